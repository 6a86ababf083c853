#!/usr/bin/env python
"""Quantized artifacts side by side: perplexity, bytes per token, decode speed, resident memory.

    .venv/bin/python scripts/bench_quant.py ART [ART ...] [--peer DIR --peer-python PY] [--rounds 3]

Each graphkiln artifact (and, with --peer, an onnxruntime-genai model directory run by PY, a Python
with onnxruntime_genai) is measured in a fresh child process per round, the rows alternating
within a round: perplexity on graphkiln's built-in prose (graphkiln.perplexity; the peer's model is
scored on the same token windows through a plain onnxruntime session over its model.onnx with
an empty cache), weight bytes read per decoded token (every MatMulNBits/MatMul weight and its
scales and zero points, plus one embedding row), decode tokens/s after a 128-token prompt over
128 greedy tokens ((new - 1) / (total - time to first token)), and the child's peak RSS (model
load and generation). Median over rounds. 2 threads unless --threads.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, resource, sys, time
kind, path, threads, prompt_len, new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
out = {}
if kind == "graphkiln":
    from graphkiln.perplexity import artifact_perplexity, read_text
    from graphkiln.runtime import Engine, GenerationConfig
    engine = Engine.load(path, threads=threads)
    ppl = artifact_perplexity(engine, read_text(None))
    out["ppl"] = ppl.value
    text_ids = engine.tokenizer.encode(read_text(None))
    prompt = text_ids[:prompt_len]
    def run():
        t0 = time.perf_counter(); stamps = []
        for ev in engine.stream(prompt, GenerationConfig(max_new_tokens=new, stop_token_ids=(), do_sample=False)):
            stamps.append(time.perf_counter())
        return stamps[0] - t0, time.perf_counter() - t0
else:
    import numpy as np, onnxruntime as ort, onnxruntime_genai as og
    from tokenizers import Tokenizer
    sys.path.insert(0, sys.argv[6])
    from graphkiln.perplexity import read_text, windows  # numpy-only modules
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    text_ids = tok.encode(read_text(None)).ids
    cfg = json.load(open(f"{path}/genai_config.json"))["model"]
    so = ort.SessionOptions(); so.intra_op_num_threads = threads
    sess = ort.InferenceSession(f"{path}/{cfg['decoder']['filename']}", so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    layers, kv, hd = cfg["decoder"]["num_hidden_layers"], cfg["decoder"]["num_key_value_heads"], cfg["decoder"]["head_size"]
    nll = count = 0.0
    for part in windows(text_ids, 512, cfg["context_length"]):
        n = len(part); feed = {"input_ids": np.array([part], np.int64), "attention_mask": np.ones((1, n), np.int64)}
        if "position_ids" in names: feed["position_ids"] = np.arange(n, dtype=np.int64)[None]
        for name in names:
            if name.startswith("past_key_values"): feed[name] = np.zeros((1, kv, 0, hd), np.float32)
        logits = sess.run(["logits"], feed)[0][0].astype(np.float64)
        logits -= logits.max(-1, keepdims=True); logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        nll -= logp[np.arange(n - 1), part[1:]].sum(); count += n - 1
    out["ppl"] = float(np.exp(nll / count)); del sess
    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)
    prompt = text_ids[:prompt_len]
    def run():
        t0 = time.perf_counter()
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new, min_length=len(prompt) + new, do_sample=False, batch_size=1)
        gen = og.Generator(model, params); gen.append_tokens([prompt]); gen.generate_next_token()
        first = time.perf_counter() - t0
        for _ in range(new - 1): gen.generate_next_token()
        return first, time.perf_counter() - t0
run()  # warm-up
first, total = run()
out["decode_tok_s"] = (new - 1) / (total - first)
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print("RESULT " + json.dumps(out))
'''


def weight_bytes_per_token(model_path: Path) -> float:
    """Bytes of weights one decoded token reads: every initializer a MatMul-like node reads whole,
    one row of each gathered table (embeddings, rotary tables)."""
    import onnx
    from onnx import helper

    model = onnx.load(str(model_path), load_external_data=False)
    sizes = {}
    for t in model.graph.initializer:
        item = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
        count = 1
        for d in t.dims:
            count *= d
        sizes[t.name] = (count * item, t.dims[0] if t.dims else 1)
    producers = {o: n for n in model.graph.node for o in n.output}
    gathered, whole = set(), set()
    for n in model.graph.node:
        if n.op_type in ("MatMul", "MatMulNBits", "Gemm", "Transpose"):  # (a tied float head: MatMul(Transpose(W)))
            whole.update(n.input[1:])
        if n.op_type in ("Gather", "GatherBlockQuantized"):
            data = n.input[0]
            while data in producers and producers[data].op_type == "Reshape":
                data = producers[data].input[0]
            gathered.update({data} | set(n.input[2:]))
    total = 0.0
    for name, (nbytes, rows) in sizes.items():
        total += nbytes / rows if name in gathered and name not in whole else nbytes  # a tied head reads all
    return total


def measure(kind: str, path: Path, py: str, args) -> dict:
    cmd = [py, "-c", CHILD, kind, str(path), str(args.threads), str(args.prompt_len), str(args.new_tokens),
           str(Path(__file__).resolve().parents[1])]
    got = subprocess.run(cmd, capture_output=True, text=True)
    line = next((l for l in got.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"{path}: {got.stderr.strip().splitlines()[-1:]}")
    return json.loads(line[7:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--peer", type=Path, default=None, help="an onnxruntime-genai model directory")
    p.add_argument("--peer-python", default=None, help="a Python with onnxruntime_genai (the peer's venv)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    args = p.parse_args()
    rows = [("graphkiln", a, sys.executable) for a in args.artifacts]
    if args.peer is not None:
        rows.append(("peer", args.peer, args.peer_python or sys.executable))
    results: dict = {str(r[1]): [] for r in rows}
    for k in range(args.rounds):
        for kind, path, py in (rows if k % 2 == 0 else rows[::-1]):
            results[str(path)].append(measure(kind, path, py, args))
    print("| artifact | perplexity | weight bytes/token | decode tok/s (median, best) | peak RSS MB |")
    print("|---|---|---|---|---|")
    for kind, path, _ in rows:
        runs = results[str(path)]
        model = path / ("decoder.onnx" if kind == "graphkiln" else "model.onnx")
        speeds = [r["decode_tok_s"] for r in runs]
        print(f"| {kind} {path.name} | {runs[0]['ppl']:.3f} | {weight_bytes_per_token(model) / 1e6:.1f} MB | "
              f"{statistics.median(speeds):.1f} ({max(speeds):.1f}) | {statistics.median(r['rss_mb'] for r in runs):.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
