"""Backend-independent CUDA-graph bookkeeping for decode steps: buckets, padding, graph keys,
the captured-graph cache with its fallback rule, and warm-up probe slots.

Nothing here imports a GPU library; the TensorRT runner (``runtime.backends.trt_runner``) and the
onnxruntime CUDA runner (``runtime.backends.ort_cuda``) own the handles and the CUDA calls.

Why buckets. A captured CUDA graph replays fixed kernels over fixed shapes and fixed device
addresses, so one graph serves one batch size. Rather than one graph per size (TensorRT
Edge-LLM captures every size 1..max), decode batches are padded up to a bucket and one graph
is captured per bucket: ``1, 2, 4, 8, ...`` doubling, then ``max_batch`` itself, which is
TensorRT-LLM's padded ``CudaGraphConfig`` list (``[1, 2, 4] + [8, 16, ...]``) capped at the
engine's maximum batch. Cost: up to ``2x`` the rows of a batch in the worst case, at
``log2(max_batch) + 1`` graphs; a decode step is bound by reading the weights, which padding
rows do not add to.

Padding rows and the state pool (``runtime.backends.state``'s contract, which the device pools keep):
live slots are packed ``0..live-1`` and slots ``live..bucket-1`` are free, so a padding row
may read and write the state rows of its slot: a slot's conv rows are zeroed when it is
claimed, and its KV rows are written before they are read. A padding row holds token
``PAD_ID`` at position 0 with length 1 (it reads no cache position, writes cache row 0 of a
free slot), and its logits are discarded. Every bucket must fit the pool's slots (the pool is
sized to ``max_batch``, the largest bucket).

Lifecycle of a graph (trt-notes §4, trtexec's pattern): at warm-up, per bucket, the runner
claims ``bucket`` probe slots (``probe_slots``), binds the bucket's shapes and addresses,
enqueues once eagerly (initialisation work must not be captured), synchronises, captures one
enqueue and instantiates it, then releases the probe slots, so the pool is empty when serving
starts (MAX's ``release_warmup_state``). While serving, a decode step looks its ``GraphKey``
up in the ``GraphCache``: replay when captured, else plain enqueue (a shape never captured,
or whose capture failed). A change of any bound address gives another key, so a stale graph
is never replayed; ``GraphCache.clear`` frees the handles when the buffers are replaced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from graphkiln.runtime.backends.state import PAD_ID


def decode_buckets(max_batch: int) -> tuple[int, ...]:
    """Batch sizes a decode graph is captured for: powers of two below ``max_batch``, then
    ``max_batch`` itself (``decode_buckets(6) == (1, 2, 4, 6)``)."""
    if type(max_batch) is not int or max_batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    out.append(max_batch)
    return tuple(out)


def bucket_for(n: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``n`` rows; None when ``n`` exceeds the largest (that batch
    cannot be replayed: run it eagerly, or refuse it earlier)."""
    if n < 1:
        raise ValueError(f"a decode batch has at least one row, got {n}")
    for b in buckets:
        if b >= n:
            return b
    return None


