"""``graphkiln.SsmScan``: Mamba-2's selective state-space scan over new tokens with a state pool.

x [B, S, H, P] (right-padded rows; H heads of P channels), dt [B, S, H] (raw: before dt_bias
and softplus), A [H] (-exp(A_log), negative), Bm / Cm [B, S, G, N] (G groups of N state
channels; G divides H), D [H], dt_bias [H], state_pool [slots, H, N, P], slot_idx [B] (row b's
slot; distinct), seq_lens [B] (row b's real tokens) -> y [B, S, H, P] and, by ``state_update``:
  0 (default): new_state [B, H, N, P], row b's new state; the caller writes the rows back into
     ``state_pool[slot_idx]``.
  1: new_state [slots, H, N, P], the whole pool with row slot_idx[b] replaced by row b's new
     state (other slots unchanged); TensorRT's plugin aliases it to state_pool, as ShortConv's.

State layout: a head's state is [N, P] (state-size rows, head-dim columns), the transpose of
transformers' [P, N] (its cache holds [B, H, P, N]). It is onnxruntime's
com.microsoft.LinearAttention layout ([B, H, d_k, d_v] with k = Bm, v = dt * x), so a lowering
to that kernel reads and writes the pool with no transpose per step.

Semantics (transformers' Mamba-2 torch path: NemotronH, GraniteMoeHybrid, Bamba, Mamba2), per
row b and head h, with g = h // (H / G) (transformers' repeat_interleave of B and C over heads)
and s_{-1} = state_pool[slot_idx[b], h], for each real token t < seq_lens[b]:
  dt_t = clamp(softplus(dt[b, t, h] + dt_bias[h]), dt_min, dt_max)
  s_t  = exp(dt_t * A[h]) * s_{t-1} + Bm[b, t, g] ⊗ (dt_t * x[b, t, h])      [N, P]
  y[b, t, h] = s_t^T Cm[b, t, g] + D[h] * x[b, t, h]                          [P]
and row b's new state is its last s_t. Tokens at t >= seq_lens[b] neither decay nor feed the
state (their dt is forced to 0, so exp(dt * A) = 1 and the input term is 0; their x and Bm are
zeroed too, so even non-finite padding cannot leak in); y there is 0. seq_lens[b] = 0 returns
row b's state bit-for-bit.

Precision: dt + dt_bias, softplus and the clamp run in dt's dtype, as both transformers paths
run them (a bf16 model's dt is rounded where the model rounds it); everything after is fp32
whatever the input dtypes (transformers' chunked path, and mamba_ssm's kernels; its torch
single-token path does dt * x * B and the readout in the model dtype), rounded at the end to
x's dtype (y; the chunked path hands the norm fp32 y, the single-token path x's dtype) and to
state_pool's (new_state; transformers keeps the recurrent state in fp32, NemotronH's
``mamba_ssm_cache_dtype``).

dt limits: transformers' chunked path (every multi-token call) clamps to the mixer's
``time_step_limit`` — NemotronH (config.time_step_min, inf) whatever config.time_step_limit
says; GraniteMoeHybrid / Bamba / Mamba2 config.time_step_limit, (0, inf) by default — but its
single-token path (mamba2_selective_state_update, like mamba_ssm's selective_state_update)
applies no limit. This op clamps at every S, so the two agree unless a softplus falls outside
[dt_min, dt_max]. dt_max's default is the largest finite fp32, which, like inf, leaves every
finite dt unchanged (an attribute default must be finite to serialize).

Why one op: a recurrence over tokens is what each runtime runs its own way — a TensorRT plugin
or a fused kernel — so the portable graph carries it whole, with the standard-ONNX body below
(a Scan over S carrying [B, H, N, P] fp32) for runtimes that have neither.
"""

from __future__ import annotations

from graphkiln.ops import slot_state
from graphkiln.ops.spec import AttrSpec, CustomOpSpec

# The largest finite float32: dt_max's default, a no-op clamp on every finite value (as inf is).
FLOAT32_MAX = 3.4028234663852886e38

SPEC = CustomOpSpec(
    name="SsmScan",
    torch_name="ssm_scan",
    inputs=("x", "dt", "A", "Bm", "Cm", "D", "dt_bias", "state_pool", "slot_idx", "seq_lens"),
    outputs=("y", "new_state"),
    attributes=(
        # right after the required attributes (none here), as on every in-place op: callers pass
        # (*required, state_update) positionally
        AttrSpec("state_update", "int", "0: return the new rows; 1: return the whole pool with them written in place",
                 default=0),
        AttrSpec("dt_min", "float", "lower clamp of softplus(dt + dt_bias)", default=0.0),
        AttrSpec("dt_max", "float", "upper clamp of softplus(dt + dt_bias); the default clamps no finite value",
                 default=FLOAT32_MAX),
    ),
    output_dtypes_from=("x", "state_pool"),
    doc=__doc__,
)

