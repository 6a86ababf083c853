"""The manifest is untrusted input (issue 10, item 5 and the malformed-values part of item 4).

Every hostile or malformed manifest is refused by ``Engine.load`` with one ``GraphkilnError``
line, and by ``graphkiln inspect`` and ``graphkiln run`` with exit status 2, one ``error:``
line and nothing on stdout. A manifest path never gets a file outside the artifact read: that
is observed, not mocked, two ways. An audit hook (``sys.addaudithook``) records every file
Python opens, and the outside files get an access time older than their modification time,
which the kernel bumps on any read, by Python, onnxruntime or the tokenizers library alike.

A hypothesis property test mutates a real exported manifest at random and checks that load
either succeeds or raises GraphkilnError, never anything else. The digest tests check that
``inspect`` prints the manifest's sha256 and that ``Engine.load(expected_digest=...)`` and
``run --expect-digest`` pin the artifact.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, Manifest
from graphkiln.runtime import Engine, GenerationConfig
from cli_contract import assert_one_error as _assert_one_error, run_cli


def assert_one_error(code: int, err: str, *needles: str) -> str:
    """Loading or inspecting prints no progress: the error is stderr's only line."""
    return _assert_one_error(code, err, *needles, alone=True)


# -- observing which files are opened ----------------------------------------------------------

_opened: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _opened is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _opened.append(os.path.realpath(os.fsdecode(args[0])))


sys.addaudithook(_audit)  # cannot be removed; costs one comparison per event while _opened is None


@contextmanager
def recording_opens():
    """The real paths of the files Python opens inside the block."""
    global _opened
    _opened = seen = []
    try:
        yield seen
    finally:
        _opened = None


class Outside:
    """Files next to (not in) the artifact, whose reads are observed: real copies of the
    graph and its data (so a runtime that followed a path there would load and run), and a
    plain secret file."""

    def __init__(self, root: Path, art: Path) -> None:
        self.dir = root / "outside"
        self.dir.mkdir()
        for name in ("decoder.onnx", "decoder.onnx.data"):
            shutil.copy(art / name, self.dir / name)
        (self.dir / "secret").write_text("not graphkiln's\n")
        self._control = root / "control"
        self._control.write_text("control\n")

    @property
    def files(self) -> list[Path]:
        return sorted(self.dir.iterdir())

    def arm(self) -> None:
        """Make any later read of an outside file visible in its access time."""
        past = time.time() - 7200
        for p in self.files + [self._control]:
            os.utime(p, (past, past + 3600))  # atime < mtime: relatime updates it on the next read
        self._atimes = {p: p.stat().st_atime_ns for p in self.files}
        self._control.read_bytes()
        self.atime_works = self._control.stat().st_atime > past + 3600  # else (noatime) only the audit hook observes

    def assert_untouched(self, opened: list[str]) -> None:
        outside = os.path.realpath(self.dir)
        assert not [p for p in opened if p.startswith(outside + os.sep)], f"opened outside the artifact: {opened}"
        if self.atime_works:
            read = [p.name for p in self.files if p.stat().st_atime_ns != self._atimes[p]]
            assert not read, f"files outside the artifact were read: {read}"


# -- helpers ------------------------------------------------------------------------------------

def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_manifest(art: Path) -> dict:
    return json.loads((art / MANIFEST_NAME).read_text())


def write_manifest(art: Path, d: dict) -> None:
    (art / MANIFEST_NAME).write_text(json.dumps(d, indent=1))


def refused_everywhere(art: Path, capsys, needle: str, inspect: bool = True) -> str:
    """Engine.load, ``inspect`` and ``run`` each refuse art with one line containing needle."""
    with pytest.raises(GraphkilnError) as err:
        Engine.load(art)
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg
    commands = [["run", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]] + ([["inspect", art]] if inspect else [])
    for argv in commands:
        code, out, err_text = run_cli(capsys, *argv)
        assert_one_error(code, err_text, needle)
        assert out == "", out
    return msg


