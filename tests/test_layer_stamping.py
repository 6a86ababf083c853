"""Layer stamping (``graphkiln.export.layer_stamping``): trace one layer per kind, copy the rest.

The parity cases in conftest have 2-4 layers, mostly all different; these checkpoints repeat
layer kinds in irregular patterns (hybrids, dense-then-MoE) so that several templates are
stamped into interleaved positions. Each must (a) trace only its templates, (b) give the
same outputs as tracing every layer, on random inputs with a non-empty cache, and (c) match
transformers after export, on both targets.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import SPECS, build_checkpoint
from reference import ATOL, forward_logits, greedy, max_abs

STAMP_SPECS = {
    # 1 template, 4 layers
    "llama_x4": dataclasses.replace(SPECS["llama_gqa_bias"], name="llama_x4",
                                    config=dict(SPECS["llama_gqa_bias"].config, num_hidden_layers=4)),
    # dense layers 1 and 3 among MoE ones: 2 templates, 5 layers
    "qwen3_moe_x5": dataclasses.replace(SPECS["qwen3_moe"], name="qwen3_moe_x5",
                                        config=dict(SPECS["qwen3_moe"].config, num_hidden_layers=5, mlp_only_layers=[1, 3])),
    # conv/attention x dense/MoE: 4 templates, 6 layers
    "lfm2_moe_x6": dataclasses.replace(SPECS["lfm2_moe"], name="lfm2_moe_x6", config=dict(
        SPECS["lfm2_moe"].config, num_hidden_layers=6, num_dense_layers=2,
        layer_types=["conv", "full_attention", "conv", "full_attention", "conv", "conv"])),
    # conv, sliding and full attention (two rope flavors, two KV pools): 3 templates, 7 layers
    "lfm3_x7": dataclasses.replace(SPECS["lfm3"], name="lfm3_x7", config=dict(
        SPECS["lfm3"].config, num_hidden_layers=7,
        layer_types=["conv", "sliding_attention", "full_attention", "sliding_attention", "conv",
                     "full_attention", "conv"])),
    # one-sublayer blocks: Mamba-2 (its A a parameter of its own, not a folded constant), MoE, no-rope
    # attention (named identity rotary tables), MLP; the second Mamba and MoE blocks stamped
    "nemotron_h": SPECS["nemotron_h"],
}
EXPECTED_TEMPLATES = {"llama_x4": (0,), "qwen3_moe_x5": (0, 1), "lfm2_moe_x6": (0, 1, 2, 3), "lfm3_x7": (0, 1, 2),
                      "nemotron_h": (0, 1, 2, 3)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("stamp")
    return {name: build_checkpoint(spec, root / name) for name, spec in STAMP_SPECS.items()}


def _load(ckpt):
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import load_decoder, read_config

    raw = read_config(ckpt)
    family = family_for(raw["architectures"][0])
    decoder = load_decoder(ckpt, family, family.parse_config(raw), "fp32", progress=False)
    decoder.set_rope_positions(64)
    return decoder


def _random_feeds(graph_spec, seed: int) -> dict:
    """Batch 2, 5 new tokens at positions 3..7 over a cache of 8, conv pool of 4 slots."""
    rng = np.random.default_rng(seed)
    dims = {"batch": 2, "seq": 5, "cache_len": 8, "n_logits": 2, "slots": 4}
    feeds = {}
    for t in graph_spec.inputs:
        shape = [dims[d] if isinstance(d, str) else d for d in t.shape]
        if t.role == "input_ids":
            feeds[t.name] = rng.integers(0, 200, shape)
        elif t.role == "position_ids":
            feeds[t.name] = np.broadcast_to(3 + np.arange(5), shape).copy()
        elif t.role == "logits_index":
            feeds[t.name] = np.array([[4, 2], [0, 4]])
        elif t.role == "seq_lens":
            feeds[t.name] = np.array([5, 5])
        elif t.role == "slot_idx":
            feeds[t.name] = np.array([3, 1])
        else:
            feeds[t.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


# qwen3_moe_x5's dense-among-MoE templates are also lfm2_moe_x6's (there with conv layers); the
# stamped artifact of every spec is checked against transformers below
@pytest.mark.parametrize("name", [n for n in STAMP_SPECS if n != "qwen3_moe_x5"])
def test_stamped_graph_equals_the_fully_traced_one(checkpoints, tmp_path, name):
    import onnxruntime as ort

    from graphkiln.export.layer_stamping import template_layers
    from graphkiln.export.onnx_export import export_decoder

    decoder = _load(checkpoints[name])
    assert template_layers(decoder.cfg) == EXPECTED_TEMPLATES[name]
    (tmp_path / "stamped").mkdir()
    (tmp_path / "traced").mkdir()
    stamped = export_decoder(decoder, tmp_path / "stamped", 23)
    traced = export_decoder(decoder, tmp_path / "traced", 23, stamp=False)
    assert stamped.stamp_refused is None
    assert stamped.traced_layers == EXPECTED_TEMPLATES[name]
    assert traced.traced_layers == tuple(range(decoder.cfg.num_layers))
    assert stamped.graph == traced.graph
    assert {o.name for o in stamped.custom_ops} == {o.name for o in traced.custom_ops}

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    runs = {}
    for kind in ("stamped", "traced"):
        sess = ort.InferenceSession(str(tmp_path / kind / "decoder.onnx"), opts, providers=["CPUExecutionProvider"])
        runs[kind] = sess.run(None, _random_feeds(stamped.graph, seed=len(name)))
    for spec, a, b in zip(stamped.graph.outputs, runs["stamped"], runs["traced"]):
        assert a.shape == b.shape, spec.name
        assert np.abs(a - b).max() <= 1e-5, f"{name}: {spec.name} differs by {np.abs(a - b).max():.3g}"


# onnxruntime only: layers are stamped before any lowering, so every target's graph is lowered
# from the same stamped graph (the parity tests run all three targets on stamped exports)
@pytest.mark.parametrize("target", ["onnxruntime"])
@pytest.mark.parametrize("name", list(STAMP_SPECS))
def test_stamped_artifact_matches_transformers(checkpoints, tmp_path, name, target):
    import torch
    from transformers import AutoModelForCausalLM

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig

    export_model(str(checkpoints[name]), tmp_path / "art", ExportOptions(progress=False, max_seq_len=64, target=target))
    engine = Engine.load(tmp_path / "art")
    reference = AutoModelForCausalLM.from_pretrained(str(checkpoints[name]), dtype=torch.float32).eval()
    rng = np.random.default_rng(len(name))
    prompts = [rng.integers(3, engine.manifest.model.vocab_size, n).tolist() for n in (7, 13)]
    for p, got in zip(prompts, engine.prompt_logits(prompts)):
        assert max_abs(got, forward_logits(reference, p)) <= ATOL
    results = engine.generate(prompts, GenerationConfig(max_new_tokens=16, do_sample=False, stop_token_ids=(),
                                                       output_logits=True))
    for p, res in zip(prompts, results):
        tokens, logits = greedy(reference, p, 16)
        assert res.token_ids == tokens
        assert max_abs(res.logits, logits) <= ATOL


def test_a_refused_template_falls_back_to_tracing_every_layer(checkpoints, tmp_path, monkeypatch):
    from graphkiln.export import layer_stamping
    from graphkiln.export.onnx_export import export_decoder

    def refuse(*args, **kwargs):
        raise layer_stamping.StampRefused("test: pretend the template does not fit")

    monkeypatch.setattr(layer_stamping, "stamp_layers", refuse)
    decoder = _load(checkpoints["llama_x4"])
    result = export_decoder(decoder, tmp_path, 23)
    assert result.stamp_refused == "test: pretend the template does not fit"
    assert result.traced_layers == (0, 1, 2, 3)
    assert [t.name for t in result.graph.inputs][-2:] == ["past_key.3", "past_value.3"]
    assert (tmp_path / "decoder.onnx").exists()


def test_byte_equal_weights_in_the_template_keep_their_own_layers(tmp_path):
    """The exporter merges byte-equal small initializers (onnx_ir's deduplication). Where two
    parameters of the template layer are equal (here layer 0's two norms, and the final norm),
    the template's nodes read one name for both; stamping must still give every layer its own
    tensors, whose values differ in the other layers."""
    import torch
    from transformers import AutoModelForCausalLM

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig

    ckpt = build_checkpoint(STAMP_SPECS["llama_x4"], tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        first = model.model.layers[0]
        first.post_attention_layernorm.weight.copy_(first.input_layernorm.weight)
        model.model.norm.weight.copy_(first.input_layernorm.weight)
    model.save_pretrained(ckpt)

    from graphkiln.export.onnx_export import export_decoder

    (tmp_path / "graph").mkdir()
    assert export_decoder(_load(ckpt), tmp_path / "graph", 23).stamp_refused is None
    export_model(str(ckpt), tmp_path / "art", ExportOptions(progress=False, max_seq_len=64))
    engine = Engine.load(tmp_path / "art")
    prompt = np.random.default_rng(0).integers(3, engine.manifest.model.vocab_size, 9).tolist()
    assert max_abs(engine.prompt_logits([prompt])[0], forward_logits(model, prompt)) <= ATOL
    result = engine.generate([prompt], GenerationConfig(max_new_tokens=8, do_sample=False, stop_token_ids=()))[0]
    assert result.token_ids == greedy(model, prompt, 8)[0]
