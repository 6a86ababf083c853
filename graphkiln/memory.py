"""How much memory this process can still allocate: read by export (rotary tables) and the
runtime (state pools) before they allocate, so an oversized request is one error line instead
of a MemoryError or the OOM killer. And what of an artifact's files this process keeps mapped
and resident (``file_mappings``, ``release_file_pages``: the runtime's CPU sessions)."""

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


def file_mappings(directory) -> list[dict[str, int]]:
    """This process's memory mappings of files under ``directory``: each one's ``start`` and ``end``
    address and its ``Rss`` and ``Anonymous`` bytes (Linux, /proc/self/smaps); [] elsewhere or
    where it cannot be read."""
    import sys

    if not sys.platform.startswith("linux"):
        return []
    try:
        prefix = str(Path(directory).resolve()) + "/"
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    regions: list[dict[str, int]] = []
    current = None
    for line in text.splitlines():
        fields = line.split(None, 5)
        if len(fields) >= 5 and "-" in fields[0] and ":" not in fields[0]:  # a mapping's first line
            current = None
            if len(fields) == 6 and fields[5].startswith(prefix):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                current = {"start": start, "end": end}
                regions.append(current)
        elif current is not None and fields and fields[0] in ("Rss:", "Anonymous:"):
            current[fields[0][:-1]] = int(fields[1]) * 1024
    return regions


def release_file_pages(mappings) -> int:
    """Drop the resident pages of ``mappings`` (``file_mappings`` entries) from this process
    (``madvise(MADV_DONTNEED)``); returns the bytes that were resident. Only mappings with
    resident pages and no anonymous one (a private mapping's page written to: the file no longer
    holds its bytes) are touched, and for those nothing is lost: page-cache pages are unmapped,
    and a later read faults the same bytes back, as after the kernel reclaimed them under memory
    pressure. The caller must know that each mapping stays mapped meanwhile (a live object of its
    own holds it): unmapped and reused, the address could hold other memory. Linux only;
    elsewhere 0.

    For onnxruntime's mappings of an artifact's external data (``runtime.backends.ort_cpu``): it
    maps each initializer and reads it while building a session, and the pages of those it keeps
    mapped stay resident, though it runs from its own pre-packed copies (MatMulNBits keeps its
    block scales mapped after packing them: 0.2x the int4 weights' bytes;
    scripts/bench_load_scale.py)."""
    import ctypes
    import mmap

    mappings = [m for m in mappings if m.get("Rss", 0) and not m.get("Anonymous", 0)]
    if not mappings or not hasattr(mmap, "MADV_DONTNEED"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    released = 0
    for m in mappings:
        if libc.madvise(m["start"], m["end"] - m["start"], mmap.MADV_DONTNEED) == 0:
            released += m["Rss"]
    return released


def _libc():
    import ctypes
    import ctypes.util

    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def one_heap() -> None:
    """Make every thread allocate from glibc's one main heap (``mallopt(M_ARENA_MAX, 1)``) instead
    of a heap per thread. The streamed export frees and reallocates its row bands and quantizer
    scratch (4-16 MiB each) per weight from several threads; in per-thread heaps those holes
    fragment, and the export's peak RSS varied by up to 107 MiB from run to run on a 16-layer
    model (3 of its layers: the peak must not depend on the layer count). With one heap: within
    26 MiB, and no slower (the threads allocate rarely; a fixed mmap threshold did as well for
    memory but cost 10% of the export's time in page faults). Process-wide, and it binds only
    threads that have not allocated yet; a no-op without glibc."""
    import ctypes

    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(-8, 1)  # M_ARENA_MAX


def trim_heap() -> None:
    """Hand the C heap's free memory back to the system (glibc's ``malloc_trim``): building a
    session, or deriving weights at load, frees large temporaries that glibc otherwise keeps
    (measured: 0.03 GiB after a 1.5B int4 Llama's session, 0.15 GiB after a 0.3B one's batched
    int8 weights). A no-op without glibc."""
    import ctypes

    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


def require_memory(needed: int, what: str, remedy: str) -> None:
    """Refuse in one line when ``needed`` bytes (``what`` would allocate them: "loading this
    artifact", "--max-loras 64 adapter stacks") exceed the memory available now (cgroup limits
    included), naming both figures and ``remedy`` (the flag that lowers the figure). Called before
    the allocation, so the answer is an error line and never the OOM killer's exit 137. Unknown
    availability (no /proc, no sysconf) lets the allocation go ahead."""
    from graphkiln.errors import GraphkilnError

    available = available_memory()
    if available is not None and needed > available:
        gib = 2 ** 30
        raise GraphkilnError(f"{what} needs about {needed / gib:.2f} GiB of memory but {available / gib:.2f} GiB is "
                             f"available: {remedy}, or close other programs")
