"""Graph fusions for the onnxruntime target: fewer kernels per decode step.

A decode step on CPU runs ~10 small kernels per layer; each costs a thread-pool dispatch
and a pass over its activations, which at one token per row is a visible share of the step
(onnxruntime 1.32, 2 threads, 246M Llama: ~2.4 ms of ~30 ms outside MatMul). The decoder
already computes q/k/v and gate/up with one Linear each (``models.decoder``); here:

* ``pack_gqa_qkv``: GroupQueryAttention takes the fused q/k/v projection whole (its packed
  ``query`` form) instead of through a Split;
* ``fuse_skip_rmsnorm``: a residual ``Add`` followed by ``RMSNormalization`` of the sum
  becomes one ``com.microsoft.SkipSimplifiedLayerNormalization`` that also returns the sum.

Both change nodes only (no weights), and leave every value they do not replace under its
name, so later passes (quantization, MoE lowering) see the same graph, with fewer nodes.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphkiln.export.lowering.ort_moe import MS_DOMAIN, _drop_unused_initializers
from graphkiln.export.lowering.quantize import _FLOAT_TYPES

_STD = ("", "ai.onnx")


def _act_type(types: dict, add: onnx.NodeProto) -> int:
    """The residual's element type: the Add's output's when recorded, else its inputs'."""
    for name in (add.output[0], *add.input):
        if name in types:
            return types[name]
    return TensorProto.FLOAT


def fuse_skip_rmsnorm(model: onnx.ModelProto) -> int:
    """Add(x, y) -> RMSNormalization(sum, w) => SkipSimplifiedLayerNormalization; in place.

    Only where neither Add input is a constant (a residual of two activations of the same
    shape, not a broadcast) and the norm is over the last axis with fp32 statistics. The
    fused node's fourth output is the sum, under the Add's name, for its other readers.
    Returns the number of fusions.
    """
    g = model.graph
    constants = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant" for o in n.output}
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    producer = {o: n for n in g.node for o in n.output}
    fused: dict[int, onnx.NodeProto] = {}  # id(add) -> fused node, which takes the Add's place
    drop: set[int] = set()
    used_adds: set[int] = set()
    for norm in g.node:
        if norm.op_type != "RMSNormalization" or norm.domain not in _STD or len(norm.input) != 2:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in norm.attribute}
        add = producer.get(norm.input[0])
        if (attrs.get("axis", -1) != -1 or attrs.get("stash_type", 1) != 1 or add is None or add.op_type != "Add"
                or add.domain not in _STD or id(add) in used_adds or any(i in constants for i in add.input)
                or norm.input[1] not in constants
                or types.get(add.output[0], TensorProto.FLOAT) not in _FLOAT_TYPES
                # the fused kernel takes one type for activations and scale (onnxruntime refuses the graph else)
                or types.get(norm.input[1], _act_type(types, add)) != _act_type(types, add)):
            continue
        used_adds.add(id(add))
        fused[id(add)] = helper.make_node(
            "SkipSimplifiedLayerNormalization", [add.input[0], add.input[1], norm.input[1]],
            [norm.output[0], "", "", add.output[0]], name=f"{norm.name or norm.output[0]}.skip", domain=MS_DOMAIN,
            epsilon=float(attrs.get("epsilon", 1e-5)))
        drop.add(id(norm))
    if not fused:
        return 0
    new_nodes = [fused.get(id(n), n) for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(new_nodes)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return len(fused)


def pack_gqa_qkv(model: onnx.ModelProto) -> int:
    """GroupQueryAttention fed by one Split's three outputs (q, k, v in order, read by nothing
    else) takes the unsplit tensor as its packed ``query`` and no key/value; the Split goes.
    Returns the number of nodes packed."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    readers: dict[str, int] = {}
    for n in g.node:
        for i in n.input:
            readers[i] = readers.get(i, 0) + 1
    graph_outputs = {o.name for o in g.output}
    drop: set[int] = set()
    sizes: set[str] = set()  # the removed Splits' split-size initializers
    for n in g.node:
        if n.op_type != "GroupQueryAttention" or n.domain != MS_DOMAIN:
            continue
        split = producer.get(n.input[0])
        if (split is None or split.op_type != "Split" or list(split.output) != list(n.input[:3])
                or any(readers.get(o, 0) != 1 or o in graph_outputs for o in split.output)):
            continue
        n.input[0], n.input[1], n.input[2] = split.input[0], "", ""
        drop.add(id(split))
        sizes.update(split.input[1:])
    if drop:
        keep = [n for n in g.node if id(n) not in drop]
        del g.node[:]
        g.node.extend(keep)
        _drop_unused_initializers(g, sizes)
    return len(drop)
