"""Multi-LoRA end to end: artifacts exported with ``--lora-rank`` against PEFT's ``merge_and_unload()``.

Adapters are real PEFT output with random, non-zero B (``conftest.make_peft_adapter``). Parity is
logits within 1e-4 and identical greedy tokens per adapter and for the base model, and a batch that
mixes two adapters and none in every step equals each request alone. The artifact's adapter stacks
are graph inputs on every target, so the same checks run on the portable, onnxruntime and tensorrt
graphs (the tensorrt graph on onnxruntime, through the custom ops' functions).
"""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import onnx
import pytest

from conftest import MAX_SEQ_LEN, make_peft_adapter
from graphkiln.errors import GraphkilnError
from graphkiln.export.pipeline import ExportOptions, export_model
from graphkiln.runtime import Engine
from graphkiln.runtime.request.scheduler import Scheduler
from graphkiln.runtime.requests import GenerationConfig

pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

STEPS = 16
GREEDY = GenerationConfig(max_new_tokens=STEPS, output_logits=True, stop_token_ids=())
ROWS = ("alpha", None, "beta")  # the mixed batch: two adapters and the base model


def reference(model, prompt: list[int]) -> tuple[list[int], np.ndarray]:
    """transformers' greedy tokens and per-step logits [STEPS, vocab] for ``prompt``."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0].float().numpy()


def load(artifact, adapters: dict, **kwargs) -> Engine:
    engine = Engine.load(artifact, **kwargs)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def mixed_batch(engine: Engine, prompts, names) -> list:
    """Every request submitted before the scheduler starts, so its first step admits them all and every
    step mixes their adapters."""
    sched = Scheduler(engine, max_batch=len(prompts))
    handles = [sched.submit(p, dataclasses.replace(GREEDY, adapter=n)) for p, n in zip(prompts, names)]
    sched.start()
    try:
        return [h.result(timeout=120) for h in handles]
    finally:
        sched.shutdown(10)


def check_parity(engine: Engine, merged, prompts, names) -> None:
    refs = {n: reference(merged(n), p) for p, n in zip(prompts, names)}
    alone = [engine.generate(p, dataclasses.replace(GREEDY, adapter=n))[0] for p, n in zip(prompts, names)]
    together = mixed_batch(engine, prompts, names)
    for p, n, a, t in zip(prompts, names, alone, together):
        tokens, logits = refs[n]
        assert a.token_ids == tokens, f"adapter {n}: {a.token_ids} != transformers {tokens}"
        np.testing.assert_allclose(a.logits, logits, atol=1e-4, rtol=0, err_msg=f"adapter {n}")
        assert t.token_ids == a.token_ids, f"adapter {n} in a mixed batch"
        np.testing.assert_allclose(t.logits, a.logits, atol=1e-5, rtol=0, err_msg=f"adapter {n} in a mixed batch")
    assert engine.pool.live == 0


@pytest.mark.parametrize("target", ["onnxruntime", "portable", "tensorrt"])
def test_adapters_match_peft_merged_model(lora_case, target):
    engine = load(lora_case.artifact, lora_case.adapters, target=target)
    prompts = [[5, 9, 3, 7, 11], [4, 8, 6], [12, 13, 14, 15, 16, 17, 18]]
    check_parity(engine, lora_case.merged, prompts, ROWS)
    # the adapters change the output: parity above is not the base model's three times
    base_tokens = reference(lora_case.merged(None), prompts[0])[0]
    assert engine.generate(prompts[0], dataclasses.replace(GREEDY, adapter="alpha"))[0].token_ids != base_tokens


def test_graph_keeps_its_fusions_and_fixed_stacks(lora_case):
    """The onnxruntime graph still packs q/k/v into GroupQueryAttention and fuses residual norms with
    the adapter updates in place, each update behind an If; the stacks are float32 graph inputs of
    fixed [slots, in, rank]."""
    spec = lora_case.manifest.graph("decoder", "onnxruntime")
    model = onnx.load(str(lora_case.artifact / spec.file), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(n.input[1] == "" for n in gqa), "q/k/v not packed"
    assert "SkipSimplifiedLayerNormalization" in ops
    # every adapter update (q/k/v, o, gate/up, down per layer) is skipped as a whole in steps without adapter rows
    assert ops.count("If") == 4 * lora_case.manifest.model.num_layers
    stacks = [t for t in spec.inputs if t.role in ("lora_a", "lora_b")]
    layers = lora_case.manifest.model.num_layers
    assert len(stacks) == 2 * 7 * layers
    assert all(t.dtype == "float32" and t.shape[0] == 3 and 8 in t.shape[1:] for t in stacks)


@pytest.mark.parametrize("name, settings", [
    # MoE FFNs take no stacks: the attention projections do
    ("mixtral", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])),
    # conv hybrid with its own names (self_attn.out_proj, feed_forward.w1/w3/w2): the manifest's module paths
    ("lfm2", dict(r=4, lora_alpha=4, target_modules=r".*self_attn\.(q_proj|k_proj|v_proj|out_proj)|.*feed_forward\.(w1|w2|w3)")),
])
def test_moe_and_hybrid_families(tiny, tmp_path, name, settings):
    ckpt = tiny(name).checkpoint
    adapters = {n: make_peft_adapter(ckpt, tmp_path / n, seed=7 + i, **settings) for i, n in enumerate(("alpha", "beta"))}
    art = tmp_path / "artifact"
    export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, lora_rank=4, max_loras=2))
    engine = load(art, adapters)

    def merged(n):
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
        return model if n is None else peft.PeftModel.from_pretrained(model, str(adapters[n])).merge_and_unload().eval()

    check_parity(engine, merged, [[5, 9, 3, 7], [4, 8, 6, 2, 10], [12, 13, 14]], ROWS)


def test_stages_bind_their_own_layers_stacks(lora_case, tmp_path):
    art = tmp_path / "staged"
    export_model(str(lora_case.checkpoint), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, stages=2,
                                                                lora_rank=8, max_loras=2))
    engine = load(art, lora_case.adapters)
    for stage in engine.manifest.stages:
        graph = engine.manifest.graph_for(stage.graph, "onnxruntime")
        layers = {t.layer for t in graph.inputs if t.role in ("lora_a", "lora_b")}
        assert layers == set(range(*stage.layers)), f"{stage.graph} takes stacks of layers {layers}"
    single = load(lora_case.artifact, lora_case.adapters)
    prompts = [[5, 9, 3, 7, 11], [4, 8, 6]]
    for p, n in zip(prompts, ("beta", "alpha")):
        config = dataclasses.replace(GREEDY, adapter=n)
        a, b = engine.generate(p, config)[0], single.generate(p, config)[0]
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logits, b.logits, atol=1e-4, rtol=0)


def test_int4_base_keeps_float_adapters(lora_case, tmp_path):
    """An int4 base with float adapters: the adapter moves the logits towards the merged fp32 model's."""
    art = tmp_path / "int4"
    export_model(str(lora_case.checkpoint), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, quant="int4",
                                                                quant_method="rtn", lora_rank=8, max_loras=2))
    engine = load(art, lora_case.adapters)
    spec = engine.manifest.graph("decoder")
    model = onnx.load(str(art / spec.file), load_external_data=False)
    stacks = {t.name for t in spec.inputs if t.role in ("lora_a", "lora_b")}
    assert not [n for n in model.graph.node if n.op_type == "MatMulNBits" and set(n.input) & stacks]
    prompt = [5, 9, 3, 7, 11, 4, 8]
    config = GenerationConfig(max_new_tokens=1, output_logits=True)
    with_adapter = engine.generate(prompt, dataclasses.replace(config, adapter="alpha"))[0].logits[0]
    without = engine.generate(prompt, config)[0].logits[0]
    want = reference(lora_case.merged("alpha"), prompt)[1][0]
    assert np.abs(with_adapter - want).mean() < 0.5 * np.abs(without - want).mean()


