"""Lower ``graphkiln.SsmScan`` to onnxruntime's ``com.microsoft.LinearAttention``.

LinearAttention with ``update_rule="gated"`` runs ``S_t = exp(g_t) S_{t-1} + k_t v_t^T``,
``o_t = scale * S_t^T q_t`` with its state [B, H_kv, d_k, d_v], which is the op's scan with
k = Bm (d_k = N), v = dt * x (d_v = P), g = dt * A (one log-decay per head), q = Cm and
scale 1, in the op's own pool layout [slots, H, N, P] (no transpose). Its heads: k and v share
H_kv = H, so Bm is repeated to the H heads (each group serving H / G consecutive heads, the op's
h // (H / G)); q stays at the G groups — the kernel's "inverse GQA" (q_num_heads < kv_num_heads)
maps kv head h to q head h // (H / G), exactly the op's head-to-group map, and emits one output
per kv head (lowering/ort_gated_delta.py verified the mapping; the parity tests here check it
again with G < H).

What it does not do, the lowering does around it, with standard ops (as the op's function):
  * dt: softplus(dt + dt_bias), clamped to [dt_min, dt_max], rounded to dt's dtype as the op
    does; everything after it in fp32 (the kernel runs in fp32 here whatever the model dtype);
  * D * x, added to the kernel's output;
  * slots and lengths: the rows' states are gathered from the pool at ``slot_idx``; past each
    row's ``seq_lens`` the decay is 0 (exp = 1) and k and v are zeroed (Where, so even
    non-finite padding cannot leak in), so a padded token leaves the state exactly as it was,
    and y there is 0; the new rows are returned (``state_update`` 0) or scattered into the
    pool (1), as the op does.

A node is lowered only when its head and group counts are known statically (the kernel's
attributes): from the graph's value_info, inputs or initializers for x / A / D / dt_bias and
Bm / Cm. Others keep their function.

Speed, measured (onnxruntime 1.32, CPU, fp32, 2 intra-op threads; median ms per run over 50,
three runs, on a 2-core machine shared with other jobs, load average 4-6, so the absolute
figures are high and noisy; H = 32 heads, P = 64, N = 128, G = 4 groups, batch 1, an 8-slot
pool; inputs and outputs bound once in host memory, state_update 1 with new_state bound to the
pool's own buffer; ``python tests/test_ort_ssm_scan.py`` reruns it):
                                          decode S=1       decode S=1       prefill S=128
                                          state_update 0   state_update 1   state_update 0
  the op's function (Scan over tokens)    0.35-0.41        0.39-0.42        122-147
  this lowering (LinearAttention)         0.14-0.15        0.15-0.19        16-20
About 2.5x faster per decode step and 7x per 128-token prefill, so
``graphkiln.export.pipeline`` runs it for the onnxruntime target (after the gated-delta pass).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from graphkiln.export.lowering.constants import Constants, numbered
from graphkiln.export.lowering.ort_attention import MS_DOMAIN, _attr, _drop_unused_function
from graphkiln.ops.spec import DOMAIN
from graphkiln.ops.ssm_scan import FLOAT32_MAX

_FLOAT = TensorProto.FLOAT


def lower_ssm_scan_for_onnxruntime(model: onnx.ModelProto) -> int:
    """Rewrite every lowerable ``graphkiln.SsmScan`` node of ``model.graph`` in place; returns
    how many were rewritten."""
    g = model.graph
    dims = _static_dims(g)
    new_nodes, lowered = [], 0
    const = Constants(new_nodes, numbered("ssm_scan.const"))

    body = []
    for node in g.node:
        if node.domain != DOMAIN or node.op_type != "SsmScan":
            body.append(node)
            continue
        x, _, a, bm, cm, d, dt_bias = node.input[:7]
        heads = _first_int((dims.get(x), 2), (dims.get(a), 0), (dims.get(d), 0), (dims.get(dt_bias), 0))
        groups = _first_int((dims.get(bm), 2), (dims.get(cm), 2))
        if heads is None or groups is None or heads % groups:
            body.append(node)
            continue
        body += _lowered(node, heads, groups, const)
        lowered += 1
    if not lowered:
        return 0
    del g.node[:]
    g.node.extend(new_nodes + body)
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    _drop_unused_function(model, "SsmScan")
    return lowered


def _lowered(node, heads: int, groups: int, const) -> list:
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = node.input
    y, new_state = node.output
    p = f"{node.name or y}.linear_attention"
    in_place = int(_attr(node, "state_update", 0))
    dt_min = float(_attr(node, "dt_min", 0.0))
    dt_max = float(_attr(node, "dt_max", FLOAT32_MAX))
    zero = const(0.0, _FLOAT)
    packed = const([0, 0, -1])
    mk = helper.make_node
    out = [
        # real tokens: position < seq_lens[b], [B, S] then broadcastable to [B, S, H] and [B, S, H, P]
        mk("Shape", [x], [f"{p}.x_shape"]),
        mk("Slice", [f"{p}.x_shape", const([1]), const([2])], [f"{p}.seq"]),
        mk("Squeeze", [f"{p}.seq", const([0])], [f"{p}.seq_scalar"]),
        mk("Range", [const(0), f"{p}.seq_scalar", const(1)], [f"{p}.steps"]),
        mk("Cast", [seq_lens], [f"{p}.lens64"], to=TensorProto.INT64),
        mk("Unsqueeze", [f"{p}.lens64", const([1])], [f"{p}.lens"]),
        mk("Less", [f"{p}.steps", f"{p}.lens"], [f"{p}.real"]),
        mk("Unsqueeze", [f"{p}.real", const([2])], [f"{p}.real3"]),
        mk("Unsqueeze", [f"{p}.real", const([2, 3])], [f"{p}.real4"]),
        # dt = clamp(softplus(dt + dt_bias)) with the op's roundings to dt's dtype (no-ops in fp32)
        mk("CastLike", [dt_bias, dt], [f"{p}.bias_dt"]),
        mk("Cast", [f"{p}.bias_dt"], [f"{p}.bias_f"], to=_FLOAT),
        mk("Cast", [dt], [f"{p}.dt_f"], to=_FLOAT),
        mk("Add", [f"{p}.dt_f", f"{p}.bias_f"], [f"{p}.raw_f"]),
        mk("CastLike", [f"{p}.raw_f", dt], [f"{p}.raw_dt"]),
        mk("Cast", [f"{p}.raw_dt"], [f"{p}.raw"], to=_FLOAT),
        mk("Softplus", [f"{p}.raw"], [f"{p}.softplus"]),
        mk("Clip", [f"{p}.softplus", const(dt_min, _FLOAT), const(dt_max, _FLOAT)],
           [f"{p}.clipped"]),
        mk("CastLike", [f"{p}.clipped", dt], [f"{p}.step_dt"]),
        mk("Cast", [f"{p}.step_dt"], [f"{p}.step_f"], to=_FLOAT),
        mk("Where", [f"{p}.real3", f"{p}.step_f", zero], [f"{p}.step"]),  # [B, S, H]; 0 on padding
        # the kernel's log-decay, one per (token, head): dt * A (0 on padding: exp = 1)
        mk("Cast", [a], [f"{p}.a_f"], to=_FLOAT),
        mk("Mul", [f"{p}.step", f"{p}.a_f"], [f"{p}.decay"]),
        # v = dt * x, zeroed on padding
        mk("Cast", [x], [f"{p}.x_f"], to=_FLOAT),
        mk("Unsqueeze", [f"{p}.step", const([3])], [f"{p}.step4"]),
        mk("Mul", [f"{p}.x_f", f"{p}.step4"], [f"{p}.v4"]),
        mk("Where", [f"{p}.real4", f"{p}.v4", zero], [f"{p}.v4_real"]),
        mk("Reshape", [f"{p}.v4_real", packed], [f"{p}.v"]),  # [B, S, H * P]
        # k = Bm, zeroed on padding and repeated from the G groups to the H heads
        mk("Cast", [bm], [f"{p}.b_f"], to=_FLOAT),
        mk("Where", [f"{p}.real4", f"{p}.b_f", zero], [f"{p}.b_real"]),  # [B, S, G, N]
    ]
    k4 = f"{p}.b_real"
    if heads != groups:  # [B, S, G, 1, N] broadcast to [B, S, G, H / G, N]
        out += [mk("Unsqueeze", [k4, const([3])], [f"{p}.b5"]),
                mk("Expand", [f"{p}.b5", const([1, 1, 1, heads // groups, 1])], [f"{p}.b_heads"])]
        k4 = f"{p}.b_heads"
    out += [
        mk("Reshape", [k4, packed], [f"{p}.k"]),  # [B, S, H * N]
        # q = Cm at the G groups (inverse GQA); its padding only reaches y at padded tokens, zeroed below
        mk("Cast", [cm], [f"{p}.c_f"], to=_FLOAT),
        mk("Reshape", [f"{p}.c_f", packed], [f"{p}.q"]),  # [B, S, G * N]
        mk("Gather", [pool, slot_idx], [f"{p}.rows"], axis=0),
        mk("Cast", [f"{p}.rows"], [f"{p}.state"], to=_FLOAT),  # [B, H, N, P]
        mk("LinearAttention", [f"{p}.q", f"{p}.k", f"{p}.v", f"{p}.state", f"{p}.decay"],
           [f"{p}.o", f"{p}.new_rows_f"], name=p, domain=MS_DOMAIN, q_num_heads=groups, kv_num_heads=heads,
           scale=1.0, update_rule="gated"),
        # y = S^T C + D * x, 0 on padding, in x's dtype
        mk("Reshape", [f"{p}.o", f"{p}.x_shape"], [f"{p}.o4"]),
        mk("Cast", [d], [f"{p}.d_f"], to=_FLOAT),
        mk("Unsqueeze", [f"{p}.d_f", const([1])], [f"{p}.d2"]),  # [H, 1]
        mk("Mul", [f"{p}.d2", f"{p}.x_f"], [f"{p}.dx"]),
        mk("Add", [f"{p}.o4", f"{p}.dx"], [f"{p}.y_f"]),
        mk("Where", [f"{p}.real4", f"{p}.y_f", zero], [f"{p}.y_real"]),
        mk("CastLike", [f"{p}.y_real", x], [y]),
        mk("CastLike", [f"{p}.new_rows_f", pool], [f"{p}.new_rows"]),
    ]
    if in_place:
        out += [mk("Cast", [slot_idx], [f"{p}.slot64"], to=TensorProto.INT64),
                mk("Unsqueeze", [f"{p}.slot64", const([1])], [f"{p}.slots"]),
                mk("ScatterND", [pool, f"{p}.slots", f"{p}.new_rows"], [new_state])]
    else:
        out.append(mk("Identity", [f"{p}.new_rows"], [new_state]))
    return out


def _static_dims(g: onnx.GraphProto) -> dict[str, list]:
    """Each value's dims (an int where known) from the graph's inputs, value_info and initializers."""
    out = {t.name: list(t.dims) for t in g.initializer}
    for v in list(g.input) + list(g.value_info):
        dims = v.type.tensor_type.shape.dim
        out[v.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    return out


def _first_int(*candidates) -> int | None:
    """The first (dims, axis) whose dim is a known positive int."""
    for dims, axis in candidates:
        if dims is not None and len(dims) > axis and isinstance(dims[axis], int) and dims[axis] > 0:
            return dims[axis]
    return None
