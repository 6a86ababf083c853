"""Trace one layer of each kind and stamp copies of it for the others.

Tracing costs about a second per layer (torch.export, then the exporter's decomposition
re-trace), while every layer with the same ``LayerSpec`` lowers to the same subgraph up to
names and weights (a ``DecoderLayer`` is built from the config and its spec alone). So the
exporter traces a *template*: the decoder with only the first layer of each spec
(``template_layers``); ``stamp_layers`` then rebuilds the full graph from it, the way
onnxruntime-genai's builder emits one layer's nodes N times.

The template graph is split into three parts by dataflow, not by trust in node names:
  - *invariant* nodes: no input depends on a layer's weights or state (shape arithmetic,
    the embedding, rope gathers, constants). Computed once, before the layers.
  - *layer k* nodes: depend on template layer k (its parameters, its state inputs, or its
    residual input); the exporter's module scope says which layer, and nodes it created
    without one (the optimizer's Split, say) inherit their producers' layer.
  - *epilogue* nodes: outside every layer scope, fed by the last layer (norm, lm_head).
Each layer has exactly one residual input (invariant for the first, the previous layer's
residual output otherwise) and one residual output; its parameters are either initializers
named by the parameter or anonymous constants the exporter folded from exactly one of them
(a transposed Linear weight, a reshaped conv kernel), found by comparing bytes. Real layer i
is a copy of its template's nodes with the residual, state inputs/outputs and weights of
layer i swapped in.

Anything that does not fit this shape raises ``StampRefused`` and the caller traces every
layer instead; the result is the same graph either way, only slower to make.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import re

import numpy as np
import torch
from torch import nn

from graphkiln.manifest import TensorSpec

# The exporter records the module path of every node it translates; a layer's nodes carry
# its ``model.layers.<k>`` scope.
_SCOPES = "pkg.torch.onnx.name_scopes"
_LAYER_SCOPE = re.compile(r"'model\.layers\.(\d+)'")
_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Above onnx_ir's DeduplicateInitializersPass size limit (1024 elements) with room to spare.
_MERGE_LIMIT = 8192


class StampRefused(Exception):
    """The template graph does not have the shape stamping relies on (the reason says how)."""


def template_layers(cfg) -> tuple[int, ...]:
    """The first layer of each distinct ``LayerSpec``, ascending: the layers that get traced."""
    first: dict = {}
    for i, spec in enumerate(cfg.layers):
        first.setdefault(spec, i)
    return tuple(sorted(first.values()))


def _shallow(module: nn.Module) -> nn.Module:
    """A copy sharing parameters and submodules, whose own module table can be changed."""
    twin = copy.copy(module)
    twin._modules = dict(module._modules)
    twin._parameters = dict(module._parameters)
    twin._buffers = dict(module._buffers)
    return twin


def template_model(decoder, reps: tuple[int, ...]):
    """The decoder restricted to layers ``reps`` (in that order), sharing all weights."""
    cfg = decoder.cfg
    tpl = _shallow(decoder)
    tpl.cfg = dataclasses.replace(cfg, num_layers=len(reps), layers=tuple(cfg.layers[r] for r in reps))
    body = _shallow(decoder.model)
    body.layers = nn.ModuleList(decoder.model.layers[r] for r in reps)
    tpl.model = body
    return tpl


def _numpy_view(t: torch.Tensor) -> np.ndarray:
    """The tensor's memory as numpy, without a copy (bfloat16 through ml_dtypes)."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


@dataclasses.dataclass
class _Layer:
    nodes: list  # template nodes, graph order
    residual_in: object = None
    residual_out: object = None
    states_in: list = dataclasses.field(default_factory=list)  # template graph inputs, in order
    states_out: list = dataclasses.field(default_factory=list)  # template graph outputs, in order


