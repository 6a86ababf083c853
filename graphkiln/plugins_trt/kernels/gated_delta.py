"""Triton kernel for ``graphkiln.GatedDeltaRule``: the gated delta rule recurrence, state in place.

Semantics are ``graphkiln.ops.gated_delta`` (its ``reference``): value head h reads q/k head
h // (HV / HK); with ``qk_l2norm`` q and k are multiplied by rsqrt(sum(x^2) + 1e-6) over Dk,
then q by ``scale``; row b starts from S = state_pool[slot_idx[b], h] ([Dk, Dv]) and for each
real token t (t < seq_lens[b]):

    S   = S * exp(g_t)
    d   = (v_t - S^T k_t) * beta_t
    S   = S + k_t d^T
    y_t = S^T q_t

y at padded positions (t >= seq_lens[b]) is 0 and padding never enters the state.

``state_update=1`` (what the TensorRT plugin uses): ``new_state`` is the whole pool, and the
kernel writes only rows ``slot_idx[b]`` — TensorRT aliases ``new_state`` to ``state_pool``,
so the other slots keep their contents because nobody touches them (a launcher without the
alias must pass the pool itself as ``new_state``). ``state_update=0``: ``new_state`` is
[B, HV, DK, DV] and row b gets row b's new state.

Grid and ownership
    grid = (B, HV, cdiv(DV, BLOCK_V)). The state's value columns are independent of each other
    (S^T k, the update k d^T and S^T q all act column by column), so program (b, h, j) owns
    columns [j*BLOCK_V, (j+1)*BLOCK_V) of slot slot_idx[b], head h, with all DK rows in
    registers (fp32): it loads them once, runs every real token of row b through them (a
    per-token loop inside the kernel, decode and prefill alike; no chunked form yet), writes
    y for those columns, zeroes y on the padding, and stores the new state after a barrier —
    read before write, within one program, touching nothing another program reads.

Invariant (the caller's): the slot_idx entries of one launch are distinct and < slots (the
runtime's slot allocator guarantees both; the kernel cannot fail a launch). seq_lens entries
are clamped to [0, S].

dtypes: q, k, v, state_pool, y and new_state in the plugin's one dtype (fp16/bf16/fp32); g and
beta fp32 (the TensorRT lowering casts them: the model computes g in fp32, beta in its dtype);
slot_idx and seq_lens int64; arithmetic in fp32. ``scale`` and ``qk_l2norm`` compile in
(TensorRT's extras are int32 only); S, the new-token count, is the one int32 scalar; HK, HV,
DK and DV (weight-derived, static in any engine) compile in.
"""

from __future__ import annotations

from typing import Callable

import triton
import triton.language as tl

from graphkiln.ops.gated_delta import L2NORM_EPS
from graphkiln.plugins_trt.kernels import aot, recurrent
from graphkiln.plugins_trt.kernels.moe import static_dim


