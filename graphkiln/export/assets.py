"""Non-graph files an artifact carries: tokenizer files, the chat template and generation defaults.

They are untrusted input that export copies or derives into the artifact, so an export either
refuses them in one line or publishes files that ``run``, ``chat`` and ``serve`` accept:

- every file is read once, through ``models.checkpoint_files`` (regular files inside the
  checkpoint only), before the output directory exists, and the bytes that were checked are the
  bytes the artifact gets (``TokenizerAssets.write``), never the checkpoint's file read again;
- they are checked by the runtime's own loaders on a staged copy laid out as in the artifact:
  tokenizer.json loads with ``runtime.request.tokenizer.Tokenizer`` and round-trips a sample
  text, in ids inside the model's vocabulary; tokenizer_config.json and special_tokens_map.json
  are JSON objects; a chat template, when there is one, loads with
  ``runtime.request.chat_template.ChatTemplate`` (the sandbox the server and ``graphkiln chat``
  use) and renders a sample conversation to non-empty text, in ids inside the vocabulary (a
  template's special tokens added past the embeddings would fail every chat request), and the
  special tokens it is given (``bos_token``, ``eos_token``) are tokens of the tokenizer;
- generation_config.json's values are checked (``generation_defaults``), and
  preprocessor_config.json must be a JSON object (its values are the vision family's to check).
"""

from __future__ import annotations

import fnmatch
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GenerationDefaults
from graphkiln.models import checkpoint_files
from graphkiln.untrusted import show

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
GENERATION_CONFIG = "generation_config.json"
# what transformers may read to convert a slow (sentencepiece, vocab/merges) tokenizer
SLOW_TOKENIZER_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                           "*.model")
MAX_TOKENIZER_BYTES = 256 << 20  # the largest real tokenizer.json files are tens of MB
TOKENIZER_FIX = "fix or re-save the tokenizer (save_pretrained), or delete the file to export without it"
TEMPLATE_FIX = ("fix the chat template (chat_template.jinja, or chat_template in tokenizer_config.json), or delete "
                "it to export without one")
# what the tokenizer must round-trip: plain ASCII every language model's tokenizer spells
SAMPLE_TEXT = "Hello, world! The answer is 42."
# the conversation a chat template must render; without the system turn when it refuses one (some
# templates do: Gemma's), but never when it refuses this conversation
SAMPLE_SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
SAMPLE_CONVERSATION = ({"role": "user", "content": "Hello, who are you?"},
                       {"role": "assistant", "content": "I am a language model."},
                       {"role": "user", "content": "What is 2 + 2?"})


@dataclass(frozen=True)
class TokenizerAssets:
    """The tokenizer files an artifact carries, by name, as read from the checkpoint and checked
    (``read_tokenizer_assets``); the order of ``TOKENIZER_FILES``."""

    files: dict[str, bytes]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.files)

    def write(self, dst: Path) -> tuple[str, ...]:
        """Write the files into the artifact directory ``dst``; returns their names."""
        for name, data in self.files.items():
            (dst / name).write_bytes(data)
        return self.names


def read_tokenizer_assets(src: Path, vocab_size: int) -> TokenizerAssets:
    """The checkpoint's tokenizer files, read and checked as the module docstring says; a slow-only
    tokenizer is converted to tokenizer.json when transformers can (the runtime uses the
    ``tokenizers`` library alone), else the artifact runs on token ids."""
    files = {}
    for name in TOKENIZER_FILES:
        data = checkpoint_files.read_bytes(src, name, TOKENIZER_FIX, MAX_TOKENIZER_BYTES)
        if data is not None:
            files[name] = data
    if "tokenizer.json" not in files:
        converted = _convert_slow_tokenizer(src)
        if converted is not None:
            files["tokenizer.json"] = converted
            files = {name: files[name] for name in TOKENIZER_FILES if name in files}
    check_tokenizer_assets(files, vocab_size, src)
    return TokenizerAssets(files)


