"""``export_model``: the whole export, from MODEL argument to a published artifact."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from graphkiln import __version__
from graphkiln.artifact import atomic_directory, checksum_tree
from graphkiln.errors import GraphkilnError
from graphkiln.export.assets import copy_tokenizer, generation_defaults
from graphkiln.export.checkpoint import resolve_checkpoint
from graphkiln.manifest import MANIFEST_NAME, CustomOpRef, Manifest, ModelInfo, StateSpec
from graphkiln.models.registry import family_for


@dataclass(frozen=True)
class ExportOptions:
    dtype: str = "fp32"
    max_seq_len: int | None = None  # default: the config's max_position_embeddings
    opset: int = 23
    # "portable": standard ONNX + graphkiln custom ops (functions attached), parseable by
    # TensorRT; "onnxruntime": custom ops lowered to onnxruntime contrib ops where faster.
    target: str = "portable"
    overwrite: bool = False
    progress: bool = True


def _say(opts: ExportOptions, msg: str) -> None:
    if opts.progress:
        print(msg, file=sys.stderr, flush=True)


TARGETS = ("portable", "onnxruntime")


def lower_for_onnxruntime(out_dir: Path, graph, used_ops):
    """Rewrite the saved graph for onnxruntime (MoE -> com.microsoft.MoE), in place on disk."""
    import dataclasses

    import onnx

    from graphkiln.export.lowering.ort_moe import lower_moe_for_onnxruntime

    path = out_dir / graph.file
    model = onnx.load(str(path), load_external_data=True)
    rewritten = lower_moe_for_onnxruntime(model)
    if rewritten:
        data = path.with_name(path.name + ".data")
        path.unlink()
        data.unlink(missing_ok=True)
        onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                  location=data.name, size_threshold=1024)
    del model
    remaining = [op for op in used_ops if not (op.name == "MoE" and rewritten)]
    return dataclasses.replace(graph, target="onnxruntime"), remaining


def tool_versions() -> dict[str, str]:
    import importlib.metadata as md

    versions = {"graphkiln": __version__}
    for pkg in ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "safetensors"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return versions


def export_model(model: str, out_dir: Path, opts: ExportOptions = ExportOptions()) -> Manifest:
    from graphkiln.export.onnx_export import NP_DTYPE, SUPPORTED_OPSETS, export_decoder
    from graphkiln.models.weights import DTYPES, load_decoder, read_config

    if opts.dtype not in DTYPES:
        raise GraphkilnError(f"--dtype {opts.dtype} is not supported: choose one of {', '.join(DTYPES)}")
    if opts.target not in TARGETS:
        raise GraphkilnError(f"--target {opts.target} is not supported: choose one of {', '.join(TARGETS)}")
    if opts.opset not in SUPPORTED_OPSETS:
        raise GraphkilnError(f"--opset {opts.opset} is not supported: choose one of {', '.join(map(str, SUPPORTED_OPSETS))}")
    src = resolve_checkpoint(model)
    raw = read_config(src)
    archs = raw.get("architectures") or []
    if not archs:
        raise GraphkilnError("config.json has no 'architectures' entry: re-save the checkpoint with save_pretrained")
    family = family_for(archs[0])
    try:
        cfg = family.parse_config(raw)
    except (ValueError, TypeError) as exc:
        raise GraphkilnError(f"config.json is inconsistent ({exc}): fix or re-save it") from None
    max_seq_len = cfg.max_position_embeddings if opts.max_seq_len is None else opts.max_seq_len
    if max_seq_len < 2:
        raise GraphkilnError(f"--max-seq-len {max_seq_len} is too small: use at least 2")

    with atomic_directory(Path(out_dir), overwrite=opts.overwrite) as tmp:
        t0 = time.perf_counter()
        _say(opts, f"[1/4] loading {archs[0]} weights from {src} as {opts.dtype}")
        decoder = load_decoder(src, family, cfg, opts.dtype, progress=opts.progress)
        num_params = sum(p.numel() for p in {id(p): p for p in decoder.parameters()}.values())
        _say(opts, f"[2/4] tracing decoder to ONNX (opset {opts.opset}, {num_params / 1e6:.1f}M parameters)")
        t1 = time.perf_counter()
        graph, used_ops = export_decoder(decoder, tmp, opts.opset)
        if opts.target == "onnxruntime":
            graph, used_ops = lower_for_onnxruntime(tmp, graph, used_ops)
        state_dtype = NP_DTYPE[decoder.lm_head.weight.dtype]
        del decoder
        _say(opts, f"      traced in {time.perf_counter() - t1:.1f}s")

        _say(opts, "[3/4] copying tokenizer and generation defaults")
        tokenizer_files = copy_tokenizer(src, tmp)
        states = []
        attention = cfg.layers_of("attention")
        for window in dict.fromkeys(cfg.layers[i].window for i in attention):
            layers = tuple(i for i in attention if cfg.layers[i].window == window)
            states.append(StateSpec("kv", layers, cfg.num_kv_heads, cfg.head_dim, max_seq_len, state_dtype, sliding_window=window))
        if cfg.layers_of("conv"):
            states.append(StateSpec("conv", cfg.layers_of("conv"), 0, 0, max_seq_len, state_dtype,
                                    layout="slots,channels,width", update="slot_rows",
                                    channels=cfg.hidden_size, width=cfg.conv_kernel - 1))

        _say(opts, "[4/4] writing checksums and manifest")
        manifest = Manifest(
            model=ModelInfo(archs[0], str(model), cfg.vocab_size, cfg.hidden_size, cfg.num_layers, num_params, opts.dtype),
            graphs=(graph,),
            states=tuple(states),
            generation=generation_defaults(src, raw),
            tokenizer_files=tokenizer_files,
            tool_versions=tool_versions(),
            files=checksum_tree(tmp),
            custom_ops=tuple(CustomOpRef(o.domain, o.name, o.version, o.plugin_namespace, o.plugin_version) for o in used_ops),
        )
        (tmp / MANIFEST_NAME).write_text(manifest.to_json())
        _say(opts, f"done in {time.perf_counter() - t0:.1f}s -> {out_dir}")
    return manifest
