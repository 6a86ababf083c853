"""Triton kernel for ``graphkiln.ShortConv``: causal depthwise conv over new tokens, state in place.

Semantics are ``graphkiln.ops.short_conv`` (its ``reference``): with ext = state ++ x (a slot
holds the last K-1 *inputs*, oldest first), row b's output at step t is
bias + sum_j weight[:, j] * ext[b, :, t + j] for every t < S (padding steps too), and its new
state is ext[b, :, len_b : len_b + K-1], so padding after a row's real tokens never enters it.

``state_update=1`` (what the TensorRT plugin uses): ``new_state`` is the whole pool, and the
kernel writes only rows ``slot_idx[b]`` — TensorRT aliases ``new_state`` to ``state_pool``,
so the other slots keep their contents because nobody touches them (a launcher without the
alias must pass the pool itself as ``new_state``). ``state_update=0``: ``new_state`` is
[B, C, K-1] and row b gets row b's state (no aliasing involved).

Grid and ownership
    grid = (B, cdiv(C, BLOCK_C), cdiv(S, BLOCK_S)). Program (b, c, s) writes y[b, time tile s,
    channel block c]; the time-tile-0 program (b, c, 0) alone reads and writes the state
    of slot slot_idx[b], channels of block c: since BLOCK_S >= K-1, a later tile's window
    t + j >= BLOCK_S >= K-1 never reaches into the state. That program loads everything the
    new state needs (old state columns and x rows) into registers, passes a barrier (the
    load layout's threads differ from the store layout's, and the new state shifts old
    state columns when len_b < K-1, e.g. decode), and only then stores — read before write,
    within one program, with no reliance on other programs' order.

Invariant (the caller's): the slot_idx entries of one launch are distinct, so programs of
different batch rows never touch the same slot; every slot_idx < slots. The runtime's slot
allocator guarantees both; the kernel does not check them (it cannot fail a launch).
seq_lens entries are clamped to [0, S].

dtypes: x, weight, bias, state_pool, y and new_state in the plugin's one dtype (fp16/bf16/
fp32), arithmetic in fp32; slot_idx and seq_lens int64.
"""

from __future__ import annotations

from typing import Callable

import triton
import triton.language as tl

from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels.moe import grid_div, static_dim


