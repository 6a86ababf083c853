"""How much memory this process can still allocate: read by export (rotary tables) and the
runtime (state pools) before they allocate, so an oversized request is one error line instead
of a MemoryError or the OOM killer."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory() -> int | None:
    """Bytes this process can still allocate without swapping or being OOM-killed, or None if
    unknown: the kernel's MemAvailable (sysconf's free pages if there is no /proc/meminfo),
    lowered to what is left under a cgroup v2 memory limit (containers)."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            # inactive page cache counts as used but is reclaimed before the OOM killer acts
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            for line in Path("/sys/fs/cgroup/memory.stat").read_text().splitlines():
                if line.startswith("inactive_file "):
                    used -= int(line.split()[1])
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available
