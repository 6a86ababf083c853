"""Perplexity of an artifact on a text: the quality measure quantized artifacts are judged by.

The text is tokenized once and cut into consecutive windows of ``window`` tokens (the last may be
shorter); each window is one prompt-only request (``prompt_logprobs``), so every token after a
window's first is scored given the tokens before it in its window. Perplexity is
``exp(mean negative log-likelihood)`` over all scored tokens. The same windows scored by the
transformers reference (``export.verify``) give the fp32 figure a quantized artifact is compared with.

``BUILTIN_TEXT`` (graphkiln/data/prose.txt) is ~1,650 words of plain English prose written for this
project (a story with expository passages on baking, history and economics), so no licence travels
with it and no model was trained on it verbatim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

BUILTIN_TEXT = Path(__file__).parent / "data" / "prose.txt"
DEFAULT_WINDOW = 512


@dataclass(frozen=True)
class Perplexity:
    """The mean negative log-likelihood over ``tokens`` scored tokens, and its exponential."""

    nll: float
    tokens: int

    @property
    def value(self) -> float:
        return math.exp(self.nll)


def read_text(path: str | Path | None) -> str:
    """The text to score: ``path``'s (UTF-8), or the built-in prose; one error line if unreadable."""
    path = Path(path) if path is not None else BUILTIN_TEXT
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphkilnError(f"cannot read the text {path} ({exc}): pass a readable UTF-8 text file") from None
    if not text.strip():
        raise GraphkilnError(f"the text {path} is empty: pass a file with some prose in it")
    return text


def windows(ids: list[int], window: int, max_len: int) -> list[list[int]]:
    """Consecutive windows of ``min(window, max_len - 1)`` tokens (a prompt must leave the artifact
    room for one more position; a last, shorter window kept if it scores anything: two tokens or more)."""
    if window < 2:
        raise GraphkilnError(f"window must be at least 2 tokens, got {window}")
    size = max(2, min(window, max_len - 1))
    out = [ids[i:i + size] for i in range(0, len(ids), size)]
    out = [w for w in out if len(w) >= 2]
    if not out:
        raise GraphkilnError("the text is shorter than two tokens: pass a longer text")
    return out


def artifact_perplexity(engine, text: str, window: int = DEFAULT_WINDOW) -> Perplexity:
    """Perplexity of ``engine``'s artifact on ``text`` (see the module docstring)."""
    from graphkiln.runtime import GenerationConfig

    if engine.tokenizer is None:
        raise GraphkilnError("the artifact has no tokenizer.json, so a text cannot be scored: re-export it with its tokenizer")
    ids = engine.tokenizer.encode(text)
    parts = windows(ids, window, engine.max_seq_len)
    config = GenerationConfig(max_new_tokens=0, prompt_logprobs=0)
    nll, count = 0.0, 0
    for part in parts:  # one window at a time: the batch's memory stays one window's
        (result,) = engine.generate([part], config)
        scored = [lp.logprob for lp in result.prompt_logprobs[1:]]
        nll -= float(np.sum(scored, dtype=np.float64))
        count += len(scored)
    return Perplexity(nll / count, count)
