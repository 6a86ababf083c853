"""Weight-only quantization for onnxruntime: Linear layers to ``com.microsoft.MatMulNBits``, the
embedding to ``com.microsoft.GatherBlockQuantized``.

On CPU, decoding one token reads every weight once, so decode speed is bound by memory
bandwidth and by the bytes of weights per token. This pass stores the Linear weights
(q/k/v/o, MLP, lm_head, tied or not) as 4- or 8-bit integers, block-wise along K (the input features),
and runs them with onnxruntime's ``MatMulNBits`` contrib op, which dequantizes on the fly.

What the exporter emits, and what is rewritten:

* ``MatMul(A, B)`` with ``B`` a 2-D float initializer ``[K, N]`` (the exporter stores Linear
  weights pre-transposed; ``A`` is ``[batch, seq, K]``) -> ``MatMulNBits(A, Bq, scales, zp)``.
  An ``Add`` of a 1-D ``[N]`` initializer right after it (attention/MLP bias), when it is the
  MatMul's only reader, is folded into MatMulNBits' ``bias`` input.
* ``MatMul(A, Transpose(W))`` with ``W`` a 2-D float initializer ``[N, K]`` and the Transpose a
  plain 2-D one: a tied head. The exporter cannot fold that Transpose into a ``[K, N]`` copy
  because the embedding ``Gather`` reads the same initializer, so the head is quantized from
  ``W`` itself, and the Transpose goes when nothing else reads it. As onnxruntime-genai's builder
  does for tied models; and it is what a pipeline stage does, whose own copy of the head is a
  plain ``[K, N]`` initializer.
* ``Gemm(A, B[, C])`` (what the exporter emits for a 2-D ``A``) with ``transA=0``, ``alpha=1``,
  ``beta=1``, ``B`` a 2-D initializer and ``C`` absent or a 1-D ``[N]`` initializer -> the same.
* The embedding ``Gather`` (axis 0 of a float 2-D table) -> ``GatherBlockQuantized`` over
  MatMulNBits-layout tensors: a tied table's are the head's own (stored once), an untied one's its
  own (``_gather_block_quantized``).
* Not rewritten: MoE expert weights (inputs of ``graphkiln.MoE`` / ``com.microsoft.MoE``, not
  MatMuls); MoE router layers (MatMul/Gemm whose output feeds the router input of a
  ``graphkiln.MoE`` node, through Cast/Reshape/Identity): they are tiny and a quantized router can
  pick other experts. So run this pass before the MoE lowering.

Blocks of ``block_size`` weights along K come from ``export.block_quant`` (round to nearest, a
scale search, or the search weighted by calibration statistics), or are the checkpoint's own
(``provided``: a GGUF's or GPTQ/AWQ checkpoint's), and are packed in the kernel's layout
(``pack_blocks``): ``B [N, ceil(K / block), block * bits / 8]`` uint8, ``scales [N, ceil(K /
block)]`` in the weight's float type, and, unless every zero point is the kernel's implicit
midpoint (symmetric blocks, its faster path), ``zero_points [N, ceil(ceil(K / block) * bits / 8)]``
packed uint8. K need not be a multiple of the block size (the last block is zero-padded).

``accuracy_level=4`` lets the CPU kernel quantize the activations to int8 per block and use
integer dot products. It is the only fast CPU path: measured on onnxruntime 1.32 (AVX2,
2 threads, [1, 1024] x [1024, 2816]), int4 decode is ~4x faster than fp32 with level 4 and
no faster without it, and int8 without it is ~10x *slower* than fp32.

Memory: initializers stored as external data are read one at a time straight from their
file (``base_dir``), so the fp32 weights being quantized are never all in memory together.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkiln.batched_int8 import dequantize
from graphkiln.export.block_quant import quantize_blocks
from graphkiln.export.external_data import defer, deferred_producer, read_initializer
from graphkiln.export.streamed_weights import is_streamed
from graphkiln.ops.spec import DOMAIN
from graphkiln.export.lowering.ort_moe import MS_DOMAIN, _NameScope, _drop_unused_initializers

QUANT_BITS = {"int4": 4, "int8": 8}
ACCURACY_LEVEL = 4  # int8 activations inside the kernel: the fast CPU path (see module docstring)
# weight types MatMulNBits has CPU kernels for (scales take the same type)
_FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16}
# ops a router's logits may pass through between its Linear and the MoE node
_PASS_THROUGH = ("Cast", "Reshape", "Identity", "Flatten", "Squeeze", "Unsqueeze")


@dataclass(frozen=True)
class QuantStats:
    nodes: int  # MatMul/Gemm nodes rewritten
    weights: int  # distinct weight initializers quantized
    float_bytes: int  # their size before
    quant_bytes: int  # packed weights + scales + zero points after
    embeddings: int = 0  # embedding Gathers rewritten (GatherBlockQuantized)

    def summary(self) -> str:
        emb = f" and {self.embeddings} embedding" if self.embeddings else ""
        return (f"{self.nodes} Linear layers{emb}, {self.float_bytes / 1e6:.1f} MB of float weights -> "
                f"{self.quant_bytes / 1e6:.1f} MB")


# Block sizes offered: onnxruntime 1.32's CPU MatMulNBits kernel refuses anything but a power of two
# >= 16 at session creation (measured with one-node graphs: int4 and int8, fp32 and fp16, symmetric
# and asymmetric, accuracy_level 0 and 4); 512 also runs but is not offered (quality falls fast with
# the block: docs/quantization.md).
MATMUL_NBITS_BLOCK_SIZES = (16, 32, 64, 128, 256)


def block_size_ok(block_size: int) -> bool:
    """Whether MatMulNBits (quantizer and CPU kernel) accepts this block size."""
    return block_size in MATMUL_NBITS_BLOCK_SIZES


@dataclass(frozen=True)
class QuantInputs:
    """What the export knows about the weights before the lowering quantizes them: the checkpoint's
    own blocks (``provided``, by parameter name: ``models.weights.prequantized_parameters``) and the
    calibration pass's per-feature importance (``export.calibration``), also by parameter name."""

    provided: dict
    importance: dict


