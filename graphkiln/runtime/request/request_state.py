"""A request's mutable state while it lives, from admission to result (``RequestState``).

Made by ``make_request`` from a prepared prompt (``request.prepare``) and resolved settings;
stepped by ``request.step.StepBatch``; its events committed by ``request.commit``; turned into
what ``generate`` returns by ``result_of``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.prompt_layout import PromptLayout
from graphkiln.runtime.request.sampling import SamplingParams
from graphkiln.runtime.request.speculate import Speculator, parse_speculative
from graphkiln.runtime.request.tokenizer import IncrementalDetokenizer
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent, TokenLogprob

if TYPE_CHECKING:
    from graphkiln.runtime.request.constraint import Constraint
    from graphkiln.runtime.request.prepare import Prepared, Preparer
    from graphkiln.runtime.request.scheduler import RequestHandle

NO_TOKEN = -1  # token_id of an event that carries no token (a cancellation's last event)

class NonFiniteLogitsError(GraphkilnError):
    """The model produced NaN/Inf logits for ``request`` when choosing its ``step``-th token
    (1-based); a broken artifact, never a sampling setting."""

    def __init__(self, request: int, step: int) -> None:
        super().__init__(f"the model produced NaN/Inf logits at step {step} of request {request}: the artifact's "
                         "weights are broken; re-export (graphkiln verify shows where)")
        self.request, self.step = request, step


@dataclass(eq=False)
class RequestState:
    """Mutable state of one request. ``slot`` is its state-pool slot (also its batch row) while
    it runs, None before it starts and after it is released; ``done`` counts its prompt tokens
    already in the cache (prefill is over when ``done == len(prompt_ids)``). ``events`` holds
    the events of the current step until the driver hands them on."""

    index: int
    prompt_ids: list[int]
    budget: int
    rng: np.random.Generator | None
    tokens: list[int] = field(default_factory=list)
    text: str = ""  # decoded so far; complete characters only until the request finishes
    detokenizer: IncrementalDetokenizer | None = None
    emitted: int = 0  # characters of text already streamed
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # filled as prefill runs
    logits: list[np.ndarray] = field(default_factory=list)
    hidden: list[np.ndarray] = field(default_factory=list)  # return_hidden_states: [k, hidden] rows, in position order
    slot: int | None = None
    images: list = field(default_factory=list)  # ImageInput, in prompt order; dropped once encoded
    image_positions: np.ndarray | None = None  # prompt position of each image embedding row, in order
    image_rows: np.ndarray | None = None  # [len(image_positions), hidden], once encoded
    layout: PromptLayout | None = None  # per-token extras (M-RoPE positions, image lookahead); None: plain text
    cfg: GenerationConfig | None = None  # resolved (no None defaults left)
    params: SamplingParams | None = None
    stop_ids: frozenset[int] = frozenset()
    done: int = 0
    cancel_requested: bool = False
    error: BaseException | None = None
    events: list[TokenEvent] = field(default_factory=list)
    handle: "RequestHandle | None" = None
    # prefix reuse (request.prefix): (start, end, content hash) of each image's placeholder span;
    # the keys of the sequence's full blocks computed so far; how many of them are in the store
    # (or came from it); the prompt tokens taken from the store instead of computed
    image_spans: tuple[tuple[int, int, str], ...] = ()
    keys: list[bytes] = field(default_factory=list)
    saved_blocks: int = 0
    cached_tokens: int = 0
    # LoRA (runtime.lora.AdapterPool): the adapter slot this request's rows use, held from submission
    # (``Scheduler.submit``; an Engine call's requests: admission, ``StepBatch.plan``) to release;
    # None: not acquired yet (0 once acquired: the base model). Its identity salts the prefix keys,
    # so blocks are never shared across adapters.
    adapter_slot: int | None = None
    adapter_salt: bytes = b""
    # structured output: the request's grammar matcher and next-step mask (request.constraint); None: free
    constraint: "Constraint | None" = None
    # speculative decoding (request.speculate): drafts and their acceptance; None: one token a step
    speculator: "Speculator | None" = None

    @property
    def position(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def folds(self) -> bool:
        """Whether the graph's argmax can choose this request's next token (no logits needed)."""
        return (self.params.greedy and self.cfg.logprobs is None and not self.cfg.output_logits
                and self.constraint is None)

    @property
    def runs(self) -> bool:
        """Whether the request needs the model at all: tokens to generate, or its prompt's
        log-probabilities to compute (a request with neither ends at once with "length")."""
        return self.budget > 0 or self.cfg.prompt_logprobs is not None


def make_request(prep: "Preparer", index: int, prepared: "Prepared", cfg: GenerationConfig,
                 params: SamplingParams) -> RequestState:
    """A request ready to be admitted (``cfg`` resolved by ``Preparer.resolve``); its sampler is
    seeded by (seed, index) so its samples depend on nothing else in the batch."""
    ids = prepared.ids
    budget = min(cfg.max_new_tokens, prep.max_seq_len - len(ids))
    detok = IncrementalDetokenizer(prep.tokenizer) if prep.tokenizer is not None else None
    constraint = prep.constraint(cfg) if budget > 0 else None
    r = RequestState(index, ids, budget, np.random.default_rng((cfg.seed, index)), detokenizer=detok,
                     images=prepared.images, image_positions=prepared.image_positions, layout=prepared.layout,
                     cfg=cfg, params=params, stop_ids=frozenset(cfg.stop_token_ids),
                     image_spans=prepared.image_spans, constraint=constraint)
    setting = parse_speculative(cfg.speculative)
    if setting is not None and prep.speculates and constraint is None and not cfg.return_hidden_states:
        r.speculator = Speculator(setting[1], setting[0])
    return r


def result_of(r: RequestState) -> GenerationResult:
    """What ``generate`` returns for a request (log-probabilities and logits only when asked)."""
    return GenerationResult(prompt_ids=r.prompt_ids, token_ids=r.tokens, text=r.text if r.detokenizer else None,
                            finish_reason=r.finish_reason, logprobs=r.logprobs if r.cfg.logprobs is not None else None,
                            logits=np.stack(r.logits) if r.logits else None,
                            hidden_states=np.concatenate(r.hidden) if r.hidden else None,
                            prompt_logprobs=r.prompt_logprobs if r.cfg.prompt_logprobs is not None else None,
                            cached_tokens=r.cached_tokens)
