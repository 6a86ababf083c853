"""What the benchmarks on the real checkpoint share: the checkpoint built and exported once per
work directory, and a generate call timed with its prefill taken off.

``exported(ckpt, art, **options)`` writes an artifact only when ``art`` has no manifest yet, so a
rerun of a benchmark measures and does not export; ``real_checkpoint(work)`` is SmolLM2-135M-
Instruct (scripts/real_checkpoint.py) under ``work``; ``timed_generate`` is the decode rate every
benchmark reports: one generate call of one token first (the prefill alone), then the real call,
the first timed off the second.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_checkpoint import build  # noqa: E402


def real_checkpoint(work: Path, name: str = "ckpt") -> Path:
    """SmolLM2-135M-Instruct as a transformers checkpoint at ``work / name`` (built once)."""
    return build(Path(work) / name)


def exported(ckpt: Path, art: Path, **options) -> Path:
    """``art``: ``ckpt`` exported with ``ExportOptions(progress=False, **options)``, unless an
    artifact is there already."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    if not (Path(art) / "manifest.json").is_file():
        export_model(str(ckpt), art, ExportOptions(progress=False, **options))
    return Path(art)


def timed_generate(engine, prompts, config):
    """(decode tokens/s, outputs) of ``engine.generate(prompts, config)``: the prefill (the same
    call for one token) timed alone and taken off; each request's first token is the prefill's."""
    t = time.perf_counter()
    engine.generate(prompts, dataclasses.replace(config, max_new_tokens=1))
    prefill = time.perf_counter() - t
    t = time.perf_counter()
    out = engine.generate(prompts, config)
    total = time.perf_counter() - t
    return (sum(len(o.token_ids) for o in out) - len(prompts)) / (total - prefill), out


def scheduled_rate(engine, prompts, configs) -> float:
    """Generated tokens/s of ``prompts`` (request i with ``configs[i]``) run together through a
    ``Scheduler`` of one batch, from its start to the last result."""
    from graphkiln.runtime.request.scheduler import Scheduler

    sched = Scheduler(engine, max_batch=len(prompts))
    handles = [sched.submit(p, c) for p, c in zip(prompts, configs)]
    t = time.perf_counter()
    sched.start()
    tokens = sum(len(h.result(timeout=600).token_ids) for h in handles)
    elapsed = time.perf_counter() - t
    sched.shutdown(10)
    return tokens / elapsed
