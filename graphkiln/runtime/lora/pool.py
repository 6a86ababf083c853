"""``AdapterPool``: LoRA adapters in the fixed slots of the stacks an adapter-capable artifact
takes as graph inputs: the slot table, request holds, LRU replacement."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.memory import require_memory
from graphkiln.runtime.lora.adapter_dir import refuse
from graphkiln.runtime.lora.peft_config import positive_int
from graphkiln.runtime.lora.peft_reader import read_peft_adapter
from graphkiln.runtime.lora.targets import LoraTarget, check_adapter_name
from graphkiln.untrusted import show


def stacks_bytes(targets: Iterable[LoraTarget], rank: int, max_loras: int, itemsize: int) -> int:
    """Bytes of the A and B stacks: (max_loras + 1) slots x rank x sum(in + out) x itemsize."""
    return (max_loras + 1) * rank * sum(t.in_features + t.out_features for t in targets) * itemsize


def _content_digest(adapter: dict) -> bytes:
    import hashlib

    h = hashlib.blake2b(b"graphkiln-lora/", digest_size=16)
    for key in sorted(adapter):
        a, b = adapter[key]
        h.update(f"{key[0]}.{key[1]}:{a.dtype.str}{a.shape}{b.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        h.update(np.ascontiguousarray(b).tobytes())
    return h.digest()


@dataclass
class _Slot:
    name: str | None = None  # the adapter held (routable by name unless busy); None: free
    busy: bool = False  # rows being written by load/unload outside the lock: neither free nor routable
    refs: int = 0  # requests holding this slot: queued (from submission) or running
    last_used: int = 0  # LRU clock value of the latest load/acquire/release
    digest: bytes = b""  # the held adapter's content hash (``AdapterPool.digest``)


class AdapterPool:
    """LoRA adapters in a fixed number of slots, as the stacks an adapter-capable artifact takes.

    Ownership: the pool allocates, per target, ``A [max_loras + 1, in, rank]`` and
    ``B [max_loras + 1, rank, out]`` once, C-contiguous in ``dtype``, and owns them for its whole
    life. They are never reallocated or replaced (``arrays`` hands out the same objects forever), so
    the engine binds them to the graph inputs once or every step at no cost; it must not write them.
    Only the pool writes, and only rows of a slot that no request can route to at that moment (a
    slot being loaded or unloaded), so a step running concurrently reads consistent rows for every
    slot its ``lora_slots`` name. Slot 0 is zeros forever ("no adapter").

    The stacks' size, (max_loras + 1) x rank x sum(in + out) x itemsize bytes, is checked against
    the memory available before they are allocated (one line naming the figure and the export
    flags that lower it, never the OOM killer).

    Slot life: ``load`` claims a free slot, or evicts the least recently used adapter that no
    request holds, writes the adapter into it (every target: untouched ones zeroed) and then makes
    it routable by name. ``acquire(name)`` returns the slot for a request and counts the request
    (the scheduler acquires when a request is submitted, so a queued request holds its adapter
    too); ``release(slot)`` uncounts it, and must come only after the last step reading that slot
    has finished. A slot with requests counted is never evicted or unloaded. ``unload`` zeroes the
    slot and frees it. ``version`` increases each time any slot's contents change (for a device copy
    of the stacks to know when to refresh).

    Thread-safe: one lock guards the slot table; reading and validating an adapter and writing its
    slot happen outside the lock, so loads never stall acquire/release of running requests.
    """

    def __init__(self, targets: Iterable[LoraTarget], rank: int, max_loras: int, dtype="float32",
                 num_layers: int | None = None, module_paths: Mapping[str, str] | None = None):
        self.targets = tuple(targets)
        if not self.targets:
            raise ValueError("AdapterPool needs at least one LoraTarget")
        if len({t.key for t in self.targets}) != len(self.targets):
            raise ValueError("AdapterPool targets repeat a (layer, module)")
        if not positive_int(rank) or not positive_int(max_loras):
            raise ValueError(f"AdapterPool rank and max_loras must be positive ints, not {rank!r}, {max_loras!r}")
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float16):
            raise ValueError(f"AdapterPool dtype must be float32 or float16, not {dtype!r}")
        self.rank, self.max_loras = rank, max_loras
        require_memory(stacks_bytes(self.targets, rank, max_loras, self.dtype.itemsize),
                       f"the LoRA adapter stacks ({max_loras + 1} slots of rank {rank} on {len(self.targets)} "
                       f"projections)", "re-export with a smaller --max-loras or --lora-rank")
        self.module_paths = dict(module_paths) if module_paths else None  # read_peft_adapter's
        self.num_layers = num_layers if num_layers is not None else 1 + max(t.layer for t in self.targets)
        self._arrays = {t.key: (np.zeros((max_loras + 1, t.in_features, rank), self.dtype),
                                np.zeros((max_loras + 1, rank, t.out_features), self.dtype)) for t in self.targets}
        self.arrays: Mapping[tuple[int, str], tuple[np.ndarray, np.ndarray]] = MappingProxyType(self._arrays)
        self._slots = [_Slot() for _ in range(max_loras + 1)]  # [0] unused: slot 0 is never assigned
        self._lock = threading.Lock()
        self._clock = 0
        self.version = 0
        self._listeners: list = []  # called with a slot index once its rows are written (add_listener)

    # -- queries ------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The loaded adapters' names, in slot order."""
        with self._lock:
            return [s.name for s in self._slots[1:] if s.name is not None and not s.busy]

    def __contains__(self, name) -> bool:
        with self._lock:
            return self._slot_of(name) is not None

    def slot_of(self, name: str) -> int | None:
        with self._lock:
            return self._slot_of(name)

    def _slot_of(self, name) -> int | None:
        # a busy slot's name is only reserved: not routable until its rows are written
        for i, s in enumerate(self._slots):
            if i and not s.busy and s.name is not None and s.name == name:
                return i
        return None

    def _refuse_taken(self, name: str) -> None:
        """Lock held: a name already loaded, or reserved by a load in progress, is refused."""
        if any(s.name == name for s in self._slots[1:]):
            raise GraphkilnError(f"a LoRA adapter named {show(name)} is already loaded (or being loaded); unload "
                                 f"it first or choose another name")

    def _loaded(self) -> str:
        return ", ".join(show(s.name) for s in self._slots[1:] if s.name is not None and not s.busy) or "none"

    def _tick(self, slot: _Slot) -> None:
        self._clock += 1
        slot.last_used = self._clock

    # -- loading ------------------------------------------------------------------------------

    def load(self, name: str, path) -> int:
        """Read, validate and load the PEFT adapter at ``path`` under ``name``; returns its slot.

        The adapter is read and checked completely before any slot is claimed, so a refused adapter
        changes nothing. Then a free slot is claimed, or the least recently used adapter no request
        holds is evicted; if every slot holds an adapter in use, ``GraphkilnError``. The name is
        reserved while the slot's rows are written and becomes acquirable only once they are all
        written. A write that fails (MemoryError, interrupt) frees the slot again: a free slot's rows
        may be stale, which is harmless because no row routes to a free slot.
        """
        check_adapter_name(name)
        with self._lock:
            self._refuse_taken(name)
        adapter = read_peft_adapter(path, self.targets, self.rank, self.num_layers, self.module_paths)
        if self.dtype != np.float32:
            with np.errstate(over="ignore"):  # overflow is checked (and refused) just below
                adapter = {k: (a.astype(self.dtype), b.astype(self.dtype)) for k, (a, b) in adapter.items()}
            if not all(np.isfinite(a).all() and np.isfinite(b).all() for a, b in adapter.values()):
                raise refuse(path, f"values overflow the artifact's {self.dtype.name} adapter inputs; "
                                          f"use a float32 artifact or an adapter with smaller weights")

        digest = _content_digest(adapter)
        with self._lock:
            self._refuse_taken(name)
            index = self._claim()
            slot = self._slots[index]
            slot.busy, slot.name = True, name  # reserves the name; not routable until written
        try:
            self._write(index, adapter)
        except BaseException:
            with self._lock:
                slot.busy, slot.name = False, None
            raise
        with self._lock:
            slot.busy = False
            slot.digest = digest
            self._tick(slot)
            self.version += 1
        return index

    def _claim(self) -> int:
        """A free slot, else the LRU slot holding an adapter no request uses (evicted). Lock held."""
        for i, s in enumerate(self._slots):
            if i and s.name is None and not s.busy:
                return i
        idle = [(s.last_used, i) for i, s in enumerate(self._slots) if i and not s.busy and s.refs == 0]
        if not idle:
            raise GraphkilnError(f"all {self.max_loras} LoRA slots hold adapters in use by queued or running "
                                 f"requests ({self._loaded()}); retry when one finishes, or export with a larger "
                                 f"--max-loras")
        _, index = min(idle)
        self._slots[index].name = None  # evicted: no longer routable by name from here on
        return index

    def add_listener(self, written) -> None:
        """Call ``written(slot)`` each time a slot's rows have been written (load, unload), before the
        slot becomes routable: a runner that keeps its own copies of the stacks (a Ray stage actor)
        copies the slot's rows there. An exception from it fails the load like a failed write."""
        self._listeners.append(written)

    def _write(self, index: int, adapter) -> None:
        # In place, this slot's rows only: other slots' rows are being read by running steps.
        for key, (a_stack, b_stack) in self._arrays.items():
            if key in adapter:
                a_stack[index], b_stack[index] = adapter[key]
            else:
                a_stack[index], b_stack[index] = 0, 0
        for written in self._listeners:
            written(index)

    # -- unloading ----------------------------------------------------------------------------

    def unload(self, name: str) -> None:
        """Remove adapter ``name`` and zero its slot; refused while requests hold it (queued or
        running: a queued request would otherwise fail once its turn came)."""
        with self._lock:
            index = self._slot_of(name)
            if index is None:
                raise GraphkilnError(f"no LoRA adapter named {show(name)} is loaded (loaded: {self._loaded()})")
            slot = self._slots[index]
            if slot.refs:
                raise GraphkilnError(f"LoRA adapter {show(name)} is in use by {slot.refs} queued or running "
                                     f"request(s); unload it after they finish")
            slot.name, slot.busy = None, True
        try:
            self._write(index, {})
        finally:
            with self._lock:
                slot.busy = False
                self.version += 1

    # -- requests -----------------------------------------------------------------------------

    def acquire(self, name: str | None) -> int:
        """The slot for a request using adapter ``name`` (None: the base model, slot 0, uncounted).

        Counts the request against the slot, so it is neither evicted nor unloaded until the matching
        ``release``, and marks the adapter as recently used."""
        if name is None:
            return 0
        with self._lock:
            index = self._slot_of(name)
            if index is None:
                raise GraphkilnError(f"no LoRA adapter named {show(name)} is loaded (loaded: {self._loaded()}); "
                                     f"load it first")
            slot = self._slots[index]
            slot.refs += 1
            self._tick(slot)
            return index

    def release(self, slot: int) -> None:
        """Uncount one request from ``slot`` (0 is a no-op); call after its last step has finished."""
        if slot == 0:
            return
        with self._lock:
            if not (isinstance(slot, int) and 0 < slot <= self.max_loras) or self._slots[slot].refs <= 0:
                raise ValueError(f"release of LoRA slot {slot!r}, which no request holds")  # an engine bug
            self._slots[slot].refs -= 1
            self._tick(self._slots[slot])

    def digest(self, slot: int) -> bytes:
        """A hash of what ``slot`` holds (b"" for slot 0, the base model): equal for the same
        adapter loaded twice, different for different weights under one name (prefix-cache keys)."""
        with self._lock:
            return self._slots[slot].digest if slot else b""

    def refs(self, slot: int) -> int:
        """How many requests (queued or running) hold ``slot``."""
        with self._lock:
            return self._slots[slot].refs if slot else 0
