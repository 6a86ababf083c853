"""What crosses the runtime API boundary: generation settings, streamed events, results."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class GenerationConfig:
    """Per-call settings. ``None`` means "use the artifact's generation defaults".

    ``stop_token_ids`` None uses the artifact's EOS ids; pass ``()`` to disable stopping on
    tokens. ``logprobs`` None returns no log-probabilities; n >= 0 returns the chosen
    token's log-probability plus the n most likely alternatives. Log-probabilities are of
    the model's distribution (log_softmax of the raw logits, before temperature/top-k/top-p).
    Sampling for request i uses its own generator seeded by (seed, i), so a request's
    samples do not depend on what else is in the batch.
    """

    max_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_token_ids: tuple[int, ...] | None = None
    stop_strings: tuple[str, ...] = ()
    logprobs: int | None = None
    output_logits: bool = False  # keep each step's raw logits (for parity checks)


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token of one request, as ``Engine.stream`` yields it.

    ``text`` is the text this token made final (may be empty while a multi-byte character
    or a possible stop string is pending). ``finish_reason`` is set on a request's last event.
    """

    request: int
    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "stop" (token or string), "length"
    logprobs: list[TokenLogprob] | None = None
    logits: np.ndarray | None = None  # [steps, vocab] when output_logits
