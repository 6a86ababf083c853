"""Prefix reuse (runtime.request.prefix): a request starting with a cached prefix prefills only the
rest, and its tokens and logits are those of the same request without reuse.

Each case compares an Engine with the cache (blocks of 4 tokens, so the tiny prompts span many
blocks) against one without, on the same artifact: dense, MoE, conv hybrid, sliding window and a
vision-language model; through ``Engine.generate`` and through the continuous-batching Scheduler
(concurrent requests sharing a prefix, chunked prefill, cancellation mid-prefill, a budget of a
few blocks). The cached-token counts are checked too, so a cache that reuses nothing fails.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.prefix import PrefixIndex
from graphkiln.runtime.request.scheduler import Scheduler

B = 4  # block size of these tests
STEPS = 12
GREEDY = GenerationConfig(max_new_tokens=STEPS, temperature=0, stop_token_ids=(), output_logits=True)
CASES = ["llama_tok", "qwen3_moe", "lfm2", "mistral_sliding", "qwen3_5"]


def prompts(vocab: int, salt: int = 0) -> list[list[int]]:
    """Two 40-token bases; prompts extending them by 1-9 tokens, one ending on a block boundary
    of the base (entirely cached once the base is), one cut inside a block."""
    rng = np.random.default_rng(salt)
    a, b = (rng.integers(3, vocab, 40).tolist() for _ in range(2))
    more = lambda k: rng.integers(3, vocab, k).tolist()
    return [a + more(1), b + more(3), a + more(5), b + more(9), a[:36], a[:37], b + more(2)]


def same(results, reference) -> None:
    for i, (got, ref) in enumerate(zip(results, reference)):
        assert got.token_ids == ref.token_ids, f"prompt {i}"
        np.testing.assert_allclose(got.logits, ref.logits, atol=2e-4, rtol=0, err_msg=f"prompt {i}")


@pytest.fixture(scope="module", params=CASES)
def engines(request, tiny):
    case = tiny(request.param)
    return (case, Engine.load(case.artifact, prefix_cache=False),
            Engine.load(case.artifact, prefix_block_size=B))


def test_reuse_equals_no_reuse_one_by_one_and_in_a_batch(engines):
    case, ref, eng = engines
    ps = prompts(case.vocab_size)
    expected = [ref.generate(p, GREEDY)[0] for p in ps]
    got = [eng.generate(p, GREEDY)[0] for p in ps]
    same(got, expected)
    cached = [r.cached_tokens for r in got]
    assert cached[:2] == [0, 0]  # nothing cached yet
    if eng.prefix.index.snapshots:
        # conv state is kept where a run ended on a block boundary: each prompt's generated blocks
        assert all(c % B == 0 for c in cached) and sum(cached) > 0, cached
    else:
        assert cached[2:] == [40, 40, 35, 36, 40], cached  # a[:36] is entirely cached: its last token runs
    # a batch through one generate call: every prompt is cached now
    batch = eng.generate(ps, GREEDY)
    same(batch, expected)
    assert all(r.cached_tokens > 0 for r in batch) or eng.prefix.index.snapshots


def test_a_second_turn_reuses_the_first_turns_prompt_and_reply(engines):
    case, ref, eng = engines
    first = prompts(case.vocab_size, salt=1)[0]
    reply = eng.generate(first, GREEDY)[0]
    second = first + reply.token_ids + [5, 6, 7]
    got, expected = eng.generate(second, GREEDY)[0], ref.generate(second, GREEDY)[0]
    same([got], [expected])
    # every full block of the first turn's sequence but the last token's (never fed back) is reused
    whole = (len(first) + len(reply.token_ids) - 1) // B * B
    assert got.cached_tokens >= whole - (B if eng.prefix.index.snapshots else 0), (got.cached_tokens, whole)


def _through_scheduler(engine: Engine, ps, *, step_tokens: int, cancel_first: bool = False):
    sched = Scheduler(engine, max_batch=4, step_tokens=step_tokens)
    sched.start()
    try:
        handles = [sched.submit(p, GREEDY) for p in ps]
        if cancel_first:
            handles[0].cancel()
        results = [h.result(timeout=120) for h in handles]
        return results, [h.cached_tokens for h in handles], sched.stats()
    finally:
        sched.shutdown(5)


def test_concurrent_requests_sharing_a_prefix_through_the_scheduler(engines):
    """Seven requests at once over two shared prefixes, prefilled in chunks of at most 12
    tokens: the later ones sharing a prefix wait for the first's blocks and start from them."""
    case, ref, eng = engines
    ps = prompts(case.vocab_size, salt=2)
    expected = [ref.generate(p, GREEDY)[0] for p in ps]
    results, cached, stats = _through_scheduler(eng, ps, step_tokens=12)
    same(results, expected)
    assert cached[:2] == [0, 0] and sum(cached[2:]) >= (3 * 32 if not eng.prefix.index.snapshots else B), cached
    assert stats.free_slots == stats.total_slots


def test_cancelled_mid_prefill_leaves_usable_blocks(engines):
    """A request cancelled while its prompt is being prefilled in chunks keeps the blocks it
    computed; the same prompt afterwards starts from them and equals the reference."""
    case, ref, eng = engines
    p = prompts(case.vocab_size, salt=3)[3]
    results, _, _ = _through_scheduler(eng, [p], step_tokens=8, cancel_first=True)
    assert results[0].finish_reason == "cancelled"
    again, cached, _ = _through_scheduler(eng, [p], step_tokens=8)
    same(again, [ref.generate(p, GREEDY)[0]])
    assert again[0].finish_reason == "length"


