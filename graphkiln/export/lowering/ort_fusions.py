"""Graph fusions for the onnxruntime target: fewer, larger kernels per decode step.

A decode step on CPU runs ~10 small kernels per layer; each costs a thread-pool dispatch
and a pass over its activations, which at one token per row is a visible share of the step
(onnxruntime 1.32, 2 threads, 246M Llama: ~2.4 ms of ~30 ms outside MatMul). Two fusions:

* ``fuse_parallel_matmuls``: Linear layers that read the same activations (q/k/v, gate/up)
  become one MatMul over their weights concatenated along N, then a Split back into the
  original outputs (a bias Add on every member is fused the same way). Weight bytes are
  unchanged; with ``--quant`` the fused weight is quantized as one MatMulNBits, whose blocks
  run along K, so the numbers are those of quantizing each weight alone.
* ``fuse_skip_rmsnorm``: a residual ``Add`` followed by ``RMSNormalization`` of the sum
  becomes one ``com.microsoft.SkipSimplifiedLayerNormalization`` that also returns the sum.

Both leave every value they do not replace under its name, so later passes (quantization,
MoE lowering) see the same graph shape, only with fewer nodes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphkiln.export.lowering.ort_moe import MS_DOMAIN, _NameScope, _drop_unused_initializers
from graphkiln.export.lowering.quantize import _FLOAT_TYPES, _read, _router_outputs

_STD = ("", "ai.onnx")


def fuse_parallel_matmuls(model: onnx.ModelProto, base_dir: str | Path | None = None) -> int:
    """Fuse MatMuls sharing their input A whose B are 2-D float initializers [K, N_i]; in place.

    Group members must each be their weight's only reader and not a MoE router; a group
    with a bias Add on every member (the Add its MatMul's only reader, the bias a 1-D [N_i]
    initializer) fuses the biases too; a group where only some have one is left alone.
    Returns the number of MatMuls fused away.
    """
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    graph_outputs = {o.name for o in g.output}
    routers = _router_outputs(g)

    groups: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        if (n.op_type == "MatMul" and n.domain in _STD and n.input[1] in inits
                and len(inits[n.input[1]].dims) == 2 and inits[n.input[1]].data_type in _FLOAT_TYPES
                and len(readers[n.input[1]]) == 1 and n.output[0] not in routers):
            groups.setdefault(n.input[0], []).append(n)

    names = _NameScope(g)
    replace: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> nodes in its place
    drop: set[int] = set()
    fused_away = 0
    candidates: set[str] = set()
    for a, members in groups.items():
        weights = [inits[m.input[1]] for m in members]
        if len(members) < 2 or len({(w.dims[0], w.data_type) for w in weights}) != 1:
            continue
        adds = [_bias_add(m, readers, inits, graph_outputs) for m in members]
        if any(adds) and not all(adds):
            continue
        sizes = [int(w.dims[1]) for w in weights]
        stem = names.fresh(f"{members[0].name or members[0].output[0]}.fused{len(members)}")
        w_name, mm_out = names.fresh(f"{stem}.weight"), names.fresh(f"{stem}.out")
        g.initializer.append(numpy_helper.from_array(
            np.concatenate([_read(w, base_dir) for w in weights], axis=1), w_name))
        nodes = [helper.make_node("MatMul", [a, w_name], [mm_out], name=f"{stem}.matmul")]
        if all(adds):
            b_name, mm_out = names.fresh(f"{stem}.bias"), names.fresh(f"{stem}.biased")
            g.initializer.append(numpy_helper.from_array(
                np.concatenate([_read(inits[b], base_dir) for _, b in adds]), b_name))
            nodes.append(helper.make_node("Add", [nodes[0].output[0], b_name], [mm_out], name=f"{stem}.add"))
            outs = [add.output[0] for add, _ in adds]
            drop.update(id(add) for add, _ in adds)
            candidates.update(b for _, b in adds)
        else:
            outs = [m.output[0] for m in members]
        split = names.fresh(f"{stem}.split_sizes")
        g.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), split))
        nodes.append(helper.make_node("Split", [mm_out, split], outs, axis=-1, name=f"{stem}.split"))
        replace[id(members[0])] = nodes
        drop.update(id(m) for m in members[1:])
        candidates.update(w.name for w in weights)
        fused_away += len(members) - 1

    if not replace:
        return 0
    new_nodes: list[onnx.NodeProto] = []
    for n in g.node:
        if id(n) in replace:
            new_nodes.extend(replace[id(n)])
        elif id(n) not in drop:
            new_nodes.append(n)
    del g.node[:]
    g.node.extend(new_nodes)
    _drop_unused_initializers(g, candidates)
    return fused_away


def _bias_add(mm: onnx.NodeProto, readers, inits, graph_outputs) -> tuple[onnx.NodeProto, str] | None:
    out = mm.output[0]
    users = readers.get(out, [])
    if out in graph_outputs or len(users) != 1 or users[0].op_type != "Add" or users[0].domain not in _STD:
        return None
    add = users[0]
    other = add.input[1] if add.input[0] == out else add.input[0]
    b = inits.get(other)
    n = inits[mm.input[1]].dims[1]
    if other == out or b is None or list(b.dims) != [n] or b.data_type != inits[mm.input[1]].data_type:
        return None
    return add, other


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
                or types.get(add.output[0], TensorProto.FLOAT) not in _FLOAT_TYPES):
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
