"""The ``graphkiln.Attention`` Triton kernels (``graphkiln.plugins_trt.kernels.attention``).

Numerics run in the Triton interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1) and
are checked against the op's torch reference (kv_update=0: out, new_key, new_value) plus an
explicit scatter of new_key/new_value into a copy of the cache — the kv_update=1 contract the
kernel implements in place. Cache rows no token may see (positions >= a row's start) are filled
with a large poison value first, so a kernel that read them would be far off.

AOT: every KernelSpec compiles to PTX for sm_80 and sm_90 in fp16, bf16 and fp32 with exactly
(10 input pointers, 3 int32 scalars, 3 output pointers) — in a subprocess without
TRITON_INTERPRET: once a kernel has run in the interpreter, Triton 3.2 has patched
``triton.language`` with the interpreter's builder for the rest of the process, and
compiling anything there fails.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

import pytest
import torch

from graphkiln.ops.attention import SPEC, reference
from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels.attention import DECODE, KERNELS, PREFILL, launch_plan, run_attention
from triton_kernel_checks import Sym, aot_build_fixtures, sym_cdiv
from triton_kernel_checks import interpreter_fixes_with_bf16_dot  # noqa: F401  (autouse: the interpreter fixes, here)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = tuple(TOL)
POISON = 1000.0  # cache rows at positions >= a row's start: never visible


# ----------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    nq: int
    nkv: int
    d: int
    cache: int  # C
    window: int
    starts: tuple[int, ...]  # position_ids[b, 0]
    seq: int = 1  # S
    lengths: tuple[int, ...] | None = None  # real tokens per row (the rest is padding); None = all
    block_m: int | None = None
    block_n: int | None = None
    # lookahead: "causal" (a constant zero [1, 1], as text models pass it), or "blocks": per
    # row b, ``blocks[b]`` = ((first, end), ...) image blocks of token indexes within the row's
    # real tokens, whose tokens see up to the block's last one ([B, S]; with one row, [1, S]
    # broadcasts nothing but still exercises the batch-dim stride)
    lookahead: str = "causal"
    blocks: tuple = ()
    rope_layout: int = 0  # 1: per-token cos/sin [B, S, D/2] at rotary positions unlike the cache's
    # use_sinks: gpt-oss's per-head sink logits (random sinks [Nq] are passed either way: with 0
    # the kernel must not read them); sink_shift moves them (large: the sinks dominate the max)
    use_sinks: int = 0
    sink_shift: float = 0.0

    @property
    def batch(self) -> int:
        return len(self.starts)


def _tables(positions: int, d: int):
    inv = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32) / (d // 2))
    freqs = torch.arange(positions, dtype=torch.float32)[:, None] * inv
    return freqs.cos() * 1.1, freqs.sin() * 1.1  # a rope-scaling factor folded in, as export does


def _inputs(case: Case, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, s = case.batch, case.seq

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = randn(b, s, case.nq * case.d), randn(b, s, case.nkv * case.d), randn(b, s, case.nkv * case.d)
    past_k, past_v = randn(b, case.nkv, case.cache, case.d), randn(b, case.nkv, case.cache, case.d)
    for i, start in enumerate(case.starts):
        past_k[i, :, start:] = POISON
        past_v[i, :, start:] = -POISON
    pos = torch.tensor(case.starts, dtype=torch.int64)[:, None] + torch.arange(s)[None]
    cos, sin = _tables(max(case.starts) + s + 1, case.d)
    if case.rope_layout == 1:  # e.g. M-RoPE: rotary positions that are not the cache positions
        rope_pos = torch.randint(0, cos.shape[0], (b, s), generator=g)
        cos, sin = cos[rope_pos], sin[rope_pos]
    lookahead = torch.zeros(1, 1, dtype=torch.int64)
    if case.lookahead == "blocks":
        lookahead = torch.zeros(b, s, dtype=torch.int64)
        for row, blocks in enumerate(case.blocks):
            for first, end in blocks:
                lookahead[row, first:end] = end - 1 - torch.arange(first, end)
        assert lookahead.any(), "a lookahead case must open some block"
    sinks = torch.randn(case.nq, generator=g) * 2.0 + case.sink_shift  # fp32, as the op takes them
    return q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks


def _expected(case: Case, q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks):
    """Reference out, and the cache with every new row scattered at its position (< C)."""
    out, new_k, new_v = reference(q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks, case.nq, case.nkv,
                                  case.window, case.d ** -0.5, rope_layout=case.rope_layout, use_sinks=case.use_sinks)
    want_k, want_v = past_k.clone(), past_v.clone()
    written = torch.zeros(past_k.shape[0], past_k.shape[2], dtype=torch.bool)
    for b in range(case.batch):
        for s in range(case.seq):
            p = int(pos[b, s])
            if p < case.cache:
                want_k[b, :, p], want_v[b, :, p] = new_k[b, :, s], new_v[b, :, s]
                written[b, p] = True
    return out, want_k, want_v, written


def _assert_close(got, want, rel: float, what: str) -> None:
    """max |got - want| <= rel * max |want| (error relative to the output's scale)."""
    got, want = got.double(), want.double()
    scale = max(float(want.abs().max()), 1e-6)
    err = float((got - want).abs().max())
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} > {rel:g} * scale {scale:.3g}"


