"""Token selection and log-probabilities from one row of logits (numpy, float32)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return (x - np.log(np.exp(x).sum(axis=-1, keepdims=True))).astype(np.float32)


@dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``do_sample`` is false or temperature is 0; top_k 0 and top_p 1 disable those filters."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature <= 0


class NonFiniteLogits(ValueError):
    """The row to choose from has a NaN or +Inf (or is all -Inf): there is no distribution to
    choose from. The engine turns it into a GraphkilnError that names the request and step."""


def select_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits; raises ``NonFiniteLogits`` instead of choosing
    from a row with a NaN or +Inf, or with no finite value.

    The check costs no extra pass in the greedy path: argmax returns the first NaN's index if
    there is one, so the chosen logit is non-finite exactly when the row is unusable (-Inf
    elsewhere is a legitimate zero probability). Sampling takes the row's max, which NaN
    propagates through.
    """
    if params.greedy:
        token = int(np.argmax(logits))
        if not np.isfinite(logits[token]):
            raise NonFiniteLogits(token)
        return token
    probs = probabilities(logits, params)
    return int(rng.choice(probs.shape[-1], p=probs))


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a sampled request draws its next token from (temperature, then top-k,
    then top-p), float64 summing to 1; speculative sampling (``request.speculate``) accepts and
    resamples against exactly this distribution. Raises ``NonFiniteLogits`` as ``select_token``."""
    top = logits.max()
    if not np.isfinite(top):
        raise NonFiniteLogits(top)
    # Shift before dividing: the max becomes 0 whatever the temperature, so a tiny temperature
    # sends the rest to -inf (probability 0) instead of overflowing to inf - inf = NaN.
    with np.errstate(over="ignore"):  # overflow here is to -inf: probability 0, as meant
        x = (logits.astype(np.float64) - float(top)) / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x)
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        cut = int(np.searchsorted(cumulative, params.top_p)) + 1
        keep = np.zeros_like(probs, dtype=bool)
        keep[order[:cut]] = True
        probs = np.where(keep, probs, 0.0)
        probs /= probs.sum()
    return probs


def top_logprobs(logprobs: np.ndarray, n: int) -> list[tuple[int, float]]:
    if n <= 0:
        return []
    idx = np.argpartition(-logprobs, n - 1)[:n] if n < logprobs.shape[-1] else np.arange(logprobs.shape[-1])
    idx = idx[np.argsort(-logprobs[idx], kind="stable")]
    return [(int(i), float(logprobs[i])) for i in idx]
