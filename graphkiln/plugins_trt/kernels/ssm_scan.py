"""Triton kernel for ``graphkiln.SsmScan``: Mamba-2's selective scan over new tokens, state in place.

Semantics are ``graphkiln.ops.ssm_scan`` (its ``reference``): head h reads group
g = h // (H / G) of Bm and Cm; row b starts from s = state_pool[slot_idx[b], h] ([N, P]) and for
each real token t (t < seq_lens[b]):

    dt_t = clamp(softplus(dt + dt_bias), DT_MIN, DT_MAX)      rounded to dt's dtype, as the op
    s    = exp(dt_t * A[h]) * s + Bm_t (dt_t * x_t)^T           [N, P]
    y_t  = s^T Cm_t + D[h] * x_t                                [P]

y at padded positions (t >= seq_lens[b]) is 0 and padding never enters the state (the loop
stops at seq_lens[b], so a row with no tokens keeps its state bit-for-bit).

``state_update=1`` (what the TensorRT plugin uses): ``new_state`` is the whole pool, and the
kernel writes only rows ``slot_idx[b]`` — TensorRT aliases ``new_state`` to ``state_pool``,
so the other slots keep their contents because nobody touches them (a launcher without the
alias must pass the pool itself as ``new_state``). ``state_update=0``: ``new_state`` is
[B, H, N, P] and row b gets row b's new state.

Grid and ownership (as kernels.gated_delta; the plan is kernels.recurrent's)
    grid = (B, H, cdiv(P, BLOCK_P)). The state's head-dim columns are independent of each other
    (the decay is per head, the input term is Bm (dt x)^T, the readout s^T Cm acts column by
    column), so program (b, h, j) owns columns [j*BLOCK_P, (j+1)*BLOCK_P) of slot slot_idx[b],
    head h, with all N rows in registers (fp32): it loads them once, runs every real token of
    row b through them (a per-token loop, decode and prefill alike; no chunked form yet),
    writes y for those columns, zeroes y on the padding, and stores the new state after a
    barrier — read before write, within one program, touching nothing another program reads.

Invariant (the caller's): the slot_idx entries of one launch are distinct and < slots (the
runtime's slot allocator guarantees both; the kernel cannot fail a launch). seq_lens entries
are clamped to [0, S].

dtypes: x, dt, Bm, Cm, state_pool, y and new_state in the plugin's one dtype
(fp16/bf16/fp32); A, D and dt_bias fp32 (the TensorRT lowering casts them: they are
parameters, A computed in fp32); slot_idx and seq_lens int64; arithmetic in fp32 except where
the op rounds dt + dt_bias and softplus to dt's dtype. ``dt_min`` / ``dt_max`` compile in
(TensorRT's extras are int32 only); S, the new-token count, is the one int32 scalar; H, P, G
and N (weight-derived, static in any engine) compile in.
"""

from __future__ import annotations

from typing import Callable

import triton
import triton.language as tl

from graphkiln.ops.ssm_scan import FLOAT32_MAX
from graphkiln.plugins_trt.kernels import aot, recurrent
from graphkiln.plugins_trt.kernels.moe import static_dim