def _check(case: Case, dtype, seed: int, kernel=None, out_in_fp32: bool = False) -> None:
    """``out_in_fp32``: compare out with the reference run in fp32 on the same inputs (where
    the dtype reference itself is off by more than the tolerance)."""
    q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks = _inputs(case, dtype, seed)
    want_out, want_k, want_v, written = _expected(case, q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks)
    if out_in_fp32:
        want_out = _expected(case, *(x.float() for x in (q, k, v, past_k, past_v)), pos, cos, sin, lookahead, sinks)[0]
    cache_k, cache_v = past_k.clone(), past_v.clone()  # present_* alias past_*: the kernel writes these
    out = run_attention(q, k, v, cache_k, cache_v, pos, cos, sin, case.nq, case.nkv, case.window, case.d ** -0.5,
                        lookahead=lookahead, rope_layout=case.rope_layout, sinks=sinks, use_sinks=case.use_sinks,
                        kernel=kernel, block_m=case.block_m, block_n=case.block_n)
    tol = TOL[dtype]
    lengths = case.lengths or (case.seq,) * case.batch
    for b, n in enumerate(lengths):  # padding tokens' outputs are not part of the contract
        _assert_close(out[b, :n], want_out[b, :n], tol, f"out row {b}")
    # Untouched rows are bit-identical (poison included); written values are plain copies.
    keep = ~written[:, None, :, None].expand_as(past_k)
    assert torch.equal(cache_k[keep], past_k[keep]) and torch.equal(cache_v[keep], past_v[keep])
    # Rotated keys are rounded per op like the reference's, so they match it exactly.
    assert torch.equal(cache_v, want_v)
    diff = (cache_k.double() - want_k.double()).abs().max()
    assert torch.equal(cache_k, want_k), f"present_key differs by {diff:.3g}"


DECODE_CASES = {
    "gqa": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 17, 39)),  # start 0: only the new key
    "mha-window": Case(nq=2, nkv=2, d=32, cache=24, window=6, starts=(5, 23)),
    # start 40 = C: its new row is not written
    "mqa-d24-blocks": Case(nq=4, nkv=1, d=24, cache=40, window=0, starts=(0, 38, 40), block_n=16),
    "gqa3-window-blocks": Case(nq=6, nkv=2, d=16, cache=70, window=20, starts=(69, 33, 2), block_n=16),
}

PREFILL_CASES = {
    # ragged rows: different starts and real lengths; the last row runs past C (those positions are skipped)
    "gqa": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 7, 30), seq=16, lengths=(16, 5, 9)),
    "mha-window-tiles": Case(nq=2, nkv=2, d=32, cache=32, window=5, starts=(3, 0), seq=12, lengths=(12, 7),
                             block_m=4, block_n=16),
    "mqa-d24-tiles": Case(nq=4, nkv=1, d=24, cache=48, window=0, starts=(20, 1, 33), seq=10, lengths=(10, 10, 3),
                          block_m=2, block_n=16),
    "gqa3-window": Case(nq=6, nkv=2, d=16, cache=40, window=7, starts=(9, 25), seq=14, lengths=(14, 6)),
}


