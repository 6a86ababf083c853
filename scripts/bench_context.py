#!/usr/bin/env python
"""Decode step time against context length, for one artifact (graphkiln runtime, batch 1).

A decode step reads every weight once (constant per step) plus the KV cache of every
attention layer (growing with the position). This prints the median step time in windows
of positions, so the per-position cost of attention can be read off the slope:

    .venv/bin/python scripts/bench_context.py ARTIFACT [--new-tokens 1024] [--window 128] [--threads 2]

onnxruntime's CPU GroupQueryAttention (the onnxruntime target's attention) multiplies each
query head by its KV head separately, re-packing that head's keys and values for each of the
query heads that share it; the slope therefore scales with the number of query heads, not KV
heads (see README, Benchmark).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--new-tokens", type=int, default=1024)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2, help="generations; the median per window is shown")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from graphkiln.runtime import Engine, GenerationConfig

    engine = Engine.load(args.artifact, threads=args.threads)
    if args.new_tokens + 4 > engine.max_seq_len:
        print(f"error: --new-tokens {args.new_tokens} exceeds the artifact's max_seq_len {engine.max_seq_len} "
              "minus the 4-token prompt: lower it", file=sys.stderr)
        return 2
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, stop_token_ids=(), do_sample=False)
    prompt = [5, 6, 7, 8]
    runs = []
    for _ in range(args.repeats):
        marks = [time.perf_counter() for _ in engine.stream(prompt, cfg)]
        runs.append([b - a for a, b in zip(marks, marks[1:])])  # step k decodes at position len(prompt) + k
    rows = []
    for start in range(0, args.new_tokens - 1, args.window):
        per_run = [statistics.median(r[start:start + args.window]) for r in runs]
        rows.append({"positions": [len(prompt) + start, len(prompt) + min(start + args.window, args.new_tokens - 1)],
                     "step_ms": statistics.median(per_run) * 1e3})
    base = rows[0]["step_ms"]
    print(f"| positions | step ms | tok/s | vs first window |\n|---|---|---|---|")
    for r in rows:
        lo, hi = r["positions"]
        print(f"| {lo}-{hi} | {r['step_ms']:.2f} | {1e3 / r['step_ms']:.1f} | +{r['step_ms'] - base:.2f} ms |")
    mid = [(sum(r["positions"]) / 2, r["step_ms"]) for r in rows]
    if len(mid) > 1:
        (x0, y0), (x1, y1) = mid[0], mid[-1]
        print(f"\nslope: {(y1 - y0) / (x1 - x0) * 1e3:.2f} µs per position of context per step")
    if args.json:
        args.json.write_text(json.dumps({"artifact": str(args.artifact), "threads": args.threads, "windows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
