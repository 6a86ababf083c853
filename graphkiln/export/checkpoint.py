"""Resolve a MODEL argument (local directory or hub id) to a local checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from graphkiln.errors import GraphkilnError

# What an export reads from a hub repository; everything else (other formats, images) is skipped.
HUB_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
                "tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*"]


def resolve_checkpoint(model: str) -> Path:
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists():
        raise GraphkilnError(f"{model} is a file, not a checkpoint directory: pass the directory holding config.json")
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
    import json

    found = {"config.json": raw.get("auto_map")}
    tok = src / "tokenizer_config.json"
    if tok.is_file():
        try:
            tok_cfg = json.loads(tok.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            tok_cfg = None  # not read by export (the runtime uses tokenizer.json): copied as is
        if isinstance(tok_cfg, dict):
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
        raise GraphkilnError(
            f"quantized checkpoints (quant_method {method}) are not supported: export the unquantized checkpoint "
            "and use --quant"
        )
