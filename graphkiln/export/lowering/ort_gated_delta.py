"""Lower ``graphkiln.GatedDeltaRule`` to onnxruntime's ``com.microsoft.LinearAttention``.

LinearAttention (``update_rule="gated_delta"``) runs the same recurrence as the op's function,
``S = exp(g) S + beta k (v - exp(g) S^T k)^T``, ``y = scale S^T q``, with its state in the same
[B, H, Dk, Dv] layout, in one CPU kernel (chunk-parallel for prefill): measured on onnxruntime
1.32 (Hv = Hk = 16, Dk = Dv = 128, one thread) 0.15 ms per decode step against the function's
0.22, and 5.3 ms for a 128-token prefill against 28 (graphkiln/ops/gated_delta.py).

What it does not do, the lowering does around it, with standard ops:
  * transformers' L2 norm of q and k (``x * rsqrt(sum(x^2) + 1e-6)``; the kernel has none);
  * k repeated to the v heads (its k and v share a head count; q stays at the q/k heads: the
    kernel's "inverse GQA" maps v head h to q head h // (Hv / Hk), as the op does);
  * slots and lengths: the rows' states are gathered from the pool at ``slot_idx``, and ``g`` and
    ``beta`` are zeroed past each row's ``seq_lens`` so padding leaves a state exactly as it was;
    the new rows are returned (``state_update`` 0) or scattered into the pool (1), as the op does.
The output at padded positions is whatever the kernel computes there (the op's function gives
zeros); nothing reads it.

A node is lowered only when its head counts are known statically (the graph's value_info for q,
the pool input's shape); others keep their function.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphkiln.export.lowering.constants import Constants, numbered
from graphkiln.export.lowering.ort_attention import MS_DOMAIN, _attr, _drop_unused_function
from graphkiln.ops.spec import DOMAIN

_EPS = 1e-6  # transformers' l2norm eps (the op's)


def lower_gated_delta_for_onnxruntime(model: onnx.ModelProto) -> int:
    """Rewrite every lowerable ``graphkiln.GatedDeltaRule`` node of ``model.graph`` in place;
    returns how many were rewritten."""
    g = model.graph
    shapes = _static_shapes(g)
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.value_info)}
    new_nodes, lowered = [], 0
    const = Constants(new_nodes, numbered("gated_delta.const"))

    body = []
    for node in g.node:
        q_shape = shapes.get(node.input[0]) if node.domain == DOMAIN and node.op_type == "GatedDeltaRule" else None
        pool_shape = shapes.get(node.input[5]) if q_shape is not None else None
        if (q_shape is None or pool_shape is None or not all(isinstance(d, int) for d in (q_shape[2], *pool_shape[1:]))
                or types.get(node.input[0]) not in (TensorProto.FLOAT, TensorProto.FLOAT16)):
            body.append(node)
            continue
        body += _lowered(node, q_shape[2], *pool_shape[1:], types[node.input[0]], const)
        lowered += 1
    if not lowered:
        return 0
    del g.node[:]
    g.node.extend(new_nodes + body)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    _drop_unused_function(model, "GatedDeltaRule")
    return lowered


def _lowered(node, hk: int, hv: int, dk: int, dv: int, elem: int, const) -> list:
    q, k, v, decay, beta, pool, slot_idx, seq_lens = node.input
    y, new_state = node.output
    p = f"{node.name or y}.linear_attention"
    scale = float(_attr(node, "scale", 0.0))
    l2norm = int(_attr(node, "qk_l2norm", 1))
    in_place = int(_attr(node, "state_update", 0))
    eps = const(_EPS, elem)
    out: list = []

    def l2(x: str, what: str) -> str:
        if not l2norm:
            return x
        out.extend([
            helper.make_node("Mul", [x, x], [f"{p}.{what}_sq"]),
            helper.make_node("ReduceSum", [f"{p}.{what}_sq", const([-1])], [f"{p}.{what}_ss"], keepdims=1),
            helper.make_node("Add", [f"{p}.{what}_ss", eps], [f"{p}.{what}_ss_eps"]),
            helper.make_node("Sqrt", [f"{p}.{what}_ss_eps"], [f"{p}.{what}_norm"]),
            helper.make_node("Div", [x, f"{p}.{what}_norm"], [f"{p}.{what}_unit"]),
        ])
        return f"{p}.{what}_unit"

    qn, kn = l2(q, "q"), l2(k, "k")
    if hv != hk:  # k repeated to the v heads, each q/k head serving hv/hk consecutive v heads
        out += [helper.make_node("Unsqueeze", [kn, const([3])], [f"{p}.k5"]),
                helper.make_node("Shape", [kn], [f"{p}.k_shape"]),
                helper.make_node("Slice", [f"{p}.k_shape", const([0]), const([2])], [f"{p}.bs"]),
                helper.make_node("Concat", [f"{p}.bs", const([hk, hv // hk, dk])], [f"{p}.k5_shape"], axis=0),
                helper.make_node("Expand", [f"{p}.k5", f"{p}.k5_shape"], [f"{p}.k_rep5"])]
        kn = f"{p}.k_rep5"
    packed = []
    for x, heads, d, what in ((qn, hk, dk, "q"), (kn, hv, dk, "k"), (v, hv, dv, "v")):
        out.append(helper.make_node("Reshape", [x, const([0, 0, heads * d])], [f"{p}.{what}_packed"]))
        packed.append(f"{p}.{what}_packed")
    # padding: g and beta zero past each row's length (state untouched), as the op's masks
    out += [helper.make_node("Shape", [decay], [f"{p}.g_shape"]),
            helper.make_node("Slice", [f"{p}.g_shape", const([1]), const([2])], [f"{p}.seq"]),
            helper.make_node("Squeeze", [f"{p}.seq", const([0])], [f"{p}.seq_scalar"]),
            helper.make_node("Range", [const(0), f"{p}.seq_scalar", const(1)], [f"{p}.steps"]),
            helper.make_node("Unsqueeze", [seq_lens, const([1])], [f"{p}.lens"]),
            helper.make_node("Less", [f"{p}.steps", f"{p}.lens"], [f"{p}.real"]),  # [B, S]
            helper.make_node("Unsqueeze", [f"{p}.real", const([2])], [f"{p}.real3"]),
            # the kernel takes every input in q's type (the model computes g in fp32)
            helper.make_node("CastLike", [decay, q], [f"{p}.g_q"]),
            helper.make_node("Where", [f"{p}.real3", f"{p}.g_q", const(0.0, elem)], [f"{p}.g"]),
            helper.make_node("CastLike", [beta, q], [f"{p}.beta_q"]),
            helper.make_node("Where", [f"{p}.real3", f"{p}.beta_q", const(0.0, elem)], [f"{p}.beta"]),
            helper.make_node("Gather", [pool, slot_idx], [f"{p}.state"], axis=0),
            helper.make_node("CastLike", [f"{p}.state", q], [f"{p}.state_f"])]
    out.append(helper.make_node(
        "LinearAttention", [*packed, f"{p}.state_f", f"{p}.g", f"{p}.beta"], [f"{p}.y_packed", f"{p}.new_rows_f"],
        name=p, domain=MS_DOMAIN, q_num_heads=hk, kv_num_heads=hv, scale=scale, update_rule="gated_delta"))
    out += [helper.make_node("Reshape", [f"{p}.y_packed", const([0, 0, hv, dv])], [y]),
            helper.make_node("CastLike", [f"{p}.new_rows_f", pool], [f"{p}.new_rows"])]
    if in_place:
        out += [helper.make_node("Unsqueeze", [slot_idx, const([1])], [f"{p}.slots"]),
                helper.make_node("ScatterND", [pool, f"{p}.slots", f"{p}.new_rows"], [new_state])]
    else:
        out.append(helper.make_node("Identity", [f"{p}.new_rows"], [new_state]))
    return out


def _static_shapes(g: onnx.GraphProto) -> dict[str, list]:
    out = {}
    for v in list(g.input) + list(g.value_info):
        dims = v.type.tensor_type.shape.dim
        out[v.name] = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
    return out
