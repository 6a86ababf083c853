"""State pools and step I/O buffers in device memory, at addresses that never move.

``DevicePool`` keeps ``StatePool``'s contract (``runtime.state``: reserve / claim / release,
live slots packed ``0..live-1``, a release moves the last live slot's rows into the hole, a
claimed slot's conv rows zeroed) over buffers allocated once, at the engine's fixed size
``max_batch`` slots x ``max_seq_len`` tokens, for the pool's whole life: a captured CUDA graph
holds their addresses, so they must never be replaced. ``reserve`` therefore only checks that a
session fits; it never reallocates (``generation`` stays 1).

Layouts are ``StatePool``'s: per attention layer key and value ``[slots, kv_heads, capacity,
head_dim]``, per conv layer ``[slots, channels, width]``, C-contiguous, slot outermost, so the
first ``n`` slots are one contiguous prefix at the buffer's base address (the graph is bound
to the base with batch ``n``), and a slot's rows are one contiguous byte range (a release is
one device-to-device copy per buffer). Each KV buffer is bound as both ``past_*`` input and
``present_*`` output, each conv pool as ``conv_state`` and ``new_conv_state``: the graph
writes its new rows in place (the manifest's ``in_place`` contract).

Memory is reached only through a ``DeviceMemory`` (allocate, free, copy, fill, upload,
download, all ordered on one stream): the TensorRT runner passes one over CUDA
(``trt_runner.CudaMemory``); the CPU tests pass one over host memory, so everything here runs
for real on CPU. Ownership: the pool and ``StepBuffers`` own what they allocate and free it in
``close``; nothing else frees it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, StateSpec, TensorSpec, is_pool_output

STATE_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_IO_ROLES = ("input_ids", "position_ids", "logits_index", "seq_lens", "slot_idx")


class DeviceMemory(Protocol):
    """Device memory operations, in stream order; addresses are plain ints."""

    def alloc(self, nbytes: int) -> int: ...

    def free(self, address: int) -> None: ...

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...  # device to device

    def zero(self, address: int, nbytes: int) -> None: ...

    def upload(self, dst: int, array: np.ndarray) -> None: ...  # host (C-contiguous) to device

    def download(self, out: np.ndarray, src: int) -> None: ...  # device to host, completes before returning

    def free_bytes(self) -> int | None: ...  # what may still be allocated, None if unknown


@dataclass(frozen=True)
class DeviceBuffer:
    """``shape`` elements of ``itemsize`` bytes at ``address``, C-contiguous."""

    address: int
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first (slot / batch) dimension."""
        return math.prod(self.shape[1:]) * self.itemsize

    def row(self, index: int) -> int:
        return self.address + index * self.row_bytes


