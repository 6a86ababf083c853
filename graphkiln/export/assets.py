"""Non-graph files an artifact carries: tokenizer files and generation defaults."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GenerationDefaults

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"


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

            # Never the checkpoint's own tokenizer code (export refuses auto_map before this;
            # trust_remote_code=False also keeps transformers from asking on a terminal).
            AutoTokenizer.from_pretrained(str(src), trust_remote_code=False).backend_tokenizer.save(
                str(dst / "tokenizer.json"))
            copied.append("tokenizer.json")
        except Exception:
            pass  # no usable tokenizer: the artifact still runs on token ids
    return tuple(copied)


def _bad(file: str, key: str, value, expected: str) -> GraphkilnError:
    from graphkiln.models.config import config_error

    return config_error(key, value, expected, file)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _json_object(path: Path, fix: str) -> dict:
    """A checkpoint JSON file that must hold an object; malformed is one error line ending in ``fix``."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GraphkilnError(f"{path.name} in {path.parent} is not valid JSON ({str(exc)[:120]}): {fix}") from None
    if not isinstance(d, dict):
        raise GraphkilnError(f"{path.name} in {path.parent} is not a JSON object: {fix}")
    return d


def read_generation_config(src: Path) -> dict:
    """generation_config.json as a dict ({} when absent); malformed is an error, never ignored."""
    path = src / GENERATION_CONFIG
    if not path.is_file():
        return {}
    return _json_object(path, "fix it or delete it (graphkiln then uses greedy defaults)")


PREPROCESSOR_CONFIG = "preprocessor_config.json"


def read_preprocessor_config(src: Path) -> dict:
    """preprocessor_config.json as a dict: a vision-language checkpoint's image processor settings,
    required (the artifact must preprocess images exactly as the model was trained)."""
    path = src / PREPROCESSOR_CONFIG
    if not path.is_file():
        raise GraphkilnError(f"{src} has no {PREPROCESSOR_CONFIG}: a vision-language checkpoint needs its image "
                             "processor's settings; save the processor with the model (processor.save_pretrained)")
    return _json_object(path, "fix it or re-save the processor")


def generation_defaults(src: Path, raw_config: dict, vocab_size: int | None = None,
                        note: Callable[[str], None] = lambda msg: None) -> GenerationDefaults:
    """The sampling defaults an artifact records, from generation_config.json (else config.json).

    Every value is checked: an ill-typed or out-of-range value is a GraphkilnError naming the file
    and key. Token ids must be in the vocabulary, except ``pad_token_id``: nothing depends on it
    (the runtime pads with its own id), so an unusable one is dropped (None) with a ``note``.
    """
    gen = read_generation_config(src)

    def pick(key: str):
        if gen.get(key) is not None:
            return gen[key], GENERATION_CONFIG
        return raw_config.get(key), "config.json"

    def token_id(key: str, value, file: str) -> int:
        if not _is_int(value) or value < 0 or (vocab_size is not None and value >= vocab_size):
            where = f" in [0, {vocab_size})" if vocab_size is not None else " >= 0"
            raise _bad(file, key, value, f"a token id{where}")
        return value

    eos, file = pick("eos_token_id")
    eos_ids = () if eos is None else tuple(token_id("eos_token_id", v, file) for v in (eos if isinstance(eos, list) else [eos]))
    bos, file = pick("bos_token_id")
    bos_id = None if bos is None else token_id("bos_token_id", bos, file)
    pad, file = pick("pad_token_id")
    pad_id = None
    if pad is not None:
        if isinstance(pad, list) and len(pad) == 1:
            pad = pad[0]
        if not _is_int(pad):
            raise _bad(file, "pad_token_id", pad, "a token id")
        if pad < 0 or (vocab_size is not None and pad >= vocab_size):
            note(f"      note: pad_token_id {pad} in {file} is outside the vocabulary ({vocab_size} tokens); "
                 "not recorded (padding does not use it)")
        else:
            pad_id = pad

    do_sample = gen.get("do_sample", False)
    if do_sample is None:
        do_sample = False
    if not isinstance(do_sample, bool):
        raise _bad(GENERATION_CONFIG, "do_sample", do_sample, "true or false")

    def number(key: str, default: float, ok: Callable[[float], bool], expected: str) -> float:
        value = gen.get(key)
        if value is None:
            return default
        if not _is_number(value) or not ok(value):
            raise _bad(GENERATION_CONFIG, key, value, expected)
        return float(value)

    def count(key: str, default: int) -> int:
        value = gen.get(key)
        if value is None:
            return default
        if not _is_int(value) or value < 0:
            raise _bad(GENERATION_CONFIG, key, value, "an integer >= 0")
        return value

    # 0 (or null) means "unset" for these, as it did before they were checked.
    temperature = number("temperature", 1.0, lambda v: v >= 0, "a number >= 0") or 1.0
    top_p = number("top_p", 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    return GenerationDefaults(
        eos_token_ids=eos_ids,
        bos_token_id=bos_id,
        pad_token_id=pad_id,
        do_sample=do_sample,
        temperature=temperature,
        top_k=count("top_k", 0),
        top_p=top_p,
        max_new_tokens=count("max_new_tokens", 128) or 128,
    )
