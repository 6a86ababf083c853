"""Runtime-owned state pools: KV cache per attention layer, conv (and recurrent) state per slot.

Layouts (match the manifest's ``StateSpec``), all C-contiguous in the artifact's dtype:
  kv    per attention layer: key and value ``[slots, kv_heads, capacity, head_dim]``; a
        token at position p of the request in slot s is stored at ``[s, :, p, :]``.
  conv  per conv layer: ``[slots, channels, kernel-1]``, the last inputs, oldest first.
  recurrent  per linear-recurrent layer (gated delta net, Mamba-2): ``[slots, heads, rows,
        cols]``, the matrix state after the slot's last token. Conv and recurrent states are the
        *slot states*: one row per slot, zeroed on claim, read and written at ``slot_idx``.

Lifecycle. The engine owns one ``StatePool`` for its life. ``reserve`` sizes it for a
generation session (only while no slot is live, so buffers never move under a running
request); the buffers are views over per-layer backing memory that the pool keeps and only
grows, so a later session of the same or a smaller size touches no new pages (fresh pages
cost a page fault each on first write: ~5% of decode speed at 128 tokens). A request
``claim``s a slot when it starts (its conv rows are zeroed; KV rows are written before they
are read) and ``release``s it when it
finishes, fails or is cancelled. Live slots are kept packed as ``0..live-1``: a
release moves the last live slot's rows into the hole and reports the move, so the live
batch is always the prefix ``[:live]`` of every buffer — a contiguous view at a fixed
address, passed to the graph without copying, which is also what CUDA-graph replay needs.
The scheduler (``runtime.request.scheduler``) also runs a sub-range ``[first, first+n)`` of the live
slots (``kv_views(n, first)``), and releases with ``release_keeping_tail`` so that a request
mid-prefill keeps the last slot; a failed request's slot is ``scrub``bed before release.
"""

from __future__ import annotations

import math

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import StateSpec
from graphkiln.memory import available_memory
from graphkiln.runtime.backends.prefix_store import BlockStore, bytes_per_block


# The token of padding rows and padded prompt positions (the engine's ragged prompts, a decode
# batch padded to its CUDA-graph bucket): they are masked out of attention and of the state the
# live rows read, so any in-vocabulary id will do; the checkpoint's pad_token_id is not trusted
# to be one.
PAD_ID = 0


class PackedSlots:
    """``StatePool``'s slot rules, for any storage: live slots are ``0..live-1``; ``claim``
    takes slot ``live`` and clears its conv rows (conv state is read from the first step; KV
    rows are written before they are read, so they are left as they are); ``release`` frees a
    slot and moves the last live slot's rows into the hole, returning the moved slot's old
    index (None when nothing moved), so the live batch is always a prefix of every buffer.
    A subclass stores the rows: ``_clear_conv_row`` and ``_move_row``."""

    slots: int  # how many slots may be live at once (this session's)
    live: int

    @property
    def free_slots(self) -> int:
        return self.slots - self.live

    def claim(self) -> int:
        if self.live >= self.slots:
            raise RuntimeError(f"{type(self).__name__} has no free slot")
        slot = self.live
        self.live += 1
        self._clear_conv_row(slot)
        return slot

    def release(self, slot: int) -> int | None:
        """Free ``slot``; if another live slot's rows moved into it, return that slot's old index."""
        if not 0 <= slot < self.live:
            raise RuntimeError(f"{type(self).__name__}.release of slot {slot} that is not live")
        last = self.live - 1
        self.live -= 1
        if slot == last:
            return None
        self._move_row(slot, last)
        return last

    def release_keeping_tail(self, slot: int, tail: int = 0) -> list[tuple[int, int]]:
        """Free ``slot`` while the last ``tail`` live slots stay the last ones (the scheduler's
        request mid-prefill: ``runtime.request.scheduler``); returns the moves made, ``(old, new)`` slot
        indices in order. ``tail`` 0 is ``release``. The slot must not be in the tail."""
        if not 0 <= slot < self.live - tail:
            raise RuntimeError(f"{type(self).__name__}.release of slot {slot} that is not live outside the last {tail}")
        if tail == 0:
            moved = self.release(slot)
            return [] if moved is None else [(moved, slot)]
        moves = []
        hole = self.live - tail - 1  # the last slot before the tail
        if slot != hole:
            self._move_row(slot, hole)
            moves.append((hole, slot))
        for src in range(self.live - tail, self.live):  # the tail shifts down by one
            self._move_row(src - 1, src)
            moves.append((src, src - 1))
        self.live -= 1
        return moves

    def _clear_conv_row(self, slot: int) -> None:
        raise NotImplementedError

    def _move_row(self, dst: int, src: int) -> None:
        raise NotImplementedError


