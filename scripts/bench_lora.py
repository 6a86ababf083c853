#!/usr/bin/env python
"""Multi-LoRA cost on the real checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py), in process.

1. No adapter active: decode tok/s (batch 1 and batch 4, greedy) of an artifact exported with
   ``--lora-rank R --max-loras 4`` (every projection; and q, v only) beside the same checkpoint
   exported without LoRA, fp32 and int4, runs interleaved so both see the same machine state.
2. Mixed adapters: 4 requests, each on its own adapter, through one continuous-batching Scheduler
   (all admitted at the first step, so every step mixes 4 adapters), beside the same 4 requests all
   on one adapter: aggregate generated tokens/s.
3. Adapter load time: ``Engine.load_adapter`` of a rank-R PEFT directory (read, validate, write
   its slot), median of repeated unload/load.

Adapters are random PEFT LoRA adapters (``init_lora_weights=False``) on every projection.

    .venv/bin/python scripts/bench_lora.py [--work /tmp/gk-bench-lora] [--threads 2] [--rank 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint, scheduled_rate, timed_generate  # noqa: E402

MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(ckpt: Path, work: Path, rank: int, n: int) -> dict[str, Path]:
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out = {}
    for i in range(n):
        path = work / f"adapter{i}-r{rank}"
        if not (path / "adapter_model.safetensors").is_file():
            torch.manual_seed(i)
            model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
            model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=MODULES,
                                                               init_lora_weights=False))
            model.save_pretrained(str(path))
        out[f"a{i}"] = path
    return out


def export(ckpt: Path, art: Path, quant: str | None, rank: int | None, targets: str | None = None) -> Path:
    return exported(ckpt, art, max_seq_len=1024, quant=quant, lora_rank=rank, lora_targets=targets, max_loras=4,
                    overwrite=True)


def decode_rate(engine, prompts, new: int, adapter=None) -> float:
    """Generated tokens/s of one batch after its prefill (the prefill timed alone and taken off)."""
    from graphkiln.runtime import GenerationConfig

    config = GenerationConfig(max_new_tokens=new, stop_token_ids=(), adapter=adapter)
    rate, out = timed_generate(engine, prompts, config)
    assert all(len(o.token_ids) == new for o in out)
    return rate


def adapter_rate(engine, prompts, names, new: int) -> float:
    """Tokens/s of the prompts through the scheduler together, request i with adapter names[i]."""
    from graphkiln.runtime import GenerationConfig

    return scheduled_rate(engine, prompts, [GenerationConfig(max_new_tokens=new, stop_token_ids=(), adapter=n)
                                            for n in names])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-lora"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.runtime import Engine

    ckpt = real_checkpoint(args.work)
    paths = adapters(ckpt, args.work, args.rank, 4)
    rng = __import__("numpy").random.default_rng(0)
    prompts = [rng.integers(100, 40000, 32).tolist() for _ in range(4)]
    print(f"SmolLM2-135M, rank {args.rank} on {', '.join(MODULES)}, --max-loras 4, {args.threads} threads, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")

    # (quantization, --lora-targets): every projection, and PEFT's default for Llama-style models (q, v)
    for quant, targets in ((None, None), (None, "q,v"), ("int4", None)):
        tag = quant or "fp32"
        plain = Engine.load(export(ckpt, args.work / f"plain-{tag}", quant, None), threads=args.threads)
        name = f"lora{args.rank}-{tag}" + (f"-{targets.replace(',', '')}" if targets else "")
        lora = Engine.load(export(ckpt, args.work / name, quant, args.rank, targets), threads=args.threads)
        tag += f", targets {targets or 'all'}"
        for batch in (1, 4):
            rates = {"plain": [], "lora": []}
            for engine in (plain, lora):
                decode_rate(engine, prompts[:batch], 4)  # warm-up
            for _ in range(args.repeats):
                rates["plain"].append(decode_rate(plain, prompts[:batch], args.new_tokens))
                rates["lora"].append(decode_rate(lora, prompts[:batch], args.new_tokens))
            p, q = statistics.median(rates["plain"]), statistics.median(rates["lora"])
            print(f"{tag} batch {batch}: no adapter active: plain {p:.1f} tok/s, LoRA-capable {q:.1f} tok/s "
                  f"({q / p:.3f}x)")
        if quant is None and targets is None:
            t_load = []
            for i in range(args.repeats + 1):
                t = time.perf_counter()
                lora.load_adapter("timed", paths["a0"])
                t_load.append(time.perf_counter() - t)
                lora.unload_adapter("timed")
            size = sum(f.stat().st_size for f in paths["a0"].iterdir()) / 1e6
            print(f"adapter load ({size:.1f} MB safetensors): median {statistics.median(t_load[1:]) * 1000:.1f} ms")
            for name, path in paths.items():
                lora.load_adapter(name, path)
            one, mixed = [], []
            adapter_rate(lora, prompts, list(paths), 4)  # warm-up
            for _ in range(args.repeats):
                one.append(adapter_rate(lora, prompts, ["a0"] * 4, args.new_tokens))
                mixed.append(adapter_rate(lora, prompts, list(paths), args.new_tokens))
            o, m = statistics.median(one), statistics.median(mixed)
            print(f"4 requests, Scheduler: all on one adapter {o:.1f} tok/s, each on its own {m:.1f} tok/s ({m / o:.3f}x)")
        del plain, lora
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
