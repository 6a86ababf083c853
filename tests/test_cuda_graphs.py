"""CUDA-graph bookkeeping (graphkiln.runtime.backends.cuda_graphs), on CPU with real arrays and real
decoder steps: buckets, padding, graph keys, the graph cache's fallback rule, and warm-up probe
slots. The padding contract is checked end to end on the tensorrt-target graph of a conv/attention
hybrid, run by onnxruntime on CPU through the custom ops' function bodies (the graph TensorRT
builds its engine from): padding rows on free slots change neither the live rows' logits nor a
later request's results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends.cuda_graphs import (PAD_ID, CaptureFailed, DecodePadding, GraphCache, GraphKey, bucket_for,
                                           decode_buckets, probe_inputs, probe_slots, warm_up)
from graphkiln.runtime.backends.ort_cpu import DecoderGraph, numpy_dtype
from graphkiln.runtime.engine import PAD_ID as ENGINE_PAD_ID
from graphkiln.runtime.backends.state import StatePool

TRT = "tensorrt"


@pytest.mark.parametrize("max_batch, expected", [(1, (1,)), (2, (1, 2)), (3, (1, 2, 3)), (6, (1, 2, 4, 6)),
                                                 (8, (1, 2, 4, 8)), (9, (1, 2, 4, 8, 9)),
                                                 (128, (1, 2, 4, 8, 16, 32, 64, 128))])
def test_decode_buckets(max_batch, expected):
    assert decode_buckets(max_batch) == expected


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_decode_buckets_refuses_bad_sizes(bad):
    with pytest.raises(ValueError):
        decode_buckets(bad)


@given(st.integers(1, 300), st.integers(1, 400))
def test_bucket_for_is_the_smallest_bucket_that_holds_n(max_batch, n):
    buckets = decode_buckets(max_batch)
    b = bucket_for(n, buckets)
    if n > max_batch:
        assert b is None
    else:
        assert b in buckets and b >= n
        assert all(x < n for x in buckets if x < b)
        assert b < 2 * n or b == 1  # padding never more than doubles a batch


def test_bucket_for_refuses_an_empty_batch():
    with pytest.raises(ValueError):
        bucket_for(0, (1, 2))


def test_pad_keeps_live_rows_and_fills_padding_rows():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 100, (3, 1))
    pos = rng.integers(5, 50, (3, 1))
    idx = np.zeros((3, 1), np.int64)
    lengths = np.ones(3, np.int64)
    p = DecodePadding(3, 4)
    out = p.pad(ids, pos, idx, lengths)
    assert [a.shape for a in out] == [(4, 1), (4, 1), (4, 1), (4,)]
    assert all(a.dtype == np.int64 and a.flags.c_contiguous for a in out)
    for a, src in zip(out, (ids, pos, idx, lengths)):
        np.testing.assert_array_equal(a[:3], src)
    assert out[0][3, 0] == PAD_ID == ENGINE_PAD_ID
    assert (out[1][3, 0], out[2][3, 0], out[3][3]) == (0, 0, 1)
    # the inputs are not modified, and the padded arrays do not alias them
    out[0][0, 0] = -7
    assert ids[0, 0] != -7
    logits = np.arange(4 * 5, dtype=np.float32).reshape(4, 1, 5)
    np.testing.assert_array_equal(p.unpad(logits), logits[:3])


def test_pad_refuses_wrong_row_counts():
    with pytest.raises(ValueError, match="position_ids"):
        DecodePadding(2, 4).pad(np.zeros((2, 1)), np.zeros((3, 1)), np.zeros((2, 1)), np.ones(2))
    for live, bucket in [(5, 4), (-1, 4), (0, 0)]:
        with pytest.raises(ValueError):
            DecodePadding(live, bucket)


def test_probe_inputs_are_all_padding():
    ids, pos, idx, lengths = probe_inputs(4)
    assert ids.shape == (4, 1) and (ids == PAD_ID).all() and (pos == 0).all() and (idx == 0).all()
    assert (lengths == 1).all()


def test_graph_key_orders_bindings_by_name():
    a = GraphKey.of(4, 1, {"b": 20, "a": 10, "c": 30})
    b = GraphKey.of(4, 1, {"c": 30, "a": 10, "b": 20})
    assert a == b and a.addresses == (10, 20, 30) and hash(a) == hash(b)
    assert GraphKey.of(4, 1, {"a": 11, "b": 20, "c": 30}) != a  # a moved buffer is another graph
    assert GraphKey.of(2, 1, {"a": 10, "b": 20, "c": 30}) != a
    assert GraphKey.of(4, 0, {"a": 10, "b": 20, "c": 30}) != a


def test_graph_cache_replays_captured_keys_and_falls_back_otherwise():
    destroyed = []
    cache: GraphCache[str] = GraphCache(destroyed.append)
    k1, k2, k4 = (GraphKey(b, 1, (100, 200)) for b in (1, 2, 4))
    assert cache.should_capture(k1) and cache.get(k1) is None  # never captured: plain enqueue
    cache.put(k1, "g1")
    cache.fail(k2, "enqueue under capture failed")
    assert not cache.should_capture(k1) and not cache.should_capture(k2) and cache.should_capture(k4)
    assert cache.get(k1) == "g1" and cache.get(k1) == "g1"
    assert cache.get(k2) is None and cache.failure(k2) == "enqueue under capture failed"
    assert cache.get(GraphKey(1, 1, (100, 201))) is None  # same bucket, another address
    s = cache.stats
    assert (s.captured, s.replays, s.fallbacks, s.failed) == (1, 2, 3, 1)
    cache.put(k1, "g1b")  # recapture replaces and destroys the old graph
    assert destroyed == ["g1"] and cache.get(k1) == "g1b"
    cache.put(k4, "g4")
    cache.clear()
    assert sorted(destroyed) == ["g1", "g1b", "g4"] and len(cache) == 0 and cache.should_capture(k2)


# -- warm-up on a real pool and real steps ------------------------------------------------------

def _hybrid(tiny):
    case = tiny("lfm2", TRT)  # conv pools and attention, both updated in place by the graph
    return case, _graph(case)


def _graph(case) -> DecoderGraph:
    # one DecoderGraph per pool: it caches its binding by (batch, pool.generation), not by pool
    graph = DecoderGraph(case.artifact, case.manifest.graph_for("decoder", "onnxruntime"), threads=1)
    assert graph.spec.target == TRT
    return graph


def _new_pool(case, slots: int, capacity: int) -> StatePool:
    pool = StatePool(case.manifest.states, numpy_dtype(case.manifest.states[0].dtype))
    pool.reserve(slots, capacity)
    return pool


def _probe_step(graph: DecoderGraph, pool: StatePool, bucket: int) -> np.ndarray:
    return graph.run(pool, *probe_inputs(bucket))


def test_probe_slots_leave_the_pool_empty_and_unchanged_in_shape(tiny):
    case, graph = _hybrid(tiny)
    pool = _new_pool(case, 4, 16)
    before = {k: (a.shape, a.__array_interface__["data"][0]) for k, a in pool._backing.items()}
    views = {l: a.shape for l, a in pool.keys.items()} | {("c", l): a.shape for l, a in pool.conv.items()}
    cache: GraphCache = GraphCache()
    key = lambda b: GraphKey(b, 1, (pool.generation,))  # noqa: E731
    seen = []

    def capture(bucket):
        assert pool.live == bucket  # the probe's slots are claimed while it runs
        seen.append(bucket)
        if bucket == 2:
            raise CaptureFailed("refused under capture")
        return _probe_step(graph, pool, bucket)

    report = warm_up(pool, (1, 2, 4), key, cache, capture)
    assert seen == [1, 2, 4] and report.captured == (1, 4) and report.failed == ((2, "refused under capture"),)
    assert pool.live == 0 and pool.slots == 4 and pool.capacity == 16
    assert {k: (a.shape, a.__array_interface__["data"][0]) for k, a in pool._backing.items()} == before
    assert {l: a.shape for l, a in pool.keys.items()} | {("c", l): a.shape for l, a in pool.conv.items()} == views
    assert cache.get(key(2)) is None and cache.get(key(4)) is not None
    # a second warm-up tries nothing again: captured and failed keys are both settled
    assert warm_up(pool, (1, 2, 4), key, cache, capture).captured == () and seen == [1, 2, 4]


def test_probe_slots_are_released_when_the_probe_raises(tiny):
    case, _ = _hybrid(tiny)
    pool = _new_pool(case, 4, 8)
    with pytest.raises(ZeroDivisionError):
        with probe_slots(pool, 3) as slots:
            assert slots == (0, 1, 2) and pool.live == 3
            1 / 0
    assert pool.live == 0
    pool.claim()
    with pytest.raises(RuntimeError, match="empty pool"):
        with probe_slots(pool, 1):
            pass
    pool.release(0)
    with pytest.raises(RuntimeError, match="does not fit"):
        with probe_slots(pool, 5):
            pass
    assert pool.live == 0


def _prefill(graph, pool, prompts):
    n, longest = len(prompts), max(map(len, prompts))
    ids = np.full((n, longest), PAD_ID, np.int64)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    last = np.array([[len(p) - 1] for p in prompts], np.int64)
    logits = graph.run(pool, ids, np.tile(np.arange(longest), (n, 1)), last, np.array([len(p) for p in prompts]))
    return logits[:, 0].copy()


def _decode(graph, pool, tokens, positions, bucket=None):
    n = len(tokens)
    arrays = (np.array(tokens, np.int64)[:, None], np.array(positions, np.int64)[:, None],
              np.zeros((n, 1), np.int64), np.ones(n, np.int64))
    if bucket is None:
        return graph.run(pool, *arrays)[:, 0].copy()
    padding = DecodePadding(n, bucket)
    return padding.unpad(graph.run(pool, *padding.pad(*arrays)))[:, 0].copy()


def test_padding_rows_change_nothing_live(tiny):
    """Three requests decoded with and without a fourth padding row (bucket 4, slot 3 free):
    the same logits at every step; then a fourth request claims the slot the padding row wrote
    (conv state and KV row 0) and generates exactly what it does on a fresh pool."""
    case, graph = _hybrid(tiny)
    graph_b = _graph(case)
    prompts = case.prompts((5, 9, 3), salt=41)
    plain, padded = _new_pool(case, 3, 32), _new_pool(case, 4, 32)
    for pool in (plain, padded):
        for _ in prompts:
            pool.claim()
    tokens_a = _prefill(graph, plain, prompts).argmax(-1)
    tokens_b = _prefill(graph_b, padded, prompts).argmax(-1)
    np.testing.assert_array_equal(tokens_a, tokens_b)
    positions = [len(p) for p in prompts]
    for _ in range(6):
        a = _decode(graph, plain, tokens_a, positions)
        b = _decode(graph_b, padded, tokens_b, positions, bucket=4)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # batch 3 vs 4: the same rows, maybe other blocking
        tokens_a = tokens_b = a.argmax(-1)
        positions = [p + 1 for p in positions]
    assert np.abs(padded.conv[0][3]).sum() > 0  # the padding row really wrote the free slot's state
    for slot in (2, 1, 0):
        padded.release(slot)

    engine = Engine.load(case.artifact, threads=1, target=TRT)
    engine.pool = padded  # the pool the padding rows wrote, reused by a new session
    conv_before = padded.conv[0]
    fresh = Engine.load(case.artifact, threads=1, target=TRT)
    batch = case.prompts((4, 7, 6, 2), salt=42)
    # 7 + 25 tokens: the session reserves exactly the (4 slots x 32) layout the padding rows wrote
    config = GenerationConfig(max_new_tokens=25, do_sample=False, stop_token_ids=())
    got = [r.token_ids for r in engine.generate(batch, config)]
    assert padded.conv[0] is conv_before  # same views: slot 3 is the slot the padding row wrote
    assert got == [r.token_ids for r in fresh.generate(batch, config)]


def test_warm_up_probes_leave_no_trace_in_later_generations(tiny):
    """Warm-up probes (every bucket, each writing its probe slots' state) on an engine's own pool,
    then generation on that pool: the same tokens as an engine that was never warmed up."""
    case, _ = _hybrid(tiny)
    warmed = Engine.load(case.artifact, threads=1, target=TRT)
    fresh = Engine.load(case.artifact, threads=1, target=TRT)
    warmed.pool.reserve(4, case.max_seq_len)
    report = warm_up(warmed.pool, decode_buckets(4), lambda b: GraphKey(b, 1, ()), GraphCache(),
                     lambda b: _probe_step(warmed.decoder, warmed.pool, b))
    assert report.captured == (1, 2, 4) and warmed.pool.live == 0
    batch = case.prompts((3, 8, 5), salt=43)
    config = GenerationConfig(max_new_tokens=6, do_sample=False, stop_token_ids=())
    assert [r.token_ids for r in warmed.generate(batch, config)] == [r.token_ids for r in fresh.generate(batch, config)]
