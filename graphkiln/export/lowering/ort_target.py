"""The onnxruntime target: every rewrite that turns a traced graph into the one onnxruntime runs.

``lower_for_onnxruntime`` chains the passes (attention, the recurrences, the fusions, weight-only
quantization, MoE) over one saved graph, in place on disk; the export's per-target loop
(``export.graph_exporters``) calls it as it calls ``trt_target.lower_for_tensorrt``.
"""

from __future__ import annotations

import time
from pathlib import Path


def release_exporter_references() -> None:
    """Let the torch weights go once the ONNX file is written.

    onnxscript's graph rewrite rules (run by the exporter's optimizer) are module-level
    objects whose pattern matchers keep the last graph they looked at, and through its
    initializers every torch weight: after an export the whole checkpoint stays in memory
    (onnxscript 0.7.2: 1.44 GB RSS for the 0.98 GB benchmark model before this, 0.49 GB
    after). Resetting the matchers' state frees it before the lowering reads weights again.
    Best effort: these are private attributes, and nothing happens if they change.
    """
    import gc

    try:
        from onnxscript.rewriter import _basics, _matcher
    except ImportError:
        return
    kinds, todo = set(), [_matcher.PatternMatcher]
    while todo:  # the matcher classes (exact types: no isinstance on arbitrary objects)
        cls = todo.pop()
        kinds.add(cls)
        todo.extend(cls.__subclasses__())
    for obj in gc.get_objects():
        if type(obj) in kinds:
            for attr, fresh in (("_graph", None), ("_current_node", None), ("_match", _basics.MatchResult)):
                if hasattr(obj, attr):
                    setattr(obj, attr, fresh() if fresh else None)
    gc.collect()


def lower_for_onnxruntime(out_dir: Path, graph, used_ops, quant: str | None = None, quant_block_size: int = 32,
                          quant_symmetric: bool = True, say=lambda msg: None, shared_data: bool = False,
                          quant_method: str = "rtn", quant_inputs=None, progress=None, expert_quant: str | None = None):
    """Rewrite the saved graph for onnxruntime, in place on disk: Attention ->
    com.microsoft.GroupQueryAttention (KV cache written in place), GatedDeltaRule and SsmScan ->
    com.microsoft.LinearAttention, Linear weights -> int4/int8 com.microsoft.MatMulNBits when
    ``quant`` is set, then MoE -> com.microsoft.MoE.

    The graph is loaded once without its weights; the MoE pass loads the expert gate_up
    tensors it interleaves, the quantizer reads each weight it quantizes from the data file,
    and a new data file is streamed from the old one (``rewrite_external_data``) when
    weights changed. With ``shared_data`` (other graphs read the same data file) that file is
    left as it is and the changed tensors go to a data file of their own.
    """
    import dataclasses

    import onnx
    import numpy as np

    from graphkiln.ops.spec import DOMAIN
    from graphkiln.export.external_data import has_deferred, read_initializer, rewrite_external_data
    from graphkiln.export.lowering.ort_attention import lower_attention_for_onnxruntime
    from graphkiln.export.lowering.ort_fusions import fuse_skip_rmsnorm, pack_gqa_qkv
    from graphkiln.export.lowering.ort_gated_delta import lower_gated_delta_for_onnxruntime
    from graphkiln.export.lowering.ort_moe import lower_moe_for_onnxruntime
    from graphkiln.export.lowering.ort_ssm_scan import lower_ssm_scan_for_onnxruntime
    from graphkiln.export.lowering.quantize import QUANT_BITS, quantize_linear_weights

    path = out_dir / graph.file
    model = onnx.load(str(path), load_external_data=False)
    moe_nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "MoE"]
    has_moe = bool(moe_nodes)
    if has_moe:  # the MoE pass checks the biases (small): load just those; gate_up is interleaved as it is written
        wanted = {n.input[i] for n in moe_nodes for i in (4, 5, 6) if len(n.input) > i}
        for tensor in model.graph.initializer:
            if tensor.name in wanted and tensor.data_location == onnx.TensorProto.EXTERNAL:
                arr = read_initializer(tensor, out_dir)
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
                tensor.raw_data = np.ascontiguousarray(arr).tobytes()
    graph, attention = lower_attention_for_onnxruntime(model, graph)
    recurrences = lower_gated_delta_for_onnxruntime(model)
    scans = lower_ssm_scan_for_onnxruntime(model)  # faster than the function (its module docstring)
    packed = pack_gqa_qkv(model)
    skip_norms = fuse_skip_rmsnorm(model)
    say(f"      {attention} attention -> GroupQueryAttention ({packed} with packed q/k/v), "
        f"{skip_norms} residual Add+RMSNorm -> SkipSimplifiedLayerNormalization"
        + (f", {recurrences} gated delta rule -> LinearAttention" if recurrences else "")
        + (f", {scans} Mamba-2 scan -> LinearAttention" if scans else ""))
    quantized = 0
    if quant:  # before the MoE lowering: the router layers are found from graphkiln.MoE nodes
        t0 = time.perf_counter()
        stats = quantize_linear_weights(model, QUANT_BITS[quant], quant_block_size, base_dir=out_dir,
                                        symmetric=quant_symmetric, method=quant_method,
                                        provided=quant_inputs.provided if quant_inputs else None,
                                        importance=quant_inputs.importance if quant_inputs else None)
        quantized = stats.nodes
        scheme = "symmetric" if quant_symmetric else "asymmetric"
        say(f"      quantizing {stats.summary()} ({quant}, {scheme}, block {quant_block_size}, {quant_method}) "
            "as the data file is written")
    rewritten = (lower_moe_for_onnxruntime(model, base_dir=out_dir, expert_bits=QUANT_BITS.get(expert_quant or quant or ""))
                 if has_moe else 0)  # MXFP4 experts: QMoE blocks of --expert-quant
    if rewritten or quantized or has_deferred(model):  # weights changed: a new data file, streamed from the old one
        t0 = time.perf_counter()
        rewrite_external_data(model, path, extra_data_name=f"{path.name}.onnxruntime.data" if shared_data else None,
                              progress=None if not progress else "quantizing weights" if quantized else "writing weights")
        say(f"      wrote {path.name}'s weights in {time.perf_counter() - t0:.1f}s")
    elif attention or skip_norms or recurrences or scans:  # only nodes changed: the initializers still point into the same data file
        onnx.save(model, str(path))
    left = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    del model
    remaining = [op for op in used_ops if op.name in left]  # the custom ops no pass lowered
    return dataclasses.replace(graph, target="onnxruntime"), remaining
