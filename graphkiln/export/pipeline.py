"""``export_model``: the whole export, from MODEL argument to a published artifact."""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from graphkiln import __version__
from graphkiln.artifact import checksum_tree
from graphkiln.errors import GraphkilnError
from graphkiln.export.assets import generation_defaults, read_tokenizer_assets
from graphkiln.export.checkpoint import prepared_checkpoint, refuse_checkpoint_code, refuse_quantized
from graphkiln.manifest import MANIFEST_NAME, TARGETS, CustomOpRef, LoraSpec, Manifest, ModelInfo, StateSpec
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
    # in one artifact, over one weights file (see graph_exporters.lower_for_targets).
    target: str = "onnxruntime"
    overwrite: bool = False
    progress: bool = True
    # weight-only quantization of the Linear layers (com.microsoft.MatMulNBits, so
    # onnxruntime-target only): None, "int4" or "int8"; block-wise along K.
    quant: str | None = None
    quant_block_size: int = 32
    # an MXFP4 checkpoint's experts (models.mxfp4): onnxruntime QMoE blocks of "int8" (exact) or "int4";
    # None: quant's width, else int4 (and then quant int4 too: a quantized checkpoint stays quantized)
    expert_quant: str | None = None
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
    # "generate" (a decoder with its LM head) or "embed" (export.embedding: an embedding artifact, no
    # head; ``pooling``/``normalize`` its recorded defaults, None: the checkpoint's or last-token, normalised)
    task: str = "generate"
    pooling: str | None = None
    normalize: bool | None = None
    # LoRA (manifest.LoraSpec): adapter stacks of rank lora_rank for max_loras slots as graph inputs
    # on the projections lora_targets names (None: every one the model has); None: no LoRA inputs
    lora_rank: int | None = None
    lora_targets: str | None = None
    max_loras: int = 4
    # weights read from the checkpoint as they are written (models.weights.load_decoder(streamed=True)):
    # memory bounded by one layer. False loads the whole model first, as before streaming; kept so
    # the tests can show that streaming changes no byte of the artifact.
    streamed: bool = True


def _say(opts: ExportOptions, msg: str) -> None:
    if opts.progress:
        print(msg, file=sys.stderr, flush=True)


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
    for rope in cfg.ropes.values():
        # longrope has two factor sets: transformers rotates every position with the long ones once
        # a sequence passes original_max_position_embeddings; one static table can only be the short
        limit = rope.parameters.get("original_max_position_embeddings") or cfg.raw.get("original_max_position_embeddings")
        if rope.rope_type == "longrope" and isinstance(limit, int) and max_seq_len > limit:
            raise GraphkilnError(f"{what} {max_seq_len} is past this model's original_max_position_embeddings {limit}, "
                                 "where its longrope rotary switches to its long factors for every position: export "
                                 f"with --max-seq-len {limit} or less")
    flavors = len(cfg.ropes)
    table_bytes = 2 * flavors * max_seq_len * (cfg.head_dim // 2) * 4
    # building them holds the angles and a product as well: about twice the tables at the peak
    available = available_memory()
    if available is not None and 2 * table_bytes > available:
        raise GraphkilnError(f"{what} {max_seq_len} needs {table_bytes / 2**30:.1f} GiB for rotary tables "
                             f"(twice that while building them), more than the {available / 2**30:.1f} GiB of memory "
                             "available: use a smaller --max-seq-len")


def tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"graphkiln": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


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
            from tqdm import tqdm

            t0 = time.perf_counter()
            with tqdm(total=decoder.cfg.num_layers, desc="calibrating", unit="layer", disable=not opts.progress,
                      leave=False) as bar:
                importance = input_importance(decoder, ids, progress=lambda i: bar.update(1))
            _say(opts, f"      calibrated on {len(ids)} tokens in {time.perf_counter() - t0:.1f}s")
    return QuantInputs(prequantized, importance), opts


def _recorded_method(opts: ExportOptions, quant_inputs) -> str:
    """The manifest's quant_method: the quantizer's, with "+checkpoint" when some blocks are the
    checkpoint's own (GGUF, GPTQ/AWQ)."""
    return opts.quant_method + ("+checkpoint" if quant_inputs is not None and quant_inputs.provided else "")


LORA_TARGET_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj", "gate": "gate_proj", "up": "up_proj",
                     "down": "down_proj"}
MAX_LORA_RANK, MAX_LORAS = 1024, 256


