"""The batched-step graph of a quantized onnxruntime artifact (``graphkiln.batched_int8`` says why).

Written beside the block graph once it is final (lowered, greedy tail added): a copy of its proto
in which every ``MatMulNBits`` becomes a per-row int8 ``MatMulInteger`` over per-channel int8
weights. The copy keeps pointing into the block graph's data file for everything else (norms,
the embedding's blocks), so the artifact gains the graph and the smoothing factors only; the
int8 weights are external initializers at ``batched_int8.DERIVED_LOCATION``, which the runtime
computes from the blocks (``batched_int8.derived_weights``) and hands to onnxruntime.

Only fp32 graphs whose MatMulNBits have no ``g_idx`` are rewritten (float16 activations would
need casts around every integer matmul, measured nowhere yet); others get no batched graph.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkiln.batched_int8 import DEFAULT_MIN_ROWS, DERIVED_LOCATION, dequantize, smoothing_from_max
from graphkiln.export.external_data import read_initializer
from graphkiln.export.lowering.constants import Constants
from graphkiln.export.lowering.ort_moe import MS_DOMAIN, _NameScope
from graphkiln.manifest import BatchedGraphSpec, DerivedWeight, GraphSpec, TensorRef

_NP_NAMES = {TensorProto.UINT8: "uint8", TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16"}


def write_batched_graph(out_dir: Path, graph: GraphSpec, importance: dict | None,
                        min_rows: int = DEFAULT_MIN_ROWS) -> BatchedGraphSpec | None:
    """Write ``<stem>.batched.onnx`` (and ``<stem>.batched.data``, the smoothing factors and any
    block tensor stored inside the block graph) for ``graph`` in ``out_dir``; returns its spec,
    or None when the graph has no MatMulNBits this pass rewrites. ``importance``: the calibration
    pass's {parameter name: mean squared input [K]} (``export.calibration``), for the smoothing."""
    model = onnx.load(str(out_dir / graph.file), load_external_data=False)
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    targets = [n for n in g.node if n.op_type == "MatMulNBits" and n.domain == MS_DOMAIN and _rewritable(n, inits)]
    if not targets:
        return None
    stem = Path(graph.file).name.removesuffix(".onnx")
    file, data_name = f"{stem}.batched.onnx", f"{stem}.batched.data"
    names = _NameScope(g)
    consts, opset = Constants([], lambda _tag: names.fresh("batched_int8.const")), _opset(model)
    data = bytearray()
    weights, replaced = [], {}
    for node in targets:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
        refs = [_ref(inits[name], out_dir, data, data_name) if name else None
                for name in (node.input[1], node.input[2], node.input[3] if len(node.input) > 3 else "")]
        arrays = [read_initializer(inits[name], out_dir) if name else None
                  for name in (node.input[1], node.input[2], node.input[3] if len(node.input) > 3 else "")]
        # max_n |W| a band of output rows at a time: a head's float weight never whole in memory
        w_max = np.zeros(k, np.float32)
        step = max(1, (64 << 20) // (4 * k))
        for a in range(0, n, step):
            band = dequantize(arrays[0][a:a + step], arrays[1][a:a + step],
                              None if arrays[2] is None else arrays[2][a:a + step], k, bits)
            np.maximum(w_max, np.abs(band).max(axis=1), out=w_max)
            del band
        s = smoothing_from_max(w_max, _importance_for(node.input[1], importance or {}, k))
        smooth_ref = _append(data, data_name, s)
        base = names.fresh(f"{node.input[1]}.batched")
        wq, wc, sm = f"{base}.int8", f"{base}.channel_scales", f"{base}.smooth"
        g.initializer.extend([_derived(wq, TensorProto.INT8, (k, n)), _derived(wc, TensorProto.FLOAT, (n,)),
                              _external(sm, TensorProto.FLOAT, (k,), smooth_ref)])
        weights.append(DerivedWeight(wq, wc, refs[0], refs[1], refs[2], smooth_ref, bits, block))
        bias = node.input[5] if len(node.input) > 5 and node.input[5] else None
        replaced[id(node)] = _int8_matmul(node.input[0], node.output[0], wq, wc, sm, bias, consts, names, opset)
    new_nodes = [m for node in g.node for m in replaced.get(id(node), [node])]
    del g.node[:]
    g.node.extend(consts.nodes + new_nodes)
    (out_dir / data_name).write_bytes(bytes(data))
    onnx.save(model, str(out_dir / file))  # the untouched initializers still point into the block graph's data file
    return BatchedGraphSpec(graph.name, graph.target, file, min_rows, tuple(weights))


def _rewritable(node, inits) -> bool:
    """An fp32 MatMulNBits without g_idx whose B, scales and zero points are initializers."""
    ins = list(node.input) + [""] * 6
    if ins[4]:
        return False
    scales = inits.get(ins[2])
    return (ins[1] in inits and scales is not None and scales.data_type == TensorProto.FLOAT
            and (not ins[3] or ins[3] in inits))


def _importance_for(blob_name: str, importance: dict, k: int):
    """The calibration statistic of the parameter a MatMulNBits B was packed from (the quantizer
    names it ``<initializer>.q<bits>``; Linear weights are stored as ``<parameter>.T``; a tied
    head's blocks are the embedding table's, its statistic is the head's)."""
    param = re.sub(r"\.q[48](_[0-9]+)?$", "", blob_name).removesuffix(".T")
    for key in (param, "lm_head.weight" if param.endswith("embed_tokens.weight") else None):
        if key in importance and len(importance[key]) == k:
            return importance[key]
    return None


def _int8_matmul(a: str, out: str, wq: str, wc: str, smooth: str, bias: str | None, consts: Constants,
                 names: _NameScope, opset: int) -> list:
    """``out = (MatMulInteger(round(x / r) + 128, wq, 128) * r) * wc [+ bias]``, ``x = a / smooth``,
    ``r = max(max|x| per row, tiny) / 127``: symmetric per-row int8, shifted into uint8 so the
    kernel takes its u8 x s8 path (zero point 128 is a scalar, which onnxruntime's kernel needs)."""
    v = lambda what: names.fresh(f"{out}/batched_int8/{what}")  # noqa: E731
    x, ab, amax, r0, r, xr, rd, u, uq, acc, accf, y0 = (v(w) for w in (
        "x", "abs", "amax", "r0", "r", "xr", "round", "shift", "u8", "i32", "f32", "rows"))
    y = v("channels") if bias else out
    nodes = [
        helper.make_node("Div", [a, smooth], [x]),
        helper.make_node("Abs", [x], [ab]),
        _reduce_max_last(ab, amax, consts, opset),
        helper.make_node("Div", [amax, consts(127.0, np.float32)], [r0]),
        helper.make_node("Max", [r0, consts(1e-30, np.float32)], [r]),
        helper.make_node("Div", [x, r], [xr]),
        helper.make_node("Round", [xr], [rd]),
        helper.make_node("Add", [rd, consts(128.0, np.float32)], [u]),
        helper.make_node("Cast", [u], [uq], to=TensorProto.UINT8),
        helper.make_node("MatMulInteger", [uq, wq, consts(128, np.uint8)], [acc]),
        helper.make_node("Cast", [acc], [accf], to=TensorProto.FLOAT),
        helper.make_node("Mul", [accf, r], [y0]),
        helper.make_node("Mul", [y0, wc], [y]),
    ]
    if bias:
        nodes.append(helper.make_node("Add", [y, bias], [out]))
    return nodes


def _opset(model) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _reduce_max_last(x: str, out: str, consts: Constants, opset: int):
    """ReduceMax over the last axis, keeping it (axes an input from opset 18, an attribute before)."""
    if opset >= 18:
        axes = consts([-1], np.int64)
        return helper.make_node("ReduceMax", [x, axes], [out], keepdims=1)
    return helper.make_node("ReduceMax", [x], [out], axes=[-1], keepdims=1)


def _derived(name: str, dtype: int, shape: tuple) -> TensorProto:
    """An initializer whose bytes the runtime supplies (``batched_int8.DERIVED_LOCATION``)."""
    t = TensorProto(name=name, data_type=dtype, dims=list(shape), data_location=TensorProto.EXTERNAL)
    for key, value in (("location", DERIVED_LOCATION), ("offset", "0"),
                       ("length", str(int(np.prod(shape)) * (1 if dtype == TensorProto.INT8 else 4)))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def _external(name: str, dtype: int, shape: tuple, ref: TensorRef) -> TensorProto:
    t = TensorProto(name=name, data_type=dtype, dims=list(shape), data_location=TensorProto.EXTERNAL)
    length = int(np.prod(shape)) * np.dtype(ref.dtype).itemsize
    for key, value in (("location", ref.file), ("offset", str(ref.offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def _append(data: bytearray, data_name: str, arr: np.ndarray) -> TensorRef:
    """Append ``arr`` to the batched data file (64-byte aligned) and return where it is."""
    data.extend(b"\0" * (-len(data) % 64))
    ref = TensorRef(data_name, len(data), tuple(arr.shape), str(arr.dtype))
    data.extend(np.ascontiguousarray(arr).tobytes())
    return ref


def _ref(init: TensorProto, out_dir: Path, data: bytearray, data_name: str) -> TensorRef:
    """Where a block tensor's bytes are: its external-data file, or (stored in the graph) the batched data file."""
    if init.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in init.external_data}
        return TensorRef(info["location"], int(info.get("offset", 0)), tuple(init.dims), _NP_NAMES[init.data_type])
    return _append(data, data_name, numpy_helper.to_array(init))
