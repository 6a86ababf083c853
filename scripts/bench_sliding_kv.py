#!/usr/bin/env python
"""KV bytes per token with window-sized sliding-layer caches, and decode speed before/after.

Bytes: the CPU runtime's ``StatePool`` for a real model's attention shapes, sized for one slot
at 4K and 32K tokens of context (``bytes_for``: the buffers ``reserve`` carves, counted without
allocating them; reserved and checked equal where they fit), as full-length rows (before: every artifact until the window inputs, the portable and
tensorrt targets) and window-sized (after: ``windowed``), and its buffers' bytes divided by the
context. Speed (``--speed``): a random sliding/full-alternating model (window 128) exported for
the onnxruntime target, decoding past ``--context`` tokens with the window-sized pool and with a
full-length one (the same graph, fed offsets 0); tokens/s over the last ``--new-tokens``.

    .venv/bin/python scripts/bench_sliding_kv.py [--speed] [--context 4096] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

# (name, layers, kv heads, head dim, window, which layers slide, dtype bytes)
SHAPES = {
    # gpt-oss-20b: 24 layers alternating sliding (128) and full, 8 kv heads of 64
    "gpt-oss-20b": (24, 8, 64, 128, lambda i: i % 2 == 0),
    # Gemma3-27B: 62 layers, 5 local (window 1024) to 1 global, 16 kv heads of 128
    "gemma3-27b": (62, 16, 128, 1024, lambda i: (i + 1) % 6 != 0),
    # Gemma3-4B: 34 layers, 5:1, 4 kv heads of 256
    "gemma3-4b": (34, 4, 256, 1024, lambda i: (i + 1) % 6 != 0),
}


def states(layers: int, heads: int, head_dim: int, window: int, slides, max_seq: int, dtype: str):
    from graphkiln.manifest import StateSpec

    sliding = tuple(i for i in range(layers) if slides(i))
    full = tuple(i for i in range(layers) if not slides(i))
    return tuple(StateSpec(kind="kv", layers=ls, num_kv_heads=heads, head_dim=head_dim, max_seq_len=max_seq,
                           dtype=dtype, sliding_window=w) for ls, w in ((sliding, window), (full, None)) if ls)


def pool_bytes(block_size: int = 32) -> list[dict]:
    import numpy as np

    from graphkiln.runtime.backends.state import StatePool

    rows = []
    for name, (layers, heads, head_dim, window, slides) in SHAPES.items():
        specs = states(layers, heads, head_dim, window, slides, 32768, "float16")
        for context in (4096, 32768):
            got = {}
            for windowed in (False, True):
                pool = StatePool(specs, np.dtype(np.float16), windowed=windowed)
                pool.attach_store(1, block_size)  # the prefix cache's block size bounds what a window keeps
                # the buffers reserve(1, context) carves, counted without allocating them (a 32K Gemma3-27B
                # pool is 15.5 GiB before); reserved and counted where they fit, to show it is the same
                got[windowed] = pool.bytes_for(1, context) / context
                if pool.bytes_for(1, context) < 2 << 30:
                    pool.reserve(1, context)
                    assert pool.nbytes == pool.bytes_for(1, context)
            rows.append({"model": name, "context": context, "before_bytes_per_token": got[False],
                         "after_bytes_per_token": got[True], "ratio": got[True] / got[False]})
    return rows


def speed(context: int, new_tokens: int, threads: int) -> dict:
    """Decode tokens/s after ``context`` tokens, window-sized pool vs full-length pool."""
    import numpy as np
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime.backends.state import StatePool

    tmp = Path(tempfile.mkdtemp(prefix="bench-sliding-", dir="/work/bench-tmp" if Path("/work/bench-tmp").is_dir() else None))
    layers = 8
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=context + 256,
                      use_sliding_window=True, sliding_window=128, max_window_layers=0,
                      layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                      tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(tmp / "ckpt")
    export_model(str(tmp / "ckpt"), tmp / "art", ExportOptions(progress=False, max_seq_len=context + new_tokens + 8,
                                                               target="onnxruntime"))
    from graphkiln.runtime.request.scheduler import Scheduler

    prompt = np.random.default_rng(0).integers(3, 4000, context).tolist()
    out = {}
    for windowed in (True, False, True):
        engine = Engine.load(tmp / "art", threads=threads, prefix_cache=False)
        if not windowed:  # the same graph over full-length rows: what every artifact ran before
            engine.pool = StatePool(engine.pool.specs, engine.pool.dtype)
        # as serve runs it: the prompt prefilled in chunks of the step budget, then decoded
        sched = Scheduler(engine, max_batch=1, step_tokens=256)
        sched.start()
        try:
            handle = sched.submit(prompt, GenerationConfig(max_new_tokens=new_tokens, temperature=0, stop_token_ids=()))
            stamps = [time.perf_counter() for _ in handle.events(timeout=600)]
        finally:
            sched.shutdown(5)
        steps = np.diff(stamps[len(stamps) // 4:])  # decode steps after the first few
        out.setdefault("windowed" if windowed else "full_length", []).append(
            {"tok_s": round(float(len(steps) / steps.sum()), 2), "pool_bytes": engine.pool.nbytes})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    result = {"pools": pool_bytes()}
    for r in result["pools"]:
        print(f"{r['model']:<12} {r['context']:>6} tokens: {r['before_bytes_per_token'] / 1024:7.1f} KiB/token before, "
              f"{r['after_bytes_per_token'] / 1024:7.1f} after ({r['ratio']:.3f}x)")
    if args.speed:
        result["speed"] = speed(args.context, args.new_tokens, args.threads)
        print(json.dumps(result["speed"], indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