@pytest.fixture
def art(llama_case, artifact_copy) -> Path:
    return artifact_copy(llama_case)


# -- paths: nothing outside the artifact is read ------------------------------------------------

def _list(d: dict, key: str, target: Path) -> None:
    d["files"][key] = sha256(target)  # with its true checksum: only the path rule can refuse it


def _graph_dotdot(art, out, d):
    d["graphs"][0]["file"] = "../outside/decoder.onnx"
    _list(d, "../outside/decoder.onnx", out.dir / "decoder.onnx")


def _graph_absolute(art, out, d):
    d["graphs"][0]["file"] = str(out.dir / "decoder.onnx")
    _list(d, str(out.dir / "decoder.onnx"), out.dir / "decoder.onnx")


def _graph_etc_passwd(art, out, d):
    d["graphs"][0]["file"] = "../../../../../../../../etc/passwd"


def _tokenizer_dotdot(art, out, d):
    d["tokenizer_files"] = ["../outside/secret"]
    _list(d, "../outside/secret", out.dir / "secret")


def _tokenizer_absolute(art, out, d):
    d["tokenizer_files"] = [str(out.dir / "secret")]
    _list(d, str(out.dir / "secret"), out.dir / "secret")


def _files_key_dotdot(art, out, d):
    _list(d, "../outside/secret", out.dir / "secret")


def _files_key_absolute(art, out, d):
    _list(d, str(out.dir / "secret"), out.dir / "secret")


def _files_key_inner_dotdot(art, out, d):
    _list(d, "sub/../../outside/secret", out.dir / "secret")


def _symlinked_data(art, out, d):
    (art / "decoder.onnx.data").unlink()
    (art / "decoder.onnx.data").symlink_to(out.dir / "decoder.onnx.data")  # same bytes: the checksum passes


def _symlinked_graph(art, out, d):
    (art / "decoder.onnx").unlink()
    (art / "decoder.onnx").symlink_to(os.path.relpath(out.dir / "decoder.onnx", art))


def _symlinked_directory(art, out, d):
    (art / "tok").symlink_to(out.dir, target_is_directory=True)
    d["tokenizer_files"] = ["tok/secret"]
    _list(d, "tok/secret", out.dir / "secret")


def _symlinked_manifest(art, out, d):
    (out.dir / MANIFEST_NAME).write_text(json.dumps(d))
    (art / MANIFEST_NAME).unlink()
    (art / MANIFEST_NAME).symlink_to(out.dir / MANIFEST_NAME)
    return True  # the manifest is written already


def _backslashes(art, out, d):
    d["graphs"][0]["file"] = "..\\outside\\decoder.onnx"


def _drive_letter(art, out, d):
    d["tokenizer_files"] = ["C:/outside/secret"]


def _nul(art, out, d):
    d["graphs"][0]["file"] = "decoder.onnx\u0000../../outside/decoder.onnx"


PATH_CASES = {
    "graph-dotdot": (_graph_dotdot, "'..'"),
    "graph-absolute": (_graph_absolute, "absolute"),
    "graph-etc-passwd": (_graph_etc_passwd, "'..'"),
    "tokenizer-dotdot": (_tokenizer_dotdot, "'..'"),
    "tokenizer-absolute": (_tokenizer_absolute, "absolute"),
    "files-key-dotdot": (_files_key_dotdot, "'..'"),
    "files-key-absolute": (_files_key_absolute, "absolute"),
    "files-key-inner-dotdot": (_files_key_inner_dotdot, "'..'"),
    "symlinked-data-file": (_symlinked_data, "resolves outside the artifact"),
    "symlinked-graph-file": (_symlinked_graph, "resolves outside the artifact"),
    "symlinked-directory": (_symlinked_directory, "resolves outside the artifact"),
    "symlinked-manifest": (_symlinked_manifest, "resolves outside the artifact"),
    "backslashes": (_backslashes, "backslash"),
    "drive-letter": (_drive_letter, "absolute"),
    "nul-byte": (_nul, "control character"),
}


