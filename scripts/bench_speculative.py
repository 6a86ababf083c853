#!/usr/bin/env python
"""Prompt-lookup (n-gram) speculative decoding on the real checkpoint (SmolLM2-135M-Instruct),
beside plain greedy decoding in the same run, in process.

Two tasks, chat-templated, greedy, up to 128 new tokens (the reply's end stops it): repeat a paragraph (the drafts come from the
prompt: summarise/edit/repeat workloads), and free chat (a story: few repeats). Decode tokens/s
after the prefill (timed alone and taken off), the acceptance rate (accepted / proposed drafts),
and a check that the tokens equal plain decoding's.

    .venv/bin/python scripts/bench_speculative.py [--work /tmp/gk-bench-spec] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoint import build  # noqa: E402

PARAGRAPH = ("The committee met on Tuesday to review the budget. It approved funding for the new library, "
             "postponed the road repairs until spring, and asked the treasurer to publish a quarterly report "
             "on spending. Members also discussed the summer festival, which will move to the riverside park.")
TASKS = {"repeat a paragraph": f"Repeat the following text exactly, word for word.\n\n{PARAGRAPH}",
         "free chat": "Write a short story about a dragon who learns to bake bread."}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-spec"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.chat import load_template

    ckpt = build(args.work / "ckpt")
    art = args.work / "fp32"
    if not (art / "manifest.json").is_file():
        export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=1024, overwrite=True))
    engine = Engine.load(art, threads=args.threads)
    template = load_template(engine)
    plain = GenerationConfig(max_new_tokens=args.new_tokens)  # to the end of the reply (or the budget)
    print(f"SmolLM2-135M fp32, {args.threads} threads, greedy, {args.new_tokens} new tokens, median of {args.repeats}")
    for task, message in TASKS.items():
        prompt = template.render([{"role": "user", "content": message}])
        engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=4))  # warm-up
        rates: dict = {}
        for _ in range(args.repeats):
            t = time.perf_counter()
            engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=1))
            prefill = time.perf_counter() - t
            for spec in (None, "ngram:4", "ngram:8"):
                config = dataclasses.replace(plain, speculative=spec)
                t = time.perf_counter()
                out = engine.generate(prompt, config)[0]
                rates.setdefault(spec, []).append((len(out.token_ids) - 1) / (time.perf_counter() - t - prefill))
                if spec is None:
                    want = out.token_ids
                assert out.token_ids == want, f"{spec}: tokens differ from plain decoding"
        acceptance = _acceptance(engine, prompt, plain)
        base = statistics.median(rates[None])
        line = ", ".join(f"{s} {statistics.median(r):.1f} tok/s ({statistics.median(r) / base:.2f}x, "
                         f"{acceptance[s]:.0%} of drafts accepted)" for s, r in rates.items() if s)
        print(f"{task:20s} plain {base:.1f} tok/s; {line}")
    return 0


def _acceptance(engine, prompt, plain) -> dict:
    """Accepted / proposed drafts of one run per setting (read off the request's speculator)."""
    from graphkiln.runtime.request.step import StepBatch

    seen = {}
    original = StepBatch._speculative_run

    def spy(self, r, draft):
        seen["speculator"] = r.speculator
        return original(self, r, draft)

    StepBatch._speculative_run = spy
    try:
        out = {}
        for spec in ("ngram:4", "ngram:8"):
            seen.clear()
            engine.generate(prompt, dataclasses.replace(plain, speculative=spec))
            out[spec] = seen["speculator"].acceptance if seen else 0.0
        return out
    finally:
        StepBatch._speculative_run = original


if __name__ == "__main__":
    raise SystemExit(main())