def test_prefix_blocks_are_never_shared_across_adapters(lora_case):
    engine = load(lora_case.artifact, lora_case.adapters, prefix_block_size=4)
    prompt = list(range(3, 3 + 21))
    runs = [(n, engine.generate(prompt, dataclasses.replace(GREEDY, adapter=n))[0]) for n in ("alpha", "beta", None, "alpha")]
    assert [r.cached_tokens for _, r in runs[:3]] == [0, 0, 0]  # a new adapter (or none) reuses nothing
    assert runs[3][1].cached_tokens > 0 and runs[3][1].token_ids == runs[0][1].token_ids
    np.testing.assert_allclose(runs[3][1].logits, runs[0][1].logits, atol=1e-5, rtol=0)


def test_slots_are_lru_and_held_by_running_requests(lora_case, tmp_path):
    engine = load(lora_case.artifact, lora_case.adapters)  # max_loras 2: both slots taken
    gamma = shutil.copytree(lora_case.adapters["beta"], tmp_path / "gamma")
    engine.generate([5, 6, 7], dataclasses.replace(GREEDY, max_new_tokens=1, adapter="alpha"))  # beta is now LRU
    engine.load_adapter("gamma", gamma)
    assert sorted(engine.adapter_names()) == ["alpha", "gamma"]
    with pytest.raises(GraphkilnError, match="no LoRA adapter named 'beta' is loaded"):
        engine.generate([5, 6, 7], dataclasses.replace(GREEDY, adapter="beta"))
    # a running request holds its slot: neither unloaded nor evicted until it finishes
    stream = engine.stream([5, 6, 7], dataclasses.replace(GREEDY, adapter="gamma"))
    next(stream)
    with pytest.raises(GraphkilnError, match="in use by 1 queued or running request"):
        engine.unload_adapter("gamma")
    stream.close()
    engine.unload_adapter("gamma")
    assert engine.adapter_names() == ["alpha"]


