"""Pipeline stages: one decoder graph per contiguous slice of layers (issue 15).

Planning (which layers each stage runs, checked before anything is written) is
``export.stage_plan``'s; here, each stage's torch module, its graph's inputs and outputs, its
trace and its export.

Graph contract of stage k over layers [start, end) (see ``models.decoder`` for the rest):
  first stage:   input_ids [batch, seq] (and the vision seam inputs of a VLM)
  later stages:  hidden_states [batch, seq, hidden] (the model dtype)
  every stage:   position_ids, the layout inputs its attention layers read (rope_position_ids,
                 lookahead), seq_lens/slot_idx when it has conv layers, and the state inputs
                 and outputs of its own layers only (names keep the global layer index)
  last stage:    logits_index -> logits (+ the target's next_token), after the final norm/head,
                 and with --return-hidden-states last_hidden_state, as the single graph's
  other stages:  -> hidden_states_out (role hidden_states) [batch, seq, hidden], every position
                 (the next stage needs them all to fill its own caches)
Each stage's graph is traced from a module holding only its layers' parameters, so its
external-data file holds only the weights it reads; with tied embeddings the last stage
writes its own copy of the head (``StageSpec.tied_head``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, StateSpec, TensorSpec

HIDDEN_STATES = "hidden_states"
HIDDEN_STATES_OUT = "hidden_states_out"  # the output's name (role hidden_states)
# -- the stage's torch module --------------------------------------------------------------------


def _module_class():
    from torch import nn

    from graphkiln.models.decoder import DecoderForExport, embed, head, layer_stacks, scatter_vision_rows

    class StageForExport(nn.Module):
        """Layers [start, end) of a ``DecoderForExport``, sharing its parameters (no copies in
        memory) but holding no others: what torch.export lifts is exactly the stage's weights.
        The forward is the stage contract in this module's docstring."""

        def __init__(self, decoder: DecoderForExport, start: int, end: int, first: bool, last: bool) -> None:
            super().__init__()
            self.cfg, self.start, self.end, self.first, self.last = decoder.cfg, start, end, first, last
            self.model = nn.Module()
            if first:
                self.model.embed_tokens = decoder.model.embed_tokens
            # keys are the global layer indices: initializer names say which layer a weight is
            self.model.layers = nn.ModuleDict({str(i): decoder.model.layers[i] for i in range(start, end)})
            if last:
                self.model.norm = decoder.model.norm
                self.lm_head = decoder.lm_head
            # the single graph's --return-hidden-states output, from the stage that has the final norm
            self.return_hidden_states = last and decoder.return_hidden_states
            self.specs = [decoder.cfg.layers[i] for i in range(start, end)]
            self.has_attention = any(s.mixer == "attention" for s in self.specs)
            self.has_conv = any(decoder.cfg.slot_states(i) for i in range(start, end))
            self.has_lora = any(decoder.cfg.lora_targets(i) for i in range(start, end))
            self.rope_flavors = sorted({s.rope for s in self.specs if s.mixer == "attention"})
            for name in self.rope_flavors:
                cos, sin = decoder.rope_tables(name)
                self.register_buffer(f"rope_cos_{name}", cos, persistent=False)
                self.register_buffer(f"rope_sin_{name}", sin, persistent=False)
                if decoder.cfg.partial_rotary:
                    for part, table in zip(("cos", "sin"), decoder.identity_tables(name)):
                        self.register_buffer(f"rope_identity_{part}_{name}", table, persistent=False)

        def rope_tables(self, flavor: str):
            return getattr(self, f"rope_cos_{flavor}"), getattr(self, f"rope_sin_{flavor}")

        def identity_tables(self, flavor: str):
            return getattr(self, f"rope_identity_cos_{flavor}"), getattr(self, f"rope_identity_sin_{flavor}")

        def forward(self, first_input, position_ids, *rest):
            cfg = self.cfg
            if self.last:
                logits_index, rest = rest[0], rest[1:]
            if self.first:
                x = embed(cfg, self.model.embed_tokens, first_input)
                if cfg.vision_seam:
                    x = scatter_vision_rows(x, rest[0], rest[1])
                    rest = rest[2:]
            else:
                x = first_input
            rope_position_ids = lookahead = None
            if self.has_attention and cfg.mrope_section:
                rope_position_ids, rest = rest[0], rest[1:]
            if self.has_attention and cfg.image_lookahead:
                lookahead, rest = rest[0], rest[1:]
            seq_lens = slot_idx = None
            if self.has_conv:
                seq_lens, slot_idx, rest = rest[0], rest[1], rest[2:]
            routing = None
            if self.has_lora:
                routing, rest = (rest[0], rest[1]), rest[2:]
            n_states = sum(cfg.state_arity(i) for i in range(self.start, self.end))
            stacks = layer_stacks(cfg, range(self.start, self.end), rest[n_states:])
            # the decoder's own rope helper (M-RoPE included), over this module's tables
            rope = {name: DecoderForExport._rope(self, name, rope_position_ids) for name in self.rope_flavors}
            new_states, off = [], 0
            for i, layer in zip(range(self.start, self.end), self.model.layers.values()):
                arity = cfg.state_arity(i)
                lora = (*routing, stacks[i]) if stacks[i] else None
                x, new = layer(x, rope, position_ids, rest[off: off + arity], slot_idx, seq_lens, lookahead, lora)
                off += arity
                new_states += new
            if not self.last:
                return (x, *new_states)
            logits, hidden = head(cfg, self.model.norm, self.lm_head, x, logits_index)
            if self.return_hidden_states:  # as DecoderForExport.forward: right after the logits
                return (logits, hidden, *new_states)
            return (logits, *new_states)

    return StageForExport


