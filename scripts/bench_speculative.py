#!/usr/bin/env python
"""Speculative decoding on the real checkpoint (SmolLM2-135M-Instruct, fp32), beside plain
decoding in the same run, in process: prompt-lookup (n-gram) drafts, and drafts of the same
checkpoint's int4 export (``--speculative draft``).

Two tasks, chat-templated, up to 128 new tokens (the reply's end stops it): repeat a paragraph
(the drafts come from the prompt: summarise/edit/repeat workloads), and free chat (a story: few
repeats). Decode tokens/s after the prefill (timed alone and taken off), the acceptance rate
(accepted / proposed drafts), and, greedy, a check that the tokens equal plain decoding's.
``--sample T``: sampled at temperature T instead (seed per repeat; no equality to check).
``--batch N``: N copies of the prompt at once (several rows speculating, each verified apart).
``--force-draft``: the draft model proposes whatever its cost (``DraftModel.cost`` set to 0),
to see what its drafts would give where the engine declines them.

    .venv/bin/python scripts/bench_speculative.py [--work /tmp/gk-bench-spec] [--threads 2]
        [--settings ngram:4,ngram:8,draft:3,draft:5] [--sample 0.7] [--batch 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint  # noqa: E402

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
    ap.add_argument("--settings", default="ngram:4,ngram:8,draft:3,draft:5")
    ap.add_argument("--sample", type=float, default=None, metavar="T")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--force-draft", action="store_true")
    args = ap.parse_args()
    settings = args.settings.split(",")
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.chat import load_template

    ckpt = real_checkpoint(args.work)
    art = exported(ckpt, args.work / "fp32", max_seq_len=1024, overwrite=True)
    draft = args.work / "int4"  # the same checkpoint's int4 export drafts for the fp32 one
    if any(s.startswith("draft") for s in settings):
        exported(ckpt, draft, max_seq_len=1024, overwrite=True, quant="int4")
    engine = Engine.load(art, threads=args.threads, draft=draft if draft.is_dir() else None)
    if engine.draft is not None:
        print(f"draft step cost, measured at load: {engine.draft.cost:.2f} of the target's"
              + ("; forced to 0" if args.force_draft else ""))
        if args.force_draft:
            engine.draft.cost = 0.0
    template = load_template(engine)
    plain = GenerationConfig(max_new_tokens=args.new_tokens)  # to the end of the reply (or the budget)
    if args.sample is not None:
        plain = dataclasses.replace(plain, do_sample=True, temperature=args.sample, top_p=1.0, top_k=0)
    mode = "greedy" if args.sample is None else f"sampled at temperature {args.sample}"
    print(f"SmolLM2-135M fp32 (draft: its int4 export), {args.threads} threads, {mode}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    for task, message in TASKS.items():
        prompt = [template.render([{"role": "user", "content": message}])] * args.batch
        engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=4))  # warm-up
        rates: dict = {}
        for repeat in range(args.repeats):
            t = time.perf_counter()
            engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=1))
            prefill = time.perf_counter() - t
            for spec in (None, *settings):
                config = dataclasses.replace(plain, speculative=spec, seed=repeat)
                t = time.perf_counter()
                outs = engine.generate(prompt, config)
                tokens = sum(len(o.token_ids) - 1 for o in outs)
                rates.setdefault(spec, []).append(tokens / (time.perf_counter() - t - prefill))
                if spec is None:
                    want = [o.token_ids for o in outs]
                assert args.sample is not None or [o.token_ids for o in outs] == want, f"{spec}: tokens differ"
        acceptance = _acceptance(engine, prompt, plain, settings)
        base = statistics.median(rates[None])
        line = ", ".join(f"{s} {statistics.median(r):.1f} tok/s ({statistics.median(r) / base:.2f}x, "
                         f"{acceptance[s]:.0%} of drafts accepted)" for s, r in rates.items() if s)
        print(f"{task:20s} plain {base:.1f} tok/s; {line}")
    return 0


def _acceptance(engine, prompt, plain, settings) -> dict:
    """Accepted / proposed drafts of one run per setting (read off the requests' speculators)."""
    from graphkiln.runtime.request.step import StepBatch

    seen = {}
    original = StepBatch._speculative_run

    def spy(self, r, proposal):
        seen[id(r)] = r.speculator
        return original(self, r, proposal)

    StepBatch._speculative_run = spy
    try:
        out = {}
        for spec in settings:
            seen.clear()
            engine.generate(prompt, dataclasses.replace(plain, speculative=spec))
            proposed = sum(s.proposed for s in seen.values())
            out[spec] = sum(s.accepted for s in seen.values()) / proposed if proposed else 0.0
        return out
    finally:
        StepBatch._speculative_run = original


if __name__ == "__main__":
    raise SystemExit(main())
