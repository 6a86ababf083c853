#!/usr/bin/env python
"""Structured-output cost on the real checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py).

Decode tokens/s after the prefill (timed alone and taken off), greedy, same prompt:
1. one request constrained by a JSON schema whose output runs long (an array of 8 objects),
   beside the same request unconstrained for as many tokens (end-of-text ignored);
2. the same with regex and with a small Lark grammar;
3. a batch of 4 through one Scheduler step loop: 2 constrained + 2 free, beside 4 free.
Also the time to compile the schema (the first request pays it; it is cached per engine).

    .venv/bin/python scripts/bench_structured.py [--work /tmp/gk-bench-structured] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint, scheduled_rate, timed_generate  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 8, "maxItems": 8, "items": {
        "type": "object", "additionalProperties": False, "required": ["name", "qty", "fragile"],
        "properties": {"name": {"type": "string", "maxLength": 24}, "qty": {"type": "integer", "minimum": 0},
                       "fragile": {"type": "boolean"}}}}}}
PROMPT = "List eight items for a moving box inventory as JSON:"


def timed(engine, config, prompts):
    """(decode tokens/s, tokens per request, outputs) of one generate call, its prefill taken off."""
    rate, out = timed_generate(engine, prompts, config)
    return rate, [len(o.token_ids) for o in out], out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-structured"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.runtime import Engine, GenerationConfig

    art = exported(real_checkpoint(args.work), args.work / "fp32", max_seq_len=1024, overwrite=True)
    engine = Engine.load(art, threads=args.threads)
    t = time.perf_counter()
    engine.prep.resolve(GenerationConfig(json_schema=SCHEMA))
    print(f"SmolLM2-135M fp32, {args.threads} threads; schema compiled in {(time.perf_counter() - t) * 1e3:.0f} ms")

    cases = [("json_schema", dict(json_schema=SCHEMA), 400),
             ("regex", dict(regex=r"([a-z]{3,8} ){20}[a-z]+\."), 400),
             ("lark", dict(grammar='start: item (", " item)*\nitem: /[a-z]{2,10}/ " = " /[0-9]{1,4}/'), 96)]
    for name, kw, budget in cases:
        constrained, free, lengths = [], [], None
        timed(engine, GenerationConfig(max_new_tokens=budget, **kw), [PROMPT])  # warm-up
        for _ in range(args.repeats):
            rate, lengths, out = timed(engine, GenerationConfig(max_new_tokens=budget, **kw), [PROMPT])
            constrained.append(rate)
            free.append(timed(engine, GenerationConfig(max_new_tokens=lengths[0], stop_token_ids=()), [PROMPT])[0])
        if name == "json_schema":
            json.loads(out[0].text)  # it is JSON
        c, f = statistics.median(constrained), statistics.median(free)
        print(f"{name:12s} {lengths[0]:4d} tokens: constrained {c:.1f} tok/s, free {f:.1f} tok/s "
              f"({c / f:.3f}x, {(f / c - 1) * 100:.1f}% per token)")

    mixed, free = [], []
    prompts = [PROMPT] * 4

    def batch(configs) -> float:
        return scheduled_rate(engine, prompts, configs)

    for _ in range(args.repeats):
        mixed.append(batch([GenerationConfig(max_new_tokens=120, json_schema=SCHEMA)] * 2
                           + [GenerationConfig(max_new_tokens=120, stop_token_ids=())] * 2))
        free.append(batch([GenerationConfig(max_new_tokens=120, stop_token_ids=())] * 4))
    m, f = statistics.median(mixed), statistics.median(free)
    print(f"batch of 4 (prefill included): 2 json_schema + 2 free {m:.1f} tok/s, 4 free {f:.1f} tok/s ({m / f:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
