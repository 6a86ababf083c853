"""graphkiln's custom ops: one definition each, every target derived from it.

This package sits below export, runtime and plugins_trt, which all import it (never each
other) for an op's identity. Each op module (``attention``, ``moe``, ``short_conv``,
``gated_delta``, ``ssm_scan``; every one in ``OP_MODULES``) holds:
  * ``SPEC`` — name, domain, version, inputs, outputs, attributes and the TensorRT plugin
    identity (torch-free, so the runtime can list known ops without torch);
  * ``reference`` — the torch math (torch imported lazily), which export registers as the
    ``torch.library`` op the model code calls and the Triton kernels are tested against;
  * ``fake`` — output shapes for tracing;
  * ``onnx_function`` — the same math in standard ONNX ops, attached to exported models as a
    model-local function so onnxruntime runs the node with no extra library.

``register_torch_ops``/``torch_op`` give the torch face the model code calls;
``graphkiln.export.custom_ops.registry`` derives the export faces (the exporter's
translation table, ONNX schemas, attaching the functions); ``graphkiln.plugins_trt``
derives the TensorRT plugins.
"""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

from graphkiln.ops.spec import DOMAIN, AttrSpec, CustomOpSpec

OP_MODULES = ("attention", "moe", "short_conv", "gated_delta", "ssm_scan")

__all__ = ["DOMAIN", "AttrSpec", "CustomOpSpec", "OP_MODULES", "op_modules", "specs", "register_torch_ops", "torch_op"]


@cache
def op_modules() -> dict[str, ModuleType]:
    """Every op's defining module by ONNX op name."""
    mods = [importlib.import_module(f"graphkiln.ops.{m}") for m in OP_MODULES]
    return {m.SPEC.name: m for m in mods}


def specs() -> dict[str, CustomOpSpec]:
    """Every known custom op by ONNX name; importing this needs neither torch nor onnx."""
    return {name: m.SPEC for name, m in op_modules().items()}


@cache
def register_torch_ops() -> None:
    """Define ``torch.ops.graphkiln.*`` with each module's reference as the implementation."""
    import torch

    for m in op_modules().values():
        spec = m.SPEC
        torch.library.define(spec.torch_qualname, spec.torch_schema())
        torch.library.impl(spec.torch_qualname, "CompositeExplicitAutograd")(m.reference)
        torch.library.register_fake(spec.torch_qualname)(m.fake)


def torch_op(name: str):
    import torch

    register_torch_ops()
    return getattr(torch.ops.graphkiln, specs()[name].torch_name).default