# The attribute that makes new_state the whole (aliased) pool: 1 on every TensorRT node.
IN_PLACE_ATTR = "state_update"


def reference(x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens, state_update=0, dt_min=0.0,
              dt_max=FLOAT32_MAX):
    import torch
    import torch.nn.functional as F

    batch, seq, heads, head_dim = x.shape
    per_group = heads // Bm.shape[2]
    valid = torch.arange(seq, device=x.device) < seq_lens.unsqueeze(1)  # [B, S]
    # in dt's dtype, as transformers; the clamp in fp32 and rounded after (the same value, rounding
    # being monotone), since fp16 cannot even hold dt_max's default (torch refuses the clamp)
    step = F.softplus(dt + dt_bias.to(dt.dtype)).float().clamp(dt_min, dt_max).to(dt.dtype).float()
    step = torch.where(valid.unsqueeze(2), step, 0.0)
    decay = torch.exp(step * A.float())  # [B, S, H]; exactly 1 on padding
    pad4 = valid[:, :, None, None]
    inp = torch.where(pad4, x.float() * step.unsqueeze(3), 0.0)  # dt * x [B, S, H, P]
    b_heads = torch.where(pad4, Bm.float(), 0.0).repeat_interleave(per_group, dim=2)  # [B, S, H, N]
    c_heads = Cm.float().repeat_interleave(per_group, dim=2)
    state = state_pool.index_select(0, slot_idx).float()  # [B, H, N, P]
    y = torch.empty(batch, seq, heads, head_dim, dtype=torch.float32, device=x.device)
    for t in range(seq):  # the decode formula, token by token
        state = state * decay[:, t, :, None, None] + b_heads[:, t, :, :, None] * inp[:, t, :, None, :]
        y[:, t] = (c_heads[:, t, :, None, :] @ state).squeeze(2)  # C^T S: [B, H, 1, P]
    y = torch.where(pad4, y + D.float()[:, None] * x.float(), 0.0).to(x.dtype)
    rows = state.to(state_pool.dtype)
    return y, slot_state.new_state(state_pool, slot_idx, rows, state_update)


def fake(x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens, state_update=0, dt_min=0.0,
         dt_max=FLOAT32_MAX):
    return x.new_empty(x.shape), slot_state.fake_new_state(state_pool, x.shape[0], state_update)


