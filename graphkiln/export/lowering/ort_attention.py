"""Lower ``graphkiln.Attention`` to onnxruntime's ``com.microsoft.GroupQueryAttention``.

GroupQueryAttention (GQA) does what the portable op's reference function does — rotary from
cos/sin tables, grouped heads, causal and sliding-window masks — in one fused CPU kernel, and
it can write the new keys and values straight into the cache: when ``present_key`` is bound to
the same buffer as ``past_key`` (onnxruntime's "past/present share buffer" mode) the node
stores its new rows at their positions and returns the whole buffer, with no copy.

The lowered graph's contract differs from the portable one (``graphkiln.models.decoder``)
only in the KV cache:
  * inputs gain ``seq_lens`` int64 [batch] (real tokens per row) if the graph lacks it: GQA
    takes each row's total length (``seqlens_k`` = start + seq_lens - 1, int32), computed
    in-graph from it and ``position_ids``;
  * inputs gain ``total_sequence_length``, an int32 scalar (role ``total_sequence_length``),
    fed straight into every GQA node: the runtime computes it on the host (the batch's
    ``max(start + seq_lens)``, ``runtime.backends.ort_cpu.total_sequence_length``). onnxruntime's CUDA
    GQA reads it in host memory, so computing it in the graph (on the device) made onnxruntime
    copy it to the host inside every step, which CUDA-graph capture refuses;
  * a graph with a sliding-window node (``window`` > 0) gains ``window_offset`` int64 [batch]
    and ``window_total_sequence_length`` int32 scalar (roles of the same names): such a node's
    cache is window-sized, row b's cache row j holding position window_offset[b] + j
    (``runtime.backends.state``, ``windowed``). Its GQA takes seqlens_k from
    ``position_ids[:, 0] - window_offset`` and the window total (a host scalar, the step's
    longest row in those terms) as its total; its window mask works on distances, which the
    shift keeps; its rotary (``do_rotary=1``) is given the absolute ``position_ids`` (input 9,
    which onnxruntime 1.32's CPU kernel uses instead of deriving positions from the lengths:
    measured, ``tests/test_sliding_kv.py``). Offsets 0 and the window total equal to the total
    address a full-length cache exactly as before (the CUDA runner does that). Full-attention
    nodes are unchanged;
  * ``new_key.i`` / ``new_value.i`` outputs become ``present_key.i`` / ``present_value.i``
    [batch, kv_heads, cache_len, head_dim], which the runtime binds to the very buffers it
    feeds as ``past_key.i`` / ``past_value.i`` (manifest state update ``"in_place"``).

Rotary: a ``rope_layout=0`` node's tables go to GQA (``do_rotary=1``, cast to the query's
type once per table). A ``rope_layout=1`` node's cos/sin are per token [B, S, D/2], computed
by the graph (M-RoPE), which GQA's rotary cannot take (it gathers tables at positions it
derives from the cache lengths): q and k are rotated in the graph by the standard
``RotaryEmbedding`` (opset 23; without position_ids it reads per-token [B, S, D/2] values,
rotate-half, in the query's type — cos/sin are cast to it once per distinct pair, shared by
every layer that shares them), then GQA runs with ``do_rotary=0``.

Attention sinks: a ``use_sinks=1`` node's ``sinks`` go to GQA's ``head_sink`` input (index 11,
cast to the query's type: exact for sinks that came from the model dtype). onnxruntime 1.32's
CPU kernel then computes, per query head h and row, m = max(scores, head_sink[h]) and
probs = exp(scores - m) / (sum(exp(scores - m)) + exp(head_sink[h] - m)) over the row's
visible (causal, windowed) keys: softmax([scores, sinks[h]]) without the sink's column, which
is the op's definition (measured against it: ``tests/test_attention_sinks.py``). A
``use_sinks=0`` node's GQA gets no ``head_sink`` — the very node this pass wrote before sinks
existed — and the constant it was passed as ``sinks``, read by nothing else, is dropped, so a
model without sinks lowers to the same graph as before.

Which nodes stay functions: GQA's mask is causal (and windowed) only, so a node whose
``lookahead`` is not a constant all-zero tensor (Gemma3's bidirectional images: the graph
input ``lookahead``) keeps its portable form, run through the op's function. Such a graph
keeps the rows contract for those layers (``new_key.i`` / ``new_value.i``); the manifest
derives each state's update from the graph's outputs, so a graph whose nodes all stay
functions runs exactly as the portable one does.

GQA's limits, which the runtime respects: a step with several new tokens per row (prefill)
starts from an empty cache for every row (start = 0) unless the batch has one row; decode
steps (one token per row) may mix rows of any lengths. Types: float32 and float16; head_dim
a multiple of 16 (a node outside these keeps its portable form).
"""

