"""The step: requests join and leave a running batch at step boundaries (continuous batching).

One step is one cycle a reader can follow (``StepBatch.plan`` then ``StepBatch.execute`` then
``StepBatch.retire``):

1. **admit**: cancelled requests leave; waiting requests are taken, first come first served,
   while there is a free slot and token budget (``step_tokens``: each decoding row costs one
   token, a prefill chunk its padded length);
2. **claim or reuse**: each admitted request claims a state-pool slot (``runtime.backends.state``),
   which is its batch row; one whose prompt starts with cached blocks (``request.prefix``) has
   them copied into its slot and is prefilled alone from there, and a request sharing its first
   block with one this step computes waits a step to reuse it;
3. **pack**: the decode rows' last tokens, the prefill chunk's prompt slice, per-token extras
   (``runtime.prompt_layout``) and image rows inside the chunk (``runtime.backends.vision``);
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

    def plan(self, waiting: deque[RequestState]) -> Plan:
        """Admit from ``waiting`` (popping what it takes) and claim the new requests' slots.
        Cancelled requests, running or waiting, finish with "cancelled" here first and are
        listed in the plan's ``cancelled`` (their slots already released)."""
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
        decode = self.rows[: len(self.rows) - (self.partial is not None)]
        budget = math.inf if self.step_tokens is None else self.step_tokens - len(decode)
        if self.partial is not None:
            r = self.partial
            return Plan(decode, [r], r.done, [self._chunk_end(r, r.done, budget)], cancelled)
        group: list[RequestState] = []
        ends: list[int] = []
        longest = 0
        firsts: set[bytes] = set()  # the group's first blocks (prefix reuse)
        if self.joinable or not self.rows:
            while waiting and self.pool.free_slots > len(group):
                r = waiting[0]
                n = len(r.prompt_ids)
                if r.adapter_slot is None and not self._acquire_adapter(r):
                    waiting.popleft()
                    cancelled.append(r)
                    continue
                if self.prefix is not None:
                    hit = self.prefix.find(r)
                    if hit.tokens:  # a cached prefix: prefilled alone from there, past in its slot
                        if group:
                            break
                        r = waiting.popleft()
                        r.slot = self.pool.claim()
                        self.rows.append(r)
                        self.prefix.restore(r, hit)
                        return Plan(decode, [r], r.done, [self._chunk_end(r, r.done, budget)], cancelled)
                    first = self.prefix.first_key(r)
                    if first is not None and first in firsts:
                        break  # it shares a prefix with one this step computes: next step reuses it
                    firsts.add(first)
                if (len(group) + 1) * max(longest, n) <= budget:
                    group.append(waiting.popleft())
                    ends.append(n)
                    longest = max(longest, n)
                    continue
                if not group:  # a long prompt: its first chunk, alone (whole, for a runner that cannot chunk)
                    group.append(waiting.popleft())
                    ends.append(self._chunk_end(r, 0, budget) if self.joinable else n)
                break
        for r in group:
            r.slot = self.pool.claim()
            self.rows.append(r)
        return Plan(decode, group, 0, ends, cancelled)

    def _acquire_adapter(self, r: RequestState) -> bool:
        """Hold the request's LoRA adapter slot from admission on (``runtime.lora.AdapterPool``);
        False, with the request failed, when its adapter was unloaded since it was submitted."""
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

    def execute(self, plan: Plan) -> list[RequestState]:
        """Run the plan's decode rows, then its prefill rows; each request that chose a token
        has its event in ``events`` (or its ``error``). Returns the requests that did, in slot
        order. An exception from the runner itself propagates (the driver decides its fate).

        A runner that can hold several runs in flight (``submit``: pipeline stages on Ray) gets
        both runs before either is awaited, so one range is in a later stage while the other is
        in an earlier one; the two ranges are different slots and the prefill's inputs do not
        depend on the decode's tokens, so the results are the same. A local runner reuses its
        output buffers, so each run is consumed before the next starts."""
        runs = (self._decode_runs(plan) if plan.decode else []) + ([self._prefill_run(plan)] if plan.prefill else [])
        decoder = self.runner
        if hasattr(decoder, "submit"):
            pending = [decoder.submit(self.pool, *args, **kwargs) for args, kwargs, _ in runs]
            outs = (p.result() for p in pending)
        else:
            outs = (decoder.run(self.pool, *args, **kwargs) for args, kwargs, _ in runs)
        stepped: list[RequestState] = []
        for (_, _, finish), out in zip(runs, outs):
            stepped += finish(out)
        return stepped

    def _decode_runs(self, plan: Plan) -> list:
        """The decode rows' runs, each (args, kwargs, finish): a row that speculates this step
        verifies its drafts in a run of its own (``_speculative_run``: onnxruntime's attention
        takes several tokens onto a filled cache for one row only), the others decode one token
        each in one run per contiguous range of their slots."""
        reqs = plan.decode
        proposals = {r.slot: self._propose(r, len(reqs)) for r in reqs if r.speculator is not None}
        runs, group = [], []
        for r in reqs:
            proposal = proposals.get(r.slot)
            if proposal is None or not proposal.tokens:
                group.append(r)
                continue
            if group:
                runs.append(self._decode_run(group))
                group = []
            runs.append(self._speculative_run(r, proposal))
        if group:
            runs.append(self._decode_run(group))
        return runs

    def _propose(self, r: RequestState, rows: int) -> Proposal | None:
        """Request r's drafts for this step (``request.speculate``), or None: not worth a run of
        its own among ``rows`` decode rows, paused, or no room left."""
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
        return self.prep.draft.propose(spec, sequence, k, r.params, r.rng)

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

    def _prefill_run(self, plan: Plan):
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
        self._release_adapter(r)
        if r.constraint is not None:
            r.constraint.close()
        if r.speculator is not None and self.prep.draft is not None:
            self.prep.draft.release(r.speculator)


