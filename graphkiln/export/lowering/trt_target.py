"""Lower the portable graph for TensorRT's ONNX parser (``graphkiln export --target tensorrt``).

The portable graph is already almost what the parser takes: standard ops at opset 23 (the
norms are native ``RMSNormalization``, which the parser maps to its own layer from TensorRT
10.15), nothing onnxruntime-only, and every ``graphkiln`` node carries its plugin identity
(``plugin_namespace``, ``plugin_version``; the parser imports a node with a registered
``plugin_namespace`` as that plugin before trying anything else). This pass changes only what
TensorRT needs differently:

* every ``graphkiln`` node gets ``aot=1``: the parser builds the plugin from its ahead-of-time
  Triton kernel, so the engine runs without Python (``graphkiln.plugins_trt``);
* ops with in-place state get their in-place mode (``IN_PLACE_ATTR`` of the op module:
  Attention ``kv_update=1``, ShortConv, GatedDeltaRule and SsmScan ``state_update=1``), so their state outputs are the
  whole cache / pool, which the plugin aliases to the state input and writes in place:
    - ``new_key.i`` / ``new_value.i`` [batch, kv_heads, seq, head_dim] become
      ``present_key.i`` / ``present_value.i`` [batch, kv_heads, cache_len, head_dim] (the shape
      of ``past_key.i``; manifest state update ``"in_place"``, the contract of the onnxruntime
      target's GroupQueryAttention);
    - ``new_conv_state.i`` [batch, channels, width] becomes the whole pool
      [slots, channels, width] (the shape of ``conv_state.i``; conv state update ``"in_place"``);
    - ``new_recurrent_state.i`` [batch, heads, rows, cols] becomes the whole pool
      [slots, heads, rows, cols] (the shape of ``recurrent_state.i``; recurrent state update
      ``"in_place"``).
  The runtime binds each of these outputs to the buffer it feeds as the matching input;
* inputs a plugin reads in fp32 whatever the model dtype (``FP32_INPUTS``: MoE's routing bias,
  which a model with a learned bias stores in the model dtype; Attention's cos/sin, tables or,
  with ``rope_layout=1``, per-token values the graph computes, and its sinks (fp32 by the op's
  contract: a cast only if a graph passes them otherwise); GatedDeltaRule's g and beta, the
  latter computed in the model dtype; SsmScan's A, D and dt_bias, parameters) get a Cast to fp32 where they are not fp32 already (exact: the op's reference rounds them to the activation dtype anyway,
  and so does the kernel after reading them).

Nothing else changes: the same initializers (the data file is untouched), the model-local
functions stay attached (onnxruntime runs this graph through them, in the same in-place mode;
TensorRT never reads them for a node it imports as a plugin), opset and IR version as
export pinned them. ``graphkiln.export.trt_check`` checks the result against the parser's
published operator list.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx
from onnx import helper

from graphkiln.manifest import GraphSpec, TensorSpec
from graphkiln.ops import DOMAIN, op_modules, specs

TRT_OPSET = 23  # RMSNormalization (native in the parser) is an opset-23 op; the parser reads opsets 9-24

# op -> inputs its TensorRT plugin's kernel reads as fp32 (graphkiln.plugins_trt.rules.FIXED_INPUT_DTYPES)
FP32_INPUTS = {"MoE": ("expert_bias",), "Attention": ("cos_cache", "sin_cache", "sinks"), "GatedDeltaRule": ("g", "beta"),
               "SsmScan": ("A", "D", "dt_bias")}

# state output role -> (its role in the lowered graph, its name prefix there)
_IN_PLACE_OUTPUTS = {"new_key": ("present_key", "present_key"), "new_value": ("present_value", "present_value"),
                     "new_conv_state": ("new_conv_state", "new_conv_state"),
                     "new_recurrent_state": ("new_recurrent_state", "new_recurrent_state")}


def _set_int(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            node.attribute.remove(a)
            break
    node.attribute.append(helper.make_attribute(name, value))


def lower_for_tensorrt(out_dir: Path, graph: GraphSpec) -> tuple[GraphSpec, int]:
    """Rewrite ``out_dir / graph.file`` for TensorRT in place on disk (nodes and graph outputs
    only; the data file is not touched). Returns the lowered graph's spec (target "tensorrt")
    and the number of custom nodes rewritten."""
    path = out_dir / graph.file
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    outputs = {t.name: t for t in graph.outputs}
    inputs = {t.name: t for t in graph.inputs}
    graph_inputs = {v.name: v for v in g.input}
    readers = {i for n in g.node for i in n.input}
    renamed: dict[str, tuple[TensorSpec, onnx.TypeProto]] = {}  # old output name -> (new spec, new type)
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    casts: dict[str, str] = {}  # value -> its fp32 cast
    nodes: list[onnx.NodeProto] = []
    rewritten = 0
    for node in g.node:
        nodes.append(node)
        if node.domain != DOMAIN:
            continue
        spec = specs()[node.op_type]
        _set_int(node, "aot", 1)
        rewritten += 1
        for name in FP32_INPUTS.get(spec.name, ()):
            i = spec.inputs.index(name)
            value = node.input[i]
            if types.get(value, onnx.TensorProto.FLOAT) != onnx.TensorProto.FLOAT:
                if value not in casts:
                    casts[value] = f"{value}.fp32"
                    nodes.insert(len(nodes) - 1, helper.make_node("Cast", [value], [casts[value]], name=casts[value],
                                                                  to=onnx.TensorProto.FLOAT))
                node.input[i] = casts[value]
        attr = getattr(op_modules()[spec.name], "IN_PLACE_ATTR", None)
        if attr is None:
            continue
        _set_int(node, attr, 1)
        for i, (out_name, src) in enumerate(zip(spec.outputs, spec.output_dtypes_from)):
            if src == spec.output_dtypes_from[0]:  # follows the activations (q, x, v): not a state output
                continue
            old, state_in = node.output[i], node.input[spec.inputs.index(src)]
            old_spec, in_spec = outputs.get(old), inputs.get(state_in)
            if old_spec is None or in_spec is None or old in readers or old_spec.role not in _IN_PLACE_OUTPUTS:
                # the decoder contract (models.decoder) makes every state output a graph output
                raise ValueError(f"{node.name}: state output {out_name} ({old}) is not a graph output of a state "
                                 "input: the decoder graph does not follow its contract")
            role, prefix = _IN_PLACE_OUTPUTS[old_spec.role]
            new = TensorSpec(f"{prefix}.{old_spec.layer}", old_spec.dtype, in_spec.shape, role, old_spec.layer)
            renamed[old] = (new, graph_inputs[state_in].type)
            node.output[i] = new.name
    del g.node[:]
    g.node.extend(nodes)
    for out in g.output:
        if out.name in renamed:
            new, typ = renamed[out.name]
            out.name = new.name
            out.type.CopyFrom(typ)  # the state input's type: same dtype, same (symbolic) shape
    keep = [v for v in g.value_info if v.name not in renamed]
    del g.value_info[:]
    g.value_info.extend(keep)
    onnx.save(model, str(path))
    new_outputs = tuple(renamed[t.name][0] if t.name in renamed else t for t in graph.outputs)
    return dataclasses.replace(graph, outputs=new_outputs, target="tensorrt"), rewritten
