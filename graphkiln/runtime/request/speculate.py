"""Speculative decoding: propose k draft tokens, verify them in one graph run of the row, accept.

Drafts come from one of two sources:
  ``ngram``  prompt lookup (``ngram_draft``): the longest suffix of the sequence (3 down to 2
             tokens) that occurred earlier, and the k tokens that followed its latest earlier
             occurrence (vLLM's and onnxruntime-genai's prompt lookup). No second model.
  ``draft``  a smaller artifact of the same tokenizer (``runtime.draft_model``): k steps of it
             from its own cache, greedy or sampled with the request's own settings.

Verify: the row's run feeds its last token and the k drafts at once, with logits (or, for a
greedy row that needs no logits, the graph's folded argmax) at each of the k+1 positions.
onnxruntime's GroupQueryAttention takes several new tokens onto a filled cache only for a batch
of one, so each speculating row is verified in a run of its own (``request.step``).

Accept (``accept``): greedy keeps the longest prefix of drafts equal to the argmax before each,
then the argmax after the last accepted one, which is exactly plain greedy decoding. Sampled rows
use the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): draft d at position
i is kept with probability min(1, p_i(d) / q_i(d)), p the request's own sampling distribution
(``sampling.probabilities``) and q the draft's (a point mass for prompt lookup); the first
rejected one is replaced by a sample from max(0, p_i - q_i), renormalised; if all k are kept,
one more is drawn from p_k. Each committed token is then distributed exactly as in plain
sampling (the random draws differ, so a seed gives other samples than without speculation).
A step always commits at least one token.

Roll back: KV rows are stored at cache position == token position and read only below each
row's start, so the rows of rejected drafts are never read and later runs overwrite them.
Conv and recurrent slot states have consumed the rejected drafts too: the step snapshots the
row's slot states before the run and, when a draft was rejected, restores them and runs the
accepted tokens again (``request.step``), which costs a second run of the row only on rejection.

Adaptive (``Speculator``): a request whose recent drafts are mostly rejected proposes fewer,
then pauses; with other rows decoding, a row is verified apart only when its recent acceptance
promises more tokens than the run it adds costs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show


SOURCES = ("ngram", "draft")


# the whole spelling, ASCII only: int() would also take "٣" or "３", and "ngram:" is not a K
_SETTING = re.compile(r"(ngram|draft)(?::([1-9][0-9]?))?", re.ASCII)


def parse_speculative(text: str | None) -> tuple[str, int] | None:
    """``"ngram[:K]"`` / ``"draft[:K]"`` -> (source, K draft tokens, default 4); None and "off" -> None.
    K is 1 to 16 in ASCII digits without sign, space or leading zero; anything else (an empty K,
    another script's digits) is one GraphkilnError line."""
    if text is None or text == "off":
        return None
    found = _SETTING.fullmatch(text) if isinstance(text, str) else None
    if found is None or (found[2] is not None and int(found[2]) > 16):
        raise GraphkilnError(f"speculative {show(text, 40)} is not supported: use 'ngram[:K]' (prompt-lookup "
                             "drafts), 'draft[:K]' (a draft model's) with K from 1 to 16, or 'off'")
    return found[1], int(found[2]) if found[2] else 4


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
class Proposal:
    """A row's drafts and, for sampled drafts of a draft model, the distribution each was drawn
    from ([k, vocab]); None: point drafts (q(d) = 1: prompt lookup, greedy draft models)."""

    tokens: list[int]
    q: np.ndarray | None = None


def accept(p_at: Callable[[int], np.ndarray], proposal: Proposal, rng: np.random.Generator) -> list[int]:
    """The tokens a sampled row commits after verification: ``p_at(i)`` its sampling distribution
    at verified position i (float64, summing to 1; asked for only up to the first rejection: top-p
    sorts the vocabulary); the rejection rule of the module docstring. Between 1 and k+1 tokens."""
    chosen: list[int] = []
    for i, d in enumerate(proposal.tokens):
        p = p_at(i)
        q_d = 1.0 if proposal.q is None else float(proposal.q[i, d])
        if rng.random() * q_d < p[d]:  # probability min(1, p/q): q_d > 0, the draft was drawn from it
            chosen.append(d)
            continue
        if proposal.q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - proposal.q[i], 0.0)
        total = residual.sum()
        # zero only when p <= q everywhere, i.e. p == q: a rejection then had probability 0
        chosen.append(int(rng.choice(len(residual), p=residual / total)) if total > 0 else int(rng.choice(len(p), p=p)))
        return chosen
    p = p_at(len(proposal.tokens))
    chosen.append(int(rng.choice(len(p), p=p)))
    return chosen


def accept_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """The tokens a greedy row commits: the drafts equal to the argmax before each, then the argmax after."""
    n = 0
    while n < len(drafts) and argmax[n] == drafts[n]:
        n += 1
    return argmax[: n + 1]


