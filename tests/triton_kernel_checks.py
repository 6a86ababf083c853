"""What the Triton kernel tests (test_trt_kernels_attention.py, test_trt_kernels_moe_conv.py,
test_trt_kernels_gated_delta.py, test_trt_kernels_ssm_scan.py) share: the Triton interpreter
fixes, the tolerance check against a reference, a stand-in for TensorRT's symbolic dims, and the
ahead-of-time build in a subprocess.

A test module imports ``interpreter_fixes`` (or ``interpreter_fixes_with_bf16_dot``, for kernels
that multiply bf16 with ``tl.dot``): an autouse module fixture, so importing it is what turns it
on there. It builds its AOT fixtures with ``aot_build_fixtures``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}  # max |err| relative to max |reference|


@contextlib.contextmanager
def _interpreter_patches(bf16_dot: bool):
    """Triton 3.2 interpreter bugs that are not the kernels', fixed while the context is open, so
    the interpreter computes what the compiled kernel does:
    * with NumPy 2, ``range()`` over a runtime bound (a per-token loop to seq_lens[b]) fails, since
      the interpreter's scalars are 1-element arrays (and ``int()`` of those is an error);
    * fp32 -> bf16 casts truncate, where compiled Triton (and torch) round to nearest even;
    * with ``bf16_dot``: ``tl.dot`` on bf16 multiplies the raw uint16 bit patterns; the operands
      are converted exactly to fp32, what the GPU's bf16 MMA multiplies (accumulating in fp32)."""
    import triton.language as tl
    from triton.runtime import interpreter as interp

    orig_patch, orig_dot = interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot
    orig_cast = interp.InterpreterBuilder.cast_impl

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            bits = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16).numpy()
            return interp.TensorHandle(bits.view(np.uint16), tl.bfloat16)
        return orig_cast(self, src, dst_type)

    def patch_lang_tensor(tensor):
        orig_patch(tensor)
        tensor.__index__ = lambda self: int(np.asarray(self.handle.data).reshape(-1)[0])

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def f32(h):
            if h.dtype == tl.bfloat16:
                return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h
        return orig_dot(self, f32(a), f32(b), d, input_precision, max_num_imprecise_acc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interp, "_patch_lang_tensor", patch_lang_tensor)
        mp.setattr(interp.InterpreterBuilder, "cast_impl", cast_impl)
        if bf16_dot:
            mp.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
        yield


@pytest.fixture(scope="module", autouse=True)
def interpreter_fixes():
    """The interpreter fixes (``_interpreter_patches``) for the importing module only."""
    with _interpreter_patches(bf16_dot=False):
        yield


@pytest.fixture(scope="module", autouse=True)
def interpreter_fixes_with_bf16_dot():
    """The interpreter fixes and the bf16 ``tl.dot`` one, for the importing module only."""
    with _interpreter_patches(bf16_dot=True):
        yield


def close(got: torch.Tensor, want: torch.Tensor, dtype: str, what: str = "") -> None:
    """Same dtype and shape, finite, and max |err| within TOL[dtype] of max |want|."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert torch.isfinite(got.double()).all(), f"{what}: non-finite values"
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    assert err <= TOL[dtype] * scale, f"{what}: max |err| {err:.3g} vs max |ref| {scale:.3g} ({dtype})"


class Sym:
    """A stand-in for TensorRT's SymInt32: + - * and cdiv only (what LaunchPlan allows)."""

    def __init__(self, text: str, const: int | None = None):
        self.text, self.is_constant, self.constant_value = text, const is not None, const

    def _op(self, o, sym, rev=False):
        a, c = self.text, o.text if isinstance(o, Sym) else str(o)
        return Sym(f"({c} {sym} {a})" if rev else f"({a} {sym} {c})")

    __add__ = lambda s, o: s._op(o, "+")
    __radd__ = lambda s, o: s._op(o, "+", True)
    __sub__ = lambda s, o: s._op(o, "-")
    __rsub__ = lambda s, o: s._op(o, "-", True)
    __mul__ = lambda s, o: s._op(o, "*")
    __rmul__ = lambda s, o: s._op(o, "*", True)

    def __floordiv__(self, o):
        raise TypeError("// on a symbolic dim: use cdiv")

    __rfloordiv__ = __truediv__ = __mod__ = __floordiv__

    def __index__(self):
        raise TypeError("a symbolic dim has no value")

    __int__ = __bool__ = __index__

    def __repr__(self):
        return self.text


def sym_cdiv(a, b):
    return Sym(f"cdiv({a}, {b})")


def aot_build_fixtures(script: str, argv: tuple[str, ...] = ()):
    """(started, builds) module fixtures for an AOT build ``script`` (run with ``argv``) that
    prints one JSON line.
    ``started`` (autouse) launches it in a subprocess with the interpreter off when the module's
    first test runs, so it overlaps the interpreter tests, and only if a selected test uses
    ``builds``; ``builds`` waits for it and returns the parsed line. Assign them in the test
    module as ``_aot_compile_started, aot_builds = aot_build_fixtures(SCRIPT)``."""

    @pytest.fixture(scope="module", autouse=True)
    def _aot_compile_started(request):
        if not any("aot_builds" in getattr(item, "fixturenames", ()) for item in request.session.items):
            yield None
            return
        env = dict(os.environ, TRITON_INTERPRET="0")
        proc = subprocess.Popen([sys.executable, "-c", script, *argv], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        yield proc
        if proc.poll() is None:
            proc.kill()
            proc.communicate()

    @pytest.fixture(scope="module")
    def aot_builds(_aot_compile_started):
        proc = _aot_compile_started
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-4000:]
        return json.loads(stdout.strip().splitlines()[-1])

    return _aot_compile_started, aot_builds
