"""The rows of cached prefix blocks, beside a ``StatePool``: where reusable KV lives.

A block is ``block_size`` consecutive positions of one sequence. ``BlockStore`` holds, per
attention layer of its pool, key and value rows ``[blocks, kv_heads, block_size, head_dim]``
and, per conv or recurrent state of a layer, one snapshot per block ``[blocks, *slot shape]`` (the
state after the block's last position, kept only where a run ended exactly there: such state cannot
be recomputed from the KV rows). Which block id holds which prefix is the request path's
(``runtime.request.prefix.PrefixIndex``); this module only copies rows between a slot and block
ids, so each pool (one per pipeline stage, in this process or in a Ray actor) keeps its own
layers' blocks and nothing else.

Copy, not share: a slot's KV is one contiguous ``[kv_heads, capacity, head_dim]`` run per layer
(what GroupQueryAttention reads), so a reused prefix is copied into the slot at admission
(measured on SmolLM2-135M, fp32, 30 layers: 9 ms per 1,000 tokens, against ~1.3 ms of prefill
per token; ``scripts/bench_prefix.py``) and the store is never read by a graph. Sliding-window layers copy only the
last ``sliding_window`` positions of the prefix: no later token attends further back. A pool
whose sliding layers are window-sized (``state.StatePool``, ``windowed``) holds position p of
such a layer at row ``p - base`` of the slot: ``save`` and ``load`` take that base per layer.

Memory: the arrays are allocated zeroed at their full size once (``np.zeros``: pages are
touched only when a block is first written), so the store's resident size grows with use up
to the budget it was sized for. The first write of each page is a page fault: until the store
has been filled once, keeping blocks costs ~2 s per GiB written on the build machine (measured:
7% of a cold run's throughput on a workload that reuses nothing, none once the store is full).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from graphkiln.manifest import StateSpec


def bytes_per_block(specs: Sequence[StateSpec], dtype: np.dtype, block_size: int) -> int:
    """The bytes one block takes in a ``BlockStore`` over ``specs`` (KV rows and state snapshots)."""
    total = 0
    for s in specs:
        if s.kind == "kv":
            total += len(s.layers) * 2 * s.num_kv_heads * block_size * s.head_dim
        else:
            total += len(s.layers) * math.prod(s.slot_shape())
    return total * np.dtype(dtype).itemsize


class BlockStore:
    """``blocks`` blocks of ``block_size`` positions for the layers of ``specs`` (module docstring)."""

    def __init__(self, specs: Sequence[StateSpec], dtype: np.dtype, blocks: int, block_size: int) -> None:
        self.blocks, self.block_size = blocks, block_size
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        self.snapshots: dict[tuple[str, int], np.ndarray] = {}  # (kind, layer) -> [blocks, *slot shape]
        self.window: dict[int, int | None] = {}  # per attention layer: its sliding window, None for full
        for s in specs:
            for layer in s.layers:
                if s.kind == "kv":
                    shape = (blocks, s.num_kv_heads, block_size, s.head_dim)
                    self.keys[layer], self.values[layer] = np.zeros(shape, dtype), np.zeros(shape, dtype)
                    self.window[layer] = s.sliding_window
                else:
                    self.snapshots[s.kind, layer] = np.zeros((blocks, *s.slot_shape()), dtype)

    def save(self, keys: dict[int, np.ndarray], values: dict[int, np.ndarray],
             slot_states: dict[tuple[str, int], np.ndarray], slot: int, blocks: Sequence[int], ids: Sequence[int],
             snapshot: int | None, bases: dict[int, int] | None = None) -> None:
        """Copy the slot's positions of blocks ``blocks`` (block indices in its sequence) into block
        ids ``ids`` (pairwise), and with ``snapshot`` (a block id) the slot's conv and recurrent
        states (``slot_states``, by (kind, layer)) into it. ``bases``: per window-sized layer, the
        position its row 0 holds (module docstring); every block saved must lie at or above it."""
        B = self.block_size
        if len(ids):
            idx = np.asarray(ids, np.int64)
            first, k = int(blocks[0]), len(blocks)
            contiguous = list(blocks) == list(range(first, first + k))
            for layer, store in self.keys.items():
                base = (bases or {}).get(layer, 0)
                if first * B < base or (not contiguous and min(blocks) * B < base):
                    raise RuntimeError(f"block {min(blocks)} of layer {layer} is no longer in its window-sized cache")
                for src, dst in ((keys[layer], store), (values[layer], self.values[layer])):
                    if contiguous:
                        rows = src[slot, :, first * B - base:(first + k) * B - base]  # [H, k*B, D]
                    else:
                        pos = (np.asarray(blocks, np.int64)[:, None] * B + np.arange(B)).ravel() - base
                        rows = src[slot][:, pos]
                    dst[idx] = rows.reshape(rows.shape[0], k, B, rows.shape[2]).transpose(1, 0, 2, 3)
        if snapshot is not None:
            for key, store in self.snapshots.items():
                store[snapshot] = slot_states[key][slot]

    def load(self, keys: dict[int, np.ndarray], values: dict[int, np.ndarray],
             slot_states: dict[tuple[str, int], np.ndarray], slot: int, ids: Sequence[int], snapshot: int | None,
             window_base: int | None = None) -> None:
        """Copy blocks ``ids`` (the prefix's blocks, in order) into the slot's positions
        ``[0, len(ids) * block_size)``, and with ``snapshot`` that block's conv and recurrent states into the slot.
        ``window_base``: sliding layers' buffers are window-sized, their row 0 holding that position
        (a multiple of the block size, at most the first block they read)."""
        B, k = self.block_size, len(ids)
        idx = np.asarray(ids, np.int64)
        for layer, store in self.keys.items():
            window = self.window[layer]
            skip = 0 if window is None else max(0, k - math.ceil(window / B))  # blocks no later token reads
            base = window_base if window is not None and window_base is not None else 0
            part = idx[skip:]
            for src, dst in ((store, keys[layer]), (self.values[layer], values[layer])):
                rows = src[part]  # [k', H, B, D]
                dst[slot, :, skip * B - base:k * B - base] = rows.transpose(1, 0, 2, 3).reshape(
                    rows.shape[1], len(part) * B, rows.shape[3])
        if snapshot is not None:
            for key, store in self.snapshots.items():
                slot_states[key][slot] = store[snapshot]
