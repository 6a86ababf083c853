"""The MoE and ShortConv Triton kernels against the ops' torch references, and their AOT build.

Kernels run on CPU in the Triton interpreter (conftest sets TRITON_INTERPRET=1). The
ahead-of-time compile runs in a subprocess with the interpreter off: under
TRITON_INTERPRET=1 every ``@triton.jit`` function — tl.max, tl.sum, tl.sigmoid, a kernel's
helpers — is an interpreter object the compiler cannot call, so an in-process compile of a
kernel that reduces fails.
"""

from __future__ import annotations

import pytest
import torch

from graphkiln.ops import moe as moe_op
from graphkiln.ops import short_conv as conv_op
from graphkiln.plugins_trt.kernels import aot
from graphkiln.plugins_trt.kernels import moe as moe_k
from graphkiln.plugins_trt.kernels import short_conv as conv_k
from triton_kernel_checks import DTYPES, Sym, aot_build_fixtures, close, sym_cdiv


# Routing styles: (scoring, normalize, norm_eps, routed_scaling, expert bias)
STYLES = {
    "mixtral": (0, 1, 0.0, 1.0, False),  # softmax, renormalised top-k (Qwen3-MoE with norm_topk_prob)
    "softmax_raw": (0, 0, 0.0, 1.0, False),  # softmax, weights not renormalised
    "lfm2": (1, 1, 1e-6, 2.5, True),  # sigmoid, bias for selection only, eps, routed scaling
    "nemotron_h": (1, 1, 1e-20, 2.5, True),  # sigmoid + e_score_correction_bias, eps 1e-20, scaling
}

# (style, T, E, H, I, top_k, tactic): decode T = 1 and 3, prefill-sized T = 20 (one 64-token
# block with the prefill tiles, or two ragged 16-token blocks with the decode ones). H = 160
# (decode, 128-column tiles) and H = 80 (prefill, 64) give a ragged second output tile and
# several K chunks, I = 48 and 80 ragged and several intermediate chunks; E = 6 pads the
# routing tile.
MOE_CASES = [
    ("mixtral", 1, 8, 32, 32, 2, None),
    ("mixtral", 3, 4, 160, 80, 2, None),
    ("mixtral", 20, 8, 80, 48, 2, None),
    ("softmax_raw", 1, 8, 32, 32, 4, None),
    ("softmax_raw", 20, 4, 32, 32, 1, "decode"),
    ("softmax_raw", 3, 6, 32, 48, 2, None),
    ("lfm2", 3, 8, 32, 32, 4, None),
    ("lfm2", 1, 4, 32, 32, 1, None),
    ("lfm2", 20, 8, 32, 48, 4, None),
]


# (style, T, E, H, I, top_k, tactic, activation, limit) with random expert biases: relu²
# (gate_up has I rows) and the clamped SwiGLU with a limit that binds; decode, ragged prefill
# and the decode tiles on a prefill-sized T.
MOE_ACT_CASES = [
    ("nemotron_h", 1, 8, 32, 32, 2, None, 1, 7.0),
    ("nemotron_h", 3, 6, 160, 80, 4, None, 1, 7.0),
    ("nemotron_h", 20, 8, 80, 48, 2, None, 1, 7.0),
    ("mixtral", 1, 8, 32, 32, 2, None, 2, 0.7),
    ("mixtral", 3, 4, 160, 80, 2, None, 2, 0.7),
    ("mixtral", 20, 8, 80, 48, 4, "decode", 2, 0.7),
    ("lfm2", 20, 8, 32, 48, 2, None, 0, 7.0),  # SwiGLU with expert biases
]


def _moe_inputs(seed: int, t: int, e: int, h: int, i: int, style: str, dtype: torch.dtype, activation: int = 0,
                expert_biases: bool = False):
    """hidden, logits, gate_up, down, expert_bias, gate_up_bias, down_bias (zeros unless
    ``expert_biases``); gate_up has I rows per expert for relu² (activation 1), else 2I."""
    g = torch.Generator().manual_seed(seed)
    f = moe_op.gate_up_rows(i, activation)
    hidden = torch.randn(t, h, generator=g).to(dtype)
    logits = (2 * torch.randn(t, e, generator=g)).to(dtype)
    gate_up = (torch.randn(e, f, h, generator=g) / h ** 0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dtype)
    bias = 0.3 * torch.randn(e, generator=g) if STYLES[style][4] else torch.zeros(e)
    gate_up_bias, down_bias = (0.5 * torch.randn(e, n, generator=g) if expert_biases else torch.zeros(e, n)
                               for n in (f, h))
    return hidden, logits, gate_up, down, bias, gate_up_bias.to(dtype), down_bias.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style,t,e,h,i,top_k,tactic", MOE_CASES)