def pool_shapes(states: tuple[StateSpec, ...], slots: int, capacity: int) -> dict[tuple[str, int], tuple[int, ...]]:
    """(``"key"``/``"value"``/``"conv"``, layer) -> buffer shape (``StatePool``'s layouts)."""
    shapes: dict[tuple[str, int], tuple[int, ...]] = {}
    for spec in states:
        for layer in spec.layers:
            if spec.kind == "kv":
                shapes["key", layer] = shapes["value", layer] = (slots, spec.num_kv_heads, capacity, spec.head_dim)
            else:
                shapes["conv", layer] = (slots, spec.channels, spec.width)
    return shapes


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class DevicePool:
    """Device state for ``slots`` requests of up to ``capacity`` tokens (see the module docstring).

    Lifecycle: allocated (and zeroed) by the constructor, refused with one line if it would
    not fit the device's free memory; the runner's warm-up claims and releases probe slots;
    the engine then claims a slot per request and releases it when the request ends; ``close``
    frees the buffers (after which nothing may run on them)."""

    def __init__(self, states: tuple[StateSpec, ...], slots: int, capacity: int, memory: DeviceMemory) -> None:
        if not states or len({s.dtype for s in states}) != 1:
            raise ValueError("a device pool holds states of one dtype")
        self.specs = states
        self.itemsize = STATE_ITEMSIZE[states[0].dtype]
        self.slots, self.capacity = slots, capacity
        self.live = 0
        self.generation = 1  # the buffers are never replaced (see StatePool.generation)
        self.memory = memory
        shapes = pool_shapes(states, slots, capacity)
        needed = sum(math.prod(s) * self.itemsize for s in shapes.values())
        free = memory.free_bytes()
        if free is not None and needed > free:
            raise GraphkilnError(
                f"the device state pools for {slots} request(s) x {capacity} tokens need {_gib(needed)} but only "
                f"{_gib(free)} of device memory is free: rebuild the engine with a smaller --max-batch or --max-seq-len")
        self.buffers: dict[tuple[str, int], DeviceBuffer] = {}
        try:
            for key, shape in shapes.items():
                buf = DeviceBuffer(memory.alloc(math.prod(shape) * self.itemsize), shape, self.itemsize)
                self.buffers[key] = buf
                # zeroed once so that no buffer ever holds NaN bit patterns a masked read could pick up
                memory.zero(buf.address, buf.nbytes)
        except BaseException:
            self.close()
            raise
        self._conv = [b for (kind, _), b in self.buffers.items() if kind == "conv"]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    @property
    def free_slots(self) -> int:
        return self.slots - self.live

    @property
    def max_capacity(self) -> int:
        """Most tokens a request can hold (the engine's build-time max_seq_len): the Engine caps requests by it."""
        return self.capacity

    def reserve(self, slots: int, capacity: int) -> None:
        """Check that a session of ``slots`` requests x ``capacity`` tokens fits; allocates nothing."""
        if self.live:
            raise RuntimeError("DevicePool.reserve while slots are live")
        if slots > self.slots or capacity > self.capacity:
            raise GraphkilnError(
                f"this session needs {slots} request(s) x {capacity} tokens but the TensorRT engine was built for at "
                f"most {self.slots} x {self.capacity}: pass fewer prompts or a smaller max_new_tokens, or rebuild with "
                "graphkiln build ART --backend tensorrt --max-batch N --max-seq-len L")

    def claim(self) -> int:
        if self.live >= self.slots:
            raise RuntimeError("DevicePool has no free slot")
        slot = self.live
        self.live += 1
        # conv state is read from the first step (KV rows are written before they are read)
        for b in self._conv:
            self.memory.zero(b.row(slot), b.row_bytes)
        return slot

    def release(self, slot: int) -> int | None:
        """Free ``slot``; if another live slot's rows moved into it, return that slot's old index."""
        if not 0 <= slot < self.live:
            raise RuntimeError(f"DevicePool.release of slot {slot} that is not live")
        last = self.live - 1
        self.live -= 1
        if slot == last:
            return None
        for b in self.buffers.values():
            self.memory.copy(b.row(slot), b.row(last), b.row_bytes)
        return last

    def close(self) -> None:
        buffers, self.buffers = self.buffers, {}
        for b in buffers.values():
            self.memory.free(b.address)


@dataclass(frozen=True)
class StepBinding:
    """One step's bindings: every input's shape and every input's and output's address.

    Each ``present_*`` output has its ``past_*`` input's address and each in-place conv pool
    output its ``conv_state``'s: the graph updates the state in place."""

    shapes: Mapping[str, tuple[int, ...]]  # inputs only (outputs' shapes follow from them)
    addresses: Mapping[str, int]  # inputs and outputs


