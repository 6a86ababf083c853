#!/usr/bin/env python
"""Decode benchmark: graphkiln artifact vs transformers ``generate`` on the same random weights.

Models (--model, default all), each ~250M parameters, vocab 32000, hidden 1024:
  llama     16 layers, 16/4 heads, intermediate 2816 (~246M)
  qwen3moe  12 layers, 16/4 heads, 8 experts top-2, expert intermediate 512 (~248M total,
            ~134M active per token); exported with --target onnxruntime (MoE lowered)
  lfm2      16 layers (10 short-conv, 6 attention), intermediate 2816, tied (~240M)
  qwen3_5   16 layers (12 gated delta net, 4 gated attention), intermediate 2816 (~270M)
  nemotron_h 23 blocks (10 Mamba-2, 10 relu2 MLP, 3 attention), intermediate 4096 (~241M)
128-token prompt, 128 greedy new tokens, 2 threads. Prints a markdown table (median of
--repeats runs) and optionally writes JSON.

--quant int4 / --quant int8 (repeatable) adds rows for weight-only quantized artifacts
(``graphkiln export --quant``, onnxruntime target) of the same checkpoint; "greedy agree"
is then against the fp32 transformers tokens (random weights: near-tied logits, so low
agreement is expected and says little), and "weights/token" is the bytes of weights read
per decoded token (the data file minus the embedding table, of which one row is read).

    .venv/bin/python scripts/bench_decode.py [--model llama] [--threads 2] [--repeats 3] [--quant int4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import statistics
import sys
import tempfile
import time
from pathlib import Path


COMMON = dict(vocab_size=32000, hidden_size=1024, num_attention_heads=16, num_key_value_heads=4,
              max_position_embeddings=2048)
MODELS = {
    "llama": ("LlamaConfig", dict(COMMON, num_hidden_layers=16, intermediate_size=2816, tie_word_embeddings=False), "portable"),
    "qwen3moe": ("Qwen3MoeConfig", dict(COMMON, num_hidden_layers=12, head_dim=64, intermediate_size=2816,
                                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512,
                                        norm_topk_prob=True, tie_word_embeddings=False), "onnxruntime"),
    "lfm2": ("Lfm2Config", dict(COMMON, num_hidden_layers=16, intermediate_size=2816, block_auto_adjust_ff_dim=False,
                                layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
                                pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True), "portable"),
    # Qwen3.5-shaped: 12 gated-delta-net layers (8 q/k heads of 64, 16 v heads of 64) and 4 gated
    # full-attention layers (8/2 heads of 128, a quarter rotated), intermediate 2816 (~270M)
    "qwen3_5": ("Qwen3_5TextConfig", dict(COMMON, num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=2,
                                          head_dim=128, intermediate_size=2816, linear_num_key_heads=8,
                                          linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
                                          tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
                "onnxruntime"),
    # Nemotron-H-shaped: Mamba-2 blocks (32 heads of 64, state 128, 8 groups) each followed by a
    # relu2 MLP block, a no-rope attention block after every third (pattern M-M-M*-...), ~241M
    "nemotron_h": ("NemotronHConfig", dict(COMMON, hybrid_override_pattern="M-M-M*-M-M-M*-M-M-M*-M-", head_dim=64,
                                           intermediate_size=4096, mamba_num_heads=32, mamba_head_dim=64,
                                           ssm_state_size=128, n_groups=8, tie_word_embeddings=False,
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   "onnxruntime"),
}


def build_checkpoint(path: Path, model: str) -> None:
    import torch
    import transformers

    config_name, kwargs, _ = MODELS[model]
    cfg = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)


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


# Runs the export in a child process and reports that process's own peak RSS.
_EXPORT = ("import resource, sys; from graphkiln.cli import main; rc = main(sys.argv[1:]); "
           "print('peak_rss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, file=sys.stderr); sys.exit(rc)")


def export(ckpt: Path, art: Path, target: str, quant: str | None) -> tuple[float | None, int | None]:
    """Export unless ``art`` exists; (seconds, peak RSS bytes) of the export, or (None, None)."""
    if (art / "manifest.json").exists():
        return None, None
    extra = ["--quant", quant] if quant else ["--target", target]
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _EXPORT, "export", str(ckpt), "-o", str(art), "--max-seq-len", "1024",
                           *extra], check=True, stderr=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stderr)
    rss = [int(l.split()[1]) for l in proc.stderr.splitlines() if l.startswith("peak_rss ")]
    return time.perf_counter() - t, rss[-1] if rss else None


def weights_per_token(art: Path) -> int:
    """Bytes of weights read per decoded token: everything but the embedding table (one row of it)."""
    from graphkiln.manifest import Manifest

    m = Manifest.read(art).model
    itemsize = 2 if m.dtype in ("fp16", "bf16") else 4
    if m.quant:  # the embedding is blocks too (GatherBlockQuantized): codes plus one fp scale per block
        itemsize = {"int4": 0.5, "int8": 1.0}[m.quant] + itemsize / (m.quant_block_size or 32)
    data = sum(f.stat().st_size for f in art.glob("*.onnx.data"))
    return int(data - m.vocab_size * m.hidden_size * itemsize)


def run_model(model: str, args, work: Path) -> dict:
    import numpy as np

    ckpt = work / model / "checkpoint"
    if not (ckpt / "config.json").exists():
        ckpt.mkdir(parents=True, exist_ok=True)
        build_checkpoint(ckpt, model)
    target = MODELS[model][2]
    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    ref = bench_transformers(ckpt, prompt, args.new_tokens, args.threads, args.repeats)
    ref_tokens = ref.pop("tokens")
    rows = []
    for quant in [None, *(args.quant or [])]:
        art = work / model / ("artifact" if quant is None else f"artifact-{quant}")
        export_s, export_rss = export(ckpt, art, target, quant)
        ours = bench_graphkiln(art, prompt, args.new_tokens, args.threads, args.repeats)
        rows.append({
            "quant": quant, "target": target if quant is None else "onnxruntime",
            "export_s": export_s, "export_peak_rss": export_rss,
            "artifact_bytes": sum(f.stat().st_size for f in art.iterdir()),
            "weights_per_token": weights_per_token(art),
            "agree": sum(a == b for a, b in zip(ours.pop("tokens"), ref_tokens)),
            "graphkiln": ours,
        })
    fp32 = rows[0]
    return {  # the fp32 row's fields at the top level, as before --quant existed
        "model": model, "target": target, "export_s": fp32["export_s"], "export_peak_rss": fp32["export_peak_rss"],
        "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
        "artifact_bytes": fp32["artifact_bytes"], "weights_per_token": fp32["weights_per_token"], "agree": fp32["agree"],
        "graphkiln": fp32["graphkiln"], "transformers": ref, "quantized": rows[1:],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--workdir", default=None, help="reuse checkpoints/artifacts here across runs")
    p.add_argument("--quant", action="append", choices=["int4", "int8"],
                   help="also benchmark a weight-only quantized artifact (repeatable)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gk-bench-"))
    results = [run_model(m, args, work) for m in (MODELS if args.model == "all" else [args.model])]
    print(f"\nprompt {args.prompt_len}, {args.new_tokens} greedy new tokens, {args.threads} threads, "
          f"median of {args.repeats}\n")
    print("| model | runtime | prefill ms | decode tok/s | vs transformers | greedy agree | weights/token |\n"
          "|---|---|---|---|---|---|---|")
    for r in results:
        ref = r["transformers"]
        print(f"| {r['model']} | transformers generate fp32 | {ref['prefill_ms']:.0f} | {ref['decode_tok_s']:.1f} | 1.00x | | "
              f"{r['weights_per_token'] / 1e9:.2f} GB |")
        for row in [r, *r["quantized"]]:
            ours = row["graphkiln"]
            kind = f"{row['quant']} weights" if row.get("quant") else "fp32"
            print(f"| {r['model']} | graphkiln {kind} ({row['target']}) | {ours['prefill_ms']:.0f} | {ours['decode_tok_s']:.1f} | "
                  f"{ours['decode_tok_s'] / ref['decode_tok_s']:.2f}x | {row['agree']}/{args.new_tokens} | "
                  f"{row['weights_per_token'] / 1e9:.2f} GB |")
    print()
    for r in results:
        for row in [r, *r["quantized"]]:
            if row["export_s"]:
                rss = row["export_peak_rss"]
                mem = (f"peak RSS {rss / 1e9:.2f} GB ({rss / r['checkpoint_bytes']:.2f}x the "
                       f"{r['checkpoint_bytes'] / 1e9:.2f} GB checkpoint)" if rss else "peak RSS unknown")
                print(f"{r['model']} {row.get('quant') or 'fp32'}: export {row['export_s']:.1f}s, {mem}, "
                      f"artifact {row['artifact_bytes'] / 1e9:.2f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