@pytest.mark.parametrize("name", PATH_CASES)
def test_manifest_paths_never_reach_outside_the_artifact(name, art, tmp_path, capsys):
    out = Outside(tmp_path, art)
    setup, needle = PATH_CASES[name]
    d = read_manifest(art)
    if not setup(art, out, d):
        write_manifest(art, d)
    out.arm()
    with recording_opens() as opened:
        refused_everywhere(art, capsys, needle)
    out.assert_untouched(opened)


def test_a_symlink_that_stays_inside_the_artifact_is_fine(art, llama_case):
    """The containment rule is about where a path resolves, not about symlinks as such."""
    (art / "blobs").mkdir()
    (art / "decoder.onnx.data").rename(art / "blobs" / "weights")
    (art / "decoder.onnx.data").symlink_to(Path("blobs") / "weights")
    d = read_manifest(art)
    d["files"]["blobs/weights"] = d["files"]["decoder.onnx.data"]
    write_manifest(art, d)
    prompt = llama_case.prompts((6,), salt=90)[0]
    cfg = GenerationConfig(max_new_tokens=4, do_sample=False, stop_token_ids=())
    got = Engine.load(art).generate(prompt, cfg)[0].token_ids
    assert got == llama_case.engine.generate(prompt, cfg)[0].token_ids


@pytest.mark.parametrize("which", ["decoder.onnx.data", MANIFEST_NAME])
def test_a_fifo_is_refused_without_blocking(which, art, capsys):
    """A listed file (or the manifest) that is a FIFO would block a plain open() forever."""
    fifo = art / which
    if which == MANIFEST_NAME:
        shutil.copy(fifo, art / "saved.json")
    fifo.unlink()
    os.mkfifo(fifo)
    result: list = []

    def load():
        try:
            Engine.load(art)
        except GraphkilnError as exc:
            result.append(str(exc))

    t = threading.Thread(target=load, daemon=True)
    t.start()
    t.join(60)
    if t.is_alive():  # a writer unblocks the reader's open, so the thread can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"loading blocked on the FIFO {which}")
    assert result and "not a regular file" in result[0], result
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2")
    assert_one_error(code, err, "not a regular file")


# -- every file the runtime opens is covered by a checksum --------------------------------------