# softplus(x) = x above this, as torch's (threshold 20: exp(-20) is below fp32's resolution of x)
SOFTPLUS_THRESHOLD = tl.constexpr(20.0)


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) in fp32 without losing the small values: max(x, 0) + log1p(exp(-|x|)),
    log1p by Goldberg's correction (Triton has no log1p), so softplus(-12) keeps its digits."""
    u = tl.exp(-tl.abs(x))
    w = 1.0 + u
    exact = w == 1.0  # u below half an ulp of 1: log1p(u) = u to fp32 precision
    log1p = tl.where(exact, u, tl.log(w) * (u / tl.where(exact, 1.0, w - 1.0)))
    return tl.where(x > SOFTPLUS_THRESHOLD, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def ssm_scan_kernel(x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens,
                    S,
                    y, new_state,
                    H: tl.constexpr, P: tl.constexpr, G: tl.constexpr, N: tl.constexpr,
                    DT_MIN: tl.constexpr, DT_MAX: tl.constexpr,
                    STATE_UPDATE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_p = tl.program_id(2)
    offs_n = tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    m = n_ok[:, None] & p_ok[None, :]

    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    g = h64 // (H // G)  # the Bm/Cm group head h reads (repeat_interleave)
    slot = tl.load(slot_idx + b64).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(seq_lens + b64).to(tl.int32), 0), S)

    a = tl.load(A + h64).to(tl.float32)
    d = tl.load(D + h64).to(tl.float32)
    # dt_bias rounded to dt's dtype before the add, as the op (a no-op for fp32)
    bias = tl.load(dt_bias + h64).to(dt.dtype.element_ty).to(tl.float32)

    tile = offs_n[:, None] * P + offs_p[None, :]
    src = state_pool + (slot * H + h64) * (N * P)
    state = tl.load(src + tile, mask=m, other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_P]

    for t in tl.range(0, n):
        row = b64 * S + t  # token (b, t)
        raw = (tl.load(dt + row * H + h64).to(tl.float32) + bias).to(dt.dtype.element_ty).to(tl.float32)
        # clamp then one rounding: rounding is monotone, so it commutes with the clamp (the op's note)
        step = tl.minimum(tl.maximum(_softplus(raw), DT_MIN), DT_MAX)
        step = step.to(dt.dtype.element_ty).to(tl.float32)
        xt = tl.load(x + (row * H + h64) * P + offs_p, mask=p_ok, other=0.0).to(tl.float32)
        bt = tl.load(Bm + (row * G + g) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        ct = tl.load(Cm + (row * G + g) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(step * a) + bt[:, None] * (xt * step)[None, :]
        yt = tl.sum(state * ct[:, None], axis=0) + d * xt  # s^T C + D x, after the update
        tl.store(y + (row * H + h64) * P + offs_p, yt.to(y.dtype.element_ty), mask=p_ok)

    zero = tl.zeros([BLOCK_P], dtype=tl.float32)
    for t in tl.range(n, S):  # padding: y is 0
        tl.store(y + ((b64 * S + t) * H + h64) * P + offs_p, zero.to(y.dtype.element_ty), mask=p_ok)

    tl.debug_barrier()  # every thread's reads of this slot's old state happen before any write to it
    if STATE_UPDATE == 1:
        dst = new_state + (slot * H + h64) * (N * P)
    else:
        dst = new_state + (b64 * H + h64) * (N * P)
    tl.store(dst + tile, state.to(new_state.dtype.element_ty), mask=m)


SSM_SCAN = aot.KernelSpec(
    name="ssm_scan",
    fn=ssm_scan_kernel,
    inputs=("x", "dt", "A", "Bm", "Cm", "D", "dt_bias", "state_pool", "slot_idx", "seq_lens"),
    scalars=("S",),
    outputs=("y", "new_state"),
    constexprs=("H", "P", "G", "N", "DT_MIN", "DT_MAX", "STATE_UPDATE", "BLOCK_N", "BLOCK_P"),
    fixed_dtypes={"A": "float32", "D": "float32", "dt_bias": "float32", "slot_idx": "int64", "seq_lens": "int64"},
)

KERNELS: tuple[aot.KernelSpec, ...] = (SSM_SCAN,)

_DIMS = recurrent.StateDims(heads="H", groups="G", rows="N", cols="P", block_rows="BLOCK_N", block_cols="BLOCK_P",
                            heads_what="heads", groups_what="groups")


def launch_plan(x_shape, Bm_shape, state_pool_shape, *, state_update: int = 1, dt_min: float = 0.0,
                dt_max: float = FLOAT32_MAX, cdiv: Callable = aot.ceil_div) -> aot.LaunchPlan:
    """The one launch of ``ssm_scan_kernel`` (``recurrent.state_launch_plan``): the heads over the
    B/C groups, the state [N, P]."""
    h = static_dim(x_shape[2], "the head count")
    p = static_dim(x_shape[3], "the head dim")
    g = static_dim(Bm_shape[2], "the group count")
    n = static_dim(Bm_shape[3], "the state size")
    return recurrent.state_launch_plan(SSM_SCAN, _DIMS, x_shape[0], x_shape[1], h, g, n, p, state_pool_shape,
                                       state_update, {"DT_MIN": float(dt_min), "DT_MAX": float(dt_max)})


def run_ssm_scan(x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens, state_update: int = 1,
                 dt_min: float = 0.0, dt_max: float = FLOAT32_MAX, new_state=None):
    """Launch the kernel on torch tensors; returns (y, new_state).

    state_update=1 with ``new_state`` None updates ``state_pool`` in place and returns it
    (TensorRT's aliasing); state_update=0 returns fresh rows [B, H, N, P].
    """
    import torch

    x, dt, Bm, Cm = x.contiguous(), dt.contiguous(), Bm.contiguous(), Cm.contiguous()
    A, D, dt_bias = (t.to(torch.float32).contiguous() for t in (A, D, dt_bias))
    slot_idx, seq_lens, new_state = recurrent.state_launch_args(state_pool, slot_idx, seq_lens, state_update,
                                                                x.shape[0], new_state)
    y = torch.empty_like(x)
    plan = launch_plan(tuple(x.shape), tuple(Bm.shape), tuple(state_pool.shape), state_update=state_update,
                       dt_min=dt_min, dt_max=dt_max)
    ssm_scan_kernel[plan.grid](x, dt, A, Bm, Cm, D, dt_bias, state_pool, slot_idx, seq_lens, *plan.scalars, y,
                               new_state, num_warps=plan.num_warps, **plan.constexprs)
    return y, new_state