def _convert_slow_tokenizer(src: Path) -> bytes | None:
    """tokenizer.json made by transformers from a slow tokenizer's files, or None."""
    slow = [p for p in sorted(src.iterdir()) if any(fnmatch.fnmatch(p.name, pat) for pat in SLOW_TOKENIZER_PATTERNS)]
    if not any(p.name.endswith(".model") for p in slow):
        return None
    for path in slow:  # transformers opens them by name: each must be a regular file of the checkpoint
        checkpoint_files.check_file(path, src, TOKENIZER_FIX)
    try:
        from transformers import AutoTokenizer

        with tempfile.TemporaryDirectory(prefix="graphkiln-tokenizer-") as tmp:
            # Never the checkpoint's own tokenizer code (export refuses auto_map before this;
            # trust_remote_code=False also keeps transformers from asking on a terminal).
            AutoTokenizer.from_pretrained(str(src), trust_remote_code=False).backend_tokenizer.save(
                str(Path(tmp) / "tokenizer.json"))
            return (Path(tmp) / "tokenizer.json").read_bytes()
    except Exception:
        return None  # no usable tokenizer: the artifact still runs on token ids


def check_tokenizer_assets(files: dict[str, bytes], vocab_size: int, src: Path) -> None:
    """Refuse, in one line, tokenizer files the runtime would reject or misuse (see the module
    docstring); ``files`` are staged in a temporary directory laid out as the artifact and loaded
    from there by the runtime's own code."""
    from graphkiln.runtime.request.chat_template import ChatTemplate
    from graphkiln.runtime.request.tokenizer import Tokenizer

    parsed = {name: checkpoint_files.parse_json(files[name], name, src, TOKENIZER_FIX)
              for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") if name in files}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if name in parsed and not isinstance(parsed[name], dict):
            raise GraphkilnError(f"{name} in {show(str(src), 120)} is not a JSON object: {TOKENIZER_FIX}")
    config = parsed.get("tokenizer_config.json", {})
    with tempfile.TemporaryDirectory(prefix="graphkiln-assets-") as stage:
        stage = Path(stage)
        for name, data in files.items():
            (stage / name).write_bytes(data)
        tokenizer = None
        if "tokenizer.json" in files:
            try:
                tokenizer = Tokenizer(stage / "tokenizer.json")
            except GraphkilnError as exc:  # the runtime's message says "re-export": the cause is the checkpoint's
                cause = exc.__context__ or exc
                raise GraphkilnError(f"the checkpoint's tokenizer.json cannot be loaded by the tokenizers library "
                                     f"({show(' '.join(str(cause).split()), 160)}): {TOKENIZER_FIX}") from None
            _check_tokenizer(tokenizer, parsed["tokenizer.json"], vocab_size)
        if "chat_template.jinja" in files or config.get("chat_template") is not None:
            if tokenizer is not None:  # without one the artifact runs on token ids, and chat is refused by design
                _check_chat_template(ChatTemplate.load(stage, tuple(files), tokenizer=tokenizer), tokenizer,
                                     vocab_size)


def _check_tokenizer(tokenizer, spec, vocab_size: int) -> None:
    """``SAMPLE_TEXT`` encodes to ids inside the model's vocabulary that decode to it again (unless
    the vocabulary cannot spell it: unknown tokens). Tokens past the vocabulary are allowed
    elsewhere (transformers' GGUF conversion adds one): a prompt holding one is refused per request."""
    model = spec.get("model") if isinstance(spec, dict) else None
    unknown = set()
    if isinstance(model, dict):
        if isinstance(model.get("unk_token"), str) and tokenizer.backend.token_to_id(model["unk_token"]) is not None:
            unknown.add(tokenizer.backend.token_to_id(model["unk_token"]))
        if isinstance(model.get("unk_id"), int):
            unknown.add(model["unk_id"])
    ids = tokenizer.encode(SAMPLE_TEXT, add_special_tokens=False)
    if not ids:
        raise GraphkilnError(f"the checkpoint's tokenizer.json encodes the text {SAMPLE_TEXT!r} to no tokens: "
                             f"{TOKENIZER_FIX}")
    _check_ids(tokenizer, ids, vocab_size, f"the text {SAMPLE_TEXT!r}")
    if not unknown.intersection(ids):
        decoded = tokenizer.decode(ids)
        if decoded != SAMPLE_TEXT:
            raise GraphkilnError(f"the checkpoint's tokenizer.json does not round-trip text ({SAMPLE_TEXT!r} decodes "
                                 f"back as {show(decoded, 60)}; is its decoder missing?): {TOKENIZER_FIX}")


def _check_ids(tokenizer, ids: list[int], vocab_size: int, what: str) -> None:
    """Every id of ``what`` inside the model's vocabulary (the runtime refuses a prompt otherwise)."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise GraphkilnError(f"the checkpoint's tokenizer.json encodes {what} with token "
                             f"{show(tokenizer.token_text(bad), 60)} as id {bad}, outside the model's vocabulary "
                             f"[0, {vocab_size}) (config.json's vocab_size): use the model's own tokenizer, or resize "
                             "the model's embeddings to the tokenizer")


def _check_chat_template(template, tokenizer, vocab_size: int) -> None:
    """The chat template loads, renders ``SAMPLE_CONVERSATION`` (with a system turn, or without
    one when the template refuses it) to non-empty text whose ids are inside the vocabulary, and
    the special tokens it is given are tokens."""
    from graphkiln.runtime.request.chat_template import ChatTemplateError

    if template.problem is not None:
        raise GraphkilnError(f"the checkpoint's chat template cannot be used ({template.problem}): {TEMPLATE_FIX}")
    for key, text in (("bos_token", template.bos_token), ("eos_token", template.eos_token)):
        if text and tokenizer.backend.token_to_id(text) is None:
            raise GraphkilnError(f"tokenizer_config.json's {key} {show(text, 60)}, which the chat template is given, "
                                 f"is not a token of tokenizer.json: {TOKENIZER_FIX}")
    try:
        try:
            rendered = template.render([SAMPLE_SYSTEM, *SAMPLE_CONVERSATION])
        except ChatTemplateError:
            rendered = template.render(list(SAMPLE_CONVERSATION))
    except ChatTemplateError as exc:
        # the runtime's message without its fix (it names the artifact's template, not the checkpoint's)
        message = str(exc)
        problem = message.rsplit("): ", 1)[0] + ")" if "): " in message else message
        raise GraphkilnError(f"the checkpoint's chat template cannot render a plain user/assistant conversation "
                             f"({show(problem, 200)}): {TEMPLATE_FIX}") from None
    if not rendered.strip():
        raise GraphkilnError(f"the checkpoint's chat template renders a conversation as empty text, so every chat "
                             f"prompt would be empty: {TEMPLATE_FIX}")
    _check_ids(tokenizer, tokenizer.encode(rendered, add_special_tokens=False), vocab_size,
               "the chat template's sample conversation")


def _bad(file: str, key: str, value, expected: str) -> GraphkilnError:
    from graphkiln.models.config import config_error

    return config_error(key, value, expected, file)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def read_generation_config(src: Path) -> dict:
    """generation_config.json as a dict ({} when absent); malformed is an error, never ignored."""
    gen = checkpoint_files.read_json_object(src, GENERATION_CONFIG,
                                            "fix it or delete it (graphkiln then uses greedy defaults)")
    return {} if gen is None else gen


PREPROCESSOR_CONFIG = "preprocessor_config.json"


def read_preprocessor_config(src: Path) -> dict:
    """preprocessor_config.json as a dict: a vision-language checkpoint's image processor settings,
    required (the artifact must preprocess images exactly as the model was trained)."""
    config = checkpoint_files.read_json_object(src, PREPROCESSOR_CONFIG, "fix it or re-save the processor")
    if config is None:
        raise GraphkilnError(f"{show(str(src), 120)} has no {PREPROCESSOR_CONFIG}: a vision-language checkpoint needs "
                             "its image processor's settings; save the processor with the model "
                             "(processor.save_pretrained)")
    return config


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