@triton.jit
def gated_delta_kernel(q, k, v, g, beta, state_pool, slot_idx, seq_lens,
                       S,
                       y, new_state,
                       HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                       SCALE: tl.constexpr, QK_L2NORM: tl.constexpr, EPS: tl.constexpr,
                       STATE_UPDATE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pid_v = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < DK
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    v_ok = offs_v < DV
    m = k_ok[:, None] & v_ok[None, :]

    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    hk = h64 // (HV // HK)  # the q/k head value head h reads (repeat_interleave)
    slot = tl.load(slot_idx + b64).to(tl.int64)
    n = tl.minimum(tl.maximum(tl.load(seq_lens + b64).to(tl.int32), 0), S)

    tile = offs_k[:, None] * DV + offs_v[None, :]
    src = state_pool + (slot * HV + h64) * (DK * DV)
    state = tl.load(src + tile, mask=m, other=0.0).to(tl.float32)  # [BLOCK_K, BLOCK_V]

    for t in tl.range(0, n):
        row = b64 * S + t  # token (b, t)
        qt = tl.load(q + (row * HK + hk) * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        kt = tl.load(k + (row * HK + hk) * DK + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        if QK_L2NORM:
            qt = qt * tl.rsqrt(tl.sum(qt * qt, axis=0) + EPS)
            kt = kt * tl.rsqrt(tl.sum(kt * kt, axis=0) + EPS)
        qt = qt * SCALE
        vt = tl.load(v + (row * HV + h64) * DV + offs_v, mask=v_ok, other=0.0).to(tl.float32)
        gt = tl.load(g + row * HV + h64).to(tl.float32)
        bt = tl.load(beta + row * HV + h64).to(tl.float32)
        state = state * tl.exp(gt)
        delta = (vt - tl.sum(state * kt[:, None], axis=0)) * bt  # (v - S^T k) * beta
        state = state + kt[:, None] * delta[None, :]
        yt = tl.sum(state * qt[:, None], axis=0)  # S^T q, after the update
        tl.store(y + (row * HV + h64) * DV + offs_v, yt.to(y.dtype.element_ty), mask=v_ok)

    zero = tl.zeros([BLOCK_V], dtype=tl.float32)
    for t in tl.range(n, S):  # padding: y is 0
        tl.store(y + ((b64 * S + t) * HV + h64) * DV + offs_v, zero.to(y.dtype.element_ty), mask=v_ok)

    tl.debug_barrier()  # every thread's reads of this slot's old state happen before any write to it
    if STATE_UPDATE == 1:
        dst = new_state + (slot * HV + h64) * (DK * DV)
    else:
        dst = new_state + (b64 * HV + h64) * (DK * DV)
    tl.store(dst + tile, state.to(new_state.dtype.element_ty), mask=m)


GATED_DELTA = aot.KernelSpec(
    name="gated_delta",
    fn=gated_delta_kernel,
    inputs=("q", "k", "v", "g", "beta", "state_pool", "slot_idx", "seq_lens"),
    scalars=("S",),
    outputs=("y", "new_state"),
    constexprs=("HK", "HV", "DK", "DV", "SCALE", "QK_L2NORM", "EPS", "STATE_UPDATE", "BLOCK_K", "BLOCK_V"),
    fixed_dtypes={"g": "float32", "beta": "float32", "slot_idx": "int64", "seq_lens": "int64"},
)

KERNELS: tuple[aot.KernelSpec, ...] = (GATED_DELTA,)

_DIMS = recurrent.StateDims(heads="HV", groups="HK", rows="DK", cols="DV", block_rows="BLOCK_K", block_cols="BLOCK_V",
                            heads_what="value heads", groups_what="q/k heads")


def launch_plan(q_shape, v_shape, state_pool_shape, *, scale: float, state_update: int = 1, qk_l2norm: int = 1,
                cdiv: Callable = aot.ceil_div) -> aot.LaunchPlan:
    """The one launch of ``gated_delta_kernel`` (``recurrent.state_launch_plan``): the value heads
    over the q/k heads, the state [DK, DV]."""
    hk = static_dim(q_shape[2], "the q/k head count")
    dk = static_dim(q_shape[3], "the key head dim")
    hv = static_dim(v_shape[2], "the value head count")
    dv = static_dim(v_shape[3], "the value head dim")
    recurrent.check_flag("qk_l2norm", qk_l2norm)
    return recurrent.state_launch_plan(GATED_DELTA, _DIMS, q_shape[0], q_shape[1], hv, hk, dk, dv, state_pool_shape,
                                       state_update, {"SCALE": float(scale), "QK_L2NORM": int(qk_l2norm),
                                                      "EPS": L2NORM_EPS})


def run_gated_delta(q, k, v, g, beta, state_pool, slot_idx, seq_lens, scale: float, state_update: int = 1,
                    qk_l2norm: int = 1, new_state=None):
    """Launch the kernel on torch tensors; returns (y, new_state).

    state_update=1 with ``new_state`` None updates ``state_pool`` in place and returns it
    (TensorRT's aliasing); state_update=0 returns fresh rows [B, HV, DK, DV].
    """
    import torch

    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    g = g.to(torch.float32).contiguous()
    beta = beta.to(torch.float32).contiguous()
    slot_idx, seq_lens, new_state = recurrent.state_launch_args(state_pool, slot_idx, seq_lens, state_update,
                                                                v.shape[0], new_state)
    y = torch.empty_like(v)
    plan = launch_plan(tuple(q.shape), tuple(v.shape), tuple(state_pool.shape), scale=scale,
                       state_update=state_update, qk_l2norm=qk_l2norm)
    gated_delta_kernel[plan.grid](q, k, v, g, beta, state_pool, slot_idx, seq_lens, *plan.scalars, y, new_state,
                                  num_warps=plan.num_warps, **plan.constexprs)
    return y, new_state
