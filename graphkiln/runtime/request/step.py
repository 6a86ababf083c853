"""The step: requests join and leave a running batch at step boundaries (continuous batching).

One step is one cycle a reader can follow (``StepBatch.plan`` then ``StepBatch.execute`` then
``StepBatch.retire``):

1. **admit**: cancelled requests leave; waiting requests are taken in the queue's order while
   there is a free slot and token budget (``step_tokens``: each decoding row costs one token, a
   prefill its padded length), shared so that no prompt holds back others for more than a step
   (``StepBatch.plan``);
2. **claim or reuse**: each admitted request claims a state-pool slot (``runtime.backends.state``),
   which is its batch row; one whose prompt starts with cached blocks (``request.prefix``) has
   them copied into its slot and is prefilled in a run of its own from there, and a request
   sharing its first block with one this step computes waits a step to reuse it;
3. **pack**: the decode rows' last tokens, the prefill chunk's prompt slice, per-token extras
   (``runtime.prompt_layout``) and image rows inside the chunk (``runtime.backends.vision``);
4. **run**: the decoder over the decode rows, then over the prefill rows (see below);
5. **sample**: each row's next token, from the graph's folded argmax (``next_token``) when every
   row of the run is greedy without log-probabilities, else from its logits;
6. **commit**: tokens, text, stops, events;
7. **release**: finished, failed and cancelled requests free their slots at once.

Slot arrangement. Live slots are packed ``0..live-1`` (``PackedSlots``). At most one request is
mid-prefill (a long prompt in chunks); every other live request decodes. A step's new requests
whose whole prompts fit the budget claim the slots at the end, contiguous, and are prefilled
together with no past (one run); a chunk of a prompt over past already in its slot (the request
mid-prefill, or one starting from cached blocks) runs alone (batch 1); the decode rows run as
one run per contiguous range of their slots (two when the request mid-prefill sits between
them). So every run covers a contiguous range of slots (views of the pool, no copies), and no
run ever has a batch > 1 with seq > 1 over a non-empty cache, which onnxruntime's
GroupQueryAttention refuses. Mixing decode rows into a prefill run would pad every decode row
to the chunk length on a dense-batch graph, so separate runs are also the cheaper arrangement.
Releasing a decoding slot while the request mid-prefill is last keeps it last
(``PackedSlots.release_keeping_tail``), so the decode rows stay one range when nothing was
admitted beside it.

Backends whose runner cannot run a range of slots that does not start at 0 (the GPU runners:
no ``first_slot`` parameter) get static batching: waiting requests are admitted only when the
batch is empty, whole prompts, together.

A request's results do not depend on what else runs: its sampler is its own generator, and
each row's logits depend only on its own tokens and cache (up to the float rounding of a
different batch shape).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.backends.state import PAD_ID
from graphkiln.runtime.request.prefix import PrefixCache
from graphkiln.runtime.request.prepare import Preparer
from graphkiln.runtime.request.commit import commit, finish_cancelled, score_prompt
from graphkiln.runtime.request.request_state import NO_TOKEN, NonFiniteLogitsError, RequestState
from graphkiln.runtime.request.sampling import NonFiniteLogits, probabilities, select_token
from graphkiln.runtime.request.speculate import Proposal, accept, accept_greedy, ngram_draft
from graphkiln.runtime.requests import TokenEvent


@dataclass
class Plan:
    """One step's work. ``decode`` rows decode one token each (slot order; one run per contiguous
    range of their slots). ``prefill`` is a group of fresh prompts, whole, on contiguous slots at
    the end of the batch, run together from position 0 (``ends``: each one's length). Each of
    ``chunks`` is (request, start, end): that request's prompt positions ``[start, end)`` over
    the past already in its slot, in a run of its own (a prompt longer than its share of the
    budget, or one that starts from cached blocks)."""

    decode: list[RequestState]
    prefill: list[RequestState]
    ends: list[int] = field(default_factory=list)
    chunks: list[tuple[RequestState, int, int]] = field(default_factory=list)
    cancelled: list[RequestState] = field(default_factory=list)

    @property
    def requests(self) -> list[RequestState]:
        """Every request this step runs."""
        return self.decode + self.prefill + [r for r, _, _ in self.chunks]

    @property
    def starting(self) -> list[RequestState]:
        """The requests this step admits or continues prefilling."""
        return self.prefill + [r for r, _, _ in self.chunks]


class StepBatch:
    """The running requests of one state pool, stepped by a driver: ``Engine`` (one call's
    prompts, in the caller's thread) or ``Scheduler`` (its stepping thread).

    Invariants between steps: ``rows[s]`` holds slot s and ``len(rows) == pool.live``; every row
    but ``partial`` (a prompt being prefilled in chunks, in any slot) has finished its prefill.
    The pool is sized by the driver before the first step and not while slots are live."""

    def __init__(self, prep: Preparer, runner, pool, *, step_tokens: int | None, joinable: bool,
                 prefix: PrefixCache | None = None) -> None:
        self.prep = prep  # the layout inputs of each run (Preparer.extra)
        self.runner = runner
        self.pool = pool
        self.prefix = prefix  # None: nothing reused (off, or a runner that cannot start past slot 0)
        if not joinable:
            self.prefix = None  # a reused prefix is prefilled alone, from its own slot
        self.step_tokens = step_tokens  # None: no budget (whole prompts, as many as have slots)
        self.joinable = joinable  # the runner can run a range of slots from first_slot > 0
        self.rows: list[RequestState] = []
        self.partial: RequestState | None = None
        # the runner can return the graph's argmax instead of logits (DecoderGraph.run tokens_only)
        self.folded = bool(getattr(runner, "has_next_token", False))
        self.prompt_tokens = 0  # prefilled so far (the driver's totals)
        self.generated_tokens = 0
        self.draft_tokens = 0  # speculative drafts verified, and those accepted
        self.accepted_draft_tokens = 0

    # -- admit, claim -----------------------------------------------------------------------

    def plan(self, waiting) -> Plan:
        """Admit from ``waiting`` (removing what it takes; any collection with ``remove``, iterated
        in the order requests should be served: the Scheduler's is fair across submitters) and
        claim the new requests' slots. Cancelled requests, running or waiting, finish with
        "cancelled" here first and are listed in the plan's ``cancelled`` (their slots already
        released).

        The prefill budget (``step_tokens`` less one token per decoding row) is shared so that no
        prompt, however long or however many arrive together, holds back the others by more than
        a step: the request mid-prefill keeps at most half of it while others wait (all of it
        otherwise), and waiting requests whose whole prompts fit the rest are admitted in queue
        order, skipping those that do not fit. A prompt that does not fit starts its prefill in
        chunks only when it comes first in the queue and no other request is mid-prefill; it
        waits otherwise (one partial prefill at a time)."""
        cancelled = [r for r in self.rows if r.cancel_requested and r.finish_reason is None]
        for r in cancelled:
            finish_cancelled(r)
        self.retire()
        if any(r.cancel_requested for r in waiting):
            for r in [r for r in waiting if r.cancel_requested]:
                waiting.remove(r)
                finish_cancelled(r)
                self._release_adapter(r)
                cancelled.append(r)
        partial = self.partial
        decode = [r for r in self.rows if r is not partial]
        if self.step_tokens is None:  # no budget: every whole prompt that has a slot
            budget = math.inf
        else:
            budget = self.step_tokens - len(decode)
        if not self.joinable:
            group, ends = self._whole_prompts(waiting, budget, cancelled) if not self.rows else ([], [])
            return Plan(decode, group, ends, [], cancelled)
        chunks: list[tuple[RequestState, int, int]] = []
        group: list[RequestState] = []
        ends: list[int] = []
        keep = 0 if partial is None else self._share(len(partial.prompt_ids) - partial.done, budget, bool(waiting))
        spent = keep  # budget taken so far, the partial's share included
        longest = 0  # the group's longest prompt: it is padded to that
        firsts: set[bytes] = set()  # the group's first blocks (prefix reuse)
        head = True  # the first request the loop considers: the only one that may start a partial prefill
        for r in list(waiting):
            if self.pool.free_slots <= len(group):
                break
            if not self._holds_adapter(r, waiting, cancelled):
                continue
            first_in_queue, head = head, False
            n = len(r.prompt_ids)
            hit = self.prefix.find(r) if self.prefix is not None else None
            if hit is not None and hit.tokens:  # starts from cached blocks: a chunk over that past
                rest = n - min(hit.tokens, n - 1)
                if rest <= budget - spent or (first_in_queue and partial is None):
                    waiting.remove(r)
                    r.slot = self.pool.claim()
                    self.rows.append(r)
                    self.prefix.restore(r, hit)
                    if rest <= budget - spent:
                        chunks.append((r, r.done, n))
                        spent += rest
                    else:
                        partial = r
                        keep = self._share(rest, budget, bool(waiting))
                        spent += keep
                continue
            if self.prefix is not None:
                key = self.prefix.first_key(r)
                if key is not None and key in firsts:
                    continue  # it shares a prefix with one this step computes: a later step reuses it
            cost = (len(group) + 1) * max(longest, n) - len(group) * longest
            if cost <= budget - spent:
                waiting.remove(r)
                group.append(r)
                ends.append(n)
                longest = max(longest, n)
                spent += cost
            elif first_in_queue and partial is None:  # a long prompt: its prefill starts, in chunks
                waiting.remove(r)
                r.slot = self.pool.claim()
                self.rows.append(r)
                partial = r
                keep = self._share(n, budget, bool(waiting))
                spent += keep
            else:
                continue
            if self.prefix is not None and key is not None:
                firsts.add(key)
        if partial is not None:  # its share and whatever the others left
            start = partial.done
            chunks.append((partial, start, self._chunk_end(partial, start, budget - spent + keep)))
        for r in group:  # last: the group's slots are contiguous, the end of the batch
            r.slot = self.pool.claim()
            self.rows.append(r)
        return Plan(decode, group, ends, chunks, cancelled)

    @staticmethod
    def _share(rest: int, budget: float, others_wait: bool) -> int:
        """The budget the request mid-prefill (``rest`` prompt tokens to go) keeps for itself: all
        it needs while no one waits, else at most half (rounded up, so at least one token)."""
        if not others_wait or budget == math.inf:
            return min(rest, budget)
        return min(rest, int(budget) - int(budget) // 2)

    def _holds_adapter(self, r: RequestState, waiting, cancelled: list[RequestState]) -> bool:
        """Whether ``r`` holds its adapter's slot (taking it now if it has none yet); a request whose
        adapter cannot be had leaves ``waiting`` for ``cancelled``."""
        if r.adapter_slot is None and not self._acquire_adapter(r):
            waiting.remove(r)
            cancelled.append(r)
            return False
        return True

    def _whole_prompts(self, waiting, budget: float, cancelled: list[RequestState]) -> tuple[list, list[int]]:
        """A runner that cannot run a range of slots from ``first_slot`` > 0: whole prompts in
        queue order while they fit (the first even when it alone does not), run from slot 0."""
        group: list[RequestState] = []
        longest = 0
        for r in list(waiting):
            if self.pool.free_slots <= len(group):
                break
            if not self._holds_adapter(r, waiting, cancelled):
                continue
            n = len(r.prompt_ids)
            if group and (len(group) + 1) * max(longest, n) > budget:
                break
            waiting.remove(r)
            group.append(r)
            longest = max(longest, n)
        for r in group:
            r.slot = self.pool.claim()
            self.rows.append(r)
        return group, [len(r.prompt_ids) for r in group]

    def _acquire_adapter(self, r: RequestState) -> bool:
        """Hold the request's LoRA adapter slot (``runtime.lora.AdapterPool``) until
        ``_release_adapter``: from admission for an Engine call's requests, from submission for the
        Scheduler's (so a queued request's adapter is neither unloaded nor evicted). False, with the
        request failed, when its adapter was unloaded since it was checked."""
        adapters = self.prep.adapters
        if adapters is None:
            r.adapter_slot = 0
            return True
        try:
            r.adapter_slot = adapters.acquire(r.cfg.adapter)
        except GraphkilnError as exc:
            r.error, r.finish_reason = exc, "error"
            return False
        r.adapter_salt = adapters.digest(r.adapter_slot)
        return True

    def _release_adapter(self, r: RequestState) -> None:
        if r.adapter_slot and self.prep.adapters is not None:
            self.prep.adapters.release(r.adapter_slot)
        r.adapter_slot = None

    def _chunk_end(self, r: RequestState, start: int, budget: float) -> int:
        """Where a prefill chunk of ``r`` from ``start`` ends: its prompt's end if the budget allows,
        else as far as the budget goes, on a block boundary when blocks are cached (a conv
        snapshot is kept only where a run ends on one) and never inside an image."""
        n = len(r.prompt_ids)
        if budget >= n - start:
            return n
        budget = max(int(budget), 1)
        if self.prefix is not None:
            aligned = (start + budget) // self.prefix.block_size * self.prefix.block_size
            if aligned > start:
                budget = aligned - start
        return r.layout.chunk_end(start, budget) if r.layout is not None else min(start + budget, n)

    # -- pack, run, sample, commit ------------------------------------------------------------

    def execute(self, plan: Plan, on_run=None) -> list[RequestState]:
        """Run the plan's decode rows, then its new whole prompts, then its chunks (the request
        mid-prefill last); each request that chose a token has its event in ``events`` (or its
        ``error``). Returns the requests that did, in run order; ``on_run`` (optional) is called
        with each run's such requests as soon as that run is done, so a driver can pass tokens
        on before the step's later runs (a decoding stream or a new request's first token need
        not wait for another prompt's chunk). An exception from the runner itself propagates
        (the driver decides its fate).

        A runner that can hold several runs in flight (``submit``: pipeline stages on Ray) gets
        both runs before either is awaited, so one range is in a later stage while the other is
        in an earlier one; the two ranges are different slots and the prefill's inputs do not
        depend on the decode's tokens, so the results are the same. A local runner reuses its
        output buffers, so each run is consumed before the next starts."""
        runs = self._decode_runs(plan) if plan.decode else []
        if plan.prefill:
            runs.append(self._prefill_run(plan.prefill, 0, plan.ends))
        runs += [self._prefill_run([r], start, [end]) for r, start, end in plan.chunks]
        decoder = self.runner
        if hasattr(decoder, "submit"):
            pending = [decoder.submit(self.pool, *args, **kwargs) for args, kwargs, _ in runs]
            outs = (p.result() for p in pending)
        else:
            outs = (decoder.run(self.pool, *args, **kwargs) for args, kwargs, _ in runs)
        stepped: list[RequestState] = []
        for (_, _, finish), out in zip(runs, outs):
            done = finish(out)
            stepped += done
            if on_run is not None and done:
                on_run(done)
        # at most one request is left mid-prefill (plan): the one whose prompt is not all in its slot
        self.partial = next((r for r in self.rows if r.finish_reason is None and r.done < len(r.prompt_ids)), None)
        return stepped

    def _decode_runs(self, plan: Plan) -> list:
        """The decode rows' runs, each (args, kwargs, finish): a row that speculates this step
        verifies its drafts in a run of its own (``_speculative_run``: onnxruntime's attention
        takes several tokens onto a filled cache for one row only), the others decode one token
        each in one run per contiguous range of their slots."""
        reqs = plan.decode
        # what the step's draft-model catch-ups may feed, together: the step's budget
        allowance = [math.inf if self.step_tokens is None else self.step_tokens]
        proposals = {r.slot: self._propose(r, len(reqs), allowance) for r in reqs if r.speculator is not None}
        runs, group = [], []
        for r in reqs:
            proposal = proposals.get(r.slot)
            if proposal is None or not proposal.tokens:
                if group and r.slot != group[-1].slot + 1:  # a row mid-prefill sits between them
                    runs.append(self._decode_run(group))
                    group = []
                group.append(r)
                continue
            if group:
                runs.append(self._decode_run(group))
                group = []
            runs.append(self._speculative_run(r, proposal))
        if group:
            runs.append(self._decode_run(group))
        return runs

    def _propose(self, r: RequestState, rows: int, allowance: list[float]) -> Proposal | None:
        """Request r's drafts for this step (``request.speculate``), or None: not worth a run of
        its own among ``rows`` decode rows, paused, or no room left. A draft model catches up on
        the request's tokens within ``allowance[0]`` tokens, shared by the step's rows (a long
        prompt's catch-up is spread over steps, the row decoding plainly meanwhile)."""
        spec = r.speculator
        if not spec.worth(rows):
            return None
        sequence = r.prompt_ids + r.tokens
        room = r.budget - len(r.tokens) - 1  # the token chosen after the drafts needs a place too
        cost = 0.0
        if spec.source == "draft":
            room = min(room, self.prep.draft.room(len(sequence)))
            cost = self.prep.draft.cost or 0.0
        k = spec.size(room, cost)
        if k <= 0:
            return None
        if spec.source == "ngram":
            return Proposal(ngram_draft(sequence, k))
        if allowance[0] == math.inf:  # no step budget (Engine.generate): caught up whole
            return self.prep.draft.propose(spec, sequence, k, r.params, r.rng)
        most = int(allowance[0])
        allowance[0] = max(0, most - (len(sequence) - spec.draft_done))
        return self.prep.draft.propose(spec, sequence, k, r.params, r.rng, most=most)

    def _decode_run(self, reqs: list[RequestState]):
        """(args, kwargs, finish) of a run of decode rows, one token each, over their slots (contiguous)."""
        n = len(reqs)
        tokens = np.array([[r.tokens[-1]] for r in reqs], np.int64)
        positions = np.array([[r.position - 1] for r in reqs], np.int64)
        fold = self.folded and all(r.folds for r in reqs)
        extra = self.prep.extra(reqs, positions[:, 0], 1)
        hidden = any(r.cfg.return_hidden_states for r in reqs)

        def finish(out) -> list[RequestState]:
            if hidden:
                out, states = out
                for row, r in enumerate(reqs):
                    if r.cfg.return_hidden_states:
                        r.hidden.append(states[row, :1].copy())  # the runner reuses its buffers
            for row, r in enumerate(reqs):
                self._choose(r, out[row, 0], fold)
                if self.prefix is not None:
                    self.prefix.remember(r)
            return list(reqs)

        args = (tokens, positions, np.zeros((n, 1), np.int64), np.ones(n, np.int64))
        return args, self._run_kwargs(extra, None, reqs[0].slot, fold, hidden), finish

    def _speculative_run(self, r: RequestState, proposal: Proposal):
        """(args, kwargs, finish) of one row's run over its last token and its k drafts, with the
        argmax (greedy, no logits wanted) or logits at each of the k+1 positions; commits the
        drafts it accepts and one more (``request.speculate``). Slot states (conv, recurrent) are
        snapshotted first and, when a draft is rejected, restored and advanced over the accepted
        tokens by a second run (KV rows need nothing: position alone rolls them back)."""
        draft, spec = proposal.tokens, r.speculator
        k, slot, length = len(draft), r.slot, r.position
        tokens = np.array([[r.tokens[-1], *draft]], np.int64)
        positions = np.arange(length - 1, length + k, dtype=np.int64)[None, :]
        fold = self.folded and r.folds
        saved = self.pool.snapshot_slot_states(slot) if self.prep.slot_states else None

        def finish(out) -> list[RequestState]:
            logits = None if fold else out[0]  # [k+1, vocab], a view of the runner's buffer
            try:
                if fold or r.params.greedy:
                    argmax = out[0] if fold else logits.argmax(axis=-1)
                    chosen = accept_greedy([int(t) for t in argmax], draft)
                    if chosen[-1] < 0 or (logits is not None and not np.isfinite(logits[len(chosen) - 1, chosen[-1]])):
                        raise NonFiniteLogits(chosen[-1])
                else:
                    chosen = accept(lambda i: probabilities(logits[i], r.params), proposal, r.rng)
            except NonFiniteLogits:
                r.error = NonFiniteLogitsError(r.index, len(r.tokens) + 1)
                r.finish_reason = "error"
                return [r]
            accepted = len(chosen) - 1
            spec.record(k, accepted)
            self.draft_tokens += k
            self.accepted_draft_tokens += accepted
            if spec.source == "draft":  # the draft's cache stays valid up to the last accepted draft
                spec.draft_done = min(spec.draft_done, length + accepted)
            for i, token in enumerate(chosen):
                commit(r, token, None if logits is None else logits[i])
                self.generated_tokens += 1
                if r.finish_reason is not None:
                    break
            if saved is not None and accepted < k and r.finish_reason is None:
                # after the commits: this run reuses the runner's output buffers (``logits``)
                self.pool.restore_slot_states(slot, saved)
                m = accepted + 1
                self.runner.run(self.pool, tokens[:, :m], positions[:, :m], np.array([[m - 1]], np.int64),
                                np.array([m], np.int64),
                                **self._run_kwargs(self.prep.extra([r], positions[:, 0], m), None, slot, self.folded, False))
            if self.prefix is not None:
                self.prefix.remember(r)
            return [r]

        logits_index = np.arange(k + 1, dtype=np.int64)[None, :]
        extra = self.prep.extra([r], positions[:, 0], k + 1)
        args = (tokens, positions, logits_index, np.array([k + 1], np.int64))
        return args, self._run_kwargs(extra, None, slot, fold, False), finish

    def _prefill_run(self, reqs: list[RequestState], start: int, ends: list[int]):
        """(args, kwargs, finish) of a prefill run over contiguous slots from ``reqs[0].slot``: each
        row's prompt positions ``[start, end)`` (a group of several rows has no past: ``start`` 0)."""
        first = reqs[0].slot
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
        extra = self.prep.extra(reqs, positions[:, 0], seq)

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
                    score_prompt(r, out[row, : end - start], start)
                r.done = end
                if f and r.budget == 0:  # it only wanted its prompt scored
                    r.finish_reason = "length"
                    r.events.append(TokenEvent(r.index, NO_TOKEN, "", None, "length"))
                    stepped.append(r)
                elif f:
                    self._choose(r, out[row, cols[row]], fold)
                    stepped.append(r)
            if self.prefix is not None:
                self.prefix.computed(int(lengths.sum()))
                for r in reqs:
                    self.prefix.remember(r)
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
                commit(r, token, None)
            elif r.constraint is not None:  # chosen among the tokens its grammar allows now
                if not np.isfinite(out).all():
                    raise NonFiniteLogits(0)  # not hidden by the mask: the model itself is broken
                token = select_token(r.constraint.mask(out), r.params, r.rng)
                last = token in r.stop_ids or len(r.tokens) + 1 >= r.budget
                complete = r.constraint.advance(token, finished=last)
                commit(r, token, out, complete=complete)
            else:
                commit(r, select_token(out, r.params, r.rng), out)
            self.generated_tokens += 1
        except NonFiniteLogits:
            r.error = NonFiniteLogitsError(r.index, len(r.tokens) + 1)
            r.finish_reason = "error"
        except GraphkilnError as exc:  # its grammar failed (request.constraint): this request only
            r.error, r.finish_reason = exc, "error"

    # -- release --------------------------------------------------------------------------

    def retire(self) -> None:
        """Release every finished request's slot (highest slot first, so fewer rows move);
        a request mid-prefill that is last stays last (the decode rows stay one range)."""
        for r in sorted((r for r in self.rows if r.finish_reason is not None), key=lambda r: -r.slot):
            self._release(r)

    def drop(self, plan: Plan, failed: list[RequestState]) -> None:
        """Release ``failed``, requests the plan starts that failed before it runs (their images),
        and take them out of the plan; the group's slots stay contiguous at the end of the batch
        (it claimed them last)."""
        gone = {id(r) for r in failed}
        in_group = {id(r) for r in plan.prefill}
        group = [r for r in plan.prefill if id(r) not in gone]
        for r in sorted(failed, key=lambda r: (id(r) not in in_group, -r.slot)):  # the group's own first
            self._release(r, tail=0 if id(r) in in_group else len(group))
        plan.prefill = sorted(group, key=lambda r: r.slot)
        plan.ends = [len(r.prompt_ids) for r in plan.prefill]
        plan.chunks = [c for c in plan.chunks if id(c[0]) not in gone]

    def release_all(self) -> None:
        for r in sorted(self.rows, key=lambda r: -r.slot):
            self._release(r)

    def _release(self, r: RequestState, tail: int | None = None) -> None:
        """Free r's slot; the last ``tail`` rows stay last (default: the request mid-prefill, if it is last)."""
        if r.error is not None and hasattr(self.pool, "scrub"):
            self.pool.scrub(r.slot)  # a failed request may leave NaN rows (StatePool.scrub)
        if r is self.partial:
            self.partial = None
        if tail is None:
            tail = 1 if self.partial is not None and self.partial is self.rows[-1] else 0
        for src, dst in self.pool.release_keeping_tail(r.slot, tail):
            self.rows[dst] = self.rows[src]
            self.rows[dst].slot = dst
        self.rows.pop()
        r.slot = None
        self._release_adapter(r)
        if r.constraint is not None:
            r.constraint.close()
        if r.speculator is not None and self.prep.draft is not None:
            self.prep.draft.release(r.speculator)