def test_a_budget_of_a_few_blocks_evicts_and_stays_correct(tiny):
    case = tiny("llama_tok")
    ref = Engine.load(case.artifact, prefix_cache=False)
    per_block = ref.pool.block_bytes(B)
    eng = Engine.load(case.artifact, prefix_block_size=B, prefix_cache_bytes=3 * per_block)
    assert eng.prefix.index.capacity == 3
    ps = prompts(case.vocab_size, salt=4)
    same([eng.generate(p, GREEDY)[0] for p in ps + ps], [ref.generate(p, GREEDY)[0] for p in ps + ps])
    s = eng.prefix.stats()
    assert s.evictions > 0 and s.blocks == 3 and s.bytes == 3 * per_block and s.hit_tokens > 0, s


def test_prompt_logprobs_are_computed_not_reused(tiny):
    """A request for its prompt's log-probabilities needs every position's logits: it takes
    nothing from the cache (and equals the uncached request)."""
    case = tiny("llama_tok")
    ref = Engine.load(case.artifact, prefix_cache=False)
    eng = Engine.load(case.artifact, prefix_block_size=B)
    p = prompts(case.vocab_size, salt=5)[0]
    cfg = GenerationConfig(max_new_tokens=2, temperature=0, prompt_logprobs=1)
    eng.generate(p, cfg)
    got, expected = eng.generate(p, cfg)[0], ref.generate(p, cfg)[0]
    assert got.cached_tokens == 0
    for a, b in zip(got.prompt_logprobs[1:], expected.prompt_logprobs[1:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_vision_prompts_key_blocks_by_image_content(tiny):
    """Two prompts with the same token ids and different images share only the blocks before
    the image; the same image again reuses through it. Tokens equal the uncached engine's."""
    from test_vlm_runtime import rgb

    case = tiny("llava_clip")
    ref = Engine.load(case.artifact, prefix_cache=False)
    eng = Engine.load(case.artifact, prefix_block_size=B)
    image_token = eng.manifest.vision.image_token_id
    rng = np.random.default_rng(6)
    p = rng.integers(3, 300, 10).tolist() + [image_token] + rng.integers(3, 300, 12).tolist()
    one, other = rgb(1, 32, 32), rgb(2, 32, 32)
    cfg = GenerationConfig(max_new_tokens=8, temperature=0, stop_token_ids=())
    first = eng.generate(p, cfg, images=[one])[0]
    again = eng.generate(p, cfg, images=[one])[0]
    changed = eng.generate(p, cfg, images=[other])[0]
    for got, image in ((first, one), (again, one), (changed, other)):
        assert got.token_ids == ref.generate(p, cfg, images=[image])[0].token_ids
    n = len(first.prompt_ids)
    assert again.cached_tokens == (n - 1) // B * B or again.cached_tokens == n - 1, (again.cached_tokens, n)
    assert changed.cached_tokens == 10 // B * B  # the blocks wholly before the image


def test_index_evicts_the_tail_of_a_chain_first():
    index = PrefixIndex(block_size=2, capacity_blocks=3, block_bytes=1, snapshots=False)
    keys: list[bytes] = []
    index.extend_keys(keys, [1, 2, 3, 4, 5, 6])
    writes, _ = index.insert(keys, snapshot_last=False)
    assert [b for b, _ in writes] == [0, 1, 2]
    other: list[bytes] = []
    index.extend_keys(other, [9, 9])
    index.insert(other, snapshot_last=False)  # full: the chain's last block goes
    assert index.lookup(keys, 6).tokens == 4 and index.evictions == 1
    salted: list[bytes] = []
    index.extend_keys(salted, [1, 2, 3, 4], salt=b"adapter-1")
    assert index.lookup(salted, 4).tokens == 0  # a salt (a LoRA id) never shares rows


def test_bad_budgets_are_one_line(tiny):
    case = tiny("llama_tok")
    for bad, needle in ((10, "holds no block"), (1 << 60, "prefix cache budget"), (-1, "bytes >= 0")):
        with pytest.raises(GraphkilnError, match=needle) as exc:
            Engine.load(case.artifact, prefix_cache_bytes=bad)
        assert "\n" not in str(exc.value)
    with pytest.raises(GraphkilnError, match="prefix_block_size"):
        Engine.load(case.artifact, prefix_block_size=0)
    assert Engine.load(case.artifact, prefix_cache=False).prefix is None


def test_pipeline_stages_in_process_reuse_their_own_layers_blocks(tiny, tmp_path_factory):
    """A 2-stage artifact chained in one process: each stage's pool restores its own layers' rows
    under the same block ids; a second turn equals the uncached engine."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    case = tiny("llama_tok")
    art = tmp_path_factory.mktemp("prefix-staged") / "artifact"
    export_model(str(case.checkpoint), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, stages=2))
    ref = Engine.load(art, prefix_cache=False)
    eng = Engine.load(art, prefix_block_size=B)
    first = prompts(case.vocab_size, salt=7)[1]
    reply = eng.generate(first, GREEDY)[0]
    second = first + reply.token_ids + [5, 6, 7]
    got, want = eng.generate(second, GREEDY)[0], ref.generate(second, GREEDY)[0]
    same([got], [want])
    assert got.cached_tokens == (len(first) + STEPS - 1) // B * B
    assert all(p.store is not None and p.store.keys for p in eng.pool.pools)  # each stage keeps its own layers
    assert set(eng.pool.pools[0].store.keys).isdisjoint(eng.pool.pools[1].store.keys)