@dataclass(frozen=True)
class DecodePadding:
    """Pads a decode batch of ``live`` rows (slots ``0..live-1``) up to ``bucket`` rows.

    Rows ``live..bucket-1`` are padding (see the module docstring): token ``PAD_ID``, position
    0, logits index 0, length 1; their logits are dropped by ``unpad``. ``live`` may be 0 for
    a warm-up probe, whose every row is padding."""

    live: int
    bucket: int

    def __post_init__(self) -> None:
        if not 0 <= self.live <= self.bucket or self.bucket < 1:
            raise ValueError(f"cannot pad {self.live} rows to a bucket of {self.bucket}")

    def pad(self, input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
            lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """New C-contiguous int64 arrays of ``bucket`` rows: the live rows, then padding rows."""
        arrays = (input_ids, position_ids, logits_index, lengths)
        for name, a in zip(("input_ids", "position_ids", "logits_index", "lengths"), arrays):
            if a.shape[:1] != (self.live,):
                raise ValueError(f"{name} has {a.shape[:1]} rows, expected {self.live}")
        fills = (PAD_ID, 0, 0, 1)
        return tuple(self._pad_one(a, fill) for a, fill in zip(arrays, fills))  # type: ignore[return-value]

    def _pad_one(self, a: np.ndarray, fill: int) -> np.ndarray:
        out = np.full((self.bucket,) + a.shape[1:], fill, np.int64)
        out[: self.live] = a
        return out

    def unpad(self, logits: np.ndarray) -> np.ndarray:
        """The live rows of a bucket's logits (a view)."""
        return logits[: self.live]


def probe_inputs(bucket: int, seq: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A warm-up probe step of ``bucket`` padding rows (``DecodePadding(0, bucket)``)."""
    empty2 = np.zeros((0, seq), np.int64)
    return DecodePadding(0, bucket).pad(empty2, empty2, np.zeros((0, 1), np.int64), np.zeros(0, np.int64))


@dataclass(frozen=True)
class GraphKey:
    """What a captured graph is valid for: its batch bucket, the optimization profile (or
    graph id) it ran under, and every device address it was bound to, in a fixed order."""

    bucket: int
    profile: int
    addresses: tuple[int, ...]

    @classmethod
    def of(cls, bucket: int, profile: int, bindings: Mapping[str, int]) -> "GraphKey":
        """The key for ``bindings`` (tensor name -> device address), ordered by name so the
        same bindings always make the same key."""
        return cls(bucket, profile, tuple(bindings[name] for name in sorted(bindings)))


@dataclass
class GraphStats:
    captured: int = 0  # graphs put into the cache
    replays: int = 0  # lookups that found a graph
    fallbacks: int = 0  # lookups that found none (never captured, or capture failed): plain enqueue
    failed: int = 0  # captures that failed (recorded with GraphCache.fail)


H = TypeVar("H")


class GraphCache(Generic[H]):
    """Captured graphs by ``GraphKey``; ``H`` is the backend's handle (a ``cudaGraphExec_t``
    for TensorRT, a ``gpu_graph_id`` for onnxruntime).

    The fallback rule: ``get`` returns the handle to replay, or None, and then the caller runs
    the step with a plain enqueue: the key was never captured (a shape or address warm-up did
    not see), or its capture failed (``fail``; it is not retried: a failure under capture
    means the step has work CUDA graphs cannot hold, and it would fail again). ``should_capture``
    says whether warm-up should try a key. The cache owns its handles: ``clear`` (and ``put``
    over an existing key) passes each one to ``destroy``.
    """

    def __init__(self, destroy: Callable[[H], None] | None = None) -> None:
        self._graphs: dict[GraphKey, H] = {}
        self._failed: dict[GraphKey, str] = {}
        self._destroy = destroy
        self.stats = GraphStats()

    def __len__(self) -> int:
        return len(self._graphs)

    def __contains__(self, key: GraphKey) -> bool:
        return key in self._graphs

    def keys(self) -> tuple[GraphKey, ...]:
        return tuple(self._graphs)

    def should_capture(self, key: GraphKey) -> bool:
        return key not in self._graphs and key not in self._failed

    def get(self, key: GraphKey) -> H | None:
        handle = self._graphs.get(key)
        if handle is None:
            self.stats.fallbacks += 1
        else:
            self.stats.replays += 1
        return handle

    def put(self, key: GraphKey, handle: H) -> None:
        old = self._graphs.get(key)
        if old is not None and self._destroy is not None:
            self._destroy(old)
        self._graphs[key] = handle
        self._failed.pop(key, None)
        self.stats.captured += 1

    def fail(self, key: GraphKey, reason: str) -> None:
        """Record that capturing ``key`` failed (steps with it then run eagerly)."""
        self._failed[key] = reason
        self.stats.failed += 1

    def failure(self, key: GraphKey) -> str | None:
        return self._failed.get(key)

    def clear(self) -> None:
        """Forget (and destroy) every graph, e.g. before the buffers they are bound to are freed."""
        graphs, self._graphs, self._failed = self._graphs, {}, {}
        if self._destroy is not None:
            for handle in graphs.values():
                self._destroy(handle)


class SlotPool(Protocol):
    """The part of a state pool (``StatePool`` or a device pool) warm-up uses."""

    live: int
    slots: int

    def claim(self) -> int: ...

    def release(self, slot: int) -> int | None: ...


@contextmanager
def probe_slots(pool: SlotPool, n: int) -> Iterator[tuple[int, ...]]:
    """Claim ``n`` slots of an empty pool for a warm-up probe; they are released (last first,
    so nothing moves) when the block ends, however it ends, leaving the pool empty.

    The probe's state rows are left as the probe wrote them: free slots' rows, which the
    pool's contract makes harmless (conv rows are zeroed on claim, KV rows written before
    they are read)."""
    if pool.live:
        raise RuntimeError(f"warm-up needs an empty pool, {pool.live} slot(s) are live")
    if n > pool.slots:
        raise RuntimeError(f"a warm-up probe of {n} rows does not fit a pool of {pool.slots} slots")
    claimed: list[int] = []
    try:
        for _ in range(n):
            claimed.append(pool.claim())
        yield tuple(claimed)
    finally:
        for slot in reversed(claimed):
            pool.release(slot)


@dataclass(frozen=True)
class WarmupReport:
    buckets: tuple[int, ...]
    captured: tuple[int, ...]  # buckets whose graph was captured
    failed: tuple[tuple[int, str], ...]  # (bucket, why) for captures that failed (run eagerly)


def warm_up(pool: SlotPool, buckets: tuple[int, ...], key_for: Callable[[int], GraphKey],
            cache: GraphCache, capture: Callable[[int], H]) -> WarmupReport:
    """Capture one decode graph per bucket, each with ``bucket`` probe slots claimed.

    ``key_for(bucket)`` is the key the step would look up while serving; ``capture(bucket)``
    runs the probe step (inputs: ``probe_inputs(bucket)``) eagerly once, then under capture,
    and returns the handle, or raises ``CaptureFailed`` (recorded; that bucket then runs
    eagerly). Any other exception propagates, with the probe slots released."""
    captured, failed = [], []
    for bucket in buckets:
        key = key_for(bucket)
        if not cache.should_capture(key):
            continue
        with probe_slots(pool, bucket):
            try:
                handle = capture(bucket)
            except CaptureFailed as exc:
                cache.fail(key, str(exc))
                failed.append((bucket, str(exc)))
                continue
        cache.put(key, handle)
        captured.append(bucket)
    return WarmupReport(tuple(buckets), tuple(captured), tuple(failed))


class CaptureFailed(Exception):
    """A step could not be captured into a CUDA graph (it is then run eagerly)."""