def stamp_layers(model, decoder, reps: tuple[int, ...], ins: list[TensorSpec], outs: list[TensorSpec]) -> None:
    """Rewrite ``model`` (the exported template, an ``onnx_ir.Model``) in place into the full
    decoder graph whose inputs/outputs are ``ins``/``outs``; raises StampRefused, leaving the
    model unusable, when the template does not fit (see the module docstring)."""
    import onnx_ir as ir

    graph = model.graph
    cfg = decoder.cfg
    spec_of = {cfg.layers[r]: k for k, r in enumerate(reps)}
    layers_t = [decoder.model.layers[r] for r in reps]
    for i, layer in enumerate(decoder.model.layers):
        k = spec_of[cfg.layers[i]]
        mine = [(n, tuple(p.shape)) for n, p in layer.named_parameters()]
        if mine != [(n, tuple(p.shape)) for n, p in layers_t[k].named_parameters()]:
            raise StampRefused(f"layer {i} has other parameters than layer {reps[k]} of the same kind")
    _undo_deduplication(ir, graph, decoder, reps)

    # Template inputs/outputs of each template layer, by the names the template was traced with.
    t_ins = {v.name: v for v in graph.inputs}
    t_outs = {v.name: v for v in graph.outputs}
    layers = [_Layer([]) for _ in reps]
    state_owner: dict = {}  # template state input value -> template layer
    for k in range(len(reps)):
        for t in ins:
            if t.layer == reps[k]:
                v = t_ins[_of_layer(t.name, k)]
                layers[k].states_in.append(v)
                state_owner[v] = k
        layers[k].states_out = [t_outs[_of_layer(t.name, k)] for t in outs if t.layer == reps[k]]

    # Per-layer initializers: named parameters and anonymous constants folded from one.
    params_t = [dict(layer.named_parameters()) for layer in layers_t]
    named = {n for n, _ in decoder.named_parameters()} | {n for n, _ in decoder.named_buffers()}
    weight_of: dict = {}  # initializer value -> (template layer, parameter name, transform)
    opaque: set = set()  # anonymous constants that only a layer-independent part may read
    for v in graph.initializers.values():
        m = _LAYER_PARAM.match(v.name or "")
        if m:
            k = int(m.group(1))
            if k >= len(reps) or m.group(2) not in params_t[k]:
                raise StampRefused(f"initializer {v.name} is not a template layer's parameter")
            weight_of[v] = (k, m.group(2), None)
        elif v.name not in named:
            found = _match_folded(v, params_t)
            if found == "opaque":
                opaque.add(v)
            elif found is not None:
                weight_of[v] = found

    # The residual stream starts at the embedding; seed it as layer 0's so that the nodes of
    # the first layer that read only it are not mistaken for layer-independent ones.
    embeds = [n for n in graph if n.op_type == "Gather" and "model.embed_tokens" in n.metadata_props.get(_SCOPES, "")]
    if len(embeds) != 1:
        raise StampRefused(f"{len(embeds)} embedding lookups")
    embedding = embeds[0].outputs[0]

    # Classify nodes: layer-independent (-1), layer k, or epilogue (len(reps)).
    epilogue = len(reps)
    where: dict = {}  # node -> part
    variant: dict = {v: k for v, k in state_owner.items()}  # value -> the part whose data it carries
    variant[embedding] = 0
    # The prologue: unscoped-to-a-layer nodes between the embedding and the first layer (a
    # vision-language decoder's seam, models.decoder.scatter_vision_rows). Computed once, like
    # the invariant part; their result, not the embedding, is the first layer's residual input.
    prologue = {embedding}
    for node in graph:
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for a in node.attributes.values()):
            raise StampRefused(f"node {node.name} has a subgraph")
        shape_only = node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx")
        deps = set()
        for v in node.inputs:
            if v in weight_of:
                deps.add(weight_of[v][0])
            elif v in variant and not (shape_only and (v in state_owner or v in prologue)):
                deps.add(variant[v])  # shapes of states and of the embedding are the same for every layer
        if not deps:
            where[node] = -1
            continue
        scope = node.metadata_props.get(_SCOPES)
        m = _LAYER_SCOPE.search(scope) if scope is not None else None
        if m is None and scope is not None and all(v in prologue for v in node.inputs if v in variant) \
                and not any(v in weight_of for v in node.inputs):
            where[node] = -1
            for o in node.outputs:
                variant[o] = 0
                prologue.add(o)
            continue
        if m is not None:
            part = int(m.group(1))
        elif scope is None:  # made by the optimizer: belongs with what it reads
            part = max(deps)
        else:
            part = epilogue
        if part >= len(reps) and part != epilogue:
            raise StampRefused(f"node {node.name} is scoped to layer {part}, past the template")
        if part != epilogue and any(v in opaque for v in node.inputs):
            raise StampRefused(f"node {node.name} reads a constant folded from several weights")
        where[node] = part
        for o in node.outputs:
            variant[o] = part
        if part < len(reps):
            layers[part].nodes.append(node)

    # Residual edges: the one value each layer reads from the layer before (the embedding for
    # the first) and the one it passes on.
    epi_nodes = [n for n in graph if where[n] == epilogue]
    for k, layer in enumerate(layers):
        read = {v for n in layer.nodes for v in n.inputs}
        entering = {v for v in read if v in variant and variant[v] != k and v not in state_owner}
        if k == 0:  # the prologue's result (the embedding, or the seam's) is seeded as layer 0's
            starts = {v for v in read if v in prologue}
            entering = starts if len(starts) == 1 and not entering else entering | starts | {None}
        if len(entering) != 1 or (k > 0 and variant[next(iter(entering))] != k - 1):
            raise StampRefused(f"template layer {k} reads {len(entering)} values from outside it")
        layer.residual_in = next(iter(entering))
        if any(v in state_owner and state_owner[v] != k for n in layer.nodes for v in n.inputs):
            raise StampRefused(f"template layer {k} reads another layer's state")
        if any(v.producer() not in set(layer.nodes) for v in layer.states_out):
            raise StampRefused(f"template layer {k}'s state outputs come from elsewhere")
    for k, layer in enumerate(layers):
        inside = set(layer.nodes)
        leaving = {o for n in layer.nodes for o in n.outputs
                   if any(u.node not in inside for u in o.uses()) and o not in layer.states_out}
        if len(leaving) != 1:
            raise StampRefused(f"template layer {k} passes {len(leaving)} values on")
        out = next(iter(leaving))
        if out.producer().metadata_props.get(_SCOPES) is None:
            raise StampRefused(f"template layer {k}'s output comes from an unscoped node")
        consumers = {u.node for u in out.uses()} - inside
        expected = set(layers[k + 1].nodes) if k + 1 < len(layers) else set(epi_nodes)
        if not consumers <= expected or (k + 1 < len(layers) and layers[k + 1].residual_in is not out):
            raise StampRefused(f"template layer {k}'s output does not feed the next layer")
        layer.residual_out = out
        if any(o.is_graph_output() for n in layer.nodes for o in n.outputs if o not in layer.states_out):
            raise StampRefused(f"template layer {k} produces a graph output that is not its state")
    last = layers[-1].residual_out
    if any(variant.get(v, -1) not in (-1, epilogue) and v is not last for n in epi_nodes for v in n.inputs):
        raise StampRefused("the epilogue reads a layer value other than the last residual")

    # Rebuild: layer-independent nodes stay; the layers and the epilogue are replaced by
    # copies, made before the originals are removed (removal detaches their inputs).
    old_nodes = [n for n in graph if where[n] != -1]
    old_outputs = list(graph.outputs)
    for v in weight_of:  # frees the template's names (model.layers.<k>) for the real layers
        graph.initializers.pop(v.name, None)
    # Rep layer r keeps its template inputs' objects (layer-independent Shape nodes may read
    # them), renamed to r's names; the other layers get fresh inputs of the same type and shape.
    state_inputs: dict[str, object] = {}
    for k, layer in enumerate(layers):
        for v in layer.states_in:
            v.name = _of_layer(v.name, reps[k])
            state_inputs[v.name] = v
    by_name = {v.name: v for v in graph.inputs if v not in state_owner}
    new_inputs = []
    for spec in ins:
        v = by_name.get(spec.name) if spec.layer is None else state_inputs.get(spec.name)
        if v is None and spec.layer is not None:
            k = spec_of[cfg.layers[spec.layer]]
            tv = next(t for t in layers[k].states_in if _of_layer(t.name, spec.layer) == spec.name)
            v = ir.Value(name=spec.name, type=tv.type, shape=tv.shape.copy() if tv.shape is not None else None)
        if v is None:
            raise StampRefused(f"the template has no input {spec.name}")
        new_inputs.append(v)
    inputs_by_name = {v.name: v for v in new_inputs}

    copies: list = []
    outputs_by_name: dict[str, object] = {}
    current = layers[0].residual_in
    for i, module in enumerate(decoder.model.layers):
        k = spec_of[cfg.layers[i]]
        layer = layers[k]
        vmap: dict = {layer.residual_in: current}
        for v in layer.states_in:
            vmap[v] = inputs_by_name[_of_layer(v.name, i)]
        for v, (wk, pname, transform) in weight_of.items():
            if wk == k:
                vmap[v] = _weight_value(ir, graph, module, i, pname, transform, getattr(decoder, "weights", None))
        state_out_names = {v: _of_layer(v.name, i) for v in layer.states_out}
        copies += [_copy_node(ir, node, vmap, f"layers.{i}.", state_out_names) for node in layer.nodes]
        for v, name in state_out_names.items():
            outputs_by_name[name] = vmap[v]
        current = vmap[layer.residual_out]
    vmap = {layers[-1].residual_out: current}
    copies += [_copy_node(ir, node, vmap, "", {o: o.name for o in node.outputs}) for node in epi_nodes]
    for o in old_outputs:
        if o in vmap:
            outputs_by_name[o.name] = vmap[o]

    graph.outputs.clear()
    graph.remove(old_nodes, safe=True)
    graph.inputs.clear()
    graph.inputs.extend(new_inputs)
    graph.extend(copies)
    graph.outputs.extend(outputs_by_name[t.name] for t in outs)

    seen: set = set()
    for v in [*graph.inputs, *graph.initializers.values(), *(o for n in graph for o in n.outputs)]:
        if v.name in seen:
            raise StampRefused(f"two values are named {v.name}")
        seen.add(v.name)