def _rewrite_data_location(art: Path, location: str) -> None:
    """Point every external initializer of the graph at ``location`` and re-record its checksum."""
    import onnx

    model = onnx.load(str(art / "decoder.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(model, str(art / "decoder.onnx"))
    d = read_manifest(art)
    d["files"]["decoder.onnx"] = sha256(art / "decoder.onnx")
    write_manifest(art, d)


def test_graph_not_listed_in_files(art, capsys):
    d = read_manifest(art)
    del d["files"]["decoder.onnx"]
    write_manifest(art, d)
    refused_everywhere(art, capsys, "graphs[0].file 'decoder.onnx' is not listed in files")


def test_empty_files_no_longer_turns_checksums_off(art, capsys):
    d = read_manifest(art)
    d["files"] = {}
    write_manifest(art, d)
    data = art / "decoder.onnx.data"
    data.write_bytes(bytes(len(data.read_bytes())))  # weights replaced: only a checksum would notice
    refused_everywhere(art, capsys, "not listed in files")


def test_tokenizer_file_not_listed_in_files(tok_case, artifact_copy, capsys):
    art = artifact_copy(tok_case)
    d = read_manifest(art)
    del d["files"]["tokenizer.json"]
    write_manifest(art, d)
    refused_everywhere(art, capsys, "tokenizer_files[0] 'tokenizer.json' is not listed in files")


def test_data_file_not_listed_in_files(art, capsys):
    d = read_manifest(art)
    del d["files"]["decoder.onnx.data"]
    write_manifest(art, d)
    # inspect reads no graph, so it describes this artifact; load and run refuse it
    refused_everywhere(art, capsys, "reads external data from 'decoder.onnx.data'", inspect=False)


def test_data_location_not_listed_in_files(art, capsys):
    shutil.copy(art / "decoder.onnx.data", art / "other.data")
    _rewrite_data_location(art, "other.data")
    refused_everywhere(art, capsys, "reads external data from 'other.data'", inspect=False)


@pytest.mark.parametrize("location", ["../outside/decoder.onnx.data", "/etc/passwd", "./decoder.onnx.data"])
def test_data_location_outside_the_artifact(location, art, tmp_path, capsys):
    out = Outside(tmp_path, art)
    _rewrite_data_location(art, location)
    out.arm()
    refused_everywhere(art, capsys, f"names external data {location!r}", inspect=False)
    out.assert_untouched([])


def test_listed_file_missing_on_disk(art, capsys):
    (art / "decoder.onnx.data").unlink()
    refused_everywhere(art, capsys, "decoder.onnx.data is missing", inspect=False)
    code, out, _ = run_cli(capsys, "inspect", art)  # inspect describes what is there
    assert code == 0 and "MISSING" in out


# -- malformed values ---------------------------------------------------------------------------

DELETE = object()


def _at(d, path):
    for p in path[:-1]:
        d = d[p]
    return d


VALUE_CASES = [
    # wrong types
    (("model", "vocab_size"), "320", "model.vocab_size must be a valid integer"),
    (("model", "hidden_size"), 64.0, "model.hidden_size must be a valid integer"),
    (("model", "num_layers"), True, "model.num_layers must be a valid integer"),
    (("model", "num_parameters"), "many", "model.num_parameters"),
    (("model", "dtype"), 32, "model.dtype"),
    (("model", "architecture"), ["LlamaForCausalLM"], "model.architecture must be a valid string"),
    (("graphs",), {"decoder": {}}, "graphs must be a valid"),
    (("graphs", 0, "opset"), "23", "graphs[0].opset"),
    (("graphs", 0, "inputs", 0, "shape"), "batch,seq", "graphs[0].inputs[0].shape"),
    (("graphs", 0, "inputs", 3, "layer"), "0", "graphs[0].inputs[3].layer"),
    (("graphs", 0, "target"), None, "graphs[0].target"),
    (("states", 0, "layers"), "0,1", "states[0].layers"),
    (("states", 0, "max_seq_len"), 128.5, "states[0].max_seq_len"),
    (("states", 0, "sliding_window"), "8", "states[0].sliding_window"),
    (("generation", "do_sample"), "false", "generation.do_sample must be a valid boolean"),
    (("generation", "temperature"), "1.0", "generation.temperature"),
    (("generation", "eos_token_ids"), 2, "generation.eos_token_ids"),
    (("generation", "top_k"), 1.5, "generation.top_k"),
    (("tokenizer_files",), "tokenizer.json", "tokenizer_files"),
    (("tool_versions",), [["graphkiln", "0.1.0"]], "tool_versions"),
    (("tool_versions", "graphkiln"), 1, 'tool_versions["graphkiln"]'),
    (("files",), ["decoder.onnx"], "files must be an object"),
    (("custom_ops",), {}, "custom_ops"),
    # zero and negative sizes
    (("model", "vocab_size"), 0, "model.vocab_size must be greater than 0"),
    (("model", "vocab_size"), -320, "model.vocab_size must be greater than 0"),
    (("model", "hidden_size"), 0, "model.hidden_size"),
    (("model", "num_layers"), 0, "model.num_layers"),
    (("model", "num_parameters"), -1, "model.num_parameters"),
    (("states", 0, "num_kv_heads"), 0, "states[0].num_kv_heads must be > 0"),
    (("states", 0, "head_dim"), -16, "states[0].head_dim"),
    (("states", 0, "max_seq_len"), 1, "states[0].max_seq_len must be greater than or equal to 2"),
    (("states", 0, "max_seq_len"), 0, "states[0].max_seq_len"),
    (("states", 0, "sliding_window"), 0, "states[0].sliding_window"),
    (("states", 0, "layers"), [], "states[0].layers"),
    (("states",), [], "states must have at least 1 item"),
    (("graphs",), [], "graphs must have at least 1 item"),
    (("graphs", 0, "opset"), 0, "graphs[0].opset"),
    (("graphs", 0, "inputs", 0, "shape", 0), -1, "graphs[0].inputs[0].shape[0]"),
    (("generation", "max_new_tokens"), -1, "generation.max_new_tokens"),
    (("generation", "top_k"), -1, "generation.top_k"),
    (("generation", "temperature"), -0.5, "generation.temperature"),
    (("generation", "temperature"), float("inf"), "generation.temperature must be a finite number"),
    (("generation", "temperature"), float("nan"), "generation.temperature must be a finite number"),
    (("generation", "top_p"), 0, "generation.top_p must be greater than 0"),
    (("generation", "top_p"), 1.5, "generation.top_p must be less than or equal to 1"),
    # out-of-range token ids and layers
    (("generation", "eos_token_ids"), [320], "generation.eos_token_ids[0] is 320, outside the vocabulary [0, 320)"),
    (("generation", "eos_token_ids"), [2, -1], "generation.eos_token_ids[1]"),
    (("generation", "bos_token_id"), 10**6, "generation.bos_token_id is 1000000, outside the vocabulary"),
    (("generation", "pad_token_id"), -1, "generation.pad_token_id"),
    (("states", 0, "layers"), [0, 2], "states[0].layers[1] is 2, not a layer of this 2-layer model"),
    (("states", 0, "layers"), [0, 0], "states[0].layers lists a layer twice"),
    (("states", 0, "layers"), [0], "graphs[0].inputs[5].layer 1 has no kv state"),
    (("graphs", 0, "outputs", 1, "layer"), 7, "graphs[0].outputs[1] 'new_key.0' has no matching past_key input for layer 7"),
    # unknown or inconsistent values
    (("states", 0, "kind"), "ssm", "states[0].kind"),
    (("states", 0, "update"), "slot_rows", "states[0].update is not a manifest field"),
    (("states", 0, "dtype"), "float64", "states[0].dtype"),
    (("graphs", 0, "inputs", 0, "dtype"), "complex128", "graphs[0].inputs[0].dtype"),
    (("graphs", 0, "inputs", 0, "role"), "logits", "graphs[0].inputs[0].role 'logits' is not a decoder graph input role"),
    (("graphs", 0, "outputs", 0, "role"), "new_key", "graphs[0].outputs[0].layer is missing"),
    (("graphs", 0, "name"), "encoder", "graphs[0].name 'encoder' is not a graph this runtime runs (decoder, vision)"),
    (("graphs", 0, "name"), "vision", "graphs[0].inputs[0].role 'input_ids' is not a vision graph input role"),
    (("graphs", 0, "outputs", 0, "shape"), ["batch", "n_logits", 321], "not the vocabulary size 320"),
    (("graphs", 0, "inputs", 3, "shape", 1), 3, "does not match its kv state"),
    (("graphs", 0, "inputs", 0, "shape", 0), "anything", "graphs[0].inputs[0].shape[0] must be an int >= 0 or one of"),
    (("model", "quant"), "int4", "model.quant_block_size must be set exactly when quant is"),
    (("model", "source"), "ok\u001b[2J\u001b[31mfake", "model.source contains a control character"),
    # sha256 strings
    (("files", "decoder.onnx"), "", 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), "abc", 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), "A" * 64, 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), "a" * 63, 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), "a" * 65, 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), "g" * 64, 'files["decoder.onnx"] must be a sha256'),
    (("files", "decoder.onnx"), 5, 'files["decoder.onnx"] must be a valid string'),
    (("files", MANIFEST_NAME), "a" * 64, "files lists manifest.json"),
    # unknown keys
    (("future_feature",), True, "future_feature is not a manifest field"),
    (("model", "foo"), 1, "model.foo is not a manifest field"),
    (("graphs", 0, "inputs", 0, "bar"), None, "graphs[0].inputs[0].bar is not a manifest field"),
    (("states", 0, "future_field"), 1, "states[0].future_field is not a manifest field"),
    (("generation", "seed"), 0, "generation.seed is not a manifest field"),
    # missing keys
    (("model", "vocab_size"), DELETE, "model.vocab_size is missing"),
    (("graphs", 0, "file"), DELETE, "graphs[0].file is missing"),
    (("generation",), DELETE, "generation is missing"),
    # nested garbage
    (("model",), [], "model must be an object"),
    (("graphs",), [[]], "graphs[0] must be an object"),
    (("states",), [None], "states[0] must be an object"),
    (("generation",), "greedy", "generation must be an object"),
    (("graphs", 0, "inputs"), [{"a": {"b": [1, {"c": None}]}}], "graphs[0].inputs[0]"),
    (("files",), {"decoder.onnx": {"sha256": "0" * 64}}, 'files["decoder.onnx"]'),
    (("tool_versions",), {"a": {"b": {"c": {}}}}, 'tool_versions["a"]'),
]


