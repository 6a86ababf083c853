"""The artifact manifest and layout, on real exported artifacts, and ``graphkiln inspect``."""

from __future__ import annotations

import hashlib
import json
import os
import stat

import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import FORMAT_VERSION, MANIFEST_NAME, Manifest
from graphkiln.runtime import Engine, GenerationConfig


def test_manifest_json_round_trip(case):
    m = Manifest.read(case.artifact)
    assert m == case.manifest  # what export returned is what it wrote
    assert Manifest.from_json(m.to_json()) == m
    assert Manifest.from_json(m.to_json()).to_json() == m.to_json()
    assert m.format_version == FORMAT_VERSION


def test_manifest_describes_the_model(case):
    from transformers import AutoConfig

    m = case.manifest
    cfg = AutoConfig.from_pretrained(case.checkpoint)
    assert m.model.architecture == case.spec.architecture
    assert (m.model.vocab_size, m.model.hidden_size, m.model.num_layers) == (
        cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers)
    assert m.model.num_parameters == sum(p.numel() for p in case.reference.parameters())
    assert m.model.dtype == "fp32"
    g = m.graph("decoder")
    assert (case.artifact / g.file).is_file()
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    # a gated-delta-net or Mamba-2 layer (linear_attention) holds a conv state and a recurrent state;
    # Nemotron-H's mlp and moe blocks hold neither
    conv_layers = [i for i, t in enumerate(types) if t in ("conv", "linear_attention")]
    recurrent_layers = [i for i, t in enumerate(types) if t == "linear_attention"]
    ffn_only = [i for i, t in enumerate(types) if t in ("mlp", "moe")]
    attn_layers = [i for i, t in enumerate(types) if i not in conv_layers + ffn_only]
    past = [t for t in g.inputs if t.role in ("past_key", "past_value")]
    assert sorted({t.layer for t in past}) == attn_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert all(t.shape == ("batch", cfg.num_key_value_heads, "cache_len", head_dim) for t in past)
    conv = [t for t in g.inputs if t.role == "conv_state"]
    assert sorted(t.layer for t in conv) == conv_layers
    recurrent = [t for t in g.inputs if t.role == "recurrent_state"]
    assert sorted(t.layer for t in recurrent) == recurrent_layers
    # one kv state spec per distinct window plus conv (and recurrent) specs, together covering every
    # layer once per kind
    for kind, want in (("kv", attn_layers), ("conv", conv_layers), ("recurrent", recurrent_layers)):
        assert sorted(l for s in m.states if s.kind == kind for l in s.layers) == want
    assert sorted(set(attn_layers) | set(conv_layers) | set(ffn_only)) == list(range(cfg.num_hidden_layers))
    assert all(s.max_seq_len == case.max_seq_len for s in m.states if s.kind == "kv")
    assert {s.kind for s in m.states} == {"kv"} | ({"conv"} if conv_layers else set()) | (
        {"recurrent"} if recurrent_layers else set())


def test_state_specs_follow_sliding_windows(tiny):
    mixed = tiny("qwen3_mixed_sliding").manifest
    assert {(s.layers, s.sliding_window) for s in mixed.states} == {((0, 2), 8), ((1,), None)}
    mistral = tiny("mistral_sliding").manifest
    assert [(s.layers, s.sliding_window) for s in mistral.states] == [((0, 1), 8)]


def test_manifest_records_generation_defaults_and_tokenizer(tok_case, sampling_default_case):
    g = sampling_default_case.manifest.generation
    assert (g.do_sample, g.temperature, g.top_k, g.top_p, g.max_new_tokens) == (True, 0.7, 20, 0.9, 24)
    assert g.eos_token_ids == (5, 7) and g.bos_token_id == 1
    assert sampling_default_case.manifest.tokenizer_files == ()

    t = tok_case.manifest
    assert t.generation.eos_token_ids == (2,) and t.generation.bos_token_id == 1
    assert "tokenizer.json" in t.tokenizer_files
    for f in t.tokenizer_files:
        assert (tok_case.artifact / f).read_bytes() == (tok_case.checkpoint / f).read_bytes()


def test_manifest_checksums_cover_every_file(case):
    on_disk = {p.relative_to(case.artifact).as_posix() for p in case.artifact.rglob("*") if p.is_file()}
    assert set(case.manifest.files) == on_disk - {MANIFEST_NAME}
    for rel, digest in case.manifest.files.items():
        assert hashlib.sha256((case.artifact / rel).read_bytes()).hexdigest() == digest


