"""``export_model``: the whole export, from MODEL argument to a published artifact."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from graphkiln import __version__
from graphkiln.artifact import checksum_tree
from graphkiln.errors import GraphkilnError
from graphkiln.export.assets import copy_tokenizer, generation_defaults
from graphkiln.export.checkpoint import prepared_checkpoint, refuse_checkpoint_code, refuse_quantized
from graphkiln.export.external_data import NonFiniteWeight
from graphkiln.manifest import MANIFEST_NAME, TARGETS, CustomOpRef, Manifest, ModelInfo, StateSpec
from graphkiln.memory import available_memory
from graphkiln.models.registry import family_for
from graphkiln.publish import atomic_directory


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp32"
    max_seq_len: int | None = None  # default: the config's max_position_embeddings
    opset: int = 23
    # "onnxruntime" (default; the embedded CPU runtime): custom ops lowered to onnxruntime
    # contrib ops where faster. "portable": standard ONNX + graphkiln custom ops (functions
    # attached). "tensorrt": the portable graph as TensorRT's parser takes it (AOT plugins,
    # state in place). Several, comma-separated ("onnxruntime,tensorrt"): one graph per target
    # in one artifact, over one weights file (see export_graphs).
    target: str = "onnxruntime"
    overwrite: bool = False
    progress: bool = True
    # weight-only quantization of the Linear layers (com.microsoft.MatMulNBits, so
    # onnxruntime-target only): None, "int4" or "int8"; block-wise along K.
    quant: str | None = None
    quant_block_size: int = 32
    quant_symmetric: bool = True  # False: asymmetric blocks with zero points (see lowering.quantize)
    # how blocks are chosen (export.block_quant): "calibrated" (error weighted by a calibration pass's
    # activations), "search" (weight error) or "rtn" (round to nearest)
    quant_method: str = "calibrated"
    # pipeline stages (export.stages): N stages split evenly by weight bytes, or explicit
    # layer ranges "0:6,6:12"; None/None: one decoder graph
    stages: int | None = None
    stage_layers: str | None = None
    # decoder graphs (the last stage's, when staged) also return ``last_hidden_state``: the
    # final-norm hidden states at the logits positions (models.decoder); not with tensorrt
    return_hidden_states: bool = False


def _say(opts: ExportOptions, msg: str) -> None:
    if opts.progress:
        print(msg, file=sys.stderr, flush=True)


# the graph written first (in place over the traced one, as decoder.onnx): the CPU runtime's
# favourite when present; every other target's graph is decoder.<target>.onnx
PRIMARY_ORDER = ("onnxruntime", "portable", "tensorrt")


def parse_targets(text: str) -> tuple[str, ...]:
    """``--target`` as a tuple of distinct targets; one-line GraphkilnError otherwise."""
    items = [t.strip() for t in str(text).split(",")]
    for t in items:
        if t not in TARGETS:
            shown = repr(t) if t else "an empty name"
            raise GraphkilnError(f"--target {text} names {shown}, not a target: choose from {', '.join(TARGETS)} "
                                 "(several: comma-separated, e.g. onnxruntime,tensorrt)")
        if items.count(t) > 1:
            raise GraphkilnError(f"--target {text} names {t} twice: name each target once")
    return tuple(items)


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
                          quant_method: str = "rtn", quant_inputs=None):
    """Rewrite the saved graph for onnxruntime, in place on disk: Attention ->
    com.microsoft.GroupQueryAttention (KV cache written in place), Linear weights -> int4/int8
    com.microsoft.MatMulNBits when ``quant`` is set, then MoE -> com.microsoft.MoE.

    The graph is loaded once without its weights; the MoE pass loads the expert gate_up
    tensors it interleaves, the quantizer reads each weight it quantizes from the data file,
    and a new data file is streamed from the old one (``rewrite_external_data``) when
    weights changed. With ``shared_data`` (other graphs read the same data file) that file is
    left as it is and the changed tensors go to a data file of their own.
    """
    import dataclasses

    import onnx
    from onnx.external_data_helper import load_external_data_for_tensor, uses_external_data

    from graphkiln.ops.spec import DOMAIN
    from graphkiln.export.external_data import rewrite_external_data
    from graphkiln.export.lowering.ort_attention import lower_attention_for_onnxruntime
    from graphkiln.export.lowering.ort_fusions import fuse_skip_rmsnorm, pack_gqa_qkv
    from graphkiln.export.lowering.ort_gated_delta import lower_gated_delta_for_onnxruntime
    from graphkiln.export.lowering.ort_moe import lower_moe_for_onnxruntime
    from graphkiln.export.lowering.quantize import QUANT_BITS, quantize_linear_weights

    path = out_dir / graph.file
    model = onnx.load(str(path), load_external_data=False)
    moe_nodes = [n for n in model.graph.node if n.domain == DOMAIN and n.op_type == "MoE"]
    has_moe = bool(moe_nodes)
    if has_moe:  # the MoE pass rewrites gate_up and checks expert biases: load just those
        wanted = {n.input[i] for n in moe_nodes for i in (2, 4) if len(n.input) > i}
        for tensor in model.graph.initializer:
            if tensor.name in wanted and uses_external_data(tensor):
                load_external_data_for_tensor(tensor, str(out_dir))
                tensor.data_location = onnx.TensorProto.DEFAULT
                del tensor.external_data[:]
    graph, attention = lower_attention_for_onnxruntime(model, graph)
    recurrences = lower_gated_delta_for_onnxruntime(model)
    packed = pack_gqa_qkv(model)
    skip_norms = fuse_skip_rmsnorm(model)
    say(f"      {attention} attention -> GroupQueryAttention ({packed} with packed q/k/v), "
        f"{skip_norms} residual Add+RMSNorm -> SkipSimplifiedLayerNormalization"
        + (f", {recurrences} gated delta rule -> LinearAttention" if recurrences else ""))
    quantized = 0
    if quant:  # before the MoE lowering: the router layers are found from graphkiln.MoE nodes
        t0 = time.perf_counter()
        stats = quantize_linear_weights(model, QUANT_BITS[quant], quant_block_size, base_dir=out_dir,
                                        symmetric=quant_symmetric, method=quant_method,
                                        provided=quant_inputs.provided if quant_inputs else None,
                                        importance=quant_inputs.importance if quant_inputs else None)
        quantized = stats.nodes
        scheme = "symmetric" if quant_symmetric else "asymmetric"
        say(f"      quantized {stats.summary()} ({quant}, {scheme}, block {quant_block_size}, {quant_method}) "
            f"in {time.perf_counter() - t0:.1f}s")
    rewritten = lower_moe_for_onnxruntime(model) if has_moe else 0
    if rewritten or quantized:  # weights changed: a new data file, streamed from the old one
        rewrite_external_data(model, path, extra_data_name=f"{path.name}.onnxruntime.data" if shared_data else None)
    elif attention or skip_norms or recurrences:  # only nodes changed: the initializers still point into the same data file
        onnx.save(model, str(path))
    left = {n.op_type for n in model.graph.node if n.domain == DOMAIN}
    del model
    remaining = [op for op in used_ops if op.name in left]  # the custom ops no pass lowered
    return dataclasses.replace(graph, target="onnxruntime"), remaining


# Positions are int64 in the graph, but onnxruntime's attention kernels and the runtime's
# bookkeeping index them with int32.
MAX_SEQ_LEN_LIMIT = 2**31 - 1


def check_max_seq_len(max_seq_len: int, cfg, what: str = "--max-seq-len") -> None:
    """Refuse a maximum length the export cannot build: below 2, above int32 positions, or whose
    rotary tables (cos and sin, fp32 [max_seq_len, head_dim/2] per rope flavor, built in memory
    and written into the graph's data file) would not fit in the memory available now. Checked
    before anything is allocated."""
    if max_seq_len < 2:
        raise GraphkilnError(f"{what} {max_seq_len} is too small: use at least 2")
    if max_seq_len > MAX_SEQ_LEN_LIMIT:
        raise GraphkilnError(f"{what} {max_seq_len} is too large: positions are 32-bit in onnxruntime, use at most "
                             f"{MAX_SEQ_LEN_LIMIT}")
    flavors = len(cfg.ropes)
    table_bytes = 2 * flavors * max_seq_len * (cfg.head_dim // 2) * 4
    # building them holds the angles and a product as well: about twice the tables at the peak
    available = available_memory()
    if available is not None and 2 * table_bytes > available:
        raise GraphkilnError(f"{what} {max_seq_len} needs {table_bytes / 2**30:.1f} GiB for rotary tables "
                             f"(twice that while building them), more than the {available / 2**30:.1f} GiB of memory "
                             "available: use a smaller --max-seq-len")


def non_finite_error(exc: NonFiniteWeight, src: Path, family, cfg, dtype: str, decoder) -> GraphkilnError:
    """The checkpoint tensor behind a non-finite initializer, as one error line. The ONNX name is
    usually the torch parameter's (``.T``: stored transposed); the checkpoint tensors are read
    again, one at a time, to name the one the user can find (q_proj, not the fused qkv_proj)."""
    from graphkiln.models.weights import find_non_finite

    param = exc.initializer[:-2] if exc.initializer.endswith(".T") else exc.initializer
    params = dict(decoder.named_parameters())
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


def tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"graphkiln": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


# Targets whose graphs also emit the folded greedy sampler's ``next_token`` (onnx_export.add_next_token).
# Not tensorrt: its runners bind every output to a device buffer they know (runtime.backends.device_state).
NEXT_TOKEN_TARGETS = ("portable", "onnxruntime")


def export_graphs(out_dir: Path, traced, used_ops, targets: tuple[str, ...], opts: ExportOptions,
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
    import dataclasses
    import shutil

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
            release_exporter_references()
            graph, graph_ops = lower_for_onnxruntime(out_dir, graph, used_ops, opts.quant, opts.quant_block_size,
                                                     opts.quant_symmetric, say=lambda msg: _say(opts, msg),
                                                     shared_data=len(targets) > 1, quant_method=opts.quant_method,
                                                     quant_inputs=quant_inputs)
            _say(opts, f"      lowered for onnxruntime in {time.perf_counter() - t0:.1f}s")
        elif target == "tensorrt":
            from graphkiln.export.lowering.trt_target import lower_for_tensorrt

            graph, rewritten = lower_for_tensorrt(out_dir, graph)
            _say(opts, f"      {rewritten} custom nodes -> TensorRT plugins (aot=1, state written in place)"
                 + (f" in {graph.file}" if len(targets) > 1 else ""))
        if next_token and target in NEXT_TOKEN_TARGETS:
            from graphkiln.export.onnx_export import add_next_token

            graph = add_next_token(out_dir, graph)
        graphs.append(graph)
        ops.update({(o.domain, o.name, o.version): o for o in graph_ops})
    return (graphs[-1], *graphs[:-1]), [o for o in used_ops if (o.domain, o.name, o.version) in ops]


def slot_state_specs(cfg, layers, max_seq_len: int, state_dtype: str) -> list:
    """The manifest states of ``layers``' conv and recurrent pools (``DecoderConfig.slot_states``):
    one StateSpec per (kind, per-slot shape), in layer order."""
    groups: dict[tuple, list[int]] = {}
    for i in layers:
        for state in cfg.slot_states(i):
            groups.setdefault((state.kind, state.shape), []).append(i)
    specs = []
    for (kind, shape), held in groups.items():
        if kind == "conv":
            specs.append(StateSpec("conv", tuple(held), 0, 0, max_seq_len, state_dtype, layout="slots,channels,width",
                                   channels=shape[0], width=shape[1]))
        else:
            specs.append(StateSpec("recurrent", tuple(held), 0, 0, max_seq_len, state_dtype,
                                   layout="slots,heads,rows,cols", dims=shape))
    return specs


def _batched_graphs(out_dir: Path, graphs, opts: ExportOptions, quant_inputs) -> tuple:
    """A quantized fp32 artifact's batched-step graph (``lowering.batched_int8``) beside its
    onnxruntime decoder graph; () for the others."""
    if not opts.quant or opts.dtype != "fp32":
        return ()
    from graphkiln.export.lowering.batched_int8 import write_batched_graph

    t0 = time.perf_counter()
    decoder = next((g for g in graphs if g.name == "decoder" and g.target == "onnxruntime"), None)
    spec = write_batched_graph(out_dir, decoder, quant_inputs.importance if quant_inputs else None) if decoder else None
    if spec is None:
        return ()
    _say(opts, f"      batched-step int8 graph: {len(spec.weights)} weights in {time.perf_counter() - t0:.1f}s")
    return (spec,)


def _quant_inputs(src: Path, decoder, prequantized: dict, opts: ExportOptions):
    """The quantizer's inputs (``QuantInputs``) and the options as they will be recorded: the
    calibration pass runs here, on the loaded float decoder, when the method is ``calibrated``; a
    checkpoint without a tokenizer.json has no calibration text and falls back to ``search``."""
    import dataclasses

    from graphkiln.export.calibration import CALIBRATION_TOKENS, calibration_ids, input_importance
    from graphkiln.export.lowering.quantize import QuantInputs

    importance = {}
    if opts.quant_method == "calibrated":
        ids = calibration_ids(src, min(CALIBRATION_TOKENS, decoder.rope_positions), decoder.cfg.vocab_size)
        if ids is None:
            _say(opts, "      no tokenizer.json to calibrate with: quantizing by weight error (--quant-method search)")
            opts = dataclasses.replace(opts, quant_method="search")
        else:
            t0 = time.perf_counter()
            importance = input_importance(decoder, ids)
            _say(opts, f"      calibrated on {len(ids)} tokens in {time.perf_counter() - t0:.1f}s")
    return QuantInputs(prequantized, importance), opts


def _recorded_method(opts: ExportOptions, quant_inputs) -> str:
    """The manifest's quant_method: the quantizer's, with "+checkpoint" when some blocks are the
    checkpoint's own (GGUF, GPTQ/AWQ)."""
    return opts.quant_method + ("+checkpoint" if quant_inputs is not None and quant_inputs.provided else "")


def export_vision_graph(src: Path, family, vcfg, cfg, dtype: str, out_dir: Path, graphs: tuple, opts: ExportOptions):
    """Trace the vision graph spec beside the decoder graphs; returns the graphs with it and the
    manifest's VisionSpec."""
    from graphkiln.export.vision_export import export_vision
    from graphkiln.manifest import VisionSpec

    t0 = time.perf_counter()
    module = family.vision.build(src, vcfg, opts.dtype)
    try:
        graph = export_vision(module, vcfg, cfg.hidden_size, dtype, out_dir, opts.opset)
    except NonFiniteWeight as exc:
        raise GraphkilnError(f"vision weight '{exc.initializer}' has NaN or infinite values (or overflows --dtype "
                             f"{opts.dtype}): re-download the checkpoint, or export with --dtype fp32") from None
    del module
    _say(opts, f"      vision graph traced in {time.perf_counter() - t0:.1f}s ({graph.file})")
    return (*graphs, graph), VisionSpec(vcfg.image_token_id, vcfg.preprocessing, vcfg.placeholder,
                                     positions=vcfg.positions)


def export_model(model: str, out_dir: Path, opts: ExportOptions = ExportOptions()) -> Manifest:
    from graphkiln.export.onnx_export import SUPPORTED_OPSETS
    from graphkiln.models.weights import DTYPES

    if opts.dtype not in DTYPES:
        raise GraphkilnError(f"--dtype {opts.dtype} is not supported: choose one of {', '.join(DTYPES)}")
    targets = parse_targets(opts.target)
    if opts.quant is not None:
        from graphkiln.export.lowering.quantize import MATMUL_NBITS_BLOCK_SIZES, QUANT_BITS, block_size_ok

        if opts.quant not in QUANT_BITS:
            raise GraphkilnError(f"--quant {opts.quant} is not supported: choose one of {', '.join(QUANT_BITS)}")
        if "tensorrt" in targets:
            raise GraphkilnError(f"--quant {opts.quant} is not supported with --target tensorrt yet (quantized "
                                 "artifacts use onnxruntime's MatMulNBits): drop --quant, or use --target onnxruntime")
        if targets != ("onnxruntime",):
            raise GraphkilnError(f"--quant {opts.quant} needs --target onnxruntime: quantized artifacts are "
                                 "onnxruntime-target (com.microsoft.MatMulNBits); drop --target portable")
        if opts.dtype not in ("fp32", "fp16"):
            raise GraphkilnError(f"--quant {opts.quant} needs --dtype fp32 or fp16 (onnxruntime has no CPU "
                                 f"MatMulNBits for {opts.dtype})")
        from graphkiln.export.block_quant import METHODS

        if opts.quant_method not in METHODS:
            raise GraphkilnError(f"--quant-method {opts.quant_method} is not supported: choose one of {', '.join(METHODS)}")
        if not block_size_ok(opts.quant_block_size):
            raise GraphkilnError(f"--quant-block-size {opts.quant_block_size} is not supported: MatMulNBits "
                                 f"accepts {', '.join(map(str, MATMUL_NBITS_BLOCK_SIZES))}")
    if opts.return_hidden_states and "tensorrt" in targets:
        raise GraphkilnError("--return-hidden-states is not supported with --target tensorrt yet (its runners bind "
                             "only the outputs they know): drop it, or use --target onnxruntime or portable")
    if opts.opset not in SUPPORTED_OPSETS:
        raise GraphkilnError(f"--opset {opts.opset} is not supported: choose one of {', '.join(map(str, SUPPORTED_OPSETS))}")
    if "tensorrt" in targets:
        from graphkiln.export.lowering.trt_target import TRT_OPSET

        if opts.opset != TRT_OPSET:
            raise GraphkilnError(f"--opset {opts.opset} does not suit --target tensorrt: TensorRT's native "
                                 f"RMSNormalization needs opset {TRT_OPSET}; use --opset {TRT_OPSET} (the default)")
    with prepared_checkpoint(model, say=lambda msg: _say(opts, msg)) as src:
        return _export_checkpoint(model, src, out_dir, opts, targets)


def _export_checkpoint(model: str, src: Path, out_dir: Path, opts: ExportOptions, targets: tuple[str, ...]) -> Manifest:
    """``export_model`` once MODEL is a local checkpoint directory and the options are checked."""
    import dataclasses

    from graphkiln.export.onnx_export import NP_DTYPE, export_decoder
    from graphkiln.models.config import architecture_of
    from graphkiln.models.prequantized import sidecar_default_bits
    from graphkiln.models.weights import check_checkpoint, load_decoder, prequantized_parameters, read_config

    # Everything that can be refused from the checkpoint's JSON files and safetensors headers is
    # refused here, before the output directory exists; what is left (non-finite weights, found
    # as they are written) fails inside it, and the publication layer removes the partial output.
    raw = read_config(src)
    refuse_checkpoint_code(src, raw)
    refuse_quantized(raw)
    arch = architecture_of(raw)
    family = family_for(arch)
    try:
        cfg = family.parse_config(raw)
    except (ValueError, TypeError) as exc:
        raise GraphkilnError(f"config.json is inconsistent ({exc}): fix or re-save it") from None
    max_seq_len = cfg.max_position_embeddings if opts.max_seq_len is None else opts.max_seq_len
    check_max_seq_len(max_seq_len, cfg, "--max-seq-len" if opts.max_seq_len is not None else
                      "max_position_embeddings in config.json")
    generation = generation_defaults(src, raw, cfg.vocab_size, note=lambda msg: _say(opts, msg))
    check_checkpoint(src, family, cfg)
    prequantized = prequantized_parameters(src, family, cfg)
    stored_bits = sidecar_default_bits(src)
    if ((prequantized or stored_bits) and opts.quant is None and targets == ("onnxruntime",)
            and opts.dtype in ("fp32", "fp16")):
        # a quantized checkpoint stays quantized (as llama.cpp runs a GGUF): the weights without
        # stored blocks get the width most of the checkpoint's quantized weights had (the converter
        # records it: a Q4_1 GGUF is int4 though only its Q8_0 head maps), else the blocks' own
        from collections import Counter

        from graphkiln.export.lowering.quantize import QUANT_BITS

        bits = stored_bits or Counter(b.bits for b in prequantized.values()).most_common(1)[0][0]
        opts = dataclasses.replace(opts, quant=next(q for q, b in QUANT_BITS.items() if b == bits))
        _say(opts, f"      the checkpoint stores quantized blocks: exporting as --quant {opts.quant}")
    if not (opts.quant and targets == ("onnxruntime",)):
        prequantized = {}  # a float artifact of the dequantized weights
    vcfg = None
    if family.vision is not None:
        from graphkiln.export.assets import read_preprocessor_config

        vcfg = family.vision.parse(raw, read_preprocessor_config(src))
        if family.vision.complete is not None:
            vcfg = family.vision.complete(src, vcfg)
        family.vision.check(src, vcfg)
        if vcfg.image_token_id >= cfg.vocab_size:
            raise GraphkilnError(f"config.json: image token id {vcfg.image_token_id} is outside the text vocabulary "
                                 f"[0, {cfg.vocab_size}): fix image_token_index")

    from graphkiln.export.stages import check_stage_request

    stage_ranges = check_stage_request(opts.stages, opts.stage_layers, cfg.num_layers, targets)
    with atomic_directory(out_dir, overwrite=opts.overwrite, protected=(src, Path(model))) as tmp:
        t0 = time.perf_counter()
        _say(opts, f"[1/4] loading {arch} weights from {src} as {opts.dtype}")
        decoder = load_decoder(src, family, cfg, opts.dtype, progress=opts.progress)
        decoder.set_rope_positions(max_seq_len)
        decoder.return_hidden_states = bool(opts.return_hidden_states)
        quant_inputs = None
        if opts.quant:
            quant_inputs, opts = _quant_inputs(src, decoder, prequantized, opts)
        # expert_bias is a routing buffer in the reference, not a parameter: don't count it
        num_params = sum(p.numel() for n, p in decoder.named_parameters() if not n.endswith("expert_bias"))
        _say(opts, f"[2/4] tracing decoder to ONNX (opset {opts.opset}, {num_params / 1e6:.1f}M parameters)")
        t1 = time.perf_counter()
        staged, batched = None, ()
        if stage_ranges is not None:  # one graph per slice of layers (export.stages)
            from graphkiln.export.stages import export_stages

            state_dtype = NP_DTYPE[decoder.lm_head.weight.dtype]
            try:
                staged = export_stages(decoder, tmp, opts.stages, stage_ranges, targets, opts,
                                       say=lambda msg: _say(opts, msg), quant_inputs=quant_inputs)
            except NonFiniteWeight as exc:
                raise non_finite_error(exc, src, family, cfg, opts.dtype, decoder) from None
            del decoder
            graphs, used_ops = staged.graphs, staged.custom_ops
        else:
            try:
                traced = export_decoder(decoder, tmp, opts.opset)
            except NonFiniteWeight as exc:
                raise non_finite_error(exc, src, family, cfg, opts.dtype, decoder) from None
            state_dtype = NP_DTYPE[decoder.lm_head.weight.dtype]
            del decoder  # before the lowering, which loads (some of) the weights again
            if traced.stamp_refused:
                _say(opts, f"      (could not stamp layers from a template: {traced.stamp_refused}; traced them all)")
            n_traced = len(traced.traced_layers)
            how = "" if n_traced == cfg.num_layers else f" ({n_traced} of {cfg.num_layers} layers traced, the rest stamped)"
            _say(opts, f"      traced in {time.perf_counter() - t1:.1f}s{how}")
            graphs, used_ops = export_graphs(tmp, traced.graph, traced.custom_ops, targets, opts,
                                             quant_inputs=quant_inputs)
            batched = _batched_graphs(tmp, graphs, opts, quant_inputs)
        vision = None
        if vcfg is not None:
            graphs, vision = export_vision_graph(src, family, vcfg, cfg, state_dtype, tmp, graphs, opts)
            if staged is not None:  # the vision graph belongs to the first stage, which takes the seam
                vision_file = graphs[-1].file
                staged = staged.with_first_stage_files(tuple(p.name for p in tmp.iterdir() if p.name == vision_file
                                                             or p.name.startswith(vision_file + ".")))

        _say(opts, "[3/4] copying tokenizer and generation defaults")
        tokenizer_files = copy_tokenizer(src, tmp)
        states = []
        attention = cfg.layers_of("attention")
        for window in dict.fromkeys(cfg.layers[i].window for i in attention):
            layers = tuple(i for i in attention if cfg.layers[i].window == window)
            states.append(StateSpec("kv", layers, cfg.num_kv_heads, cfg.head_dim, max_seq_len, state_dtype,
                                    sliding_window=window))
        states += slot_state_specs(cfg, range(cfg.num_layers), max_seq_len, state_dtype)

        _say(opts, "[4/4] writing checksums and manifest")
        manifest = Manifest(
            model=ModelInfo(arch, str(model), cfg.vocab_size, cfg.hidden_size, cfg.num_layers, num_params, opts.dtype,
                            quant=opts.quant, quant_block_size=opts.quant_block_size if opts.quant else None,
                            quant_symmetric=opts.quant_symmetric if opts.quant else None,
                            quant_method=_recorded_method(opts, quant_inputs) if opts.quant else None),
            graphs=graphs,
            states=tuple(states),
            generation=generation,
            tokenizer_files=tokenizer_files,
            tool_versions=tool_versions(),
            files=checksum_tree(tmp),
            custom_ops=tuple(CustomOpRef(o.domain, o.name, o.version, o.plugin_namespace, o.plugin_version) for o in used_ops),
            vision=vision,
            stages=staged.stage_specs(tuple(states)) if staged is not None else (),
            batched=batched,
        ).validated()
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        _say(opts, f"done in {time.perf_counter() - t0:.1f}s -> {out_dir}")
    return manifest
