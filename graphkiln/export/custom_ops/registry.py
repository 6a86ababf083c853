"""Derive every face of every custom op from its module (see package docstring)."""

from __future__ import annotations

import importlib
from functools import cache
from types import ModuleType

from graphkiln.export.custom_ops.spec import DOMAIN, CustomOpSpec

OP_MODULES = ("attention", "moe", "short_conv")


@cache
def op_modules() -> dict[str, ModuleType]:
    mods = [importlib.import_module(f"graphkiln.export.custom_ops.{m}") for m in OP_MODULES]
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


@cache
def register_onnx_schemas() -> None:
    """Register an ``onnx.defs.OpSchema`` per op so checkers and onnxscript know the node."""
    import onnx
    from onnx.defs import OpSchema

    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING}
    for spec in specs().values():
        if onnx.defs.has(spec.name, spec.domain):
            continue
        attrs = [OpSchema.Attribute(a.name, kinds[a.kind], a.doc) for a in spec.attributes]
        attrs += [OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                  OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version")]
        schema = OpSchema(
            spec.name, spec.domain, spec.version, doc=spec.doc,
            inputs=[OpSchema.FormalParameter(n, "T" if i == 0 else f"T{i}") for i, n in enumerate(spec.inputs)],
            outputs=[OpSchema.FormalParameter(n, f"O{i}") for i, n in enumerate(spec.outputs)],
            type_constraints=[("T" if i == 0 else f"T{i}", _ALL_TENSORS, "") for i in range(len(spec.inputs))]
            + [(f"O{i}", _ALL_TENSORS, "") for i in range(len(spec.outputs))],
            attributes=attrs,
        )
        onnx.defs.register_schema(schema)


_ALL_TENSORS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(int64)", "tensor(int32)"]


def translation_table() -> dict:
    """torch op -> function emitting one opaque ``graphkiln`` node with the plugin attributes."""
    from onnxscript.values import Opset

    register_torch_ops()
    register_onnx_schemas()
    table = {}
    for spec in specs().values():
        opset = Opset(spec.domain, spec.version)

        def translate(*args, _spec=spec, _opset=opset):
            n = len(_spec.inputs)
            attrs = {a.name: v for a, v in zip(_spec.attributes, args[n:])}
            return getattr(_opset, _spec.name)(
                *args[:n], **attrs, plugin_namespace=_spec.plugin_namespace, plugin_version=_spec.plugin_version)

        table[torch_op(spec.name)] = translate
    return table


def attach_functions(model) -> list[CustomOpSpec]:
    """Finish an exported ``onnx_ir.Model`` that uses custom ops; returns the ops it uses.

    Appends each op's reference function (attaching after export, rather than handing the
    exporter an onnxscript function, is what keeps each node whole: the exporter inlines any
    function it is given), declares the ``graphkiln`` opset, and types the custom nodes'
    outputs, which the exporter leaves untyped because custom schemas have no type inference.
    """
    import onnx_ir as ir

    opset = model.opset_imports.get("", None) or model.opset_imports.get("ai.onnx")
    used: dict[str, CustomOpSpec] = {}
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain != DOMAIN:
            continue
        spec = specs().get(node.op_type)
        if spec is None:
            raise ValueError(f"node {node.name} uses unknown custom op {node.op_type}")
        used[spec.name] = spec
        for out, src in zip(node.outputs, spec.output_dtypes_from):
            if out.dtype is None:
                out.dtype = node.inputs[spec.inputs.index(src)].dtype
    for spec in used.values():
        if (spec.domain, spec.name, "") not in model.functions:
            fn = ir.serde.deserialize_function(op_modules()[spec.name].onnx_function(opset))
            model.functions[fn.identifier()] = fn
    if used:
        model.opset_imports.setdefault(DOMAIN, max(s.version for s in used.values()))
    return list(used.values())
