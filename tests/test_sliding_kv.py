"""Window-sized KV caches for sliding-window layers (runtime.backends.state, ``windowed``): the
onnxruntime target's sliding GroupQueryAttention nodes address a cache of ``window_rows``
positions per slot, and a model decoding past many windows (window 8, the buffers made as small
as they go, so rows are dropped and moved many times) still equals transformers — greedy tokens
and logits — alone, from a reused prefix, in prefill chunks through the Scheduler, and with
speculative rollbacks; the pools' bytes grow per token only with the full-attention layers; a
run that would read dropped rows fails loudly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends.state import StatePool
from graphkiln.runtime.request.scheduler import Scheduler

NEW = 60  # new tokens: with a 20-token prompt, ten windows of 8
GREEDY = GenerationConfig(max_new_tokens=NEW, temperature=0, stop_token_ids=(), output_logits=True)


@pytest.fixture(scope="module")
def gpt_oss(tiny):
    """gpt-oss (sliding window 8 and full layers alternating, sinks) for the onnxruntime target,
    three prompts (two share 24 tokens), and a check of a greedy result against transformers:
    its logits at every generated position (one forward over prompt + tokens) and each token
    their argmax."""
    import torch

    case = tiny("gpt_oss", "onnxruntime")
    rng = np.random.default_rng(7)
    shared = rng.integers(3, case.vocab_size, 24).tolist()
    prompts = [rng.integers(3, case.vocab_size, 20).tolist(), shared + rng.integers(3, case.vocab_size, 5).tolist(),
               shared + rng.integers(3, case.vocab_size, 11).tolist()]

    def check(result, what: str) -> None:
        p, tokens = result.prompt_ids, result.token_ids
        assert len(tokens) == NEW, what
        with torch.no_grad():
            ref = case.reference(torch.tensor([p + tokens])).logits[0, len(p) - 1:-1].numpy()
        assert tokens == ref.argmax(-1).tolist(), what
        np.testing.assert_allclose(np.asarray(result.logits), ref, atol=1e-4, rtol=0, err_msg=what)

    return case, prompts, check


def _small_windows(engine: Engine) -> Engine:
    """Windowed buffers only a row longer than what they must keep: every few tokens the rows
    below the window are dropped and the rest moved to the front."""
    assert engine.pool.windowed and set(engine.pool.windows.values()) == {8}
    engine.pool.window_step = 1
    return engine


def test_decoding_past_many_windows_equals_transformers(gpt_oss):
    case, prompts, check = gpt_oss
    engine = _small_windows(Engine.load(case.artifact, prefix_cache=False))
    results = engine.generate(prompts, GREEDY)  # three rows in one batch, each moving its own window
    for i, got in enumerate(results):
        check(got, f"prompt {i}")
    pool = engine.pool
    sliding, full = pool.keys[0], pool.keys[1]
    assert sliding.shape[2] < 60 and full.shape[2] >= 20 + NEW  # window-sized against full-length
    # speculation: the verification's rejected rows are rolled back over a moving window
    spec = engine.generate(prompts[0] * 3, dataclasses.replace(GREEDY, speculative="ngram:8", output_logits=False))[0]
    plain = engine.generate(prompts[0] * 3, dataclasses.replace(GREEDY, output_logits=False))[0]
    assert spec.token_ids == plain.token_ids


def test_prefix_reuse_and_chunked_prefill_over_window_sized_caches(gpt_oss):
    case, prompts, check = gpt_oss
    engine = _small_windows(Engine.load(case.artifact, prefix_block_size=4))
    first = engine.generate(prompts[1], GREEDY)[0]
    again = engine.generate(prompts[2], GREEDY)[0]  # its first 24 tokens come from the cache
    check(first, "first")
    check(again, "from a cached prefix")
    assert again.cached_tokens == 24
    # the Scheduler: prompts in prefill chunks of a few tokens each, beside decoding rows, the
    # cache reused again (the generated tokens' blocks too)
    sched = Scheduler(engine, max_batch=2, step_tokens=6)
    sched.start()
    try:
        handles = [sched.submit(p, GREEDY) for p in prompts]
        results = [h.result(timeout=120) for h in handles]
        # /metrics' graphkiln_kv_bytes_per_token: below the full-length pool's at the same length
        full = StatePool(case.manifest.states, engine.pool.dtype).kv_bytes_per_token(engine.max_seq_len)
        assert 0 < sched.stats().kv_bytes_per_token < full
    finally:
        sched.shutdown(5)
    for i, got in enumerate(results):
        check(got, f"scheduled prompt {i}")
    assert sum(r.cached_tokens for r in results) >= 24


def test_pool_bytes_grow_only_with_full_layers(gpt_oss):
    case, _, _ = gpt_oss
    states, dtype = case.manifest.states, np.dtype(np.float32)
    grown = {}
    for windowed in (False, True):
        pool = StatePool(states, dtype, windowed=windowed)
        sizes = []
        for capacity in (4096, 8192):
            pool.reserve(2, capacity)
            sizes.append(pool.nbytes)
        grown[windowed] = sizes[1] - sizes[0]
        assert pool.kv_bytes_per_token(8192) * 8192 * 2 == pool.nbytes  # what /metrics and inspect report
    # gpt-oss alternates sliding and full layers of one shape: half the bytes per added token
    assert grown[True] * 2 == grown[False]


def test_a_run_behind_its_window_fails_loudly(gpt_oss):
    case, _, _ = gpt_oss
    pool = StatePool(case.manifest.states, np.dtype(np.float32), windowed=True)
    pool.window_step = 1
    pool.reserve(1, 128)
    pool.claim()
    for position in range(101):  # decoding up to position 100 moves the window along
        offsets, total = pool.window_offsets(np.array([position]), np.array([1]), 1)
    assert int(offsets[0]) == 100 - pool.window_keep and int(total) == pool.window_keep + 1
    pool.window_offsets(np.array([100 - pool.window_keep + 7]), np.array([1]), 1)  # a rollback within reach
    with pytest.raises(RuntimeError, match="dropped"):
        pool.window_offsets(np.array([100 - pool.window_keep + 6]), np.array([1]), 1)


def test_pipeline_stages_over_window_sized_caches(gpt_oss, tmp_path):
    """Two stages (the sliding layer in the first, the full one in the second), each with its own
    pool: the same tokens and logits, from a reused prefix too."""
    from conftest import MAX_SEQ_LEN
    from graphkiln.export.pipeline import ExportOptions, export_model

    case, prompts, check = gpt_oss
    export_model(str(case.checkpoint), tmp_path / "staged",
                 ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, target="onnxruntime", stages=2))
    engine = Engine.load(tmp_path / "staged", prefix_block_size=4)
    assert [p.windowed for p in engine.pool.pools] == [True, False]
    engine.pool.pools[0].window_step = 1
    for i in (1, 2):
        result = engine.generate(prompts[i], GREEDY)[0]
        check(result, f"staged prompt {i}")
    assert result.cached_tokens == 24
