"""Resolve a MODEL argument (local directory, GGUF file or hub id) to a local checkpoint directory.

``prepared_checkpoint`` is what export and verify use: a checkpoint stored in a quantized format (a
GGUF file, or a Hugging Face checkpoint with a GPTQ/AWQ/compressed-tensors/FP8/NVFP4
``quantization_config``) is converted into a temporary checkpoint directory (config, tokenizer: no
weight file) whose float weights are dequantized from the source when read and whose blocks that
map onto MatMulNBits are kept as they are (``models.derived``, ``models.prequantized``), which lives
as long as the ``with`` block. The conversion's memory and disk needs are checked first
(``export.preflight.check_conversion``).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

from graphkiln.errors import GraphkilnError

# What an export reads from a hub repository; everything else (other formats, images) is skipped.
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*"]


# quantization_config methods whose weights convert (graphkiln.models.hf_quantized); others are refused
CONVERTIBLE_QUANT_METHODS = ("gptq", "awq", "compressed-tensors", "fp8", "modelopt")
# quantization_config methods exported straight from the checkpoint, unconverted (models.mxfp4: gpt-oss's
# MXFP4 experts become onnxruntime QMoE blocks as they are written)
DIRECT_QUANT_METHODS = ("mxfp4",)


def gguf_file(model: str) -> Path | None:
    """The GGUF file MODEL names: the file itself, or the one ``*.gguf`` in a directory with no
    config.json; None when MODEL is not a GGUF checkpoint."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").exists():
        found = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
        if len(found) > 1:
            raise GraphkilnError(f"{model} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:3])}): "
                                 "pass the one to export")
        if found:
            return found[0]
    return None


@contextlib.contextmanager
def prepared_checkpoint(model: str, say=lambda msg: None, bits: int | None = None, block_size: int | None = None):
    """Yield the local checkpoint directory for MODEL, converting a quantized format first (see the
    module docstring); the converted directory is removed when the block ends. ``bits`` and
    ``block_size`` (the export's ``--quant`` width and block size, None when not given) choose the
    blocks of formats that are not integer blocks themselves (FP8, NVFP4)."""
    gguf = gguf_file(model)
    src = None if gguf is not None else resolve_checkpoint(model)
    method = None
    if src is not None:
        from graphkiln.models.hf_quantized.nvfp4 import modelopt_config
        from graphkiln.models.weights import read_config

        qc = read_config(src).get("quantization_config")
        if qc is None:
            qc = modelopt_config(src)  # ModelOpt writes its quantization into hf_quant_config.json
        if qc is None:
            yield src
            return
        method = qc.get("quant_method") if isinstance(qc, dict) else None
        if method in DIRECT_QUANT_METHODS:
            from graphkiln.models.mxfp4 import check_checkpoint

            check_checkpoint(src)
            yield src
            return
        if method not in CONVERTIBLE_QUANT_METHODS:
            refuse_quantized({"quantization_config": qc})
    from graphkiln.export.preflight import check_conversion
    from graphkiln.models.derived import registered

    with tempfile.TemporaryDirectory(prefix="graphkiln-checkpoint-") as tmp:
        dest = Path(tmp) / "checkpoint"
        check = lambda needs: check_conversion(needs, dest)  # noqa: E731
        if gguf is not None:
            from graphkiln.models.gguf import convert_gguf

            say(f"      converting {gguf.name} (GGUF) into a checkpoint (its weights dequantized as they are read)")
            derived = convert_gguf(gguf, dest, preflight=check)
        else:
            from graphkiln.models.hf_quantized import convert_quantized_checkpoint

            say(f"      converting the {method} checkpoint {src} (weights dequantized as they are read, blocks kept)")
            derived = convert_quantized_checkpoint(src, dest, bits, block_size, preflight=check)
            if derived.summary:
                say(f"      {derived.summary}")
        with registered(dest, derived):
            yield dest


def resolve_checkpoint(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise GraphkilnError(f"{model} is a file, not a checkpoint directory: pass the directory holding config.json "
                             "(or a .gguf file)")
    if model.count("/") != 1 or model.startswith((".", "/")):
        raise GraphkilnError(f"{model} is neither a local directory nor a hub id like 'org/name': check the path")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=HUB_PATTERNS))
    except Exception as exc:
        raise GraphkilnError(
            f"could not download '{model}' from the Hugging Face hub ({type(exc).__name__}): "
            "check the id and network, or pass a local checkpoint directory"
        ) from None


def refuse_checkpoint_code(src: Path, raw: dict) -> None:
    """Refuse a checkpoint that needs its own Python code (``auto_map`` in config.json or
    tokenizer_config.json, the files transformers would import from the checkpoint).

    graphkiln never runs checkpoint code, and must never let transformers ask "[y/N]" about it on a
    terminal: export and verify only load built-in transformers classes, with
    ``trust_remote_code=False``. A checkpoint whose architecture is built into transformers may
    carry a stale auto_map; deleting it from the file makes the checkpoint exportable.
    """
    from graphkiln.export.assets import TOKENIZER_FIX
    from graphkiln.models.checkpoint_files import read_json_object

    found = {"config.json": raw.get("auto_map")}
    tok_cfg = read_json_object(src, "tokenizer_config.json", TOKENIZER_FIX)
    if tok_cfg is not None:
        found["tokenizer_config.json"] = tok_cfg.get("auto_map")
    for file, auto_map in found.items():
        if auto_map is not None:
            modules = sorted({v.split(".")[0] + ".py" for v in _auto_map_targets(auto_map) if "." in v})
            code = f" ({', '.join(modules)})" if modules else ""
            raise GraphkilnError(
                f"checkpoint needs its own Python code (auto_map in {file}{code}): graphkiln does not run "
                f"checkpoint code; if the architecture is built into transformers, delete 'auto_map' from {file}"
            )


def _auto_map_targets(auto_map) -> list[str]:
    """The "module.Class" strings of an auto_map (values are strings or [slow, fast] lists)."""
    values = auto_map.values() if isinstance(auto_map, dict) else []
    out = []
    for v in values:
        for item in (v if isinstance(v, list) else [v]):
            if isinstance(item, str):
                out.append(item.split("--")[-1])  # "repo--module.Class" names code in another repo
    return out


def refuse_quantized(raw: dict) -> None:
    """Checkpoints whose weights are stored quantized (GPTQ, AWQ, bitsandbytes, fp8...): graphkiln
    knows no stored quantization, and casting the integer tensors would make a silently wrong model."""
    qc = raw.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else "unknown"
        if method in DIRECT_QUANT_METHODS:
            return
        from graphkiln.models.hf_quantized.convert import READS
        from graphkiln.untrusted import show

        raise GraphkilnError(
            f"quantized checkpoints (quant_method {show(method)}) are not supported (graphkiln converts "
            f"{READS} and reads {', '.join(DIRECT_QUANT_METHODS)}): export the "
            "unquantized checkpoint and use --quant"
        )
