"""Trace one graph spec (the decoder) of a loaded model into an ONNX file.

The graph contract is documented in ``graphkiln.models.decoder``; this module adds the
names, symbolic shapes and roles that the manifest records for it. The file is written by
``graphkiln.export.external_data`` (same bytes as the exporter's own save, several times faster).
"""

from __future__ import annotations

import contextlib
import io
import re
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import torch
from torch.export import Dim

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, TensorSpec
from graphkiln.models.config import DecoderConfig
from graphkiln.models.decoder import DecoderForExport

# The IR version each opset first appeared with; pinned because newer onnx writes IR
# versions that deployed onnxruntime builds (e.g. onnxruntime-gpu 1.31: IR <= 13) refuse.
IR_FOR_OPSET = {18: 8, 19: 9, 20: 9, 21: 10, 22: 10, 23: 11}
SUPPORTED_OPSETS = tuple(IR_FOR_OPSET)
NP_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def last_hidden_state_spec(hidden: int, dtype: str) -> TensorSpec:
    """The ``--return-hidden-states`` output: final-norm hidden states at the logits_index positions."""
    return TensorSpec("last_hidden_state", dtype, ("batch", "n_logits", hidden), "last_hidden_state")


def decoder_io(cfg: DecoderConfig, dtype: str, hidden_states: bool = False,
               logits: bool = True) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Names, dtypes, symbolic shapes and roles of the decoder graph (see models.decoder);
    ``hidden_states``: the graph also returns ``last_hidden_state`` right after the logits;
    ``logits`` False (an embedding graph, export --task embed): ``last_hidden_state`` instead of them."""
    ins = [
        TensorSpec("input_ids", "int64", ("batch", "seq"), "input_ids"),
        TensorSpec("position_ids", "int64", ("batch", "seq"), "position_ids"),
        TensorSpec("logits_index", "int64", ("batch", "n_logits"), "logits_index"),
    ]
    if cfg.vision_seam:
        ins += [TensorSpec("vision_embeddings", dtype, ("vision_rows", cfg.hidden_size), "vision_embeddings"),
                TensorSpec("vision_scatter_indices", "int64", ("vision_rows",), "vision_scatter_indices")]
    if cfg.mrope_section:
        ins.append(TensorSpec("rope_position_ids", "int64", (3, "batch", "seq"), "rope_position_ids"))
    if cfg.image_lookahead:
        ins.append(TensorSpec("lookahead", "int64", ("batch", "seq"), "lookahead"))
    if cfg.has_slot_states:
        ins += [TensorSpec("seq_lens", "int64", ("batch",), "seq_lens"),
                TensorSpec("slot_idx", "int64", ("batch",), "slot_idx")]
    if cfg.lora is not None:
        ins += LORA_ROUTING
    outs = [TensorSpec("logits", "float32", ("batch", "n_logits", cfg.vocab_size), "logits")] if logits else []
    if hidden_states or not logits:
        outs.append(last_hidden_state_spec(cfg.hidden_size, dtype))
    kv, d = cfg.num_kv_heads, cfg.head_dim
    for i, layer in enumerate(cfg.layers):
        if layer.mixer == "attention":
            for part in ("key", "value"):
                ins.append(TensorSpec(f"past_{part}.{i}", dtype, ("batch", kv, "cache_len", d), f"past_{part}", i))
                outs.append(TensorSpec(f"new_{part}.{i}", dtype, ("batch", kv, "seq", d), f"new_{part}", i))
        else:
            for state in cfg.slot_states(i):
                role = f"{state.kind}_state"
                ins.append(TensorSpec(f"{role}.{i}", dtype, ("slots", *state.shape), role, i))
                outs.append(TensorSpec(f"new_{role}.{i}", dtype, ("batch", *state.shape), f"new_{role}", i))
    ins += lora_stack_specs(cfg, range(cfg.num_layers))
    return ins, outs


# which batch rows use an adapter, and each one's slot (manifest.LoraSpec)
LORA_ROUTING = [TensorSpec("lora_rows", "int64", ("lora_rows",), "lora_rows"),
                TensorSpec("lora_slots", "int64", ("lora_rows",), "lora_slots")]


def lora_stack_specs(cfg: DecoderConfig, layers) -> list[TensorSpec]:
    """The LoRA stack inputs of ``layers`` (manifest.LoraSpec), in the order the forward takes them:
    per layer, per targeted projection, A [slots, in, rank] then B [slots, rank, out], float32."""
    if cfg.lora is None:
        return []
    slots, rank, specs = cfg.lora.max_loras + 1, cfg.lora.rank, []
    for i in layers:
        for module, n_in, n_out in cfg.lora_targets(i):
            specs += [TensorSpec(f"lora_a.{module}.{i}", "float32", (slots, n_in, rank), "lora_a", i, module),
                      TensorSpec(f"lora_b.{module}.{i}", "float32", (slots, rank, n_out), "lora_b", i, module)]
    return specs


@dataclass(frozen=True)
class TracedDecoder:
    """What ``export_decoder`` made: the graph's spec, the custom ops it uses, and which layers
    were traced (the others stamped from them; all of them when stamping was refused)."""

    graph: GraphSpec
    custom_ops: list
    traced_layers: tuple[int, ...]
    stamp_refused: str | None = None


def export_decoder(model: DecoderForExport, out_dir: Path, opset: int, file_name: str = "decoder.onnx",
                   stamp: bool = True, defer_weights: bool = False, progress: bool = False) -> TracedDecoder:
    """Trace the decoder (one layer per kind, stamped; see ``layer_stamping``), attach custom-op
    functions, save. A streamed decoder (``models.weights.load_decoder(streamed=True)``) has its
    other layers, embedding and head read from the checkpoint as the data file is written, or
    with ``defer_weights`` declared deferred for the lowering to make (``external_data.defer``)."""
    from graphkiln.export.custom_ops import registry as custom_ops
    from graphkiln.export.external_data import save_model
    from graphkiln.export.layer_stamping import StampRefused, stamp_layers, template_layers, template_model

    if opset not in IR_FOR_OPSET:
        raise GraphkilnError(f"--opset {opset} is not supported: choose one of {', '.join(map(str, SUPPORTED_OPSETS))}")
    cfg = model.cfg
    ins, outs = decoder_io(cfg, NP_DTYPE[model.lm_head.weight.dtype], model.return_hidden_states,
                          model.return_logits)
    reps = template_layers(cfg) if stamp else tuple(range(cfg.num_layers))
    refused = None
    if len(reps) < cfg.num_layers:
        program = _trace(template_model(model, reps), opset)
        try:
            stamp_layers(program.model, model, reps, ins, outs)
        except StampRefused as exc:
            refused, reps = str(exc), tuple(range(cfg.num_layers))
            del program
    if len(reps) == cfg.num_layers:
        if getattr(model, "weights", None) is not None:  # streamed: tracing every layer needs them all
            model = materialized(model)
        program = _trace(model, opset)
    if getattr(model, "weights", None) is not None:
        bind_streamed_tables(program.model, model)
        stream_template_layers(program.model, model, reps)
    else:
        name_head_weight(program.model, model)
    used = custom_ops.attach_functions(program.model)
    program.model.ir_version = IR_FOR_OPSET[opset]
    program.model.producer_name = "graphkiln"
    save_model(program.model, out_dir / file_name, defer_streamed=defer_weights,
               progress="writing weights" if progress else None)
    del program
    return TracedDecoder(GraphSpec("decoder", file_name, tuple(ins), tuple(outs), opset), used, reps, refused)


def materialized(model: DecoderForExport) -> DecoderForExport:
    """A streamed decoder with every parameter read (the trace-every-layer fallback, which needs
    them all: this one path holds the whole model; refused first when it does not fit)."""
    from graphkiln.export.preflight import check_whole_model

    check_whole_model(model)
    weights = model.weights
    for i, layer in enumerate(model.model.layers):
        if any(p.is_meta for p in layer.parameters()):
            model.model.layers[i] = weights.layer(i)
            weights.release()
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        setattr(owner, attr, torch.nn.Parameter(weights.read(name), requires_grad=False))
    if model.cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.weights = None
    weights.close()
    return model


def bind_streamed_tables(ir_model, model) -> None:
    """Give a streamed decoder's traced graph the checkpoint's embedding and head.

    They were traced as uninitialised placeholders (``models.weights.PLACEHOLDER_PARAMS``): the
    embedding initializer keeps its name, and an untied head is the exporter's folded transpose of
    the placeholder (a view of its memory, ``val_38``), named ``lm_head.weight.T`` here as
    ``name_head_weight`` names it. Both become ``StreamedWeight``s. Any other initializer of a
    table's size means the exporter computed something from a placeholder's (garbage) values:
    refused rather than written."""
    from graphkiln.export.streamed_weights import is_streamed, streamed_weight

    graph = ir_model.graph
    weights = model.weights
    emb = model.model.embed_tokens.weight
    head = model.lm_head.weight
    tied = head is emb
    tables = {"model.embed_tokens.weight": emb} | ({} if tied else {"lm_head.weight": head})
    views = {name: t.detach().view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.detach().numpy()
             for name, t in tables.items()}
    own_names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or is_streamed(tensor) or tensor.size not in {t.numel() for t in tables.values()}:
            continue
        try:
            arr = tensor.numpy()
        except Exception:
            arr = None
        source = next((n for n, v in views.items() if arr is not None and np.may_share_memory(arr, v)), None)
        if source is None:
            if name in own_names or name.startswith("model.layers."):
                continue  # a parameter or buffer of its own that happens to be as large as a table
            raise GraphkilnError(f"the exporter computed initializer {name} from the placeholder embedding or head "
                                 "of a streamed export: report this with the checkpoint's config.json")
        shape = tuple(tensor.shape)
        own = tuple(tables[source].shape)
        transform = None if shape == own else "T"
        if transform == "T" and shape != own[::-1]:
            raise GraphkilnError(f"initializer {name} is a {shape} view of {source} {own}: report this with the "
                                 "checkpoint's config.json")
        # a table keeps the name the exporter gave it, but for an untied head's transpose, which is
        # named as name_head_weight names it (a tied stage's copy of the head stays anonymous, as before)
        new_name = "lm_head.weight.T" if transform == "T" and source == "lm_head.weight" else name
        if new_name != name:
            graph.initializers.pop(name)
            value.name = new_name
            graph.register_initializer(value)
        value.const_value = streamed_weight(weights, source, transform, shape, new_name)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        value = graph.initializers.get(name)
        if value is not None and not is_streamed(value.const_value):
            raise GraphkilnError(f"initializer {name} of a streamed export is not read from the checkpoint: report "
                                 "this with the checkpoint's config.json")


def stream_template_layers(ir_model, model, reps: tuple[int, ...]) -> None:
    """The traced layers' named weights (``model.layers.<r>.<parameter>``, ``.T`` when stored
    transposed) as ``StreamedWeight``s too, like every stamped layer's: nothing of the template is
    written from memory, so a deferred (quantized) export writes no float weight of any layer."""
    from graphkiln.export.streamed_weights import is_streamed, streamed_weight

    weights = model.weights
    for name, value in list(ir_model.graph.initializers.items()):
        tensor = value.const_value
        m = re.match(r"^model\.layers\.(\d+)\.(.+?)(\.T)?$", name)
        if tensor is None or is_streamed(tensor) or m is None or int(m.group(1)) not in reps:
            continue
        try:
            param = model.model.layers[int(m.group(1))].get_parameter(m.group(2))
        except AttributeError:
            continue
        transform = "T" if m.group(3) else None
        expected = tuple(param.shape)[::-1] if transform else tuple(param.shape)
        if tuple(tensor.shape) != expected:
            continue
        value.const_value = streamed_weight(weights, f"model.layers.{m.group(1)}.{m.group(2)}", transform,
                                            tuple(tensor.shape), name)


def name_head_weight(ir_model, model) -> None:
    """Name an untied head's pre-transposed weight ``lm_head.weight.T``, as layer weights are named.

    The exporter folds ``lm_head.weight``'s transpose into an anonymous constant (``val_38``); the
    quantizer finds a weight's calibration statistics and a checkpoint's own blocks by the
    ``<parameter>.T`` name, so without this the head (the largest Linear) would get neither. A
    tied head is read through a Transpose of the embedding table, which keeps its name.
    """
    head = model.lm_head.weight
    if head is model.model.embed_tokens.weight or head.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        return
    graph = ir_model.graph
    if "lm_head.weight.T" in graph.initializers:
        return
    want = tuple(head.shape[::-1])
    for name, value in list(graph.initializers.items()):
        tensor = value.const_value
        if tensor is None or tuple(tensor.shape) != want or name.startswith(("model.", "lm_head.")):
            continue
        arr = tensor.numpy()
        if arr.dtype.itemsize != head.element_size():
            continue
        raw = head.detach().contiguous().view(torch.uint8).numpy()  # bytes: bf16 has no numpy type
        if np.array_equal(np.ascontiguousarray(arr.T).view(np.uint8).reshape(raw.shape), raw):
            graph.initializers.pop(name)
            value.name = "lm_head.weight.T"
            graph.register_initializer(value)
            return


def _trace(model: DecoderForExport, opset: int):
    """torch.onnx.export of the decoder with the graph contract's names and dynamic axes."""
    from graphkiln.export.custom_ops import registry as custom_ops

    cfg = model.cfg
    dtype = model.lm_head.weight.dtype
    ins, outs = decoder_io(cfg, NP_DTYPE[dtype], model.return_hidden_states,
                          model.return_logits)

    # Example sizes avoid 0 and 1 so torch.export does not specialise the dynamic axes.
    b, s, c, n, slots = 2, 3, 5, 2, 4
    batch, seq, cache, n_logits, slot_dim = Dim("batch"), Dim("seq"), Dim("cache_len"), Dim("n_logits"), Dim("slots")
    args: list = [torch.zeros(b, s, dtype=torch.long), torch.arange(s).expand(b, s).contiguous(), torch.zeros(b, n, dtype=torch.long)]
    dynamic: list = [{0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch, 1: n_logits}]
    states, state_dims = [], []  # forward(*rest): one pytree entry holding everything after logits_index
    if cfg.vision_seam:
        rows = 3  # out-of-range index included: the skip is traced too
        states += [torch.zeros(rows, cfg.hidden_size, dtype=dtype), torch.tensor([0, b * s + 1, 2], dtype=torch.long)]
        vision_rows = Dim("vision_rows")
        state_dims += [{0: vision_rows}, {0: vision_rows}]
    if cfg.mrope_section:
        states.append(torch.arange(s).expand(3, b, s).contiguous())
        state_dims.append({1: batch, 2: seq})
    if cfg.image_lookahead:
        states.append(torch.zeros(b, s, dtype=torch.long))
        state_dims.append({0: batch, 1: seq})
    if cfg.has_slot_states:
        states += [torch.full((b,), s, dtype=torch.long), torch.arange(b, dtype=torch.long)]
        state_dims += [{0: batch}, {0: batch}]
    if cfg.lora is not None:  # both rows use an adapter (two rows: the dimension stays symbolic)
        lora_rows = Dim("lora_rows")
        states += [torch.arange(b, dtype=torch.long), torch.arange(1, b + 1, dtype=torch.long)]
        state_dims += [{0: lora_rows}, {0: lora_rows}]
    for i, layer in enumerate(cfg.layers):
        if layer.mixer == "attention":
            states += [torch.zeros(b, cfg.num_kv_heads, c, cfg.head_dim, dtype=dtype) for _ in range(2)]
            state_dims += [{0: batch, 2: cache}, {0: batch, 2: cache}]
        else:
            for state in cfg.slot_states(i):
                states.append(torch.zeros(slots, *state.shape, dtype=dtype))
                state_dims.append({0: slot_dim})
    for t in lora_stack_specs(cfg, range(cfg.num_layers)):
        states.append(torch.zeros(t.shape, dtype=torch.float32))
        state_dims.append({})
    args += states
    dynamic.append(tuple(state_dims))

    # The exporter logs a warning per torchvision op it cannot register; irrelevant here.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model,
                tuple(args),
                dynamo=True,
                input_names=[t.name for t in ins],
                output_names=[t.name for t in outs],
                dynamic_shapes=tuple(dynamic),
                opset_version=opset,
                external_data=True,
                optimize=True,
                custom_translation_table=custom_ops.translation_table(),
            )
    except Exception as exc:
        raise GraphkilnError(
            f"ONNX export failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): "
            "report this with the checkpoint's config.json"
        ) from exc
    return program


