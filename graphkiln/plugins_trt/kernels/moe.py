"""Triton kernel for ``graphkiln.MoE``: routing and routed experts in one launch.

Semantics are ``graphkiln.ops.moe`` (its ``reference``): scores = softmax or sigmoid of the
router logits (fp32), experts = top_k of scores + expert_bias (the bias only *selects*),
weights = the unbiased scores of those experts, divided by (sum + norm_eps) when normalize=1,
times routed_scaling, rounded to the hidden dtype; out = sum over the token's experts of
weight * (down_e(act(gate_up_e x + gate_up_bias_e)) + down_bias_e), act by ACTIVATION:
0 silu(gate) * up, 1 relu(up)^2 (non-gated: gate_up holds only the I up rows, and no gate
row is read), 2 min(gate, LIMIT) * sigmoid(ALPHA * min(gate, LIMIT)) * (clamp(up, +-LIMIT) + 1).
The expert biases cost (F + BLOCK_H) element loads per routed expert and program, against the
F * H + BLOCK_H * I of its weights: below 1% at H >= 128, so bias-free models (zeros) pay
nothing measurable for them.

Grid and ownership
    grid = (cdiv(T, BLOCK_T), cdiv(H, BLOCK_H), 1). Program (i, j) owns out[token block i,
    column tile j] and nothing else: it computes its tokens' routing itself (fp32, in
    registers: [BLOCK_T, E_PAD] scores, TOP_K unrolled arg-max passes), then walks the
    experts 0..E-1 and skips every expert none of its tokens routes to — an unrouted
    expert's weights are never read, not even multiplied by zero. For a routed expert it
    computes the SwiGLU intermediate of its tokens in BLOCK_I chunks (x [BLOCK_T, H] against
    the chunk's gate and up rows), scales each token's row by its routing weight (zero rows
    for the block's tokens that did not pick the expert: ``where``, not a multiply, so a
    non-finite value cannot leak in) and accumulates act @ down[e, tile, chunk]^T into an
    fp32 [BLOCK_T, BLOCK_H] register tile. One store at the end; no atomics, no scratch, no
    dependence on the order programs run in — the properties an AOT TensorRT plugin (one
    kernel, outputs only, no workspace) needs and CUDA-graph replay is happy with.

Bytes read per decode step (T = batch <= BLOCK_T = 16: one token block)
    Let U be the experts the batch routes to (|U| <= min(E, T*top_k)) and W_e = 3*I*H
    elements of expert e (gate and up 2*I*H, down I*H). The ideal is sum over U of W_e: each
    routed expert read once. Here each of the n_h = cdiv(H, BLOCK_H) programs reads, for each
    e in U, all of gate_up[e] (its tile's outputs need the whole intermediate) and only its
    BLOCK_H rows of down[e]:
      * load requests: (2*n_h + 1)/3 x ideal (H = 2048, BLOCK_H = 128: n_h = 16, ~11x);
      * DRAM traffic: ~1x ideal when the n_h programs run together — n_h is far below the SM
        count and they walk the same experts' chunks in the same order, so the repeats of a
        gate_up chunk are L2 hits — and at worst n_h x for gate_up;
      * unrouted experts: 0 bytes; each routed expert is read once per program for the whole
        batch, never once per token. Router logits and hidden rows are re-read per program
        (T*E + T*H elements, negligible).
    The cost that matters for large models: every program streams sum over U of 2*I*H
    elements through one SM, so the step takes at least that over one SM's L2 bandwidth
    (Qwen3-30B-A3B, batch 1: 8 experts x 6.3 MB = 50 MB per program, an estimated few hundred
    us per layer at 150-250 GB/s per SM, where the ideal DRAM time is ~16 us; not measured).
    More output tiles do not shorten that (each still needs the whole intermediate); it is
    the price of one launch that owns its output.

Prefill (T > BLOCK_T)
    Tokens are grouped per token block (BLOCK_T = 64), not sorted by expert: a block reads the
    union of its tokens' experts once, for all of its tokens, and computes a dense
    [BLOCK_T, chunk] tile for each, so the dot work is BLOCK_T / (tokens of the block routed
    to e) above the ideal. A global sort by expert (vLLM's fused_moe) needs an index pass and
    an intermediate buffer: a second launch or a workspace, which an AOT plugin does not have.

Trade-offs, and what would be better
    Splitting I across programs would read each expert once in total with many programs
    sharing the stream, but its partial outputs need a cross-program reduction: atomics into
    the uninitialised TensorRT output or a second pass. Under the one-kernel, outputs-only
    rule this kernel instead owns output tiles and pays the per-program gate_up stream above.
    The fix for large-model decode is two launches — a gate_up+SwiGLU plugin writing act
    [T, top_k, I] as a real tensor, then a down+combine plugin — i.e. two nodes in the
    TensorRT-target graph; this module's routing and tiling carry over to both.

dtypes: fp16/bf16/fp32 for hidden, router_logits, gate_up, down and out (the plugin's one
dtype, gate_up_bias and down_bias too); expert_bias is fp32 (a routing table, read as the
reference reads it). Dots take the weights' dtype with fp32 accumulation (fp32: IEEE, not
TF32). Attributes are constexpr: float attributes must be (TensorRT extras are int32 only),
so the plugin compiles per attribute set anyway, and a constexpr TOP_K unrolls the selection
(ALPHA and LIMIT are pinned to their defaults unless ACTIVATION is 2, so they split no cache). E, H and I compile in too
(weight dims, static in any engine); T, the token count, is the one int32 scalar. Loops are
bounded by constexprs only: Triton 3.2's interpreter cannot loop to a runtime scalar under
numpy 2.
"""

