"""Parity with transformers (fp32) for every supported architecture.

Each case in ``conftest.SPECS`` is a tiny random-init checkpoint exported once per run. The
runtime must reproduce the reference's logits at every prompt position and its greedy
generation (tokens and per-step logits), alone and in batches of prompts of different
lengths, within 1e-4 absolute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import (PARITY_CASES, SLIDING_CASES, SPECS, VLM_SPECS, build_checkpoint, config_class,
                      own_file_vlm_architectures, traits)
from graphkiln.manifest import state_update
from graphkiln.runtime import GenerationConfig
from reference import ATOL, forward_logits, greedy, max_abs, teacher_forced_logits

STEPS = 32
BATCHES = {"batch1": (12,), "batch3": (5, 19, 11)}


def _greedy_config(steps: int = STEPS) -> GenerationConfig:
    # do_sample=False explicitly: one case's generation_config.json asks for sampling.
    return GenerationConfig(max_new_tokens=steps, do_sample=False, stop_token_ids=(), output_logits=True)


def test_every_supported_architecture_has_a_parity_case():
    from graphkiln.models.registry import supported_architectures

    # vision-language architectures have theirs in VLM_SPECS (tests/test_vlm_export.py, test_vlm_runtime.py)
    # or in their own test file (OWN_FILE_VLMS)
    covered = ({SPECS[n].architecture for n in PARITY_CASES} | {s.architecture for s in VLM_SPECS.values()}
               | own_file_vlm_architectures())
    missing = set(supported_architectures()) - covered
    assert not missing, f"architectures without a parity case in tests/conftest.py: {sorted(missing)}"


def test_parity_cases_cover_the_attention_variants():
    covered = set().union(*(traits(SPECS[n]) for n in PARITY_CASES))
    needed = {"gqa", "mha", "tied", "untied", "attention_bias", "qkv_bias", "qk_norm", "explicit_head_dim",
              "sliding_window", "mixed_layer_types", "rope_scaling", "tokenizer"}
    assert needed <= covered, f"no parity case with {sorted(needed - covered)}"


@pytest.mark.parametrize("batch", list(BATCHES))
def test_prompt_logits_match_transformers(case, batch):
    prompts = case.prompts(BATCHES[batch], salt=1)
    ours = case.engine.prompt_logits(prompts)
    assert len(ours) == len(prompts)
    for p, got in zip(prompts, ours):
        ref = forward_logits(case.reference, p)
        assert got.shape == ref.shape == (len(p), case.vocab_size)
        err = max_abs(got, ref)
        assert err <= ATOL, f"{case.name}: prompt logits (length {len(p)}) differ by {err:.3g}"


@pytest.mark.parametrize("batch", list(BATCHES))
def test_greedy_generation_matches_transformers(case, batch):
    prompts = case.prompts(BATCHES[batch], salt=2)
    results = case.engine.generate(prompts, _greedy_config())
    assert len(results) == len(prompts)
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref_tokens, ref_logits = greedy(case.reference, p, STEPS)
        assert res.prompt_ids == p
        assert res.finish_reason == "length"
        assert res.logits is not None and res.logits.shape == (STEPS, case.vocab_size)
        assert res.token_ids == ref_tokens, f"{case.name} request {i}: greedy tokens differ from transformers"
        err = max_abs(res.logits, ref_logits)
        assert err <= ATOL, f"{case.name} request {i}: step logits differ by {err:.3g}"
        # a second, cache-free reference: one full forward over prompt + generated tokens
        err = max_abs(res.logits, teacher_forced_logits(case.reference, p, res.token_ids))
        assert err <= ATOL, f"{case.name} request {i}: step logits differ from a full forward by {err:.3g}"


def test_greedy_parity_when_requests_finish_at_different_steps(case):
    """A request near the maximum length finishes first; the others continue in a smaller batch."""
    long_len = case.max_seq_len - 6  # budget 6 tokens
    prompts = case.prompts((9, long_len, 4), salt=3)
    results = case.engine.generate(prompts, _greedy_config(20))
    assert [len(r.token_ids) for r in results] == [20, 6, 20]
    assert [r.finish_reason for r in results] == ["length"] * 3
    for i, (p, res) in enumerate(zip(prompts, results)):
        ref_tokens, ref_logits = greedy(case.reference, p, len(res.token_ids))
        assert res.token_ids == ref_tokens, f"{case.name} request {i}: tokens differ after another request finished"
        assert max_abs(res.logits, ref_logits) <= ATOL


def test_reference_logits_are_sane(case):
    """The checkpoints are useful test material: finite, spread-out logits and varied greedy output."""
    prompts = case.prompts(BATCHES["batch3"], salt=2)
    tokens = set()
    for p in prompts:
        toks, logits = greedy(case.reference, p, STEPS)
        assert np.isfinite(logits).all()
        assert 0.5 < np.abs(logits).max() < 50, np.abs(logits).max()
        assert logits.std(-1).min() > 0.1
        top2 = np.sort(logits, -1)[:, -2:]
        # no near-ties: logits within tolerance of these cannot change a greedy choice
        assert (top2[:, 1] - top2[:, 0]).min() > 2 * ATOL
        tokens.update(toks)
    assert len(tokens) >= 8, f"{case.name}: degenerate greedy output {sorted(tokens)}"


@pytest.mark.parametrize("name", SLIDING_CASES)
def test_sliding_window_changes_the_reference(tiny, name):
    """Guard for the sliding cases: the window must matter, or their parity would not test it."""
    import torch
    from transformers import AutoModelForCausalLM

    case = tiny(name)
    window = case.spec.config["sliding_window"]
    if case.spec.architecture == "MistralForCausalLM":
        overrides = {"sliding_window": None}
    elif case.spec.architecture == "Lfm3ForCausalLM":
        # sliding layers keep their own rope flavor, so widen the window instead of retyping them
        overrides = {"sliding_window": 4096}
    else:
        overrides = {"layer_types": ["full_attention"] * case.spec.config["num_hidden_layers"]}
    full = AutoModelForCausalLM.from_pretrained(str(case.checkpoint), dtype=torch.float32, **overrides).eval()
    p = case.prompts((40,), salt=4)[0]
    windowed, unwindowed = forward_logits(case.reference, p), forward_logits(full, p)
    assert max_abs(windowed[:window], unwindowed[:window]) <= ATOL
    assert max_abs(windowed[window:], unwindowed[window:]) > 1e-2
    # and the runtime follows the windowed one
    assert max_abs(case.engine.prompt_logits([p])[0], windowed) <= ATOL


# -- sliding-window configuration, checked against transformers' own reading of config.json ----

def _hf_windows(config) -> tuple:
    window = getattr(config, "sliding_window", None)
    if config.model_type in ("llama", "mistral", "mixtral", "qwen3_moe", "phi3"):  # one window for every layer
        return (window,) * config.num_hidden_layers
    return tuple(window if t == "sliding_attention" else None for t in config.layer_types)


def _window_configs(tmp_path):
    """(label, config.json dict) pairs, including configs as older transformers wrote them."""
    out = []
    for name, spec in SPECS.items():
        if spec.tokenizer:
            continue
        config = config_class(spec.architecture)(**spec.config)
        config.architectures = [spec.architecture]
        config.save_pretrained(tmp_path / name)
        out.append((name, json.loads((tmp_path / name / "config.json").read_text())))
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        # transformers < 4.53 wrote no layer_types: the sliding layers follow max_window_layers
        d = tmp_path / f"legacy-{arch}"
        config_class(arch)(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                           max_window_layers=2, architectures=[arch]).save_pretrained(d)
        raw = json.loads((d / "config.json").read_text())
        raw.pop("layer_types")
        out.append((f"legacy-{arch}", raw))
    return out


def test_layer_windows_match_transformers(tmp_path):
    """graphkiln's per-layer sliding windows equal the ones transformers derives from the same config.json."""
    from transformers import AutoConfig

    from graphkiln.models.registry import family_for

    wrong = []
    for label, raw in _window_configs(tmp_path):
        d = tmp_path / f"reload-{label}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps(raw))
        expected = _hf_windows(AutoConfig.from_pretrained(d))
        got = family_for(raw["architectures"][0]).parse_config(raw).layer_windows
        if tuple(got) != expected:
            wrong.append(f"{label}: graphkiln {tuple(got)} vs transformers {expected}")
    assert not wrong, "; ".join(wrong)