def _undo_deduplication(ir, graph, decoder, reps: tuple[int, ...]) -> None:
    """Give each reader of a merged initializer the parameter its module owns.

    The exporter's optimizer merges byte-equal small initializers, so a template layer whose
    two norms happen to be equal (untrained checkpoints: all ones) reads one name for both;
    stamped as is, every layer would get that one parameter's tensor. Each reader's module
    scope names the parameter it meant; a reader whose scope does not settle it refuses."""
    params: dict[str, torch.Tensor] = {}  # initializer name -> tensor, in the template's naming
    for n, p in [*decoder.named_parameters(), *decoder.named_buffers()]:
        if not n.startswith("model.layers."):
            params[n] = p
    for k, r in enumerate(reps):
        for n, p in decoder.model.layers[r].named_parameters():
            params[f"model.layers.{k}.{n}"] = p
    # The deduplication pass only merges small tensors; hash those.
    equal: dict[tuple, list[str]] = {}
    for n, p in params.items():
        if p.numel() <= _MERGE_LIMIT:
            arr = _numpy_view(p)
            equal.setdefault((str(arr.dtype), arr.shape, arr.tobytes()), []).append(n)
    aliases = {n: names for names in equal.values() if len(names) > 1 for n in names}
    for v in list(graph.initializers.values()):
        if v.name not in aliases:
            continue
        for node, index in list(v.uses()):
            scope = node.metadata_props.get(_SCOPES)
            modules = set(ast.literal_eval(scope)) if scope is not None else set()
            meant = [n for n in aliases[v.name] if n.rsplit(".", 1)[0] in modules]
            if len(meant) != 1:
                raise StampRefused(f"node {node.name} reads {v.name}, equal to {len(aliases[v.name]) - 1} other "
                                   "parameters, and its scope does not say which it meant")
            if meant[0] == v.name:
                continue
            own = graph.initializers.get(meant[0])
            if own is None:
                own = ir.Value(name=meant[0], type=v.type, shape=v.shape.copy(), const_value=v.const_value)
                graph.register_initializer(own)
            node.replace_input_with(index, own)


