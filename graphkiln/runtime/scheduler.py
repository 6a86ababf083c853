"""Continuous batching: requests join and leave a running batch at step boundaries.

One step is one cycle a reader can follow (``StepBatch.plan`` then ``StepBatch.execute`` then
``StepBatch.retire``):

1. **admit**: cancelled requests leave; waiting requests are taken, first come first served,
   while there is a free slot and token budget (``step_tokens``: each decoding row costs one
   token, a prefill chunk its padded length);
2. **claim**: each admitted request claims a state-pool slot (``runtime.state``), which is its
   batch row;
3. **pack**: the decode rows' last tokens, the prefill chunk's prompt slice, per-token extras
   (``runtime.prompt_layout``) and image rows inside the chunk (``runtime.vision``);
4. **run**: the decoder over the decode rows, then over the prefill rows (two runs; see below);
5. **sample**: each row's next token, from the graph's folded argmax (``next_token``) when every
   row of the run is greedy without log-probabilities, else from its logits;
6. **commit**: tokens, text, stops, events;
7. **release**: finished, failed and cancelled requests free their slots at once.

Slot arrangement. Live slots are packed ``0..live-1`` (``PackedSlots``). Decoding requests hold
``[0, d)``; at most one request is mid-prefill (a long prompt in chunks), and it holds the last
slot; a step's new requests whose whole prompts fit the budget claim ``[d, d+g)`` and are
prefilled together, with no past. So the decode run and the prefill run each cover a
contiguous range of slots (views of the pool, no copies), and no run ever has a batch > 1 with
seq > 1 over a non-empty cache, which onnxruntime's GroupQueryAttention refuses: a chunk after
the first runs alone (batch 1), a group of fresh prompts has no past. Mixing decode rows into a
prefill run would pad every decode row to the chunk length on a dense-batch graph, so two runs
are also the cheaper arrangement. Releasing a decoding slot while a request is mid-prefill
keeps that request last (``PackedSlots.release_keeping_tail``).

Backends whose runner cannot run a range of slots that does not start at 0 (the GPU runners:
no ``first_slot`` parameter) get static batching: waiting requests are admitted only when the
batch is empty, whole prompts, together.

A request's results do not depend on what else runs: its sampler is its own generator, and
each row's logits depend only on its own tokens and cache (up to the float rounding of a
different batch shape).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Iterator

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.prompt_layout import PromptLayout
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent, TokenLogprob, _is_int
from graphkiln.runtime.sampling import NonFiniteLogits, SamplingParams, log_softmax, select_token, top_logprobs
from graphkiln.runtime.state import PAD_ID
from graphkiln.runtime.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from graphkiln.runtime.engine import Engine

NO_TOKEN = -1  # token_id of an event that carries no token (a cancellation's last event)


class QueueFull(GraphkilnError):
    """``submit`` while ``max_queue`` requests are already waiting for a slot."""


class ShuttingDown(GraphkilnError):
    """``submit`` after ``shutdown`` began (or after the scheduler stopped)."""


class NonFiniteLogitsError(GraphkilnError):
    """The model produced NaN/Inf logits for ``request`` when choosing its ``step``-th token
    (1-based); a broken artifact, never a sampling setting."""

    def __init__(self, request: int, step: int) -> None:
        super().__init__(f"the model produced NaN/Inf logits at step {step} of request {request}: the artifact's "
                         "weights are broken; re-export (graphkiln verify shows where)")
        self.request, self.step = request, step


@dataclass(frozen=True)
class SchedulerStats:
    """A consistent snapshot: ``queued`` requests wait for a slot, ``running`` hold one;
    ``prompt_tokens`` / ``generated_tokens`` are totals since the scheduler was made (prompt
    tokens counted when prefilled, image placeholder tokens included)."""

    queued: int
    running: int
    free_slots: int
    total_slots: int
    prompt_tokens: int
    generated_tokens: int


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

    @property
    def position(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    @property
    def folds(self) -> bool:
        """Whether the graph's argmax can choose this request's next token (no logits needed)."""
        return self.params.greedy and self.cfg.logprobs is None and not self.cfg.output_logits

    @property
    def runs(self) -> bool:
        """Whether the request needs the model at all: tokens to generate, or its prompt's
        log-probabilities to compute (a request with neither ends at once with "length")."""
        return self.budget > 0 or self.cfg.prompt_logprobs is not None


def make_request(engine: "Engine", index: int, ids: list[int], images: list, image_positions, cfg: GenerationConfig,
                 params: SamplingParams) -> RequestState:
    """A request ready to be admitted (``cfg`` resolved by ``Engine._resolve``); its sampler is
    seeded by (seed, index) so its samples depend on nothing else in the batch."""
    budget = min(cfg.max_new_tokens, engine.max_seq_len - len(ids))
    detok = IncrementalDetokenizer(engine.tokenizer) if engine.tokenizer is not None else None
    return RequestState(index, ids, budget, np.random.default_rng((cfg.seed, index)), detokenizer=detok, images=images,
                    image_positions=image_positions, layout=engine._layout(ids, images, image_positions), cfg=cfg,
                    params=params, stop_ids=frozenset(cfg.stop_token_ids))


@dataclass
class _Plan:
    """One step's work: ``decode`` rows are slots ``[0, len(decode))``; ``prefill`` rows follow
    them, each covering prompt positions ``[start, end)`` (same ``start`` for a fresh group: 0)."""

    decode: list[RequestState]
    prefill: list[RequestState]
    start: int = 0
    ends: list[int] = field(default_factory=list)
    cancelled: list[RequestState] = field(default_factory=list)


class StepBatch:
    """The running requests of one state pool, stepped by a driver: ``Engine`` (one call's
    prompts, in the caller's thread) or ``Scheduler`` (its stepping thread).

    Invariants between steps: ``rows[s]`` holds slot s and ``len(rows) == pool.live``; every row
    but ``partial`` has finished its prefill; ``partial`` (a prompt being prefilled in chunks) is
    ``rows[-1]``. The pool is sized by the driver before the first step and not while slots
    are live."""

    def __init__(self, engine: "Engine", *, step_tokens: int | None, joinable: bool) -> None:
        self.engine = engine
        self.pool = engine.pool
        self.step_tokens = step_tokens  # None: no budget (whole prompts, as many as have slots)
        self.joinable = joinable  # the runner can run a range of slots from first_slot > 0
        self.rows: list[RequestState] = []
        self.partial: RequestState | None = None
        # the runner can return the graph's argmax instead of logits (DecoderGraph.run tokens_only)
        self.folded = bool(getattr(engine.decoder, "has_next_token", False))
        self.prompt_tokens = 0  # prefilled so far (the driver's totals)
        self.generated_tokens = 0

    # -- admit, claim -----------------------------------------------------------------------

    def plan(self, waiting: deque[RequestState]) -> _Plan:
        """Admit from ``waiting`` (popping what it takes) and claim the new requests' slots.
        Cancelled requests, running or waiting, finish with "cancelled" here first and are
        listed in the plan's ``cancelled`` (their slots already released)."""
        cancelled = [r for r in self.rows if r.cancel_requested and r.finish_reason is None]
        for r in cancelled:
            _finish_cancelled(r)
        self.retire()
        if any(r.cancel_requested for r in waiting):
            for r in [r for r in waiting if r.cancel_requested]:
                waiting.remove(r)
                _finish_cancelled(r)
                cancelled.append(r)
        decode = self.rows[: len(self.rows) - (self.partial is not None)]
        budget = math.inf if self.step_tokens is None else self.step_tokens - len(decode)
        if self.partial is not None:
            r = self.partial
            return _Plan(decode, [r], r.done, [_chunk_end(r, r.done, budget)], cancelled)
        group: list[RequestState] = []
        ends: list[int] = []
        longest = 0
        if self.joinable or not self.rows:
            while waiting and self.pool.free_slots > len(group):
                r = waiting[0]
                n = len(r.prompt_ids)
                if (len(group) + 1) * max(longest, n) <= budget:
                    group.append(waiting.popleft())
                    ends.append(n)
                    longest = max(longest, n)
                    continue
                if not group and self.joinable:  # a long prompt: its first chunk, alone
                    group.append(waiting.popleft())
                    ends.append(_chunk_end(r, 0, budget))
                break
        for r in group:
            r.slot = self.pool.claim()
            self.rows.append(r)
        return _Plan(decode, group, 0, ends, cancelled)

    # -- pack, run, sample, commit ------------------------------------------------------------

    def execute(self, plan: _Plan) -> list[RequestState]:
        """Run the plan's decode rows, then its prefill rows; each request that chose a token
        has its event in ``events`` (or its ``error``). Returns the requests that did, in slot
        order. An exception from the runner itself propagates (the driver decides its fate).

        A runner that can hold several runs in flight (``submit``: pipeline stages on Ray) gets
        both runs before either is awaited, so one range is in a later stage while the other is
        in an earlier one; the two ranges are different slots and the prefill's inputs do not
        depend on the decode's tokens, so the results are the same. A local runner reuses its
        output buffers, so each run is consumed before the next starts."""
        runs = ([self._decode_run(plan)] if plan.decode else []) + ([self._prefill_run(plan)] if plan.prefill else [])
        decoder = self.engine.decoder
        if hasattr(decoder, "submit"):
            pending = [decoder.submit(self.pool, *args, **kwargs) for args, kwargs, _ in runs]
            outs = (p.result() for p in pending)
        else:
            outs = (decoder.run(self.pool, *args, **kwargs) for args, kwargs, _ in runs)
        stepped: list[RequestState] = []
        for (_, _, finish), out in zip(runs, outs):
            stepped += finish(out)
        return stepped

    def _decode_run(self, plan: _Plan):
        """(args, kwargs, finish) of the decode rows' run: one token each, slots [0, d)."""
        reqs = plan.decode
        n = len(reqs)
        tokens = np.array([[r.tokens[-1]] for r in reqs], np.int64)
        positions = np.array([[r.position - 1] for r in reqs], np.int64)
        fold = self.folded and all(r.folds for r in reqs)
        extra = self.engine._extra(reqs, positions[:, 0], 1)
        hidden = any(r.cfg.return_hidden_states for r in reqs)

        def finish(out) -> list[RequestState]:
            if hidden:
                out, states = out
                for row, r in enumerate(reqs):
                    if r.cfg.return_hidden_states:
                        r.hidden.append(states[row, :1].copy())  # the runner reuses its buffers
            for row, r in enumerate(reqs):
                self._choose(r, out[row, 0], fold)
            return list(reqs)

        args = (tokens, positions, np.zeros((n, 1), np.int64), np.ones(n, np.int64))
        return args, self._run_kwargs(extra, None, 0, fold, hidden), finish

    def _prefill_run(self, plan: _Plan):
        """(args, kwargs, finish) of the prefill rows' run: one chunk each, slots after the decode rows."""
        reqs, start, ends = plan.prefill, plan.start, plan.ends
        first = len(plan.decode)
        seq = max(ends) - start
        n = len(reqs)
        input_ids = np.full((n, seq), PAD_ID, np.int64)
        for b, (r, end) in enumerate(zip(reqs, ends)):
            input_ids[b, : end - start] = r.prompt_ids[start:end]
        positions = np.tile(np.arange(start, start + seq, dtype=np.int64), (n, 1))
        lengths = np.array([end - start for end in ends], np.int64)
        finishing = [end == len(r.prompt_ids) for r, end in zip(reqs, ends)]
        # a chunk that ends its prompt reads the logits of its last token; others none (row 0)
        logits_index = np.array([[end - 1 - start if f else 0] for end, f in zip(ends, finishing)], np.int64)
        cols = np.zeros(n, np.int64)  # each row's column of the outputs: where its token is chosen
        hidden = any(r.cfg.return_hidden_states for r in reqs)
        scored = [r.cfg.prompt_logprobs is not None for r in reqs]
        if any(scored) or any(r.cfg.return_hidden_states == "all" for r in reqs):
            # every position of the chunk (a shorter row repeats its last one): logits too,
            # since the graph gives hidden states where it gives logits
            logits_index = np.minimum(np.arange(seq, dtype=np.int64), (lengths - 1)[:, None])
            cols = lengths - 1
        fold = self.folded and not any(scored) and all(r.folds for r, f in zip(reqs, finishing) if f)
        extra = self.engine._extra(reqs, positions[:, 0], seq)

        def finish(out) -> list[RequestState]:
            if hidden:
                out, states = out
                for row, (r, end, f) in enumerate(zip(reqs, ends, finishing)):
                    if r.cfg.return_hidden_states == "all":
                        r.hidden.append(states[row, : end - start].copy())
                    elif r.cfg.return_hidden_states == "last" and f:
                        r.hidden.append(states[row, cols[row]: cols[row] + 1].copy())
            stepped = []
            for row, (r, end, f) in enumerate(zip(reqs, ends, finishing)):
                self.prompt_tokens += end - start
                if scored[row]:
                    _score_prompt(r, out[row, : end - start], start)
                r.done = end
                if f and r.budget == 0:  # it only wanted its prompt scored
                    r.finish_reason = "length"
                    r.events.append(TokenEvent(r.index, NO_TOKEN, "", None, "length"))
                    stepped.append(r)
                elif f:
                    self._choose(r, out[row, cols[row]], fold)
                    stepped.append(r)
            last = reqs[-1]
            self.partial = last if last.done < len(last.prompt_ids) else None
            return stepped

        args = (input_ids, positions, logits_index, lengths)
        return args, self._run_kwargs(extra, self._vision(reqs, start, ends, seq), first, fold, hidden), finish

    @staticmethod
    def _run_kwargs(extra, vision, first: int, fold: bool, hidden: bool) -> dict:
        """The runner's keyword arguments, each passed only when it departs from the default (the
        GPU runners take none of them; requests needing them are refused before they get there).
        The runner returns logits, or tokens when ``fold``, paired with its hidden states
        [n, n_logits, hidden] when ``hidden``."""
        kwargs = {}
        if hidden:
            kwargs["with_hidden"] = True
        if extra:
            kwargs["extra"] = extra
        if vision is not None:
            kwargs["vision"] = vision
        if first:
            kwargs["first_slot"] = first
        if fold:
            kwargs["tokens_only"] = True
        return kwargs

    @staticmethod
    def _vision(reqs: list[RequestState], start: int, ends: list[int], seq: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The image rows inside this chunk and their flat token rows ``b * seq + position - start``
        (rows outside the chunk are fed by the chunk that holds them)."""
        rows, indices = [], []
        for b, (r, end) in enumerate(zip(reqs, ends)):
            if r.image_rows is None:
                continue
            inside = (r.image_positions >= start) & (r.image_positions < end)
            if inside.any():
                rows.append(r.image_rows[inside])
                indices.append(b * seq + r.image_positions[inside] - start)
        if not rows:
            return None
        return np.concatenate(rows), np.concatenate(indices).astype(np.int64)

    def _choose(self, r: RequestState, out: np.ndarray, folded: bool) -> None:
        """Commit request r's next token, chosen from its logits row or the graph's argmax;
        a non-finite row becomes the request's ``error``."""
        try:
            if folded:
                token = int(out)
                if token < 0:  # the graph's mark for a row with NaN/+Inf or no finite logit
                    raise NonFiniteLogits(token)
                _commit(self.engine, r, token, None)
            else:
                _commit(self.engine, r, select_token(out, r.params, r.rng), out)
            self.generated_tokens += 1
        except NonFiniteLogits:
            r.error = NonFiniteLogitsError(r.index, len(r.tokens) + 1)
            r.finish_reason = "error"

    # -- release --------------------------------------------------------------------------

    def retire(self) -> None:
        """Release every finished request's slot (highest slot first, so fewer rows move);
        a request mid-prefill stays last."""
        for r in sorted((r for r in self.rows if r.finish_reason is not None), key=lambda r: -r.slot):
            self._release(r)

    def release_all(self) -> None:
        for r in sorted(self.rows, key=lambda r: -r.slot):
            self._release(r)

    def _release(self, r: RequestState) -> None:
        if r.error is not None and hasattr(self.pool, "scrub"):
            self.pool.scrub(r.slot)  # a failed request may leave NaN rows (StatePool.scrub)
        if r is self.partial:
            self.partial = None  # it is the last slot: nothing moves
        tail = 1 if self.partial is not None else 0
        for src, dst in self.pool.release_keeping_tail(r.slot, tail):
            self.rows[dst] = self.rows[src]
            self.rows[dst].slot = dst
        self.rows.pop()
        r.slot = None


def _chunk_end(r: RequestState, start: int, budget: float) -> int:
    n = len(r.prompt_ids)
    if budget >= n - start:
        return n
    budget = max(int(budget), 1)
    return r.layout.chunk_end(start, budget) if r.layout is not None else min(start + budget, n)


def _score_prompt(r: RequestState, logits: np.ndarray, start: int) -> None:
    """Append the log-probabilities of prompt tokens ``start+1 .. start+len(logits)`` (each given
    the positions before it) from a chunk's logits rows at positions ``start ..``. Whole-chunk
    array operations, only the wanted entries turned into log-probabilities, the top n by n
    argmax passes (measured on [511, 49152]: argpartition 300 ms, an argmax 10 ms; a row at a time,
    a 512-token prompt took 1.9x its plain prefill with one alternative, 3.2x with five)."""
    x = logits[: len(r.prompt_ids) - 1 - start]  # the last position predicts no prompt token
    if not len(x):
        return
    rows = np.arange(len(x))
    peak = x.max(axis=-1, keepdims=True)
    # float32 pairwise sums of values in (0, 1]: ~1e-7 relative, below the logits' own rounding
    lse = peak[:, 0] + np.log(np.exp(x - peak).sum(axis=-1))
    tokens = np.asarray(r.prompt_ids[start + 1: start + 1 + len(x)])
    chosen = x[rows, tokens] - lse
    n = min(r.cfg.prompt_logprobs, x.shape[-1])
    top = np.empty((len(x), n), np.int64)
    work = x.copy() if n > 1 else x
    for k in range(n):
        top[:, k] = work.argmax(axis=-1)
        if k + 1 < n:
            work[rows, top[:, k]] = -np.inf
    top_lps = x[rows[:, None], top] - lse[:, None]
    for j in range(len(x)):
        r.prompt_logprobs.append(TokenLogprob(int(tokens[j]), float(chosen[j]),
                                              tuple(zip(top[j].tolist(), top_lps[j].tolist()))))


def _finish_cancelled(r: RequestState) -> None:
    r.finish_reason = "cancelled"
    r.events.append(TokenEvent(r.index, NO_TOKEN, "", None, "cancelled"))


def _commit(engine: "Engine", r: RequestState, token: int, logits: np.ndarray | None) -> None:
    """Append request r's next token, update its text and stop state, and queue its event."""
    cfg = r.cfg
    r.tokens.append(token)
    if cfg.output_logits:
        r.logits.append(logits.copy())
    # the row of the position whose logits chose this token (appended before the choice)
    hidden = r.hidden[-1][-1] if cfg.return_hidden_states and r.hidden else None
    lp = None
    if cfg.logprobs is not None:
        lps = log_softmax(logits)
        lp = TokenLogprob(token, float(lps[token]), tuple(top_logprobs(lps, cfg.logprobs)))
        r.logprobs.append(lp)
    if token in r.stop_ids:
        r.finish_reason = "stop"
    elif len(r.tokens) >= r.budget:
        r.finish_reason = "length"
    if engine.tokenizer is None:
        r.events.append(TokenEvent(r.index, token, "", lp, r.finish_reason, hidden))
        return
    text = r.text + r.detokenizer.step(r.tokens, final=r.finish_reason is not None)
    for s in cfg.stop_strings:
        at = text.find(s, max(0, len(r.text) - len(s)))
        if at >= 0:
            text, r.finish_reason = text[:at], "stop"
    r.text = text
    visible = text if r.finish_reason else text[: len(text) - _pending_stop(text, cfg.stop_strings)]
    new_text = visible[r.emitted:] if len(visible) > r.emitted else ""
    r.emitted = max(r.emitted, len(visible))
    r.events.append(TokenEvent(r.index, token, new_text, lp, r.finish_reason, hidden))


def _pending_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


def result_of(r: RequestState) -> GenerationResult:
    """What ``generate`` returns for a request (log-probabilities and logits only when asked)."""
    return GenerationResult(prompt_ids=r.prompt_ids, token_ids=r.tokens, text=r.text if r.detokenizer else None,
                            finish_reason=r.finish_reason, logprobs=r.logprobs if r.cfg.logprobs is not None else None,
                            logits=np.stack(r.logits) if r.logits else None,
                            hidden_states=np.concatenate(r.hidden) if r.hidden else None,
                            prompt_logprobs=r.prompt_logprobs if r.cfg.prompt_logprobs is not None else None)


# -- the serving side -------------------------------------------------------------------------

class RequestHandle:
    """One submitted request, as its submitter sees it; safe to use from any thread.

    Events are kept, so ``events``/``aevents`` may be called more than once (each replays from
    the first event) and ``result`` after them. The last event has a ``finish_reason``: "stop",
    "length" or "cancelled". An event with ``token_id`` -1 (``NO_TOKEN``) carries no token: a
    cancellation's, or the only event of a request with nothing to generate (max_new_tokens 0 or
    a prompt that fills the maximum sequence length). A request that fails
    (a broken artifact's NaN logits, a runner error) ends without one and its ``error`` (a
    GraphkilnError) is raised by ``events``, ``aevents`` and ``result``."""

    def __init__(self, scheduler: "Scheduler", request: RequestState) -> None:
        self.id: int = request.index
        self.prompt_ids: list[int] = request.prompt_ids  # the ids the model sees (image tokens expanded)
        self._scheduler = scheduler
        self._request = request
        self._events: list[TokenEvent] = []
        self._done = False
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._async: list[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = []

    @property
    def prompt_logprobs(self) -> list[TokenLogprob | None] | None:
        """With ``GenerationConfig.prompt_logprobs``: as ``GenerationResult.prompt_logprobs``,
        complete once the request's first event has arrived (its prefill is over by then)."""
        r = self._request
        return list(r.prompt_logprobs) if r.cfg.prompt_logprobs is not None else None

    # called by the stepping thread
    def _deliver(self, events: list[TokenEvent], done: bool, error: BaseException | None = None) -> None:
        with self._cond:
            self._events.extend(events)
            self._done = done
            self._error = error
            self._cond.notify_all()
            targets = list(self._async)
            item = (len(self._events), done, error)
        for loop, queue in targets:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: it is gone
                self._forget(loop, queue)

    def _forget(self, loop, queue) -> None:
        with self._cond:
            if (loop, queue) in self._async:
                self._async.remove((loop, queue))

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        """Yield the request's events as they come, blocking; ends after the one with a
        finish_reason, or raises the request's error. ``timeout``: the longest wait for one
        event, in seconds (then TimeoutError; the request keeps running)."""
        at = 0
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: len(self._events) > at or self._done, timeout):
                    raise TimeoutError(f"request {self.id} produced no event within {timeout} s")
                new = self._events[at:]
                done, error = self._done, self._error
            at += len(new)
            yield from new
            if done and at >= len(self._events):
                if error is not None:
                    raise error
                return

    async def aevents(self) -> AsyncIterator[TokenEvent]:
        """``events`` for asyncio: the stepping thread wakes this loop with
        ``call_soon_threadsafe``; no thread waits per request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        with self._cond:
            self._async.append((loop, queue))
            queue.put_nowait((len(self._events), self._done, self._error))
        at = 0
        try:
            while True:
                count, done, error = await queue.get()
                with self._cond:
                    new = self._events[at:count]
                at += len(new)
                for ev in new:
                    yield ev
                if done and at >= count:
                    if error is not None:
                        raise error
                    return
        finally:
            self._forget(loop, queue)

    def cancel(self) -> None:
        """Ask the request to stop (idempotent, any thread): it leaves at the next step boundary,
        freeing its slot, and its events end with finish_reason "cancelled" (unless it finished
        first). A queued request is dropped without running."""
        self._request.cancel_requested = True
        self._scheduler._wake()

    def result(self, timeout: float | None = None) -> GenerationResult:
        """Wait until the request ends (at most ``timeout`` seconds, then TimeoutError) and return
        its result; raises its error if it failed."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
            if self._error is not None:
                raise self._error
        return result_of(self._request)


class Scheduler:
    """Serves one Engine to many callers: ``submit`` from any thread, one background stepping
    thread (``start``) runs the continuous batch (module docstring).

    Lifecycle: made (holds the engine: its ``generate``/``stream`` refuse meanwhile), ``start``
    (sizes the state pool: ``max_batch`` slots x the artifact's maximum sequence length),
    ``submit``..., ``shutdown`` (stops admitting, drains until the deadline, cancels the rest,
    joins the thread, frees the pool's slots and the engine). A failing request (NaN logits,
    a runner error) fails alone; its slot is freed and the others go on."""

    def __init__(self, engine: "Engine", *, max_queue: int = 64, max_batch: int | None = None,
                 step_tokens: int = 256) -> None:
        """Refuses (GraphkilnError) bad limits and an engine already in use. Each refusal names the
        limit both as ``graphkiln serve`` spells it and as this constructor does (--max-batch/max_batch)."""
        if not (_is_int(max_queue) and max_queue >= 1):
            raise GraphkilnError(f"--max-queue/max_queue must be an integer >= 1, got {max_queue!r}")
        if max_batch is not None and not (_is_int(max_batch) and max_batch >= 1):
            raise GraphkilnError(f"--max-batch/max_batch must be an integer >= 1, got {max_batch!r}: omit it for the "
                                 "default")
        if not (_is_int(step_tokens) and step_tokens >= 2):
            raise GraphkilnError(f"--step-tokens/step_tokens must be an integer >= 2, got {step_tokens!r}")
        if max_batch is not None and step_tokens <= max_batch:
            # each step spends one token per decoding request, so a full batch needs one more for prefill
            raise GraphkilnError(f"--max-batch/max_batch {max_batch} needs --step-tokens/step_tokens above it (each "
                                 "step spends one token per generating request and the rest on prefill), got "
                                 f"{step_tokens}: pass --step-tokens {max_batch + 1} or more, or a smaller --max-batch")
        self.engine = engine
        self.max_queue = max_queue
        self.max_batch = max_batch
        self.step_tokens = step_tokens
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting: deque[RequestState] = deque()
        self._next_id = 0
        self._stopping = False  # no more submits (shutdown began, or the stepping thread ended)
        self._shut = False  # shutdown was called (the engine is released once)
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        if not engine._busy.acquire(blocking=False):
            from graphkiln.runtime.engine import BUSY

            raise GraphkilnError(BUSY)
        self._batch = StepBatch(engine, step_tokens=step_tokens,
                             joinable=_takes(engine.decoder.run, "first_slot"))
        self._total_slots = 0

    def start(self) -> None:
        """Size the pool and start the stepping thread (once). The default ``max_batch`` is 16
        (less than ``step_tokens``), halved until the pool fits in available memory; an explicit
        one that does not fit is a GraphkilnError."""
        with self._lock:
            if self._thread is not None or self._stopping:
                raise GraphkilnError("this Scheduler was already started: make a new one")
        pool = self.engine.pool
        capacity = self.engine.max_seq_len
        if self.max_batch is not None:
            try:
                pool.reserve(self.max_batch, capacity)
            except GraphkilnError as exc:  # the pool speaks of "the batch size": name the limit that was set
                raise GraphkilnError(f"--max-batch/max_batch {self.max_batch} does not fit in memory ({exc}): pass a "
                                     "smaller --max-batch, or omit it to fit the default") from None
        else:
            slots = min(16, self.step_tokens - 1)  # each decoding request spends a token of every step
            while True:
                try:
                    pool.reserve(slots, capacity)
                    break
                except GraphkilnError:
                    if slots == 1:
                        raise
                    slots //= 2
        self._total_slots = pool.slots
        self._thread = threading.Thread(target=self._loop, name="graphkiln-scheduler", daemon=True)
        self._thread.start()

    def submit(self, prompt, config: GenerationConfig | None = None, *, images=None) -> RequestHandle:
        """Queue one prompt (text or token ids; ``images`` its images as for ``Engine.generate``).
        Validation happens here, synchronously (GraphkilnError, one line); nothing here waits
        for the model. Raises QueueFull when ``max_queue`` requests wait, ShuttingDown once
        ``shutdown`` began."""
        with self._lock:
            self._check_open()
        engine = self.engine
        cfg, params = engine._resolve(config)
        [(ids, loaded, positions)] = engine._prepare([prompt], images, single=True)
        with self._lock:
            self._check_open()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting): retry later")
            index = self._next_id
            self._next_id += 1
            r = make_request(engine, 0, ids, loaded, positions, cfg, params)
            r.index = index
            handle = r.handle = RequestHandle(self, r)
            if not r.runs:  # nothing to generate or score: it ends without running
                r.finish_reason = "length"
                handle._deliver([TokenEvent(index, NO_TOKEN, "", None, "length")], True)
                return handle
            self._waiting.append(r)
            self._cond.notify_all()
        return handle

    def _check_open(self) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down and takes no new requests: retry on another instance")

    def stats(self) -> SchedulerStats:
        """A consistent snapshot (taken under the scheduler's lock)."""
        with self._lock:
            b = self._batch
            return SchedulerStats(queued=len(self._waiting), running=len(b.rows),
                                  free_slots=self._total_slots - len(b.rows), total_slots=self._total_slots,
                                  prompt_tokens=b.prompt_tokens, generated_tokens=b.generated_tokens)

    def shutdown(self, deadline_s: float) -> None:
        """Stop admitting; queued and running requests go on until they end or ``deadline_s``
        seconds pass, then are cancelled; joins the stepping thread and frees the engine.
        Idempotent."""
        with self._lock:
            first = not self._shut
            self._shut = self._stopping = True
            if self._deadline is None or time.monotonic() + deadline_s < self._deadline:
                self._deadline = time.monotonic() + max(0.0, deadline_s)
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        elif first:
            self._cancel_all_queued()
        if first:
            self.engine._busy.release()

    def _wake(self) -> None:
        with self._lock:
            self._cond.notify_all()

    # -- the stepping thread ------------------------------------------------------------------

    def _cancel_all_queued(self) -> None:
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
        for r in queued:
            _finish_cancelled(r)
            self._hand_over(r)

    def _loop(self) -> None:
        b = self._batch
        try:
            while True:
                with self._lock:
                    while not (self._waiting or b.rows) and not self._stopping:
                        self._cond.wait()
                    if self._stopping and self._deadline is not None and time.monotonic() >= self._deadline:
                        for r in list(self._waiting) + b.rows:
                            r.cancel_requested = True
                    if self._stopping and not (self._waiting or b.rows):
                        return
                    plan = b.plan(self._waiting)
                for r in plan.cancelled:
                    self._hand_over(r)
                try:
                    if plan.prefill:
                        self._encode_new(plan)
                    stepped = b.execute(plan)
                except Exception as exc:  # the runner failed: this step's requests fail, others are not in it
                    err = exc if isinstance(exc, GraphkilnError) else GraphkilnError(
                        f"the decoder failed ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                        "the request was dropped; if this repeats, re-export the artifact or lower max_batch")
                    stepped = []
                    for r in plan.decode + plan.prefill:
                        if r.finish_reason is None:
                            r.error, r.finish_reason = err, "error"
                        stepped.append(r)
                with self._lock:
                    b.retire()
                for r in stepped:
                    self._hand_over(r)
        finally:
            with self._lock:
                self._stopping = True  # also after a bug ended the loop: submit must not queue for no one
                rest = list(self._waiting) + list(b.rows)
                self._waiting.clear()
                b.release_all()
            for r in rest:
                if r.finish_reason is None:
                    _finish_cancelled(r)
                self._hand_over(r)

    def _encode_new(self, plan: _Plan) -> None:
        """Image rows of the requests this step starts (vision graph or cache), before they run;
        a request whose images fail leaves without running."""
        new = [r for r in plan.prefill if r.images and r.done == 0]
        if not new:
            return
        for r in new:
            try:
                self.engine._encode_images([r])
            except Exception as exc:
                err = exc if isinstance(exc, GraphkilnError) else GraphkilnError(
                    f"encoding the images failed ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                    "check the images")
                r.error, r.finish_reason = err, "error"
        failed = [r for r in plan.prefill if r.error is not None]
        if failed:
            # released now, so the rest of the group stays contiguous after the decode rows
            # (a release moves the last slot into the hole: the group's order may change)
            end_of = {id(r): e for r, e in zip(plan.prefill, plan.ends)}
            with self._lock:
                self._batch.retire()
                plan.prefill = self._batch.rows[len(plan.decode):]
            plan.ends = [end_of[id(r)] for r in plan.prefill]
            for r in failed:
                self._hand_over(r)

    def _hand_over(self, r: RequestState) -> None:
        """Pass r's new events (and its end) to its handle."""
        events, r.events = r.events, []
        if r.handle is not None:
            r.handle._deliver(events, r.finish_reason is not None, r.error)


def _takes(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
