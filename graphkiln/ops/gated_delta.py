"""``graphkiln.GatedDeltaRule``: the gated delta rule recurrence of Qwen3.5 / Qwen3-Next linear attention.

q / k [B, S, Hk, Dk], v [B, S, Hv, Dv], g [B, S, Hv] (log of the per-step decay, <= 0),
beta [B, S, Hv] (the update rate, already sigmoid-ed), state_pool [slots, Hv, Dk, Dv],
slot_idx [B] (row b's slot), seq_lens [B] (row b's real tokens; rows are right-padded to S)
-> y [B, S, Hv, Dv] (v's dtype) and, by ``state_update``:
  0 (default): new_state [B, Hv, Dk, Dv], row b's new state; the caller writes the rows back
     into ``state_pool[slot_idx]``.
  1: new_state [slots, Hv, Dk, Dv], the whole pool with row slot_idx[b] replaced by row b's new
     state (other slots unchanged), as ShortConv's ``state_update`` — so TensorRT's plugin and
     onnxruntime (the function's ScatterND, with new_state bound to the pool) write it in place.

Semantics: transformers' ``torch_recurrent_gated_delta_rule`` / ``torch_chunk_gated_delta_rule``
(qwen3_5 / qwen3_next, transformers 5.x) with ``use_qk_l2norm_in_kernel`` = ``qk_l2norm``,
extended with a state pool and right-padded rows. Everything runs in fp32. Hv is a multiple of
Hk and value head h reads q/k head h // (Hv / Hk) (``repeat_interleave`` on the head axis, as
transformers expands them). With ``qk_l2norm`` = 1, q and k are first multiplied by
rsqrt(sum(x^2) + 1e-6) over Dk (transformers' ``l2norm``); then q is multiplied by ``scale``
(transformers: Dk ** -0.5). Row b starts from S = state_pool[slot_idx[b]] ([Dk, Dv] per value
head) and for each real token t:

    S   = S * exp(g_t)
    d   = (v_t - S^T k_t) * beta_t
    S   = S + k_t d^T
    y_t = S^T q_t               (the state *after* token t; q already carries the scale)

Tokens t >= seq_lens[b] take g = 0 and beta = 0, which leaves S exactly unchanged, so a row's
new state is its state after its real tokens (a row with seq_lens 0 keeps its state), and
y at those positions is 0. Inputs at padded positions must be finite (g and beta there are
replaced, not multiplied, so they may hold anything). slot_idx holds distinct slots; the
runtime zeroes a slot when a sequence claims it.

Why one op: the recurrence is what each runtime implements its own way (a TensorRT plugin, a
fused kernel); the portable graph carries it whole, with the standard-ONNX Scan below for
runtimes that have neither.
"""

from __future__ import annotations

from graphkiln.ops import slot_state
from graphkiln.ops.spec import AttrSpec, CustomOpSpec

SPEC = CustomOpSpec(
    name="GatedDeltaRule",
    torch_name="gated_delta_rule",
    inputs=("q", "k", "v", "g", "beta", "state_pool", "slot_idx", "seq_lens"),
    outputs=("y", "new_state"),
    attributes=(
        AttrSpec("scale", "float", "multiplies q after the l2norm (usually Dk ** -0.5)"),
        # the in-place mode right after the required attributes, as every in-place op has it, so
        # callers pass (scale, mode) positionally (tests/test_custom_ops.py)
        AttrSpec("state_update", "int", "0: return the new rows; 1: return the whole pool with them written in place",
                 default=0),
        AttrSpec("qk_l2norm", "int", "1: L2-normalise q and k over Dk (eps 1e-6) inside the op; 0: use them as given",
                 default=1),
    ),
    output_dtypes_from=("v", "state_pool"),
    doc=__doc__,
)

# The attribute that makes new_state the whole (aliased) pool: 1 on every TensorRT node.
IN_PLACE_ATTR = "state_update"

L2NORM_EPS = 1e-6  # transformers' l2norm (and FLA's) eps, inside the rsqrt
CHUNK_SIZE = 64  # transformers' default chunk for the chunked form


def prepare(q, k, v, g, beta, seq_lens, scale: float, qk_l2norm: int):
    """The recurrence's fp32 operands, heads first: q (normalised, scaled) and k expanded to Hv
    heads [B, Hv, S, Dk], v [B, Hv, S, Dv], g and beta [B, Hv, S] with padded tokens set to
    0 (no decay, no update), and the real-token mask [B, S]."""
    import torch

    s = q.shape[1]
    valid = torch.arange(s, device=q.device).unsqueeze(0) < seq_lens.to(q.device).unsqueeze(1)  # [B, S]
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    if qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + L2NORM_EPS)
    q = q * scale
    rep = v.shape[2] // k.shape[2]
    if rep != 1:  # after the norm: the same per-vector math, on Hk heads instead of Hv
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    m = valid.unsqueeze(2)
    g = torch.where(m, g, torch.zeros((), dtype=g.dtype))
    beta = torch.where(m, beta, torch.zeros((), dtype=beta.dtype))
    q, k, v, g, beta = (x.transpose(1, 2).contiguous() for x in (q, k, v, g, beta))
    return q, k, v, g, beta, valid


