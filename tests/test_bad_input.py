"""User errors: one ``error: ...`` line on stderr naming the problem, non-zero exit, nothing written.

Each export failure runs the real ``graphkiln export`` (through ``graphkiln.cli.main``) on a
broken copy of a real checkpoint and checks that the output directory was not created and
that no hidden ``.NAME.partial-*`` directory was left next to it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from cli_contract import assert_nothing_written, assert_one_error, export_fails, run_cli


@pytest.fixture
def out_dir(tmp_path) -> Path:
    """An output path inside an empty directory, so leftovers are easy to see."""
    return tmp_path / "outputs" / "artifact"


def edit_config(ckpt: Path, **changes) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (ckpt / "config.json").write_text(json.dumps(cfg))


# -- export ------------------------------------------------------------------------------------

def test_missing_config_json(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    (ckpt / "config.json").unlink()
    export_fails(capsys, ckpt, out_dir, "config.json")


@pytest.mark.parametrize("content,problem", [
    (b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,', "not valid JSON"),
    (b"\xff\xfe\x00\x01 binary", "not UTF-8"),
    (b'["LlamaForCausalLM"]', "not a JSON object"),
], ids=["truncated", "binary", "array"])
def test_malformed_config_json(llama_case, checkpoint_copy, out_dir, capsys, content, problem):
    ckpt = checkpoint_copy(llama_case)
    (ckpt / "config.json").write_bytes(content)
    export_fails(capsys, ckpt, out_dir, "config.json", problem)


def test_config_without_architectures(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, architectures=None)
    export_fails(capsys, ckpt, out_dir, "architectures")


def test_unsupported_architecture_lists_the_supported_ones(llama_case, checkpoint_copy, out_dir, capsys):
    from graphkiln.models.registry import supported_architectures

    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, architectures=["GPT2LMHeadModel"])
    line = export_fails(capsys, ckpt, out_dir, "unsupported architecture", "GPT2LMHeadModel")
    for arch in supported_architectures():
        assert arch in line


@pytest.mark.parametrize("keep", ["half", "all_but_4_bytes", "header_only_10_bytes"])
def test_truncated_safetensors(llama_case, checkpoint_copy, out_dir, capsys, keep):
    ckpt = checkpoint_copy(llama_case)
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    n = {"half": len(data) // 2, "all_but_4_bytes": len(data) - 4, "header_only_10_bytes": 10}[keep]
    f.write_bytes(data[:n])
    export_fails(capsys, ckpt, out_dir, "model.safetensors", "truncated or corrupt")


def test_truncated_shard_of_a_sharded_checkpoint(sampling_default_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(sampling_default_case)
    shards = sorted(ckpt.glob("*.safetensors"))
    assert len(shards) > 1
    data = shards[-1].read_bytes()
    shards[-1].write_bytes(data[: len(data) - 100])
    export_fails(capsys, ckpt, out_dir, shards[-1].name, "truncated or corrupt")


def test_missing_shard_of_a_sharded_checkpoint(sampling_default_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(sampling_default_case)
    shards = sorted(ckpt.glob("*.safetensors"))
    shards[0].unlink()
    export_fails(capsys, ckpt, out_dir, "missing weight")


def test_missing_weight(llama_case, checkpoint_copy, out_dir, capsys):
    from safetensors.numpy import load_file, save_file

    ckpt = checkpoint_copy(llama_case)
    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    victim = "model.layers.1.self_attn.k_proj.weight"
    del tensors[victim]
    save_file(tensors, f, metadata={"format": "pt"})
    export_fails(capsys, ckpt, out_dir, "missing", victim)


def test_weight_with_the_wrong_shape(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, intermediate_size=96)  # the weights have 128
    export_fails(capsys, ckpt, out_dir, "shape", "mlp")


def test_inconsistent_head_counts(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, num_key_value_heads=3)
    export_fails(capsys, ckpt, out_dir, "config.json", "num_key_value_heads")


def test_config_without_a_required_field(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, hidden_size=None)
    export_fails(capsys, ckpt, out_dir, "hidden_size")


def test_checkpoint_path_is_a_file(llama_case, out_dir, capsys):
    export_fails(capsys, llama_case.checkpoint / "config.json", out_dir, "is a file")


def test_checkpoint_path_does_not_exist(tmp_path, out_dir, capsys):
    export_fails(capsys, tmp_path / "no" / "such" / "checkpoint", out_dir, "neither a local directory nor a hub id")


def test_unsupported_opset(llama_case, out_dir, capsys):
    line = export_fails(capsys, llama_case.checkpoint, out_dir, "--opset 17", extra=("--opset", "17"))
    assert "23" in line


@pytest.mark.parametrize("value", ["1", "-4", "0"])
def test_max_seq_len_too_small(llama_case, out_dir, capsys, value):
    export_fails(capsys, llama_case.checkpoint, out_dir, "--max-seq-len", extra=("--max-seq-len", value))


def test_existing_output_is_not_touched_without_overwrite(llama_case, tmp_path, capsys):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", out)
    assert_one_error(code, err, "already exists", "--overwrite")
    assert [p.name for p in tmp_path.iterdir()] == ["existing"]
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_failed_overwrite_keeps_the_previous_artifact(llama_case, checkpoint_copy, artifact_copy, capsys):
    ckpt = checkpoint_copy(llama_case)
    (ckpt / "model.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes()[:1000])
    art = artifact_copy(llama_case)
    before = {p.name: p.read_bytes() for p in art.iterdir()}
    code, _, err = run_cli(capsys, "export", ckpt, "-o", art, "--overwrite")
    assert_one_error(code, err, "truncated or corrupt")
    assert {p.name: p.read_bytes() for p in art.iterdir()} == before
    assert sorted(p.name for p in art.parent.iterdir()) == ["artifact", "checkpoint"]


def test_activation_graphkiln_does_not_implement(llama_case, checkpoint_copy, out_dir, capsys):
    """hidden_act 'relu' is valid for transformers' Llama; graphkiln must export it or refuse it cleanly."""
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, hidden_act="relu")
    try:
        code, _, err = run_cli(capsys, "export", ckpt, "-o", out_dir)
    except Exception as exc:  # anything but GraphkilnError escaping main() is a traceback for the user
        pytest.fail(f"export raised {type(exc).__name__}: {exc!r} instead of printing an 'error:' line")
    if code == 0:
        assert (out_dir / "manifest.json").is_file()
    else:
        assert_one_error(code, err, "relu")
        assert_nothing_written(out_dir)