from __future__ import annotations

import dataclasses

import onnx
from onnx import TensorProto, helper

from graphkiln.ops.spec import DOMAIN
from graphkiln.manifest import GraphSpec, TensorSpec

MS_DOMAIN = "com.microsoft"
_GQA_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16)
_ROTARY_OPSET = 23  # RotaryEmbedding, which rotates a rope_layout=1 node's q and k, is a standard op from 23


def lower_attention_for_onnxruntime(model: onnx.ModelProto, graph: GraphSpec) -> tuple[GraphSpec, int]:
    """Rewrite every lowerable ``graphkiln.Attention`` node of ``model.graph`` in place.

    Returns the graph's new spec (inputs/outputs changed as the module docstring says) and the
    number of nodes rewritten; with none rewritten the model and spec are unchanged.
    """
    g = model.graph
    types = _elem_types(g)
    specs = {t.name: t for t in graph.outputs}
    head_dims = {t.name: t.shape[3] for t in graph.inputs if t.role in ("past_key", "past_value")}
    zeros = _constant_zeros(g)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    layouts = (0, 1) if opset >= _ROTARY_OPSET else (0,)
    targets = [n for n in g.node if n.domain == DOMAIN and n.op_type == "Attention"
               and types.get(n.input[3]) in _GQA_TYPES and n.input[8] in zeros and _attr(n, "rope_layout", 0) in layouts
               and all(o in specs for o in n.output[1:])
               and isinstance(head_dims.get(n.input[3]), int) and head_dims[n.input[3]] % 16 == 0]
    if not targets:
        return graph, 0

    inputs = list(graph.inputs)
    seq_lens = next((t.name for t in inputs if t.role == "seq_lens"), None)
    if seq_lens is None:
        seq_lens = "seq_lens"
        inputs.append(TensorSpec(seq_lens, "int64", ("batch",), "seq_lens"))
        g.input.append(helper.make_tensor_value_info(seq_lens, TensorProto.INT64, ["batch"]))

    total = "total_sequence_length"
    inputs.append(TensorSpec(total, "int32", (), "total_sequence_length"))
    g.input.append(helper.make_tensor_value_info(total, TensorProto.INT32, []))
    window_offset = window_total = None
    if any(_attr(n, "window", 0) > 0 for n in targets):  # sliding layers address a window-sized cache
        window_offset, window_total = "window_offset", "window_total_sequence_length"
        inputs.append(TensorSpec(window_offset, "int64", ("batch",), "window_offset"))
        g.input.append(helper.make_tensor_value_info(window_offset, TensorProto.INT64, ["batch"]))
        inputs.append(TensorSpec(window_total, "int32", (), "window_total_sequence_length"))
        g.input.append(helper.make_tensor_value_info(window_total, TensorProto.INT32, []))

    prologue: list[onnx.NodeProto] = []
    lengths: dict[tuple[str, bool], str] = {}  # (position_ids value, windowed) -> seqlens_k
    casts: dict[tuple[str, int], str] = {}  # (table or per-token cos/sin, type) -> it in the query's type
    renamed: dict[str, TensorSpec] = {}  # old output name -> new output spec
    new_nodes: list[onnx.NodeProto] = []
    lowered = {id(n) for n in targets}
    unread_sinks: set[str] = set()  # sinks of use_sinks=0 nodes: constants no GQA node reads
    for node in g.node:
        if id(node) not in lowered:
            new_nodes.append(node)
            continue
        q, k, v, past_k, past_v, pos, cos, sin, _causal, sinks = node.input
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        windowed = attrs["window"] > 0
        if (pos, windowed) not in lengths:
            lengths[pos, windowed] = _seqlens_k(prologue, pos, seq_lens, len(lengths),
                                                window_offset if windowed else None)
        seqlens_k = lengths[pos, windowed]
        elem = types[past_k]
        per_token = attrs.get("rope_layout", 0) == 1
        tables = []
        for table in (cos, sin):
            if types.get(table, TensorProto.FLOAT) != elem:
                key = (table, elem)
                if key not in casts:
                    casts[key] = f"{table}.as_{TensorProto.DataType.Name(elem).lower()}"
                    cast = helper.make_node("Cast", [table], [casts[key]], to=elem, name=casts[key])
                    # per-token values are computed by the graph: cast where first read, after
                    # their producer; tables are initializers, cast up front
                    (new_nodes if per_token else prologue).append(cast)
                table = casts[key]
            tables.append(table)
        rotary: dict = dict(do_rotary=1, rotary_interleaved=0)
        if per_token:
            base = node.name or node.output[0]
            rotated = []
            for x, heads, what in ((q, attrs["num_heads"], "q"), (k, attrs["num_kv_heads"], "k")):
                name = f"{base}.{what}_rotated"
                new_nodes.append(helper.make_node("RotaryEmbedding", [x, *tables], [name], name=name,
                                                  num_heads=heads, interleaved=0))
                rotated.append(name)
            (q, k), tables, rotary = rotated, [], dict(do_rotary=0)
        gqa_inputs = [q, k, v, past_k, past_v, seqlens_k, window_total if windowed else total, *tables]
        if windowed and tables:
            # GQA's own rotary would take positions from the window-relative lengths: it is given
            # the absolute ones (input 9, position_ids)
            gqa_inputs += [""] * (9 - len(gqa_inputs)) + [pos]
        if attrs.get("use_sinks", 0) == 1:
            if types.get(sinks, TensorProto.FLOAT) != elem:
                key = (sinks, elem)
                if key not in casts:
                    casts[key] = f"{sinks}.as_{TensorProto.DataType.Name(elem).lower()}"
                    # where first read: after the sinks' producer, if the graph computes them
                    new_nodes.append(helper.make_node("Cast", [sinks], [casts[key]], to=elem, name=casts[key]))
                sinks = casts[key]
            # head_sink is input 11: cos/sin (absent with per-token rotary), position_ids and
            # attention_bias stay empty
            gqa_inputs += [""] * (11 - len(gqa_inputs)) + [sinks]
        else:
            unread_sinks.add(sinks)
        outs = [node.output[0]]
        for old, role in zip(node.output[1:], ("present_key", "present_value")):
            spec = specs[old]
            new = TensorSpec(f"{role}.{spec.layer}", spec.dtype, ("batch", spec.shape[1], "cache_len", spec.shape[3]),
                             role, spec.layer)
            renamed[old] = new
            outs.append(new.name)
        new_nodes.append(helper.make_node(
            "GroupQueryAttention", gqa_inputs, outs,
            name=f"{node.name or outs[0]}.gqa", domain=MS_DOMAIN,
            num_heads=attrs["num_heads"], kv_num_heads=attrs["num_kv_heads"], scale=float(attrs["scale"]),
            local_window_size=attrs["window"] if attrs["window"] > 0 else -1, **rotary))

    del g.node[:]
    g.node.extend(prologue + new_nodes)
    _drop_unread_constants(g, unread_sinks)
    for out in g.output:
        if out.name in renamed:
            new = renamed[out.name]
            elem = out.type.tensor_type.elem_type  # a present buffer has its new rows' type
            out.CopyFrom(helper.make_tensor_value_info(new.name, elem, list(new.shape)))
    if not any(o.domain == MS_DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    _drop_unused_function(model, "Attention")
    outputs = tuple(renamed.get(t.name, t) for t in graph.outputs)
    return dataclasses.replace(graph, inputs=tuple(inputs), outputs=outputs), len(targets)


def _constant_zeros(g: onnx.GraphProto) -> set[str]:
    """Names of the graph's constant all-zero tensors (a causal node's ``lookahead``: GQA has no
    lookahead, so only such nodes are lowered)."""
    from onnx import numpy_helper

    found = {t.name for t in g.initializer
             if t.data_location != TensorProto.EXTERNAL and not numpy_helper.to_array(t).any()}
    for n in g.node:
        if n.op_type == "Constant" and n.domain in ("", "ai.onnx"):
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and not numpy_helper.to_array(value).any():
                found.add(n.output[0])
    return found


def _drop_unread_constants(g: onnx.GraphProto, names: set[str]) -> None:
    """Remove the initializers and Constant nodes among ``names`` that no node or graph output
    reads any more (the unused ``sinks`` of nodes lowered without a head_sink)."""
    read = {i for n in g.node for i in n.input} | {o.name for o in g.output}
    for n in g.node:  # values a subgraph reads from the outer scope
        for a in n.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                read |= {i for sn in sub.node for i in sn.input}
    gone = names - read
    if not gone:
        return
    keep_init = [t for t in g.initializer if t.name not in gone]
    del g.initializer[:]
    g.initializer.extend(keep_init)
    keep_nodes = [n for n in g.node if not (n.op_type == "Constant" and n.domain in ("", "ai.onnx")
                                            and n.output[0] in gone)]
    del g.node[:]
    g.node.extend(keep_nodes)
    keep_info = [v for v in g.value_info if v.name not in gone]
    del g.value_info[:]
    g.value_info.extend(keep_info)


def _attr(node: onnx.NodeProto, name: str, default):
    a = next((a for a in node.attribute if a.name == name), None)
    return default if a is None else helper.get_attribute_value(a)


def _seqlens_k(prologue: list, pos: str, seq_lens: str, i: int, window_offset: str | None = None) -> str:
    """Append nodes computing GQA's seqlens_k [B] (start + seq_lens - 1, int32) from position_ids;
    with ``window_offset`` (a sliding layer's window-sized cache) start is relative to the row's
    cache: position_ids[:, 0] - window_offset."""
    p = f"gqa_lengths.{i}"
    prologue += [
        helper.make_node("Constant", [], [f"{p}.zero"], value=helper.make_tensor("", TensorProto.INT64, [1], [0])),
        helper.make_node("Constant", [], [f"{p}.one"], value=helper.make_tensor("", TensorProto.INT64, [1], [1])),
        helper.make_node("Slice", [pos, f"{p}.zero", f"{p}.one", f"{p}.one"], [f"{p}.start2d"]),
        helper.make_node("Squeeze", [f"{p}.start2d", f"{p}.one"], [f"{p}.start"]),
    ]
    start = f"{p}.start"
    if window_offset is not None:
        prologue.append(helper.make_node("Sub", [start, window_offset], [f"{p}.window_start"]))
        start = f"{p}.window_start"
    prologue += [
        helper.make_node("Add", [start, seq_lens], [f"{p}.total"]),
        helper.make_node("Sub", [f"{p}.total", f"{p}.one"], [f"{p}.last"]),
        helper.make_node("Cast", [f"{p}.last"], [f"{p}.seqlens_k"], to=TensorProto.INT32),
    ]
    return f"{p}.seqlens_k"


def _elem_types(g: onnx.GraphProto) -> dict[str, int]:
    types = {v.name: v.type.tensor_type.elem_type for v in list(g.input) + list(g.value_info) + list(g.output)}
    types.update({t.name: t.data_type for t in g.initializer})
    return types


def _drop_unused_function(model: onnx.ModelProto, name: str) -> None:
    if any(n.domain == DOMAIN and n.op_type == name for n in model.graph.node):
        return
    keep = [f for f in model.functions if not (f.domain == DOMAIN and f.name == name)]
    del model.functions[:]
    model.functions.extend(keep)
    if not any(n.domain == DOMAIN for n in model.graph.node):
        keep_ops = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(keep_ops)


def full_length_windows(feeds: dict) -> dict:
    """The window inputs of a lowered graph fed by a caller that keeps full-length caches (every
    sliding layer's cache position is its token's position): offsets 0, and the window total is
    the step's ``total_sequence_length``; from ``feeds`` holding ``position_ids`` and it."""
    import numpy as np

    return {"window_offset": np.zeros(len(feeds["position_ids"]), np.int64),
            "window_total_sequence_length": np.asarray(feeds["total_sequence_length"], np.int32)}
