#!/usr/bin/env python
"""Decode benchmark: graphkiln artifact vs transformers ``generate`` on the same random weights.

Default model: Llama-shaped, ~246M parameters (hidden 1024, 16 layers, 16/4 heads,
intermediate 2816, vocab 32000). 128-token prompt, 128 greedy new tokens, 2 threads.
Prints a markdown table (median of --repeats runs) and optionally writes JSON.

    .venv/bin/python scripts/bench_decode.py [--threads 2] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path


def build_checkpoint(path: Path, args) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=32000, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=4,
                      max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def bench_graphkiln(artifact: Path, prompt: list[int], new: int, threads: int, repeats: int) -> dict:
    from graphkiln.runtime import Engine, GenerationConfig

    engine = Engine.load(artifact, threads=threads)
    engine.generate(prompt, GenerationConfig(max_new_tokens=4, stop_token_ids=()))  # warm-up
    prefill, decode = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.generate(prompt, GenerationConfig(max_new_tokens=1, stop_token_ids=()))
        t_prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = engine.generate(prompt, GenerationConfig(max_new_tokens=new, stop_token_ids=()))[0]
        total = time.perf_counter() - t
        assert len(out.token_ids) == new
        prefill.append(t_prefill * 1000)
        decode.append((new - 1) / (total - t_prefill))
    return {"prefill_ms": statistics.median(prefill), "decode_tok_s": statistics.median(decode), "tokens": out.token_ids}


def bench_transformers(ckpt: Path, prompt: list[int], new: int, threads: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        prefill, decode = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
            t_prefill = time.perf_counter() - t
            t = time.perf_counter()
            out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            total = time.perf_counter() - t
            prefill.append(t_prefill * 1000)
            decode.append((new - 1) / (total - t_prefill))
    return {"prefill_ms": statistics.median(prefill), "decode_tok_s": statistics.median(decode),
            "tokens": out[0, len(prompt):].tolist()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--workdir", default=None, help="reuse checkpoint/artifact here across runs")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    import numpy as np

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gk-bench-"))
    ckpt, art = work / "checkpoint", work / "artifact-fp32"
    if not (ckpt / "config.json").exists():
        ckpt.mkdir(parents=True, exist_ok=True)
        build_checkpoint(ckpt, args)
    export_s = export_rss = None
    if not (art / "manifest.json").exists():
        # In a child process so its peak RSS is the export's alone.
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(art),
                        "--max-seq-len", "1024"], check=True)
        export_s = time.perf_counter() - t
        export_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    prompt = np.random.default_rng(0).integers(0, 32000, args.prompt_len).tolist()

    ours = bench_graphkiln(art, prompt, args.new_tokens, args.threads, args.repeats)
    ref = bench_transformers(ckpt, prompt, args.new_tokens, args.threads, args.repeats)
    agree = sum(a == b for a, b in zip(ours["tokens"], ref["tokens"]))
    weight_bytes = sum(f.stat().st_size for f in art.glob("*.data"))
    rows = [("transformers generate fp32", ref), ("graphkiln fp32 (onnxruntime CPU)", ours)]
    print(f"\nLlama-shaped {weight_bytes / 4e6:.0f}M params, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"{args.threads} threads, median of {args.repeats}")
    if export_s:
        ckpt_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        print(f"export {export_s:.1f}s, peak RSS {export_rss / 1e9:.2f} GB = {export_rss / ckpt_bytes:.2f}x the "
              f"{ckpt_bytes / 1e9:.2f} GB checkpoint")
    print("\n| runtime | prefill ms | decode tok/s | vs transformers |\n|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['prefill_ms']:.0f} | {r['decode_tok_s']:.1f} | {r['decode_tok_s'] / ref['decode_tok_s']:.2f}x |")
    print(f"\ngreedy tokens identical: {agree}/{args.new_tokens}; weights {weight_bytes / 1e9:.2f} GB read per decode step "
          f"-> {weight_bytes * ours['decode_tok_s'] / 1e9:.1f} GB/s effective")
    if args.json:
        Path(args.json).write_text(json.dumps({"export_s": export_s, "export_peak_rss": export_rss, "graphkiln": {k: v for k, v in ours.items() if k != "tokens"},
                                               "transformers": {k: v for k, v in ref.items() if k != "tokens"}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
