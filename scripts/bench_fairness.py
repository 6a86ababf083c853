#!/usr/bin/env python
"""Fairness on the real checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py), in process
through the continuous-batching Scheduler (no HTTP): issue 37's case, scaled to this machine.

One submission of --prompts prompts of ~--prompt-tokens tokens each, scored only (the server's
``echo`` with ``logprobs`` 1 and ``max_tokens`` 0: prompt log-probabilities, nothing generated),
submitted as one group as the server submits a multi-prompt completion; --delay seconds later a
16-token chat prompt asking for --new-tokens greedy tokens. Reported: the chat's time to first
token, the median and largest step (one scheduler step: plan + runs) while the big submission
runs, and the big submission's wall time. The fairness goal: the chat's first token within about
one step of its arrival.

    .venv/bin/python scripts/bench_fairness.py [--work /tmp/gk-bench-fairness] [--prompts 16]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prefix import artifact, document  # noqa: E402  (the real checkpoint, exported once)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-fairness"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=1100)
    ap.add_argument("--delay", type=float, default=3.0)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--step-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import graphkiln
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime.request.scheduler import Scheduler

    engine = Engine.load(artifact(args.work), threads=args.threads)
    ids = engine.tokenizer.encode(document(args.prompt_tokens * 6), add_special_tokens=False)
    big = [ids[i * 7: i * 7 + args.prompt_tokens] for i in range(args.prompts)]  # distinct: no prefix reuse
    chat = ids[-16:]
    scored = GenerationConfig(max_new_tokens=0, prompt_logprobs=1)
    greedy = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False)

    sched = Scheduler(engine, step_tokens=args.step_tokens)
    steps: list[float] = []
    plan = sched._batch.plan
    last = [None]

    def timed_plan(waiting):  # a step is the time from one plan to the next
        now = time.perf_counter()
        if last[0] is not None:
            steps.append(now - last[0])
        last[0] = now
        return plan(waiting)

    sched._batch.plan = timed_plan
    sched.start()
    grouped = "group" in inspect.signature(sched.submit).parameters  # older code: no groups
    try:
        t0 = time.perf_counter()
        key = object()
        handles = [sched.submit(p, scored, **({"group": key} if grouped else {})) for p in big]
        time.sleep(args.delay)
        sent = time.perf_counter()
        small = sched.submit(chat, greedy)
        first = next(iter(small.events())) and time.perf_counter() - sent
        small.result()
        for h in handles:
            h.result()
        big_wall = time.perf_counter() - t0
    finally:
        sched.shutdown(600)
    print(f"graphkiln {Path(graphkiln.__file__).parent}; {args.prompts} x {args.prompt_tokens}-token scored prompts "
          f"(one submission{'' if grouped else ': no groups in this code'}), a 16-token chat {args.delay:g} s later; "
          f"step_tokens {args.step_tokens}, threads {args.threads}")
    print(f"chat time to first token: {first:.2f} s")
    print(f"steps: {len(steps)}, median {statistics.median(steps):.2f} s, largest {max(steps):.2f} s")
    print(f"big submission wall time: {big_wall:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
