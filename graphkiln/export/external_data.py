"""Save an ``onnx_ir`` model as a graph file plus one external data file, quickly.

The layout is the one ``onnx_ir.save(model, path, external_data=...)`` writes: every
initializer (main graph and subgraphs) over ``size_threshold`` bytes packed densely, in
declaration order, into one data file; smaller ones stay inline. Only the writing differs:
onnx_ir writes each tensor with ``numpy.ndarray.tofile``, which goes element by element for
the non-contiguous views that constant folding leaves behind (a folded ``Transpose`` of a
weight is a lazy numpy transpose), about 7 s per GB. Here contiguous tensors are written
straight from their memory, strided ones are made contiguous a block at a time with torch's
copy kernel into a few reused buffers, and a second thread writes each block while the next
is being made (both release the GIL). Bytes are copied once; memory stays flat. The model
is unchanged afterwards.

Every floating-point initializer is checked for NaN/Inf as it is written, one block at a time
while the previous block is being written (no extra pass over the weights): a non-finite weight
gives NaN logits, so it raises ``NonFiniteWeight`` naming the initializer instead.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

# onnx_ir.save's default: tensors of at most this many bytes stay inline in the graph file.
SIZE_THRESHOLD = 256
# Bytes per write() and per strided block: large enough to amortise calls and to copy a
# typical per-layer weight whole, small enough that the few scratch buffers stay cheap
# (fresh pages are slow to fault in on some VMs).
_BLOCK = 16 << 20
# Blocks queued for the writer thread beyond the one it is writing.
_QUEUE_DEPTH = 2
# Same-width integer views: the copy moves bytes, so any dtype of that width (ml_dtypes'
# bfloat16 and float8 included) goes through the integer one without conversion.
_INT_OF_WIDTH = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
# Sub-blocks checked for non-finite values at a time: the bool scratch stays in cache.
_CHECK_STEP = 1 << 18

# The location of an initializer whose bytes are not written yet (``defer``): the streamed export
# declares every weight in the graph but makes its bytes only when the final data file is written.
DEFERRED_LOCATION = "graphkiln-deferred"
# out_dir -> {initializer name -> producer}: what ``read_initializer`` and ``rewrite_external_data``
# call for a deferred initializer. Entries live until ``forget_deferred(out_dir)`` (the export's end).
_DEFERRED: dict[Path, dict[str, object]] = {}


def defer(tensor, producer, base_dir) -> None:
    """Declare ``tensor`` (an ``onnx.TensorProto`` with name, type and dims set, no data) as deferred:
    its bytes are ``producer()`` (a numpy array of exactly that type and shape, or an object with
    ``numpy()``), made when a pass reads it (``read_initializer``) or when the data file is written
    (``rewrite_external_data``). A producer is called once per use and should not keep its result,
    so at most the tensor being written is in memory."""
    from onnx import TensorProto

    tensor.data_location = TensorProto.EXTERNAL
    for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", DEFERRED_LOCATION
    _DEFERRED.setdefault(Path(base_dir).resolve(), {})[tensor.name] = producer


def deferred_producer(init, base_dir):
    """The producer ``defer`` registered for this initializer, or None when it is not deferred."""
    from onnx import TensorProto

    if init.data_location != TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in init.external_data}
    if info.get("location") != DEFERRED_LOCATION:
        return None
    producer = _DEFERRED.get(Path(base_dir).resolve(), {}).get(init.name) if base_dir is not None else None
    if producer is None:
        raise ValueError(f"initializer {init.name!r} is deferred but nothing produces it")
    return producer


def has_deferred(model) -> bool:
    """Whether any main-graph initializer of this ``onnx.ModelProto`` is still deferred."""
    return any(e.key == "location" and e.value == DEFERRED_LOCATION for t in model.graph.initializer
               for e in t.external_data)


def forget_deferred(base_dir) -> None:
    _DEFERRED.pop(Path(base_dir).resolve(), None)


def _produce(producer, init) -> np.ndarray:
    from onnx import helper

    arr = producer() if callable(producer) else producer.numpy()
    arr = np.asarray(arr)
    expected = tuple(init.dims)
    if arr.shape != expected:
        raise ValueError(f"deferred initializer {init.name!r} was made with shape {arr.shape}, declared {expected}")
    want = helper.tensor_dtype_to_np_dtype(init.data_type)
    if arr.dtype.itemsize != np.dtype(want).itemsize:
        raise ValueError(f"deferred initializer {init.name!r} was made as {arr.dtype}, declared {want}")
    return arr


class NonFiniteWeight(GraphkilnError):
    """An initializer holds NaN or +-Inf. ``initializer`` is its ONNX name (usually the torch
    parameter's, ``.T`` appended when the exporter stored it transposed); callers that know the
    checkpoint map it back to the checkpoint's tensor name."""

    def __init__(self, initializer: str) -> None:
        self.initializer = initializer
        super().__init__(f"weight '{initializer}' has NaN or infinite values: the checkpoint is corrupt or "
                         "was saved from a diverged run; re-download it or export another checkpoint")


def _finite_check(arr: np.ndarray | None):
    """A function telling whether a block of ``arr``'s C-order bytes is all finite, or None for
    arrays that cannot hold NaN/Inf (integers) and for None (bytes not a plain array)."""
    if arr is None:
        return None
    dtype = arr.dtype
    if dtype in (np.float16, np.float32, np.float64):
        scratch = np.empty(_CHECK_STEP, dtype=bool)

        def check(block) -> bool:
            values = np.frombuffer(block, dtype=dtype)
            for start in range(0, len(values), _CHECK_STEP):
                part = values[start: start + _CHECK_STEP]
                out = scratch[: len(part)]
                np.isfinite(part, out=out)
                if not out.all():
                    return False
            return True

        return check
    if dtype.name == "bfloat16":  # ml_dtypes: all exponent bits set is Inf or NaN
        def check_bf16(block) -> bool:
            bits = np.frombuffer(block, dtype=np.uint16)
            return not ((bits & 0x7F80) == 0x7F80).any()

        return check_bf16
    return None


def check_finite(name: str, tensor) -> None:
    """Raise ``NonFiniteWeight`` when a (small, in-graph) float initializer is not all finite."""
    arr = _plain_array(tensor)
    check = _finite_check(arr)
    if check is not None:
        arr = np.ascontiguousarray(arr)
        if arr.size and not check(memoryview(arr.reshape(-1).view(np.uint8))):
            raise NonFiniteWeight(name)


def save_model(model, path: Path, data_name: str | None = None, size_threshold: int = SIZE_THRESHOLD,
               defer_streamed: bool = False, progress: str | None = None) -> None:
    """Write ``model`` to ``path`` and its large initializers to ``data_name`` next to it
    (default: ``<file name>.data``), replacing both files. Streamed weights
    (``export.streamed_weights``) are read from the checkpoint as they are written; with
    ``defer_streamed`` they are not written at all but declared deferred (``defer``), for a
    lowering that rewrites the data file anyway (quantization) to make them once, there."""
    import onnx_ir as ir

    from graphkiln.export.streamed_weights import is_streamed

    path = Path(path)
    data_name = data_name or f"{path.name}.data"
    values = [v for graph in model.graphs() for v in graph.initializers.values()]
    missing = [v.name for v in values if v.const_value is None]
    if missing:
        raise ValueError(f"the model has initializers without values: {missing[:5]}")
    deferred = [v for v in values if defer_streamed and is_streamed(v.const_value)]
    values = [v for v in values if not (defer_streamed and is_streamed(v.const_value))]
    big = [v for v in values if v.const_value.nbytes > size_threshold]
    for v in values:  # the ones staying inline are checked here, the others as they are written
        if v.const_value.nbytes <= size_threshold:
            check_finite(v.name, v.const_value)
    originals = [v.const_value for v in big]
    streamed = [v.const_value for v in deferred]
    try:
        with open(path.parent / data_name, "wb", buffering=0) as f:
            with _bar(progress, sum(t.nbytes for t in originals), "B") as bar:
                lengths = _write_tensors(f, originals, [v.name for v in big], bar)
        offset = 0
        for value, tensor, length in zip(big, originals, lengths):
            if length != tensor.nbytes:  # a wrong layout would load as garbage: refuse
                raise ValueError(f"initializer {value.name}: wrote {length} bytes, expected {tensor.nbytes}")
            value.const_value = ir.ExternalTensor(
                data_name, offset, length, tensor.dtype, shape=tensor.shape, name=tensor.name,
                doc_string=tensor.doc_string, metadata_props=dict(tensor.metadata_props), base_dir=path.parent,
            )
            offset += length
        for value, tensor in zip(deferred, streamed):
            value.const_value = ir.ExternalTensor(DEFERRED_LOCATION, 0, tensor.nbytes, tensor.dtype, shape=tensor.shape,
                                                  name=tensor.name, base_dir=path.parent)
        ir.save(model, path)  # external tensors keep their location/offset/length
        for value, tensor in zip(deferred, streamed):
            _DEFERRED.setdefault(path.parent.resolve(), {})[value.name] = tensor
    finally:
        for value, tensor in zip(big, originals):
            value.const_value = tensor
        for value, tensor in zip(deferred, streamed):
            value.const_value = tensor


def _bar(description: str | None, total: int, unit: str):
    """A tqdm progress bar (a disabled one without ``description``), with ETA."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, unit=unit, unit_scale=unit == "B", disable=description is None,
                leave=False, mininterval=1.0)


def _write_tensors(f, tensors, names=None, bar=None) -> list[int]:
    """Append each tensor's bytes to ``f``; returns the bytes written per tensor. Float tensors are
    checked block by block for NaN/Inf (in this thread, while the writer writes the previous block);
    the first non-finite one raises ``NonFiniteWeight`` with its name (``names[i]``)."""
    pool = _BufferPool()
    lengths = []
    names = names or [getattr(t, "name", None) or f"#{i}" for i, t in enumerate(tensors)]
    # One worker: writes run in submission order, so the file is laid out sequentially.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="external-data") as writer:
        pending: deque = deque()  # (write future, scratch buffer to recycle or None), oldest first
        try:
            for tensor, name in zip(tensors, names):
                length = 0
                for piece in _pieces(tensor):
                    arr = _plain_array(piece)
                    check = _finite_check(arr)
                    for block, scratch in _blocks(piece, pool, arr):
                        if check is not None and not check(block):
                            raise NonFiniteWeight(name)
                        pending.append((writer.submit(_write_all, f, block), scratch))
                        length += len(block)
                        if bar is not None:
                            bar.update(len(block))
                        while len(pending) > _QUEUE_DEPTH:
                            _finish(pending.popleft(), pool)
                    del arr
                lengths.append(length)
            while pending:
                _finish(pending.popleft(), pool)
        finally:  # on error: let queued writes finish before the file closes
            for future, _ in pending:
                future.cancel()
    return lengths


def _pieces(tensor):
    """The tensor as consecutive row bands to write: a streamed weight's own bands
    (``export.streamed_weights``), read one at a time; any other tensor whole."""
    pieces = getattr(tensor, "pieces", None)
    if pieces is None:
        yield tensor
        return
    import onnx_ir as ir

    for band in pieces():
        yield ir.Tensor(band)


def _finish(item, pool: _BufferPool) -> None:
    future, scratch = item
    future.result()  # re-raises the writer's error here, in the caller's thread
    if scratch is not None:
        pool.give_back(scratch)


class _BufferPool:
    """Reused scratch buffers of ``_BLOCK`` bytes (or one row, if a row is larger)."""

    def __init__(self) -> None:
        self.free: list = []

    def take(self, nbytes: int):
        import torch

        while self.free:
            buf = self.free.pop()
            if buf.numel() >= nbytes:
                return buf
        return torch.empty(max(nbytes, _BLOCK), dtype=torch.uint8)

    def give_back(self, buf) -> None:
        self.free.append(buf)


def _blocks(tensor, pool: _BufferPool, arr: np.ndarray | None) -> Iterator[tuple[memoryview, object]]:
    """(bytes, scratch buffer holding them or None) for each block of the tensor, in order;
    ``arr`` is ``_plain_array(tensor)``."""
    if arr is None:  # packed 4-bit, strings, big-endian hosts...: the tensor's own serializer
        yield memoryview(tensor.tobytes()), None
        return
    if arr.flags.c_contiguous:
        flat = memoryview(arr.reshape(-1).view(np.uint8))
        step = max(arr.itemsize, _BLOCK - _BLOCK % arr.itemsize)  # whole elements: blocks are checked as values
        for start in range(0, len(flat), step):
            yield flat[start: start + step], None
        return
    yield from _strided_blocks(arr, pool)


def _plain_array(tensor) -> np.ndarray | None:
    """A numpy array whose memory, in C order, is exactly the tensor's serialized bytes; None
    when that does not hold (then ``tobytes`` is the only faithful serializer)."""
    if sys.byteorder != "little":
        return None
    try:
        arr = tensor.numpy()
    except Exception:  # some tensor kinds cannot expose an array: let tobytes() decide
        return None
    if not isinstance(arr, np.ndarray) or arr.dtype.hasobject or arr.dtype.itemsize not in _INT_OF_WIDTH:
        return None
    if arr.nbytes != tensor.nbytes or not arr.dtype.isnative:  # e.g. 4-bit types unpack to a byte each
        return None
    return arr


def _strided_blocks(arr: np.ndarray, pool: _BufferPool) -> Iterator[tuple[memoryview, object]]:
    """C-order bytes of a non-contiguous array, copied a band of rows at a time into pool buffers.

    ``arr`` has at least one row: 0-d and empty arrays are contiguous. torch copies a whole
    transposed matrix with a cache-blocked kernel but a band of its rows element by element
    (5-20x slower), so a tensor that fits one block is copied whole, and a larger transposed
    matrix band by band in two cache-friendly steps (see ``_copy_band``).
    """
    import torch

    ints = arr.view(_INT_OF_WIDTH[arr.dtype.itemsize])
    rows = arr.shape[0] if arr.nbytes <= _BLOCK else max(1, _BLOCK // (arr.nbytes // arr.shape[0]))
    try:
        src = torch.from_numpy(ints)
    except (TypeError, ValueError, RuntimeError):  # e.g. negative strides: numpy copies instead
        for start in range(0, arr.shape[0], rows):
            yield memoryview(np.ascontiguousarray(ints[start: start + rows]).reshape(-1).view(np.uint8)), None
        return
    staging = None
    for start in range(0, arr.shape[0], rows):
        part = src[start: start + rows]
        nbytes = part.numel() * part.element_size()
        scratch = pool.take(nbytes)
        dst = scratch[:nbytes].view(part.dtype).view(part.shape)
        if rows < arr.shape[0] and part.dim() == 2 and part.stride(0) == 1:
            staging = staging if staging is not None and staging.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8)
            _copy_band(dst, part, staging[:nbytes].view(part.dtype))
        else:
            dst.copy_(part)
        yield memoryview(dst.numpy().reshape(-1).view(np.uint8)), scratch


def _copy_band(dst, band, staging) -> None:
    """dst[:] = band, for a band of rows of a transposed matrix (strides (1, ld)).

    First gather the band's columns (runs of contiguous source elements) into ``staging``,
    then transpose that whole small matrix, which torch does with its blocked kernel.
    """
    cols = staging.view(band.shape[1], band.shape[0])
    cols.copy_(band.t())
    dst.copy_(cols.t())


def _write_all(f, chunk) -> int:
    """write() until the whole chunk is on disk (a raw write may be partial)."""
    view = memoryview(chunk).cast("B")
    done = 0
    while done < len(view):
        done += f.write(view[done:])
    return done


def read_initializer(init, base_dir) -> np.ndarray:
    """An initializer as an array, read from its external-data file (relative to ``base_dir``)
    if it is not loaded: only its own bytes, so a pass can visit weights one at a time."""
    from onnx import TensorProto, helper, numpy_helper

    if init.data_location != TensorProto.EXTERNAL or init.HasField("raw_data"):
        return numpy_helper.to_array(init)
    producer = deferred_producer(init, base_dir)
    if producer is not None:
        return _produce(producer, init)
    if base_dir is None:
        raise ValueError(f"initializer {init.name!r} is stored as external data: pass base_dir")
    info = {e.key: e.value for e in init.external_data}
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(init.data_type))
    count = int(np.prod(init.dims))
    offset = int(info.get("offset", 0))
    if "length" in info and int(info["length"]) != count * dtype.itemsize:
        raise ValueError(f"initializer {init.name!r}: external length {info['length']} does not match its shape")
    arr = np.fromfile(Path(base_dir) / info["location"], dtype=dtype, count=count, offset=offset)
    if arr.size != count:
        raise ValueError(f"initializer {init.name!r}: external data file is truncated")
    return arr.reshape(tuple(init.dims))


def rewrite_external_data(model, path: Path, size_threshold: int = 1024, extra_data_name: str | None = None,
                          progress: str | None = None) -> None:
    """Save an ``onnx.ModelProto`` whose main-graph initializers are partly in memory and partly
    still in ``path``'s data file (``<file name>.data``), replacing both files.

    The new data file is written one initializer at a time, in order: bytes still on disk are
    copied over in blocks, in-memory tensors over ``size_threshold`` bytes are written and
    moved out of the proto. So memory holds only what a pass changed (the lowering's new
    tensors), never the whole model, as ``onnx.save(..., save_as_external_data=True)`` would
    after loading every weight.

    With ``extra_data_name`` the data file is shared with other graphs and left untouched:
    initializers still on disk keep pointing into it, and only the in-memory ones are written,
    to ``extra_data_name`` (beside ``path``).

    Deferred initializers (``defer``) are made here, one at a time in initializer order, checked
    for NaN/Inf and written; ``progress`` (a description) shows a progress bar over them.
    """
    import os

    import onnx
    from onnx import TensorProto, helper, numpy_helper

    path = Path(path)
    data_name = f"{path.name}.data"
    old, new = path.parent / data_name, path.parent / f"{data_name}.partial"
    if extra_data_name is not None:
        old, new, data_name = path.parent / extra_data_name, path.parent / f"{extra_data_name}.partial", extra_data_name
    offset = 0
    pool = _BufferPool()
    # by bytes of the tensors to make: a quantized weight's codes dominate, and its cost goes with them
    bar = _bar(progress, sum(_declared_bytes(t) for t in model.graph.initializer
                             if deferred_producer(t, path.parent) is not None), "B")
    with bar, open(new, "wb", buffering=0) as dst, open(old, "rb") if old.exists() else open(os.devnull, "rb") as src:
        for t in model.graph.initializer:
            producer = deferred_producer(t, path.parent)
            small = producer is not None and _declared_bytes(t) <= size_threshold
            if small:  # inline, as a small tensor made in memory would be (same rule as below)
                arr = np.ascontiguousarray(_produce(producer, t))
                check_finite(t.name, _NumpyTensor(arr))
                saved = list(t.external_data)
                del t.external_data[:]
                t.data_location = TensorProto.DEFAULT
                t.raw_data = arr.tobytes()
                if t.ByteSize() <= size_threshold:
                    continue
                t.ClearField("raw_data")
                t.data_location = TensorProto.EXTERNAL
                t.external_data.extend(saved)
            if producer is not None:  # made now, written, and let go
                pieces = producer.pieces() if hasattr(producer, "pieces") else (_produce(producer, t),)
                length = 0
                for arr in pieces:
                    plain = _plain_array_np(arr)
                    check = _finite_check(plain)
                    for block, scratch in _blocks(_NumpyTensor(arr), pool, plain):
                        if check is not None and not check(block):
                            raise NonFiniteWeight(t.name)
                        length += _write_all(dst, block)
                        if scratch is not None:
                            pool.give_back(scratch)
                    del arr, plain
                expected = _declared_bytes(t)
                if length != expected:
                    raise ValueError(f"deferred initializer {t.name!r}: wrote {length} bytes, expected {expected}")
                bar.update(_declared_bytes(t))
            elif t.data_location == TensorProto.EXTERNAL and extra_data_name is not None:
                continue  # stays in the shared data file
            elif t.data_location == TensorProto.EXTERNAL:
                info = {e.key: e.value for e in t.external_data}
                if info.get("location") != data_name:
                    raise ValueError(f"initializer {t.name!r} lives in {info.get('location')!r}, not {data_name!r}")
                length = int(info["length"])
                src.seek(int(info.get("offset", 0)))
                left = length
                while left:
                    chunk = src.read(min(left, _BLOCK))
                    if not chunk:
                        raise ValueError(f"initializer {t.name!r}: {data_name} is truncated")
                    _write_all(dst, chunk)
                    left -= len(chunk)
            elif t.ByteSize() > size_threshold:
                raw = t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
                length = _write_all(dst, raw)
                for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                    t.ClearField(field)
                t.data_location = TensorProto.EXTERNAL
            else:
                continue
            del t.external_data[:]
            for key, value in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            offset += length
    onnx.save(model, str(path))
    os.replace(new, old)
    old.chmod(path.stat().st_mode & 0o777)


def _declared_bytes(t) -> int:
    from onnx import helper

    return int(np.prod(t.dims, dtype=np.int64)) * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize


def _plain_array_np(arr: np.ndarray) -> np.ndarray | None:
    """``_plain_array`` for a numpy array."""
    if sys.byteorder != "little" or arr.dtype.hasobject or arr.dtype.itemsize not in _INT_OF_WIDTH:
        return None
    return arr


class _NumpyTensor:
    """The ``tobytes`` fallback ``_blocks`` needs, over a numpy array."""

    def __init__(self, arr: np.ndarray) -> None:
        self.arr = arr

    def tobytes(self) -> bytes:
        return self.arr.tobytes()

    def numpy(self) -> np.ndarray:
        return self.arr

    @property
    def nbytes(self) -> int:
        return self.arr.nbytes
