"""Non-graph files an artifact carries: tokenizer files and generation defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from graphkiln.manifest import GenerationDefaults

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_tokenizer(src: Path, dst: Path) -> tuple[str, ...]:
    """Copy the tokenizer; convert a slow-only tokenizer to tokenizer.json when possible.

    The runtime uses the ``tokenizers`` library alone, so tokenizer.json is what matters.
    """
    copied = [name for name in TOKENIZER_FILES if (src / name).is_file()]
    for name in copied:
        shutil.copy2(src / name, dst / name)
    if "tokenizer.json" not in copied and any(src.glob("*.model")):
        try:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(src)).backend_tokenizer.save(str(dst / "tokenizer.json"))
            copied.append("tokenizer.json")
        except Exception:
            pass  # no usable tokenizer: the artifact still runs on token ids
    return tuple(copied)


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list) else [value]))


def generation_defaults(src: Path, raw_config: dict) -> GenerationDefaults:
    gen = {}
    if (src / "generation_config.json").is_file():
        try:
            gen = json.loads((src / "generation_config.json").read_text())
        except json.JSONDecodeError:
            gen = {}
    eos = _ids(gen.get("eos_token_id", raw_config.get("eos_token_id")))
    return GenerationDefaults(
        eos_token_ids=eos,
        bos_token_id=gen.get("bos_token_id", raw_config.get("bos_token_id")),
        pad_token_id=gen.get("pad_token_id", raw_config.get("pad_token_id")),
        do_sample=bool(gen.get("do_sample", False)),
        temperature=float(gen.get("temperature") or 1.0),
        top_k=int(gen.get("top_k") or 0),
        top_p=float(gen.get("top_p") or 1.0),
        max_new_tokens=int(gen.get("max_new_tokens") or 128),
    )