@pytest.mark.parametrize("path, value, needle", VALUE_CASES, ids=[f"{'.'.join(map(str, p))}={json.dumps(v)[:20]}"
                                                                   if v is not DELETE else f"{'.'.join(map(str, p))}-deleted"
                                                                   for p, v, _ in VALUE_CASES])
def test_malformed_values_are_one_line_errors(path, value, needle, art, capsys):
    d = read_manifest(art)
    parent = _at(d, path)
    if value is DELETE:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    write_manifest(art, d)
    msg = refused_everywhere(art, capsys, needle)
    assert msg.startswith(f"{art / MANIFEST_NAME}: ") and msg.endswith(": re-export the artifact"), msg


@pytest.mark.parametrize("text, needle", [
    ("", "not valid JSON"),
    ("{", "not valid JSON"),
    ("[1, 2]", "format_version null"),
    ('"manifest"', "format_version null"),
    ("null", "format_version null"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    (b"\xff\xfe{\x00", "not valid JSON"),
    ('{"format_version": true}', "format_version true"),
    ('{"format_version": 1.0}', "format_version 1.0"),
    ('{"format_version": 1}', "model is missing"),
])
def test_unparseable_manifests_are_one_line_errors(text, needle, art, capsys):
    (art / MANIFEST_NAME).write_bytes(text if isinstance(text, bytes) else text.encode())
    refused_everywhere(art, capsys, needle)


def test_many_problems_are_counted_on_the_one_line(art, capsys):
    d = read_manifest(art)
    d["model"].update(vocab_size="1", hidden_size="2", num_layers="3")
    write_manifest(art, d)
    assert refused_everywhere(art, capsys, "model.vocab_size").count("(and 2 more problems)") == 1


def test_a_manifest_that_disagrees_with_its_graph_is_refused_at_load(art, capsys):
    """A consistent manifest can still lie about the graph; the runtime compares it with onnxruntime's view."""
    d = read_manifest(art)
    d["graphs"][0]["inputs"][0]["name"] = "token_ids"
    write_manifest(art, d)
    refused_everywhere(art, capsys, "needs input 'input_ids', which its manifest does not declare", inspect=False)


def test_exported_manifests_validate_and_round_trip(llama_case, tok_case, sampling_default_case):
    for case in (llama_case, tok_case, sampling_default_case):
        m = case.manifest.validated()
        assert m == case.manifest == Manifest.read(case.artifact)
        assert Manifest.from_json(m.to_json()).to_json() == m.to_json()


# -- random mutations: GraphkilnError or success, never anything else ---------------------------

def _containers(inner):
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3))


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    _containers,
    max_leaves=6,
)
_STRINGS = ["", ".", "..", "../../etc/passwd", "/etc/passwd", "decoder.onnx", "decoder.onnx.data", MANIFEST_NAME,
            "tokenizer.json", "a\\b", "C:x", "x\x00y", "kv", "conv", "in_place", "slot_rows", "float16", "bfloat16",
            "int64", "batch", "seq", "cache_len", "logits", "past_key", "present_value", "conv_state", "decoder",
            "onnxruntime", "0" * 64, "\u202e\u00df"]
