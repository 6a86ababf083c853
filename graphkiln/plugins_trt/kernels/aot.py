"""Ahead-of-time compilation of the plugin kernels to PTX, and the ABI check TensorRT needs.

TensorRT launches an AOT Python plugin's kernel with exactly: input pointers, the plugin's
``SymInt32`` extra arguments, output pointers. Triton 3.2.0 (pinned in pyproject) compiles a
kernel with exactly its non-constexpr parameters in signature order; 3.3 appends a
global-scratch pointer and 3.5 a profile-scratch pointer too, which TensorRT would not pass.
``compile_kernel`` therefore parses the PTX entry and refuses any other parameter list.

Compiling needs no GPU (Triton bundles ptxas), but it needs a process in which Triton is not
in interpreter mode: under ``TRITON_INTERPRET=1`` every ``@triton.jit`` function, ``tl.max``
and friends included, is an interpreter object the compiler cannot lower. The test suite
(which interprets) compiles in a child process for that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable, Mapping

# Triton pointer/scalar type names for the dtypes the plugins take.
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}
ARCHS = (80, 90)  # sm_80 (A100) and sm_90 (H100/H200)


@dataclass(frozen=True, eq=False)  # identity: one object per kernel (and hashable for the compile cache)
class KernelSpec:
    """One Triton kernel as a plugin launches it.

    ``fn`` is the ``@triton.jit`` kernel. ``inputs``/``outputs`` name its pointer parameters
    (in launch order, matching the op's inputs/outputs the plugin binds) and ``scalars`` its
    int32 parameters, which come between them; ``constexprs`` names the compile-time
    parameters (block sizes, float attributes). Pointers take the dtype chosen at compile
    time ("float16", ...) unless ``fixed_dtypes`` pins theirs (int64 ids, fp32 tables).
    """

    name: str
    fn: Callable
    inputs: tuple[str, ...]
    scalars: tuple[str, ...]
    outputs: tuple[str, ...]
    constexprs: tuple[str, ...] = ()
    fixed_dtypes: Mapping[str, str] = field(default_factory=dict)  # pointer -> dtype regardless of the choice

    def signature(self, dtype: str, constexprs: Mapping[str, object]) -> dict[str, str]:
        sig = {}
        for p in self.inputs + self.scalars + self.outputs:
            if p in self.scalars:
                sig[p] = "i32"
            else:
                sig[p] = "*" + TRITON_DTYPES[self.fixed_dtypes.get(p, dtype)]
        missing = set(self.constexprs) - set(constexprs)
        if missing:
            raise ValueError(f"kernel {self.name} needs constexprs {sorted(missing)}")
        for c in self.constexprs:
            sig[c] = "constexpr"
        return sig


@dataclass(frozen=True)
class CompiledKernel:
    """What ``tensorrt.plugin.aot_impl`` returns the pieces of: the PTX and its entry name,
    and the launch facts (threads per block = num_warps * 32, dynamic shared memory)."""

    name: str
    ptx: str
    num_warps: int
    shared_mem: int
    params: tuple[str, ...]  # PTX parameter types in order, e.g. (".u64", ".u64", ".u32", ".u64")
    arch: int

    @property
    def block_threads(self) -> int:
        return self.num_warps * 32


_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\((.*?)\)", re.S)


def ptx_params(ptx: str) -> tuple[str, tuple[str, ...]]:
    """(entry name, parameter types) of the single kernel entry in ``ptx``."""
    entries = _ENTRY.findall(ptx)
    if len(entries) != 1:
        raise ValueError(f"expected one .entry in the PTX, found {len(entries)}")
    name, params = entries[0]
    types = tuple(re.match(r"\s*\.param\s+(\.\w+)", p).group(1) for p in params.split(",") if p.strip())
    return name, types


def expected_params(spec: KernelSpec) -> tuple[str, ...]:
    """The PTX parameter types TensorRT's launch supplies: pointers are .u64, int32 scalars .u32."""
    return (".u64",) * len(spec.inputs) + (".u32",) * len(spec.scalars) + (".u64",) * len(spec.outputs)


@lru_cache(maxsize=256)
def _compile(spec: KernelSpec, dtype: str, constexprs: tuple[tuple[str, object], ...], arch: int,
             num_warps: int) -> CompiledKernel:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    if not isinstance(spec.fn, JITFunction):
        raise RuntimeError(f"kernel {spec.name} was defined with TRITON_INTERPRET=1 and cannot be compiled: "
                           "compile in a process without TRITON_INTERPRET set")
    values = dict(constexprs)
    src = triton.compiler.ASTSource(fn=spec.fn, signature=spec.signature(dtype, values), constants=values)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    ptx = compiled.asm["ptx"]
    name, params = ptx_params(ptx)
    want = expected_params(spec)
    if params != want:
        raise RuntimeError(
            f"kernel {spec.name} compiled by Triton {triton.__version__} takes PTX parameters {params}, but TensorRT "
            f"launches it with {want} (inputs, int32 extras, outputs): use the pinned Triton (pyproject.toml)")
    return CompiledKernel(name, ptx, compiled.metadata.num_warps, compiled.metadata.shared, params, arch)


def compile_kernel(spec: KernelSpec, dtype: str, constexprs: Mapping[str, object], arch: int = 90,
                   num_warps: int = 4) -> CompiledKernel:
    """Compile ``spec`` for ``dtype`` on sm_``arch`` to PTX and check its parameter list."""
    if dtype not in TRITON_DTYPES:
        raise ValueError(f"dtype {dtype} is not one of {sorted(TRITON_DTYPES)}")
    return _compile(spec, dtype, tuple(sorted(constexprs.items())), arch, num_warps)


@dataclass(frozen=True)
class LaunchPlan:
    """How a plugin launches one kernel for given shapes: the kernel, its compile-time values,
    the grid (x, y, z) and the int32 scalars it takes between inputs and outputs.

    Built by each kernel module's ``launch_plan`` from shapes whose entries are either ints
    (the CPU tests, the Python launchers) or TensorRT's symbolic ``SymInt32`` expressions
    (the plugin's ``aot_impl``): plan functions use only ``+ - *``, ``//`` by constants is NOT
    allowed — they call the ``cdiv`` they are given (``trtp.cdiv`` or ``ceil_div``) — so one
    plan serves both.
    """

    kernel: KernelSpec
    constexprs: Mapping[str, object]
    grid: tuple[object, object, object]
    scalars: tuple[object, ...]
    num_warps: int = 4


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
