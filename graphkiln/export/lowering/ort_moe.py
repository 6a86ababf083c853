"""Lower ``graphkiln.MoE`` to onnxruntime's ``com.microsoft.MoE`` contrib op.

The portable node's reference function is a dense decomposition: it runs every expert on
every token. onnxruntime ships a sparse MoE kernel (``com.microsoft.MoE``, CPU float and
float16) that runs only the routed experts, but it does its own routing: softmax over the
whole ``router_probs`` row, top-k, optionally renormalized. graphkiln's routing is more
general (sigmoid scoring, a selection-only expert bias, normalization with an epsilon,
routed scaling), so this pass computes the routing with standard ops and feeds ORT a
router row whose softmax reproduces it:

    w     = top-k routing weights before normalization and scaling   [T, k], fp32, >= 0
    r     = max(log(w / max_k w), -1e3)                              [T, k]  (<= 0, top one is 0)
    probs = scatter r at the selected ids into a row of -1e4         [T, E]
    ORT softmax(probs) = w / sum_k w at the selected experts and exactly 0 elsewhere, so ORT
    picks the same experts (the ones above -1e4) with weights w / sum(w); the output is then
    multiplied by the per-token factor that turns w / sum(w) into the graphkiln weights:
        normalize=1: routed_scaling * sum(w) / (sum(w) + norm_eps)   (a constant when eps == 0)
        normalize=0: routed_scaling * sum(w)
    (dividing by max w keeps the router values near 0, where float16 is most precise).

ORT's CPU kernel needs SwiGLU with gate/up interleaved by rows (``swiglu_fusion=1``): fc1
is [E, 2I, H] with rows g0, u0, g1, u1, ...; fc2 is [E, H, I], which is graphkiln's ``down``
layout already. Its SwiGLU (onnxruntime/contrib_ops/cpu/moe/moe_utils.cc, fp32 for both
element types) is g = min(gate, swiglu_limit), u = clamp(up, +-swiglu_limit),
g * sigmoid(activation_alpha * g) * (u + activation_beta), no clamp without swiglu_limit;
fc1_experts_bias is added before it (interleaved like fc1), fc2_experts_bias after fc2 and
before the routing weight. Per graphkiln activation:
    0 silu(gate) * up: alpha 1, beta 0, no limit;
    2 gpt-oss clamped SwiGLU: alpha, beta 1, swiglu_limit = limit (tested against the reference);
    1 relu(y)^2 (non-gated; no relu² on CPU): every up row twice (fc1 rows u0, u0, u1, u1, ...,
      so gate = up = y), beta 0, no limit and alpha 1e30, which makes y * sigmoid(1e30 y) * y
      exactly relu(y)^2 for every finite fp32 y: sigmoid rounds to exactly 1 once 1e30 y > 17
      and to 0 once 1e30 y < -88.7 (exp overflows), and for |y| below those (< 1e-28) both y^2
      and the kernel's product underflow to 0. The price is fc1 twice the size: these layers'
      expert weights take 3 I H instead of 2 I H per expert (still read only for routed experts).
The expert biases are passed only when they are not all-zero initializers, so bias-free
models lower to exactly the graph they did before the op had biases.

MXFP4 experts (gpt-oss in the Hub's form, ``models.mxfp4``) are lowered to ``com.microsoft.QMoE``
instead, with the same routing: when a node's ``gate_up`` and ``down`` are deferred streamed weights
whose checkpoint source is MXFP4 blocks, fc1/fc2 become QMoE blocks of 32 along K (``expert_bits``
8: exact, the E2M1 values times two as int8 codes; 4: each block's step chosen by least squares,
approximate), made from the blocks one expert at a time as the data file is written; the float
experts are never made. fc1 keeps the checkpoint's row order, which is QMoE's interleaved gate/up
(``swiglu_fusion=1``). onnxruntime 1.32's CPU kernel (measured, scripts/bench_gpt_oss_mxfp4.py):
int4 blocks run with fp32 activations at ``accuracy_level`` 0 (the dequantized weights exactly),
int8 blocks always quantize the activations to int8 inside the kernel (no fp32 kernel); its
``quant_type="fp4"`` takes E8M0 scales on CUDA only (the CPU kernel reads float scales).

Only nodes of the main graph are rewritten. Weight initializers must be in memory (load
external data first); a ``gate_up`` that is not an initializer is interleaved in the graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkiln.export.lowering.constants import Constants
from graphkiln.ops.spec import DOMAIN

MS_DOMAIN = "com.microsoft"
MOE_OP = "MoE"
QMOE_OP = "QMoE"
QMOE_BLOCK = 32  # QMoE's block along K for MXFP4 experts: the MXFP4 block
# element types com.microsoft.MoE has CPU kernels for
_ORT_MOE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
_FILLER = -1.0e4  # router value of unselected experts (finite in float16; exp underflows to 0)
_FLOOR = -1.0e3  # router value of a selected expert whose weight is exactly 0
_TINY = float(np.finfo(np.float32).tiny)
_RELU2_ALPHA = 1.0e30  # see the module docstring: makes ORT's SwiGLU on duplicated rows exactly relu²
_SWIGLU, _RELU2, _SWIGLU_CLAMPED = 0, 1, 2  # graphkiln.ops.moe's activation codes


def lower_moe_for_onnxruntime(model: onnx.ModelProto, base_dir=None, expert_bits: int | None = None) -> int:
    """Rewrite every ``graphkiln.MoE`` node of ``model.graph`` for onnxruntime, in place.

    Each node becomes fp32 routing in standard ops + one ``com.microsoft.MoE`` (+ a Mul
    rescaling the output where the routing weights do not sum to 1). ``gate_up``
    initializers are replaced by interleaved copies (``<name>.ort_interleaved``, or
    ``<name>.ort_doubled`` for relu² experts; so is a non-zero ``gate_up_bias``); the
    originals, and all-zero expert-bias and expert-output-bias initializers (which cannot
    change the selection or the output), are dropped when nothing else reads them. Adds the
    ``com.microsoft`` opset import; drops the MoE function and the ``graphkiln`` opset import
    once unused.
    Nodes whose weights have a type ORT's MoE has no CPU kernel for (e.g. bfloat16) are
    left as they are. Returns the number of nodes rewritten.

    With ``base_dir`` (where the graph's external data is), a ``gate_up`` stored as external or
    deferred data is not loaded: its interleaved copy is deferred (``external_data.defer``), made
    from it one tensor at a time when the data file is rewritten. MXFP4 experts become QMoE
    nodes of ``expert_bits`` (default 4) blocks (see the module docstring).
    """
    graph = model.graph
    default_opset = _default_opset(model)
    if default_opset < 13:
        raise ValueError(f"lower_moe_for_onnxruntime needs opset >= 13, model has {default_opset}")
    inits = {t.name: t for t in graph.initializer}
    names = _NameScope(graph)
    elem_types = _known_elem_types(graph)
    interleaved: dict[tuple[str, str], str] = {}  # (initializer, row layout) -> its fc1 copy
    new_nodes: list[onnx.NodeProto] = []
    replaced_inputs: set[str] = set()  # initializers the rewritten nodes read
    rewritten = 0
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == MOE_OP:
            lowered = _lower_node(node, inits, elem_types, names, interleaved, default_opset, graph, base_dir,
                                  expert_bits or 4)
            if lowered is not None:
                new_nodes.extend(lowered)
                replaced_inputs.update(n for n in node.input if n in inits)
                rewritten += 1
                continue
        new_nodes.append(node)
    if not rewritten:
        return 0
    del graph.node[:]
    graph.node.extend(new_nodes)
    _drop_unused_initializers(graph, replaced_inputs)
    _drop_unused_function(model)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return rewritten


# --------------------------------------------------------------------------- one node


def _lower_node(node, inits, elem_types, names, interleaved, opset, graph, base_dir=None, expert_bits=4):
    hidden, logits, gate_up, down = node.input[:4]
    bias, gate_up_bias, down_bias = (node.input[i] if len(node.input) > i else "" for i in (4, 5, 6))
    (out,) = node.output
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    missing = {"top_k", "scoring", "normalize", "norm_eps", "routed_scaling"} - set(attrs)
    if missing:
        raise ValueError(f"graphkiln.MoE node {node.name!r} lacks attributes {sorted(missing)}")
    top_k, scoring, normalize = int(attrs["top_k"]), int(attrs["scoring"]), int(attrs["normalize"])
    norm_eps, routed_scaling = float(attrs["norm_eps"]), float(attrs["routed_scaling"])
    activation = int(attrs.get("activation", _SWIGLU))  # absent: the SPEC defaults
    alpha, limit = float(attrs.get("alpha", 1.702)), float(attrs.get("limit", 7.0))
    if scoring not in (0, 1):
        raise ValueError(f"graphkiln.MoE node {node.name!r}: unknown scoring {scoring}")
    if activation not in (_SWIGLU, _RELU2, _SWIGLU_CLAMPED):
        raise ValueError(f"graphkiln.MoE node {node.name!r}: unknown activation {activation}")

    elem = next((elem_types[n] for n in (gate_up, down, hidden) if n in elem_types), None)
    mxfp4 = _mxfp4_experts(gate_up, down, inits, base_dir)
    if mxfp4 is not None and (elem not in _ORT_MOE_TYPES or activation == _RELU2):
        from graphkiln.errors import GraphkilnError

        raise GraphkilnError(f"MXFP4 experts lower to onnxruntime's QMoE, which has no CPU kernel for this model's "
                             f"type or activation ({node.name}): export with --dtype fp32")
    if elem is not None and elem not in _ORT_MOE_TYPES:
        return None  # no ORT CPU kernel for this type: keep the portable node

    nodes: list[onnx.NodeProto] = []
    prefix = (node.name or "moe").replace("/", "_")

    def tmp(tag: str) -> str:
        return names.fresh(f"{prefix}/ort_{tag}")

    def add(op_type, inputs, n_out=1, domain="", **kw):
        outs = [tmp(op_type.lower()) for _ in range(n_out)]
        nodes.append(helper.make_node(op_type, list(inputs), outs, name=names.fresh(f"{prefix}/ort_{op_type}"),
                                      domain=domain, **kw))
        return outs if n_out > 1 else outs[0]

    const = Constants(nodes, tmp)

    def reduce(op_type, x):
        if opset >= 18 or op_type == "ReduceSum":
            return add(op_type, [x, const([-1], np.int64, "axes")], keepdims=1)
        return add(op_type, [x], axes=[-1], keepdims=1)

    # --- routing, fp32, exactly as the reference function computes it
    lf = add("Cast", [logits], to=TensorProto.FLOAT)
    probs = add("Sigmoid", [lf]) if scoring == 1 else add("Softmax", [lf], axis=-1)
    select = probs
    if bias and not _is_zero_initializer(inits.get(bias)):
        select = add("Add", [probs, add("Cast", [bias], to=TensorProto.FLOAT)])
    _, idx = add("TopK", [select, const([top_k], np.int64, "k")], n_out=2, axis=-1, largest=1, sorted=1)
    w = add("GatherElements", [probs, idx], axis=-1)  # [T, k], unnormalized, unscaled

    # --- router row for ORT: softmax of it is w / sum(w) at the selected ids, 0 elsewhere
    wmax = add("Max", [reduce("ReduceMax", w), const(_TINY, np.float32)])
    r = add("Max", [add("Log", [add("Div", [w, wmax])]), const(_FLOOR, np.float32)])
    filler = add("ConstantOfShape", [add("Shape", [lf])],
                 value=numpy_helper.from_array(np.array([_FILLER], np.float32)))
    router = add("ScatterElements", [filler, idx, r], axis=-1)
    if elem == TensorProto.FLOAT16:
        router = add("Cast", [router], to=TensorProto.FLOAT16)
    elif elem is None:
        router = add("CastLike", [router, hidden])

    rows = "doubled" if activation == _RELU2 else "interleaved"
    if mxfp4 is None:
        fc1 = _fc1_rows(gate_up, rows, inits, names, interleaved, graph, add, const, opset, base_dir)
    else:
        fc1 = _qmoe_tensors(gate_up, mxfp4[0], expert_bits, elem, names, graph, base_dir)
        down = _qmoe_tensors(down, mxfp4[1], expert_bits, elem, names, graph, base_dir)
    fc1_bias = fc2_bias = ""
    if gate_up_bias and not _is_zero_initializer(inits.get(gate_up_bias)):
        fc1_bias = _fc1_rows(_as_elem(gate_up_bias, elem, elem_types, hidden, add), rows, inits, names, interleaved,
                             graph, add, const, opset)
    if down_bias and not _is_zero_initializer(inits.get(down_bias)):
        fc2_bias = _as_elem(down_bias, elem, elem_types, hidden, add)

    # --- per-token factor turning w / sum(w) into the graphkiln weights
    scale = None  # None: exactly 1
    if normalize and norm_eps == 0.0:
        if routed_scaling != 1.0:
            scale = const(routed_scaling, np.float32, "routed_scaling")
    else:
        s = reduce("ReduceSum", w)
        if normalize:
            s = add("Div", [s, add("Add", [s, const(norm_eps, np.float32, "norm_eps")])])
        if routed_scaling != 1.0:
            s = add("Mul", [s, const(routed_scaling, np.float32, "routed_scaling")])
        scale = s
    if scale is not None:
        if elem == TensorProto.FLOAT16:
            scale = add("Cast", [scale], to=TensorProto.FLOAT16)
        elif elem is None:
            scale = add("CastLike", [scale, hidden])

    moe_out = out if scale is None else tmp("moe_out")
    if activation == _SWIGLU_CLAMPED:
        act = dict(activation_alpha=alpha, activation_beta=1.0, swiglu_limit=limit)
    elif activation == _RELU2:
        act = dict(activation_alpha=_RELU2_ALPHA, activation_beta=0.0)
    else:
        act = dict(activation_alpha=1.0, activation_beta=0.0)
    if mxfp4 is None:
        moe_inputs = [hidden, router, fc1, fc1_bias, down, fc2_bias]
        op, quant = MOE_OP, {}
    else:  # QMoE: (weights, scales) per projection, blocks of 32 along K, default zero points
        moe_inputs = [hidden, router, fc1[0], fc1[1], fc1_bias, down[0], down[1], fc2_bias]
        op, quant = QMOE_OP, dict(expert_weight_bits=expert_bits, block_size=QMOE_BLOCK, accuracy_level=0)
    while not moe_inputs[-1]:  # trailing optional inputs left out, as before the op had biases
        moe_inputs.pop()
    nodes.append(helper.make_node(
        op, moe_inputs, [moe_out], name=names.fresh(f"{prefix}/ort_{op}"),
        domain=MS_DOMAIN, k=top_k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=0, **act,
        **quant))
    if scale is not None:
        nodes.append(helper.make_node("Mul", [moe_out, scale], [out], name=names.fresh(f"{prefix}/ort_Mul")))
    return nodes


def _mxfp4_experts(gate_up: str, down: str, inits, base_dir):
    """(gate_up's, down's) MXFP4 sources (``models.mxfp4.Mxfp4Experts``) with the checkpoint reader,
    when both initializers are deferred streamed weights read from MXFP4 blocks; else None."""
    if base_dir is None:
        return None
    from graphkiln.export.external_data import deferred_producer
    from graphkiln.export.streamed_weights import is_streamed
    from graphkiln.models.mxfp4 import requantized_source

    found = []
    for name in (gate_up, down):
        init = inits.get(name)
        if init is None:
            return None
        producer = deferred_producer(init, base_dir)
        if producer is None or not is_streamed(producer) or producer.transform is not None:
            return None
        src = requantized_source(producer.weights, producer.weights._own(producer.param))
        if src is None:
            return None
        found.append((producer.weights.reader, src))
    for name in (gate_up, down):  # written from their blocks: never dequantized again (CheckpointWeights)
        deferred_producer(inits[name], base_dir).weights.expand_integer_sources = False
    return tuple(found)


def _qmoe_tensors(name: str, found, bits: int, elem, names, graph, base_dir) -> tuple[str, str]:
    """QMoE (weights, scales) initializers for the MXFP4 expert tensor ``name``, deferred: made from
    the checkpoint's blocks one expert at a time when the data file is written."""
    from graphkiln.export.external_data import defer
    from graphkiln.models.mxfp4 import RequantizedExperts

    reader, src = found
    made = RequantizedExperts(reader, src, bits, helper.tensor_dtype_to_np_dtype(elem or TensorProto.FLOAT))
    e, n, k = made.shape
    out = []
    for tag, dtype, dims, producer in (("weights", TensorProto.UINT8, (e, n, k * bits // 8), made.weights),
                                       ("scales", elem or TensorProto.FLOAT, (e, n, k // QMOE_BLOCK), made.scales)):
        tensor = graph.initializer.add()
        tensor.name = names.fresh(f"{name}.qmoe_int{bits}_{tag}")
        tensor.data_type = dtype
        tensor.dims.extend(dims)
        defer(tensor, producer, base_dir)
        out.append(tensor.name)
    return out[0], out[1]


def _as_elem(value, elem, elem_types, hidden, add) -> str:
    """``value`` in the MoE's element type (ORT's biases are T, like its weights)."""
    known = elem_types.get(value)
    if elem is None:
        return add("CastLike", [value, hidden])
    return value if known == elem else add("Cast", [value], to=elem)


def _fc1_rows(gate_up, rows, inits, names, interleaved, graph, add, const, opset, base_dir=None) -> str:
    """fc1 (or its bias) for ORT, rows along axis 1: ``rows`` "interleaved": gate_up [E, 2I, ...]
    (gate rows, then up rows) -> rows g0, u0, g1, u1, ...; "doubled": the relu² experts' up
    rows [E, I, ...] -> u0, u0, u1, u1, ... (gate = up, see the module docstring)."""
    init = inits.get(gate_up)
    if init is None:  # not a constant we can rewrite: pair the rows at run time
        axis = const([2], np.int64, "axes")
        if rows == "doubled":
            g = u = gate_up
        elif opset >= 18:
            g, u = add("Split", [gate_up], n_out=2, axis=1, num_outputs=2)
        else:
            g, u = add("Split", [gate_up], n_out=2, axis=1)
        pairs = add("Concat", [add("Unsqueeze", [g, axis]), add("Unsqueeze", [u, axis])], axis=2)  # [E, I, 2, ...]
        shape = add("Shape", [gate_up])
        if rows == "doubled":  # [E, 2I, ...]: E, then -1 for the doubled rows, then the trailing dims
            tail = add("Slice", [shape, const([2], np.int64, "start"), const([np.iinfo(np.int64).max], np.int64, "end")])
            shape = add("Concat", [const([0, -1], np.int64, "shape"), tail], axis=0)
        return add("Reshape", [pairs, shape])
    key = (gate_up, rows)
    if key in interleaved:
        return interleaved[key]
    external = init.data_location == TensorProto.EXTERNAL and not init.HasField("raw_data")
    shape = tuple(init.dims) if external and base_dir is not None else _initializer_array(init).shape
    if len(shape) not in (2, 3) or (rows == "interleaved" and shape[1] % 2):
        raise ValueError(f"{gate_up!r} has shape {shape}; expected [E, 2I, H] or [E, 2I] (gate then up rows), "
                         "or [E, I, H] / [E, I] for relu² experts")
    name = names.fresh(f"{gate_up}.ort_{rows}")
    tensor = graph.initializer.add()  # filled in place: no copy of a temporary TensorProto
    tensor.name = name
    tensor.data_type = init.data_type
    tensor.dims.extend((shape[0], shape[1] * (2 if rows == "doubled" else 1), *shape[2:]))
    if external and base_dir is not None:  # made when the data file is written, one tensor at a time
        from graphkiln.export.external_data import defer, read_initializer

        source = TensorProto()
        source.CopyFrom(init)  # the original may be dropped from the graph before it is read
        defer(tensor, lambda: _fc1_layout(read_initializer(source, base_dir), rows), base_dir)
    else:
        tensor.raw_data = _fc1_layout(_initializer_array(init), rows).tobytes()
    interleaved[key] = name
    return name


def _fc1_layout(arr: np.ndarray, rows: str) -> np.ndarray:
    """gate_up [E, 2I, ...] with gate rows then up rows -> interleaved (g0, u0, g1, ...); or the
    relu² experts' up rows doubled (u0, u0, u1, ...)."""
    tail = arr.shape[2:]
    if rows == "doubled":
        return np.ascontiguousarray(np.repeat(arr, 2, axis=1))
    e, two_i = arr.shape[:2]
    return np.ascontiguousarray(arr.reshape(e, 2, two_i // 2, *tail).swapaxes(1, 2).reshape(e, two_i, *tail))


# --------------------------------------------------------------------------- helpers


def _initializer_array(init: TensorProto) -> np.ndarray:
    if init.data_location == TensorProto.EXTERNAL and not init.HasField("raw_data"):
        raise ValueError(
            f"initializer {init.name!r} is stored as external data; load it first "
            "(onnx.load(path) or onnx.external_data_helper.load_external_data_for_model)")
    return numpy_helper.to_array(init)


def _is_zero_initializer(init: TensorProto | None) -> bool:
    if init is None or (init.data_location == TensorProto.EXTERNAL and not init.HasField("raw_data")):
        return False
    return not np.any(numpy_helper.to_array(init))


def _default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise ValueError("model has no default-domain opset import")


def _known_elem_types(graph: onnx.GraphProto) -> dict[str, int]:
    types = {}
    for vi in list(graph.input) + list(graph.value_info) + list(graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types[vi.name] = vi.type.tensor_type.elem_type
    for t in graph.initializer:
        types[t.name] = t.data_type
    return types


def _subgraphs(node: onnx.NodeProto):
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _all_nodes(graph: onnx.GraphProto):
    for n in graph.node:
        yield n
        for g in _subgraphs(n):
            yield from _all_nodes(g)


class _NameScope:
    """Fresh value/node names that collide with nothing in the graph."""

    def __init__(self, graph: onnx.GraphProto):
        self.used: set[str] = set()
        for g in [graph]:
            self.used.update(t.name for t in g.initializer)
            self.used.update(v.name for v in list(g.input) + list(g.output) + list(g.value_info))
        for n in _all_nodes(graph):
            self.used.update(n.input)
            self.used.update(n.output)
            self.used.add(n.name)

    def fresh(self, base: str) -> str:
        name, i = base, 0
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name


def _drop_unused_initializers(graph: onnx.GraphProto, candidates: set[str]) -> None:
    if not candidates:
        return
    used = {o.name for o in graph.output}
    for n in _all_nodes(graph):
        used.update(n.input)
    drop = candidates - used
    if not drop:
        return
    for i in reversed(range(len(graph.initializer))):  # in place: no copies of the other tensors
        if graph.initializer[i].name in drop:
            del graph.initializer[i]
    for field in (graph.input, graph.value_info):
        keep_vi = [v for v in field if v.name not in drop]
        del field[:]
        field.extend(keep_vi)


def _drop_unused_function(model: onnx.ModelProto) -> None:
    nodes = list(_all_nodes(model.graph))
    for f in model.functions:
        for n in f.node:
            nodes.append(n)
    if not any(n.domain == DOMAIN and n.op_type == MOE_OP for n in nodes):
        keep = [f for f in model.functions if not (f.domain == DOMAIN and f.name == MOE_OP)]
        del model.functions[:]
        model.functions.extend(keep)
    if not any(n.domain == DOMAIN for n in nodes) and not any(f.domain == DOMAIN for f in model.functions):
        keep_ops = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep_ops)