# Gemma3's images (lookahead [B, S]: blocks spanning query tiles, at a row's start and end, two
# per row) and Qwen2.5-VL's M-RoPE (rope_layout 1: per-token cos/sin), with and without a window
LOOKAHEAD_CASES = {
    "gqa-images-tiles": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 7, 30), seq=16, lengths=(16, 5, 9),
                             block_m=4, block_n=16, lookahead="blocks",
                             blocks=(((2, 6), (9, 12)), ((0, 3),), ((5, 9),))),
    "mha-window-images-mrope": Case(nq=2, nkv=2, d=32, cache=32, window=3, starts=(3, 0), seq=12, lengths=(12, 7),
                                    block_m=2, block_n=16, lookahead="blocks", blocks=(((4, 9),), ((1, 5),)),
                                    rope_layout=1),
    "gqa-mrope-decode": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 17, 39), rope_layout=1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("name", LOOKAHEAD_CASES)
def test_lookahead_and_per_token_rotary_match_reference(name, dtype):
    _check(LOOKAHEAD_CASES[name], dtype, seed=6)


# gpt-oss's attention sinks (use_sinks 1) on sliding and full layers, decode and ragged prefill
# over query and key tiles; sinks of +12 dominate every row's max (the kernel folds them in after
# the keys, so a sink above the keys' max must rescale what was accumulated)
SINKS_CASES = {
    "gqa-decode": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 17, 39), use_sinks=1),
    "gqa3-window-decode-blocks": Case(nq=6, nkv=2, d=16, cache=70, window=20, starts=(69, 33, 2), block_n=16,
                                      use_sinks=1),
    "gqa-prefill-tiles": Case(nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 7, 30), seq=16, lengths=(16, 5, 9),
                              block_m=4, block_n=16, use_sinks=1),
    "mha-window-prefill": Case(nq=2, nkv=2, d=32, cache=32, window=5, starts=(3, 0), seq=12, lengths=(12, 7),
                               block_m=4, block_n=16, use_sinks=1),
    "gqa-window-dominant-sinks": Case(nq=4, nkv=2, d=16, cache=40, window=7, starts=(9, 25), seq=6, use_sinks=1,
                                      sink_shift=12.0),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("name", SINKS_CASES)
def test_sinks_match_reference(name, dtype):
    # Dominant sinks leave every key a probability ~1e-5, which the fp16/bf16 reference rounds
    # (normalised) to subnormal or 8-bit precision, off from the exact value by more than the
    # tolerance; the kernel rounds unnormalised probabilities, so it is checked against fp32.
    case = SINKS_CASES[name]
    _check(case, dtype, seed=8, out_in_fp32=case.sink_shift > 0 and dtype != torch.float32)


def test_sinks_have_teeth():
    """The sinks change out (so the reference check above can fail), and without use_sinks the
    kernel ignores whatever the sinks input holds."""
    case = SINKS_CASES["gqa-prefill-tiles"]
    q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks = _inputs(case, torch.float32, 9)

    def run(sinks, use_sinks):
        return run_attention(q, k, v, past_k.clone(), past_v.clone(), pos, cos, sin, case.nq, case.nkv, 0, 0.25,
                             sinks=sinks, use_sinks=use_sinks, block_m=4, block_n=16)

    plain = run(None, 0)
    assert (run(sinks, 1) - plain).abs().max() > 1e-2
    assert torch.equal(run(torch.full_like(sinks, float("nan")), 0), plain)