# -- verify ------------------------------------------------------------------------------------

def test_verify_passes_for_the_matching_reference(llama_case):
    from graphkiln.export.verify import verify_artifact

    report = verify_artifact(llama_case.artifact, str(llama_case.checkpoint), steps=STEPS,
                             engine=llama_case.engine)
    assert report.passed, report.summary()
    assert report.max_abs_error <= 1e-4
    assert report.tokens_compared == report.tokens_agreed > 0
    assert "PASS" in report.summary()


def test_verify_fails_for_a_different_checkpoint_of_the_same_config(llama_case, tmp_path, capsys):
    from graphkiln.cli import main
    from graphkiln.export.verify import verify_artifact

    other = build_checkpoint(llama_case.spec, tmp_path / "other", seed=llama_case.spec.seed + 1000)
    report = verify_artifact(llama_case.artifact, str(other), steps=STEPS, engine=llama_case.engine)
    assert not report.passed
    assert report.max_abs_error > 1e-2
    assert "FAIL" in report.summary()

    capsys.readouterr()
    assert main(["verify", str(llama_case.artifact), "--reference", str(other), "--steps", "8"]) != 0
    assert "FAIL" in capsys.readouterr().out
    assert main(["verify", str(llama_case.artifact), "--reference", str(llama_case.checkpoint), "--steps", "8"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_verify_passes_for_a_checkpoint_that_samples_by_default(sampling_default_case):
    """generation_config.json with do_sample=True (as instruct models ship) must not break verify:
    parity is about greedy decoding, whatever the artifact's sampling defaults are."""
    from graphkiln.export.verify import verify_artifact

    case = sampling_default_case
    assert case.manifest.generation.do_sample is True
    report = verify_artifact(case.artifact, str(case.checkpoint), steps=16, engine=case.engine)
    assert report.passed, report.summary()


# -- half precision ------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_fp16_artifact_verifies_within_half_precision_tolerance(llama_case, tmp_path, target):
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.export.verify import DEFAULT_ATOL, verify_artifact
    from graphkiln.runtime import Engine

    art = tmp_path / "fp16"
    m = export_model(str(llama_case.checkpoint), art, ExportOptions(dtype="fp16", progress=False, max_seq_len=64,
                                                                    target=target))
    assert m.model.dtype == "fp16" and {s.dtype for s in m.states} == {"float16"}
    # the onnxruntime target runs GroupQueryAttention in fp16, writing the fp16 cache in place
    assert {state_update(m.graphs[0], s) for s in m.states} == {"in_place" if target == "onnxruntime" else "scatter_rows"}
    assert {t.dtype for t in m.graph("decoder").inputs if t.role in ("past_key", "past_value")} == {"float16"}
    # half the weight bytes of the fp32 artifact
    fp32_bytes = (llama_case.artifact / "decoder.onnx.data").stat().st_size
    assert (art / "decoder.onnx.data").stat().st_size < 0.6 * fp32_bytes
    engine = Engine.load(art)
    report = verify_artifact(art, str(llama_case.checkpoint), steps=16, engine=engine)
    assert report.passed, report.summary()
    assert report.atol == DEFAULT_ATOL["fp16"]
    assert 1e-6 < report.max_abs_error  # really computed in half precision
    p = llama_case.prompts((7,), salt=5)[0]
    ref = forward_logits(llama_case.reference, p)
    assert max_abs(engine.prompt_logits([p])[0], ref) <= DEFAULT_ATOL["fp16"]