def _of_layer(name: str, layer: int) -> str:
    """A per-layer tensor name (``past_key.3``) with another layer index."""
    return f"{name.rsplit('.', 1)[0]}.{layer}"


def _match_folded(value, params_t: list[dict]):
    """(template layer, parameter, transform) when this anonymous initializer holds exactly one
    template parameter's bytes, transposed ("T") or reshaped ("reshape"); None when it is a
    layer-independent constant (integers, a scalar, all zeros); "opaque" otherwise (a
    constant only the layer-independent parts may read, such as the transposed lm_head)."""
    tensor = value.const_value
    if tensor.dtype.is_integer() or tensor.size <= 1:
        return None
    arr, raw = None, None
    candidates = []
    for k, params in enumerate(params_t):
        for name, p in params.items():
            if p.numel() != tensor.size or p.dtype.itemsize != tensor.dtype.itemsize:
                continue
            if arr is None:  # only now: the big anonymous constants (lm_head) match nothing
                arr = tensor.numpy()
                raw = np.ascontiguousarray(arr).tobytes()
            view = _numpy_view(p)
            if view.ndim == 2 and arr.shape == view.T.shape and np.ascontiguousarray(view.T).tobytes() == raw:
                candidates.append((k, name, "T"))
            elif view.shape != arr.shape and view.tobytes() == raw:
                candidates.append((k, name, ("reshape", tuple(arr.shape))))
    if len(candidates) == 1:
        return candidates[0]
    # all zeros, of any size: a MoE's absent expert biases are [E, 2I] and [E, H] zeros (98,304 and
    # 131,072 of them in a 64-expert Qwen3-MoE, which a bound of 4,096 made opaque and sent the
    # whole real-size model down the trace-every-layer path); a placeholder table's untouched pages
    # read as the kernel's zero page, costing no memory
    if not candidates and not tensor.numpy().any():
        return None
    return "opaque"


