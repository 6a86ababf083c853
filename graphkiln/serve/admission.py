"""What admitting one request may cost before and while its prompt is tokenized.

Tokenizing is the expensive part of admitting a request: a 7 MB text prompt costs seconds of a
core and gigabytes for its ``Encoding``, only to be refused as too long. Three bounds keep such
requests from delaying small ones or exhausting memory:

1. **Unseen refusal** (``chars_per_token_bound``). From the tokenizer's pipeline, read once at
   load, the most characters of prompt text one token can stand for (``M``). A text of ``C``
   characters then has at least ``ceil(C / M)`` tokens, so ``C > (max_seq_len - 1) * M`` is
   refused as too long without tokenizing it, and no prompt that would fit ever is. ``M`` is
   the longest vocabulary entry (token strings: ByteLevel writes one character per byte, so a
   string is never shorter than the text it covers) times what the normalizer can shrink text
   by. It exists only when the pipeline provably lets every character of the text land in some
   token: a normalizer or pre-tokenizer that deletes characters, unknown-token fusing, whole-word
   unknowns (WordPiece, WordLevel), truncation, or added tokens that swallow whitespace would let
   a long text become few tokens, so such a tokenizer gets no bound and every prompt is tokenized
   (under the two bounds below).
2. **Lanes** (``Lanes``). Parsing, validating, rendering chat templates, tokenizing and submitting
   run in worker threads, never on the event loop: bodies up to ``SMALL_BODY_BYTES`` in the small
   lane, bigger ones in the big lane (one thread), so big bodies wait behind each other and never
   in front of small ones. Tokenizing goes through ``encode_batch``, which releases the GIL
   (``encode`` holds it: a long one would stall the event loop and every other thread).
3. **Memory**. The big lane takes at most ``big_lane_bytes`` of bodies, queued or in progress; a big
   body beyond that is refused at once (the server's 429 with ``Retry-After``). With one big
   worker, at most one big prompt is being tokenized at a time.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

SMALL_BODY_BYTES = 64 << 10  # a prompt of ~16k tokens: milliseconds to parse and tokenize
SMALL_WORKERS = 2
DEFAULT_BIG_LANE_BYTES = 32 << 20  # four maximum-size bodies

# Normalizers that never shrink text: every character maps to one or more (case mappings and
# decompositions only expand; Prepend adds).
_EXPANDING_NORMALIZERS = {"Lowercase", "NFD", "NFKD", "Prepend", "ByteLevel"}
# NFC/NFKC compose: one output character stands for at most its canonical decomposition, at most
# 4 characters in any Unicode version (U+1F82); tests check this against unicodedata.
_COMPOSING_NORMALIZERS = {"NFC", "NFKC"}
MAX_DECOMPOSITION = 4
# Pre-tokenizers that split text without dropping any of it (Split/Punctuation unless "Removed").
_COVERING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation"}


def chars_per_token_bound(tokenizer: Any) -> int | None:
    """The most prompt characters one token of ``tokenizer`` (a ``tokenizers.Tokenizer``) can
    stand for, or None when its pipeline proves no bound (module docstring)."""
    spec = json.loads(tokenizer.to_str())
    if spec.get("truncation") is not None:
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_covers(spec.get("pre_tokenizer")):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if not _model_covers(spec.get("model") or {}, spec, vocab):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None  # an added token with lstrip/rstrip absorbs any run of whitespace beside it
    longest = max((len(t) for t in vocab), default=0)
    return longest * shrink if longest else None


def _normalizer_shrink(n: dict | None) -> int | None:
    """By how much ``n`` can shrink text (normalized characters per input character, at most
    1/factor); None when it can delete characters (or is not understood)."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        factor = 1
        for part in n.get("normalizers") or []:
            f = _normalizer_shrink(part)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in _EXPANDING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return MAX_DECOMPOSITION
    if kind == "Replace":
        pattern, content = (n.get("pattern") or {}).get("String"), n.get("content")
        if not isinstance(pattern, str) or not isinstance(content, str) or not content:
            return None  # a regex pattern, or replacing with nothing: unbounded deletion
        return max(1, -(-len(pattern) // len(content)))
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled: may delete characters


def _pre_tokenizer_covers(p: dict | None) -> bool:
    if p is None:
        return True
    kind = p.get("type")
    if kind == "Sequence":
        return all(_pre_tokenizer_covers(part) for part in p.get("pretokenizers") or [])
    return kind in _COVERING_PRE_TOKENIZERS and p.get("behavior") != "Removed"


def _model_covers(model: dict, spec: dict, vocab: dict[str, int]) -> bool:
    """Whether every character reaching the model becomes part of some token (an unknown one at
    worst), each token covering at most its own string."""
    kind = model.get("type")
    bytes_known = model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256))
    if kind == "Unigram":
        return bool(bytes_known)  # Unigram fuses consecutive unknown characters into one token
    if kind != "BPE":
        return False  # WordPiece and WordLevel make a whole unknown word one token
    if bytes_known or (model.get("unk_token") in vocab and not model.get("fuse_unk")):
        return True
    # ByteLevel maps every byte to one of 256 characters: with all in the vocabulary none is unknown
    return _uses_byte_level(spec) and all(c in vocab for c in _byte_level_alphabet())


def _uses_byte_level(spec: dict) -> bool:
    def walk(node, key):
        if not isinstance(node, dict):
            return False
        return node.get("type") == "ByteLevel" or any(walk(c, key) for c in node.get(key) or [])

    return walk(spec.get("pre_tokenizer"), "pretokenizers") or walk(spec.get("normalizer"), "normalizers")


def _byte_level_alphabet() -> set[str]:
    from tokenizers.pre_tokenizers import ByteLevel

    return set(ByteLevel.alphabet())


def min_tokens(chars: int, chars_per_token: int) -> int:
    """The fewest tokens a text of ``chars`` characters can become."""
    return -(-chars // chars_per_token)


class LaneFull(Exception):
    """The big lane already holds ``big_lane_bytes`` of bodies."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(in_flight)
        self.in_flight = in_flight


class Lanes:
    """Two worker pools for request preparation, chosen by body size (module docstring)."""

    def __init__(self, big_lane_bytes: int = DEFAULT_BIG_LANE_BYTES) -> None:
        self.small = ThreadPoolExecutor(SMALL_WORKERS, thread_name_prefix="graphkiln-prepare")
        self.big = ThreadPoolExecutor(1, thread_name_prefix="graphkiln-prepare-big")
        self.big_lane_bytes = big_lane_bytes
        self._big_in_flight = 0
        self._lock = threading.Lock()

    def submit(self, size: int, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` in the lane for a body of ``size`` bytes; LaneFull when the big lane
        is full (one body is always taken, however big, so the limit never refuses everything)."""
        if size <= SMALL_BODY_BYTES:
            return self.small.submit(fn, *args)
        with self._lock:
            if self._big_in_flight and self._big_in_flight + size > self.big_lane_bytes:
                raise LaneFull(self._big_in_flight)
            self._big_in_flight += size
        future = self.big.submit(fn, *args)
        future.add_done_callback(lambda _: self._release(size))  # also when cancelled before it ran
        return future

    def _release(self, size: int) -> None:
        with self._lock:
            self._big_in_flight -= size

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.big.shutdown(wait=False, cancel_futures=True)
