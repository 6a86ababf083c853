"""The GatedDeltaRule Triton kernel against the op's torch reference, and its AOT build.

Kernels run on CPU in the Triton interpreter (conftest sets TRITON_INTERPRET=1) and are checked
against ``graphkiln.ops.gated_delta.reference`` (state_update=0: y and the new rows) plus an
explicit scatter of the rows into a copy of the pool — the state_update=1 contract the kernel
implements in place. Padded positions (t >= seq_lens[b]) hold large finite values in q, k, v
and out-of-range g / beta, which the op's contract says are never used, so a kernel that read
them would be far off. The ahead-of-time compile runs in a subprocess with the interpreter off
(see tests/test_trt_kernels_moe_conv.py for why). The interpreter fixes, the tolerance check and
the AOT subprocess are tests/triton_kernel_checks.py's, shared with the SsmScan kernel's tests.
"""

from __future__ import annotations

import pytest
import torch

from graphkiln.ops import gated_delta as gd_op
from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels import gated_delta as gd_k
from triton_kernel_checks import DTYPES, Sym, aot_build_fixtures
from triton_kernel_checks import close as _close
from triton_kernel_checks import interpreter_fixes  # noqa: F401  (autouse: the interpreter fixes, here)
from triton_kernel_checks import sym_cdiv as _sym_cdiv

POOL_SLOTS = 9
POISON = 1000.0


# (B, S, HK, HV, DK, DV, seq_lens, slot_idx): decode S = 1 (a len-0 row keeps its state), prefill
# S = 7 and 12 with ragged rows (0, 1 and S real tokens), unordered non-contiguous slots of a
# 9-slot pool; HV = 2 HK and 3 HK (value heads share q/k heads), HK = HV; DK != DV (a transposed
# state shows), DK and DV not powers of two (masked rows), DV = 40 > BLOCK_V (two column blocks,
# the second partial).
CASES = [
    (3, 1, 2, 4, 8, 6, [1, 0, 1], [5, 0, 7]),
    (2, 1, 1, 2, 16, 40, [1, 1], [2, 8]),
    (3, 7, 2, 4, 8, 6, [7, 3, 0], [2, 8, 4]),
    (4, 7, 2, 2, 12, 10, [1, 7, 4, 2], [8, 3, 0, 6]),
    (2, 12, 1, 3, 12, 40, [12, 5], [6, 4]),
]
IDS = [f"B{c[0]}-S{c[1]}-hk{c[2]}-hv{c[3]}-dk{c[4]}-dv{c[5]}" for c in CASES]


def _inputs(seed, b, s, hk, hv, dk, dv, lens, slots, dtype, poison: bool = True):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hk, dk, generator=g)
    k = torch.randn(b, s, hk, dk, generator=g)
    v = torch.randn(b, s, hv, dv, generator=g)
    decay = -torch.nn.functional.softplus(torch.randn(b, s, hv, generator=g)) * 0.7
    beta = torch.sigmoid(torch.randn(b, s, hv, generator=g))
    pool = torch.randn(POOL_SLOTS, hv, dk, dv, generator=g) * 0.5
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    if poison:  # padding: finite but large inputs, g and beta far outside their range
        pad = torch.arange(s).unsqueeze(0) >= seq_lens.unsqueeze(1)  # [B, S]
        for x in (q, k, v):
            x[pad] = POISON
        decay[pad], beta[pad] = 5.0, 3.0
    return (q.to(dtype), k.to(dtype), v.to(dtype), decay, beta, pool.to(dtype),
            torch.tensor(slots, dtype=torch.int64), seq_lens)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,hk,hv,dk,dv,lens,slots", CASES, ids=IDS)