_INTS = [0, 1, -1, 2, 3, 16, 320, 2**31, 2**63, -(2**63), 10**30]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, prefix + (i,))


def _get(d, path):
    for p in path:
        d = d[p]
    return d


@st.composite
def _mutated(draw, base: dict) -> dict:
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(list(_paths(d))))
        node = _get(d, path)
        parent = _get(d, path[:-1]) if path else None
        ops = ["insert", "duplicate"] if isinstance(node, (dict, list)) else []
        ops += ["delete", "replace"] if path else []
        ops += ["mutate"] if not isinstance(node, (dict, list)) else []
        if not ops:
            continue
        op = draw(st.sampled_from(ops))
        if op == "delete":
            del parent[path[-1]]
        elif op == "replace":
            parent[path[-1]] = draw(_JSON)
        elif op == "insert" and isinstance(node, dict):
            node[draw(st.sampled_from(["", "x", "layer", "files"]) | st.text(max_size=6))] = draw(_JSON)
        elif op == "insert":
            node.insert(draw(st.integers(0, len(node))), draw(_JSON))
        elif op == "duplicate" and isinstance(node, list) and node:
            node.append(copy.deepcopy(node[draw(st.integers(0, len(node) - 1))]))
        elif op == "duplicate" and isinstance(node, dict) and node:
            key = draw(st.sampled_from(sorted(node)))
            node[key + draw(st.sampled_from(["", "_", ".1"]))] = copy.deepcopy(node[key])
        elif op == "mutate":
            if isinstance(node, bool):
                new = not node
            elif isinstance(node, int):
                new = draw(st.sampled_from(_INTS) | st.integers(-3, 3).map(lambda k, n=node: n + k))
            elif isinstance(node, float):
                new = draw(st.sampled_from([0.0, -0.0, -1.0, 1.5, 1e308, float("inf"), float("nan")]))
            elif isinstance(node, str):
                new = draw(st.sampled_from(_STRINGS) | st.text(max_size=6).map(lambda s, n=node: n + s)
                           | st.text(max_size=8))
            else:
                new = draw(_JSON)
            parent[path[-1]] = new
    return d