def test_decode_kernel_sees_ahead_for_any_seq_len():
    case = LOOKAHEAD_CASES["gqa-images-tiles"]
    _check(Case(**{**case.__dict__, "block_m": None}), torch.float32, seed=7, kernel=DECODE)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_matches_reference(name, dtype):
    _check(DECODE_CASES[name], dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("name", PREFILL_CASES)
def test_prefill_matches_reference(name, dtype):
    _check(PREFILL_CASES[name], dtype, seed=2)


@pytest.mark.parametrize("name", ["gqa", "mha-window-tiles"])
def test_decode_kernel_is_correct_for_any_seq_len(name):
    """TensorRT may pick either tactic for any profile: the decode form must not assume S == 1."""
    case = PREFILL_CASES[name]
    _check(Case(**{**case.__dict__, "block_m": None}), torch.float32, seed=3, kernel=DECODE)


def test_prefill_kernel_is_correct_for_one_token():
    _check(DECODE_CASES["gqa3-window-blocks"], torch.float32, seed=4, kernel=PREFILL)


def test_poisoned_cache_would_be_seen():
    """The poison test has teeth: making the poison visible (start past it) changes out."""
    case = DECODE_CASES["gqa"]
    q, k, v, past_k, past_v, pos, cos, sin, _, _ = _inputs(case, torch.float32, 5)
    out = run_attention(q, k, v, past_k.clone(), past_v.clone(), pos, cos, sin, case.nq, case.nkv, 0, 0.25)
    later = pos + 1  # now cache position start (poisoned) is < start and visible
    cos2, sin2 = _tables(int(later.max()) + 1, case.d)
    out2 = run_attention(q, k, v, past_k.clone(), past_v.clone(), later, cos2, sin2, case.nq, case.nkv, 0, 0.25)
    assert (out2[1:] - out[1:]).abs().max() > 10  # rows with start < C now see a poisoned key


# ----------------------------------------------------------------------------------------------
# launch plans


@pytest.mark.parametrize("kernel,block_m", [(DECODE, 1), (PREFILL, 32)])
def test_launch_plan_with_symbolic_shapes(kernel, block_m):
    b, s, c, p = Sym("B"), Sym("S"), Sym("C"), Sym("P")
    plan = launch_plan(8, 4, 0, 0.125, (b, s, 8 * 64), (b, 4, c, 64), (p, 32), sym_cdiv, dtype="float16",
                       kernel=kernel)
    assert plan.kernel is kernel
    assert repr(plan.grid[0]) == f"cdiv(S, {block_m})" and plan.grid[1] == 4 and plan.grid[2] is b
    assert [repr(x) for x in plan.scalars] == ["S", "C", "P"]
    assert plan.constexprs["BLOCK_M"] == block_m and plan.constexprs["ROWS"] >= 16


def test_launch_plan_chooses_by_seq_len():
    assert launch_plan(4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)).kernel is DECODE
    assert launch_plan(4, 2, 0, 0.25, (2, 7, 64), (2, 2, 8, 16), (8, 8)).kernel is PREFILL