def test_gated_delta_updates_pool_in_place(b, s, hk, hv, dk, dv, lens, slots, dtype):
    q, k, v, g, beta, pool, slot_idx, seq_lens = _inputs(b * 10 + s + dk, b, s, hk, hv, dk, dv, lens, slots,
                                                         DTYPES[dtype])
    scale = dk ** -0.5
    y_ref, rows_ref = gd_op.reference(q, k, v, g, beta, pool, slot_idx, seq_lens, scale)
    want = pool.clone()
    want[slot_idx] = rows_ref  # state_update=1: the whole pool, row slot_idx[b] replaced
    live = pool.clone()
    y, new_state = gd_k.run_gated_delta(q, k, v, g, beta, live, slot_idx, seq_lens, scale)
    assert new_state.data_ptr() == live.data_ptr()  # in place, as under TensorRT's aliasing
    _close(y, y_ref, dtype, "y")
    pad = torch.arange(s).unsqueeze(0) >= seq_lens.unsqueeze(1)
    assert (y[pad] == 0).all(), "y at padded positions is not 0"
    untouched = [r for r in range(POOL_SLOTS) if r not in slots]
    assert torch.equal(live[untouched], pool[untouched])
    _close(live[slot_idx], want[slot_idx], dtype, "state")
    for r, n in enumerate(lens):  # a row with no real tokens keeps its state exactly
        if n == 0:
            assert torch.equal(live[slots[r]], pool[slots[r]])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gated_delta_state_rows_mode(dtype):
    b, s, hk, hv, dk, dv, lens, slots = CASES[2]
    q, k, v, g, beta, pool, slot_idx, seq_lens = _inputs(3, b, s, hk, hv, dk, dv, lens, slots, DTYPES[dtype])
    before = pool.clone()
    y, rows = gd_k.run_gated_delta(q, k, v, g, beta, pool, slot_idx, seq_lens, 0.3, state_update=0)
    y_ref, rows_ref = gd_op.reference(q, k, v, g, beta, before, slot_idx, seq_lens, 0.3, 0)
    assert torch.equal(pool, before) and rows.shape == (b, hv, dk, dv)
    _close(y, y_ref, dtype, "y")
    _close(rows, rows_ref, dtype, "rows")


def test_gated_delta_without_l2norm_and_model_dtype_beta():
    """qk_l2norm=0 reaches the kernel (small keys keep the raw delta rule bounded), and a beta in
    the model dtype (what the graph computes before the TensorRT lowering's cast) gives the same."""
    b, s, hk, hv, dk, dv, lens, slots = CASES[3]
    q, k, v, g, beta, pool, slot_idx, seq_lens = _inputs(5, b, s, hk, hv, dk, dv, lens, slots, torch.float16,
                                                         poison=False)
    q, k = q * 0.2, k * 0.2
    y_ref, rows_ref = gd_op.reference(q, k, v, g, beta.half(), pool, slot_idx, seq_lens, 0.5, 0, 0)
    y, rows = gd_k.run_gated_delta(q, k, v, g, beta.half(), pool, slot_idx, seq_lens, 0.5, state_update=0,
                                   qk_l2norm=0)
    _close(y, y_ref, "float16", "y")
    _close(rows, rows_ref, "float16", "rows")
    y_norm, _ = gd_k.run_gated_delta(q, k, v, g, beta, pool, slot_idx, seq_lens, 0.5, state_update=0)
    assert (y_norm.double() - y.double()).abs().max() > 1e-2, "qk_l2norm made no difference: the test has no teeth"


def test_prefill_then_decode_through_the_pool_equals_one_pass():
    """Chunks of a sequence through the kernel, state carried in the pool in place, give one
    pass's outputs and state."""
    hk, hv, dk, dv = 2, 4, 8, 6
    q, k, v, g, beta, pool, _, _ = _inputs(9, 1, 9, hk, hv, dk, dv, [9], [3], torch.float32, poison=False)
    slot = torch.tensor([3])
    y_ref, rows_ref = gd_op.reference(q, k, v, g, beta, pool, slot, torch.tensor([9]), 0.4)
    live = pool.clone()
    outs = []
    for lo, hi in ((0, 5), (5, 6), (6, 7), (7, 9)):
        y, _ = gd_k.run_gated_delta(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], live, slot,
                                    torch.tensor([hi - lo]), 0.4)
        outs.append(y)
    _close(torch.cat(outs, dim=1), y_ref, "float32", "y")
    _close(live[3], rows_ref[0], "float32", "state")


