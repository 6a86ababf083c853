"""Runtime-owned state pools: KV cache per attention layer, conv (and recurrent) state per slot.

Layouts (match the manifest's ``StateSpec``), all C-contiguous in the artifact's dtype:
  kv    per attention layer: key and value ``[slots, kv_heads, capacity, head_dim]``; a
        token at position p of the request in slot s is stored at ``[s, :, p, :]``.
  conv  per conv layer: ``[slots, channels, kernel-1]``, the last inputs, oldest first.
  recurrent  per linear-recurrent layer (gated delta net, Mamba-2): ``[slots, heads, rows,
        cols]``, the matrix state after the slot's last token. Conv and recurrent states are the
        *slot states*: one row per slot, zeroed on claim, read and written at ``slot_idx``.

Window-sized caches (``windowed``: the decoder graph takes ``window_offset``, the onnxruntime
target's sliding-window GroupQueryAttention nodes, ``export.lowering.ort_attention``). A sliding
layer's key and value buffers hold ``window_rows`` positions per slot instead of ``capacity``:
slot s's row j holds position ``window_base[s] + j``. Before each run ``window_offsets`` makes
room for the run's new rows by moving the slot's last ``keep`` rows (at least window - 1: all
that a later token of a sliding layer attends to) to the front when the run would pass the end,
and returns each row's base, which the graph subtracts from its positions (GQA then masks by the
relative positions, the same distances). Rows are only ever dropped from below ``start - keep``
of a run about to start, so a speculative run rolled back to any position at or after its start
still finds its window (a ring, overwriting as it goes, could not give that back). A run longer
than ``window_rows - keep`` grows the buffers (copying the live rows, bindings go stale:
``generation``); ``window_rows`` never exceeds ``capacity``, so short sessions are exactly as
before. Full-attention layers, and every layer of a non-windowed pool (portable and tensorrt
graphs, artifacts exported before ``window_offset`` existed), keep ``capacity`` rows.

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


# Positions a windowed pool's sliding buffers hold beyond what a run's window needs, at first
# (a run longer than this grows them): the scheduler's default step budget (serve --step-tokens).
WINDOW_STEP_ROWS = 256
# Positions a windowed buffer keeps below a run's start beyond the window's own: how far a
# request (or its draft model, request.speculate: up to 16 drafts run one at a time, after the
# tokens it catches up on) may roll back to before a run it has already made.
ROLLBACK_ROWS = 32


def windowed_layers(states: tuple[StateSpec, ...]) -> dict[int, int]:
    """Sliding-window attention layers and their windows (the layers a windowed pool keeps
    window-sized)."""
    return {layer: s.sliding_window for s in states if s.kind == "kv" and s.sliding_window for layer in s.layers}


def takes_window_offset(spec) -> bool:
    """Whether decoder graph ``spec`` addresses its sliding layers' caches by window (a ``window_offset`` input)."""
    return any(t.role == "window_offset" for t in spec.inputs)


