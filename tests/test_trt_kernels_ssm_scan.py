"""The SsmScan Triton kernel against the op's torch reference, and its AOT build.

Kernels run on CPU in the Triton interpreter (conftest sets TRITON_INTERPRET=1) and are checked
against ``graphkiln.ops.ssm_scan.reference`` (state_update=0: y and the new rows) plus an
explicit scatter of the rows into a copy of the pool — the state_update=1 contract the kernel
implements in place. Padded positions (t >= seq_lens[b]) hold large finite x / Bm / Cm and a dt
whose softplus would all but zero the state, which the op's contract says are never used, so a
kernel that read them would be far off. The interpreter fixes, the tolerance check and the AOT
subprocess are tests/triton_kernel_checks.py's, shared with the GatedDeltaRule kernel's tests.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphkiln.ops import ssm_scan as ssm_op
from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels import ssm_scan as ssm_k
from triton_kernel_checks import DTYPES, Sym, aot_build_fixtures, close, sym_cdiv
from triton_kernel_checks import interpreter_fixes  # noqa: F401  (autouse: the interpreter fixes, here)

POOL_SLOTS = 9
POISON = 1000.0

# (B, S, H, G, N, P, seq_lens, slot_idx): decode S = 1 (a len-0 row keeps its state), prefill
# S = 7 and 12 with ragged rows (0, 1 and S real tokens), unordered non-contiguous slots of a
# 9-slot pool; H = 2 G, 3 G and G (heads share a group's B and C); N != P (a transposed state
# shows), N and P not powers of two (masked rows), P = 40 > BLOCK_P (two column blocks, the
# second partial).
CASES = [
    (3, 1, 4, 2, 8, 6, [1, 0, 1], [5, 0, 7]),
    (2, 1, 2, 2, 16, 40, [1, 1], [2, 8]),
    (3, 7, 6, 2, 5, 3, [7, 3, 0], [2, 8, 4]),
    (4, 7, 2, 2, 12, 10, [1, 7, 4, 2], [8, 3, 0, 6]),
    (2, 12, 3, 1, 12, 40, [12, 5], [6, 4]),
]
IDS = [f"B{c[0]}-S{c[1]}-h{c[2]}-g{c[3]}-n{c[4]}-p{c[5]}" for c in CASES]


def _inputs(seed, b, s, h, g, n, p, lens, slots, dtype, poison: bool = True):
    """Op inputs in the plugin's dtypes: activations and the pool in ``dtype``; A, D, dt_bias fp32."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, h, p, generator=gen)
    dt = torch.randn(b, s, h, generator=gen)
    a = -torch.exp(torch.rand(h, generator=gen) * 2.0)  # decays from near 0 to near 1
    bm = torch.randn(b, s, g, n, generator=gen)
    cm = torch.randn(b, s, g, n, generator=gen)
    d = torch.randn(h, generator=gen)
    dt_bias = torch.randn(h, generator=gen) * 1.5 - 1.0
    pool = torch.randn(POOL_SLOTS, h, n, p, generator=gen) * 0.5
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    if poison:  # padding: finite but large inputs, and a dt that would wipe the state (exp(50 A) ~ 0)
        pad = torch.arange(s).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [B, S]
        for t in (x, bm, cm):
            t[pad] = POISON
        dt[pad] = 50.0
    return (x.to(dtype), dt.to(dtype), a, bm.to(dtype), cm.to(dtype), d, dt_bias, pool.to(dtype),
            torch.tensor(slots, dtype=torch.int64), seq_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,h,g,n,p,lens,slots", CASES, ids=IDS)
def test_ssm_scan_updates_pool_in_place(b, s, h, g, n, p, lens, slots, dtype):
    inputs = _inputs(b * 10 + s + n, b, s, h, g, n, p, lens, slots, DTYPES[dtype])
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = inputs
    y_ref, rows_ref = ssm_op.reference(*inputs)
    live = pool.clone()
    y, new_state = ssm_k.run_ssm_scan(x, dt, a, bm, cm, d, dt_bias, live, slot_idx, seq_lens)
    assert new_state.data_ptr() == live.data_ptr()  # in place, as under TensorRT's aliasing
    close(y, y_ref, dtype, "y")
    pad = torch.arange(s).unsqueeze(0) >= seq_lens.unsqueeze(1)
    assert (y[pad] == 0).all(), "y at padded positions is not 0"
    untouched = [r for r in range(POOL_SLOTS) if r not in slots]
    assert torch.equal(live[untouched], pool[untouched])
    close(live[slot_idx], rows_ref, dtype, "state")  # state_update=1: row slot_idx[b] replaced
    for r, k in enumerate(lens):  # a row with no real tokens keeps its state exactly
        if k == 0:
            assert torch.equal(live[slots[r]], pool[slots[r]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_ssm_scan_state_rows_mode_with_dt_limits(dtype):
    """state_update=0 leaves the pool alone and returns the rows; dt_min / dt_max reach the
    kernel (both clamps bite on these inputs, and change the result)."""
    b, s, h, g, n, p, lens, slots = CASES[2]
    inputs = _inputs(3, b, s, h, g, n, p, lens, slots, DTYPES[dtype])
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = inputs
    lo, hi = 0.1, 1.2
    real = torch.arange(s).unsqueeze(0) < seq_lens.unsqueeze(1)
    sp = F.softplus(dt.float() + dt_bias)[real]
    assert (sp < lo).any() and (sp > hi).any(), "neither clamp is exercised: the test has no teeth"
    before = pool.clone()
    y, rows = ssm_k.run_ssm_scan(*inputs, state_update=0, dt_min=lo, dt_max=hi)
    y_ref, rows_ref = ssm_op.reference(*inputs, 0, lo, hi)
    assert torch.equal(pool, before) and rows.shape == (b, h, n, p)
    close(y, y_ref, dtype, "y")
    close(rows, rows_ref, dtype, "rows")
    unclamped, _ = ssm_k.run_ssm_scan(*inputs, state_update=0)
    assert (unclamped.double() - y.double()).abs().max() > 1e-2, "the limits made no difference: no teeth"


def test_prefill_then_decode_through_the_pool_equals_one_pass():
    """Chunks of a sequence through the kernel, state carried in the pool in place, give one
    pass's outputs and state."""
    h, g, n, p = 4, 2, 8, 6
    x, dt, a, bm, cm, d, dt_bias, pool, _, _ = _inputs(9, 1, 9, h, g, n, p, [9], [3], torch.float32, poison=False)
    slot = torch.tensor([3])
    y_ref, rows_ref = ssm_op.reference(x, dt, a, bm, cm, d, dt_bias, pool, slot, torch.tensor([9]))
    live = pool.clone()
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 9)):
        y, _ = ssm_k.run_ssm_scan(x[:, lo:hi], dt[:, lo:hi], a, bm[:, lo:hi], cm[:, lo:hi], d, dt_bias, live, slot,
                                  torch.tensor([hi - lo]))
        outs.append(y)
    close(torch.cat(outs, dim=1), y_ref, "float32", "y")
    close(live[3], rows_ref[0], "float32", "state")


@triton.jit
def _softplus_probe(src, dst, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst + offs, ssm_k._softplus(tl.load(src + offs)))


def test_softplus_keeps_small_values_and_passes_large_ones_through():
    """The kernel's softplus against torch's in fp32 across the range dt + dt_bias takes: the
    far-negative side is where log(1 + exp(x)) alone loses every digit; above 20 it is x."""
    xs = torch.cat([torch.linspace(-30.0, 30.0, 121), torch.tensor([-88.0, -1e-3, 0.0, 1e-3, 19.99, 20.01, 60.0])])
    block = triton.next_power_of_2(xs.numel())
    src = torch.zeros(block)
    src[: xs.numel()] = xs
    out = torch.empty(block)
    _softplus_probe[(1,)](src, out, BLOCK=block)
    want = F.softplus(xs.double())
    rel = ((out[: xs.numel()].double() - want).abs() / want.clamp_min(1e-300)).max().item()
    assert rel < 1e-6, rel


def test_launch_plan_takes_symbolic_batch_and_sequence():
    b, s = Sym("B"), Sym("S")
    plan = ssm_k.launch_plan((b, s, Sym("H", 128), Sym("P", 64)), (b, s, Sym("G", 8), Sym("N", 128)),
                             (Sym("slots"), Sym("H", 128), Sym("N", 128), Sym("P", 64)), dt_min=0.001, dt_max=0.1,
                             cdiv=sym_cdiv)
    bp = plan.constexprs["BLOCK_P"]
    assert plan.grid[0] is b and plan.grid[1:] == (128, aot.ceil_div(64, bp)) and plan.scalars == (s,)
    c = plan.constexprs
    assert (c["H"], c["P"], c["G"], c["N"], c["BLOCK_N"], c["STATE_UPDATE"]) == (128, 64, 8, 128, 128, 1)
    assert (c["DT_MIN"], c["DT_MAX"]) == (0.001, 0.1)


@pytest.mark.parametrize("x_shape,b_shape,pool_shape,kw,match", [
    ((2, 1, Sym("H"), 6), (2, 1, 2, 8), (9, 4, 8, 6), {}, "head count"),
    ((2, 1, 4, 6), (2, 1, 2, Sym("N")), (9, 4, 8, 6), {}, "state size"),
    ((2, 1, 4, 6), (2, 1, 3, 8), (9, 4, 8, 6), {}, "multiple"),
    ((2, 1, 4, 6), (2, 1, 2, 8), (9, 4, 6, 8), {}, "state rows"),  # the [H, P, N] layout is refused
    ((2, 1, 4, 6), (2, 1, 2, 8), (9, 4, 8, 6), {"state_update": 2}, "state_update"),
])
def test_launch_plan_refuses_what_the_kernel_cannot_run(x_shape, b_shape, pool_shape, kw, match):
    with pytest.raises(ValueError, match=match):
        ssm_k.launch_plan(x_shape, b_shape, pool_shape, **kw)


def test_kernel_spec_follows_the_op_spec():
    """Pointer parameters are the op's inputs and outputs in SPEC order (what the plugin binds)."""
    assert ssm_k.KERNELS == (ssm_k.SSM_SCAN,)
    assert ssm_k.SSM_SCAN.inputs == ssm_op.SPEC.inputs and ssm_k.SSM_SCAN.outputs == ssm_op.SPEC.outputs
    assert aot.expected_params(ssm_k.SSM_SCAN) == (".u64",) * 10 + (".u32",) + (".u64",) * 2


# The AOT build: the kernel in every dtype for sm_80 and sm_90 at a real model's sizes
# (Nemotron-H 8B: 128 heads of 64, 8 groups, state size 128), both modes and NemotronH's dt
# limits; parameter list exactly (inputs .u64, int32 extras .u32, outputs .u64); shared memory
# within the 48 KiB a launch gets without an opt-in attribute.
_AOT_SCRIPT = r"""
import json
from graphkiln.plugins_trt.kernels import aot, ssm_scan
out = []
for dtype in ("float16", "bfloat16", "float32"):
    for arch in aot.ARCHS:
        for mode in (0, 1):
            plan = ssm_scan.launch_plan((4, 1, 128, 64), (4, 1, 8, 128), (9, 128, 128, 64), state_update=mode,
                                        dt_min=0.001)
            ck = aot.compile_kernel(plan.kernel, dtype, plan.constexprs, arch, plan.num_warps)
            out.append(dict(dtype=dtype, arch=arch, mode=mode, entry=ck.name, params=list(ck.params),
                            want=list(aot.expected_params(plan.kernel)), shared=ck.shared_mem,
                            target=f".target sm_{arch}" in ck.ptx))
print(json.dumps(out))
"""
_aot_compile_started, aot_builds = aot_build_fixtures(_AOT_SCRIPT)


def test_kernel_compiles_ahead_of_time_with_the_tensorrt_abi(aot_builds):
    assert {(b["dtype"], b["arch"], b["mode"]) for b in aot_builds} == {
        (d, a, m) for d in DTYPES for a in aot.ARCHS for m in (0, 1)}
    for b in aot_builds:
        where = f"{b['dtype']} sm_{b['arch']} state_update={b['mode']}"
        assert b["params"] == b["want"], where
        assert b["target"] and b["entry"] == "ssm_scan_kernel", where
        assert b["shared"] <= 48 * 1024, where