def parse_lora_targets(text: str | None) -> tuple[str, ...] | None:
    """``--lora-targets q,k,v,o,gate,up,down`` (short or q_proj-style names) as module names in
    canonical order; None for the default (every projection the model has)."""
    if text is None:
        return None
    modules = set()
    for item in str(text).split(","):
        item = item.strip()
        module = LORA_TARGET_NAMES.get(item, item if item in LORA_TARGET_NAMES.values() else None)
        if module is None:
            raise GraphkilnError(f"--lora-targets {text}: {item!r} is not a projection graphkiln adapts; choose from "
                                 f"{','.join(LORA_TARGET_NAMES)}")
        modules.add(module)
    return tuple(m for m in LORA_TARGET_NAMES.values() if m in modules)


def lora_shape(opts: ExportOptions, cfg):
    """The decoder config's ``LoraShape`` for the LoRA flags (None without --lora-rank), refused in one
    line when the flags are out of range or name projections the model does not have."""
    from graphkiln.models.config import LoraShape

    if opts.lora_rank is None:
        if opts.lora_targets is not None:
            raise GraphkilnError("--lora-targets needs --lora-rank R (the largest adapter rank to accept)")
        return None
    for flag, value, top in (("--lora-rank", opts.lora_rank, MAX_LORA_RANK), ("--max-loras", opts.max_loras, MAX_LORAS)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
            raise GraphkilnError(f"{flag} {value} is out of range: choose 1 to {top}")
    wanted = parse_lora_targets(opts.lora_targets)
    probe = dataclasses.replace(cfg, lora=LoraShape(opts.lora_rank, opts.max_loras, wanted or tuple(LORA_TARGET_NAMES.values())))
    present = {m for i in range(cfg.num_layers) for m, _, _ in probe.lora_targets(i)}
    missing = [m for m in (wanted or ()) if m not in present]
    if missing or not present:
        raise GraphkilnError(f"--lora-targets: this {cfg.architecture} has no LoRA-adaptable {', '.join(missing) or 'projection'} "
                             f"(graphkiln adapts attention q/k/v/o and dense-MLP gate/up/down"
                             f"{'; it has ' + ','.join(sorted(present, key=list(LORA_TARGET_NAMES.values()).index)) if present else ''})")
    return dataclasses.replace(probe.lora, modules=tuple(m for m in LORA_TARGET_NAMES.values() if m in present))


def lora_module_paths(family, cfg) -> dict[str, str]:
    """Each adaptable projection's checkpoint module path with "{layer}" for the layer (what PEFT
    names its tensors after; manifest.LoraSpec.module_paths), from the family's weight mapping.
    A projection the checkpoint stores fused with others (Phi-3's qkv_proj) has no path of its
    own: refused when asked for, left out of the default."""
    from graphkiln.models.config import LoraShape

    everything = dataclasses.replace(cfg, lora=LoraShape(1, 1, tuple(LORA_TARGET_NAMES.values())))
    paths = {}
    for i in range(cfg.num_layers):
        for module, _, _ in everything.lora_targets(i):
            if module in paths:
                continue
            container = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            name = family.source(f"model.layers.{i}.{container}.{module}.weight", cfg)
            marker = f"layers.{i}."
            if isinstance(name, str) and name.endswith(".weight") and name.count(marker) == 1:
                paths[module] = name.removesuffix(".weight").replace(marker, "layers.{layer}.")
    return paths


def export_model(model: str, out_dir: Path, opts: ExportOptions = ExportOptions()) -> Manifest:
    from graphkiln.export.onnx_export import SUPPORTED_OPSETS
    from graphkiln.models.weights import DTYPES

    if opts.dtype not in DTYPES:
        raise GraphkilnError(f"--dtype {opts.dtype} is not supported: choose one of {', '.join(DTYPES)}")
    targets = parse_targets(opts.target)
    if opts.quant not in (None, "none"):  # "none": float weights, a quantized checkpoint's dequantized values
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
    from graphkiln.export.embedding import check_task_options

    check_task_options(opts.task, opts.pooling, opts.normalize, targets, bool(opts.stages or opts.stage_layers),
                       opts.lora_rank is not None, opts.return_hidden_states)
    if opts.opset not in SUPPORTED_OPSETS:
        raise GraphkilnError(f"--opset {opts.opset} is not supported: choose one of {', '.join(map(str, SUPPORTED_OPSETS))}")
    if "tensorrt" in targets:
        from graphkiln.export.lowering.trt_target import TRT_OPSET

        if opts.opset != TRT_OPSET:
            raise GraphkilnError(f"--opset {opts.opset} does not suit --target tensorrt: TensorRT's native "
                                 f"RMSNormalization needs opset {TRT_OPSET}; use --opset {TRT_OPSET} (the default)")
    from graphkiln.memory import one_heap

    one_heap()  # the streamed export's peak must not depend on how the heaps fragment
    from graphkiln.export.lowering.quantize import QUANT_BITS

    with prepared_checkpoint(model, say=lambda msg: _say(opts, msg), bits=QUANT_BITS.get(opts.quant),
                             block_size=opts.quant_block_size) as src:
        return _export_checkpoint(model, src, out_dir, opts, targets)


def _export_checkpoint(model: str, src: Path, out_dir: Path, opts: ExportOptions, targets: tuple[str, ...]) -> Manifest:
    """``export_model`` once MODEL is a local checkpoint directory and the options are checked."""
    import dataclasses

    from graphkiln.models.config import architecture_of
    from graphkiln.models.prequantized import sidecar_default_bits
    from graphkiln.models.weights import check_checkpoint, prequantized_parameters, read_config

    # Everything that can be refused from the checkpoint's JSON files and safetensors headers is
    # refused here, before the output directory exists; what is left (non-finite weights, found
    # as they are written) fails inside it, and the publication layer removes the partial output.
    raw = read_config(src)
    refuse_checkpoint_code(src, raw)
    refuse_quantized(raw)
    from graphkiln.models.mxfp4 import export_quant, is_mxfp4

    if is_mxfp4(raw):  # MXFP4 experts are written as QMoE blocks (int4 by default)
        quant, expert_quant = export_quant(opts.quant, opts.expert_quant, targets, opts.dtype, lambda m: _say(opts, m))
        opts = dataclasses.replace(opts, quant=quant, expert_quant=expert_quant)
    arch = architecture_of(raw)
    if opts.task == "embed":  # a base model class (Qwen3Model) is read by its *ForCausalLM family
        from graphkiln.export.embedding import embedding_architecture
        from graphkiln.models.registry import supported_architectures

        arch = embedding_architecture(arch, lambda a: a in supported_architectures())
    family = family_for(arch)
    try:
        cfg = family.parse_config(raw)
    except (ValueError, TypeError) as exc:
        raise GraphkilnError(f"config.json is inconsistent ({exc}): fix or re-save it") from None
    lora, lora_paths = lora_shape(opts, cfg), {}
    if lora is not None:
        lora_paths = lora_module_paths(family, cfg)
        unnamed = [m for m in lora.modules if m not in lora_paths]
        if unnamed and (opts.lora_targets is not None or len(unnamed) == len(lora.modules)):
            raise GraphkilnError(f"--lora-targets: this {arch} checkpoint stores {unnamed[0]} fused with other "
                                 f"projections, so adapters cannot name it alone; leave it out (adaptable: "
                                 f"{','.join(lora_paths) or 'none'})")
        lora = dataclasses.replace(lora, modules=tuple(m for m in lora.modules if m in lora_paths))
    cfg = dataclasses.replace(cfg, lora=lora)
    embedding = None
    if opts.task == "embed":
        from graphkiln.export.embedding import embedding_config, embedding_spec

        embedding = embedding_spec(src, opts.pooling, opts.normalize, family.vision is not None)
        cfg = embedding_config(cfg)
    max_seq_len = cfg.max_position_embeddings if opts.max_seq_len is None else opts.max_seq_len
    check_max_seq_len(max_seq_len, cfg, "--max-seq-len" if opts.max_seq_len is not None else
                      "max_position_embeddings in config.json")
    generation = generation_defaults(src, raw, cfg.vocab_size, note=lambda msg: _say(opts, msg))
    assets = read_tokenizer_assets(src, cfg.vocab_size)
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
    if opts.quant == "none":  # asked for float weights: the checkpoint's dequantized values at --dtype
        opts = dataclasses.replace(opts, quant=None)
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

    from graphkiln.export.stage_plan import check_stage_request

    stage_ranges = check_stage_request(opts.stages, opts.stage_layers, cfg.num_layers, targets)
    est = _preflight(src, family, cfg, opts, targets)
    io_before = _written_bytes()
    with atomic_directory(out_dir, overwrite=opts.overwrite, protected=(src, Path(model))) as tmp:
        from graphkiln.export import preflight

        preflight.check_disk(est, tmp, Path(out_dir), opts)
        try:
            return _export_into(tmp, model, src, out_dir, arch, family, cfg, vcfg, opts, targets, prequantized,
                                generation, assets, max_seq_len, stage_ranges, lora_paths, io_before, embedding)
        finally:
            from graphkiln.export.external_data import forget_deferred

            forget_deferred(tmp)


def _preflight(src: Path, family, cfg, opts: ExportOptions, targets: tuple[str, ...]):
    """Estimate the export's peak memory and disk need (export.preflight) and refuse when the memory
    does not fit; the disk is checked once the output path is (``preflight.check_disk``)."""
    from graphkiln.export import preflight
    from graphkiln.export.layer_stamping import template_layers
    from graphkiln.models.weights import CheckpointWeights, meta_decoder

    weights = CheckpointWeights(src, family, cfg, opts.dtype)
    try:
        est = preflight.estimate(meta_decoder(cfg), opts, targets, template_layers(cfg), weights)
    finally:
        if weights is not None:
            weights.close()
    preflight.check_memory(est, opts)
    _say(opts, f"      estimated peak memory {est.peak_memory / 2**30:.1f} GiB, artifact {est.artifact / 2**30:.2f} GiB")
    return est


def _written_bytes() -> int | None:
    """Bytes this process has written to storage so far (Linux /proc/self/io), or None."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _peak_rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _export_into(tmp: Path, model: str, src: Path, out_dir: Path, arch, family, cfg, vcfg, opts: ExportOptions,
                 targets, prequantized, generation, assets, max_seq_len: int, stage_ranges, lora_paths,
                 io_before, embedding=None) -> Manifest:
    """The export's writing part, into the publication's temporary directory ``tmp``."""
    from graphkiln.export.graph_exporters import ExportContext, export_graph_specs
    from graphkiln.export.onnx_export import NP_DTYPE
    from graphkiln.export.stage_plan import make_plan
    from graphkiln.models.weights import load_decoder

    t0 = time.perf_counter()
    _say(opts, f"[1/4] loading {arch} weights from {src} as {opts.dtype} (the first layer of each kind; the "
               "rest are read as they are written)")
    decoder = load_decoder(src, family, cfg, opts.dtype, progress=opts.progress, streamed=opts.streamed)
    weights = getattr(decoder, "weights", None)
    try:
        decoder.set_rope_positions(max_seq_len)
        decoder.return_hidden_states = bool(opts.return_hidden_states)
        decoder.return_logits = embedding is None  # an embedding graph has no head (export.embedding)
        quant_inputs = None
        if opts.quant:
            quant_inputs, opts = _quant_inputs(src, decoder, prequantized, opts)
        # expert_bias is a routing buffer in the reference, not a parameter: don't count it
        num_params = sum(p.numel() for n, p in decoder.named_parameters() if not n.endswith("expert_bias"))
        _say(opts, f"[2/4] tracing decoder to ONNX (opset {opts.opset}, {num_params / 1e6:.1f}M parameters)")
        ctx = ExportContext(src, family, cfg, vcfg, decoder, tmp, targets, opts, quant_inputs,
                            state_dtype=NP_DTYPE[decoder.lm_head.weight.dtype], say=lambda msg: _say(opts, msg))
        if stage_ranges is not None:  # --stages N is planned from the loaded weights (export.stages)
            ctx.stage_plan = make_plan(decoder, opts.stages, stage_ranges)
        del decoder  # the loop drops its reference once no graph needs it
        plans = family.graph_specs(cfg, ctx.stage_plan.ranges if ctx.stage_plan else None)
        exported = export_graph_specs(plans, ctx)
        state_dtype = ctx.state_dtype

        _say(opts, "[3/4] copying tokenizer and generation defaults")
        tokenizer_files = assets.write(tmp)
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
            graphs=exported.graphs,
            states=tuple(states),
            generation=generation,
            tokenizer_files=tokenizer_files,
            tool_versions=tool_versions(),
            files=checksum_tree(tmp),
            custom_ops=tuple(CustomOpRef(o.domain, o.name, o.version, o.plugin_namespace, o.plugin_version)
                             for o in exported.custom_ops),
            vision=exported.vision,
            stages=exported.stage_specs(tuple(states)),
            batched=exported.batched,
            lora=LoraSpec(cfg.lora.rank, cfg.lora.max_loras, cfg.lora.modules, lora_paths) if cfg.lora else None,
            embedding=embedding,
        ).validated()
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        written = _written_bytes()
        size = sum(p.stat().st_size for p in tmp.iterdir() if p.is_file())
        wrote = "" if written is None or io_before is None else f", {(written - io_before) / 1e9:.2f} GB written"
        _say(opts, f"done in {time.perf_counter() - t0:.1f}s -> {out_dir} (artifact {size / 1e9:.2f} GB{wrote}, "
                   f"peak memory {_peak_rss() / 2**30:.2f} GiB)")
    finally:
        if weights is not None:
            weights.close()
    return manifest