class StatePool(PackedSlots):
    def __init__(self, states: tuple[StateSpec, ...], dtype: np.dtype) -> None:
        self.specs = states
        self.dtype = dtype
        self.slots = 0
        self.capacity = 0
        self.live = 0
        self.generation = 0  # bumped whenever reserve replaces the buffers (bindings to them go stale)
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        self.conv: dict[int, np.ndarray] = {}
        self.recurrent: dict[int, np.ndarray] = {}
        self._backing: dict[tuple[str, int], np.ndarray] = {}  # flat memory under the views above
        self.store: BlockStore | None = None  # cached prefix blocks (attach_store)

    # -- sizing ---------------------------------------------------------------------------

    def reserve(self, slots: int, capacity: int) -> None:
        """Size the pool to exactly ``slots`` x ``capacity`` tokens; only between sessions.

        Refuses (GraphkilnError, pool unchanged) when the memory it would newly allocate is
        more than the machine has available: numpy's zeroed allocation succeeds lazily and
        the process would die in the OOM killer halfway through a generation instead."""
        if self.live:
            raise RuntimeError("StatePool.reserve while slots are live")
        if (slots, capacity) == (self.slots, self.capacity):
            return
        self._check_memory(slots, capacity)
        self.slots, self.capacity = slots, capacity
        self.generation += 1
        self.keys, self.values, self.conv, self.recurrent = {}, {}, {}, {}
        for spec in self.specs:
            if spec.kind == "kv":
                shape = (slots, spec.num_kv_heads, capacity, spec.head_dim)
                most = slots * spec.num_kv_heads * max(capacity, spec.max_seq_len) * spec.head_dim
                for layer in spec.layers:
                    self.keys[layer] = self._carve(("key", layer), shape, most)
                    self.values[layer] = self._carve(("value", layer), shape, most)
            else:
                pools = self.conv if spec.kind == "conv" else self.recurrent
                for layer in spec.layers:
                    pools[layer] = self._carve((spec.kind, layer), (slots, *spec.slot_shape()))

    def slot_states(self) -> dict[tuple[str, int], np.ndarray]:
        """Every conv and recurrent pool by (kind, layer)."""
        return {**{("conv", l): a for l, a in self.conv.items()}, **{("recurrent", l): a for l, a in self.recurrent.items()}}

    def _shapes(self, slots: int, capacity: int) -> dict[tuple[str, int], tuple[int, ...]]:
        shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        for spec in self.specs:
            if spec.kind == "kv":
                for layer in spec.layers:
                    shapes["key", layer] = shapes["value", layer] = (slots, spec.num_kv_heads, capacity, spec.head_dim)
            else:
                for layer in spec.layers:
                    shapes[spec.kind, layer] = (slots, *spec.slot_shape())
        return shapes

    def bytes_for(self, slots: int, capacity: int) -> int:
        """The bytes of this pool's buffers at ``slots`` x ``capacity`` tokens, allocating nothing
        (exact Python ints: a huge manifest value does not wrap)."""
        return sum(math.prod(shape) for shape in self._shapes(slots, capacity).values()) * self.dtype.itemsize

    def _check_memory(self, slots: int, capacity: int) -> None:
        """Refuse a size whose new backing memory exceeds what is available (exact Python
        ints: a huge manifest value must not overflow into a small number)."""
        needed = 0
        for key, shape in self._shapes(slots, capacity).items():
            size = math.prod(shape)
            buf = self._backing.get(key)
            if buf is None or buf.size < size:
                needed += size * self.dtype.itemsize
        available = available_memory()
        if available is not None and needed > available:
            raise GraphkilnError(
                f"the state pools for {slots} request(s) x {capacity} tokens need {_gib(needed)} of memory but "
                f"only {_gib(available)} is available: lower --max-new-tokens (max_new_tokens) or the batch size, "
                "or re-export with a smaller --max-seq-len"
            )

    def _carve(self, key: tuple[str, int], shape: tuple[int, ...], most: int | None = None) -> np.ndarray:
        """A C-contiguous array of ``shape`` over the front of ``key``'s backing memory, which
        is replaced by a larger zeroed one when too small: twice the size asked for (at most
        ``most`` elements, the largest this key can need), so that sessions growing a little at
        a time (a chat's turns, each a few tokens longer) keep the pages they have touched:
        measured on SmolLM2-135M, a fresh 1,568-token slot cost 0.17 s of page faults to fill
        before its first run. The headroom is address space only until written (zeroed pages
        are mapped lazily). Reused memory holds earlier rows: finite values that the graphs
        never read (see ``claim``)."""
        size = int(np.prod(shape))
        buf = self._backing.get(key)
        if buf is None or buf.size < size:
            room = max(size, min(2 * size, most if most is not None else size))
            buf = self._backing[key] = np.zeros(room, self.dtype)
        return buf[:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for d in (self.keys, self.values, self.conv, self.recurrent) for a in d.values())

    # -- cached prefix blocks (backends.prefix_store) ----------------------------------------

    def block_bytes(self, block_size: int) -> int:
        """What one cached block of this pool's layers takes (``prefix_store.bytes_per_block``)."""
        return bytes_per_block(self.specs, self.dtype, block_size)

    def attach_store(self, blocks: int, block_size: int) -> None:
        """Keep up to ``blocks`` cached prefix blocks beside this pool (replacing any store)."""
        self.store = BlockStore(self.specs, self.dtype, blocks, block_size)

    def save_blocks(self, slot: int, blocks, ids, snapshot: int | None = None) -> None:
        """``BlockStore.save`` from ``slot``."""
        self.store.save(self.keys, self.values, self.slot_states(), slot, blocks, ids, snapshot)

    def load_blocks(self, slot: int, ids, snapshot: int | None = None) -> None:
        """``BlockStore.load`` into ``slot`` (a claimed slot, before its first run)."""
        self.store.load(self.keys, self.values, self.slot_states(), slot, ids, snapshot)

    # -- slots (claim, release: PackedSlots) -------------------------------------------------

    def _clear_conv_row(self, slot: int) -> None:
        for bufs in (self.conv, self.recurrent):
            for a in bufs.values():
                a[slot] = 0

    def _move_row(self, dst: int, src: int) -> None:
        for bufs in (self.keys, self.values, self.conv, self.recurrent):
            for a in bufs.values():
                a[dst] = a[src]

    def scrub(self, slot: int) -> None:
        """Zero every row of ``slot``. For a request that failed: its rows may hold NaN/Inf, and
        the graphs read a slot's stale cache positions under a zero attention weight, where
        0 x NaN is NaN; the reuse rule (``_carve``, ``claim``) needs stale rows finite."""
        for bufs in (self.keys, self.values, self.conv, self.recurrent):
            for a in bufs.values():
                a[slot] = 0

    def snapshot_slot_states(self, slot: int) -> dict[tuple[str, int], np.ndarray]:
        """A copy of ``slot``'s conv and recurrent rows (speculative decoding restores them when a
        draft the run consumed is rejected: ``request.step``); {} for a KV-only pool."""
        return {key: a[slot].copy() for key, a in self.slot_states().items()}

    def restore_slot_states(self, slot: int, saved: dict[tuple[str, int], np.ndarray]) -> None:
        states = self.slot_states()
        for key, rows in saved.items():
            states[key][slot] = rows

    # -- graph I/O ------------------------------------------------------------------------

    def kv_views(self, n: int, first: int = 0) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """Slots first..first+n-1 of every KV buffer: contiguous views, no copies."""
        return ({l: a[first:first + n] for l, a in self.keys.items()},
                {l: a[first:first + n] for l, a in self.values.items()})

    def write_kv(self, layer: int, new_k: np.ndarray, new_v: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                 first: int = 0) -> None:
        """Store new rows: row b's first lengths[b] tokens go to slot first+b at positions
        starts[b]..., in place."""
        k, v = self.keys[layer][first:], self.values[layer][first:]
        n, seq = new_k.shape[0], new_k.shape[2]
        if seq == 1:
            rows = np.arange(n)
            k[rows, :, starts] = new_k[:, :, 0]
            v[rows, :, starts] = new_v[:, :, 0]
            return
        for b in range(n):
            s, ln = int(starts[b]), int(lengths[b])
            k[b, :, s : s + ln] = new_k[b, :, :ln]
            v[b, :, s : s + ln] = new_v[b, :, :ln]

    def write_conv(self, layer: int, rows: np.ndarray, slot_idx: np.ndarray) -> None:
        self.conv[layer][slot_idx] = rows

    def write_recurrent(self, layer: int, rows: np.ndarray, slot_idx: np.ndarray) -> None:
        self.recurrent[layer][slot_idx] = rows


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