def onnx_function(opset: int):
    import onnxscript
    from onnx import TensorProto
    from onnxscript.values import Opset

    op = Opset("", opset)
    gk = Opset(SPEC.domain, SPEC.version)
    FLOAT = TensorProto.FLOAT

    @onnxscript.script(gk, default_opset=op)
    def SsmScan(x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens, plugin_namespace: str,
                plugin_version: str, state_update: int = 0, dt_min: float = 0.0, dt_max: float = FLOAT32_MAX):
        # One token of every row: heads split as [B, G, H/G, ...] so each group's B and C
        # broadcast over its heads without being repeated; fp32 throughout.
        @onnxscript.graph()
        def Step(state, decay_t, inp_t, b_t, c_t):
            # state [B, G, R, N, P]; decay_t [B, G, R, 1, 1]; inp_t [B, G, R, 1, P];
            # b_t [B, G, 1, N, 1]; c_t [B, G, 1, 1, N]
            new = op.Add(op.Mul(state, decay_t), op.Mul(b_t, inp_t))
            y_t = op.MatMul(c_t, new)  # [B, G, R, 1, P]
            return new, y_t

        zero = op.Constant(value_float=0.0)
        minus1 = op.Constant(value_ints=[-1])
        batch = op.Shape(x, start=0, end=1)
        seq = op.Shape(x, start=1, end=2)
        groups = op.Shape(Bm, start=2, end=3)

        # dt + dt_bias, softplus and the clamp rounded to dt's dtype as transformers computes them
        # in it (fp16/bf16 arithmetic is fp32 arithmetic rounded per op, so the Casts reproduce it;
        # no-ops for fp32). One rounding after the clamp stands for the two after softplus and
        # clamp: rounding is monotone, so it commutes with clamping.
        raw = op.CastLike(op.Add(op.Cast(dt, to=FLOAT), op.Cast(op.CastLike(dt_bias, dt), to=FLOAT)), dt)
        step = op.Clip(op.Softplus(op.Cast(raw, to=FLOAT)), op.Constant(value_float=dt_min),
                       op.Constant(value_float=dt_max))
        step = op.Cast(op.CastLike(step, dt), to=FLOAT)

        # Padding: dt = 0 (no decay) and a zero input term, x and B zeroed so nothing non-finite leaks in.
        positions = op.Range(op.Constant(value_int=0), op.Squeeze(seq), op.Constant(value_int=1))
        lens = op.Cast(seq_lens, to=TensorProto.INT64)  # int32 indices are TensorRT's native type
        valid = op.Less(op.Unsqueeze(positions, op.Constant(value_ints=[0])),
                        op.Unsqueeze(lens, op.Constant(value_ints=[1])))  # [B, S]
        valid3 = op.Unsqueeze(valid, op.Constant(value_ints=[2]))
        valid4 = op.Unsqueeze(valid, op.Constant(value_ints=[2, 3]))
        step = op.Where(valid3, step, zero)  # [B, S, H]
        xf = op.Cast(x, to=FLOAT)
        decay = op.Exp(op.Mul(step, op.Cast(A, to=FLOAT)))  # exactly 1 on padding
        inp = op.Where(valid4, op.Mul(xf, op.Unsqueeze(step, op.Constant(value_ints=[3]))), zero)  # [B, S, H, P]
        bf = op.Where(valid4, op.Cast(Bm, to=FLOAT), zero)  # [B, S, G, N]

        one = op.Constant(value_ints=[1])
        head_dim = op.Shape(x, start=3, end=4)
        state_dims = op.Shape(state_pool, start=2, end=4)  # [N, P]
        by_group = op.Concat(batch, seq, groups, minus1, axis=0)
        decay_s = op.Reshape(decay, op.Concat(by_group, one, one, axis=0))  # [B, S, G, R, 1, 1]
        inp_s = op.Reshape(inp, op.Concat(by_group, one, head_dim, axis=0))  # [B, S, G, R, 1, P]
        b_s = op.Unsqueeze(bf, op.Constant(value_ints=[3, 5]))  # [B, S, G, 1, N, 1]
        c_s = op.Unsqueeze(op.Cast(Cm, to=FLOAT), op.Constant(value_ints=[3, 4]))  # [B, S, G, 1, 1, N]
        start = op.Cast(op.Gather(state_pool, slot_idx, axis=0), to=FLOAT)  # [B, H, N, P]
        start = op.Reshape(start, op.Concat(batch, groups, minus1, state_dims, axis=0))  # [B, G, R, N, P]

        final, ys = op.Scan(start, decay_s, inp_s, b_s, c_s, body=Step, num_scan_inputs=4,
                            scan_input_axes=[1, 1, 1, 1], scan_output_axes=[1])
        d_skip = op.Mul(op.Unsqueeze(op.Cast(D, to=FLOAT), op.Constant(value_ints=[1])), xf)  # [B, S, H, P]
        y = op.Where(valid4, op.Add(op.Reshape(ys, op.Shape(x)), d_skip), zero)
        rows = op.CastLike(op.Reshape(final, op.Concat(batch, op.Shape(state_pool, start=1, end=4), axis=0)),
                           state_pool)
        # state_update is a constant once the function is inlined: onnxruntime folds the If.
        if op.Equal(op.Constant(value_int=state_update), op.Constant(value_int=1)):
            slots = op.Unsqueeze(op.Cast(slot_idx, to=TensorProto.INT64), op.Constant(value_ints=[1]))  # [B, 1]
            new_state = op.ScatterND(state_pool, slots, rows)  # reads the pool first: rows depend on it
        else:
            new_state = op.Identity(rows)
        return op.CastLike(y, x), new_state

    return SsmScan.to_function_proto()


# onnxruntime 1.32 (com.microsoft schemas, get_all_operator_schema): no kernel for this op as
# such. Mamba2Verify fuses conv + scan + gated norm but is a one-sequence, bf16-only,
# head_dim 64 / d_state 128 op with no CPU kernel. LinearAttention(update_rule="gated") runs on
# CPU and is this recurrence with q = Cm (at the G groups: its inverse GQA maps head h to group
# h // (H / G)), k = Bm (repeated to H heads), v = dt * x, decay = dt * A, scale 1 and its state
# [B, H, N, P] (this op's layout), plus D * x outside: graphkiln.export.lowering.ort_ssm_scan
# lowers to it (2.5x faster per decode step, 7x per prefill, measured there). GatedRMSNorm
# (CPU) is the norm that follows, a candidate for a fusion.