# -- run / inspect / verify --------------------------------------------------------------------

def test_prompt_longer_than_the_maximum_length(llama_case, capsys):
    for n in (llama_case.max_seq_len, llama_case.max_seq_len + 70):
        ids = ",".join(["5"] * n)
        code, out, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", ids)
        assert_one_error(code, err, f"{n} tokens", f"maximum sequence length is {llama_case.max_seq_len}")
        assert out == ""


def test_prompt_token_outside_the_vocabulary(llama_case, capsys):
    code, _, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", f"1,2,{llama_case.vocab_size}")
    assert_one_error(code, err, str(llama_case.vocab_size), "vocabulary")


def test_prompt_ids_that_are_not_integers(llama_case, capsys):
    code, _, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", "1,two,3")
    assert_one_error(code, err, "--prompt-ids", "1,two,3")


def test_text_prompt_without_a_tokenizer(llama_case, capsys):
    code, _, err = run_cli(capsys, "run", llama_case.artifact, "--prompt", "hello")
    assert_one_error(code, err, "tokenizer", "--prompt-ids")


def test_stop_string_without_a_tokenizer(llama_case, capsys):
    code, _, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", "1,2", "--stop", "x")
    assert_one_error(code, err, "stop strings", "tokenizer")


def _set_version(art: Path, version) -> None:
    d = json.loads((art / "manifest.json").read_text())
    d["format_version"] = version
    (art / "manifest.json").write_text(json.dumps(d))


@pytest.mark.parametrize("command", ["run", "inspect", "verify"])
def test_unknown_manifest_version(llama_case, artifact_copy, capsys, command):
    art = artifact_copy(llama_case)
    _set_version(art, 7)
    extra = {"run": ("--prompt-ids", "1,2,3"), "inspect": (), "verify": ("--reference", llama_case.checkpoint)}
    code, out, err = run_cli(capsys, command, art, *extra[command])
    assert_one_error(code, err, "format_version 7", "re-export")
    assert out == ""


def test_tampered_weights_fail_the_checksum(llama_case, artifact_copy, capsys):
    art = artifact_copy(llama_case)
    f = art / "decoder.onnx.data"
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    f.write_bytes(bytes(data))
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3")
    assert_one_error(code, err, "decoder.onnx.data", "sha256")
    assert out == ""


def test_missing_artifact_file(llama_case, artifact_copy, capsys):
    art = artifact_copy(llama_case)
    (art / "decoder.onnx.data").unlink()
    code, _, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3")
    assert_one_error(code, err, "decoder.onnx.data", "missing")


def test_bf16_artifact_on_cpu(llama_case, tmp_path, capsys):
    """bf16 exports fine but onnxruntime CPU cannot run it: a clear error, not a crash."""
    art = tmp_path / "bf16"
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", art, "--dtype", "bf16", "--max-seq-len", "32")
    assert code == 0, err
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3")
    assert_one_error(code, err, "bf16", "fp16")
    assert out == ""


def test_not_an_artifact(tmp_path, capsys):
    code, _, err = run_cli(capsys, "inspect", tmp_path)
    assert_one_error(code, err, "manifest.json")
    code, _, err = run_cli(capsys, "run", tmp_path / "nope", "--prompt-ids", "1")
    assert_one_error(code, err, "not a directory")


def test_verify_with_too_many_steps(llama_case, capsys):
    code, _, err = run_cli(capsys, "verify", llama_case.artifact, "--reference", llama_case.checkpoint,
                           "--steps", str(llama_case.max_seq_len))
    assert_one_error(code, err, "--steps", str(llama_case.max_seq_len))


# -- the installed command, in a real process --------------------------------------------------

def test_console_script_reports_one_line_and_fails(llama_case, checkpoint_copy, tmp_path):
    script = Path(sys.executable).with_name("graphkiln")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "graphkiln.cli"]
    ckpt = checkpoint_copy(llama_case)
    edit_config(ckpt, architectures=["FalconForCausalLM"])
    out = tmp_path / "outputs" / "artifact"
    proc = subprocess.run(cmd + ["export", str(ckpt), "-o", str(out)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: unsupported architecture 'FalconForCausalLM'")
    assert_nothing_written(out)