@pytest.mark.parametrize("args,kwargs,match", [
    ((4, 2, 0, 0.25, (2, 1, 4 * 15), (2, 2, 8, 15), (8, 7)), {}, "head_dim 15"),  # odd: rotate-half needs pairs
    ((4, 2, 0, 0.25, (2, 1, 4 * 512), (2, 2, 8, 512), (8, 256)), {}, "head_dim 512"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, Sym("D")), (8, 8)), {}, "build-time constant"),
    ((6, 4, 0, 0.25, (2, 1, 96), (2, 4, 8, 16), (8, 8)), {}, "not a multiple"),
    ((4, 2, -1, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {}, "window -1"),
    ((4, 2, 0, 0.25, (2, Sym("S"), 64), (2, 2, 8, 16), (8, 8)), {}, "symbolic"),
    ((4, 2, 0, 0.25, (2, 1, 60), (2, 2, 8, 16), (8, 8)), {}, "q's last dim"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {"dtype": "int8"}, "dtype int8"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {"block_m": 3}, "block_m 3"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {"block_n": 8}, "block_n 8"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {"use_sinks": 1, "sinks_shape": (2,)}, r"sinks has shape"),
    ((4, 2, 0, 0.25, (2, 1, 64), (2, 2, 8, 16), (8, 8)), {"use_sinks": 2}, "use_sinks 2"),
])
def test_launch_plan_refuses(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch_plan(*args, **kwargs)


# ----------------------------------------------------------------------------------------------
# ahead-of-time compilation

AOT_DTYPES = ("float16", "bfloat16", "float32")
# (kernel, Nq, Nkv, D, window): both constexpr branches (window on/off), a non-power-of-two head
AOT_CASES = {"attention_decode": (4, 1, 24, 0), "attention_prefill": (4, 2, 32, 4)}
LARGE_D = 128  # a real model's head: shared memory must stay within the 48 KiB no-opt-in launch limit

_AOT_SCRIPT = """
import json, sys
from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels.attention import KERNELS, DECODE, launch_plan
cases, dtypes, large_d = json.loads(sys.argv[1])
rows = []
def compile_one(spec, nq, nkv, d, window, dtype, arch, variant=False):
    s = 1 if spec is DECODE else 16
    # variant: a lookahead graph input [B, S] and per-token rotary [B, S, D/2] (Gemma3, Qwen2.5-VL),
    # with attention sinks (gpt-oss)
    extra = dict(lookahead_shape=(2, s), rope_layout=1, use_sinks=1, sinks_shape=(nq,)) if variant else {}
    plan = launch_plan(nq, nkv, window, d ** -0.5, (2, s, nq * d), (2, nkv, 64, d),
                       (2, s, d // 2) if variant else (128, d // 2), dtype=dtype, kernel=spec, **extra)
    ck = aot.compile_kernel(spec, dtype, plan.constexprs, arch, plan.num_warps)
    rows.append(dict(kernel=spec.name, dtype=dtype, arch=arch, d=d, params=list(ck.params), variant=variant,
                     expected=list(aot.expected_params(spec)), shared=ck.shared_mem, name=ck.name,
                     target=f"sm_{arch}" in ck.ptx, threads=ck.block_threads))
for spec in KERNELS:
    nq, nkv, d, window = cases[spec.name]
    for dtype in dtypes:
        for arch in aot.ARCHS:
            compile_one(spec, nq, nkv, d, window, dtype, arch)
    compile_one(spec, nq, nkv, d, window, "float16", 90, variant=True)
    if spec is not DECODE:  # the larger tiles: q rows x D and K/V blocks x D
        for dtype in ("float16", "float32"):
            compile_one(spec, 32, 8, large_d, 0, dtype, 90)
print(json.dumps(rows))
"""
_aot_compile_started, aot_builds = aot_build_fixtures(_AOT_SCRIPT, (json.dumps([AOT_CASES, AOT_DTYPES, LARGE_D]),))


def test_kernel_specs_match_the_op():
    """Pointer parameters in the op's input/output order, named as the kernel names them."""
    for spec in KERNELS:
        assert spec.inputs == SPEC.inputs
        assert spec.scalars == ("seq_len", "cache_len", "rope_len")
        assert spec.outputs == ("out", "present_key", "present_value") and len(spec.outputs) == len(SPEC.outputs)
        params = list(inspect.signature(getattr(spec.fn, "fn", spec.fn)).parameters)
        assert params == [*spec.inputs, *spec.scalars, *spec.outputs, *spec.constexprs]


@pytest.mark.parametrize("arch", aot.ARCHS)
@pytest.mark.parametrize("dtype", AOT_DTYPES)
@pytest.mark.parametrize("kernel", [k.name for k in KERNELS])
def test_compiles_with_tensorrt_abi(aot_builds, kernel, dtype, arch):
    key = (kernel, dtype, arch, AOT_CASES[kernel][2], False)
    (row,) = [r for r in aot_builds if (r["kernel"], r["dtype"], r["arch"], r["d"], r["variant"]) == key]
    assert row["params"] == row["expected"] == [".u64"] * 10 + [".u32"] * 3 + [".u64"] * 3
    assert row["target"] and row["threads"] == 128 and row["shared"] <= 48 * 1024


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("kernel", [PREFILL.name])
def test_real_head_dim_fits_default_shared_memory(aot_builds, kernel, dtype):
    (row,) = [r for r in aot_builds if (r["kernel"], r["dtype"], r["d"]) == (kernel, dtype, LARGE_D)]
    assert row["params"] == row["expected"]
    assert row["shared"] <= 48 * 1024, f"{kernel} {dtype} D={LARGE_D} needs {row['shared']} bytes of shared memory"


@pytest.mark.parametrize("kernel", [k.name for k in KERNELS])
def test_lookahead_input_and_per_token_rotary_compile_with_tensorrt_abi(aot_builds, kernel):
    """The constexpr branches the interpreter tests run (indexed lookahead, rope_layout 1,
    sinks) compile too, with the same launch ABI."""
    (row,) = [r for r in aot_builds if r["kernel"] == kernel and r["variant"]]
    assert row["params"] == row["expected"] == [".u64"] * 10 + [".u32"] * 3 + [".u64"] * 3
    assert row["target"] and row["shared"] <= 48 * 1024
