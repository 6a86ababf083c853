"""Device state: the one device pool both GPU backends use, the memory it lives in, and the
TensorRT runner's step I/O buffers.

``DevicePool`` keeps ``StatePool``'s contract (``runtime.backends.state``: reserve / claim / release,
live slots packed ``0..live-1``, a release moves the last live slot's rows into the hole and
reports the move, a claimed slot's conv rows zeroed: ``PackedSlots`` holds those rules) over
buffers in a ``DeviceMemory``. A captured CUDA graph holds the buffers' addresses, so they are
replaced only between sessions, when the pool must grow (``generation`` then changes, and a
runner drops every graph bound to the old ones). Two sizings, one per backend:

* ``max_slots`` given (TensorRT): allocated once by the constructor at the engine's
  ``max_batch`` slots x ``max_seq_len`` tokens and never replaced (``generation`` stays 1);
  ``reserve`` only checks that a session fits.
* ``max_slots`` None (onnxruntime CUDA): allocated by ``reserve``, at the full ``capacity``
  tokens and the session's slot count rounded up to its decode bucket (``physical_slots``),
  so the same buffers, and the graphs captured over them, serve later sessions of that size
  or smaller; a session needing more slots replaces them.

Layouts are ``StatePool``'s: per attention layer key and value ``[slots, kv_heads, capacity,
head_dim]``, per conv layer ``[slots, channels, width]``, C-contiguous, slot outermost, so the
first ``n`` slots are one contiguous prefix at the buffer's base address (a graph is bound to
the base with batch ``n``), and a slot's rows are one contiguous byte range (a release is one
device-to-device copy per buffer). Each KV buffer is bound as both ``past_*`` input and
``present_*`` output, each in-place conv pool as ``conv_state`` and ``new_conv_state``: the
graph writes its new rows in place (the manifest's ``in_place`` contract).

Memory is reached only through a ``DeviceMemory`` (allocate, free, copy, zero, upload,
download, all ordered on the memory's one stream; ``sync`` waits for them). ``CudaMemory`` is
the CUDA one, over cuda-python's ``cuda.bindings.runtime`` (``cudaMalloc``'d blocks, which
onnxruntime's IOBinding binds by raw address as TensorRT does); ``HostMemory`` is the same
over host memory, which is how the CPU test suite runs the pool and both runners byte for
byte. Whoever hands the memory to work on another stream (onnxruntime's) calls ``sync``
first. Ownership: the pool and ``StepBuffers`` own what they allocate and free it in
``close``; nothing else frees it.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, StateSpec, TensorSpec, is_pool_output
from graphkiln.memory import available_memory
from graphkiln.runtime.backends.cuda_graphs import bucket_for
from graphkiln.runtime.backends.state import PackedSlots

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int8": 1, "uint8": 1, "bool": 1}
_IO_ROLES = ("input_ids", "position_ids", "logits_index", "seq_lens", "slot_idx")
# what to do when the pools do not fit, by sizing (see the module docstring)
_ENGINE_FIX = "rebuild the engine with a smaller --max-batch or --max-seq-len, or free GPU memory"
_SESSION_FIX = "run fewer prompts at once, or re-export with a smaller --max-seq-len"


# -- memory ---------------------------------------------------------------------------------

class DeviceMemory(Protocol):
    """Memory operations in one stream's order; addresses are plain ints. ``device`` and
    ``device_id`` name where the addresses live, as IOBinding takes them ("cuda"/"cpu")."""

    device: str
    device_id: int

    def alloc(self, nbytes: int) -> int: ...  # contents undefined

    def free(self, address: int) -> None: ...

    def copy(self, dst: int, src: int, nbytes: int) -> None: ...  # device to device

    def zero(self, address: int, nbytes: int) -> None: ...

    def upload(self, dst: int, array: np.ndarray) -> None: ...  # host (C-contiguous) to device

    def download(self, out: np.ndarray, src: int) -> None: ...  # device to host, completes before returning

    def sync(self) -> None: ...  # everything issued so far has completed

    def free_bytes(self) -> int | None: ...  # what may still be allocated, None if unknown


@dataclass(frozen=True)
class DeviceBuffer:
    """``shape`` elements of ``dtype`` (the manifest's names) at ``address``, C-contiguous;
    the first dimension is the slot (or batch) row."""

    address: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def row_bytes(self) -> int:
        """Bytes of one index of the first (slot / batch) dimension."""
        return math.prod(self.shape[1:]) * self.itemsize

    def row(self, index: int) -> int:
        return self.address + index * self.row_bytes

    def rows(self, n: int) -> tuple[int, tuple[int, ...]]:
        """(address, shape) of rows ``0..n-1``: the live batch, as a graph binds it."""
        if n > self.shape[0]:
            raise RuntimeError(f"{n} rows of a buffer with {self.shape[0]}")
        return self.address, (n,) + self.shape[1:]


class HostMemory:
    """``DeviceMemory`` over host memory, so the pool and the runners run for real on a machine
    without a GPU. Blocks are numpy arrays this object owns until ``free`` (``blocks``: base
    address -> array); every call checks that it stays inside one block, so a bookkeeping error
    raises instead of corrupting the process. Fresh blocks hold 0xFF bytes (NaN as float32),
    as ``cudaMalloc`` gives no zeroes: a read of memory nobody wrote shows up. ``limit`` is
    what ``free_bytes`` reports (default: the machine's available memory)."""

    device = "cpu"
    device_id = 0

    def __init__(self, limit: int | None = None) -> None:
        self.blocks: dict[int, np.ndarray] = {}
        self.limit = limit

    def alloc(self, nbytes: int) -> int:
        block = np.full(max(nbytes, 1), 0xFF, np.uint8)
        self.blocks[block.ctypes.data] = block
        return block.ctypes.data

    def free(self, address: int) -> None:
        del self.blocks[address]

    def _base(self, address: int, nbytes: int) -> int:
        for base, a in self.blocks.items():
            if base <= address and address + nbytes <= base + a.nbytes:
                return base
        raise RuntimeError(f"HostMemory: [{address:#x}, +{nbytes}) is outside every block")

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._base(dst, nbytes), self._base(src, nbytes)
        ctypes.memmove(dst, src, nbytes)

    def zero(self, address: int, nbytes: int) -> None:
        self._base(address, nbytes)
        ctypes.memset(address, 0, nbytes)

    def upload(self, dst: int, array: np.ndarray) -> None:
        if not array.flags.c_contiguous:
            raise RuntimeError("HostMemory.upload of a non-contiguous array")
        self._base(dst, array.nbytes)
        ctypes.memmove(dst, array.ctypes.data, array.nbytes)

    def download(self, out: np.ndarray, src: int) -> None:
        self._base(src, out.nbytes)
        ctypes.memmove(out.ctypes.data, src, out.nbytes)

    def sync(self) -> None:
        pass

    def free_bytes(self) -> int | None:
        return self.limit if self.limit is not None else available_memory()

    def view(self, buf: DeviceBuffer) -> np.ndarray:
        """A numpy view of ``buf`` (inspection and tests)."""
        from graphkiln.runtime.backends.ort_cpu import numpy_dtype

        base = self._base(buf.address, buf.nbytes)
        start = buf.address - base
        return self.blocks[base][start: start + buf.nbytes].view(numpy_dtype(buf.dtype)).reshape(buf.shape)


def cuda_call(cudart, name: str, *args):
    """``cudart.name(*args)``'s results after its error code; RuntimeError naming the call when
    the code is not success. ``cudart`` is cuda-python's ``cuda.bindings.runtime``."""
    err, *out = getattr(cudart, name)(*args)
    if err != cudart.cudaError_t.cudaSuccess:
        text = cudart.cudaGetErrorString(err)[1]
        raise RuntimeError(f"{name} failed: {text.decode() if isinstance(text, bytes) else text}")
    return out


class CudaMemory:
    """``DeviceMemory`` over the CUDA runtime (cuda-python), every call ordered on ``stream``:
    the TensorRT runner's stream (its enqueues and graph launches share it), or, from ``open``,
    a stream of its own (onnxruntime runs on its own stream: the runner calls ``sync`` before
    each run). Blocks come from ``cudaMalloc``; this object does not track them (their owners
    free them). GPU only: not run where this was written."""

    device = "cuda"

    def __init__(self, cudart, stream, device_id: int = 0, owns_stream: bool = False) -> None:
        self.rt, self.stream, self.device_id, self._owns_stream = cudart, stream, device_id, owns_stream
        self.kinds = cudart.cudaMemcpyKind

    @classmethod
    def open(cls, cudart, device_id: int = 0) -> "CudaMemory":
        """Memory on GPU ``device_id`` with a new stream of its own (freed by ``close``)."""
        cuda_call(cudart, "cudaSetDevice", device_id)
        return cls(cudart, cuda_call(cudart, "cudaStreamCreate")[0], device_id, owns_stream=True)

    def _call(self, name: str, *args):
        return cuda_call(self.rt, name, *args)

    def alloc(self, nbytes: int) -> int:
        try:
            return int(self._call("cudaMalloc", max(nbytes, 1))[0])
        except RuntimeError as exc:
            raise GraphkilnError(f"cannot allocate {nbytes} bytes of GPU memory ({exc}): free GPU memory, or use "
                                 "smaller sizes") from None

    def free(self, address: int) -> None:
        self._call("cudaFree", address)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        self._call("cudaMemcpyAsync", dst, src, nbytes, self.kinds.cudaMemcpyDeviceToDevice, self.stream)

    def zero(self, address: int, nbytes: int) -> None:
        self._call("cudaMemsetAsync", address, 0, nbytes, self.stream)

    def upload(self, dst: int, array: np.ndarray) -> None:
        # pageable source: the call returns once the bytes are staged, so the array may change after
        self._call("cudaMemcpyAsync", dst, array.ctypes.data, array.nbytes, self.kinds.cudaMemcpyHostToDevice,
                   self.stream)

    def download(self, out: np.ndarray, src: int) -> None:
        self._call("cudaMemcpyAsync", out.ctypes.data, src, out.nbytes, self.kinds.cudaMemcpyDeviceToHost,
                   self.stream)
        self.sync()

    def sync(self) -> None:
        self._call("cudaStreamSynchronize", self.stream)

    def free_bytes(self) -> int | None:
        return int(self._call("cudaMemGetInfo")[0])

    def compute_capability(self) -> tuple[int, int]:
        props = self._call("cudaGetDeviceProperties", self.device_id)[0]
        return int(props.major), int(props.minor)

    def close(self) -> None:
        """Destroy the stream ``open`` made (after everything on it has finished)."""
        if self._owns_stream:
            self.sync()
            self._call("cudaStreamDestroy", self.stream)
            self._owns_stream = False


# -- the device pool --------------------------------------------------------------------------

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


class DevicePool(PackedSlots):
    """Per-request state in device memory (see the module docstring for the two sizings).

    ``capacity`` is every buffer's token capacity (the engine's ``max_seq_len``, or the
    artifact's); ``buffers`` maps (``"key"``/``"value"``/``"conv"``, layer) to its buffer.
    Lifecycle: the engine owns the pool for its life; ``reserve`` (only while no slot is live)
    sizes it for a session, refusing with one line what memory cannot hold (the pool is then
    unchanged); requests ``claim`` a slot when they start and ``release`` it when they end
    (a runner's warm-up probes too, before serving); ``close`` frees the buffers, after which
    nothing may run on them. Claims and releases are issued on the memory's stream."""

    def __init__(self, states: tuple[StateSpec, ...], memory: DeviceMemory, capacity: int, *,
                 max_slots: int | None = None, buckets: tuple[int, ...] = ()) -> None:
        if not states or len({s.dtype for s in states}) != 1:
            raise ValueError("a device pool holds states of one dtype")
        self.specs, self.memory, self.buckets = states, memory, buckets
        self.dtype = states[0].dtype
        self.max_capacity = capacity  # most tokens a request can hold: the Engine caps requests by it
        self.max_slots = max_slots
        self.slots = self.capacity = self.physical_slots = self.live = 0
        self.generation = 0  # bumped whenever the buffers are replaced (graphs bound to them go stale)
        self.buffers: dict[tuple[str, int], DeviceBuffer] = {}
        if max_slots is not None:
            self._allocate(max_slots)
            self.slots, self.capacity = max_slots, capacity

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers.values())

    def physical_for(self, slots: int) -> int:
        """Buffer rows for a session of ``slots``: its decode bucket, so padded rows have slots."""
        return max(slots, bucket_for(slots, self.buckets) or slots) if slots else 0

    def reserve(self, slots: int, capacity: int) -> None:
        """Make room for a session of ``slots`` requests x ``capacity`` tokens (see the sizings)."""
        if self.live:
            raise RuntimeError("DevicePool.reserve while slots are live")
        if self.max_slots is not None:
            if slots > self.max_slots or capacity > self.max_capacity:
                raise GraphkilnError(
                    f"this session needs {slots} request(s) x {capacity} tokens but the TensorRT engine was built for "
                    f"at most {self.max_slots} x {self.max_capacity}: pass fewer prompts or a smaller max_new_tokens, "
                    "or rebuild with graphkiln build ART --backend tensorrt --max-batch N --max-seq-len L")
            return
        if capacity > self.max_capacity:
            raise RuntimeError(f"DevicePool.reserve of {capacity} tokens > the pool's {self.max_capacity}")
        physical = self.physical_for(slots)
        if physical > self.physical_slots:
            self._allocate(physical)
        self.slots, self.capacity = slots, capacity

    def _allocate(self, physical: int) -> None:
        """Replace the buffers by zeroed ones of ``physical`` slots; refused (GraphkilnError,
        pool unchanged) when they cannot fit the memory's free bytes plus what the old ones hold."""
        fix = _ENGINE_FIX if self.max_slots is not None else _SESSION_FIX
        shapes = pool_shapes(self.specs, physical, self.max_capacity)
        needed = sum(math.prod(s) * ITEMSIZE[self.dtype] for s in shapes.values())  # exact ints: no overflow
        free = self.memory.free_bytes()
        if free is not None and needed > free + self.nbytes:
            raise GraphkilnError(
                f"the state pools for {physical} slot(s) x {self.max_capacity} tokens need {_gib(needed)} but only "
                f"{_gib(free + self.nbytes)} of {self.memory.device} memory is free: {fix}")
        # The old buffers go first (their memory was counted as free above); until the new ones
        # are all allocated the pool has none, and a failure leaves it so (empty, sized 0).
        self.close()
        self.generation += 1
        try:
            for key, shape in shapes.items():
                buf = DeviceBuffer(self.memory.alloc(math.prod(shape) * ITEMSIZE[self.dtype]), shape, self.dtype)
                self.buffers[key] = buf
                # zeroed once so that no buffer ever holds NaN bit patterns a masked read could pick up
                self.memory.zero(buf.address, buf.nbytes)
        except BaseException as exc:
            self.close()
            if not isinstance(exc, Exception):
                raise
            raise GraphkilnError(
                f"could not allocate the state pools for {physical} slot(s) x {self.max_capacity} tokens in "
                f"{self.memory.device} memory ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                f"{fix}") from None
        self.physical_slots = physical

    def _clear_conv_row(self, slot: int) -> None:
        for (kind, _), b in self.buffers.items():
            if kind == "conv":
                self.memory.zero(b.row(slot), b.row_bytes)

    def _move_row(self, dst: int, src: int) -> None:
        for b in self.buffers.values():
            self.memory.copy(b.row(dst), b.row(src), b.row_bytes)

    def close(self) -> None:
        """Free the buffers (the pool is then empty, 0 slots)."""
        buffers, self.buffers = self.buffers, {}
        self.physical_slots = 0
        for b in buffers.values():
            self.memory.free(b.address)


# -- the TensorRT runner's step bindings ---------------------------------------------------------

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
    each: step inputs from ``io`` (by role), the pool's buffers for the state (whole buffers:
    ``cache_len`` is their token capacity, ``slots`` their slot rows), logits into ``logits``.
    Refuses (ValueError) a step that does not fit the buffers it is bound to."""
    dims = {"batch": batch, "seq": seq, "n_logits": n_logits, "cache_len": pool.max_capacity,
            "slots": pool.physical_slots}
    if batch > pool.physical_slots:
        raise ValueError(f"a step of {batch} rows does not fit a pool of {pool.physical_slots} slots")
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
                self.io[role] = DeviceBuffer(memory.alloc(math.prod(shape) * 8), shape, "int64")
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
            self.logits = DeviceBuffer(self.memory.alloc(logit_rows * self.vocab * 4), (logit_rows, self.vocab),
                                       "float32")
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
