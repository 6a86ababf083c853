"""Export as one loop over the graphs a family declares (``models.graphs``), one exporter per kind.

``export_graph_specs(plans, ctx)`` runs each plan's exporter in order: "decoder" (the whole
decoder), "stage" (one pipeline stage's slice of layers), "vision" (the vision encoder). An
exporter traces its graph, lowers it for every requested target (``lowering.targets.lower_for_targets``), writes it
under ``ctx.out_dir`` and returns what the manifest records of it (``ExportedGraph``); the loop
gathers the graphs, custom ops and stage records, knowing from the directory which files each
graph wrote. It also owns the torch decoder's lifetime: the decoder is dropped as soon as no later
graph reads it, before the last reader's lowering loads weights again.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.export.external_data import NonFiniteWeight
from graphkiln.export.lowering.targets import lower_for_targets
from graphkiln.manifest import GraphSpec, StageSpec, StateSpec
from graphkiln.models.graphs import GraphPlan

@dataclass
class ExportContext:
    """What every exporter reads. ``decoder``: the loaded torch decoder, until the loop drops it
    (``release_decoder``); ``stage_plan``: the pipeline-stage plan when the graphs are stages."""

    src: Path
    family: object
    cfg: object
    vcfg: object | None
    decoder: object | None
    out_dir: Path
    targets: tuple[str, ...]
    opts: object  # export.pipeline.ExportOptions
    quant_inputs: object | None
    state_dtype: str  # the model dtype as numpy names it
    say: Callable[[str], None]
    stage_plan: object | None = None
    _last_reader: bool = False

    def release_decoder(self) -> None:
        """Drop the decoder if the current graph is its last reader (a no-op otherwise)."""
        if self._last_reader:
            self.decoder = None

    def non_finite(self, exc: NonFiniteWeight) -> GraphkilnError:
        return non_finite_error(exc, self.src, self.family, self.cfg, self.opts.dtype, self.decoder)


@dataclass(frozen=True)
class ExportedGraph:
    """One plan's output: its graph in every target (primary first), the custom ops they use, a
    batched-step graph beside a decoder, the vision record, and whether a stage wrote its own copy
    of a tied head."""

    graphs: tuple[GraphSpec, ...]
    custom_ops: tuple = ()
    batched: tuple = ()
    vision: object | None = None
    tied_head: bool = False


@dataclass(frozen=True)
class ExportedGraphs:
    """Everything the loop wrote, for the manifest: graphs in plan order, the custom ops any of them
    uses, batched-step graphs, the vision record, and per stage (graph name, layer range, the files
    its process needs, tied-head copy)."""

    graphs: tuple[GraphSpec, ...]
    custom_ops: tuple
    batched: tuple
    vision: object | None
    stages: tuple[tuple, ...]

    def stage_specs(self, states: tuple[StateSpec, ...]) -> tuple[StageSpec, ...]:
        """The manifest's stage records, each owning the model's states restricted to its layers."""
        from graphkiln.export.stages import stage_states

        return tuple(StageSpec(name, layers, files, stage_states(states, *layers), tied_head=tied)
                     for name, layers, files, tied in self.stages)


def export_graph_specs(plans: tuple[GraphPlan, ...], ctx: ExportContext) -> ExportedGraphs:
    """Export every plan in order (see the module docstring)."""
    last_reader = max((i for i, p in enumerate(plans) if p.needs_decoder), default=-1)
    if last_reader < 0:
        ctx.decoder = None
    graphs, ops, batched, vision, files = [], {}, [], None, {}
    for i, plan in enumerate(plans):
        before = {p.name for p in ctx.out_dir.iterdir()}
        ctx._last_reader = i == last_reader
        done = EXPORTERS[plan.kind](plan, ctx)
        ctx.release_decoder()
        files[i] = tuple(sorted({p.name for p in ctx.out_dir.iterdir()} - before))
        graphs += done.graphs
        ops.update({(o.domain, o.name, o.version): o for o in done.custom_ops})
        batched += done.batched
        vision = done.vision or vision
        if plan.kind == "stage":
            files[i] = (files[i], done.tied_head)
    stages = {plan.index: [plan.name, plan.layers, set(files[i][0]), files[i][1]]
              for i, plan in enumerate(plans) if plan.kind == "stage"}
    for i, plan in enumerate(plans):
        if plan.owner_stage is not None:  # a graph the stage's process runs: its files travel with the stage
            stages[plan.owner_stage][2].update(files[i])
    return ExportedGraphs(tuple(graphs), tuple(ops.values()), tuple(batched), vision,
                          tuple((name, layers, tuple(sorted(own)), tied)
                                for _, (name, layers, own, tied) in sorted(stages.items())))


# -- the exporters ----------------------------------------------------------------------------------


def _export_decoder(plan: GraphPlan, ctx: ExportContext) -> ExportedGraph:
    from graphkiln.export.onnx_export import export_decoder

    cfg, t1 = ctx.cfg, time.perf_counter()
    # a quantized single-target export rewrites the data file anyway: the weights are made there,
    # once, quantized on the way (external_data.defer), never written in full precision first
    # (an MXFP4 checkpoint's experts too: models.mxfp4, made as QMoE blocks there)
    defer = bool(ctx.opts.quant or getattr(ctx.opts, "expert_quant", None)) and ctx.targets == ("onnxruntime",)
    try:
        traced = export_decoder(ctx.decoder, ctx.out_dir, ctx.opts.opset, defer_weights=defer,
                                progress=bool(ctx.opts.progress))
    except NonFiniteWeight as exc:
        raise ctx.non_finite(exc) from None
    ctx.release_decoder()  # before the lowering, which loads (some of) the weights again
    if traced.stamp_refused:
        ctx.say(f"      (could not stamp layers from a template: {traced.stamp_refused}; traced them all)")
    n_traced = len(traced.traced_layers)
    how = "" if n_traced == cfg.num_layers else f" ({n_traced} of {cfg.num_layers} layers traced, the rest stamped)"
    ctx.say(f"      traced in {time.perf_counter() - t1:.1f}s{how}")
    try:  # a streamed export's deferred weights are read (and checked) as the lowering writes them
        graphs, used = lower_for_targets(ctx.out_dir, traced.graph, traced.custom_ops, ctx.targets, ctx.opts,
                                         say=ctx.say, quant_inputs=ctx.quant_inputs)
    except NonFiniteWeight as exc:
        raise ctx.non_finite(exc) from None
    return ExportedGraph(graphs, tuple(used), batched=_batched_graphs(ctx, graphs))


def _export_stage(plan: GraphPlan, ctx: ExportContext) -> ExportedGraph:
    from graphkiln.export.stages import export_stage

    graphs, used, tied = export_stage(ctx.decoder, plan, ctx.out_dir, ctx.targets, ctx.opts, say=ctx.say,
                                      quant_inputs=ctx.quant_inputs,
                                      planned_bytes=ctx.stage_plan.planned_bytes[plan.index])
    return ExportedGraph(graphs, tuple(used), tied_head=tied)


def _export_vision(plan: GraphPlan, ctx: ExportContext) -> ExportedGraph:
    """The vision graph spec, traced from the checkpoint's vision tower (no per-target lowering:
    every target runs it as traced)."""
    from graphkiln.export.vision_export import export_vision
    from graphkiln.manifest import VisionSpec

    t0, vcfg, opts = time.perf_counter(), ctx.vcfg, ctx.opts
    module = ctx.family.vision.build(ctx.src, vcfg, opts.dtype)
    try:
        graph = export_vision(module, vcfg, ctx.cfg.hidden_size, ctx.state_dtype, ctx.out_dir, opts.opset)
    except NonFiniteWeight as exc:
        raise GraphkilnError(f"vision weight '{exc.initializer}' has NaN or infinite values (or overflows --dtype "
                             f"{opts.dtype}): re-download the checkpoint, or export with --dtype fp32") from None
    del module
    ctx.say(f"      vision graph traced in {time.perf_counter() - t0:.1f}s ({graph.file})")
    return ExportedGraph((graph,), vision=VisionSpec(vcfg.image_token_id, vcfg.preprocessing, vcfg.placeholder,
                                                     positions=vcfg.positions))


EXPORTERS: dict[str, Callable[[GraphPlan, ExportContext], ExportedGraph]] = {
    "decoder": _export_decoder, "stage": _export_stage, "vision": _export_vision}


# -- shared by the decoder and stage exporters ------------------------------------------------------


def _batched_graphs(ctx: ExportContext, graphs) -> tuple:
    """A quantized fp32 artifact's batched-step graph (``lowering.batched_int8``) beside its
    onnxruntime decoder graph; () for the others."""
    opts = ctx.opts
    if not opts.quant or opts.dtype != "fp32":
        return ()
    from graphkiln.export.lowering.batched_int8 import write_batched_graph

    t0 = time.perf_counter()
    decoder = next((g for g in graphs if g.name == "decoder" and g.target == "onnxruntime"), None)
    importance = ctx.quant_inputs.importance if ctx.quant_inputs else None
    spec = write_batched_graph(ctx.out_dir, decoder, importance) if decoder else None
    if spec is None:
        return ()
    ctx.say(f"      batched-step int8 graph: {len(spec.weights)} weights in {time.perf_counter() - t0:.1f}s")
    return (spec,)


def non_finite_error(exc: NonFiniteWeight, src: Path, family, cfg, dtype: str, decoder) -> GraphkilnError:
    """The checkpoint tensor behind a non-finite initializer, as one error line. The ONNX name is
    usually the torch parameter's (``.T``: stored transposed); the checkpoint tensors are read
    again, one at a time, to name the one the user can find (q_proj, not the fused qkv_proj)."""
    from graphkiln.models.weights import find_non_finite

    # the tensors a lowering makes from a weight carry its name: <weight>.q4 / .scales / .ort_interleaved
    param = re.sub(r"(\.T)?(\.(q4|q8|scales|zero_points|ort_interleaved|ort_doubled)(_\d+)?)?$", "", exc.initializer)
    params = dict(decoder.named_parameters()) if decoder is not None else {}
    found = find_non_finite(src, family, cfg, dtype, hint=param if param in params else None)
    if found is None:  # not a checkpoint weight: something computed at export
        return GraphkilnError(f"exported tensor '{exc.initializer}' has NaN or infinite values although the "
                              "checkpoint's weights are finite: report this with the checkpoint's config.json")
    name, by_conversion, kind = found
    if by_conversion:
        return GraphkilnError(f"checkpoint weight '{name}' has values too large for --dtype {dtype} (they become "
                              "infinite): export with --dtype fp32 or bf16")
    return GraphkilnError(f"checkpoint weight '{name}' has {kind} values: the checkpoint is corrupt or was "
                          "saved from a diverged run; re-download it or export another checkpoint")
