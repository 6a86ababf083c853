"""How many CPU threads this process may usefully run: the bound on every thread-count setting.

onnxruntime starts one intra-op thread per requested thread, each with its own stack, and a
spinning pool wider than the CPUs it may run on only takes time from itself; an unbounded
``--threads`` once started 14,533 threads and 16.5 GB of stacks before the first token. The
bound is the CPUs this process may run on: its CPU affinity, lowered to a cgroup v2 CPU quota
(containers). Checked where the threads are created (every onnxruntime session, so a Ray
stage actor checks against its own host) and, earlier, where a user sets the number.
"""

from __future__ import annotations

import math
import operator
import os
from pathlib import Path

from graphkiln.errors import GraphkilnError


def usable_cpus() -> int:
    """CPUs this process may run on: ``sched_getaffinity`` (``cpu_count`` where there is none),
    lowered to ``ceil(quota / period)`` under a cgroup v2 ``cpu.max`` quota; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def check_threads(threads, name: str = "threads") -> int:
    """``threads`` as the intra-op thread count to use: None means every usable CPU; anything
    but an integer in 1..usable_cpus() is one GraphkilnError line naming ``name`` and the bound."""
    limit = usable_cpus()
    if threads is None:
        return limit
    try:
        if isinstance(threads, bool):
            raise TypeError
        threads = operator.index(threads)  # ints, numpy ints; not floats or strings
    except TypeError:
        raise GraphkilnError(f"{name} must be an integer from 1 to {limit}, got {threads!r}: omit it to use every CPU") from None
    if not 1 <= threads <= limit:
        raise GraphkilnError(f"{name} {threads} is outside 1..{limit}: this process may run on {limit} CPU(s) "
                             "(its CPU affinity and cgroup quota), and more threads than CPUs only slow onnxruntime "
                             f"down; give at most {limit}, or omit it to use every CPU")
    return threads