from __future__ import annotations

import os
from typing import Callable

import triton
import triton.language as tl

from graphkiln.ops import moe as moe_op
from graphkiln.plugins_trt.kernels import aot


@triton.jit
def _dot(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b. UPCAST (set only by the CPU interpreter for bf16, whose dot it gets wrong)
    computes in fp32; fp32 operands use IEEE fp32, not TF32, so fp32 stays exact."""
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def moe_kernel(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias,
               T,
               out,
               E: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
               TOP_K: tl.constexpr, SCORING: tl.constexpr, NORMALIZE: tl.constexpr,
               NORM_EPS: tl.constexpr, ROUTED_SCALING: tl.constexpr,
               ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
               E_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
               BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    offs_e = tl.arange(0, E_PAD)
    e_ok = offs_e < E
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H

    # Routing, fp32, for this program's tokens (padding tokens get logits 0: finite, unused).
    logits = tl.load(router_logits + offs_t[:, None] * E + offs_e[None, :],
                     mask=t_ok[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
    if SCORING == 1:
        probs = tl.sigmoid(logits)
    else:
        z = tl.where(e_ok[None, :], logits, float("-inf"))
        p = tl.exp(z - tl.max(z, axis=1)[:, None])
        probs = p / tl.sum(p, axis=1)[:, None]
    probs = tl.where(e_ok[None, :], probs, 0.0)
    bias = tl.load(expert_bias + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    select = tl.where(e_ok[None, :], probs + bias[None, :], float("-inf"))
    routed = tl.zeros([BLOCK_T, E_PAD], dtype=tl.int32)
    for _ in tl.static_range(TOP_K):
        best = tl.max(select, axis=1)
        # lowest index among equal maxima: one expert per pass, whatever the ties
        pick = tl.min(tl.where(select == best[:, None], offs_e[None, :], E_PAD), axis=1)
        hit = offs_e[None, :] == pick[:, None]
        routed = tl.where(hit, 1, routed)
        select = tl.where(hit, float("-inf"), select)
    w = tl.where(routed != 0, probs, 0.0)
    if NORMALIZE:
        w = w / (tl.sum(w, axis=1)[:, None] + NORM_EPS)
    w = w * ROUTED_SCALING
    w = w.to(out.dtype.element_ty).to(tl.float32)  # the reference applies weights in the hidden dtype

    # rows of gate_up per expert: gate then up (2I), or only the up rows (I) for relu²
    F: tl.constexpr = I if ACTIVATION == 1 else 2 * I
    UP: tl.constexpr = 0 if ACTIVATION == 1 else I  # the first up row
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    offs_ib = tl.arange(0, BLOCK_I)
    offs_kb = tl.arange(0, BLOCK_K)
    for e in range(0, E):  # experts with no token here cost one reduction, no weight read
        is_e = offs_e[None, :] == e
        tok_e = tl.max(tl.where(is_e, routed, 0), axis=1) != 0  # [BLOCK_T]: token picked e
        if tl.max(tok_e.to(tl.int32), axis=0) != 0:  # else: expert e is never read
            w_e = tl.sum(tl.where(is_e, w, 0.0), axis=1)
            gu_e = gate_up + tl.cast(e, tl.int64) * (F * H)
            gub_e = gate_up_bias + e * F
            dn_e = down + tl.cast(e, tl.int64) * (H * I)
            for i0 in range(0, I, BLOCK_I):
                offs_i = i0 + offs_ib
                i_ok = offs_i < I
                g = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
                u = tl.zeros([BLOCK_T, BLOCK_I], dtype=tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    offs_k = k0 + offs_kb
                    k_ok = offs_k < H
                    x = tl.load(hidden + offs_t[:, None] * H + offs_k[None, :],
                                mask=t_ok[:, None] & k_ok[None, :], other=0.0)
                    wmask = k_ok[:, None] & i_ok[None, :]
                    if ACTIVATION != 1:
                        wg = tl.load(gu_e + offs_i[None, :] * H + offs_k[:, None], mask=wmask, other=0.0)
                        g = _dot(x, wg, g, UPCAST)
                    wu = tl.load(gu_e + (UP + offs_i)[None, :] * H + offs_k[:, None], mask=wmask, other=0.0)
                    u = _dot(x, wu, u, UPCAST)
                u += tl.load(gub_e + UP + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
                if ACTIVATION == 1:
                    r = tl.maximum(u, 0.0)
                    act = r * r
                else:
                    g += tl.load(gub_e + offs_i, mask=i_ok, other=0.0).to(tl.float32)[None, :]
                    if ACTIVATION == 2:
                        g = tl.minimum(g, LIMIT)
                        u = tl.minimum(tl.maximum(u, -LIMIT), LIMIT)
                        act = g * tl.sigmoid(g * ALPHA) * (u + 1.0)
                    else:
                        act = g * tl.sigmoid(g) * u
                act = tl.where(tok_e[:, None], act * w_e[:, None], 0.0)
                wd = tl.load(dn_e + offs_h[None, :] * I + offs_i[:, None],
                             mask=i_ok[:, None] & h_ok[None, :], other=0.0)
                acc = _dot(act.to(wd.dtype), wd, acc, UPCAST)
            # the expert's output bias, weighted like its output (0 for tokens that did not pick it)
            db = tl.load(down_bias + e * H + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            acc += tl.where(tok_e[:, None], w_e[:, None] * db[None, :], 0.0)
    tl.store(out + offs_t[:, None] * H + offs_h[None, :], acc.to(out.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])


MOE = aot.KernelSpec(
    name="moe",
    fn=moe_kernel,
    inputs=("hidden", "router_logits", "gate_up", "down", "expert_bias", "gate_up_bias", "down_bias"),
    scalars=("T",),
    outputs=("out",),
    constexprs=("E", "H", "I", "TOP_K", "SCORING", "NORMALIZE", "NORM_EPS", "ROUTED_SCALING",
                "ACTIVATION", "ALPHA", "LIMIT", "E_PAD", "BLOCK_T", "BLOCK_H", "BLOCK_I", "BLOCK_K", "UPCAST"),
    fixed_dtypes={"expert_bias": "float32"},
)

KERNELS: tuple[aot.KernelSpec, ...] = (MOE,)

# (BLOCK_T, BLOCK_H, BLOCK_I, BLOCK_K) per (tactic, fp32?). Decode: the batch in one token
# block; prefill: more tokens share each expert read. fp32 takes smaller I/K tiles so the
# pipelined loads stay within the 48 KiB of shared memory a launch gets without an opt-in
# (Triton's 3 stages at H=2048, I=768: fp16 decode 18 KiB, fp32 38 KiB; prefill 16 / 32 KiB).
TACTICS = {
    ("decode", False): (16, 128, 64, 64),
    ("decode", True): (16, 128, 32, 32),
    ("prefill", False): (64, 64, 32, 64),
    ("prefill", True): (64, 64, 16, 32),
}
DECODE_MAX_TOKENS = 16


def static_dim(d, what: str) -> int:
    """An int from a dim that must be known at build time (a weight's shape): an int, or a
    TensorRT ``SymExpr`` whose ``is_constant`` holds."""
    if isinstance(d, int):
        return d
    if getattr(d, "is_constant", False):
        value = d.constant_value  # a method on TensorRT's ShapeExpr
        return int(value() if callable(value) else value)
    raise ValueError(f"{what} must be known when the kernel is compiled (a weight's dimension), got {d!r}")


def grid_div(cdiv: Callable, a, b: int):
    """cdiv(a, b) for a symbolic ``a``; plain ceil division (an int in the plan) for an int."""
    return aot.ceil_div(a, b) if isinstance(a, int) else cdiv(a, b)


def _pow2(n: int) -> int:
    return 1 << max(1, (n - 1).bit_length())


def launch_plan(hidden_shape, router_logits_shape, gate_up_shape, down_shape, *, top_k: int, scoring: int,
                normalize: int, norm_eps: float, routed_scaling: float, activation: int = 0,
                alpha: float = moe_op.GPT_OSS_ALPHA, limit: float = moe_op.GPT_OSS_LIMIT,
                cdiv: Callable = aot.ceil_div, dtype: str = "float16", tactic: str | None = None,
                interpret: bool = False) -> aot.LaunchPlan:
    """The one launch of ``moe_kernel`` for these shapes and attributes.

    T (hidden_shape[0]) may be symbolic: it is the kernel's one int32 scalar. E, H and I are
    the weights' dims, static in any engine, and compile in (they size the routing tile and
    bound the loops). ``dtype`` is the plugin's ("float16", "bfloat16", "float32"): it picks
    the tiles. ``tactic`` is "decode" or "prefill"; None picks by T when T is an int (decode
    up to ``DECODE_MAX_TOKENS`` tokens) and "decode" otherwise. ``interpret`` is for
    the CPU interpreter only (fp32 dots for bf16); never set it for a compiled kernel.
    """
    t = hidden_shape[0]
    e = static_dim(gate_up_shape[0], "the number of experts")
    h = static_dim(gate_up_shape[2], "the hidden size")
    i = static_dim(down_shape[2], "the expert intermediate size")
    if scoring not in (0, 1) or normalize not in (0, 1):
        raise ValueError(f"scoring and normalize must be 0 or 1, got {scoring} and {normalize}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}] (the number of experts), got {top_k}")
    rows = static_dim(gate_up_shape[1], "gate_up's rows")
    if rows != moe_op.gate_up_rows(i, activation):  # also refuses an unknown activation
        raise ValueError(f"activation {activation}: gate_up has {rows} rows per expert, expected "
                         f"{moe_op.gate_up_rows(i, activation)} for intermediate size {i}")
    if activation != moe_op.SWIGLU_CLAMPED:  # unread: one compiled kernel whatever the node carries
        alpha, limit = moe_op.GPT_OSS_ALPHA, moe_op.GPT_OSS_LIMIT
    if tactic is None:
        tactic = "prefill" if isinstance(t, int) and t > DECODE_MAX_TOKENS else "decode"
    if dtype not in ("float16", "bfloat16", "float32"):
        raise ValueError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    bt, bh, bi, bk = TACTICS[(tactic, dtype == "float32")]
    constexprs = {"E": e, "H": h, "I": i, "TOP_K": int(top_k), "SCORING": int(scoring),
                  "NORMALIZE": int(normalize), "NORM_EPS": float(norm_eps), "ROUTED_SCALING": float(routed_scaling),
                  "ACTIVATION": int(activation), "ALPHA": float(alpha), "LIMIT": float(limit),
                  "E_PAD": _pow2(e), "BLOCK_T": bt, "BLOCK_H": bh, "BLOCK_I": bi, "BLOCK_K": bk,
                  "UPCAST": bool(interpret)}
    return aot.LaunchPlan(MOE, constexprs, (grid_div(cdiv, t, bt), aot.ceil_div(h, bh), 1), (t,), num_warps=4)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run_moe(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias, top_k: int, scoring: int,
            normalize: int, norm_eps: float, routed_scaling: float, activation: int = 0,
            alpha: float = moe_op.GPT_OSS_ALPHA, limit: float = moe_op.GPT_OSS_LIMIT, out=None,
            tactic: str | None = None):
    """Launch the kernel on torch tensors (contiguous; expert_bias is read as fp32); returns out [T, H]."""
    import torch

    hidden, router_logits, gate_up, down, gate_up_bias, down_bias = (
        a.contiguous() for a in (hidden, router_logits, gate_up, down, gate_up_bias, down_bias))
    expert_bias = expert_bias.to(torch.float32).contiguous()
    if out is None:
        out = torch.empty_like(hidden)
    plan = launch_plan(tuple(hidden.shape), tuple(router_logits.shape), tuple(gate_up.shape), tuple(down.shape),
                       top_k=top_k, scoring=scoring, normalize=normalize, norm_eps=norm_eps,
                       routed_scaling=routed_scaling, activation=activation, alpha=alpha, limit=limit, dtype=str(hidden.dtype).removeprefix("torch."), tactic=tactic,
                       interpret=_interpreting() and hidden.dtype == torch.bfloat16)
    moe_kernel[plan.grid](hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias,
                          *plan.scalars, out,
                          num_warps=plan.num_warps, **plan.constexprs)
    return out