# What each drafted token adds to a verification run, in one-token steps of the target: a run over
# 1 + k tokens took 1.18x (k=1) and 1.23x (k=2) a decode step (SmolLM2-135M fp32, 2 cores).
VERIFY_GROWTH = 0.1
# The expected speed-up below which costly drafts pause: an int4 SmolLM2-135M draft of the fp32
# one, predicted 1.09x at k=1, ran at 0.85-0.9x (2 cores)
MIN_GAIN = 1.2
# The acceptance a costly draft is assumed to have before it has any (good drafts reach 0.7-0.9)
PRIOR_ACCEPTANCE = 0.8


@dataclass
class Speculator:
    """One request's speculation: ``k`` drafts per step from ``source``, and the recent acceptance
    that shortens them, pauses the request for a while when they keep failing (below
    ``min_rate`` over the last ``window`` proposals: off for ``pause`` steps), and decides whether
    verifying the row apart from a batch is worth its run (``worth``). A draft model's cache of
    this request is ``draft_slot`` (claimed on the first proposal, released with the request)
    holding its first ``draft_done`` tokens valid, ``draft_fed`` fed; a hybrid draft's slot states
    as they were after ``draft_saved[0]`` tokens are ``draft_saved[1]``."""

    k: int
    source: str = "ngram"
    window: int = 8
    min_rate: float = 0.2
    pause: int = 16
    proposed: int = 0
    accepted: int = 0
    steps: int = 0  # verification runs
    history: list[tuple[int, int, int]] = field(default_factory=list)
    paused: int = 0
    backoff: int = 0  # pauses in a row for want of gain: the next is ``pause * backoff`` steps (at most 16x)
    draft_slot: int | None = None
    draft_done: int = 0
    draft_fed: int = 0
    draft_saved: tuple | None = None

    def size(self, room: int, cost: float = 0.0) -> int:
        """How many drafts to propose now (0: not this step). ``cost``: a draft token's cost in
        target runs (``DraftModel.cost``; 0 for prompt lookup). Depends only on the request's own
        history, so a seeded sampled request draws the same numbers whatever else runs. Free
        drafts: k, halved while fewer than half are accepted. Costly ones: the k that maximises
        the expected tokens per unit of time, (1 - a^(k+1)) / ((1 - a)(1 + k (cost + VERIFY_GROWTH))), a the
        recent per-draft acceptance (Leviathan et al. 2023, eq. 1 and theorem 3.8); when no k is
        expected to beat plain decoding by ``MIN_GAIN`` (what the model leaves out: catching the
        draft up, the step's own overhead), a pause, twice as long each time in a row. Without
        history (at first, after a pause) a is ``PRIOR_ACCEPTANCE``, so a draft too costly to pay
        even then is never tried."""
        if self.paused:
            self.paused -= 1
            return 0
        room = max(0, room)
        proposed = sum(h[0] for h in self.history)
        accepted = sum(h[1] for h in self.history)
        if cost <= 0:  # recent drafts mostly rejected: shorter ones (a verification run costs more per token)
            return min(self.k if 2 * accepted >= proposed else max(2, self.k // 2), room)
        a = min(max(accepted / max(1, sum(h[2] for h in self.history)), 0.01), 0.99) if proposed else PRIOR_ACCEPTANCE
        gain = {k: (1 - a ** (k + 1)) / ((1 - a) * (1 + k * (cost + VERIFY_GROWTH))) for k in range(1, self.k + 1)}
        best = max(gain, key=gain.get)
        if gain[best] < MIN_GAIN:
            self.backoff = min(2 * self.backoff, 16) if self.backoff else 1
            self.paused, self.history = self.pause * self.backoff, []
            return 0
        if proposed:  # paid off on its own record: pauses start short again
            self.backoff = 0
        return min(best, room)

    def worth(self, rows: int) -> bool:
        """Whether verifying this row in a run of its own beats leaving it in a decode run of
        ``rows`` rows. Decode on a CPU reads every weight once per run whatever its rows, so taking
        the row out costs about one run, which the batch spends on ``rows`` tokens: worth it when
        more drafts than that are expected to be accepted (its recent rate; a first try is
        granted at half the drafts)."""
        if rows <= 1:
            return True
        proposed = sum(h[0] for h in self.history)
        expected = self.k * (sum(h[1] for h in self.history) / proposed if proposed else 0.5)
        return expected > rows

    def record(self, proposed: int, accepted: int) -> None:
        """One verification's outcome; ``history`` keeps (proposed, accepted, tested) of the last
        ``window``, tested counting the drafts that were compared (all before the first rejection,
        and it)."""
        self.proposed += proposed
        self.accepted += accepted
        self.steps += 1
        self.history = (self.history + [(proposed, accepted, accepted + (accepted < proposed))])[-self.window:]
        p = sum(h[0] for h in self.history)
        if len(self.history) == self.window and sum(h[1] for h in self.history) < self.min_rate * p:
            self.paused, self.history = self.pause, []

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0
