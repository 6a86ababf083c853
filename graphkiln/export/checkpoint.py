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
