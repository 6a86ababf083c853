"""The traced graph lowered once per requested target: what the decoder and stage exporters share.

Below both ``export.graph_exporters`` and ``export.stages`` (each exports a graph and lowers it
here), so neither imports the other.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

# the graph written first (in place over the traced one, as decoder.onnx): the CPU runtime's
# favourite when present; every other target's graph is decoder.<target>.onnx
PRIMARY_ORDER = ("onnxruntime", "portable", "tensorrt")

# Targets whose graphs also emit the folded greedy sampler's ``next_token`` (onnx_export.add_next_token).
# Not tensorrt: its runners bind every output to a device buffer they know (runtime.backends.device_state).
NEXT_TOKEN_TARGETS = ("portable", "onnxruntime")


def lower_for_targets(out_dir: Path, traced, used_ops, targets: tuple[str, ...], opts, say=lambda msg: None,
                      next_token: bool = True, quant_inputs=None):
    """Lower the traced graph (``out_dir / traced.file``, weights in its data file) once per
    target; returns the graph specs (primary first, see ``PRIMARY_ORDER``) and the custom ops
    any of them uses. ``next_token`` False: a graph without logits (a pipeline stage before the
    last) gets no greedy tail.

    Every graph reads the traced data file where its weights are the traced ones: the other
    targets' graphs are copies of the traced proto (a few MB at most; the weights stay in the
    one data file), lowered before the primary is lowered in place. Only tensors a lowering
    changes (onnxruntime's interleaved MoE experts) get a data file of their own, so a
    multi-target MoE artifact carries the experts' gate/up weights twice. ``quant_inputs``
    (``lowering.quantize.QuantInputs``): the checkpoint's own blocks and the calibration pass's
    importance, for the quantizer.
    """
    primary = next(t for t in PRIMARY_ORDER if t in targets)
    others = [t for t in PRIMARY_ORDER if t in targets and t != primary]
    graphs, ops = [], {}
    for target in others + [primary]:
        graph = traced
        if target != primary:
            graph = dataclasses.replace(traced, file=f"{Path(traced.file).stem}.{target}.onnx")
            shutil.copyfile(out_dir / traced.file, out_dir / graph.file)
        t0 = time.perf_counter()
        graph_ops = used_ops
        if target == "onnxruntime":
            from graphkiln.export.lowering.ort_target import lower_for_onnxruntime, release_exporter_references

            release_exporter_references()
            graph, graph_ops = lower_for_onnxruntime(out_dir, graph, used_ops, opts.quant, opts.quant_block_size,
                                                     opts.quant_symmetric, say=say, shared_data=len(targets) > 1,
                                                     quant_method=opts.quant_method, quant_inputs=quant_inputs,
                                                     expert_quant=getattr(opts, "expert_quant", None),
                                                     progress=bool(getattr(opts, "progress", False)))
            say(f"      lowered for onnxruntime in {time.perf_counter() - t0:.1f}s")
        elif target == "tensorrt":
            from graphkiln.export.lowering.trt_target import lower_for_tensorrt

            graph, rewritten = lower_for_tensorrt(out_dir, graph)
            say(f"      {rewritten} custom nodes -> TensorRT plugins (aot=1, state written in place)"
                + (f" in {graph.file}" if len(targets) > 1 else ""))
        from graphkiln.export.lowering.lora_guard import guard_lora_updates

        guarded = guard_lora_updates(out_dir, graph)  # after the target's passes: nothing rewrites what the branches read
        if guarded:
            say(f"      {guarded} LoRA updates behind If (skipped in steps without adapter rows)"
                + (f" in {graph.file}" if len(targets) > 1 else ""))
        if next_token and target in NEXT_TOKEN_TARGETS:
            from graphkiln.export.onnx_export import add_next_token

            graph = add_next_token(out_dir, graph)
        graphs.append(graph)
        ops.update({(o.domain, o.name, o.version): o for o in graph_ops})
    return (graphs[-1], *graphs[:-1]), [o for o in used_ops if (o.domain, o.name, o.version) in ops]
