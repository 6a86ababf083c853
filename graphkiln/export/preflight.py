"""Before an export writes anything: will this machine hold it? (issue 36, item 4)

The streamed export (``models.weights.load_decoder(streamed=True)``, ``export.streamed_weights``)
holds, at its peak, the traced template (one layer of each kind, real), one more layer being written,
quantized or run by the calibration pass, the largest table in flight (the embedding or head, in the
checkpoint's dtype while an untied head is transposed), and a fixed overhead for the interpreter,
torch, onnx and the exporter. Disk: the artifact, plus the traced data file of a float export that a
lowering rewrites (MoE). Both are estimated from config.json and the shard headers alone and
compared with what is available now (cgroup limits included); a shortfall is one error line naming
the figures and what lowers them.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from graphkiln.errors import GraphkilnError

# Measured on this machine's exports of the suite's tiny models (peak RSS with nothing loaded):
# the interpreter with torch, onnx, onnxscript and transformers imported, plus the exporter's trace.
BASE_BYTES = 700 << 20
# Quantizing one weight holds its float rows, a chunk's temporaries and its packed blocks; the
# calibration pass holds a layer and its activations: about twice the layer, measured.
WORKING_FACTOR = 2.0


@dataclass(frozen=True)
class Estimate:
    peak_memory: int  # bytes
    disk: int  # bytes written to the output's filesystem at the peak (artifact + temporaries)
    artifact: int  # bytes of the published artifact
    largest_layer: int
    template: int
    table: int
    dequantize: int = 0  # a converted quantized checkpoint's largest tensor's dequantization temporaries


def estimate(decoder, opts, targets: tuple[str, ...], template: tuple[int, ...], weights=None) -> Estimate:
    """The export's peak memory and disk need, from the decoder's parameter shapes (a meta decoder:
    ``models.weights.meta_decoder``) and the checkpoint's stored sizes (``weights``, a
    ``CheckpointWeights``, when given)."""
    import torch

    cfg = decoder.cfg
    from graphkiln.models.weights import DTYPES

    itemsize = torch.empty((), dtype=DTYPES[opts.dtype]).element_size()
    layer_params = [sum(p.numel() for p in layer.parameters()) for layer in decoder.model.layers]
    layer_bytes = [n * itemsize for n in layer_params]
    table_params = decoder.model.embed_tokens.weight.numel()
    tied = decoder.lm_head.weight is decoder.model.embed_tokens.weight
    stored_table = max((weights.stored_bytes(n) for n in ("model.embed_tokens.weight", "lm_head.weight")),
                       default=table_params * 2) if weights is not None else table_params * itemsize
    total_params = sum(layer_params) + table_params * (1 if tied else 2)
    experts = sum(p.numel() for layer in decoder.model.layers for n, p in layer.named_parameters()
                  if ".experts." in f".{n}")
    expert_bytes = experts * itemsize
    if getattr(opts, "expert_quant", None):  # MXFP4 experts as QMoE blocks of 32 with one scale each (models.mxfp4)
        expert_bytes = int(experts * ({"int4": 4, "int8": 8}[opts.expert_quant] / 8 + itemsize / 32))
    if opts.quant:
        bits = {"int4": 4, "int8": 8}[opts.quant]
        per_block = itemsize + (0 if opts.quant_symmetric else bits / 8)
        quant_factor = bits / 8 + per_block / opts.quant_block_size
        artifact = int((total_params - experts) * quant_factor + expert_bytes) + _stored_widths(weights, bits)
        table_work = table_params * 4 * 2  # a band of fp32 rows plus the table's packed codes, bounded by the table
        table_work = min(table_work, stored_table + table_params)
    else:
        artifact = (total_params - experts) * itemsize + expert_bytes
        table_work = stored_table + (64 << 20)  # an untied head is transposed from its stored bytes, a band at a time
    largest = max(layer_bytes, default=0)
    template_bytes = sum(layer_bytes[i] for i in template)
    template_bytes = max(template_bytes, _largest_stage(opts, cfg, targets, layer_bytes))
    if cfg.vision_seam and weights is not None:  # the vision tower (and projector) is loaded whole, in fp32
        stored = sum(math.prod(weights.reader.header(n)["shape"]) for n in weights.reader.where)
        template_bytes += max(0, stored - total_params) * 4
    dequantize = _dequantizing(weights) if weights is not None else 0  # a converted quantized checkpoint
    peak = BASE_BYTES + template_bytes + int(WORKING_FACTOR * largest) + table_work + dequantize
    disk = artifact
    moe = any(s.ffn == "moe" for s in cfg.layers)
    if moe and not (opts.quant or getattr(opts, "expert_quant", None)):  # the traced data file and the interleaved experts' new one, side by side
        disk += artifact
    if len(targets) > 1:
        disk += artifact // 4  # other targets' rewritten tensors (MoE experts), at most: a margin
    return Estimate(peak, disk, artifact, largest, template_bytes, table_work, dequantize)


def _largest_stage(opts, cfg, targets, layer_bytes: list[int]) -> int:
    """The layer bytes of the largest pipeline stage (``--stages``/``--stage-layers``), all of whose
    layers are read for its trace; 0 unstaged. ``--stages N`` is planned by bytes once the weights
    are known: at most an even share plus one layer."""
    from graphkiln.export.stage_plan import check_stage_request

    ranges = check_stage_request(opts.stages, opts.stage_layers, cfg.num_layers, targets)
    if ranges is None:
        return 0
    if ranges:
        return max(sum(layer_bytes[a:b]) for a, b in ranges)
    total = sum(layer_bytes)
    return min(total, -(-total // opts.stages) + max(layer_bytes, default=0))


def _stored_widths(weights, bits: int) -> int:
    """What a converted quantized checkpoint's own blocks add to a ``bits``-wide artifact: they are
    written at their stored width (a GGUF's Q8_0 table in an int4 export); 0 for an ordinary one."""
    if weights is None:
        return 0
    extra = 0
    for t in weights.reader.where.values():
        blocks = getattr(t, "blocks", None)
        if blocks is not None:
            extra += math.prod(blocks.shape) * (blocks.bits - bits) // 8
    return extra


def _dequantizing(weights) -> int:
    """What reading a converted quantized checkpoint's largest tensor adds beyond its float rows
    (``models.derived``: the dequantizer's temporaries); 0 for an ordinary checkpoint."""
    from graphkiln.models.weights import PLACEHOLDER_PARAMS

    made = [t for n, t in weights.reader.where.items() if not isinstance(t, Path) and n not in PLACEHOLDER_PARAMS]
    return max((int(t.nbytes * t.work_factor) for t in made), default=0)  # the tables are read in bands


def check_conversion(needs, dest: Path) -> None:
    """Before a quantized checkpoint (GGUF, GPTQ/AWQ/...) is converted (``models.derived.ConversionNeeds``,
    from its headers): refuse in one line when the memory available now, or the free space where
    the converted directory goes, cannot hold what the conversion needs."""
    from graphkiln.memory import require_memory

    gib = 2 ** 30
    require_memory(needs.memory, f"{needs.what} (the tools and the largest tensor while its blocks are checked)",
                   "export on a machine with more memory")
    free = _free_disk(dest)
    if free is not None and needs.disk > free:
        raise GraphkilnError(
            f"no space left on device for {dest.parent}: {needs.what} writes about {needs.disk / gib:.2f} GiB "
            f"(its config and tokenizer files; the weights are read from the source) but the disk has "
            f"{free / gib:.2f} GiB free: set TMPDIR to a directory on another disk")


def check_whole_model(decoder) -> None:
    """Before the trace-every-layer fallback (``onnx_export.materialized``: layer stamping refused
    the graph) reads every layer and table of a streamed decoder: refuse in one line when they do
    not fit in the memory available now, the one export path whose memory grows with the model."""
    from graphkiln.memory import require_memory

    missing = sum(p.numel() * p.element_size() for p in decoder.parameters() if p.is_meta)
    tables = decoder.model.embed_tokens.weight.numel() * decoder.model.embed_tokens.weight.element_size()
    tied = decoder.lm_head.weight is decoder.model.embed_tokens.weight
    needed = missing + tables * (1 if tied else 2)  # the tables were placeholders: read now
    remedy = "export with --dtype fp16" if decoder.model.embed_tokens.weight.element_size() == 4 else \
        "export on a machine with more memory"
    require_memory(needed, "tracing every layer (layer stamping refused this graph, so the whole model is read)",
                   remedy)


def check_memory(est: Estimate, opts) -> None:
    """Refuse in one line (``memory.require_memory``) when the memory available now cannot hold the
    export's peak."""
    from graphkiln.memory import require_memory

    gib = 2 ** 30
    require_memory(est.peak_memory,
                   f"this export (at its peak: the traced layers {est.template / gib:.1f} GiB, one layer "
                   f"{est.largest_layer / gib:.1f} GiB twice, the embedding/head {est.table / gib:.1f} GiB, "
                   + (f"dequantizing a stored tensor {est.dequantize / gib:.1f} GiB, " if est.dequantize else "") +
                   f"{BASE_BYTES / gib:.1f} GiB for the tools)",
                   "export with --dtype fp16" if opts.dtype == "fp32" else "export on a machine with more memory")


def check_disk(est: Estimate, where: Path, target: Path, opts) -> None:
    """Refuse in one line when the filesystem of ``where`` (the export's temporary directory, beside
    ``target``) has less free space than the export will write. Run inside the publication, after
    the output path itself was checked (read-only and protected paths get their own errors), so the
    partial directory and the parents it made are removed as for any write failure."""
    gib = 2 ** 30
    free = _free_disk(where)
    if free is not None and est.disk > free:
        remedy = "add --quant int4, or " if not opts.quant else ""
        raise GraphkilnError(
            f"no space left on device for {target}: this export writes about {est.disk / gib:.2f} GiB (artifact "
            f"{est.artifact / gib:.2f} GiB) but the disk has {free / gib:.2f} GiB free: {remedy}pass --output a "
            "directory on another disk")


def _free_disk(out_dir: Path) -> int | None:
    path = Path(out_dir).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
