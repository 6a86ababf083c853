"""What export copies or derives into an artifact is untrusted input, checked at export (issue 37).

Classes swept here, each on a damaged copy of ``tok_case``'s checkpoint (a byte-level BPE
tokenizer), through the real ``graphkiln export`` in-process, checking the one ``error:`` line and
that nothing was published:

- tokenizer files the runtime would reject or misuse: tokenizer.json that does not load or does
  not round-trip text, a template's token outside the model's vocabulary, tokenizer_config.json /
  special_tokens_map.json that are not JSON objects, chat templates that do not compile, fail or
  refuse a plain conversation, render empty text, or are given special tokens the tokenizer lacks;
- every file export reads from the checkpoint, as a link out of it, a dangling link, a FIFO or a
  directory in the file's place (links inside it, as the hub cache makes them, are followed);
  preprocessor_config.json (vision-language checkpoints only) on its reader;
- hostile JSON in every checkpoint JSON file: deep nesting, a 5,000-digit integer, bytes that are
  not UTF-8.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cli_contract import export_fails, run_cli

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture
def out_dir(tmp_path) -> Path:
    return tmp_path / "outputs" / "artifact"


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def _tokenizer(ckpt: Path, change) -> None:
    d = _json(ckpt / "tokenizer.json")
    change(d)
    (ckpt / "tokenizer.json").write_text(json.dumps(d))


def _config(ckpt: Path, **changes) -> None:
    d = _json(ckpt / "tokenizer_config.json")
    d.update(changes)
    (ckpt / "tokenizer_config.json").write_text(json.dumps(d))


def _added_token(d: dict, token_id: int) -> None:
    d["added_tokens"].append({"id": token_id, "content": "<extra>", "single_word": False, "lstrip": False,
                              "rstrip": False, "normalized": False, "special": True})


def _write(name: str, data: str | bytes):
    return lambda ckpt: (ckpt / name).write_bytes(data if isinstance(data, bytes) else data.encode())


# Each damaged input was copied into the artifact before, and `run`, `chat` or `serve` then
# refused it or used it wrongly (a garbled decode, an empty prompt, a literal "<nope>" in it).
DAMAGED = {
    "tokenizer-not-json": (_write("tokenizer.json", "{not json"), ["tokenizer.json", "not valid JSON"]),
    "tokenizer-not-a-tokenizer": (_write("tokenizer.json", '{"a": 1}'), ["tokenizer.json", "cannot be loaded"]),
    "tokenizer-without-decoder": (lambda c: _tokenizer(c, lambda d: d.update(decoder=None)),
                                  ["tokenizer.json", "does not round-trip"]),
    "template-token-outside-vocab": (lambda c: (_tokenizer(c, lambda d: _added_token(d, 5000)),
                                                _config(c, chat_template="<extra>" + TEMPLATE)),
                                     ["tokenizer.json", "'<extra>'", "outside the model's vocabulary"]),
    "tokenizer-config-array": (_write("tokenizer_config.json", "[1]"), ["tokenizer_config.json", "not a JSON object"]),
    "tokenizer-config-not-json": (_write("tokenizer_config.json", "{bad"), ["tokenizer_config.json", "not valid JSON"]),
    "special-tokens-map-not-json": (_write("special_tokens_map.json", "{bad"),
                                    ["special_tokens_map.json", "not valid JSON"]),
    "template-syntax": (_write("chat_template.jinja", "{% if %}"), ["chat template", "does not compile"]),
    "template-in-config-syntax": (lambda c: _config(c, chat_template="{% for %}"), ["chat template", "does not compile"]),
    "template-in-config-not-text": (lambda c: _config(c, chat_template=5), ["chat template", "not a template string"]),
    "template-empty-file": (_write("chat_template.jinja", ""), ["chat template", "empty text"]),
    "template-renders-empty": (_write("chat_template.jinja", "{% for m in messages %}{% endfor %}"),
                               ["chat template", "empty text"]),
    "template-refuses-everything": (_write("chat_template.jinja", "{{ raise_exception('no') }}"),
                                    ["chat template", "cannot render", "refused"]),
    "template-type-error": (_write("chat_template.jinja", "{{ messages[0]['content'] + 1 }}"),
                            ["chat template", "cannot render", "TypeError"]),
    "template-output-bomb": (_write("chat_template.jinja", "{{ 'x' * 100000000 }}"),
                             ["chat template", "cannot render", "bound"]),
    "template-not-utf8": (_write("chat_template.jinja", b"\xff\xfe{{ x }}"), ["chat template", "cannot be read"]),
    "template-too-big": (_write("chat_template.jinja", "x" * (2 << 20)), ["chat template", "over"]),
    "bos-not-a-token": (lambda c: _config(c, bos_token="<nope>", chat_template=TEMPLATE.replace("<s>", "{{ bos_token }}")),
                        ["bos_token", "'<nope>'", "not a token"]),
    "eos-not-a-token": (lambda c: _config(c, eos_token={"content": "<|nope|>"}, chat_template=TEMPLATE),
                        ["eos_token", "not a token"]),
}


@pytest.mark.parametrize("damage", DAMAGED, ids=list(DAMAGED))
def test_damaged_tokenizer_files_are_refused_at_export(tok_case, checkpoint_copy, out_dir, capsys, damage):
    change, needles = DAMAGED[damage]
    ckpt = checkpoint_copy(tok_case)
    change(ckpt)
    export_fails(capsys, ckpt, out_dir, *needles)


# -- files that are not regular files of the checkpoint -------------------------------------------

# Opens a FIFO's write end (and closes it) every half second from 20 s on: a process of its own,
# since a reader blocked opening the FIFO may hold the GIL (safetensors' Rust open does).
_UNBLOCKER = """
import os, sys, time
time.sleep(20)
while True:
    try:
        os.close(os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass
    time.sleep(0.5)
"""


def _unblock_fifo_later(path: Path) -> subprocess.Popen:
    """Code that (wrongly) blocks opening the FIFO ``path``, however often, ends with a failed test
    rather than a hung suite; kill the returned process when the test is done."""
    return subprocess.Popen([sys.executable, "-c", _UNBLOCKER, str(path)])


READ_FILES = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "chat_template.jinja", "model.safetensors"]
KINDS = {"link-outside": ["is a link to", "outside"], "dangling-link": ["is a link to"], "fifo": ["is a FIFO"],
         "directory": ["is a directory"]}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", READ_FILES)
def test_checkpoint_files_must_be_regular_files_inside_it(tok_case, checkpoint_copy, out_dir, tmp_path, capsys,
                                                          name, kind):
    ckpt = checkpoint_copy(tok_case)
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    (ckpt / "special_tokens_map.json").write_text('{"bos_token": "<s>"}')
    path = ckpt / name
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    shutil.move(path, outside)  # the file's real contents, outside the checkpoint
    unblocking = None
    if kind == "link-outside":
        path.symlink_to(outside)
    elif kind == "dangling-link":
        path.symlink_to(tmp_path / "missing" / name)
    elif kind == "fifo":
        os.mkfifo(path)
        unblocking = _unblock_fifo_later(path)
    else:
        path.mkdir()
    try:
        export_fails(capsys, ckpt, out_dir, name, *KINDS[kind])
    finally:
        if unblocking is not None:
            unblocking.kill()
            unblocking.wait()


def _hub_snapshot(ckpt: Path, root: Path) -> Path:
    """``ckpt`` laid out as the Hugging Face hub cache lays out a download: the files in
    ``blobs/``, the snapshot directory made of relative links to them."""
    blobs, snapshot = root / "blobs", root / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(ckpt.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..") / ".." / "blobs" / f"blob{i}")
    return snapshot


def test_links_inside_the_checkpoint_are_followed_and_links_out_of_it_refused(tok_case, checkpoint_copy, tmp_path,
                                                                               capsys):
    from graphkiln.chat import load_template
    from graphkiln.models.weights import tensor_headers
    from graphkiln.runtime import Engine

    ckpt = checkpoint_copy(tok_case)
    # a template that refuses a system turn (as Gemma's does) is usable: checked without one
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}" + TEMPLATE
    (ckpt / "chat_template.jinja").write_text(template)
    snapshot = _hub_snapshot(ckpt, tmp_path / "hub" / "models--org--tiny")
    art = tmp_path / "artifact"
    code, _, err = run_cli(capsys, "export", snapshot, "-o", art, "--max-seq-len", "64")
    assert code == 0, err
    assert (art / "chat_template.jinja").read_text() == template and not (art / "chat_template.jinja").is_symlink()
    engine = Engine.load(art)
    chat = load_template(engine)
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s>user: hi\nassistant:"

    # an older `--local-dir` download: real files, the large ones links to the hub cache's blobs
    local = tmp_path / "local"
    shutil.copytree(ckpt, local)
    (local / "model.safetensors").unlink()
    (local / "model.safetensors").symlink_to((snapshot / "model.safetensors").resolve())
    assert "model.embed_tokens.weight" in tensor_headers(local)  # the shards' reader, as export opens them

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET {{ messages }}")
    (snapshot / "chat_template.jinja").unlink()
    (snapshot / "chat_template.jinja").symlink_to(secret)
    export_fails(capsys, snapshot, tmp_path / "outputs" / "artifact", "chat_template.jinja", "is a link to",
                 "outside")


# -- hostile JSON in the checkpoint's JSON files --------------------------------------------------

JSON_FILES = ["config.json", "generation_config.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.json"]
HOSTILE = {
    "deep": (lambda text: ("[" * 100_000 + "]" * 100_000).encode(), "nests deeper"),
    "5000-digit-int": (lambda text: text.replace("{", '{"n": ' + "9" * 5000 + ", ", 1).encode(),
                       "cannot be read"),
    "not-utf8": (lambda text: b"\xff\xfe" + text.encode(), "not UTF-8"),
}


@pytest.mark.parametrize("hostile", HOSTILE)
@pytest.mark.parametrize("name", JSON_FILES)
def test_hostile_json_in_checkpoint_files_is_one_line(tok_case, checkpoint_copy, out_dir, capsys, name, hostile):
    ckpt = checkpoint_copy(tok_case)
    path = ckpt / name
    text = path.read_text() if path.exists() else '{"bos_token": "<s>"}'
    make, needle = HOSTILE[hostile]
    path.write_bytes(make(text))
    export_fails(capsys, ckpt, out_dir, name, needle)


def test_config_json_with_a_5000_digit_vocab_size(tok_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(tok_case)
    text = (ckpt / "config.json").read_text()
    vocab = json.loads(text)["vocab_size"]
    (ckpt / "config.json").write_text(text.replace(f'"vocab_size": {vocab}', '"vocab_size": ' + "9" * 5000))
    export_fails(capsys, ckpt, out_dir, "config.json", "cannot be read")


@pytest.mark.parametrize("kind", ["link-outside", "fifo", "directory", "deep", "5000-digit-int"])
def test_preprocessor_config_is_a_regular_file_of_untrusted_json(tmp_path, kind):
    """A vision-language checkpoint's preprocessor_config.json (read by export alone, so tested on
    the reader: no tiny VLM export needed), under the rules of every other checkpoint file."""
    from graphkiln.errors import GraphkilnError
    from graphkiln.export.assets import read_preprocessor_config

    ckpt, outside = tmp_path / "checkpoint", tmp_path / "elsewhere.json"
    ckpt.mkdir()
    outside.write_text('{"image_processor_type": "CLIPImageProcessor"}')
    path = ckpt / "preprocessor_config.json"
    if kind == "link-outside":
        path.symlink_to(outside)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        path.mkdir()
    else:
        path.write_text("[" * 100_000 + "]" * 100_000 if kind == "deep" else '{"size": ' + "9" * 5000 + "}")
    needle = {"link-outside": "outside", "fifo": "is a FIFO", "directory": "is a directory", "deep": "nests deeper",
              "5000-digit-int": "cannot be read"}[kind]
    with pytest.raises(GraphkilnError, match=needle) as e:
        read_preprocessor_config(ckpt)
    assert "preprocessor_config.json" in str(e.value) and "\n" not in str(e.value)