def test_refusals(lora_case, llama_case, tiny, tmp_path):
    src = str(lora_case.checkpoint)
    for opts, match in [(dict(lora_rank=0), "--lora-rank 0 is out of range"),
                        (dict(lora_rank=8, max_loras=0), "--max-loras 0 is out of range"),
                        (dict(lora_rank=8, lora_targets="q,qkv"), "'qkv' is not a projection"),
                        (dict(lora_targets="q"), "--lora-targets needs --lora-rank")]:
        with pytest.raises(GraphkilnError, match=match):
            export_model(src, tmp_path / "out", ExportOptions(progress=False, **opts))
        assert not (tmp_path / "out").exists()
    with pytest.raises(GraphkilnError, match="has no LoRA-adaptable gate_proj"):  # its FFNs are all MoE
        export_model(str(tiny("mixtral").checkpoint), tmp_path / "out", ExportOptions(progress=False, lora_rank=4,
                                                                                      lora_targets="gate"))
    plain = Engine.load(llama_case.artifact)
    with pytest.raises(GraphkilnError, match="takes no LoRA adapters: re-export it with"):
        plain.load_adapter("alpha", lora_case.adapters["alpha"])
    with pytest.raises(GraphkilnError, match="takes no LoRA adapters"):
        plain.generate([5, 6], GenerationConfig(adapter="alpha"))
    engine = Engine.load(lora_case.artifact)
    with pytest.raises(GraphkilnError, match="no LoRA adapter named 'nope' is loaded"):
        engine.generate([5, 6], GenerationConfig(adapter="nope"))


def _mutate(manifest, change) -> str:
    import json

    d = json.loads(manifest.to_json())
    change(d)
    return json.dumps(d)


