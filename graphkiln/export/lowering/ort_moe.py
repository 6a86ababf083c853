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
layout already. The SwiGLU is pinned to silu(gate) * up: activation_alpha=1,
activation_beta=0, no swiglu_limit (no clamp).

Only nodes of the main graph are rewritten. Weight initializers must be in memory (load
external data first); a ``gate_up`` that is not an initializer is interleaved in the graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkiln.ops.spec import DOMAIN

MS_DOMAIN = "com.microsoft"
MOE_OP = "MoE"
# element types com.microsoft.MoE has CPU kernels for
_ORT_MOE_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
_FILLER = -1.0e4  # router value of unselected experts (finite in float16; exp underflows to 0)
_FLOOR = -1.0e3  # router value of a selected expert whose weight is exactly 0
_TINY = float(np.finfo(np.float32).tiny)


def lower_moe_for_onnxruntime(model: onnx.ModelProto) -> int:
    """Rewrite every ``graphkiln.MoE`` node of ``model.graph`` for onnxruntime, in place.

    Each node becomes fp32 routing in standard ops + one ``com.microsoft.MoE`` (+ a Mul
    rescaling the output where the routing weights do not sum to 1). ``gate_up``
    initializers are replaced by interleaved copies (``<name>.ort_interleaved``); the
    originals, and all-zero expert-bias initializers (which cannot change the selection),
    are dropped when nothing else reads them. Adds the ``com.microsoft`` opset
    import; drops the MoE function and the ``graphkiln`` opset import once unused.
    Nodes whose weights have a type ORT's MoE has no CPU kernel for (e.g. bfloat16) are
    left as they are. Returns the number of nodes rewritten.
    """
    graph = model.graph
    default_opset = _default_opset(model)
    if default_opset < 13:
        raise ValueError(f"lower_moe_for_onnxruntime needs opset >= 13, model has {default_opset}")
    inits = {t.name: t for t in graph.initializer}
    names = _NameScope(graph)
    elem_types = _known_elem_types(graph)
    interleaved: dict[str, str] = {}  # gate_up initializer -> its interleaved copy
    new_nodes: list[onnx.NodeProto] = []
    replaced_inputs: set[str] = set()  # initializers the rewritten nodes read
    rewritten = 0
    for node in graph.node:
        if node.domain == DOMAIN and node.op_type == MOE_OP:
            lowered = _lower_node(node, inits, elem_types, names, interleaved, default_opset, graph)
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


def _lower_node(node, inits, elem_types, names, interleaved, opset, graph):
    hidden, logits, gate_up, down = node.input[:4]
    bias = node.input[4] if len(node.input) > 4 else ""
    (out,) = node.output
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    missing = {"top_k", "scoring", "normalize", "norm_eps", "routed_scaling"} - set(attrs)
    if missing:
        raise ValueError(f"graphkiln.MoE node {node.name!r} lacks attributes {sorted(missing)}")
    top_k, scoring, normalize = int(attrs["top_k"]), int(attrs["scoring"]), int(attrs["normalize"])
    norm_eps, routed_scaling = float(attrs["norm_eps"]), float(attrs["routed_scaling"])
    if scoring not in (0, 1):
        raise ValueError(f"graphkiln.MoE node {node.name!r}: unknown scoring {scoring}")

    elem = next((elem_types[n] for n in (gate_up, down, hidden) if n in elem_types), None)
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

    def const(value, dtype=np.float32, tag="const"):
        arr = np.asarray(value, dtype=dtype)
        name = tmp(tag)
        nodes.append(helper.make_node("Constant", [], [name], name=names.fresh(f"{prefix}/ort_Constant"),
                                      value=numpy_helper.from_array(arr, name)))
        return name

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
    wmax = add("Max", [reduce("ReduceMax", w), const(_TINY)])
    r = add("Max", [add("Log", [add("Div", [w, wmax])]), const(_FLOOR)])
    filler = add("ConstantOfShape", [add("Shape", [lf])],
                 value=numpy_helper.from_array(np.array([_FILLER], np.float32)))
    router = add("ScatterElements", [filler, idx, r], axis=-1)
    if elem == TensorProto.FLOAT16:
        router = add("Cast", [router], to=TensorProto.FLOAT16)
    elif elem is None:
        router = add("CastLike", [router, hidden])

    fc1 = _interleaved_gate_up(gate_up, inits, names, interleaved, graph, add, const, opset)

    # --- per-token factor turning w / sum(w) into the graphkiln weights
    scale = None  # None: exactly 1
    if normalize and norm_eps == 0.0:
        if routed_scaling != 1.0:
            scale = const(routed_scaling, tag="routed_scaling")
    else:
        s = reduce("ReduceSum", w)
        if normalize:
            s = add("Div", [s, add("Add", [s, const(norm_eps, tag="norm_eps")])])
        if routed_scaling != 1.0:
            s = add("Mul", [s, const(routed_scaling, tag="routed_scaling")])
        scale = s
    if scale is not None:
        if elem == TensorProto.FLOAT16:
            scale = add("Cast", [scale], to=TensorProto.FLOAT16)
        elif elem is None:
            scale = add("CastLike", [scale, hidden])

    moe_out = out if scale is None else tmp("moe_out")
    nodes.append(helper.make_node(
        MOE_OP, [hidden, router, fc1, "", down], [moe_out], name=names.fresh(f"{prefix}/ort_MoE"),
        domain=MS_DOMAIN, k=top_k, activation_type="swiglu", swiglu_fusion=1,
        activation_alpha=1.0, activation_beta=0.0, normalize_routing_weights=0))
    if scale is not None:
        nodes.append(helper.make_node("Mul", [moe_out, scale], [out], name=names.fresh(f"{prefix}/ort_Mul")))
    return nodes


def _interleaved_gate_up(gate_up, inits, names, interleaved, graph, add, const, opset) -> str:
    """fc1 for ORT: gate_up [E, 2I, H] (gate rows, then up rows) -> rows g0, u0, g1, u1, ..."""
    init = inits.get(gate_up)
    if init is None:  # not a constant we can rewrite: interleave at run time
        if opset >= 18:
            g, u = add("Split", [gate_up], n_out=2, axis=1, num_outputs=2)
        else:
            g, u = add("Split", [gate_up], n_out=2, axis=1)
        axis = const([2], np.int64, "axes")
        pairs = add("Concat", [add("Unsqueeze", [g, axis]), add("Unsqueeze", [u, axis])], axis=2)  # [E, I, 2, H]
        return add("Reshape", [pairs, add("Shape", [gate_up])])
    if gate_up in interleaved:
        return interleaved[gate_up]
    arr = _initializer_array(init)
    if arr.ndim != 3 or arr.shape[1] % 2:
        raise ValueError(f"gate_up {gate_up!r} has shape {arr.shape}; expected [E, 2I, H]")
    e, two_i, h = arr.shape
    arr = np.ascontiguousarray(arr.reshape(e, 2, two_i // 2, h).transpose(0, 2, 1, 3).reshape(e, two_i, h))
    name = names.fresh(f"{gate_up}.ort_interleaved")
    tensor = graph.initializer.add()  # filled in place: no copy of a temporary TensorProto
    tensor.name = name
    tensor.data_type = init.data_type
    tensor.dims.extend(arr.shape)
    tensor.raw_data = arr.tobytes()
    interleaved[gate_up] = name
    return name


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
