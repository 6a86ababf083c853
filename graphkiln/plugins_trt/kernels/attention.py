"""Triton kernels for ``graphkiln.Attention`` with ``kv_update=1``: the cache is written in place.

Semantics are the op's (``graphkiln.ops.attention``): q and k rotated rotate-half style with
fp32 cos/sin (rounded to the activation dtype, as the reference does) — ``rope_layout`` 0: the
tables [P, D/2] gathered at ``position_ids``; 1: per-token values [B, S, D/2] read at the
token's (row, index) — query head h reads KV head h // (Nq / Nkv); a new token at position p
sees cached keys at positions < start_b (= position_ids[b, 0]) and new keys at positions
<= p + lookahead (int64 [B|1, S|1]: a dim of 1 is broadcast, decided at build time as
constexprs LOOKAHEAD_B / LOOKAHEAD_S), and with ``window`` > 0 only keys at positions
> p - window; fp32 softmax; with ``use_sinks`` = 1 (constexpr SINKS) query head h's softmax also
counts the logit sinks[h] (fp32 [Nq]), whose probability is dropped — one more term in the
running max and sum, folded in after the keys; with 0 the kernel is compiled without that code
and never reads ``sinks``. Besides
``out`` the kernel stores row b's rotated new keys and its values into present_key /
present_value [B, Nkv, C, D] at positions position_ids[b, s] (positions outside [0, C) are
skipped). It writes ONLY those rows, so present_* must alias past_* (TensorRT: outputs
declared ``.aliased()``; ``run_attention``: the same tensors).

Contract relied on (the runtime's, and the op docstring's): row b's tokens sit at positions
start_b + 0..S-1, padding continuing them. The kernel uses it to skip work (new-key blocks
past the furthest key a tile's queries may see — its last query plus that query's lookahead —
or before its window) and for race freedom; visibility itself is decided on the position
values, as the reference does.

One Triton function, two launch shapes (``KERNELS``): ``attention_decode`` (BLOCK_M = 1 query
per program) and ``attention_prefill`` (a tile of BLOCK_M queries per program). Both are
correct for every S: the plugin offers them as tactics (decode for S == 1).

Grid (cdiv(S, BLOCK_M), Nkv, B): program (t, h, b) owns queries t*BLOCK_M .. +BLOCK_M of row b
for ALL the query heads of KV head h — the group's heads are folded into the tile's rows
(row r = query r // REP, head h*REP + r % REP; ROWS >= 16 for tl.dot), so each K/V block it
loads serves the whole group: the cache is read once per KV head, not once per query head.
  1. It rotates its q rows, then streams past_key/past_value[b, h, lo:min(start_b, C)] in
     BLOCK_N blocks (lo = the window's first visible position, rounded down to a block)
     through an online softmax (fp32 max, sum and accumulator).
  2. It streams the new tokens 0..(furthest visible one) from k/v, rotating k itself, and
     stores the rotated keys and the values of its OWN tile's tokens into the cache.
  3. With SINKS it folds each row's head's sink into the max and sum; it normalises and writes
     out for its rows.
Race freedom in one launch: programs read cache positions < start_b only and write positions
start_b + s >= start_b; new keys are always taken from k/v, never read back from the cache, so
no program depends on another's writes, and a program's own writes follow its cache reads.

Numerics: rotary products are rounded to the dtype one by one, like the reference's per-op
dtype arithmetic, so the cached keys equal the reference's bit for bit. Dots take dtype
operands with fp32 accumulation (IEEE for fp32, not TF32); probabilities are rounded to the
dtype before the PV dot, as the reference rounds them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from graphkiln.ops.attention import SPEC
from graphkiln.plugins_trt.kernels.aot import KernelSpec, LaunchPlan, ceil_div

MAX_HEAD_DIM = 256  # larger heads would need a D-tiled kernel (registers)

# The kernel is one function with no @jit helpers: aot.compile_kernel recompiles the plain
# function while TRITON_INTERPRET=1 is set, and helpers would be interpreter objects then.


@triton.jit
def attention_kernel(
    q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks,
    seq_len, cache_len, rope_len,
    out, present_key, present_value,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, WINDOW: tl.constexpr,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ROWS: tl.constexpr, ROPE_LAYOUT: tl.constexpr, LOOKAHEAD_B: tl.constexpr, LOOKAHEAD_S: tl.constexpr,
    SINKS: tl.constexpr,
):
    REP: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    HALF: tl.constexpr = HEAD_DIM // 2
    dt = q.dtype.element_ty
    # Dots take dtype operands and accumulate in fp32; fp32 inputs stay IEEE (not TF32).
    PREC: tl.constexpr = "ieee" if dt == tl.float32 else "tf32"
    # Software-pipelined cache loads; fp32 tiles are twice the bytes, and without pipelining
    # they stay within 48 KiB of shared memory.
    STAGES: tl.constexpr = 1 if dt == tl.float32 else 2
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    # rotate_half: x[d] pairs with x[d +- D/2], negated in the first half; tables are [P, D/2].
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)
    sign = tl.where(first_half, -1.0, 1.0)
    table_col = tl.where(first_half, d, d - HALF)

    pos_row = position_ids + b * seq_len
    start = tl.load(pos_row).to(tl.int32)
    n_cached = tl.maximum(tl.minimum(start, cache_len), 0)
    cache_base = (b * NUM_KV_HEADS + kvh) * cache_len  # int64: caches pass 2**31 elements

    # The tile's rows: REP query heads of this KV head for each of its BLOCK_M queries.
    r = tl.arange(0, ROWS)
    s_idx = tile * BLOCK_M + r // REP
    head = kvh * REP + r % REP
    row_ok = (r < BLOCK_M * REP) & (s_idx < seq_len)
    q_pos = tl.load(pos_row + s_idx, mask=row_ok, other=0).to(tl.int32)
    # lookahead [B|1, S|1]: a broadcast dim has stride 0.
    la_row = lookahead
    if LOOKAHEAD_B:
        if LOOKAHEAD_S:
            la_row = lookahead + b * seq_len
        else:
            la_row = lookahead + b
    q_lim = q_pos + tl.load(la_row + s_idx * LOOKAHEAD_S, mask=row_ok, other=0).to(tl.int32)
    q_off = (b * seq_len + s_idx) * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM
    q_mask = row_ok[:, None] & d_ok[None, :]
    # Rotary in fp32, each product rounded to the dtype like the reference's per-op dtype
    # arithmetic. Positions outside the table (a broken caller) read nothing: they rotate to 0.
    if ROPE_LAYOUT == 1:  # per-token [B, S, D/2]
        t_mask = q_mask
        t_off = (b * seq_len + s_idx)[:, None] * HALF + table_col[None, :]
    else:
        t_mask = q_mask & ((q_pos >= 0) & (q_pos < rope_len))[:, None]
        t_off = q_pos[:, None].to(tl.int64) * HALF + table_col[None, :]
    cos = tl.load(cos_cache + t_off, mask=t_mask, other=0.0).to(dt).to(tl.float32)
    sin = tl.load(sin_cache + t_off, mask=t_mask, other=0.0).to(dt).to(tl.float32)
    x = tl.load(q + q_off[:, None] + d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    xp = tl.load(q + q_off[:, None] + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q_rot = ((x * cos).to(dt).to(tl.float32) + sign[None, :] * (xp * sin).to(dt).to(tl.float32)).to(dt)

    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)

    # 1. Cached keys: positions [0, min(start, C)), from the window's first visible one on.
    lo = 0
    if WINDOW > 0:
        first = tl.min(tl.where(row_ok, q_pos, 2147483647), axis=0)
        lo = (tl.maximum(first - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    for n0 in tl.range(lo, n_cached, BLOCK_N, num_stages=STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < n_cached
        kv_off = (cache_base + n)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_ok[:, None] & d_ok[None, :]
        keys = tl.load(past_key + kv_off, mask=kv_mask, other=0.0).to(dt)
        vals = tl.load(past_value + kv_off, mask=kv_mask, other=0.0).to(dt)
        scores = tl.dot(q_rot, tl.trans(keys), input_precision=PREC) * SCALE
        vis = n_ok[None, :] & (n[None, :] <= q_lim[:, None])
        if WINDOW > 0:
            vis = vis & (n[None, :] > q_pos[:, None] - WINDOW)
        # Streaming softmax. A row that has seen nothing keeps max -inf: shift it by 0 so
        # exp gives 0, not NaN. Probabilities are rounded to the dtype, as the reference's.
        scores = tl.where(vis, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(dt), vals, input_precision=PREC)
        m_i = m_new

    # 2. New keys, rotated here from k — never read back from the cache other programs write.
    # Token j sits at position start + j, so tokens after j = s + lookahead of the tile's
    # furthest-seeing query s are invisible. The loop (which covers the tile's own tokens, as
    # lookahead >= 0) also stores those OWN new tokens into the cache: every cache read of this
    # program is done, and the positions (>= start) are ones no program reads.
    own_lo = tile * BLOCK_M
    own_hi = tl.minimum(own_lo + BLOCK_M, seq_len)
    furthest = tl.max(tl.where(row_ok, s_idx + (q_lim - q_pos), -1), axis=0) + 1
    j_hi = tl.minimum(tl.maximum(own_hi, furthest), seq_len)
    j_lo = 0
    if WINDOW > 0:
        j_lo = (tl.maximum(own_lo - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
    for j0 in tl.range(j_lo, j_hi, BLOCK_N, num_stages=1):
        j = j0 + tl.arange(0, BLOCK_N)
        j_ok = j < seq_len
        k_pos = tl.load(pos_row + j, mask=j_ok, other=0).to(tl.int32)
        new_off = (b * seq_len + j) * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM
        new_mask = j_ok[:, None] & d_ok[None, :]
        if ROPE_LAYOUT == 1:
            k_tmask = new_mask
            k_toff = (b * seq_len + j)[:, None] * HALF + table_col[None, :]
        else:
            k_tmask = new_mask & ((k_pos >= 0) & (k_pos < rope_len))[:, None]
            k_toff = k_pos[:, None].to(tl.int64) * HALF + table_col[None, :]
        k_cos = tl.load(cos_cache + k_toff, mask=k_tmask, other=0.0).to(dt).to(tl.float32)
        k_sin = tl.load(sin_cache + k_toff, mask=k_tmask, other=0.0).to(dt).to(tl.float32)
        kx = tl.load(k + new_off[:, None] + d[None, :], mask=new_mask, other=0.0).to(tl.float32)
        kxp = tl.load(k + new_off[:, None] + partner[None, :], mask=new_mask, other=0.0).to(tl.float32)
        new_k = ((kx * k_cos).to(dt).to(tl.float32) + sign[None, :] * (kxp * k_sin).to(dt).to(tl.float32)).to(dt)
        new_v = tl.load(v + new_off[:, None] + d[None, :], mask=new_mask, other=0.0)

        w_ok = j_ok & (j >= own_lo) & (j < own_hi) & (k_pos >= 0) & (k_pos < cache_len)
        w_off = (cache_base + k_pos)[:, None] * HEAD_DIM + d[None, :]
        w_mask = w_ok[:, None] & d_ok[None, :]
        tl.store(present_key + w_off, new_k.to(present_key.dtype.element_ty), mask=w_mask)
        tl.store(present_value + w_off, new_v.to(present_value.dtype.element_ty), mask=w_mask)

        s2 = tl.dot(q_rot, tl.trans(new_k), input_precision=PREC) * SCALE
        vis2 = j_ok[None, :] & (k_pos[None, :] <= q_lim[:, None])
        if WINDOW > 0:
            vis2 = vis2 & (k_pos[None, :] > q_pos[:, None] - WINDOW)
        s2 = tl.where(vis2, s2, float("-inf"))
        m2 = tl.maximum(m_i, tl.max(s2, axis=1))
        m2_safe = tl.where(m2 == float("-inf"), 0.0, m2)
        alpha2 = tl.exp(m_i - m2_safe)
        p2 = tl.exp(s2 - m2_safe[:, None])
        l_i = l_i * alpha2 + tl.sum(p2, axis=1)
        acc = acc * alpha2[:, None] + tl.dot(p2.to(dt), new_v.to(dt), input_precision=PREC)
        m_i = m2

    if SINKS:
        # The sink is one more logit of the row's softmax with no value: rescale to the max
        # including it and add its exp to the sum. A row that saw no key gets l = 1, out = 0.
        sink = tl.load(sinks + head, mask=row_ok, other=0.0).to(tl.float32)
        m_sink = tl.maximum(m_i, sink)
        alpha_sink = tl.exp(m_i - m_sink)
        l_i = l_i * alpha_sink + tl.exp(sink - m_sink)
        acc = acc * alpha_sink[:, None]
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out + q_off[:, None] + d[None, :], o.to(out.dtype.element_ty), mask=q_mask)


_INPUTS = SPEC.inputs  # q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks
_SCALARS = ("seq_len", "cache_len", "rope_len")
# SPEC's outputs (out, new_key, new_value) in kv_update=1 form: the whole cache, aliased to past_*
_OUTPUTS = ("out", "present_key", "present_value")
_CONSTEXPRS = ("NUM_HEADS", "NUM_KV_HEADS", "HEAD_DIM", "WINDOW", "SCALE", "BLOCK_M", "BLOCK_N", "BLOCK_D", "ROWS",
               "ROPE_LAYOUT", "LOOKAHEAD_B", "LOOKAHEAD_S", "SINKS")
# export writes the rotary tables as fp32 graph constants (DecoderLM.set_rope_positions), and
# M-RoPE's per-token values are gathered from them in fp32 (DecoderForExport._rope); sinks are
# fp32 (the decoder casts its parameter; export.lowering.trt_target casts any other)
_FIXED = {"position_ids": "int64", "cos_cache": "float32", "sin_cache": "float32", "lookahead": "int64",
          "sinks": "float32"}

DECODE = KernelSpec("attention_decode", attention_kernel, _INPUTS, _SCALARS, _OUTPUTS, _CONSTEXPRS, _FIXED)
PREFILL = KernelSpec("attention_prefill", attention_kernel, _INPUTS, _SCALARS, _OUTPUTS, _CONSTEXPRS, _FIXED)
KERNELS: tuple[KernelSpec, ...] = (DECODE, PREFILL)

# Tile budgets (bytes of one dtype tile): q rows x D and a K or V block x D. They keep the
# compiled kernel's shared memory at or under 48 KiB (the default a launch may use without an
# opt-in TensorRT is not known to make) for head dims up to 256 in every dtype.
Q_TILE_BYTES = 16384
KV_TILE_BYTES = 8192
MAX_PREFILL_ROWS = 64
MAX_BLOCK_N = 64
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def launch_plan(num_heads: int, num_kv_heads: int, window: int, scale: float, q_shape, past_key_shape, cos_shape,
                cdiv=ceil_div, *, dtype: str = "float16", kernel: KernelSpec | None = None,
                block_m: int | None = None, block_n: int | None = None, lookahead_shape=(1, 1),
                rope_layout: int = 0, use_sinks: int = 0, sinks_shape=None) -> LaunchPlan:
    """How to launch ``kernel`` (DECODE or PREFILL; chosen by S when S is an int and kernel is
    None) for q [B, S, Nq*D] of ``dtype``, past_key [B, Nkv, C, D], cos_cache [P, D/2]
    (``rope_layout`` 0) or [B, S, D/2] (1), lookahead [B|1, S|1], sinks [Nq] (read only with
    ``use_sinks`` = 1; its shape, when given, is checked then).

    B, S, C and P may be symbolic (TensorRT ``shape_expr`` entries); D must be an int (it
    sizes the tiles: the plugin resolves the constant head dim). A lookahead dim is broadcast
    only when it is the int 1 (a symbolic dim is indexed, which is right whatever it resolves
    to, as it equals q's). ``block_m``/``block_n`` override the tile sizes (tests; tactics).
    Raises ValueError for what the kernel cannot run.
    """
    b, s = q_shape[0], q_shape[1]
    c, d = past_key_shape[2], past_key_shape[3]
    p = cos_shape[0]
    if rope_layout not in (0, 1) or isinstance(rope_layout, bool):
        raise ValueError(f"attention kernel: rope_layout {rope_layout!r} is not 0 or 1")
    want_rank = 2 + rope_layout
    if len(cos_shape) != want_rank:
        raise ValueError(f"attention kernel: cos_cache has rank {len(cos_shape)}, rope_layout {rope_layout} "
                         f"takes rank {want_rank}")
    if len(lookahead_shape) != 2:
        raise ValueError(f"attention kernel: lookahead has rank {len(lookahead_shape)}, expected 2 ([B|1, S|1])")
    broadcast = []
    for got, want, what in ((lookahead_shape[0], b, "batch"), (lookahead_shape[1], s, "sequence")):
        if isinstance(got, int) and got == 1:
            broadcast.append(True)
        elif isinstance(got, int) and isinstance(want, int) and got != want:
            raise ValueError(f"attention kernel: lookahead's {what} dim is {got}, expected 1 or {want}")
        else:
            broadcast.append(False)
    if dtype not in ITEMSIZE:
        raise ValueError(f"attention kernel: dtype {dtype} is not one of {sorted(ITEMSIZE)}")
    if not isinstance(d, int):
        raise ValueError("attention kernel: head_dim (past_key's last dim) must be a build-time constant")
    if d % 2 or not 2 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"attention kernel: head_dim {d} is not supported (even, 2..{MAX_HEAD_DIM})")
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"attention kernel: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if window < 0:
        raise ValueError(f"attention kernel: window {window} is negative")
    if use_sinks not in (0, 1) or isinstance(use_sinks, bool):
        raise ValueError(f"attention kernel: use_sinks {use_sinks!r} is not 0 or 1")
    if use_sinks and sinks_shape is not None:
        if len(sinks_shape) != 1 or (isinstance(sinks_shape[0], int) and sinks_shape[0] != num_heads):
            raise ValueError(f"attention kernel: sinks has shape {tuple(sinks_shape)}, expected [{num_heads}]")
    if rope_layout == 1:
        for got, want, what in ((cos_shape[0], b, "batch"), (cos_shape[1], s, "sequence")):
            if isinstance(got, int) and isinstance(want, int) and got != want:
                raise ValueError(f"attention kernel: per-token cos_cache's {what} dim is {got}, expected {want}")
    for got, want, what in ((q_shape[2], num_heads * d, "q's last dim"),
                            (past_key_shape[1], num_kv_heads, "past_key's heads"),
                            (cos_shape[-1], d // 2, "cos_cache's last dim")):
        if isinstance(got, int) and got != want:
            raise ValueError(f"attention kernel: {what} is {got}, expected {want}")
    if kernel is None:
        if not isinstance(s, int):
            raise ValueError("attention kernel: sequence length is symbolic; pass kernel=DECODE or PREFILL")
        kernel = DECODE if s == 1 else PREFILL
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel: {kernel.name} is not one of this module's kernels")
    rep = num_heads // num_kv_heads
    block_d = max(16, _pow2(d))  # tl.dot needs every dim >= 16
    row_bytes = block_d * ITEMSIZE[dtype]
    if block_m is None:
        rows = max(16, min(MAX_PREFILL_ROWS, Q_TILE_BYTES // row_bytes))
        block_m = 1 if kernel is DECODE else max(1, rows // _pow2(rep))
    if block_m < 1 or block_m != _pow2(block_m):
        raise ValueError(f"attention kernel: block_m {block_m} is not a power of two")
    if block_n is None:
        block_n = max(16, min(MAX_BLOCK_N, KV_TILE_BYTES // row_bytes))
    if block_n < 16 or block_n != _pow2(block_n):
        raise ValueError(f"attention kernel: block_n {block_n} is not a power of two >= 16")
    constexprs = {
        "NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": d, "WINDOW": window,
        "SCALE": float(scale), "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
        "ROWS": max(16, _pow2(block_m * rep)), "ROPE_LAYOUT": rope_layout,
        "LOOKAHEAD_B": int(not broadcast[0]), "LOOKAHEAD_S": int(not broadcast[1]), "SINKS": use_sinks,
    }
    return LaunchPlan(kernel, constexprs, (cdiv(s, block_m), num_kv_heads, b), (s, c, p), num_warps=4)


def run_attention(q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, num_heads: int,
                  num_kv_heads: int, window: int, scale: float, *, lookahead=None, rope_layout: int = 0,
                  sinks=None, use_sinks: int = 0, kernel: KernelSpec | None = None,
                  block_m: int | None = None, block_n: int | None = None):
    """Launch on torch tensors: writes the new rows into past_key/past_value IN PLACE (they are
    present_key/present_value) and returns out [B, S, Nq*D].

    ``lookahead`` (int64 [B|1, S|1]; None: causal, a zero [1, 1]) and ``sinks`` (fp32 [Nq], read
    only with ``use_sinks`` = 1, as the op's attribute says; None: none) are keyword-only so
    callers written before them (scripts/gpu_check.py) keep their positional calls; the
    plugin's ``impl`` binds every input and attribute by name."""
    import torch

    b, s, _ = q.shape
    dtype = str(q.dtype).removeprefix("torch.")
    if not (q.dtype == k.dtype == v.dtype == past_key.dtype == past_value.dtype):
        raise ValueError("attention kernel: q, k, v and the caches must share one dtype")
    if position_ids.dtype != torch.int64 or tuple(position_ids.shape) != (b, s):
        raise ValueError(f"attention kernel: position_ids must be int64 [{b}, {s}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("past_key", past_key), ("past_value", past_value)):
        if not t.is_contiguous():
            raise ValueError(f"attention kernel: {name} must be contiguous")
    if lookahead is None:
        lookahead = torch.zeros(1, 1, dtype=torch.int64, device=q.device)
    if lookahead.dtype != torch.int64:
        raise ValueError("attention kernel: lookahead must be int64")
    cos_cache = cos_cache.to(torch.float32).contiguous()
    sin_cache = sin_cache.to(torch.float32).contiguous()
    if sinks is None:
        if use_sinks:
            raise ValueError("attention kernel: use_sinks=1 needs sinks")
        sinks = torch.zeros(num_heads, dtype=torch.float32, device=q.device)  # never read
    sinks = sinks.to(torch.float32).contiguous()
    plan = launch_plan(num_heads, num_kv_heads, window, scale, tuple(q.shape), tuple(past_key.shape),
                       tuple(cos_cache.shape), dtype=dtype, kernel=kernel, block_m=block_m, block_n=block_n,
                       lookahead_shape=tuple(lookahead.shape), rope_layout=rope_layout, use_sinks=use_sinks,
                       sinks_shape=tuple(sinks.shape))
    out = torch.empty_like(q)
    if b == 0 or s == 0:
        return out
    plan.kernel.fn[plan.grid](q, k, v, past_key, past_value, position_ids.contiguous(), cos_cache, sin_cache,
                              lookahead.contiguous(), sinks, *plan.scalars, out, past_key, past_value,
                              num_warps=plan.num_warps, **plan.constexprs)
    return out