def test_moe_matches_reference(style, t, e, h, i, top_k, tactic, dtype):
    scoring, normalize, eps, scaling, _ = STYLES[style]
    args = _moe_inputs(t * 100 + e * 10 + top_k, t, e, h, i, style, DTYPES[dtype])
    attrs = (top_k, scoring, normalize, eps, scaling)
    got = moe_k.run_moe(*args, *attrs, tactic=tactic)
    close(got, moe_op.reference(*args, *attrs), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style,t,e,h,i,top_k,tactic,activation,limit", MOE_ACT_CASES)
def test_moe_activations_and_expert_biases_match_reference(style, t, e, h, i, top_k, tactic, activation, limit,
                                                           dtype):
    scoring, normalize, eps, scaling, _ = STYLES[style]
    args = _moe_inputs(t * 100 + e * 10 + top_k, t, e, h, i, style, DTYPES[dtype], activation, expert_biases=True)
    if activation == 2:  # the limit must bind on gate and on up for the clamps to be tested
        y = torch.einsum("th,efh->tef", args[0].float(), args[2].float()) + args[5].float()
        assert (y[..., :i] > limit).any() and (y[..., i:].abs() > limit).any()
    attrs = (top_k, scoring, normalize, eps, scaling, activation, 1.702, limit)
    got = moe_k.run_moe(*args, *attrs, tactic=tactic)
    close(got, moe_op.reference(*args, *attrs), dtype)


def test_moe_expert_bias_changes_selection_not_weights():
    """The LFM2 cases only test the bias if it changes which experts win; and the weights of
    a biased pick must still be its unbiased score (a kernel weighting by score + bias fails)."""
    scoring, normalize, eps, scaling, _ = STYLES["lfm2"]
    hidden, logits, gate_up, down, bias, gub, dnb = _moe_inputs(7, 20, 8, 32, 32, "lfm2", torch.float32)
    _, with_bias = moe_op.routing(logits, bias, 2, scoring, normalize, eps, scaling)
    _, without = moe_op.routing(logits, torch.zeros_like(bias), 2, scoring, normalize, eps, scaling)
    assert not torch.equal(with_bias.sort(-1).values, without.sort(-1).values)
    strong = bias * 10  # large enough to override the scores
    got = moe_k.run_moe(hidden, logits, gate_up, down, strong, gub, dnb, 2, scoring, normalize, eps, scaling)
    want = moe_op.reference(hidden, logits, gate_up, down, strong, gub, dnb, 2, scoring, normalize, eps, scaling)
    close(got, want, "float32")


@pytest.mark.parametrize("poisoned", ["gate_up", "down", "gate_up_bias", "down_bias"])
@pytest.mark.parametrize("t,tactic", [(1, None), (3, None), (20, None), (20, "decode")])
def test_moe_never_reads_an_unrouted_expert(t, tactic, poisoned):
    """NaN weights in an expert no token picks must not reach the output: a kernel that runs
    every expert on every token and multiplies the unrouted ones by 0 gives NaN."""
    style, e, h, i, top_k = "mixtral", 8, 32, 32, 2
    scoring, normalize, eps, scaling, _ = STYLES[style]
    args = _moe_inputs(11 + t, t, e, h, i, style, torch.float32, expert_biases=True)
    hidden, logits, gate_up, down, bias, gub, dnb = args
    logits[:, 3] = -30.0  # expert 3 is never in any token's top 2
    {"gate_up": gate_up, "down": down, "gate_up_bias": gub, "down_bias": dnb}[poisoned][3] = float("nan")
    got = moe_k.run_moe(*args, top_k, scoring, normalize, eps, scaling, tactic=tactic)
    assert torch.isfinite(got).all()
    close(got, moe_op.reference(*args, top_k, scoring, normalize, eps, scaling), "float32")


# (B, S, C, K, seq_lens, slot_idx, tactic): decode S = 1 (len 1 < K-1 shifts old state columns;
# a len-0 row keeps its state), prefill S = 12 and 20, ragged lengths including 1 and S,
# unordered non-contiguous slots of a 9-slot pool; the "decode" tactic on prefill shapes cuts
# S into many small time tiles (only tile 0 may touch the state); C = 40 and 96 give partial
# and several channel blocks.
CONV_CASES = [
    (3, 1, 40, 4, [1, 1, 1], [5, 0, 7], None),
    (3, 1, 96, 3, [1, 0, 1], [2, 8, 4], None),
    (3, 12, 40, 3, [12, 1, 5], [2, 8, 4], None),
    (5, 12, 40, 4, [12, 2, 7, 1, 12], [8, 3, 0, 6, 1], None),
    (5, 12, 96, 4, [12, 2, 7, 1, 3], [8, 3, 0, 6, 1], "decode"),
    (2, 20, 40, 4, [20, 17], [6, 4], None),
]
POOL_SLOTS = 9


def _conv_inputs(seed, b, s, c, k, lens, slots, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, s, c, generator=g).to(dtype)
    weight = torch.randn(c, k, generator=g).to(dtype)
    bias = torch.randn(c, generator=g).to(dtype)
    pool = torch.randn(POOL_SLOTS, c, k - 1, generator=g).to(dtype)
    return x, weight, bias, pool, torch.tensor(slots, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,s,c,k,lens,slots,tactic", CONV_CASES)
def test_short_conv_updates_pool_in_place(b, s, c, k, lens, slots, tactic, dtype):
    x, weight, bias, pool, slot_idx, seq_lens = _conv_inputs(b * 10 + s + k, b, s, c, k, lens, slots, DTYPES[dtype])
    y_ref, rows_ref = conv_op.reference(x, weight, bias, pool, slot_idx, seq_lens, c)
    want = pool.clone()
    want[slot_idx] = rows_ref  # state_update=1: the whole pool, row slot_idx[b] replaced
    live = pool.clone()
    y, new_state = conv_k.run_short_conv(x, weight, bias, live, slot_idx, seq_lens, c, tactic=tactic)
    assert new_state.data_ptr() == live.data_ptr()  # in place, as under TensorRT's aliasing
    close(y, y_ref, dtype)
    untouched = [r for r in range(POOL_SLOTS) if r not in slots]
    assert torch.equal(live[untouched], pool[untouched])
    close(live[slot_idx], want[slot_idx], dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_short_conv_state_rows_mode(dtype):
    b, s, c, k, lens, slots = 3, 12, 40, 4, [12, 1, 5], [2, 8, 4]
    x, weight, bias, pool, slot_idx, seq_lens = _conv_inputs(3, b, s, c, k, lens, slots, DTYPES[dtype])
    before = pool.clone()
    y, rows = conv_k.run_short_conv(x, weight, bias, pool, slot_idx, seq_lens, c, state_update=0)
    y_ref, rows_ref = conv_op.reference(x, weight, bias, before, slot_idx, seq_lens, c)
    assert torch.equal(pool, before) and rows.shape == (b, c, k - 1)
    close(y, y_ref, dtype)
    close(rows, rows_ref, dtype)


def test_launch_plans_take_symbolic_token_dims():
    t = Sym("T")
    plan = moe_k.launch_plan((t, Sym("H", 64)), (t, Sym("E", 8)), (Sym("E", 8), Sym("2I", 96), Sym("H", 64)),
                             (Sym("E", 8), Sym("H", 64), Sym("I", 48)), top_k=2, scoring=1, normalize=1,
                             norm_eps=1e-6, routed_scaling=2.5, cdiv=sym_cdiv)
    bt, bh = plan.constexprs["BLOCK_T"], plan.constexprs["BLOCK_H"]
    assert repr(plan.grid[0]) == f"cdiv(T, {bt})" and plan.grid[1:] == (aot.ceil_div(64, bh), 1)
    assert plan.scalars == (t,) and (plan.constexprs["E"], plan.constexprs["H"], plan.constexprs["I"]) == (8, 64, 48)
    b, s = Sym("B"), Sym("S")
    plan = conv_k.launch_plan((b, s, Sym("C", 40)), (Sym("C", 40), Sym("K", 4)), (Sym("N"), Sym("C", 40), Sym("K1", 3)),
                              channels=40, cdiv=sym_cdiv)
    assert plan.grid[0] is b and repr(plan.grid[2]) == f"cdiv(S, {plan.constexprs['BLOCK_S']})"
    assert plan.scalars == (s,) and plan.constexprs["K"] == 4 and plan.constexprs["BLOCK_S"] >= 3


@pytest.mark.parametrize("bad", [
    dict(top_k=0), dict(top_k=9), dict(scoring=2), dict(normalize=3),
])
def test_moe_launch_plan_refuses_bad_attributes(bad):
    attrs = dict(top_k=2, scoring=0, normalize=1, norm_eps=0.0, routed_scaling=1.0) | bad
    with pytest.raises(ValueError):
        moe_k.launch_plan((4, 32), (4, 8), (8, 64, 32), (8, 32, 32), **attrs)


def test_launch_plans_need_static_weight_dims():
    with pytest.raises(ValueError, match="number of experts"):
        moe_k.launch_plan((4, 32), (4, 8), (Sym("E"), 64, 32), (8, 32, 32), top_k=2, scoring=0, normalize=1,
                          norm_eps=0.0, routed_scaling=1.0)
    with pytest.raises(ValueError, match="convolution width"):
        conv_k.launch_plan((2, 5, 40), (40, Sym("K")), (9, 40, 3), channels=40)
    with pytest.raises(ValueError, match="state width"):
        conv_k.launch_plan((2, 5, 40), (40, 4), (9, 40, 2), channels=40)


# The AOT build: every kernel in every dtype for sm_80 and sm_90, parameter list exactly
# (inputs .u64, int32 extras .u32, outputs .u64), shared memory within the 48 KiB a launch
# gets without an opt-in attribute.
_AOT_SCRIPT = r"""
import json, sys
from graphkiln.plugins_trt.kernels import aot, moe, short_conv
plans = {
    # weights big enough that every loop runs several iterations (Triton pipelines those loads:
    # shared memory is as at model sizes)
    "moe/decode": lambda dtype: moe.launch_plan(
        (3, 256), (3, 16), (16, 256, 256), (16, 256, 128), top_k=8, scoring=1, normalize=1, norm_eps=1e-6,
        routed_scaling=2.5, dtype=dtype, tactic="decode"),
    "moe/prefill": lambda dtype: moe.launch_plan(
        (300, 256), (300, 16), (16, 256, 256), (16, 256, 128), top_k=8, scoring=0, normalize=1,
        norm_eps=0.0, routed_scaling=1.0, dtype=dtype, tactic="prefill"),
    "moe/relu2": lambda dtype: moe.launch_plan(
        (3, 256), (3, 16), (16, 128, 256), (16, 256, 128), top_k=8, scoring=1, normalize=1, norm_eps=1e-20,
        routed_scaling=2.5, activation=1, dtype=dtype, tactic="decode"),
    "moe/clamped": lambda dtype: moe.launch_plan(
        (300, 256), (300, 16), (16, 256, 256), (16, 256, 128), top_k=4, scoring=0, normalize=1,
        norm_eps=0.0, routed_scaling=1.0, activation=2, alpha=1.702, limit=7.0, dtype=dtype, tactic="prefill"),
    "short_conv/decode": lambda dtype: short_conv.launch_plan((4, 1, 1024), (1024, 4), (9, 1024, 3), channels=1024,
                                                              state_update=1),
}
# every kernel in every dtype for both archs with its decode tiles; the MoE prefill tiles in
# fp32, where shared memory is largest
builds = [(n, d, a) for n in ("moe/decode", "short_conv/decode") for d in ("float16", "bfloat16", "float32")
          for a in aot.ARCHS]
builds += [("moe/prefill", "float32", 80), ("moe/relu2", "bfloat16", 90), ("moe/clamped", "float32", 80)]
out = []
for name, dtype, arch in builds:
    plan = plans[name](dtype)
    ck = aot.compile_kernel(plan.kernel, dtype, plan.constexprs, arch, plan.num_warps)
    out.append(dict(plan=name, dtype=dtype, arch=arch, entry=ck.name, params=list(ck.params),
                    want=list(aot.expected_params(plan.kernel)), shared=ck.shared_mem,
                    target=f".target sm_{arch}" in ck.ptx))
print(json.dumps(out))
"""
_aot_compile_started, aot_builds = aot_build_fixtures(_AOT_SCRIPT)


def test_kernels_compile_ahead_of_time_with_the_tensorrt_abi(aot_builds):
    assert {(b["plan"], b["dtype"], b["arch"]) for b in aot_builds} >= {
        (p, d, a) for p in ("moe/decode", "short_conv/decode") for d in DTYPES for a in aot.ARCHS}
    for b in aot_builds:
        where = f"{b['plan']} {b['dtype']} sm_{b['arch']}"
        assert b["params"] == b["want"], where
        assert b["target"] and b["entry"].endswith("_kernel"), where
        assert b["shared"] <= 48 * 1024, where
    assert aot.expected_params(moe_k.MOE) == (".u64",) * 7 + (".u32",) + (".u64",)
    assert aot.expected_params(conv_k.SHORT_CONV) == (".u64",) * 6 + (".u32",) + (".u64",) * 2


def test_kernel_specs_follow_the_op_specs():
    """Pointer parameters are the op's inputs and outputs in SPEC order (what the plugin binds)."""
    assert moe_k.KERNELS == (moe_k.MOE,) and conv_k.KERNELS == (conv_k.SHORT_CONV,)
    assert moe_k.MOE.inputs == moe_op.SPEC.inputs and moe_k.MOE.outputs == moe_op.SPEC.outputs
    assert conv_k.SHORT_CONV.inputs == conv_op.SPEC.inputs and conv_k.SHORT_CONV.outputs == conv_op.SPEC.outputs