def stage_io(cfg, start: int, end: int, first: bool, last: bool, dtype: str,
             hidden_states: bool = False) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The stage graph's inputs and outputs (the stage contract in the module docstring), in the
    order the stage module's forward takes and returns them; ``hidden_states``: the last stage
    also returns ``last_hidden_state`` (export --return-hidden-states)."""
    from graphkiln.export.onnx_export import decoder_io

    full_ins, full_outs = decoder_io(cfg, dtype, hidden_states and last)
    specs = cfg.layers[start:end]
    has_attention = any(s.mixer == "attention" for s in specs)
    has_conv = any(cfg.slot_states(i) for i in range(start, end))
    hidden = TensorSpec(HIDDEN_STATES, dtype, ("batch", "seq", cfg.hidden_size), HIDDEN_STATES)
    ins = [full_ins[0] if first else hidden, full_ins[1]]
    if last:
        ins.append(full_ins[2])
    wanted = set()
    if first:
        wanted |= {"vision_embeddings", "vision_scatter_indices"}
    if has_attention:
        wanted |= {"rope_position_ids", "lookahead"}
    if has_conv:
        wanted |= {"seq_lens", "slot_idx"}
    if any(cfg.lora_targets(i) for i in range(start, end)):  # a stage without targets has no use for it
        wanted |= {"lora_rows", "lora_slots"}
    ins += [t for t in full_ins[3:] if t.layer is None and t.role in wanted]
    ins += [t for t in full_ins if t.layer is not None and start <= t.layer < end]
    # an ONNX graph defines each name once: a middle stage takes and returns hidden states
    outs = [full_outs[0] if last else TensorSpec(HIDDEN_STATES_OUT, dtype, hidden.shape, HIDDEN_STATES)]
    outs += [t for t in full_outs if t.role == "last_hidden_state"]
    outs += [t for t in full_outs if t.layer is not None and start <= t.layer < end]
    return ins, outs


def _trace_stage(module, cfg, ins: list[TensorSpec], outs: list[TensorSpec], opset: int):
    """torch.onnx.export of one stage with the contract's names and dynamic axes (the example
    sizes avoid 0 and 1, as ``onnx_export._trace``)."""
    import torch
    from torch.export import Dim

    from graphkiln.export.custom_ops import registry as custom_ops

    dtype = next(module.parameters()).dtype
    b, s, c, n, slots, rows = 2, 3, 5, 2, 4, 3
    dims = {"batch": Dim("batch"), "seq": Dim("seq"), "cache_len": Dim("cache_len"), "n_logits": Dim("n_logits"),
            "slots": Dim("slots"), "vision_rows": Dim("vision_rows"), "lora_rows": Dim("lora_rows")}
    example = {"batch": b, "seq": s, "cache_len": c, "n_logits": n, "slots": slots, "vision_rows": rows, "lora_rows": b}
    args, dynamic = [], []
    for t in ins:
        shape = tuple(example[d] if isinstance(d, str) else d for d in t.shape)
        if t.role == "position_ids":
            value = torch.arange(s).expand(b, s).contiguous()
        elif t.role == "rope_position_ids":
            value = torch.arange(s).expand(3, b, s).contiguous()
        elif t.role == "seq_lens":
            value = torch.full((b,), s, dtype=torch.long)
        elif t.role == "slot_idx":
            value = torch.arange(b, dtype=torch.long)
        elif t.role == "vision_scatter_indices":
            value = torch.tensor([0, b * s + 1, 2], dtype=torch.long)  # the out-of-range skip is traced too
        elif t.role == "lora_rows":  # both rows use an adapter
            value = torch.arange(b, dtype=torch.long)
        elif t.role == "lora_slots":
            value = torch.arange(1, b + 1, dtype=torch.long)
        elif t.dtype == "int64":
            value = torch.zeros(shape, dtype=torch.long)
        elif t.role in ("lora_a", "lora_b"):  # float32 whatever the model dtype
            value = torch.zeros(shape, dtype=torch.float32)
        else:
            value = torch.zeros(shape, dtype=dtype)
        args.append(value)
        dynamic.append({i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str) and d in dims})
    # forward(first, position_ids, *rest): everything after position_ids is one pytree entry
    dynamic_shapes = (dynamic[0], dynamic[1], tuple(dynamic[2:]))
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    log = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(log), torch.no_grad():
            warnings.simplefilter("ignore")
            return torch.onnx.export(module, tuple(args), dynamo=True, input_names=[t.name for t in ins],
                                     output_names=[t.name for t in outs], dynamic_shapes=dynamic_shapes,
                                     opset_version=opset, external_data=True, optimize=True,
                                     custom_translation_table=custom_ops.translation_table())
    except Exception as exc:
        raise GraphkilnError(f"ONNX export of a pipeline stage failed ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0][:200]}): report this with the checkpoint's config.json") from exc


def stage_states(states: tuple[StateSpec, ...], start: int, end: int) -> tuple[StateSpec, ...]:
    """The model's states restricted to layers [start, end): what the stage's pools hold."""
    import dataclasses

    out = []
    for s in states:
        layers = tuple(i for i in s.layers if start <= i < end)
        if layers:
            out.append(dataclasses.replace(s, layers=layers))
    return tuple(out)


def export_stage(decoder, plan, out_dir: Path, targets: tuple[str, ...], opts, say=lambda msg: None,
                 quant_inputs=None, planned_bytes: int | None = None) -> tuple[tuple[GraphSpec, ...], list, bool]:
    """Trace, save and lower the graph of one stage (``models.graphs.GraphPlan`` of kind "stage":
    ``stage{k}.onnx`` + ``stage{k}.onnx.data``); returns its graph in every target, the custom ops
    they use, and whether it wrote its own copy of a tied head.

    The stage graph is lowered for every target by ``lowering.targets.lower_for_targets``, as the
    single graph is (same passes, opset and IR version): with several targets the other targets'
    graphs are copies of the stage's traced proto (``stage{k}.<target>.onnx``) reading its data
    file, lowered before the primary one is lowered in place (a MoE stage's onnxruntime graph adds
    ``stage{k}.onnx.onnxruntime.data``). A stage record names one graph, ``stage{k}``, of which the
    manifest holds one per target; its files are every target's."""
    from graphkiln.export.custom_ops import registry as custom_ops
    from graphkiln.export.external_data import save_model
    from graphkiln.export.lowering.targets import lower_for_targets
    from graphkiln.export.onnx_export import IR_FOR_OPSET, NP_DTYPE

    t0 = time.perf_counter()
    cfg = decoder.cfg
    dtype = NP_DTYPE[decoder.lm_head.weight.dtype]
    tied = decoder.lm_head.weight is decoder.model.embed_tokens.weight or (
        decoder.lm_head.weight.data_ptr() == decoder.model.embed_tokens.weight.data_ptr())
    (start, end), first, last = plan.layers, plan.first, plan.last
    weights = getattr(decoder, "weights", None)
    streamed = {}  # a streamed decoder's layers of this stage, read for its trace and dropped after
    if weights is not None:
        for i in range(start, end):
            if any(p.is_meta for p in decoder.model.layers[i].parameters()):
                streamed[i] = decoder.model.layers[i]
                decoder.model.layers[i] = weights.build_layer(i)
    try:
        module = _module_class()(decoder, start, end, first, last).eval()
        ins, outs = stage_io(cfg, start, end, first, last, dtype, decoder.return_hidden_states)
        program = _trace_stage(module, cfg, ins, outs, opts.opset)
    finally:
        for i, meta in streamed.items():
            decoder.model.layers[i] = meta
    if weights is not None:
        from graphkiln.export.onnx_export import bind_streamed_tables

        bind_streamed_tables(program.model, decoder)
    used = custom_ops.attach_functions(program.model)
    program.model.ir_version = IR_FOR_OPSET[opts.opset]
    program.model.producer_name = "graphkiln"
    file = f"{plan.name}.onnx"
    save_model(program.model, out_dir / file)
    del program, module
    traced = GraphSpec(plan.name, file, tuple(ins), tuple(outs), opts.opset)
    graphs, used = lower_for_targets(out_dir, traced, used, targets, opts, say=say, next_token=last,
                                     quant_inputs=quant_inputs)
    # "stage1." is no prefix of stage10's files: every target's graph and data files, no other stage's
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.name.startswith(plan.name + "."))
    planned = "" if planned_bytes is None else f" (planned weights {planned_bytes / 2**20:.2f} MiB)"
    say(f"      stage {plan.index}: layers {start}:{end}, {size / 2**20:.2f} MiB{planned} in "
        f"{time.perf_counter() - t0:.1f}s")
    return graphs, used, last and tied