@triton.jit
def short_conv_kernel(x, weight, bias, state_pool, slot_idx, seq_lens,
                      S,
                      y, new_state,
                      C: tl.constexpr, K: tl.constexpr, KM1_PAD: tl.constexpr, STATE_UPDATE: tl.constexpr,
                      BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    pid_c = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < C
    offs_s = pid_s * BLOCK_S + tl.arange(0, BLOCK_S)
    s_ok = offs_s < S

    b64 = tl.cast(b, tl.int64)
    slot = tl.load(slot_idx + b64).to(tl.int64)
    x_row = x + b64 * S * C
    st_row = state_pool + slot * (C * (K - 1))

    # y: window ext[t .. t+K-1]; ext[p] is state column p for p < K-1 (tile 0 only), else x[p-(K-1)].
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    acc += tl.load(bias + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        p = offs_s + j
        in_state = p < K - 1
        xs = tl.load(x_row + (p - (K - 1))[:, None] * C + offs_c[None, :],
                     mask=(s_ok & (p >= K - 1))[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        ss = tl.load(st_row + offs_c[None, :] * (K - 1) + p[:, None],
                     mask=(s_ok & in_state)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        wj = tl.load(weight + offs_c * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc += wj[None, :] * tl.where(in_state[:, None], ss, xs)
    tl.store(y + b64 * S * C + offs_s[:, None] * C + offs_c[None, :], acc.to(y.dtype.element_ty),
             mask=s_ok[:, None] & c_ok[None, :])

    # New state = ext[len : len + K-1], owned by the time-tile-0 program.
    owner = pid_s == 0
    n = tl.minimum(tl.maximum(tl.load(seq_lens + b64).to(tl.int32), 0), S)
    jj = tl.arange(0, KM1_PAD)
    j_ok = jj < K - 1
    p2 = n + jj
    in_state2 = p2 < K - 1
    m = owner & c_ok[:, None] & j_ok[None, :]
    old = tl.load(st_row + offs_c[:, None] * (K - 1) + p2[None, :], mask=m & in_state2[None, :], other=0.0)
    new = tl.load(x_row + (p2 - (K - 1))[None, :] * C + offs_c[:, None], mask=m & (p2 >= K - 1)[None, :], other=0.0)
    val = tl.where(in_state2[None, :], old.to(tl.float32), new.to(tl.float32))
    tl.debug_barrier()  # every thread's reads of this slot's old state happen before any write to it
    if STATE_UPDATE == 1:
        dst = new_state + slot * (C * (K - 1))
    else:
        dst = new_state + b64 * (C * (K - 1))
    tl.store(dst + offs_c[:, None] * (K - 1) + jj[None, :], val.to(new_state.dtype.element_ty), mask=m)


SHORT_CONV = aot.KernelSpec(
    name="short_conv",
    fn=short_conv_kernel,
    inputs=("x", "weight", "bias", "state_pool", "slot_idx", "seq_lens"),
    scalars=("S",),
    outputs=("y", "new_state"),
    constexprs=("C", "K", "KM1_PAD", "STATE_UPDATE", "BLOCK_S", "BLOCK_C"),
    fixed_dtypes={"slot_idx": "int64", "seq_lens": "int64"},
)

KERNELS: tuple[aot.KernelSpec, ...] = (SHORT_CONV,)

# (BLOCK_S, BLOCK_C) per tactic; BLOCK_S is raised to K-1 if smaller (see the ownership note).
TACTICS = {"decode": (1, 64), "prefill": (16, 64)}


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def launch_plan(x_shape, weight_shape, state_pool_shape, *, channels: int, state_update: int = 1,
                cdiv: Callable = aot.ceil_div, tactic: str | None = None) -> aot.LaunchPlan:
    """The one launch of ``short_conv_kernel``. B and S (x_shape[0:2]) may be symbolic (S is
    the kernel's int32 scalar); channels (the attribute) and K (weight_shape[1]) compile in.
    ``tactic`` "decode" or "prefill"; None picks "decode" for an int S == 1, else "prefill"."""
    b, s = x_shape[0], x_shape[1]
    c = static_dim(channels, "channels")
    k = static_dim(weight_shape[1], "the convolution width")
    if k < 2:
        raise ValueError(f"the convolution width must be at least 2 (a state of K-1 >= 1 columns), got {k}")
    for dim, want, what in ((weight_shape[0], c, "weight rows"), (state_pool_shape[1], c, "state channels"),
                            (state_pool_shape[2], k - 1, "state width")):
        if isinstance(dim, int) and dim != want:
            raise ValueError(f"{what} is {dim}, expected {want}")
    if state_update not in (0, 1):
        raise ValueError(f"state_update must be 0 or 1, got {state_update}")
    if tactic is None:
        tactic = "decode" if isinstance(s, int) and s == 1 else "prefill"
    bs, bc = TACTICS[tactic]
    km1 = _pow2(k - 1)
    bs = max(bs, km1)
    constexprs = {"C": c, "K": k, "KM1_PAD": km1, "STATE_UPDATE": int(state_update), "BLOCK_S": bs, "BLOCK_C": bc}
    return aot.LaunchPlan(SHORT_CONV, constexprs, (b, aot.ceil_div(c, bc), grid_div(cdiv, s, bs)), (s,), num_warps=4)


def run_short_conv(x, weight, bias, state_pool, slot_idx, seq_lens, channels: int | None = None,
                   state_update: int = 1, new_state=None, tactic: str | None = None):
    """Launch the kernel on torch tensors; returns (y, new_state).

    state_update=1 with ``new_state`` None updates ``state_pool`` in place and returns it
    (TensorRT's aliasing); state_update=0 returns fresh rows [B, C, K-1].
    """
    import torch

    x, weight, bias = x.contiguous(), weight.contiguous(), bias.contiguous()
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel updates it in place")
    slot_idx = slot_idx.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    c = weight.shape[0] if channels is None else channels
    if new_state is None:
        new_state = state_pool if state_update == 1 else state_pool.new_empty(
            (x.shape[0], state_pool.shape[1], state_pool.shape[2]))
    y = torch.empty_like(x)
    plan = launch_plan(tuple(x.shape), tuple(weight.shape), tuple(state_pool.shape), channels=c,
                       state_update=state_update, tactic=tactic)
    short_conv_kernel[plan.grid](x, weight, bias, state_pool, slot_idx, seq_lens, *plan.scalars, y, new_state,
                                 num_warps=plan.num_warps, **plan.constexprs)
    return y, new_state
