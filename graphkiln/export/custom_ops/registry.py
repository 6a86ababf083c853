"""Derive every export face of every custom op from its definition in ``graphkiln.ops``."""

from __future__ import annotations

from functools import cache

from graphkiln.ops import DOMAIN, CustomOpSpec, op_modules, register_torch_ops, specs, torch_op


@cache
def register_onnx_schemas() -> None:
    """Register an ``onnx.defs.OpSchema`` per op so checkers and onnxscript know the node."""
    import onnx
    from onnx.defs import OpSchema

    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING}
    for spec in specs().values():
        if onnx.defs.has(spec.name, spec.domain):
            continue
        attrs = [OpSchema.Attribute(a.name, kinds[a.kind], a.doc, required=a.default is None) for a in spec.attributes]
        attrs += [OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace"),
                  OpSchema.Attribute("plugin_version", OpSchema.AttrType.STRING, "TensorRT plugin version"),
                  OpSchema.Attribute("aot", OpSchema.AttrType.INT, "TensorRT: 1 = the plugin's ahead-of-time kernel",
                                     required=False)]
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

        def translate(*args, _spec=spec, _opset=opset, **kwargs):
            n = len(_spec.inputs)
            # every attribute on the node, defaults too (the exporter passes only what the caller did)
            given = dict(zip((a.name for a in _spec.attributes), args[n:]), **kwargs)
            attrs = {a.name: given.get(a.name, a.default) for a in _spec.attributes}
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