def recurrent(q, k, v, g, beta, state):
    """The per-token recurrence on ``prepare``'s operands from ``state`` [B, Hv, Dk, Dv] (fp32)
    -> (y [B, Hv, S, Dv], final state); transformers' torch_recurrent_gated_delta_rule's order."""
    import torch

    y = torch.empty_like(v)
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        y[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
    return y, state


def chunked(q, k, v, g, beta, state, chunk_size: int = CHUNK_SIZE):
    """The same recurrence in chunks (transformers' torch_chunk_gated_delta_rule: a UT transform
    per chunk, a scan over chunks); padded tokens (g = beta = 0) and the tail padding to a whole
    chunk leave the state unchanged, as in ``recurrent``."""
    import torch
    import torch.nn.functional as F

    b, h, s, _ = q.shape
    pad = (chunk_size - s % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    n = (s + pad) // chunk_size
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(b, h, n, chunk_size).cumsum(dim=3)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    # exp(cum_i - cum_j) <= 1 for j <= i; the upper triangle is masked before exp so it cannot overflow
    pairwise = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, k_beta * cum.exp().unsqueeze(-1), upper=False, unitriangular=True)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    y = torch.empty_like(new_values)
    for i in range(n):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        y[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return y.reshape(b, h, -1, y.shape[-1])[:, :, :s], state


def reference(q, k, v, g, beta, state_pool, slot_idx, seq_lens, scale, state_update=0, qk_l2norm=1):
    import torch

    qf, kf, vf, gf, bf, valid = prepare(q, k, v, g, beta, seq_lens, scale, qk_l2norm)
    state = state_pool.index_select(0, slot_idx).float()
    # The loop is cheaper below a chunk (the chunked form pads to whole chunks); both are tested
    # against transformers.
    form = chunked if q.shape[1] >= CHUNK_SIZE else recurrent
    y, state = form(qf, kf, vf, gf, bf, state)
    y = torch.where(valid.unsqueeze(1).unsqueeze(-1), y, torch.zeros((), dtype=y.dtype))
    y = y.transpose(1, 2).contiguous().to(v.dtype)
    rows = state.to(state_pool.dtype)
    return y, slot_state.new_state(state_pool, slot_idx, rows, state_update)


def fake(q, k, v, g, beta, state_pool, slot_idx, seq_lens, scale, state_update=0, qk_l2norm=1):
    return v.new_empty(v.shape), slot_state.fake_new_state(state_pool, v.shape[0], state_update)


def onnx_function(opset: int):
    """A Scan over the S axis carrying the fp32 state [B, Hv, Dk, Dv]; everything per token
    that does not depend on the state (norm, scale, head expansion, exp(g), padding masks) is
    done once outside it, so a step is two MatMuls and five elementwise ops."""
    import onnxscript
    from onnx import TensorProto
    from onnxscript import graph
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)

    @onnxscript.script(gk, default_opset=op)
    def GatedDeltaRule(q, k, v, g, beta, state_pool, slot_idx, seq_lens, scale: float, plugin_namespace: str,
                       plugin_version: str, state_update: int = 0, qk_l2norm: int = 1):
        # The step sees one token of every row: state [B, Hv, Dk, Dv], q_t / k_t [B, Hv, 1, Dk]
        # (rows), k_col [B, Hv, Dk, 1], v_t [B, Hv, 1, Dv], decay / rate [B, Hv, 1, 1]. It reads
        # nothing from outside (no attribute references inside the subgraph).
        @graph()
        def step(state, q_t, k_t, k_col, v_t, decay, rate):
            decayed = op.Mul(state, decay)
            delta = op.Mul(op.Sub(v_t, op.MatMul(k_t, decayed)), rate)  # (v - S^T k) * beta
            new = op.Add(decayed, op.Mul(k_col, delta))  # + k d^T
            return new, op.MatMul(q_t, new)

        one = op.Constant(value_ints=[1])
        minus1 = op.Constant(value_ints=[-1])
        qf = op.Cast(q, to=TensorProto.FLOAT)
        kf = op.Cast(k, to=TensorProto.FLOAT)
        # qk_l2norm is a constant once the function is inlined: onnxruntime folds the If.
        if op.Equal(op.Constant(value_int=qk_l2norm), op.Constant(value_int=1)):
            eps = op.Constant(value_float=L2NORM_EPS)
            qn = op.Div(qf, op.Sqrt(op.Add(op.ReduceSum(op.Mul(qf, qf), minus1, keepdims=1), eps)))
            kn = op.Div(kf, op.Sqrt(op.Add(op.ReduceSum(op.Mul(kf, kf), minus1, keepdims=1), eps)))
        else:
            qn = op.Identity(qf)
            kn = op.Identity(kf)
        qn = op.Mul(qn, op.Constant(value_float=scale))

        # repeat_interleave over heads: [B, S, Hk, Dk] -> [B, S, Hk, rep, Dk] -> [B, S, Hv, Dk]
        hk = op.Shape(q, start=2, end=3)
        rep = op.Div(op.Shape(v, start=2, end=3), hk)
        bs = op.Shape(q, start=0, end=2)
        dk = op.Shape(q, start=3, end=4)
        wide = op.Concat(bs, hk, rep, dk, axis=0)
        heads = op.Concat(bs, minus1, dk, axis=0)
        axis3 = op.Constant(value_ints=[3])
        qh = op.Reshape(op.Expand(op.Unsqueeze(qn, axis3), wide), heads)
        kh = op.Reshape(op.Expand(op.Unsqueeze(kn, axis3), wide), heads)

        # Padded tokens: g -> 0 (decay 1) and beta -> 0 (no update) leave the state exactly as it is.
        steps = op.Range(op.Constant(value_int=0), op.Squeeze(op.Shape(q, start=1, end=2)), op.Constant(value_int=1))
        lens = op.Cast(seq_lens, to=TensorProto.INT64)
        valid = op.Less(op.Unsqueeze(steps, op.Constant(value_ints=[0])), op.Unsqueeze(lens, one))  # [B, S]
        valid3 = op.Unsqueeze(valid, op.Constant(value_ints=[2]))  # [B, S, 1]
        zero = op.Constant(value_float=0.0)
        decay = op.Exp(op.Where(valid3, op.Cast(g, to=TensorProto.FLOAT), zero))  # [B, S, Hv]
        rate = op.Where(valid3, op.Cast(beta, to=TensorProto.FLOAT), zero)

        # Scan inputs, S first.
        q_s = op.Unsqueeze(op.Transpose(qh, perm=[1, 0, 2, 3]), op.Constant(value_ints=[3]))  # [S, B, Hv, 1, Dk]
        k_t = op.Transpose(kh, perm=[1, 0, 2, 3])
        k_s = op.Unsqueeze(k_t, op.Constant(value_ints=[3]))  # [S, B, Hv, 1, Dk]
        k_col = op.Unsqueeze(k_t, op.Constant(value_ints=[4]))  # [S, B, Hv, Dk, 1]
        v_s = op.Unsqueeze(op.Transpose(op.Cast(v, to=TensorProto.FLOAT), perm=[1, 0, 2, 3]),
                           op.Constant(value_ints=[3]))  # [S, B, Hv, 1, Dv]
        gates = op.Constant(value_ints=[3, 4])
        decay_s = op.Unsqueeze(op.Transpose(decay, perm=[1, 0, 2]), gates)  # [S, B, Hv, 1, 1]
        rate_s = op.Unsqueeze(op.Transpose(rate, perm=[1, 0, 2]), gates)

        state0 = op.Cast(op.Gather(state_pool, slot_idx, axis=0), to=TensorProto.FLOAT)  # [B, Hv, Dk, Dv]
        state, ys = op.Scan(state0, q_s, k_s, k_col, v_s, decay_s, rate_s, body=step, num_scan_inputs=6)
        ys = op.Transpose(op.Squeeze(ys, axis3), perm=[1, 0, 2, 3])  # [S, B, Hv, 1, Dv] -> [B, S, Hv, Dv]
        y = op.CastLike(op.Where(op.Unsqueeze(valid3, axis3), ys, zero), v)

        rows = op.CastLike(state, state_pool)
        # state_update is a constant once the function is inlined: onnxruntime folds the If.
        if op.Equal(op.Constant(value_int=state_update), op.Constant(value_int=1)):
            slots = op.Unsqueeze(op.Cast(slot_idx, to=TensorProto.INT64), one)  # [B, 1]
            new_state = op.ScatterND(state_pool, slots, rows)  # reads the pool first: rows depend on it
        else:
            new_state = op.Identity(rows)
        return y, new_state

    fn = GatedDeltaRule.to_function_proto()
    _type_scan_body(fn)
    return fn


# The Scan body's values, all fp32 (None: any size): state [B, Hv, Dk, Dv], q_t, k_t, k_col, v_t,
# decay, rate; then the outputs, new state and y_t.
_STEP_INPUT_DIMS = ([None] * 4, [None, None, 1, None], [None, None, 1, None], [None, None, None, 1],
                    [None, None, 1, None], [None, None, 1, 1], [None, None, 1, 1])
_STEP_OUTPUT_DIMS = ([None] * 4, [None, None, 1, None])


def _type_scan_body(fn) -> None:
    """Declare the Scan body's inputs and outputs fp32 of known rank. onnxruntime's Scan refuses
    to run a body whose outputs have no shape ("Subgraph must have the shape set for all
    outputs"); inference gives them one only when the node's inputs have known ranks, which a
    graph need not provide (measured, onnxruntime 1.32: a node fed rank-less inputs failed at
    run time). onnxscript does not carry annotations into a nested ``@graph``, so they are
    set on the proto."""
    from onnx import TensorProto, helper

    (scan,) = (n for n in fn.node if n.op_type == "Scan")
    (body,) = (a.g for a in scan.attribute if a.name == "body")
    for values, dims in ((body.input, _STEP_INPUT_DIMS), (body.output, _STEP_OUTPUT_DIMS)):
        assert len(values) == len(dims)
        for value, d in zip(values, dims):
            value.type.CopyFrom(helper.make_tensor_type_proto(TensorProto.FLOAT, d))


# ----------------------------------------------------------------------------------------------
# onnxruntime's own kernels (onnxruntime 1.32, probed with one-node models against reference)
#
# com.microsoft.GatedDeltaNet: q [B, S, Hq, Dk] with Hq == Hk, k, v [B, S, Hv, Dv] (rank 4; a
#   packed rank-3 form takes cu_seqlens int32 for ragged rows), decay = g and beta [B, S, Hv];
#   value head h reads q/k head h // (Hv / Hk) (as here); scale (0 = Dk ** -0.5) and
#   qk_l2_norm=1 inside. Matches this op (7.7e-7 relative, S=70, Hv = 2 Hk, nonzero state),
#   except the l2norm: it is x / ||x|| (fits rsqrt(sum + 1e-12)), not transformers'
#   rsqrt(sum + 1e-6) — equal unless ||x||^2 is near 1e-6 (q, k scaled by 1e-3: 13% off);
#   normalising outside with qk_l2_norm=0 matches exactly. State: initial_state / final_state
#   [B, Hv, Dv, Dk], V-major (the transpose of this op's rows) and fp32 only; may alias. Also
#   fuses the gate maths (gate_activation="softplus" with a_log / dt_bias, beta_activation
#   "sigmoid") and captures per-token transitions for speculative decoding.
# com.microsoft.LinearAttention (and ai.onnx LinearAttention, opset 27), update_rule
#   "gated_delta": q / k / v packed [B, T, H * D] (a free Reshape of ours), state
#   [B, H_kv, Dk, Dv] K-major like this op's rows (fp32 / fp16 / bf16), decay / beta
#   [B, T, H_kv], o = scale * S^T q. No l2norm (the caller normalises). k and v share H_kv, so
#   for Hv > Hk the caller repeat_interleaves k to Hv; the com.microsoft op then takes q at Hk
#   ("inverse GQA", q_num_heads=Hk, kv_num_heads=Hv: q head h // (Hv / Hk), verified), while
#   the opset-27 op rejects q_num_heads < kv_num_heads (q expanded too) and needs opset 27.
#   Matches this op to 7e-7 once q / k are normalised.
# Neither takes slot_idx or seq_lens: a lowering gathers the pool rows (ScatterND back for
#   state_update=1) and masks g -> 0, beta -> 0 past seq_lens, which both honour exactly
#   (verified: padded rows' states and real outputs match, garbage q / k / v in the padding).
#
# Speed, CPU, fp32, 1 intra-op thread, median ms per run (the state fed from host memory),
# Hv = Hk = 16, Dk = Dv = 128; ranges over two runs on a shared 2-core machine:
#                                                  B=1 S=1     B=8 S=1    B=1 S=128
#   this function (Scan), state_update 0 / 1       0.22/0.27   3.6-4.2/5  28-30/27-36
#   GatedDeltaNet alone                            0.50-0.57   4.9-5.0    66
#     + Gather and both transposes to our layout   0.64-0.72   7.9-8.5    65-68
#   LinearAttention (com.microsoft) alone          0.062       0.62-0.80  3.6-4.2
#     + l2norm, masks, Gather (a lowering sketch)  0.15        2.7        5.3
#   LinearAttention (ai.onnx 27) alone             0.21        6.3        25
# On CPU, com.microsoft.LinearAttention is the kernel a lowering wants: 1.5x (decode) to 5x
# (prefill) faster than this function with the surrounding ops, exact, and the same state
# layout. GatedDeltaNet is slower than the Scan on CPU (its CUDA kernel was not measured) and
# its V-major fp32 state would cost two transposes per call unless pools were laid out
# [slots, Hv, Dv, Dk].