def _stack(d, role="lora_a"):
    return next(t for t in d["graphs"][0]["inputs"] if t["role"] == role)


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.update(lora=None), "LoRA input, but the manifest has no lora record"),
    (lambda d: _stack(d).update(shape=[9, 64, 8]), "float32 with 3 slots and rank 8"),
    (lambda d: _stack(d).update(dtype="float16"), "float32 with 3 slots"),
    (lambda d: _stack(d).update(module=None), "module is missing"),
    (lambda d: _stack(d).update(module="lm_head"), "module"),
    (lambda d: _stack(d).update(layer=99), "not a layer of this"),
    (lambda d: d["graphs"][0]["inputs"].remove(_stack(d, "lora_b")), "but not its lora_b"),
    (lambda d: d["graphs"][0]["inputs"].remove(_stack(d, "lora_rows")), "not both lora_rows and lora_slots"),
    (lambda d: d["lora"]["module_paths"].update(q_proj="model.layers.0.self_attn.q_proj"), "holding {layer} once"),
    (lambda d: d["lora"]["module_paths"].update(q_proj="../{layer}/x"), "holding {layer} once"),
    (lambda d: d["lora"]["module_paths"].pop("q_proj"), "lacks q_proj"),
    (lambda d: d["lora"].update(rank=0), "rank"),
])
def test_hostile_lora_manifest_is_one_line(lora_case, change, needle):
    from graphkiln.manifest import Manifest

    with pytest.raises(GraphkilnError, match="manifest.json") as err:
        Manifest.from_json(_mutate(lora_case.manifest, change))
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_queued_requests_hold_their_adapter(lora_case, tmp_path):
    """A request holds its adapter from submission, not only once it runs: while it waits in the
    scheduler's queue the adapter is neither unloaded (refused, naming the queued request) nor
    evicted by a load; the queued request then runs with it. A queued request that is cancelled
    (shutdown) lets go of it."""
    gamma = shutil.copytree(lora_case.adapters["beta"], tmp_path / "gamma")
    engine = load(lora_case.artifact, lora_case.adapters)  # alpha then beta: alpha is the LRU
    want = engine.generate([5, 6, 7], dataclasses.replace(GREEDY, adapter="alpha"))[0].token_ids
    engine.generate([5, 6, 7], dataclasses.replace(GREEDY, max_new_tokens=1, adapter="beta"))  # alpha LRU again
    # not started: every submitted request stays queued
    sched = Scheduler(engine, max_batch=1, step_tokens=64)
    handle = sched.submit([5, 6, 7], dataclasses.replace(GREEDY, adapter="alpha"))
    with pytest.raises(GraphkilnError, match="'alpha' is in use by 1 queued or running request"):
        engine.unload_adapter("alpha")
    engine.load_adapter("gamma", gamma)  # evicts beta, the one no request holds
    assert sorted(engine.adapter_names()) == ["alpha", "gamma"]
    sched.start()
    try:
        assert handle.result(timeout=60).token_ids == want
    finally:
        sched.shutdown(10)
    engine.unload_adapter("alpha")  # released when it finished

    # cancelled while queued: shutdown without ever starting
    engine.load_adapter("alpha", lora_case.adapters["alpha"])
    sched = Scheduler(engine, max_batch=1, step_tokens=64)
    handle = sched.submit([5, 6, 7], dataclasses.replace(GREEDY, adapter="alpha"))
    with pytest.raises(GraphkilnError, match="queued or running"):
        engine.unload_adapter("alpha")
    sched.shutdown(0)
    assert handle.result(timeout=10).finish_reason == "cancelled"
    engine.unload_adapter("alpha")
    assert engine.adapter_names() == ["gamma"]


def test_queued_behind_a_running_request(lora_case):
    """The scheduler running: a request for beta waits behind a long one (one slot); unloading beta
    meanwhile is refused, and the queued request then completes with beta's tokens."""
    engine = load(lora_case.artifact, lora_case.adapters)
    want = engine.generate([9, 8, 7], dataclasses.replace(GREEDY, adapter="beta"))[0].token_ids
    sched = Scheduler(engine, max_batch=1, step_tokens=64)
    sched.start()
    try:
        first = sched.submit([1, 2, 3], GenerationConfig(max_new_tokens=MAX_SEQ_LEN - 4, stop_token_ids=()))
        queued = sched.submit([9, 8, 7], dataclasses.replace(GREEDY, adapter="beta"))
        with pytest.raises(GraphkilnError, match="'beta' is in use by 1 queued or running request"):
            engine.unload_adapter("beta")
        assert first.result(timeout=60).finish_reason == "length"
        assert queued.result(timeout=60).token_ids == want
    finally:
        sched.shutdown(10)
    engine.unload_adapter("beta")