def resolve(shape: tuple[int | str, ...], dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(dims[d] if isinstance(d, str) else d for d in shape)


def check_in_place(spec: GraphSpec) -> None:
    """The runner binds state, it never stores returned rows: refuse a graph that returns rows,
    or that reads an input this runner does not bind."""
    for t in spec.inputs:
        if t.role not in _IO_ROLES + ("past_key", "past_value", "conv_state"):
            raise GraphkilnError(f"graph {spec.file} reads {t.name} ({t.role}), which the engine runner does not "
                                 "bind yet: run this artifact with the onnxruntime backend")
    for t in spec.outputs:
        if t.role in ("new_key", "new_value") or (t.role == "new_conv_state" and not is_pool_output(t)):
            raise GraphkilnError(f"graph {spec.file} returns new state rows ({t.name}); engines run graphs that "
                                 "update their state in place: re-export with --target tensorrt and rebuild")


def bind_step(spec: GraphSpec, pool: DevicePool, io: Mapping[str, DeviceBuffer], logits: DeviceBuffer,
              batch: int, seq: int, n_logits: int) -> StepBinding:
    """Shapes and addresses of a step of ``batch`` rows x ``seq`` tokens with ``n_logits`` logits
    each: step inputs from ``io`` (by role), the pool's buffers for the state (whole capacity:
    ``cache_len`` is the pool's capacity, ``slots`` its slot count), logits into ``logits``.
    Refuses (ValueError) a step that does not fit the buffers it is bound to."""
    dims = {"batch": batch, "seq": seq, "n_logits": n_logits, "cache_len": pool.capacity, "slots": pool.slots}
    if batch > pool.slots:
        raise ValueError(f"a step of {batch} rows does not fit a pool of {pool.slots} slots")
    shapes: dict[str, tuple[int, ...]] = {}
    addresses: dict[str, int] = {}
    state_address: dict[tuple[str, int | None], int] = {}
    for t in spec.inputs:
        shape = resolve(t.shape, dims)
        buf = _input_buffer(t, pool, io)
        if math.prod(shape) * buf.itemsize > buf.nbytes:
            raise ValueError(f"{t.name} {list(shape)} does not fit its buffer {list(buf.shape)}")
        shapes[t.name], addresses[t.name] = shape, buf.address
        state_address[t.role, t.layer] = buf.address
    for t in spec.outputs:
        if t.role == "logits":
            shape = resolve(t.shape, dims)
            if math.prod(shape) * logits.itemsize > logits.nbytes:
                raise ValueError(f"{t.name} {list(shape)} does not fit its buffer {list(logits.shape)}")
            addresses[t.name] = logits.address
        elif t.role in ("present_key", "present_value"):
            addresses[t.name] = state_address[t.role.replace("present_", "past_"), t.layer]
        elif is_pool_output(t):
            addresses[t.name] = state_address["conv_state", t.layer]
        else:
            raise ValueError(f"output {t.name} ({t.role}) is not updated in place (check_in_place refuses it)")
    return StepBinding(shapes, addresses)


def _input_buffer(t: TensorSpec, pool: DevicePool, io: Mapping[str, DeviceBuffer]) -> DeviceBuffer:
    if t.role in ("past_key", "past_value"):
        return pool.buffers["key" if t.role == "past_key" else "value", t.layer]
    if t.role == "conv_state":
        return pool.buffers["conv", t.layer]
    return io[t.role]


class StepBuffers:
    """Device buffers for one phase's step inputs (int64, by role) and its logits (float32).

    ``rows x cols`` sizes the ``[batch, seq]``/``[batch, n_logits]`` inputs and the per-row ones;
    the logits buffer holds ``rows x logit_rows x vocab`` and is regrown by ``ensure_logits``
    (only for eager steps: a captured graph's logits buffer must never move, so decode sizes
    it once). Owned by the runner; freed by ``close``."""

    def __init__(self, memory: DeviceMemory, roles: tuple[str, ...], rows: int, cols: int, vocab: int,
                 logit_rows: int) -> None:
        self.memory, self.rows, self.cols, self.vocab = memory, rows, cols, vocab
        self.io: dict[str, DeviceBuffer] = {}
        self.logits: DeviceBuffer | None = None
        try:
            for role in roles:
                shape = (rows,) if role in ("seq_lens", "slot_idx") else (rows, cols)
                self.io[role] = DeviceBuffer(memory.alloc(math.prod(shape) * 8), shape, 8)
            self.ensure_logits(rows * logit_rows)
        except BaseException:
            self.close()
            raise

    def ensure_logits(self, logit_rows: int) -> DeviceBuffer:
        """A logits buffer of at least ``logit_rows`` x vocab float32 (the same one if large enough)."""
        if self.logits is None or self.logits.shape[0] < logit_rows:
            if self.logits is not None:
                self.memory.free(self.logits.address)
                self.logits = None
            self.logits = DeviceBuffer(self.memory.alloc(logit_rows * self.vocab * 4), (logit_rows, self.vocab), 4)
        return self.logits

    def upload(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Copy each role's int64 rows into the front of its buffer (the shapes bound with it)."""
        for role, buf in self.io.items():
            a = np.ascontiguousarray(arrays[role], dtype=np.int64)
            if a.nbytes > buf.nbytes:
                raise ValueError(f"{role} {list(a.shape)} does not fit its buffer {list(buf.shape)}")
            self.memory.upload(buf.address, a)

    def close(self) -> None:
        for buf in self.io.values():
            self.memory.free(buf.address)
        self.io = {}
        if self.logits is not None:
            self.memory.free(self.logits.address)
            self.logits = None


def step_arrays(input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
                lengths: np.ndarray) -> dict[str, np.ndarray]:
    """A step's inputs by role; rows are slots ``0..n-1``, so ``slot_idx`` is ``arange(n)``."""
    n = input_ids.shape[0]
    return {"input_ids": input_ids, "position_ids": position_ids, "logits_index": logits_index,
            "seq_lens": lengths, "slot_idx": np.arange(n, dtype=np.int64)}


def io_roles(spec: GraphSpec) -> tuple[str, ...]:
    """The step-input roles ``spec`` reads (not state), in ``_IO_ROLES`` order."""
    have = {t.role for t in spec.inputs}
    return tuple(r for r in _IO_ROLES if r in have)