def test_random_manifest_mutations_load_or_fail_cleanly(llama_case, artifact_copy):
    art = artifact_copy(llama_case)
    base = read_manifest(art)
    outcomes = {"loaded": 0, "refused": 0}

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
    @example(d=base)
    @given(d=_mutated(base))
    def check(d):
        # one artifact copy for every example: only manifest.json changes, rewritten each time
        (art / MANIFEST_NAME).write_text(json.dumps(d))
        try:
            Engine.load(art)
            outcomes["loaded"] += 1
        except GraphkilnError as exc:
            assert "\n" not in str(exc), str(exc)
            outcomes["refused"] += 1
        try:  # what inspect runs
            from graphkiln.summary import describe

            m, digest = Manifest.read_with_digest(art)
            describe(art, m, digest)
        except GraphkilnError as exc:
            assert "\n" not in str(exc), str(exc)

    check()
    # the unmutated manifest (an explicit example) loads, so the harness can tell success from refusal
    assert outcomes["refused"] > 0 and outcomes["loaded"] > 0, outcomes


# -- the manifest digest pins the artifact ------------------------------------------------------

def _digest_line(out: str) -> str:
    lines = [l for l in out.splitlines() if l.startswith("digest ")]
    assert len(lines) == 1, out
    return lines[0].split()[1]