def test_launch_plan_takes_symbolic_batch_and_sequence():
    b, s = Sym("B"), Sym("S")
    plan = gd_k.launch_plan((b, s, Sym("HK", 16), Sym("DK", 128)), (b, s, Sym("HV", 32), Sym("DV", 128)),
                            (Sym("N"), Sym("HV", 32), Sym("DK", 128), Sym("DV", 128)), scale=128 ** -0.5,
                            cdiv=_sym_cdiv)
    bv = plan.constexprs["BLOCK_V"]
    assert plan.grid[0] is b and plan.grid[1:] == (32, aot.ceil_div(128, bv)) and plan.scalars == (s,)
    c = plan.constexprs
    assert (c["HK"], c["HV"], c["DK"], c["DV"], c["BLOCK_K"], c["STATE_UPDATE"]) == (16, 32, 128, 128, 128, 1)
    assert c["SCALE"] == 128 ** -0.5 and c["QK_L2NORM"] == 1


@pytest.mark.parametrize("q_shape,v_shape,pool_shape,kw,match", [
    ((2, 1, Sym("HK"), 8), (2, 1, 4, 6), (9, 4, 8, 6), {}, "q/k head count"),
    ((2, 1, 2, 8), (2, 1, 4, Sym("DV")), (9, 4, 8, 6), {}, "value head dim"),
    ((2, 1, 3, 8), (2, 1, 4, 6), (9, 4, 8, 6), {}, "multiple"),
    ((2, 1, 2, 8), (2, 1, 4, 6), (9, 4, 6, 8), {}, "state rows"),
    ((2, 1, 2, 8), (2, 1, 4, 6), (9, 4, 8, 6), {"state_update": 2}, "state_update"),
    ((2, 1, 2, 8), (2, 1, 4, 6), (9, 4, 8, 6), {"qk_l2norm": 3}, "qk_l2norm"),
])
def test_launch_plan_refuses_what_the_kernel_cannot_run(q_shape, v_shape, pool_shape, kw, match):
    with pytest.raises(ValueError, match=match):
        gd_k.launch_plan(q_shape, v_shape, pool_shape, scale=0.3, **kw)


def test_kernel_spec_follows_the_op_spec():
    """Pointer parameters are the op's inputs and outputs in SPEC order (what the plugin binds)."""
    assert gd_k.KERNELS == (gd_k.GATED_DELTA,)
    assert gd_k.GATED_DELTA.inputs == gd_op.SPEC.inputs and gd_k.GATED_DELTA.outputs == gd_op.SPEC.outputs
    assert aot.expected_params(gd_k.GATED_DELTA) == (".u64",) * 8 + (".u32",) + (".u64",) * 2


# The AOT build: the kernel in every dtype for sm_80 and sm_90 at a real model's sizes
# (Qwen3.5: 16 q/k heads, 32 value heads, 128-wide heads), both modes, decode and prefill plans
# (the same kernel: the plan differs only in the S it passes); parameter list exactly (inputs
# .u64, int32 extras .u32, outputs .u64); shared memory within the 48 KiB a launch gets without
# an opt-in attribute.
_AOT_SCRIPT = r"""
import json
from graphkiln.plugins_trt.kernels import aot, gated_delta
out = []
for dtype in ("float16", "bfloat16", "float32"):
    for arch in aot.ARCHS:
        for mode in (0, 1):
            plan = gated_delta.launch_plan((4, 1, 16, 128), (4, 1, 32, 128), (9, 32, 128, 128), scale=128 ** -0.5,
                                           state_update=mode)
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
        assert b["target"] and b["entry"] == "gated_delta_kernel", where
        assert b["shared"] <= 48 * 1024, where
