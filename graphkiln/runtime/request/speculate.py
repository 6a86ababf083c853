"""Speculative decoding with prompt-lookup (n-gram) drafts: propose, verify in one graph call, accept.

Draft (``ngram_draft``): the longest suffix of the sequence (n = max_ngram down to 1 tokens) that
occurred earlier, and the k tokens that followed its latest earlier occurrence (vLLM's and
onnxruntime-genai's prompt lookup). No second model.

Verify: the row's step feeds its last token and the k drafts at once, with logits at every one of
the k+1 positions (the graph's folded argmax, ``next_token``). Greedy acceptance keeps the longest
prefix of drafts equal to the argmax at the position before each, then the argmax after the last
accepted one (always one new token, so a step never yields less than plain decoding). The result
is exactly plain greedy decoding: each committed token is the argmax given the committed tokens.

Roll back: KV rows are stored at cache position == token position and read only below each row's
start, so the rows of rejected drafts are never read and the next step overwrites them: nothing
to undo. Per-slot recurrent or conv state would have consumed the rejected drafts too, so
artifacts with slot states do not speculate (yet).

Adaptive: a request whose recent drafts are mostly rejected stops proposing for a while
(``Speculator``), so free-form text pays little for the attempt.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from graphkiln.errors import GraphkilnError


def parse_speculative(text: str | None) -> int | None:
    """``"ngram"`` / ``"ngram:K"`` -> K draft tokens (default 4); None stays None."""
    if text is None:
        return None
    kind, _, k = str(text).partition(":")
    if kind != "ngram" or (k and not (k.isdigit() and 1 <= int(k) <= 16)):
        raise GraphkilnError(f"speculative {text!r} is not supported: use 'ngram' or 'ngram:K' with K from 1 to 16 "
                             "(prompt-lookup drafts)")
    return int(k) if k else 4


def ngram_draft(tokens: list[int], k: int, max_ngram: int = 3, min_ngram: int = 2) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's longest
    repeated suffix (``min_ngram`` to ``max_ngram`` tokens: a single repeated token predicts too
    little to be worth a verification step); [] when none repeats."""
    n_tokens = len(tokens)
    if n_tokens < min_ngram + 1:
        return []
    seq = np.asarray(tokens, np.int64)
    for n in range(min(max_ngram, n_tokens - 1), min_ngram - 1, -1):
        suffix = seq[n_tokens - n:]
        # windows starting before the suffix itself, latest first
        windows = np.lib.stride_tricks.sliding_window_view(seq[: n_tokens - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        hits = hits[hits + n < n_tokens]
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start: start + k].tolist()
    return []


@dataclass
class Speculator:
    """One request's speculation: k drafts per step, and the recent acceptance that turns it off
    for a while when drafts keep failing (below ``min_rate`` over the last ``window`` proposals:
    off for ``pause`` steps)."""

    k: int
    window: int = 8
    min_rate: float = 0.2
    pause: int = 16
    proposed: int = 0
    accepted: int = 0
    history: list[tuple[int, int]] = field(default_factory=list)
    paused: int = 0

    def draft(self, tokens: list[int], room: int) -> list[int]:
        if self.paused:
            self.paused -= 1
            return []
        # recent drafts mostly rejected: shorter ones (a verification step costs more per token)
        recent = sum(p for p, _ in self.history)
        k = self.k if not recent or 2 * sum(a for _, a in self.history) >= recent else max(2, self.k // 2)
        return ngram_draft(tokens, min(k, room))

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.history = (self.history + [(proposed, accepted)])[-self.window:]
        p = sum(a for a, _ in self.history)
        if len(self.history) == self.window and sum(b for _, b in self.history) < self.min_rate * p:
            self.paused, self.history = self.pause, []

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
