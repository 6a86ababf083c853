"""What crosses the runtime API boundary: generation settings, streamed events, results."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from graphkiln.errors import GraphkilnError


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
    # the last layer's hidden states after the final norm (an artifact exported with
    # --return-hidden-states): "last" one row per generated token (the position whose logits chose
    # it), "all" also every prompt position before that; see GenerationResult.hidden_states
    return_hidden_states: str | None = None
    # the prompt's own log-probabilities (evaluation harnesses' loglikelihood): None off; n >= 0
    # gives each prompt token after the first its log-probability given the tokens before it,
    # plus the n most likely alternatives (GenerationResult.prompt_logprobs). Computed by the
    # prefill run itself, chunk by chunk; with max_new_tokens 0 the request only prefills.
    prompt_logprobs: int | None = None
    # the LoRA adapter (by the name it was loaded under: Engine.load_adapter) this request's rows
    # use; None: the base model. Needs an artifact exported with --lora-rank.
    adapter: str | None = None
    # structured output (runtime.request.constraint), at most one: the generated text is JSON valid
    # against ``json_schema`` (a dict, or its JSON text; {"type": "object"}: any JSON object), or
    # matches ``regex``, or is in the Lark ``grammar`` (llguidance's dialect). Needs the artifact's
    # tokenizer.json; one that cannot be compiled is refused when the request is submitted.
    json_schema: dict | str | bool | None = None
    regex: str | None = None
    grammar: str | None = None
    # where the constraint starts (None: at the first generated token): Lark text (llguidance's
    # dialect) whose ``start`` rule places ``@constraint``, the constraint above, after free text of
    # its own, e.g. a reasoning model's thinking up to ``</think>`` (runtime.reasoning writes these
    # frames: the constraint applies to the answer, not to the thinking). Only with a constraint.
    constraint_frame: str | None = None
    # speculative decoding (runtime.request.speculate): "ngram[:K]" (K prompt-lookup drafts verified
    # per step, default 4), "draft[:K]" (a draft model's: Engine.load(..., draft=DIR)) or None/"off".
    # Greedy output is identical to plain decoding, sampled output has its distribution; requests
    # with a grammar or hidden states, and M-RoPE artifacts, decode as usual.
    speculative: str | None = None

    def __post_init__(self) -> None:
        """Refuse values that would crash deep inside numpy or silently mean something else
        (a NaN temperature ran greedy, an empty stop string stopped after one token)."""
        for name in ("max_new_tokens", "top_k", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is None and name != "seed":
                continue
            if not _is_int(value) or value < 0:
                raise GraphkilnError(f"{name} must be an integer >= 0, got {value!r}: pass e.g. {name}=0")
        if self.temperature is not None and not (_is_real(self.temperature) and 0 <= self.temperature < math.inf):
            raise GraphkilnError(f"temperature must be a finite number >= 0, got {self.temperature!r}: "
                                 "use 0 for greedy, e.g. 0.7 to sample")
        if self.top_p is not None and not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            raise GraphkilnError(f"top_p must be a number in (0, 1], got {self.top_p!r}: use 1 to disable it")
        if self.stop_token_ids is not None and not all(_is_int(t) for t in self.stop_token_ids):
            raise GraphkilnError(f"stop_token_ids must be integers, got {tuple(self.stop_token_ids)!r}")
        constraints = [n for n in ("json_schema", "regex", "grammar") if getattr(self, n) is not None]
        if len(constraints) > 1:
            raise GraphkilnError(f"{' and '.join(constraints)} are both set: give one constraint per request")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                raise GraphkilnError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        if self.constraint_frame is not None and (not constraints or not isinstance(self.constraint_frame, str)
                                                  or "@constraint" not in self.constraint_frame):
            raise GraphkilnError("constraint_frame must be Lark text placing @constraint, with one of json_schema, "
                                 f"regex, grammar set; got {self.constraint_frame!r:.80}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, str, bool)):
            raise GraphkilnError(f"json_schema must be a dict or its JSON text, got {type(self.json_schema).__name__}")
        if self.speculative is not None:
            from graphkiln.runtime.request.speculate import parse_speculative

            parse_speculative(self.speculative)
        if self.adapter is not None and not isinstance(self.adapter, str):
            raise GraphkilnError(f"adapter must be the name of a loaded LoRA adapter or None, got {self.adapter!r}")
        if self.return_hidden_states not in HIDDEN_STATE_MODES:
            raise GraphkilnError(f"return_hidden_states must be None, 'last' or 'all', got {self.return_hidden_states!r}")
        if isinstance(self.stop_strings, str) or not all(isinstance(s, str) and s for s in self.stop_strings):
            raise GraphkilnError(f"stop_strings must be a tuple of non-empty strings, got {self.stop_strings!r}: "
                                 "an empty stop string would stop after the first token")


HIDDEN_STATE_MODES = (None, "last", "all")


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    """An int or float (NaN included: range checks written as ``lo <= x <= hi`` refuse it)."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


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
    ``token_id`` is -1 (``runtime.request.request_state.NO_TOKEN``) on an event that carries no token: the
    last event of a request cancelled through the scheduler (finish_reason "cancelled").
    """

    request: int
    token_id: int
    text: str
    logprob: TokenLogprob | None
    finish_reason: str | None = None
    # with return_hidden_states: [hidden] final-norm state of the position whose logits chose this token
    hidden_state: np.ndarray | None = None


@dataclass
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    finish_reason: str | None = None  # "stop" (token or string), "length", "cancelled" (scheduler)
    logprobs: list[TokenLogprob] | None = None
    logits: np.ndarray | None = None  # [steps, vocab] when output_logits
    # with return_hidden_states (model dtype, [positions, hidden]): row i is the final-norm hidden
    # state at position first + i, where first is len(prompt_ids) - 1 ("last": row i chose
    # token_ids[i]) or 0 ("all"); the last generated token is never fed back, so it has no row.
    # The last len(token_ids) rows always line up with token_ids (and with logits).
    hidden_states: np.ndarray | None = None
    # with prompt_logprobs: one entry per prompt token, None for the first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache instead of a prefill