def _weight_value(ir, graph, module: nn.Module, i: int, pname: str, transform, weights=None):
    """Layer i's initializer for template parameter ``pname`` (transformed as the template's was)."""
    suffix = "" if transform is None else ".T" if transform == "T" else ".reshaped"
    name = f"model.layers.{i}.{pname}{suffix}"
    if name in graph.initializers:
        return graph.initializers[name]
    param = module.get_parameter(pname)
    if param.is_meta:  # a streamed decoder's layer (models.weights.load_decoder): read as it is written
        from graphkiln.export.streamed_weights import streamed_weight

        shape = tuple(param.shape)
        shape = shape[::-1] if transform == "T" else shape if transform is None else tuple(transform[1])
        tensor = streamed_weight(weights, f"model.layers.{i}.{pname}", transform, shape, name)
    else:
        arr = _numpy_view(param)
        if transform == "T":
            arr = arr.T
        elif transform is not None:
            arr = arr.reshape(transform[1])
        tensor = ir.Tensor(arr, name=name)
    value = ir.Value(name=name, type=ir.TensorType(tensor.dtype), shape=ir.Shape(tuple(tensor.shape)), const_value=tensor)
    graph.register_initializer(value)
    return value


def _copy_node(ir, node, vmap: dict, prefix: str, fixed_names: dict):
    inputs = [None if v is None else vmap.get(v, v) for v in node.inputs]
    attrs = [ir.Attr(a.name, a.type, a.value, ref_attr_name=a.ref_attr_name, doc_string=a.doc_string)
             for a in node.attributes.values()]
    new = ir.Node(node.domain, node.op_type, inputs, attrs, overload=node.overload, num_outputs=len(node.outputs),
                  version=node.version, name=f"{prefix}{node.name}" if node.name else None,
                  doc_string=node.doc_string, metadata_props=dict(node.metadata_props))
    for old, out in zip(node.outputs, new.outputs):
        out.name = fixed_names.get(old) or f"{prefix}{old.name}"
        out.type = old.type
        out.shape = old.shape.copy() if old.shape is not None else None
        vmap[old] = out
    return new
