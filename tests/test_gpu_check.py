"""scripts/gpu_check.py on CPU: its refusal without a GPU, and its plain parts.

The GPU work itself (timings, the CUDA-graph step, TensorRT) cannot run here. What can:
  * the one-line refusal when no CUDA device is visible (a subprocess, as a user runs it);
  * the byte counts behind every GB/s figure, against numbers worked out by hand;
  * the results table, summary line and exit status;
  * the case tables cover every kernel, tactic and dtype the script promises;
  * the script's own check functions, run with ``device="cpu"`` on CPU tensors in the Triton
    interpreter (conftest sets TRITON_INTERPRET=1): they pass on the real kernels and fail
    when a launcher's output or in-place state is wrong — so a green GPU table means something.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


gc = _load()


NO_GPU_REASON = "a CUDA device is visible: the refusal cannot happen here"


@pytest.fixture(scope="module", autouse=True)
def refusal_run(tmp_path_factory):
    """The script run as a user runs it, without a GPU: started with the module's first test so
    its torch import overlaps the other tests; ``test_refuses_without_a_gpu_in_one_line`` reads it."""
    if torch.cuda.is_available():
        yield None
        return
    cwd = tmp_path_factory.mktemp("refusal")
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--json", str(cwd / "results.json")], cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, TRITON_INTERPRET="1"))
    yield proc, cwd
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


# ----------------------------------------------------------------------------------------------
# bytes each launch must move


def test_attention_bytes_decode_by_hand():
    # B=2 rows at starts 0 and 17, S=1, Nq=4, Nkv=2, D=16, C=40, fp16 (2 bytes):
    #   q, out: 2 * 64 * 2 B each; k, v: 2 * 32 * 2 B each          -> 2*256 + 2*128 = 768
    #   cached rows read: 0 + 17, K and V, 2 heads * 16 * 2 B        -> 17 * 2 * 64 = 2176
    #   new rows written: positions 0 and 17 (< 40), K and V         -> 2 * 2 * 64 = 256
    #   position_ids: 2 * 8 = 16; cos + sin rows: 2 tokens * 2 * 8 * 4 B = 128
    assert gc.attention_bytes(2, 1, 4, 2, 16, 40, 0, (0, 17), 2) == 768 + 2176 + 256 + 16 + 128


def test_attention_bytes_window_and_cache_end_by_hand():
    # one row at start 4, S=4 (positions 4..7), Nq=2, Nkv=1, D=8, C=6, window 3, fp32:
    #   q, out: 4 tokens * 16 * 4 B each; k, v: 4 * 8 * 4 B each    -> 256 + 256 + 128 + 128 = 768
    #   cached rows: the first token (position 4) sees positions > 1: rows 2, 3 of the 4 cached
    #   new rows written: positions 4 and 5 (6 and 7 are past C)   -> (2 + 2) rows * 2 (K, V) * 32 B = 256
    #   position_ids 4 * 8 = 32; tables 4 * 2 * 4 * 4 B = 128
    assert gc.attention_bytes(1, 4, 2, 1, 8, 6, 3, (4,), 4) == 768 + 256 + 32 + 128


def test_moe_and_short_conv_bytes_by_hand():
    # MoE T=3, E=8, H=32, I=16, 5 routed experts, fp16: hidden + out 2*3*32, logits 3*8,
    # weights 5 * (2*16*32 + 32*16) elements, all 2 B; expert_bias 8 fp32
    assert gc.moe_bytes(3, 8, 32, 16, 5, 2) == (192 + 24 + 5 * 1536) * 2 + 32 == 15824
    # ShortConv B=2, S=5, C=10, K=4, fp16: x + y 2*2*5*10, weight 10*4, bias 10, slots read +
    # written 2*2*10*3, all 2 B; slot_idx + seq_lens 2 * 2 * 8 B
    assert gc.short_conv_bytes(2, 5, 10, 4, 2) == (200 + 40 + 10 + 120) * 2 + 32 == 772
    # unrouted experts cost nothing
    assert gc.moe_bytes(3, 8, 32, 16, 6, 2) - gc.moe_bytes(3, 8, 32, 16, 5, 2) == 3 * 16 * 32 * 2


# ----------------------------------------------------------------------------------------------
# the table


def _rows():
    return [
        gc.Row("attention_decode", "float16", "gqa: B=4 S=1", error=1.234e-4, tolerance=2e-3, passed=True,
               gbps=1234.56, pct_copy=25.04, note="a|b"),
        gc.Row("moe/decode", "float32", "d1", error=3.0e-5, tolerance=1e-5, passed=False,
               note="out: error 3e-05 > 1e-05"),
        gc.Row("tensorrt engine vs CPU", "float32", "-", passed=None, note="skipped: TensorRT not installed"),
    ]


def test_table_format():
    lines = gc.format_table(_rows()).splitlines()
    assert lines[0] == "| kernel | dtype | shape | max error | tolerance | pass | GB/s | % copy | note |"
    assert lines[1] == "|---|---|---|---|---|---|---|---|---|"
    assert lines[2] == "| attention_decode | float16 | gqa: B=4 S=1 | 1.23e-04 | 0.002 | ok | 1234.6 | 25.0 | a/b |"
    assert lines[3] == "| moe/decode | float32 | d1 | 3.00e-05 | 1e-05 | FAIL | - | - | out: error 3e-05 > 1e-05 |"
    assert lines[4] == ("| tensorrt engine vs CPU | float32 | - | - | - | skip | - | - | "
                        "skipped: TensorRT not installed |")
    assert len(lines) == 5 and all(l.count("|") == 10 for l in lines)  # a "|" in a note cannot add a column


def test_summary_and_exit_status():
    rows = _rows()
    line = gc.summary_line(rows, "NVIDIA H200 (sm_90)", 4012.3, 93.4)
    assert line == ("gpu_check FAILED: 1/2 checks passed, 1 failed, 1 skipped; NVIDIA H200 (sm_90); "
                    "copy bandwidth 4012 GB/s; 93 s")
    assert gc.exit_status(rows) == 1
    assert gc.exit_status([rows[0], rows[2]]) == 0  # skipped rows do not fail the run
    assert gc.summary_line([rows[0]], "x", None, 1.0).startswith("gpu_check passed: 1/1 checks passed, 0 failed")
    # rows cut by --budget: not a pass
    cut = gc.Row("moe/decode", "float16", "d1", passed=None, cut=True, note="not run: --budget 270 s reached")
    assert gc.summary_line([rows[0], rows[2], cut], "x", None, 1.0).startswith(
        "gpu_check INCOMPLETE: 1/1 checks passed, 0 failed, 1 skipped, 1 not run (--budget);")
    assert gc.exit_status([rows[0], cut]) == 1
    assert gc.format_row(cut)[5] == "not run"


def test_relative_error_and_verdict():
    want = torch.tensor([1.0, -4.0, 2.0])
    assert gc.rel_error(want + torch.tensor([0.0, 0.0, 0.04]), want) == pytest.approx(0.01)
    assert gc.rel_error(torch.tensor([1.0, float("nan"), 2.0]), want) == float("inf")
    v = gc.Verdict()
    v.close("a", want, want, 0.0)
    v.equal("b", want, want.clone())
    assert v.row("k", "float32", "s", 0.0).passed
    v.equal("c", want, want + 1)
    v.close("d", torch.full((3,), float("nan")), want, 1.0)
    row = v.row("k", "float32", "s", 1.0)
    assert not row.passed and "c: not bit-identical" in row.note and "d: error inf" in row.note


# ----------------------------------------------------------------------------------------------
# the plan covers what the script promises


def test_plan_covers_every_kernel_tactic_and_dtype():
    from graphkiln.plugins_trt.kernels import attention, moe, short_conv

    full = gc.plan(quick=False)
    seen, benched = set(), set()
    for section, case, dtype in full:
        if case is None:
            continue
        key = gc.kernel_label(section, case)
        seen.add((key, dtype))
        if case.bench:
            benched.add((key, dtype))
    kernels = {k.name for k in attention.KERNELS} | {f"moe/{t}" for t, _ in moe.TACTICS} | {
        f"short_conv/{t}" for t in short_conv.TACTICS}
    assert seen == benched == {(k, d) for k in kernels for d in gc.DTYPES}
    assert [s for s, _, _ in full].count("graph") == 2 and full[-1][0] == "tensorrt"
    assert any(c.lengths for s, c, _ in full if s == "attention")  # ragged rows
    assert any(list(c.slots) != sorted(c.slots) for s, c, _ in full if s == "short_conv")  # arbitrary slots

    quick = gc.plan(quick=True)
    assert {d for _, _, d in quick} == {"float16", "float32"}  # fp16 checks; the TensorRT row's own dtype
    assert {s for s, _, _ in quick} == {"graph", "attention", "moe", "short_conv", "tensorrt"}
    assert len(quick) < len(full) / 4
    assert {s for s, c, _ in quick if c is not None and c.bench} == {"attention", "moe"}


def test_step_shape_is_consistent():
    sh = gc.StepShape()
    assert len(set(sh.slots)) == len(sh.slots) == len(sh.starts) and max(sh.slots) < sh.pool_slots
    assert max(sh.starts) + sh.steps <= sh.cache and sh.experts <= sh.nq * sh.d


# ----------------------------------------------------------------------------------------------
# the check functions on CPU (Triton interpreter)


@pytest.fixture(scope="module", autouse=True)
def interpreter_range_fix():
    """Triton 3.2's interpreter under numpy 2 cannot loop to a runtime bound (its scalars are
    1-element arrays); the attention kernel does. Same fix as tests/test_trt_kernels_attention.py."""
    from triton.runtime import interpreter as interp

    orig = interp._patch_lang_tensor

    def patch_lang_tensor(tensor):
        orig(tensor)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interp, "_patch_lang_tensor", patch_lang_tensor)
        yield


ATTN_DECODE = gc.AttnCase("t-decode", nq=4, nkv=2, d=16, cache=40, window=0, starts=(0, 17, 40))
ATTN_PREFILL = gc.AttnCase("t-prefill", nq=4, nkv=2, d=16, cache=24, window=5, starts=(3, 0), seq=8, lengths=(8, 5))
MOE = gc.MoECase("t", "lfm2", tokens=3, experts=8, hidden=32, inter=32, top_k=2)
CONV = gc.ConvCase("t", seq=5, channels=40, width=4, lens=(5, 1, 0), slots=(5, 0, 7))


@pytest.mark.parametrize("case", [ATTN_DECODE, ATTN_PREFILL], ids=lambda c: c.name)
def test_attention_check_passes_the_kernel(case):
    row = gc.check_attention(case, "float32", "cpu")
    assert row.passed, row.note
    assert row.kernel == gc.kernel_label("attention", case) == f"attention_{case.tactic}" and 0 <= row.error <= gc.TOL["float32"] and row.gbps is None


def _attention():
    from graphkiln.plugins_trt.kernels.attention import run_attention

    return run_attention


def test_attention_check_catches_a_stray_cache_write():
    real = _attention()

    def stray(q, k, v, pk, pv, *args, **kw):
        out = real(q, k, v, pk, pv, *args, **kw)
        pk[0, 0, -1, 0] += 1  # row 0 starts at 0: position C-1 is neither read nor written
        return out

    row = gc.check_attention(ATTN_DECODE, "float32", "cpu", launch=stray)
    assert not row.passed and "cache rows not written (K)" in row.note


def test_attention_check_catches_wrong_output_and_keys():
    real = _attention()

    def off(q, k, v, pk, pv, pos, *args, **kw):
        out = real(q, k, v, pk, pv, pos, *args, **kw)
        out[1, 4] += 0.01  # a real token of the ragged row 1 (5 real tokens)
        pk[0, :, int(pos[0, 0])] *= 1.001  # a written key row, a little off
        return out

    row = gc.check_attention(ATTN_PREFILL, "float32", "cpu", launch=off)
    assert not row.passed and "out row 1" in row.note and "present_key rows" in row.note

    def padding_only(q, k, v, pk, pv, *args, **kw):
        out = real(q, k, v, pk, pv, *args, **kw)
        out[1, 6] = 1e6  # a padding token of row 1: not part of the contract
        return out

    assert gc.check_attention(ATTN_PREFILL, "float32", "cpu", launch=padding_only).passed


def test_moe_check_passes_and_has_the_cpu_tests_tolerance():
    from graphkiln.plugins_trt.kernels.moe import run_moe

    row = gc.check_moe(MOE, "float32", "cpu")
    assert row.passed and row.kernel == gc.kernel_label("moe", MOE) == "moe/decode", row.note
    scaled = gc.check_moe(MOE, "float32", "cpu", launch=lambda *a, **kw: run_moe(*a, **kw) * (1 + 3e-5))
    assert not scaled.passed and scaled.error > gc.TOL["float32"]


def test_moe_inputs_never_tie():
    """Distinct router logits per token in every dtype: top-k cannot depend on tie order."""
    case = gc.MoECase("ties", "mixtral", tokens=64, experts=64, hidden=8, inter=8, top_k=8)
    for dtype in gc.DTYPES:
        logits = gc.moe_inputs(case, dtype, "cpu", 1)[1]
        srt = logits.float().sort(dim=1).values
        assert bool((srt[:, 1:] > srt[:, :-1]).all()), dtype


def test_short_conv_check_passes_and_catches_a_stray_slot_write():
    from graphkiln.plugins_trt.kernels.short_conv import run_short_conv

    row = gc.check_short_conv(CONV, "float32", "cpu")
    assert row.passed and row.kernel == gc.kernel_label("short_conv", CONV) == "short_conv/prefill", row.note

    def stray(x, weight, bias, pool, *args, **kw):
        y, new = run_short_conv(x, weight, bias, pool, *args, **kw)
        pool[3] = 0  # slot 3 belongs to no row of the batch
        return y, new

    bad = gc.check_short_conv(CONV, "float32", "cpu", launch=stray)
    assert not bad.passed and "untouched pool slots" in bad.note


@pytest.mark.skipif(torch.cuda.is_available(), reason=NO_GPU_REASON)
def test_refuses_without_a_gpu_in_one_line(refusal_run):
    proc, cwd = refusal_run
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert stdout == ""
    assert stderr.splitlines() == [gc.NO_GPU]
    assert gc.NO_GPU == ("gpu_check: no CUDA device visible (torch.cuda.is_available() is False): run it on a "
                         "machine with an NVIDIA GPU")
    assert list(cwd.iterdir()) == []  # nothing written, the JSON included


def test_decode_step_runs_eagerly_in_place_and_deterministically():
    """The graph check's step (everything but the capture): state buffers keep their addresses,
    restore() brings the start state back, two eager runs agree bit for bit (what graph replay
    is compared against), and the effect checks pass on it and fail on a step that did nothing."""
    sh = gc.StepShape(nq=2, nkv=1, d=16, cache=24, starts=(3, 0, 20), slots=(5, 0, 2), pool_slots=6,
                      experts=4, inter=16)
    step = gc.DecodeStep("float32", sh, device="cpu")

    def addresses():
        return {k: v.data_ptr() for k, v in step.state.items()} | {"x": step.x_in.data_ptr(),
                                                                    "pos": step.pos_in.data_ptr()}

    before = addresses()
    outs, state = step.run_eager()
    outs2, state2 = step.run_eager()
    assert addresses() == before
    assert all(torch.equal(a, b) for a, b in zip(outs, outs2))
    assert all(torch.equal(state[k], state2[k]) for k in state)
    v = gc.Verdict()
    gc.step_has_effect(v, step, outs, state)
    assert not v.problems, v.problems
    idle = gc.Verdict()
    gc.step_has_effect(idle, step, [outs[0], outs[0]], step.state0)
    assert len(idle.problems) == 4  # same outputs; conv slots, key rows, value rows not written


def test_compare_greedy_compares_logits_with_polygraphy():
    """Tokens are counted; the logits before each prompt's first divergence go through
    polygraphy's comparator (fp32 tolerance: atol = rtol = 1e-2), later ones are never compared."""
    from graphkiln.runtime.requests import GenerationResult

    logits = np.array([[1.0, 4.0], [2.0, -3.0], [0.5, 0.5]])
    want = [GenerationResult([1], [5, 6, 7], logits=logits), GenerationResult([2], [8, 9], logits=logits[:2])]
    for shift, passes in ((0.0, True), (0.004, True), (0.04, False), (np.nan, False)):
        got = [GenerationResult([1], [5, 6, 7], logits=logits + shift), GenerationResult([2], [8, 9], logits=logits[:2])]
        agree, total, logit_cmp, problems = gc.compare_greedy(want, got)
        assert (agree, total, problems) == (5, 5, [])
        assert logit_cmp.passed is passes, (shift, logit_cmp.summary())
        assert {(d.iteration, d.output) for d in logit_cmp.diffs} == {("prompt 0", "logits"), ("prompt 1", "logits")}
        if not np.isnan(shift):
            assert logit_cmp.max_absdiff == pytest.approx(shift, abs=1e-6)
    # diverging at token 1: logits after it follow other tokens and are not compared
    other = [GenerationResult([1], [5, 0, 7], logits=logits + np.array([[0.0], [100.0], [100.0]])), want[1]]
    agree, total, logit_cmp, problems = gc.compare_greedy(want, other)
    assert (agree, total, problems) == (4, 5, ["prompt 0 differs from token 1"])
    assert logit_cmp.passed and logit_cmp.max_absdiff == 0.0
    # diverging at token 0 everywhere: nothing to compare, and that is not a pass
    first = [GenerationResult([1], [0, 6, 7], logits=logits), GenerationResult([2], [0, 9], logits=logits[:2])]
    agree, total, logit_cmp, problems = gc.compare_greedy(want, first)
    assert agree == 3 and not logit_cmp.diffs and not logit_cmp.passed and len(problems) == 2
    assert gc.compare_greedy(want, want[:1])[3] == ["1 results for 2 prompts"]