def test_artifact_directory_permissions_follow_the_umask(llama_case, tmp_path):
    """A published artifact is as readable as any directory its user creates (not 0700 like a temp dir)."""
    umask = os.umask(0)
    os.umask(umask)
    (tmp_path / "plain").mkdir()
    expected = stat.S_IMODE((tmp_path / "plain").stat().st_mode)
    assert expected == 0o777 & ~umask
    got = stat.S_IMODE(llama_case.artifact.stat().st_mode)
    assert got == expected, f"artifact directory mode {oct(got)}, a normal directory gets {oct(expected)}"


def test_overwrite_replaces_an_artifact_atomically(llama_case, tiny, artifact_copy, capsys):
    """--overwrite publishes the new artifact in place of the old one and leaves nothing else behind."""
    from graphkiln.cli import main

    art = artifact_copy(tiny("mistral_sliding"))
    assert main(["export", str(llama_case.checkpoint), "-o", str(art), "--overwrite", "--max-seq-len", "32"]) == 0
    assert capsys.readouterr().err.rstrip().splitlines()[-1].startswith("done in")
    assert [p.name for p in art.parent.iterdir()] == [art.name]
    m = Manifest.read(art)
    assert m.model.architecture == "LlamaForCausalLM" and m.states[0].max_seq_len == 32
    assert m.graphs[0].target == "onnxruntime"  # the CLI's default: the CPU artifact
    eng = Engine.load(art)  # checksums of the new files
    p = llama_case.prompts((5,), salt=70)[0]
    cfg = GenerationConfig(max_new_tokens=8, do_sample=False, stop_token_ids=())
    assert eng.generate(p, cfg)[0].token_ids == llama_case.engine.generate(p, cfg)[0].token_ids


def test_inspect_mentions_architecture_graph_and_state(tiny, capsys):
    from graphkiln.cli import main

    case = tiny("mistral_sliding")
    assert main(["inspect", str(case.artifact)]) == 0
    out = capsys.readouterr().out
    assert "MistralForCausalLM" in out
    assert "decoder" in out and "decoder.onnx" in out
    assert "opset 23" in out
    assert "sliding window 8" in out
    assert f"max {case.max_seq_len} tokens" in out
    assert "decoder.onnx.data" in out
    assert "none (token ids only)" in out


def test_inspect_json_prints_the_manifest(tok_case, capsys):
    from graphkiln.cli import main

    assert main(["inspect", str(tok_case.artifact), "--json"]) == 0
    out = capsys.readouterr().out
    assert Manifest.from_json(out) == tok_case.manifest
    assert json.loads(out)["model"]["architecture"] == "LlamaForCausalLM"


@pytest.mark.parametrize("version", [0, FORMAT_VERSION + 1, "1", None])
def test_unknown_format_version_is_refused(llama_case, version):
    d = json.loads(llama_case.manifest.to_json())
    if version is None:
        del d["format_version"]
    else:
        d["format_version"] = version
    with pytest.raises(GraphkilnError, match="format_version") as err:
        Manifest.from_json(json.dumps(d))
    msg = str(err.value)
    assert str(FORMAT_VERSION) in msg and "\n" not in msg


def test_engine_refuses_an_artifact_with_an_unknown_format_version(llama_case, artifact_copy):
    art = artifact_copy(llama_case)
    d = json.loads((art / MANIFEST_NAME).read_text())
    d["format_version"] = 99
    (art / MANIFEST_NAME).write_text(json.dumps(d))
    with pytest.raises(GraphkilnError, match="format_version 99"):
        Engine.load(art)


@pytest.mark.parametrize("damage", ["not_json", "missing_key", "extra_key"])
def test_malformed_manifest_is_a_clear_error(llama_case, damage):
    d = json.loads(llama_case.manifest.to_json())
    if damage == "not_json":
        text = llama_case.manifest.to_json()[:-20]
    elif damage == "missing_key":
        del d["model"]["vocab_size"]
        text = json.dumps(d)
    else:
        d["states"][0]["future_field"] = 1
        text = json.dumps(d)
    with pytest.raises(GraphkilnError, match="manifest.json") as err:
        Manifest.from_json(text)
    assert "\n" not in str(err.value)
