"""Serving one Engine to many callers: ``Scheduler`` (a stepping thread driving
``request.step.StepBatch`` over requests submitted from any thread) and ``RequestHandle``
(one submitted request, as its submitter sees it).

Fairness. Waiting requests are served fairly across *submissions* (``FairQueue``): the prompts
one caller submits together (``submit(..., group=key)``: the server's multi-prompt completion)
are served as one submission, the one that has had the fewest taken first, so a request
arriving after 64 of them is next in line, not 65th. With the step's sharing of its budget
(``StepBatch.plan``: the request mid-prefill keeps at most half while others wait, and whole
prompts that fit the rest are admitted beside it) a short request starts at the first step
after it arrives that has a free slot, whatever long or many prompts are in flight.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Iterator

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.embed import batch_tokens, refuse_generation
from graphkiln.runtime.request.commit import finish_cancelled
from graphkiln.runtime.request.request_state import NO_TOKEN, NonFiniteLogitsError, RequestState, make_request, result_of  # noqa: F401
from graphkiln.runtime.request.prefix import PrefixStats
from graphkiln.runtime.request.prepare import takes
from graphkiln.runtime.request.step import Plan, StepBatch
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent, TokenLogprob, _is_int

if TYPE_CHECKING:
    from graphkiln.runtime.engine import Engine

class FairQueue:
    """The waiting requests in the order they are served: the group (the prompts of one
    submission) that has had the fewest requests taken from it goes first, the earlier-arrived
    one on a tie; first come first served within a group. So single requests are served in
    arrival order, a request arriving while a many-prompt submission is admitted goes before that
    submission's remaining prompts, and two such submissions alternate. Iteration gives the order
    in which ``StepBatch.plan`` looks at them (as if each taken in turn); ``remove`` (a request
    admitted or cancelled) counts as one taken from its group."""

    def __init__(self) -> None:
        self._groups: dict[object, list] = {}  # key -> [taken, arrival, deque of requests]
        self._group_of: dict[int, object] = {}  # id(request) -> its group's key
        self._arrivals = itertools.count()

    def append(self, r: RequestState, group: object) -> None:
        if group not in self._groups:
            self._groups[group] = [0, next(self._arrivals), deque()]
        self._groups[group][2].append(r)
        self._group_of[id(r)] = group

    def remove(self, r: RequestState) -> None:
        key = self._group_of.pop(id(r))
        entry = self._groups[key]
        entry[2].remove(r)
        entry[0] += 1
        if not entry[2]:
            del self._groups[key]

    def __iter__(self) -> Iterator[RequestState]:
        heap = [(taken, arrival, list(q)) for taken, arrival, q in self._groups.values()]
        heapq.heapify(heap)
        while heap:
            taken, arrival, q = heapq.heappop(heap)
            yield q[0]
            if len(q) > 1:
                heapq.heappush(heap, (taken + 1, arrival, q[1:]))

    def __len__(self) -> int:
        return len(self._group_of)

    def clear(self) -> None:
        self._groups.clear()
        self._group_of.clear()


class QueueFull(GraphkilnError):
    """``submit`` while ``max_queue`` requests are already waiting for a slot."""


class ShuttingDown(GraphkilnError):
    """``submit`` after ``shutdown`` began (or after the scheduler stopped)."""


@dataclass(frozen=True)
class SchedulerStats:
    """A consistent snapshot: ``queued`` requests wait for a slot, ``running`` hold one;
    ``prompt_tokens`` / ``generated_tokens`` are totals since the scheduler was made (prompt
    tokens counted when prefilled, image placeholder tokens included; those taken from the prefix
    cache are ``prefix.hit_tokens``); ``draft_tokens`` / ``accepted_draft_tokens`` count
    speculative decoding's verified drafts and those kept."""

    queued: int
    running: int
    free_slots: int
    total_slots: int
    prompt_tokens: int
    generated_tokens: int
    prefix: PrefixStats | None = None  # the prefix cache's totals; None when it is off
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    # KV cache bytes one request's token takes at the pool's full length (sliding-window layers
    # window-sized: runtime.backends.state); None for a pool that does not say
    kv_bytes_per_token: float | None = None


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

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the prefix cache (``request.prefix``), set when the request is
        admitted: final once its first event has arrived."""
        return self._request.cached_tokens

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
        self._waiting = FairQueue()
        self._embeds: deque = deque()  # runtime.embed.EmbedJob: embedding calls, a batch run per loop turn
        self._next_id = 0
        self._stopping = False  # no more submits (shutdown began, or the stepping thread ended)
        self._shut = False  # shutdown was called (the engine is released once)
        self._deadline: float | None = None
        self._thread: threading.Thread | None = None
        engine.hold()  # refuses an engine already in use
        self._batch = StepBatch(engine.prep, engine.decoder, engine.pool, step_tokens=step_tokens, prefix=engine.prefix,
                             joinable=takes(engine.decoder.run, "first_slot"))
        self._total_slots = 0
        self._kv_bytes_per_token: float | None = None

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
        per_token = getattr(pool, "kv_bytes_per_token", None)  # at the length every slot may reach
        self._kv_bytes_per_token = per_token(capacity) if per_token is not None and capacity else None
        if self.engine.draft is not None:  # a draft model's cache beside each slot (runtime.draft_model)
            self.engine.draft.reserve(pool.slots, capacity)
        self._thread = threading.Thread(target=self._loop, name="graphkiln-scheduler", daemon=True)
        self._thread.start()

    def submit(self, prompt, config: GenerationConfig | None = None, *, images=None,
               group: object = None) -> RequestHandle:
        """Queue one prompt (text or token ids; ``images`` its images as for ``Engine.generate``).
        Validation happens here, synchronously (GraphkilnError, one line); nothing here waits
        for the model. Raises QueueFull when ``max_queue`` requests wait, ShuttingDown once
        ``shutdown`` began. ``group``: a key (hashable) shared by the prompts of one submission,
        which are then served as one submission beside others (``FairQueue``); None: a
        submission of its own."""
        with self._lock:
            self._check_open()
        engine = self.engine
        refuse_generation(engine.manifest, "generate")
        cfg, params = engine.prep.resolve(config)
        [prepared] = engine.prep.prepare([prompt], images, single=True)
        with self._lock:
            self._check_open()
            if len(self._waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting): retry later")
            index = self._next_id
            self._next_id += 1
            r = make_request(engine.prep, 0, prepared, cfg, params)
            r.index = index
            handle = r.handle = RequestHandle(self, r)
            if not r.runs:  # nothing to generate or score: it ends without running
                r.finish_reason = "length"
                handle._deliver([TokenEvent(index, NO_TOKEN, "", None, "length")], True)
                return handle
            # the adapter is held from here on, not only once admitted: while the request waits,
            # its adapter is neither unloaded (refused) nor evicted by a load (runtime.lora.pool)
            if not self._batch._acquire_adapter(r):  # unloaded since resolve() checked it
                if r.constraint is not None:
                    r.constraint.close()
                raise r.error
            self._waiting.append(r, group if group is not None else object())
            self._cond.notify_all()
        return handle

    def embed(self, prompts, pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None):
        """Queue an embedding call (a list of prompts: text or token ids) and return its
        ``runtime.embed.EmbedJob`` (``result()`` / ``await aresult()``). Checked here, synchronously
        (GraphkilnError, one line). The stepping thread runs it between generation steps, one batch
        per turn in the slots no request holds, at most ``step_tokens`` padded tokens a batch (an
        input longer than that alone); nothing is kept after. QueueFull / ShuttingDown as ``submit``."""
        from graphkiln.runtime.embed import EmbedJob, embed_settings
        from graphkiln.runtime.request.request_state import RequestState

        with self._lock:
            self._check_open()
        engine = self.engine
        settings = embed_settings(engine.manifest, pooling, normalize, dimensions)
        engine.prep.check_hidden_states("embed")
        prompts = list(prompts)
        if not prompts:
            raise GraphkilnError("embed needs at least one prompt")
        reqs = [RequestState(i, p.ids, 0, None, images=p.images, image_positions=p.image_positions, layout=p.layout)
                for i, p in enumerate(engine.prep.prepare(prompts, None, single=False))]
        job = EmbedJob(reqs, settings)
        with self._lock:
            self._check_open()
            if len(self._waiting) + len(self._embeds) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting): retry later")
            self._embeds.append(job)
            self._cond.notify_all()
        return job

    def _embed_turn(self) -> None:
        """One batch of the first embedding call waiting, in the slots no request holds (none free:
        it waits for a request to end). Stepping thread only."""
        with self._lock:
            job = self._embeds[0] if self._embeds else None
        pool = self.engine.pool
        if job is None or pool.live >= pool.slots:
            return
        if job.step(self.engine, pool.slots - pool.live, batch_tokens(self.engine.manifest, job.settings,
                                                                       self.step_tokens)):
            with self._lock:
                self._embeds.popleft()

    def _fail_embeds(self, error: BaseException) -> None:
        with self._lock:
            jobs, self._embeds = list(self._embeds), deque()
        for job in jobs:
            job.fail(error)

    def _check_open(self) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down and takes no new requests: retry on another instance")

    def stats(self) -> SchedulerStats:
        """A consistent snapshot (taken under the scheduler's lock)."""
        with self._lock:
            b = self._batch
            return SchedulerStats(queued=len(self._waiting), running=len(b.rows),
                                  free_slots=self._total_slots - len(b.rows), total_slots=self._total_slots,
                                  prompt_tokens=b.prompt_tokens, generated_tokens=b.generated_tokens,
                                  prefix=b.prefix.stats() if b.prefix is not None else None,
                                  draft_tokens=b.draft_tokens, accepted_draft_tokens=b.accepted_draft_tokens,
                                  kv_bytes_per_token=self._kv_bytes_per_token)

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
            self._fail_embeds(ShuttingDown("the server shut down before the embeddings were done: retry"))
        if first:
            self.engine.unhold()

    def _wake(self) -> None:
        with self._lock:
            self._cond.notify_all()

    # -- the stepping thread ------------------------------------------------------------------

    def _cancel_all_queued(self) -> None:
        with self._lock:
            queued = list(self._waiting)
            self._waiting.clear()
        for r in queued:
            finish_cancelled(r)
            self._batch._release_adapter(r)  # held since submit
            self._hand_over(r)

    def _loop(self) -> None:
        b = self._batch
        try:
            while True:
                with self._lock:
                    while not (self._waiting or b.rows or self._embeds) and not self._stopping:
                        self._cond.wait()
                    if self._stopping and self._deadline is not None and time.monotonic() >= self._deadline:
                        for r in list(self._waiting) + b.rows:
                            r.cancel_requested = True
                        cancel_embeds = bool(self._embeds)
                    else:
                        cancel_embeds = False
                    if self._stopping and not (self._waiting or b.rows or self._embeds):
                        return
                    plan = b.plan(self._waiting)
                for r in plan.cancelled:
                    self._hand_over(r)
                try:
                    if plan.starting:
                        self._encode_new(plan)
                    stepped = b.execute(plan, self._hand_over_running)
                except Exception as exc:  # the runner failed: this step's requests fail, others are not in it
                    err = exc if isinstance(exc, GraphkilnError) else GraphkilnError(
                        f"the decoder failed ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                        "the request was dropped; if this repeats, re-export the artifact or lower max_batch")
                    stepped = []
                    for r in plan.requests:
                        if r.finish_reason is None:
                            r.error, r.finish_reason = err, "error"
                        stepped.append(r)
                with self._lock:
                    b.retire()
                for r in stepped:
                    self._hand_over(r)
                if cancel_embeds:
                    self._fail_embeds(ShuttingDown("the server shut down before the embeddings were done: retry"))
                self._embed_turn()  # runtime.embed: one batch between steps
        finally:
            self._fail_embeds(ShuttingDown("the server shut down before the embeddings were done: retry"))
            with self._lock:
                self._stopping = True  # also after a bug ended the loop: submit must not queue for no one
                rest = list(self._waiting) + list(b.rows)
                for r in self._waiting:
                    b._release_adapter(r)  # held since submit
                self._waiting.clear()
                b.release_all()
            for r in rest:
                if r.finish_reason is None:
                    finish_cancelled(r)
                self._hand_over(r)

    def _encode_new(self, plan: Plan) -> None:
        """Image rows of the requests this step starts (vision graph or cache), before they run;
        a request whose images fail leaves without running."""
        new = [r for r in plan.starting if r.images]  # not encoded yet
        if not new:
            return
        for r in new:
            try:
                self.engine.prep.encode_images([r])
            except Exception as exc:
                err = exc if isinstance(exc, GraphkilnError) else GraphkilnError(
                    f"encoding the images failed ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                    "check the images")
                r.error, r.finish_reason = err, "error"
        failed = [r for r in new if r.error is not None]
        if failed:
            with self._lock:
                self._batch.drop(plan, failed)
            for r in failed:
                self._hand_over(r)

    def _hand_over_running(self, reqs: list[RequestState]) -> None:
        """After one run of a step: the new events of its requests that go on; those that ended
        are handed over once the step has released their slots (a caller seeing a request end
        may count on its slot being free)."""
        for r in reqs:
            if r.finish_reason is None:
                self._hand_over(r)

    def _hand_over(self, r: RequestState) -> None:
        """Pass r's new events (and its end) to its handle."""
        events, r.events = r.events, []
        if r.handle is not None:
            r.handle._deliver(events, r.finish_reason is not None, r.error)