@dataclass(frozen=True)
class _Quantized:
    """A weight written as MatMulNBits tensors: their initializer names ("" zero points: none)."""

    q: str
    scales: str
    zero_points: str
    k: int
    n: int
    bits: int
    block_size: int
    rows: bool = False  # B stored 2-D [N, k_blocks * blob] (a table only gathered: no MatMulNBits reads it)


def quantize_linear_weights(model: onnx.ModelProto, bits: int, block_size: int = 32,
                            base_dir: str | Path | None = None, accuracy_level: int = ACCURACY_LEVEL,
                            symmetric: bool = True, provided: dict | None = None, method: str = "rtn",
                            importance: dict | None = None, embeddings: bool = True) -> QuantStats:
    """Rewrite the Linear layers of ``model.graph`` into ``com.microsoft.MatMulNBits`` and (with
    ``embeddings``) the embedding ``Gather`` into ``com.microsoft.GatherBlockQuantized``, in place.

    ``base_dir`` is where external-data files are (needed when weights are not loaded).
    ``method`` and ``importance`` ({parameter name: [K] mean squared input}, for ``calibrated``)
    choose the block quantizer (``export.block_quant``). ``provided``: {parameter name:
    ``models.prequantized.BlockQuantized``}, the checkpoint's own blocks, written as they are
    (their bits and block size) for the initializers of those parameters (the exporter names a
    weight it stores transposed ``<parameter>.T``). A tied embedding reads the head's blocks.
    Float initializers no longer read by any node are dropped. Returns what was done.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if not block_size_ok(block_size):
        raise ValueError(f"block_size must be one of {MATMUL_NBITS_BLOCK_SIZES}, got {block_size}")
    provided, importance = provided or {}, importance or {}
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    nodes = list(graph.node)
    consumers: dict[str, list[int]] = {}  # value -> indices of the nodes reading it
    for idx, n in enumerate(nodes):
        for i in n.input:
            consumers.setdefault(i, []).append(idx)
    graph_outputs = {o.name for o in graph.output}
    routers = _router_outputs(graph)
    transposed_weights = _transposed_weights(nodes, inits)
    names = _NameScope(graph)

    quantized: dict[tuple[str, bool], _Quantized] = {}  # (weight, stored [N, K]?) -> its tensors
    float_bytes = quant_bytes = 0
    replace: dict[int, list[onnx.NodeProto]] = {}  # node index -> what replaces it
    drop_nodes: set[int] = set()  # indices of folded bias Adds
    candidates: set[str] = set()

    def write(weight: str, init: TensorProto, stored_nk: bool, make_blocks, rows: bool = False) -> _Quantized:
        """Declare a weight's MatMulNBits tensors (B [N, k_blocks, blob], scales, zero points); with
        ``base_dir`` they are deferred (``external_data.defer``): the blocks are made by
        ``make_blocks()`` when the data file is written, one weight at a time. ``rows``: B is
        declared ``[N, k_blocks * blob]`` (the same bytes), the shape GatherBlockQuantized reads, for
        a table that only a Gather reads (``_gather_block_quantized`` says why)."""
        nonlocal float_bytes, quant_bytes
        dims = tuple(init.dims)
        n, k = dims if stored_nk else dims[::-1]
        param = weight.removesuffix(".T")
        given = provided.get(param)
        w_bits, w_block = (given.bits, given.block_size) if given is not None else (bits, block_size)
        k_blocks = (k + w_block - 1) // w_block
        mid = 1 << (w_bits - 1)
        has_zp = (not given.centered) if given is not None else not symmetric
        dtype = _FLOAT_TYPES[init.data_type]
        blob = w_block * w_bits // 8
        shapes = [(n, k_blocks * blob) if rows else (n, k_blocks, blob), (n, k_blocks)]
        kinds = [np.uint8, dtype]
        if has_zp:
            shapes.append((n, (k_blocks * w_bits + 7) // 8))
            kinds.append(np.uint8)
        stem = weight.replace("/", "_")
        tags = [f"q{w_bits}", "scales", "zero_points"][:len(shapes)]
        tensor_names = [names.fresh(f"{stem}.{tag}") for tag in tags]
        packer = _Packer(make_blocks, dtype, has_zp, w_bits, rows)
        for i, (name, shape, kind) in enumerate(zip(tensor_names, shapes, kinds)):
            if base_dir is not None:
                tensor = graph.initializer.add()
                tensor.name = name
                tensor.data_type = helper.np_dtype_to_tensor_dtype(np.dtype(kind))
                tensor.dims.extend(shape)
                defer(tensor, lambda i=i: packer.part(i), base_dir)
            else:
                _add_initializer(graph, name, packer.part(i))
            quant_bytes += int(np.prod(shape)) * np.dtype(kind).itemsize
        float_bytes += k * n * np.dtype(dtype).itemsize
        candidates.add(weight)
        return _Quantized(tensor_names[0], tensor_names[1], tensor_names[2] if has_zp else "", k, n, w_bits, w_block, rows)

    def blocks_of(weight: str, init: TensorProto, stored_nk: bool, how: str, feature_weights=None):
        """A thunk making the weight's blocks: the checkpoint's own, or quantized from its [N, K]
        floats (a streamed weight's parameter rows, read a band at a time; else the initializer)."""
        param = weight.removesuffix(".T")
        if param in provided:
            return lambda: provided[param].load()  # stored blocks are made when written

        def make():
            producer = deferred_producer(init, base_dir) if base_dir is not None else None
            if is_streamed(producer) and len(producer.param_shape) == 2:
                w_nk = _ParamRows(producer)
            else:
                w = read_initializer(init, base_dir)
                w_nk = w if stored_nk else w.T  # Linear weights are stored [K, N]; a tied head's table [N, K]
            return quantize_blocks(w_nk, bits, block_size, symmetric, how, feature_weights)

        return make

    for idx, node in enumerate(nodes):
        plan = _plan(node, inits, transposed_weights)
        if plan is None or node.output[0] in routers:
            continue
        weight, transposed, bias = plan
        init = inits[weight]
        if (weight, transposed) not in quantized:
            make = blocks_of(weight, init, transposed, method, importance.get(weight.removesuffix(".T")))
            quantized[weight, transposed] = write(weight, init, transposed, make)
        qw = quantized[weight, transposed]
        out = node.output[0]
        if bias is None and node.op_type == "MatMul":  # fold a following bias Add
            bias, add = _bias_add(out, nodes, consumers, graph_outputs, inits, qw.n, init.data_type)
            if add is not None:
                drop_nodes.add(add)
                out = nodes[add].output[0]
        if bias is not None:
            candidates.add(bias)
        inputs = [node.input[0], qw.q, qw.scales, qw.zero_points] + (["", bias] if bias else [])
        replace[idx] = [helper.make_node(
            "MatMulNBits", inputs, [out], name=names.fresh(f"{node.name or weight}/MatMulNBits"),
            domain=MS_DOMAIN, K=qw.k, N=qw.n, bits=qw.bits, block_size=qw.block_size, accuracy_level=accuracy_level)]

    linear_nodes, embedding_nodes = len(replace), 0
    if embeddings:
        for idx, node in enumerate(nodes):
            table = _embedding_table(node, inits)
            if table is None or idx in replace:
                continue
            init = inits[table]
            if (table, True) not in quantized:  # not a tied head's table: quantized for the Gather alone
                # (no importance: an embedding row's error goes into the residual stream as it is)
                quantized[table, True] = write(table, init, True, blocks_of(table, init, True, "rtn" if method == "rtn" else "search"),
                                               rows=True)
            replace[idx] = _gather_block_quantized(node, quantized[table, True], graph, names)
            embedding_nodes += 1

    if not replace:
        return QuantStats(0, 0, 0, 0)
    new_nodes = [m for i, n in enumerate(nodes) if i not in drop_nodes for m in replace.get(i, [n])]
    # a tied head's Transpose that only the quantized MatMul read is dead now
    read = {o.name for o in graph.output} | {i for n in new_nodes for i in n.input}
    new_nodes = [n for n in new_nodes if n.output[0] not in transposed_weights or n.output[0] in read]
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unused_initializers(graph, candidates)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return QuantStats(linear_nodes, len(quantized), float_bytes, quant_bytes, embedding_nodes)


def _embedding_table(node: onnx.NodeProto, inits) -> str | None:
    """The float 2-D table an embedding ``Gather`` (axis 0, rows by token id) reads, else None."""
    if node.op_type != "Gather" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
        return None
    axis = [helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"]
    if (axis and axis[0] != 0) or not _float_2d(node.input[0], inits) or node.input[1] in inits:
        return None
    return node.input[0]


def _gather_block_quantized(node, qw: _Quantized, graph, names) -> list[onnx.NodeProto]:
    """``Gather(table, ids)`` -> GatherBlockQuantized over the table's MatMulNBits tensors ``qw``.

    The op takes 2-D data ``[V, k_blocks * blob]`` with the blocks on axis 1 and MatMulNBits'
    own scales and packed zero points. onnxruntime folds a Reshape of an initializer into a new
    one at load, a copy in its own memory (measured: 251 MiB of anonymous memory for a
    Llama-3.1-8B-sized table's blocks), so the blocks are never reshaped in the graph:

    * A table only gathered (untied) stores B in that 2-D shape (``qw.rows``), read as it is.
    * A tied table's B is the head's ``[V, k_blocks, blob]`` (MatMulNBits refuses any other
      shape, and ``[V, k_blocks]`` scales). Gathered as 3-D data (blocks on axis 2: one block a
      row of ``blob`` bytes), its scales ``[V, k_blocks, 1]`` are a Reshape of the head's (the op
      wants scales of the data's rank), and the rows ``[..., k_blocks, block]`` are reshaped to
      ``[..., K_padded]``. Every tensor is stored once; the load's folded copy is the scales'
      (a quarter of the blocks' bytes with fp32 scales), not the blocks'.
    * A tied table with zero points (asymmetric blocks): MatMulNBits packs two blocks' zero
      points a byte, which only the 2-D arrangement reads, so B is reshaped to ``[V, -1]``
      there (onnxruntime-genai's arrangement; the folded copy is the blocks').

    A K that is not a multiple of the block is sliced back.
    """
    stem = node.input[0].replace("/", "_")
    out = []
    if not qw.rows and not qw.zero_points:
        return _gather_tied_rows(node, qw, graph, names)
    if qw.rows:
        rows = qw.q
    else:
        shape = names.fresh(f"{stem}.rows_shape")
        _add_initializer(graph, shape, np.array([qw.n, -1], np.int64))
        rows = names.fresh(f"{qw.q}.rows")
        out.append(helper.make_node("Reshape", [qw.q, shape], [rows], name=names.fresh(f"{stem}/Reshape")))
    inputs = [rows, node.input[1], qw.scales] + ([qw.zero_points] if qw.zero_points else [])
    padded = qw.k % qw.block_size != 0
    gathered = names.fresh(f"{node.output[0]}.padded") if padded else node.output[0]
    out.append(helper.make_node("GatherBlockQuantized", inputs, [gathered],
                                name=names.fresh(f"{node.name or stem}/GatherBlockQuantized"), domain=MS_DOMAIN,
                                gather_axis=0, quantize_axis=1, block_size=qw.block_size, bits=qw.bits))
    if padded:
        bounds = [names.fresh(f"{stem}.{what}") for what in ("slice_start", "slice_end", "slice_axis")]
        for name, value in zip(bounds, (0, qw.k, -1)):
            _add_initializer(graph, name, np.array([value], np.int64))
        out.append(helper.make_node("Slice", [gathered, *bounds], [node.output[0]], name=names.fresh(f"{stem}/Slice")))
    return out


def _gather_tied_rows(node, qw: _Quantized, graph, names) -> list[onnx.NodeProto]:
    """``Gather(table, ids)`` -> GatherBlockQuantized over a tied head's symmetric blocks as they
    are stored (B ``[V, k_blocks, blob]``; ``_gather_block_quantized`` says why)."""
    stem = node.input[0].replace("/", "_")
    scales_shape, minus_one = names.fresh(f"{stem}.scales_shape"), names.fresh(f"{stem}.minus_one")
    _add_initializer(graph, scales_shape, np.array([qw.n, -1, 1], np.int64))
    _add_initializer(graph, minus_one, np.array([-1], np.int64))
    scales, ids_shape, rows_shape = (names.fresh(f"{stem}.{what}") for what in ("block_scales", "ids_shape", "rows_shape"))
    gathered = names.fresh(f"{node.output[0]}.blocks")
    padded = qw.k % qw.block_size != 0
    flat = names.fresh(f"{node.output[0]}.padded") if padded else node.output[0]
    out = [helper.make_node("Reshape", [qw.scales, scales_shape], [scales], name=names.fresh(f"{stem}/ScalesReshape")),
           helper.make_node("GatherBlockQuantized", [qw.q, node.input[1], scales], [gathered],
                            name=names.fresh(f"{node.name or stem}/GatherBlockQuantized"), domain=MS_DOMAIN,
                            gather_axis=0, quantize_axis=2, block_size=qw.block_size, bits=qw.bits),
           helper.make_node("Shape", [node.input[1]], [ids_shape], name=names.fresh(f"{stem}/IdsShape")),
           helper.make_node("Concat", [ids_shape, minus_one], [rows_shape], name=names.fresh(f"{stem}/RowsShape"), axis=0),
           helper.make_node("Reshape", [gathered, rows_shape], [flat], name=names.fresh(f"{stem}/Reshape"))]
    if padded:
        bounds = [names.fresh(f"{stem}.{what}") for what in ("slice_start", "slice_end", "slice_axis")]
        for name, value in zip(bounds, (0, qw.k, -1)):
            _add_initializer(graph, name, np.array([value], np.int64))
        out.append(helper.make_node("Slice", [flat, *bounds], [node.output[0]], name=names.fresh(f"{stem}/Slice")))
    return out


# --------------------------------------------------------------------------- selection


def _float_2d(name: str, inits) -> bool:
    t = inits.get(name)
    return t is not None and len(t.dims) == 2 and t.data_type in _FLOAT_TYPES and min(t.dims) > 0


def _transposed_weights(nodes, inits) -> dict[str, str]:
    """Outputs of plain 2-D Transposes of float weight initializers -> the initializer (a tied
    head's ``[N, K]`` weight, which the embedding Gather also reads)."""
    out = {}
    for node in nodes:
        if (node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and len(node.input) == 1
                and len(node.output) == 1 and _float_2d(node.input[0], inits)):
            perm = [list(helper.get_attribute_value(a)) for a in node.attribute if a.name == "perm"]
            if not perm or perm[0] == [1, 0]:  # no perm: reversed axes, the same for 2-D
                out[node.output[0]] = node.input[0]
    return out


def _plan(node: onnx.NodeProto, inits, transposed_weights: dict[str, str]) -> tuple[str, bool, str | None] | None:
    """(weight initializer, stored as [N, K]?, bias initializer or None), or None to leave the node."""
    if node.domain not in ("", "ai.onnx") or len(node.output) != 1:
        return None
    if node.op_type == "MatMul" and len(node.input) == 2 and _float_2d(node.input[1], inits):
        return node.input[1], False, None
    if node.op_type == "MatMul" and len(node.input) == 2 and node.input[1] in transposed_weights:
        return transposed_weights[node.input[1]], True, None
    if node.op_type == "Gemm" and len(node.input) >= 2 and _float_2d(node.input[1], inits):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0:
            return None
        w = inits[node.input[1]]
        transposed = bool(attrs.get("transB", 0))
        n = w.dims[0] if transposed else w.dims[1]
        bias = node.input[2] if len(node.input) > 2 and node.input[2] else None
        if bias is not None:
            b = inits.get(bias)
            if b is None or list(b.dims) != [n] or b.data_type != w.data_type or attrs.get("beta", 1.0) != 1.0:
                return None
        return node.input[1], transposed, bias
    return None


def _bias_add(out: str, nodes, consumers, graph_outputs, inits, n: int, dtype: int):
    """A bias Add reading ``out`` (its only reader) and a 1-D [N] initializer: (bias, node index)."""
    readers = consumers.get(out, [])
    if out in graph_outputs or len(readers) != 1:
        return None, None
    index = readers[0]
    add = nodes[index]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None, None
    other = add.input[1] if add.input[0] == out else add.input[0]
    b = inits.get(other)
    if other == out or b is None or list(b.dims) != [n] or b.data_type != dtype:
        return None, None
    return other, index


def _router_outputs(graph: onnx.GraphProto) -> set[str]:
    """Outputs of the Linear layers that compute MoE router logits (kept in float)."""
    producer = {o: n for n in graph.node for o in n.output}
    out: set[str] = set()
    for node in graph.node:
        if node.op_type == "MoE" and node.domain == DOMAIN and len(node.input) > 1:
            name = node.input[1]
            while name in producer and producer[name].op_type in _PASS_THROUGH:
                name = producer[name].input[0]
            out.add(name)
    return out


# --------------------------------------------------------------------------- tensors


def pack_blocks(blocks, dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A ``BlockQuantized`` weight in MatMulNBits' layout: (packed B [N, k_blocks, block * bits / 8],
    scales [N, k_blocks] in ``dtype``, packed zero points [N, ceil(k_blocks * bits / 8)]); zero
    points None when every one is the kernel's implicit midpoint (symmetric blocks: GGUF Q4_0 and
    Q8_0, symmetric GPTQ), whose kernel path is faster."""
    n, k = blocks.shape
    bits, block = blocks.bits, blocks.block_size
    k_blocks = (k + block - 1) // block
    if k == k_blocks * block:
        codes = blocks.codes  # no padding to add: no copy
    else:
        codes = np.zeros((n, k_blocks * block), np.uint8)  # the last block zero-padded, as the kernel reads it
        codes[:, :k] = blocks.codes
    zp = blocks.zero_points
    symmetric = bool((zp == 1 << (bits - 1)).all())
    if bits == 4:
        high = codes[:, 1::2] << 4
        high |= codes[:, 0::2]  # in place: one temporary of the packed size
        codes = high
        if k_blocks % 2:
            zp = np.pad(zp, ((0, 0), (0, 1)))
        zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
    return (np.ascontiguousarray(codes.reshape(n, k_blocks, block * bits // 8)),
            np.ascontiguousarray(blocks.scales.astype(dtype)), None if symmetric else np.ascontiguousarray(zp))


class _ParamRows:
    """A streamed weight's ``[N, K]`` parameter as ``quantize_blocks`` reads it: ``shape`` and row
    slices, each slice read when asked (``StreamedWeight.rows``), in fp32 as quantization works."""

    def __init__(self, weight) -> None:
        self.weight = weight
        self.shape = weight.param_shape
        self._bands = None

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop = rows.start or 0, min(rows.stop, self.shape[0])
        if self._bands is None or self._bands[0] > start or self._bands[1] < stop:
            self._bands = None
            parts = []
            for first, band in self.weight.rows(max(64 << 20, (stop - start) * self.shape[1] * 4)):
                if first + band.shape[0] <= start:
                    continue
                parts.append((first, band))
                if first + band.shape[0] >= stop:
                    break
            lo = parts[0][0]
            block = np.concatenate([b for _, b in parts]) if len(parts) > 1 else parts[0][1]
            self._bands = (lo, lo + block.shape[0], block)
        lo, _, block = self._bands
        return np.asarray(block[start - lo: stop - lo], dtype=np.float32)


class _Packer:
    """One weight's MatMulNBits tensors, made together on the first request and handed out one at a
    time (``part``): the deferred producers of B, scales and zero points share one computation, kept
    only until every part has been taken."""

    def __init__(self, make_blocks, dtype, zero_points: bool, bits: int, rows: bool = False) -> None:
        self.make, self.dtype, self.zero_points, self.bits, self.rows = make_blocks, dtype, zero_points, bits, rows
        self.parts: dict[int, np.ndarray] = {}

    def part(self, i: int) -> np.ndarray:
        if i not in self.parts:
            blocks = self.make()
            q, scales, zp = pack_blocks(blocks, self.dtype)
            if self.rows:  # GatherBlockQuantized's 2-D data: the same bytes, no copy
                q = q.reshape(q.shape[0], -1)
            if self.zero_points and zp is None:  # declared, but every block happens to sit at the midpoint
                zp = _pack_zero_points(blocks.zero_points, blocks.bits)
            self.parts = {0: q, 1: scales} | ({2: zp} if self.zero_points else {})
        return self.parts.pop(i)


def _pack_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """Zero points [N, k_blocks] in MatMulNBits' packed layout (as ``pack_blocks`` packs them)."""
    if bits == 4:
        if zp.shape[1] % 2:
            zp = np.pad(zp, ((0, 0), (0, 1)))
        zp = zp[:, 0::2] | (zp[:, 1::2] << 4)
    return np.ascontiguousarray(zp)


def _add_initializer(graph: onnx.GraphProto, name: str, arr: np.ndarray) -> None:
    tensor = graph.initializer.add()  # filled in place: no copy of a temporary TensorProto
    tensor.name = name
    tensor.data_type = helper.np_dtype_to_tensor_dtype(arr.dtype)
    tensor.dims.extend(arr.shape)
    tensor.raw_data = arr.tobytes()


def dequantize_reference(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int,
                         bits: int) -> np.ndarray:
    """The float [K, N] weight a MatMulNBits (B, scales, zero_points) represents (for tests);
    without zero points, the kernel's default: the midpoint 2^(bits-1)."""
    return dequantize(packed, scales, zero_points, k, bits)
