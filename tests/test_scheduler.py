"""The continuous-batching scheduler (runtime.request.scheduler) and the folded greedy sampler.

A request's tokens must not depend on what else runs: each request submitted while others
decode, prefilled in chunks under a small token budget, equals the same request run alone
(Engine.generate, itself held to transformers by test_generation / test_parity). Arrivals are
staggered by events, not by sleeps, so the interleaving is the same on a slow machine.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.scheduler import NO_TOKEN, QueueFull, Scheduler, ShuttingDown
from graphkiln.runtime.backends.state import PackedSlots
from test_runtime_hardening import EMBED, poison_artifact


def _greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


CASES = [("llama_gqa_bias", "onnxruntime"), ("qwen3_moe", "portable"), ("lfm2", "onnxruntime")]


@pytest.mark.parametrize("name,target", CASES, ids=[f"{n}-{t}" for n, t in CASES])
def test_concurrent_requests_equal_each_request_alone(tiny, name, target):
    """Dense (GQA in-place cache), MoE and conv-hybrid: staggered arrivals into a running batch,
    long prompts prefilled in chunks (budget 8 tokens a step, 3 slots, so requests also queue),
    a greedy request with log-probabilities, a sampled one, and two cancellations (one running,
    one queued). Every greedy request equals itself alone; the pool is empty afterwards."""
    case = tiny(name, target)
    engine = Engine.load(case.artifact)
    prompts = case.prompts((30, 5, 19, 3, 41, 11, 7), salt=90)
    cfgs = [_greedy(12)] * len(prompts)
    cfgs[2] = _greedy(12, logprobs=2)
    cfgs[5] = GenerationConfig(max_new_tokens=12, do_sample=True, temperature=0.8, seed=7, stop_token_ids=())
    alone = [engine.generate(p, c)[0] for p, c in zip(prompts, cfgs)]

    sched = Scheduler(engine, max_batch=3, step_tokens=8)
    sched.start()
    try:
        handles = []
        for i, (p, c) in enumerate(zip(prompts, cfgs)):
            handles.append(sched.submit(p, c))
            if i in (0, 3):  # the next one arrives while this one decodes
                it = handles[-1].events(timeout=30)
                next(it), next(it)
        running = sched.submit(prompts[4], _greedy(40))
        queued = sched.submit(prompts[1], _greedy(40))
        for i, ev in enumerate(running.events(timeout=30)):
            if i == 2:
                running.cancel()
                queued.cancel()
        results = [h.result(timeout=60) for h in handles]
    finally:
        sched.shutdown(30)

    for r, a in zip(results, alone):
        assert r.token_ids == a.token_ids and r.finish_reason == "length"
    assert [lp.token_id for lp in results[2].logprobs] == alone[2].token_ids
    np.testing.assert_allclose([lp.logprob for lp in results[2].logprobs], [lp.logprob for lp in alone[2].logprobs],
                               atol=1e-4)
    events = list(running.events())
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id == NO_TOKEN
    got = [e.token_id for e in events[:-1]]
    assert 3 <= len(got) < 40 and got == engine_alone(engine, prompts[4], len(got))
    assert [(e.token_id, e.finish_reason) for e in queued.events()][-1] == (NO_TOKEN, "cancelled")
    stats = sched.stats()
    assert (stats.running, stats.queued, stats.free_slots, stats.total_slots) == (0, 0, 3, 3)
    assert engine.pool.live == 0
    assert [r.token_ids for r in engine.generate(prompts[:2], _greedy(12))] == [a.token_ids for a in alone[:2]]


def engine_alone(engine, prompt, n):
    return engine.generate(prompt, _greedy(n))[0].token_ids


def test_a_runner_without_slot_ranges_batches_whole_prompts(tiny):
    """A runner that cannot run a sub-range of slots (no ``first_slot``: the GPU runners) gets
    static batching: prompts longer than the step's token budget are admitted whole, one at a
    time when need be (they once waited forever), and each equals the request alone."""
    case = tiny("llama_gqa_bias", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    run = engine.decoder.run

    def whole_ranges_only(pool, input_ids, position_ids, logits_index, lengths, **kwargs):
        assert "first_slot" not in kwargs
        return run(pool, input_ids, position_ids, logits_index, lengths, **kwargs)

    engine.decoder.run = whole_ranges_only
    prompts = case.prompts([12, 20, 5], salt=21)
    alone = [engine.generate(p, _greedy(6))[0].token_ids for p in prompts]
    sched = Scheduler(engine, max_batch=2, step_tokens=8)
    sched.start()
    try:
        handles = [sched.submit(p, _greedy(6)) for p in prompts]
        assert [h.result(timeout=60).token_ids for h in handles] == alone
    finally:
        sched.shutdown(5)


def test_submit_validates_at_once_and_the_queue_is_bounded(tiny):
    case = tiny("llama_gqa_bias")
    engine = Engine.load(case.artifact)
    sched = Scheduler(engine, max_queue=2, max_batch=1, step_tokens=4)  # not started: nothing leaves the queue
    with pytest.raises(GraphkilnError, match="already generating"):
        engine.generate([1, 2, 3], _greedy(2))  # the scheduler holds the engine
    for bad, needle in [([case.vocab_size], "outside the vocabulary"), ([], "empty"),
                        (list(range(3, 3 + case.max_seq_len)), "maximum sequence length")]:
        with pytest.raises(GraphkilnError, match=needle):
            sched.submit(bad)
    with pytest.raises(GraphkilnError, match="text-only model"):
        sched.submit([5, 6], images=[np.zeros((8, 8, 3), np.uint8)])
    with pytest.raises(GraphkilnError, match="temperature"):
        sched.submit([5, 6], GenerationConfig(temperature=-1.0))
    first, second = sched.submit([5, 6], _greedy(3)), sched.submit([7, 8], _greedy(3))
    with pytest.raises(QueueFull, match="queue is full"):
        sched.submit([9], _greedy(3))
    sched.shutdown(0)
    with pytest.raises(ShuttingDown):
        sched.submit([9], _greedy(3))
    assert [e.finish_reason for e in first.events()] == ["cancelled"]
    assert second.result().finish_reason == "cancelled"
    assert engine.generate([5, 6], _greedy(3))[0].token_ids  # the engine is free again
    with pytest.raises(GraphkilnError, match="step_tokens"):
        Scheduler(engine, max_batch=8, step_tokens=8)


def test_a_failing_request_fails_alone(tiny, artifact_copy):
    """A request whose prompt holds a token with a NaN embedding fails with the NaN error; the
    requests running beside it finish with their own tokens and every slot is freed."""
    case = tiny("llama_gqa_bias")
    good = case.prompts((6, 9), salt=91)
    clean = Engine.load(case.artifact).generate(good, _greedy(10))
    seen = {t for p, r in zip(good, clean) for t in p + r.token_ids}
    bad_token = next(t for t in range(3, case.vocab_size) if t not in seen)
    art = artifact_copy(case)
    poison_artifact(art, EMBED, bad_token, np.nan)
    engine = Engine.load(art)
    sched = Scheduler(engine, max_batch=3, step_tokens=16)
    sched.start()
    try:
        first = sched.submit(good[0], _greedy(10))
        next(first.events(timeout=30))
        broken = sched.submit([4, bad_token, 5], _greedy(10))
        second = sched.submit(good[1], _greedy(10))
        with pytest.raises(GraphkilnError, match="NaN/Inf logits at step 1"):
            broken.result(timeout=30)
        with pytest.raises(GraphkilnError, match="NaN/Inf"):
            list(broken.events())
        assert [first.result(timeout=30).token_ids, second.result(timeout=30).token_ids] == \
            [r.token_ids for r in clean]
    finally:
        sched.shutdown(10)
    assert engine.pool.live == 0


def test_async_events_and_shutdown_drains(tiny):
    case = tiny("llama_gqa_bias")
    engine = Engine.load(case.artifact)
    prompts = case.prompts((7, 12, 4), salt=92)
    alone = [engine_alone(engine, p, 9) for p in prompts]
    sched = Scheduler(engine, max_batch=2, step_tokens=8)
    sched.start()

    async def consume():
        handles = [sched.submit(p, _greedy(9)) for p in prompts]
        return await asyncio.gather(*[_collect(h) for h in handles])

    async def _collect(h):
        return [e.token_id async for e in h.aevents()]

    assert asyncio.run(consume()) == alone
    late = [sched.submit(p, _greedy(9)) for p in prompts]
    sched.shutdown(60)  # drains: every request ends by itself, none is cancelled
    assert [h.result(timeout=0).token_ids for h in late] == alone
    assert sched.stats().generated_tokens == 2 * 27 and engine.pool.live == 0


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_folded_argmax_equals_the_logits_argmax(tiny, target):
    """The graph's next_token is the first argmax of each logits row (several batch shapes and
    logits positions), and the runtime asks for it exactly when every row is greedy without
    log-probabilities or logits."""
    case = tiny("llama_gqa_bias", target)
    engine = Engine.load(case.artifact)
    assert engine.decoder.has_next_token
    rng = np.random.default_rng(93)
    for batch, seq, n_logits in [(1, 5, 1), (3, 4, 2), (2, 1, 1)]:
        ids = rng.integers(3, case.vocab_size, (batch, seq))
        pos = np.tile(np.arange(seq), (batch, 1))
        index = np.sort(rng.integers(0, seq, (batch, n_logits)), axis=1)
        engine.pool.reserve(batch, 16)
        slots = [engine.pool.claim() for _ in range(batch)]
        logits = engine.decoder.run(engine.pool, ids, pos, index, np.full(batch, seq)).copy()
        tokens = engine.decoder.run(engine.pool, ids, pos, index, np.full(batch, seq), tokens_only=True)
        for s in reversed(slots):
            engine.pool.release(s)
        assert tokens.dtype == np.int64 and tokens.shape == (batch, n_logits)
        np.testing.assert_array_equal(tokens, logits.argmax(-1))

    calls = []
    run = engine.decoder.run

    def spy(*args, **kw):
        calls.append(kw.get("tokens_only", False))
        return run(*args, **kw)

    engine.decoder.run = spy
    p = case.prompts((6,), salt=94)[0]
    folded = engine.generate(p, _greedy(5))[0].token_ids
    assert calls == [True] * 5
    calls.clear()
    assert engine.generate(p, _greedy(5, logprobs=1))[0].token_ids == folded
    assert calls == [False] * 5


def test_release_keeping_tail_keeps_the_last_slots_last():
    class Rows(PackedSlots):
        def __init__(self, n):
            self.slots, self.live, self.rows = n, 0, [None] * n

        def _clear_conv_row(self, slot):
            pass

        def _move_row(self, dst, src):
            self.rows[dst] = self.rows[src]

    pool = Rows(5)
    for name in "abcde":
        pool.rows[pool.claim()] = name
    assert pool.release_keeping_tail(1, tail=1) == [(3, 1), (4, 3)]
    assert pool.rows[: pool.live] == list("adce")
    assert pool.release_keeping_tail(2, tail=1) == [(3, 2)]
    assert pool.rows[: pool.live] == list("ade")
    assert pool.release_keeping_tail(0, tail=0) == [(2, 0)]
    with pytest.raises(RuntimeError):
        pool.release_keeping_tail(1, tail=1)  # the tail itself


# What is in flight when a short request arrives (issue 37, fairness): prompt lengths, settings, and
# whether the prompts are one submission (the server's multi-prompt completion). The step budget is 24
# tokens over 4 slots; "scored" prompts want only their prompt log-probabilities (echo, max_tokens 0).
IN_FLIGHT = {
    "many long prompts, scored": ((40,) * 6, dict(max_new_tokens=0, prompt_logprobs=1), True),
    "many short prompts": ((12,) * 10, dict(max_new_tokens=1), True),
    "many short prompts, scored": ((9,) * 10, dict(max_new_tokens=0, prompt_logprobs=1), True),
    "one long prompt": ((100,), dict(max_new_tokens=6), False),
    "one long prompt, scored": ((110,), dict(max_new_tokens=0, prompt_logprobs=2), False),
}


@pytest.mark.parametrize("cached", [False, True], ids=["fresh", "cached-prefix"])
@pytest.mark.parametrize("hog", list(IN_FLIGHT))
def test_a_short_request_starts_at_the_next_step_whatever_is_in_flight(tiny, hog, cached):
    """One submission's prefill, however long or however many prompts, scored or generating,
    must not hold back a short request that arrives while it runs: the short one (fresh, or
    starting from cached blocks) is admitted at the first step after it was submitted (steps
    counted, not timed), its first token is passed on before that step's chunk of a long prompt
    runs, and every request's tokens and prompt log-probabilities equal the request run alone."""
    lengths, settings, grouped = IN_FLIGHT[hog]
    case = tiny("llama_gqa_bias")
    engine = Engine.load(case.artifact, prefix_block_size=4, threads=1)
    prompts = case.prompts(lengths, salt=96)
    cfg = GenerationConfig(do_sample=False, stop_token_ids=(), **settings)
    prefix, tail = case.prompts((8, 3), salt=97)
    short = prefix + tail
    ref = Engine.load(case.artifact, prefix_cache=False, threads=1)  # caches nothing the test then reuses
    alone = [ref.generate(p, cfg)[0] for p in prompts]
    short_alone = engine_alone(ref, short, 4)

    sched = Scheduler(engine, max_batch=4, step_tokens=24)  # the short prompt fits half of it
    steps, arrived, box, runs = [], [], {}, []
    plan, run = sched._batch.plan, engine.decoder.run

    def counting_plan(waiting):  # under the scheduler's lock
        p = plan(waiting)
        steps.append([r.index for r in p.starting])
        return p

    def arriving_run(*args, **kwargs):  # the stepping thread, outside the lock: a submit may come in
        mine = any(list(row[:len(short)]) == short or (cached and list(row[:len(tail)]) == tail)
                   for row in args[1])  # the short request's prefill (from its cached blocks: the tail)
        runs.append((len(steps) - 1, mine, bool(box) and _has_event(box["short"])))  # its step, short's token out yet
        out = run(*args, **kwargs)
        if hog_handles and not box and len(steps) >= 2:
            box["short"] = sched.submit(short, _greedy(4))
            arrived.append(len(steps))
        return out

    sched._batch.plan = counting_plan
    engine.decoder.run = arriving_run
    sched.start()
    try:
        hog_handles = []
        if cached:  # the short prompt's first 8 tokens are in cached blocks before anything else runs
            assert sched.submit(prefix + [5], _greedy(1)).result(timeout=60).token_ids
        key = object()
        hog_handles += [sched.submit(p, cfg, group=key if grouped else None) for p in prompts]
        results = [h.result(timeout=120) for h in hog_handles]
        got = box["short"].result(timeout=60)
    finally:
        sched.shutdown(10)

    admitted = next(i for i, ids in enumerate(steps) if box["short"].id in ids)
    assert admitted == arrived[0], (hog, steps)  # steps[arrived[0]] is the first plan after the submit
    # the step's runs after the short request's own (another prompt's chunk) start after its token was passed on
    later = [out for step, _, out in runs[next(i for i, r in enumerate(runs) if r[1]) + 1:] if step == admitted]
    assert all(later) and (later or len(lengths) > 1), runs
    hog_ids = {h.id for h in hog_handles}
    assert any(hog_ids & set(ids) for ids in steps[admitted + 1:])  # it arrived while the hog was prefilling
    assert got.token_ids == short_alone
    if cached:
        assert sched.stats().prefix.hit_tokens >= 8
    for r, a in zip(results, alone):
        assert r.token_ids == a.token_ids and r.finish_reason == a.finish_reason
        if a.prompt_logprobs is not None:
            assert [lp and lp.token_id for lp in r.prompt_logprobs] == [lp and lp.token_id for lp in a.prompt_logprobs]
            np.testing.assert_allclose([lp.logprob for lp in r.prompt_logprobs[1:]],
                                       [lp.logprob for lp in a.prompt_logprobs[1:]], atol=1e-4)
    assert engine.pool.live == 0


