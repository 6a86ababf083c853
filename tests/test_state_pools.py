"""Runtime state pools (KV per attention flavor, conv state per slot), the manifest's state
description for hybrids, custom-op bookkeeping, and the onnxruntime export target."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from graphkiln.cli import main as cli_main
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from reference import ATOL, greedy, max_abs

HYBRIDS = ["lfm2", "lfm2_moe", "lfm3"]


def _greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_slots_are_all_free_after_errors_and_cancellations(tiny, name, target):
    """Finishing, failing and cancelled requests all give their slots back, and a request that
    reuses a slot after any of them sees fresh (zeroed) state (KV rows written by the runtime,
    and, for the onnxruntime target, in place by the graph)."""
    case = tiny(name, target)
    engine = Engine.load(case.artifact)  # private engine: its pool is this test's alone
    prompts = case.prompts((5, 9, 3, 12), salt=31)
    expected = [greedy(case.reference, p, 12)[0] for p in prompts]

    for round_ in range(6):
        # cancelled mid-stream by the consumer
        stream = engine.stream(prompts, _greedy(12))
        for _ in range(5 + round_):
            next(stream)
        assert engine.pool.live == len(prompts)
        stream.close()
        assert engine.pool.live == 0
        # the consumer fails while iterating
        with pytest.raises(RuntimeError, match="consumer failed"):
            for i, _ in enumerate(engine.stream(prompts[:2], _greedy(12))):
                if i == 3:
                    raise RuntimeError("consumer failed")
        assert engine.pool.live == 0
        # bad input inside a batch: refused before any slot is claimed
        with pytest.raises(GraphkilnError, match="outside the vocabulary"):
            engine.generate([prompts[0], [case.vocab_size + 5]], _greedy(4))
        assert engine.pool.live == 0
        # requests that stop at different steps (each on a token it generates) shrink the batch
        stops = tuple(expected[i][2 + 3 * i] for i in range(3))
        engine.generate(prompts[:3], GenerationConfig(max_new_tokens=12, do_sample=False, stop_token_ids=stops))
        assert engine.pool.live == 0

    assert engine.pool.free_slots == engine.pool.slots
    results = engine.generate(prompts, _greedy(12))
    assert [r.token_ids for r in results] == expected


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_requests_finishing_early_leave_the_others_exact(tiny, name, target):
    """Survivors' KV and conv rows are moved when earlier slots free up; their tokens and
    logits must not notice."""
    case = tiny(name, target)
    prompts = case.prompts((4, 11, 6, 2), salt=32)
    ref = [greedy(case.reference, p, 16) for p in prompts]
    # requests 0 and 2 stop early on tokens that no other request generates, so slots 0 and 2
    # free up while 1 and 3 go on
    toks = [r[0] for r in ref]
    stop0 = next(t for t in toks[0][1:] if t not in toks[1] + toks[2] + toks[3])
    stop2 = next(t for t in toks[2][2:] if t not in toks[0] + toks[1] + toks[3])
    res = case.engine.generate(prompts, GenerationConfig(max_new_tokens=16, do_sample=False,
                                                         stop_token_ids=(stop0, stop2), output_logits=True))
    assert res[0].token_ids == toks[0][: toks[0].index(stop0) + 1]
    assert res[2].token_ids == toks[2][: toks[2].index(stop2) + 1]
    survivors = (1, 3)
    for i in survivors:
        assert res[i].token_ids == ref[i][0]
        assert max_abs(res[i].logits, ref[i][1]) <= ATOL


def test_manifest_describes_every_state_kind_and_its_layers(tiny):
    from transformers import AutoConfig

    case = tiny("lfm3")
    m = case.manifest
    kernel = AutoConfig.from_pretrained(str(case.checkpoint)).conv_L_cache
    kinds = {(s.kind, s.sliding_window): s for s in m.states}
    assert set(kinds) == {("kv", 8), ("kv", None), ("conv", None)}
    assert kinds[("kv", 8)].layers == (1, 3) and kinds[("kv", None)].layers == (2,)
    conv = kinds[("conv", None)]
    assert conv.layers == (0,) and conv.channels == 64 and conv.width == kernel - 1
    assert {o.name for o in m.custom_ops} == {"ShortConv", "Attention"}
    graph = m.graph("decoder")
    roles = {(t.role, t.layer) for t in graph.inputs}
    assert ("conv_state", 0) in roles and ("past_key", 0) not in roles and ("past_key", 1) in roles
    assert {t.name for t in graph.inputs} >= {"seq_lens", "slot_idx"}
    moe = tiny("lfm2_moe").manifest
    assert {o.name for o in moe.custom_ops} == {"ShortConv", "MoE", "Attention"}


@pytest.mark.parametrize("name", ["lfm2_moe", "qwen3_moe"])
def test_every_custom_node_carries_the_plugin_attributes(tiny, name):
    from graphkiln.ops import specs

    case = tiny(name)
    model = onnx.load(str(case.artifact / "decoder.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.domain == "graphkiln"]
    assert nodes, "no custom nodes in a model that needs them"
    for node in nodes:
        attrs = {a.name: a for a in node.attribute}
        spec = specs()[node.op_type]
        assert attrs["plugin_namespace"].s.decode() == spec.plugin_namespace
        assert attrs["plugin_version"].s.decode() == spec.plugin_version
    assert {(f.domain, f.name) for f in model.functions} == {("graphkiln", n.op_type) for n in nodes}


def test_unknown_custom_op_fails_to_load_with_a_clear_error(tiny, artifact_copy, capsys):
    art = artifact_copy(tiny("lfm2_moe"))
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["custom_ops"][0]["name"] = "FluxCapacitor"
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(GraphkilnError, match="custom op graphkiln.FluxCapacitor .*upgrade graphkiln"):
        Engine.load(art)
    assert cli_main(["run", str(art), "--prompt-ids", "5,6,7", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "FluxCapacitor" in err[0]


def test_onnxruntime_target_lowers_moe_and_keeps_parity(tiny, tmp_path):
    """--target onnxruntime swaps graphkiln.MoE for com.microsoft.MoE; outputs stay within tolerance."""
    case = tiny("qwen3_moe")
    out = tmp_path / "ort"
    assert cli_main(["export", str(case.checkpoint), "-o", str(out), "--max-seq-len", "128", "--target", "onnxruntime"]) == 0
    engine = Engine.load(out)
    assert engine.manifest.graph("decoder").target == "onnxruntime"
    assert "MoE" not in {o.name for o in engine.manifest.custom_ops}
    model = onnx.load(str(out / "decoder.onnx"), load_external_data=False)
    domains = {(n.domain, n.op_type) for n in model.graph.node}
    assert ("com.microsoft", "MoE") in domains and ("graphkiln", "MoE") not in domains
    prompts = case.prompts((6, 13), salt=33)
    for p, res in zip(prompts, engine.generate(prompts, _greedy(24, output_logits=True))):
        tokens, logits = greedy(case.reference, p, 24)
        assert res.token_ids == tokens
        assert max_abs(res.logits, logits) <= ATOL


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
@pytest.mark.parametrize("name", ["llama_gqa_bias", "lfm2"])
def test_reserve_reuses_memory_whose_old_rows_are_never_read(tiny, name, target):
    """A later, smaller generate call keeps the pool's memory (no fresh pages to fault in) and
    its results are unaffected by the earlier call's rows still lying in it; a larger one
    grows it."""
    case = tiny(name, target)
    engine = Engine.load(case.artifact)
    first = case.prompts((14, 9, 11), salt=5)
    for p, got in zip(first, engine.generate(first, _greedy(16))):
        assert got.token_ids == greedy(case.reference, p, 16)[0]
    pool = engine.pool
    address = {k: a.__array_interface__["data"][0] for k, a in pool.keys.items()}
    assert address, "this case has attention layers"

    second = case.prompts((6, 4), salt=6)
    for p, got in zip(second, engine.generate(second, _greedy(8))):
        assert got.token_ids == greedy(case.reference, p, 8)[0]
    assert (pool.slots, pool.capacity) == (2, 14)
    assert {k: a.__array_interface__["data"][0] for k, a in pool.keys.items()} == address

    pool.reserve(4, 64)
    assert all(a.__array_interface__["data"][0] != address[k] for k, a in pool.keys.items())
    assert all(a.shape[0] == 4 and a.shape[2] == 64 and a.flags["C_CONTIGUOUS"] for a in pool.keys.values())