NEXT_TOKEN = TensorSpec("next_token", "int64", ("batch", "n_logits"), "next_token")


def add_next_token(out_dir: Path, graph: GraphSpec) -> GraphSpec:
    """Fold the greedy sampler into the graph: a trailing output ``next_token`` int64
    [batch, n_logits], the argmax of each logits row (the first maximum, as numpy's argmax),
    or -1 where the row has a NaN, or its maximum is +Inf or -Inf (no usable distribution:
    the runtime then raises the same error as when it checks the logits itself). A runtime
    whose rows are all greedy without log-probabilities fetches only this output, so no
    logits cross into Python. Rewrites ``out_dir / graph.file`` (nodes and outputs only; the
    data file is not touched) and returns its spec."""
    import onnx
    from onnx import TensorProto, helper

    logits = next((t.name for t in graph.outputs if t.role == "logits"), None)
    if logits is None or any(t.role == NEXT_TOKEN.role for t in graph.outputs):
        return graph  # a graph without logits (a pipeline stage before the last), or already folded
    path = out_dir / graph.file
    model = onnx.load(str(path), load_external_data=False)
    g = model.graph
    p = "next_token."  # node and value names of this tail
    axes = helper.make_tensor(p + "axes", TensorProto.INT64, [1], [-1])
    g.initializer.append(axes)
    nodes = [
        helper.make_node("ArgMax", [logits], [p + "argmax"], name=p + "argmax", axis=-1, keepdims=0, select_last_index=0),
        helper.make_node("ReduceMax", [logits, p + "axes"], [p + "max"], name=p + "max", keepdims=0),
        helper.make_node("IsInf", [p + "max"], [p + "max_inf"], name=p + "max_inf"),
        helper.make_node("IsNaN", [logits], [p + "nan"], name=p + "nan"),
        helper.make_node("Cast", [p + "nan"], [p + "nan_f"], name=p + "nan_f", to=TensorProto.FLOAT),
        helper.make_node("ReduceMax", [p + "nan_f", p + "axes"], [p + "any_nan_f"], name=p + "any_nan_f", keepdims=0),
        helper.make_node("Cast", [p + "any_nan_f"], [p + "any_nan"], name=p + "any_nan", to=TensorProto.BOOL),
        helper.make_node("Or", [p + "max_inf", p + "any_nan"], [p + "bad"], name=p + "bad"),
        helper.make_node("Constant", [], [p + "minus_one"], name=p + "minus_one",
                         value=helper.make_tensor(p + "minus_one_value", TensorProto.INT64, [], [-1])),
        helper.make_node("Where", [p + "bad", p + "minus_one", p + "argmax"], [NEXT_TOKEN.name], name=p + "where"),
    ]
    g.node.extend(nodes)
    g.output.append(helper.make_tensor_value_info(NEXT_TOKEN.name, TensorProto.INT64, list(NEXT_TOKEN.shape)))
    onnx.save(model, str(path))
    import dataclasses

    return dataclasses.replace(graph, outputs=(*graph.outputs, NEXT_TOKEN))
