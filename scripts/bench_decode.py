#!/usr/bin/env python
"""Decode benchmark: graphkiln artifact vs transformers ``generate`` on the same random weights.

Models (--model, default all), each ~250M parameters, vocab 32000, hidden 1024:
  llama     16 layers, 16/4 heads, intermediate 2816 (~246M)
  qwen3moe  12 layers, 16/4 heads, 8 experts top-2, expert intermediate 512 (~248M total,
            ~134M active per token); exported with --target onnxruntime (MoE lowered)
  lfm2      16 layers (10 short-conv, 6 attention), intermediate 2816, tied (~240M)
128-token prompt, 128 greedy new tokens, 2 threads. Prints a markdown table (median of
--repeats runs) and optionally writes JSON.

    .venv/bin/python scripts/bench_decode.py [--model llama] [--threads 2] [--repeats 3] [--json out.json]
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


def run_model(model: str, args, work: Path) -> dict:
    import numpy as np

    ckpt, art = work / model / "checkpoint", work / model / "artifact"
    if not (ckpt / "config.json").exists():
        ckpt.mkdir(parents=True, exist_ok=True)
        build_checkpoint(ckpt, model)
    target = MODELS[model][2]
    export_s = export_rss = None
    if not (art / "manifest.json").exists():
        # In a child process so its peak RSS is the export's alone (RUSAGE_CHILDREN is the
        # max over children, so run models in separate invocations to read each export's).
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(art),
                        "--max-seq-len", "1024", "--target", target], check=True)
        export_s = time.perf_counter() - t
        export_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    ours = bench_graphkiln(art, prompt, args.new_tokens, args.threads, args.repeats)
    ref = bench_transformers(ckpt, prompt, args.new_tokens, args.threads, args.repeats)
    return {
        "model": model, "target": target, "export_s": export_s, "export_peak_rss": export_rss,
        "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.glob("*.safetensors")),
        "artifact_bytes": sum(f.stat().st_size for f in art.iterdir()),
        "agree": sum(a == b for a, b in zip(ours.pop("tokens"), ref.pop("tokens"))),
        "graphkiln": ours, "transformers": ref,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--workdir", default=None, help="reuse checkpoints/artifacts here across runs")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gk-bench-"))
    results = [run_model(m, args, work) for m in (MODELS if args.model == "all" else [args.model])]
    print(f"\nprompt {args.prompt_len}, {args.new_tokens} greedy new tokens, {args.threads} threads, "
          f"median of {args.repeats}\n")
    print("| model | runtime | prefill ms | decode tok/s | vs transformers | greedy agree |\n|---|---|---|---|---|---|")
    for r in results:
        ref, ours = r["transformers"], r["graphkiln"]
        print(f"| {r['model']} | transformers generate fp32 | {ref['prefill_ms']:.0f} | {ref['decode_tok_s']:.1f} | 1.00x | |")
        print(f"| {r['model']} | graphkiln fp32 ({r['target']}) | {ours['prefill_ms']:.0f} | {ours['decode_tok_s']:.1f} | "
              f"{ours['decode_tok_s'] / ref['decode_tok_s']:.2f}x | {r['agree']}/{args.new_tokens} |")
    print()
    for r in results:
        if r["export_s"]:
            print(f"{r['model']}: export {r['export_s']:.1f}s, peak RSS {r['export_peak_rss'] / 1e9:.2f} GB "
                  f"({r['export_peak_rss'] / r['checkpoint_bytes']:.2f}x the {r['checkpoint_bytes'] / 1e9:.2f} GB checkpoint), "
                  f"artifact {r['artifact_bytes'] / 1e9:.2f} GB")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
