"""The bad-input matrix: one representative of every class of bad input, through the CLI.

For every case: exit status 2, exactly one ``error:`` line (stderr's last), no traceback,
nothing on stdout, and nothing written or changed anywhere under the test's directory (the
checkpoint, the artifact, the output's parent and the working directory are all inside it
and are compared byte for byte before and after). Each class is swept in depth by its own
test file (test_publish_safety, test_checkpoint_validation, test_manifest_untrusted,
test_runtime_hardening, test_bad_input); this file is the one place that shows the contract
holds across all of them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from graphkiln.cli import main


@dataclass
class Env:
    root: Path  # everything a case may touch lives under here
    ckpt: Path  # a private copy of the llama checkpoint
    art: Path  # a private copy of its exported artifact
    out: Path  # a fresh output path (its parent exists and is empty)


def _edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))


_DROP = object()


def _edit_weights(ckpt: Path, fn: Callable) -> None:
    from safetensors.numpy import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors = load_file(f)
    fn(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


def _nan_weight(t):
    w = t["model.layers.0.mlp.up_proj.weight"]
    w[1, 2] = float("nan")


def _int_weight(t):
    name = "model.layers.1.self_attn.o_proj.weight"
    t[name] = (t[name] * 100).astype("int32")


def _extra_layer_tensors(ckpt: Path) -> None:
    _edit_json(ckpt / "config.json", num_hidden_layers=1)  # the checkpoint has 2 layers


def _manifest(env: Env, fn: Callable[[dict], None]) -> None:
    path = env.art / "manifest.json"
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _graph_outside(d):
    d["graphs"][0]["file"] = "../../etc/passwd"


def _files_off(d):
    d["files"] = {}


def _vocab_string(d):
    d["model"]["vocab_size"] = "many"


def _export(env: Env, *extra) -> list:
    return ["export", env.ckpt, "-o", env.out, *extra]


def _run(env: Env, *extra) -> list:
    return ["run", env.art, "--prompt-ids", "1,2,3", "--max-new-tokens", "2", *extra]


# id -> (prepare the environment, argv, words the error line must contain)
CASES: dict[str, tuple[Callable[[Env], None], Callable[[Env], list], tuple[str, ...]]] = {
    # -- where export writes (data loss) --
    "overwrite-checkpoint": (lambda e: None, lambda e: ["export", e.ckpt, "-o", e.ckpt, "--overwrite"], ("checkpoint",)),
    "overwrite-checkpoint-parent": (lambda e: None, lambda e: ["export", e.ckpt, "-o", e.ckpt.parent, "--overwrite"],
                                    ("checkpoint",)),
    "overwrite-empty-output-path": (lambda e: None, lambda e: ["export", e.ckpt, "-o", "", "--overwrite"], ("output",)),
    "overwrite-cwd": (lambda e: None, lambda e: ["export", e.ckpt, "-o", ".", "--overwrite"], ("working directory",)),
    "overwrite-user-directory": (lambda e: (e.out.mkdir(), (e.out / "notes.txt").write_text("mine")),
                                 lambda e: _export(e, "--overwrite"), ("not a graphkiln artifact",)),
    "overwrite-user-file": (lambda e: e.out.write_text("mine"), lambda e: _export(e, "--overwrite"), ("not",)),
    "output-inside-checkpoint": (lambda e: None, lambda e: ["export", e.ckpt, "-o", e.ckpt / "artifact"],
                                 ("inside",)),
    "output-under-a-file": (lambda e: (e.out.parent / "file").write_text("x"),
                            lambda e: ["export", e.ckpt, "-o", e.out.parent / "file" / "art"], ("not a directory",)),
    # -- broken or hostile checkpoints --
    "nan-weight": (lambda e: _edit_weights(e.ckpt, _nan_weight), _export, ("model.layers.0.mlp.up_proj", "NaN")),
    "int-weight": (lambda e: _edit_weights(e.ckpt, _int_weight), _export, ("o_proj", "I32", "not as a float")),
    "unread-checkpoint-tensors": (lambda e: _extra_layer_tensors(e.ckpt), _export, ("model.layers.1",)),
    "num-layers-bool": (lambda e: _edit_json(e.ckpt / "config.json", num_hidden_layers=True), _export,
                        ("num_hidden_layers",)),
    "num-layers-float": (lambda e: _edit_json(e.ckpt / "config.json", num_hidden_layers=2.7), _export,
                         ("num_hidden_layers", "2.7")),
    "zero-layers": (lambda e: _edit_json(e.ckpt / "config.json", num_hidden_layers=0), _export,
                    ("num_hidden_layers",)),
    "negative-size": (lambda e: _edit_json(e.ckpt / "config.json", hidden_size=-64), _export, ("hidden_size",)),
    "architectures-string": (lambda e: _edit_json(e.ckpt / "config.json", architectures="LlamaForCausalLM"), _export,
                             ("architectures", "list")),
    "wrong-shape-weight": (lambda e: _edit_json(e.ckpt / "config.json", intermediate_size=96), _export,
                           ("shape", "mlp")),
    "remote-code": (lambda e: _edit_json(e.ckpt / "config.json", auto_map={"AutoModelForCausalLM": "m.Model"}),
                    _export, ("auto_map",)),
    "malformed-generation-config": (lambda e: (e.ckpt / "generation_config.json").write_text("{not json"), _export,
                                    ("generation_config.json",)),
    "bad-generation-value": (lambda e: (e.ckpt / "generation_config.json").write_text('{"temperature": -1}'), _export,
                             ("generation_config.json", "temperature")),
    # -- export flags --
    "quant-block-size": (lambda e: None, lambda e: _export(e, "--quant", "int4", "--quant-block-size", "24"),
                         ("--quant-block-size", "24")),
    "max-seq-len-too-large": (lambda e: None, lambda e: _export(e, "--max-seq-len", str(10 ** 12)), ("--max-seq-len",)),
    # -- run flags and requests --
    "negative-seed": (lambda e: None, lambda e: _run(e, "--seed", "-1"), ("seed",)),
    "empty-stop-string": (lambda e: None, lambda e: _run(e, "--stop", ""), ("--stop",)),
    "nan-temperature": (lambda e: None, lambda e: _run(e, "--temperature", "nan"), ("temperature",)),
    "negative-max-new-tokens": (lambda e: None, lambda e: _run(e, "--max-new-tokens", "-1"), ("max-new-tokens",)),
    "prefix-cache-too-small": (lambda e: None, lambda e: _run(e, "--prefix-cache-bytes", "10"),
                               ("prefix cache", "no block")),
    "prefix-cache-over-memory": (lambda e: None, lambda e: _run(e, "--prefix-cache-bytes", "100000G"),
                                 ("prefix cache", "available")),
    "prefix-cache-bad-size": (lambda e: None, lambda e: _run(e, "--prefix-cache-bytes", "2X"), ("--prefix-cache-bytes",)),
    "prefix-cache-off-and-sized": (lambda e: None, lambda e: _run(e, "--no-prefix-cache", "--prefix-cache-bytes", "1G"),
                                   ("--no-prefix-cache",)),
    "draft-cost-without-draft": (lambda e: None, lambda e: _run(e, "--draft-cost", "0.5"),
                                 ("--draft-cost", "--draft")),
    "verify-zero-steps": (lambda e: None, lambda e: ["verify", e.art, "--reference", e.ckpt, "--steps", "0"],
                          ("--steps",)),
    # -- untrusted manifests --
    "manifest-graph-outside": (lambda e: _manifest(e, _graph_outside), _run, ("..",)),
    "manifest-graph-outside-inspect": (lambda e: _manifest(e, _graph_outside), lambda e: ["inspect", e.art], ("..",)),
    "manifest-checksums-off": (lambda e: _manifest(e, _files_off), _run, ("files",)),
    "manifest-ill-typed": (lambda e: _manifest(e, _vocab_string), _run, ("vocab_size",)),
    "wrong-digest": (lambda e: None, lambda e: _run(e, "--expect-digest", "0" * 64), ("digest",)),
}


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under root (and the kind/contents of each), to prove nothing was written."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def env(llama_case, tmp_path, monkeypatch) -> Env:
    root = tmp_path / "world"
    (root / "cwd").mkdir(parents=True)
    shutil.copytree(llama_case.checkpoint, root / "models" / "ckpt")
    shutil.copytree(llama_case.artifact, root / "artifacts" / "art")
    (root / "outputs").mkdir()
    monkeypatch.chdir(root / "cwd")
    return Env(root, root / "models" / "ckpt", root / "artifacts" / "art", root / "outputs" / "out")


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_matrix(name, env, capsys):
    prepare, argv, needles = CASES[name]
    prepare(env)
    before = _snapshot(env.root)
    capsys.readouterr()
    code = main([str(a) for a in argv(env)])
    out, err = capsys.readouterr()
    assert code == 2, (code, err)
    assert "Traceback" not in err and "\x1b[" not in err, err
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0], f"the error is not stderr's last line: {err!r}"
    for n in needles:
        assert n.lower() in errors[0].lower(), f"{n!r} not in {errors[0]!r}"
    assert out == ""
    assert _snapshot(env.root) == before, "a failed command wrote or changed files"