def test_inspect_prints_the_manifest_digest(art, capsys):
    code, out, err = run_cli(capsys, "inspect", art)
    assert code == 0, err
    assert _digest_line(out) == sha256(art / MANIFEST_NAME)
    code, out, _ = run_cli(capsys, "inspect", art, "--json")
    assert code == 0 and json.loads(out) == read_manifest(art)  # --json stays the manifest itself


def test_a_matching_digest_loads(art, llama_case):
    digest = sha256(art / MANIFEST_NAME)
    for given_digest in (digest, digest.upper()):
        engine = Engine.load(art, expected_digest=given_digest)
        assert engine.manifest_digest == digest and engine.manifest == llama_case.manifest


def test_a_changed_manifest_is_refused_by_its_old_digest(art, capsys):
    old = sha256(art / MANIFEST_NAME)
    text = (art / MANIFEST_NAME).read_text()
    assert '"max_new_tokens": 128' in text
    (art / MANIFEST_NAME).write_text(text.replace('"max_new_tokens": 128', '"max_new_tokens": 127'))  # one byte
    new = sha256(art / MANIFEST_NAME)
    Engine.load(art)  # a valid manifest: only the pin refuses it
    with pytest.raises(GraphkilnError) as err:
        Engine.load(art, expected_digest=old)
    msg = str(err.value)
    assert old in msg and new in msg and "\n" not in msg
    code, out, err_text = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3", "--expect-digest", old)
    assert_one_error(code, err_text, old, new)
    assert out == ""


def test_pinning_the_manifest_pins_every_file(art):
    digest = sha256(art / MANIFEST_NAME)
    data = art / "decoder.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0x01
    data.write_bytes(bytes(blob))
    for check_files in (True, False):  # a pin checks the files even when asked not to
        with pytest.raises(GraphkilnError, match="decoder.onnx.data fails its sha256 check"):
            Engine.load(art, check_files=check_files, expected_digest=digest)


def test_run_expect_digest(art, capsys):
    digest = sha256(art / MANIFEST_NAME)
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--expect-digest", digest)
    assert code == 0, err
    assert len(out.split()) == 3
    for bad in ("abc", "g" * 64, digest[:-1], ""):
        code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "1,2,3", "--expect-digest", bad)
        assert_one_error(code, err, "--expect-digest", "sha256")
        assert out == ""


@pytest.mark.parametrize("bad", ["abc", "z" * 64, 12345, "a" * 65])
def test_a_malformed_expected_digest_is_refused(bad, art):
    with pytest.raises(GraphkilnError, match="not a sha256"):
        Engine.load(art, expected_digest=bad)


# -- the text itself: not JSON, or JSON with an editor's byte-order mark ------------------------

@pytest.mark.parametrize("edit, needle", [
    (lambda b: b"\xef\xbb\xbf" + b, "byte-order mark"),
    (lambda b: "\ufeff".encode("utf-16-le") + b.decode().encode("utf-16-le"), "not valid JSON"),
    (lambda b: b[: len(b) // 2], "not valid JSON"),
    (lambda b: b + b"}", "not valid JSON"),
    (lambda b: b"\xff" + b, "not valid JSON"),
], ids=["utf8-bom", "utf16", "truncated", "trailing", "not-utf8"])
def test_a_manifest_that_is_not_plain_json_is_one_plain_line(art, capsys, edit, needle):
    path = art / MANIFEST_NAME
    path.write_bytes(edit(path.read_bytes()))
    msg = refused_everywhere(art, capsys, needle)
    assert msg.startswith(f"{path} ") and "the manifest invalid" not in msg, msg