def _has_event(handle) -> bool:
    try:
        next(handle.events(timeout=0))
        return True
    except TimeoutError:
        return False


def test_a_draft_models_catch_up_is_spread_over_steps(tiny):
    """A speculating request's draft model first catches up on its whole prompt: under a step
    budget that is fed at most the budget per step (the row decodes plainly meanwhile), so a long
    prompt's draft prefill stalls no step; the tokens equal plain decoding. (The draft is the
    target itself: no export; drafting forced with cost 0.)"""
    case = tiny("llama_gqa_bias")
    engine = Engine.load(case.artifact, threads=1, draft=case.artifact, draft_cost=0.0)
    prompt = case.prompts((100,), salt=98)[0]
    plain = engine_alone(engine, prompt, 12)
    sched = Scheduler(engine, max_batch=2, step_tokens=24)
    fed, plan, run = [], sched._batch.plan, engine.draft.runner.run

    def counting_plan(waiting):
        fed.append(0)
        return plan(waiting)

    def counting_run(pool, input_ids, *args, **kwargs):
        fed[-1] += input_ids.shape[1]
        return run(pool, input_ids, *args, **kwargs)

    sched._batch.plan = counting_plan
    engine.draft.runner.run = counting_run
    sched.start()
    try:
        got = sched.submit(prompt, _greedy(12, speculative="draft:4")).result(timeout=120)
    finally:
        sched.shutdown(10)
    assert got.token_ids == plain
    assert sum(fed) >= 100 and max(fed) <= 24 + 4, fed  # the budget's catch-up, then at most k drafts