class StatePool(PackedSlots):
    def __init__(self, states: tuple[StateSpec, ...], dtype: np.dtype, windowed: bool = False) -> None:
        """``windowed``: keep sliding layers' KV window-sized (module docstring); only for a graph
        that takes ``window_offset`` (``takes_window_offset``)."""
        self.specs = states
        self.dtype = dtype
        self.slots = 0
        self.capacity = 0
        self.live = 0
        self.windows = windowed_layers(states) if windowed else {}  # windowed layer -> its window
        self.window_rows = 0  # positions a windowed layer's buffer holds per slot (this session's)
        self.window_base = np.zeros(0, np.int64)  # per slot: the position of its row 0 in windowed buffers
        self.window_step = WINDOW_STEP_ROWS  # rows beyond window_keep a session's windowed buffers start with
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
        self.window_rows = self._window_rows(capacity)
        self.window_base = np.zeros(slots, np.int64)
        self.generation += 1
        self.keys, self.values, self.conv, self.recurrent = {}, {}, {}, {}
        for spec in self.specs:
            if spec.kind == "kv":
                for layer in spec.layers:
                    rows = self.window_rows if layer in self.windows else capacity
                    shape = (slots, spec.num_kv_heads, rows, spec.head_dim)
                    most = slots * spec.num_kv_heads * max(rows, spec.max_seq_len) * spec.head_dim
                    self.keys[layer] = self._carve(("key", layer), shape, most)
                    self.values[layer] = self._carve(("value", layer), shape, most)
            else:
                pools = self.conv if spec.kind == "conv" else self.recurrent
                for layer in spec.layers:
                    pools[layer] = self._carve((spec.kind, layer), (slots, *spec.slot_shape()))

    def slot_states(self) -> dict[tuple[str, int], np.ndarray]:
        """Every conv and recurrent pool by (kind, layer)."""
        return {**{("conv", l): a for l, a in self.conv.items()}, **{("recurrent", l): a for l, a in self.recurrent.items()}}

    @property
    def windowed(self) -> bool:
        """Whether some layer's KV is window-sized (``runtime.request.prefix`` keeps blocks accordingly)."""
        return bool(self.windows)

    @property
    def window_keep(self) -> int:
        """Positions a windowed buffer keeps before a run's start when it makes room: the window
        less one (all a sliding layer's next token reads), at least a cached block less one
        (``runtime.request.prefix`` copies a block out after the run that filled it), and
        ``ROLLBACK_ROWS`` for a speculative rollback to before a run already made."""
        block = self.store.block_size if self.store is not None else 1
        return max(max(self.windows.values()), block) - 1 + ROLLBACK_ROWS if self.windows else 0

    def _window_rows(self, capacity: int) -> int:
        return min(capacity, self.window_keep + self.window_step) if self.windows else 0

    def kv_bytes_per_token(self, context: int) -> float:
        """Bytes of KV cache per token of one slot at ``context`` positions, as this pool lays it out
        (a windowed layer holds ``min(context, its buffer)`` of them; an unreserved pool counts the
        first session's buffers)."""
        rows = self.window_rows or self._window_rows(context)
        total = 0
        for spec in self.specs:
            if spec.kind == "kv":
                for layer in spec.layers:
                    held = min(context, rows) if layer in self.windows else context
                    total += 2 * spec.num_kv_heads * spec.head_dim * held
        return total * self.dtype.itemsize / context

    def _shapes(self, slots: int, capacity: int) -> dict[tuple[str, int], tuple[int, ...]]:
        shapes: dict[tuple[str, int], tuple[int, ...]] = {}
        window_rows = self._window_rows(capacity)
        for spec in self.specs:
            if spec.kind == "kv":
                for layer in spec.layers:
                    rows = window_rows if layer in self.windows else capacity
                    shapes["key", layer] = shapes["value", layer] = (slots, spec.num_kv_heads, rows, spec.head_dim)
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
        self._check_bytes(needed, slots, capacity)

    def _check_bytes(self, needed: int, slots: int | None = None, capacity: int | None = None) -> None:
        slots = self.slots if slots is None else slots
        capacity = self.capacity if capacity is None else capacity
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
        """``BlockStore.save`` from ``slot``. Windowed layers hold positions from the slot's base
        on; the blocks a request saves always are (``window_keep``)."""
        self.store.save(self.keys, self.values, self.slot_states(), slot, blocks, ids, snapshot,
                        self._window_base_of(slot))

    def load_blocks(self, slot: int, ids, snapshot: int | None = None) -> None:
        """``BlockStore.load`` into ``slot`` (a claimed slot, before its first run); windowed layers
        get only the prefix's last blocks that their window reads, from the slot's row 0."""
        base = None
        if self.windows:
            B = self.store.block_size
            base = max(0, len(ids) - math.ceil(max(self.windows.values()) / B)) * B
            self._grow_window(len(ids) * B - base)
            self.window_base[slot] = base
        self.store.load(self.keys, self.values, self.slot_states(), slot, ids, snapshot, base)

    def _window_base_of(self, slot: int) -> dict[int, int]:
        return {layer: int(self.window_base[slot]) for layer in self.windows}

    # -- window-sized caches ----------------------------------------------------------------

    def window_offsets(self, starts: np.ndarray, lengths: np.ndarray, seq: int, first: int = 0
                       ) -> tuple[np.ndarray, np.ndarray]:
        """The graph's ``window_offset`` [n] and ``window_total_sequence_length`` for a run of
        slots first..first+n-1 writing ``seq`` rows each from positions ``starts`` (``lengths``
        real ones), after making room for them (module docstring). A pool that is not windowed
        answers zeros and the run's total: positions as they are."""
        n = len(starts)
        if not self.windows:
            return np.zeros(n, np.int64), np.array(int((starts + lengths).max()), np.int32)
        keep, window = self.window_keep, max(self.windows.values())
        bases = self.window_base[first:first + n]
        lost = np.flatnonzero((bases > np.maximum(0, starts - window + 1)) | (starts - bases > self.window_rows))
        if len(lost):  # never silently: the rows its window reads are gone
            b = int(lost[0])
            raise RuntimeError(f"a run from position {int(starts[b])} of slot {first + b} needs positions its "
                               f"window-sized cache dropped or never held (it holds {int(bases[b])} on)")
        for b in np.flatnonzero(starts - bases + seq > self.window_rows):  # rows that must make room first
            slot, start = first + int(b), int(starts[b])
            base = int(self.window_base[slot])
            if start - base + seq <= self.window_rows:  # an earlier row's growth made room
                continue
            new_base = max(base, start - keep)
            if new_base > base:  # drop what no later token reads: the rows before start - keep
                moved = start - new_base
                for bufs in (self.keys, self.values):
                    for layer in self.windows:
                        a = bufs[layer]
                        a[slot, :, :moved] = a[slot, :, new_base - base:start - base].copy()
                self.window_base[slot] = new_base
            self._grow_window(start - new_base + seq)
        offsets = self.window_base[first:first + n].copy()
        return offsets, np.array(int((starts - offsets + lengths).max()), np.int32)

    def _grow_window(self, rows: int) -> None:
        """Make windowed buffers hold at least ``rows`` positions per slot (live rows copied;
        bindings to the old buffers go stale: ``generation``)."""
        if rows <= self.window_rows:
            return
        if rows > self.capacity:
            raise RuntimeError(f"a run needs {rows} positions of a pool of {self.capacity}")
        new_rows = min(self.capacity, max(rows, 2 * self.window_rows))
        for bufs, kind in ((self.keys, "key"), (self.values, "value")):
            for layer in self.windows:
                old = bufs[layer]
                shape = (old.shape[0], old.shape[1], new_rows, old.shape[3])
                self._check_bytes(math.prod(shape) * self.dtype.itemsize)
                new = np.zeros(math.prod(shape), self.dtype)
                self._backing[kind, layer] = new
                new = new.reshape(shape)
                new[: self.live, :, : self.window_rows] = old[: self.live]
                bufs[layer] = new
        self.window_rows = new_rows
        self.generation += 1

    # -- slots (claim, release: PackedSlots) -------------------------------------------------

    def _clear_conv_row(self, slot: int) -> None:
        for bufs in (self.conv, self.recurrent):
            for a in bufs.values():
                a[slot] = 0
        if self.windows:
            self.window_base[slot] = 0

    def _move_row(self, dst: int, src: int) -> None:
        for bufs in (self.keys, self.values, self.conv, self.recurrent):
            for a in bufs.values():
                a[dst] = a[src]
        if self.windows:
            self.window_base[dst] = self.window_base[src]

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
