"""What ``Engine.load`` keeps resident (``scripts/bench_load_scale.py`` measures it at scale).

onnxruntime memory-maps an artifact's external data and, for a quantized graph, keeps each
MatMulNBits' block scales mapped after packing them into its own weights; the runtime drops those
resident pages once the session is built (``graphkiln.memory.release_file_pages``, called from
``runtime.backends.ort_cpu``). Checked here: the release itself on a file of our own (clean
pages go and read back the same; a mapping with a written page is left alone), and on a tiny int4
artifact that nothing of the artifact's files stays resident after load while onnxruntime alone
leaves some, with the same greedy tokens either way; and that a plain load builds only the decoder
session, not the batched-step one it does not run.
"""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from conftest import MAX_SEQ_LEN, SPECS, build_checkpoint
from graphkiln.memory import file_mappings, release_file_pages
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends import ort_cpu

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _resident(directory) -> int:
    return sum(m.get("Rss", 0) for m in file_mappings(directory))


def test_release_drops_clean_pages_and_leaves_written_mappings(tmp_path):
    data = np.arange(64 * mmap.PAGESIZE // 8, dtype=np.int64)  # 64 pages
    path = tmp_path / "weights.bin"
    path.write_bytes(data.tobytes())
    with open(path, "rb") as f:
        clean = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        written = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private, writable
    clean_view, written_view = np.frombuffer(clean, np.int64), np.frombuffer(written, np.int64)
    assert int(clean_view.sum()) == int(written_view.sum()) == int(data.sum())  # every page read
    written_view[0] = -1  # one page copied on write: this mapping no longer matches the file
    starts = {clean_view.ctypes.data: "clean", written_view.ctypes.data: "written"}
    before = {starts[m["start"]]: m for m in file_mappings(tmp_path)}
    assert set(before) == {"clean", "written"} and before["clean"]["Rss"] == len(data) * 8

    assert release_file_pages(before.values()) == before["clean"]["Rss"]
    after = {starts[m["start"]]: m for m in file_mappings(tmp_path)}
    assert after["clean"].get("Rss", 0) == 0
    assert after["written"]["Rss"] == before["written"]["Rss"]
    assert int(written_view[0]) == -1
    assert np.array_equal(clean_view, data)  # faulted back from the file, the same bytes
    del clean_view, written_view
    clean.close()
    written.close()


@pytest.fixture(scope="module")
def int4_artifact(tmp_path_factory):
    from graphkiln.export.pipeline import ExportOptions, export_model

    root = tmp_path_factory.mktemp("load_memory")
    checkpoint = build_checkpoint(SPECS["llama_gqa_bias"], root / "checkpoint")
    artifact = root / "int4"
    export_model(str(checkpoint), artifact, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, target="onnxruntime",
                                                          quant="int4", quant_method="rtn"))
    return artifact


def _tokens(engine: Engine) -> list[list[int]]:
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, engine.manifest.model.vocab_size, n).tolist() for n in (9, 23)]
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=(), do_sample=False)
    return [r.token_ids for r in engine.generate(prompts, config)]


def test_load_keeps_no_artifact_pages_resident(int4_artifact, monkeypatch):
    released = Engine.load(int4_artifact, prefix_cache=False)
    assert file_mappings(int4_artifact), "onnxruntime no longer maps the external data: this test checks nothing"
    assert _resident(int4_artifact) == 0
    ours = _tokens(released)

    monkeypatch.setattr(ort_cpu, "release_file_pages", lambda mappings: 0)
    kept = Engine.load(int4_artifact, prefix_cache=False)
    # onnxruntime alone leaves pages resident (the MatMulNBits scales); if it stops, this test is moot
    assert _resident(int4_artifact) > 0
    assert ours == _tokens(kept)


def test_plain_load_builds_only_the_decoder_session(int4_artifact, monkeypatch):
    built = _built_sessions(monkeypatch)
    Engine.load(int4_artifact)
    assert built == ["decoder.onnx"]
    built.clear()
    Engine.load(int4_artifact, batched_int8=True)
    assert built == ["decoder.onnx", "decoder.batched.onnx"]


# --- refused before anything is built: what a load allocates, against the memory available ----------
# Each case makes an artifact (or a flag) whose honest estimate exceeds this machine's real available
# memory without using it: a sparse external data file (os.truncate: no disk), a manifest claiming
# huge pools or derived weights, a budget flag. The refusal is one line naming the figure and the flag
# that lowers it, and no onnxruntime session was built (nor any file hashed: the first file's recorded
# checksum is wrong, so a load that hashed first would fail on it instead).

HUGE = 10 * 10**12  # 10 TB: more than any machine running the suite has


def _built_sessions(monkeypatch) -> list[str]:
    """The graph files sessions are built over from now on (a spy: the real build still runs)."""
    built = []
    real = ort_cpu._build_session

    def counting(ort, artifact_dir, graph_file, opts):
        built.append(graph_file)
        return real(ort, artifact_dir, graph_file, opts)

    monkeypatch.setattr(ort_cpu, "_build_session", counting)
    return built


def _edit_manifest(art, edit) -> None:
    import json

    path = art / "manifest.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _spoil_first_checksum(manifest: dict) -> None:
    first = next(iter(manifest["files"]))
    manifest["files"][first] = "0" * 64


def _claim_huge_weights(art) -> None:
    import os

    data = max((p for p in art.iterdir() if p.name.endswith(".data")), key=lambda p: p.stat().st_size)
    os.truncate(data, HUGE)  # sparse: the graph's tensors keep their bytes, the file claims 10 TB


def _huge_pools(manifest: dict) -> None:
    for state in manifest["states"]:
        state["max_seq_len"] = 2**31 - 1  # 1 slot of the tiny Llama: 512 B/token x 2^31 = 1.1 TB


def _huge_derived(manifest: dict) -> None:
    weight = manifest["batched"][0]["weights"][0]
    n = HUGE // weight["smooth"]["shape"][0]  # N: Wq [K, N] int8 is 10 TB
    weight["source"]["shape"][0] = n
    weight["source_scales"]["shape"] = [n, weight["source"]["shape"][1]]


@pytest.mark.parametrize("case", ["weights", "prefix budget", "pools, default batch", "pools, --max-batch",
                                  "batched int8", "draft"])
def test_a_load_beyond_available_memory_is_refused_before_anything_is_built(case, llama_case, int4_artifact,
                                                                              artifact_copy, tmp_path, capsys,
                                                                              monkeypatch):
    import shutil

    from cli_contract import assert_one_error, run_cli
    from graphkiln.memory import available_memory

    assert available_memory() < HUGE
    if case == "batched int8":
        art = tmp_path / "int4"
        shutil.copytree(int4_artifact, art)
    else:
        art = artifact_copy(llama_case)
    command, extra = ["run", art, "--prompt-ids", "1,2"], []
    if case == "weights":
        _claim_huge_weights(art)
        needles = ["the sessions", "re-export with --quant int4"]
    elif case == "prefix budget":
        command, extra = ["serve", art, "--port", "0"], ["--prefix-cache-bytes", f"{HUGE >> 30}G"]
        needles = ["prefix cache budget", "--prefix-cache-bytes"]
    elif case.startswith("pools"):
        _edit_manifest(art, _huge_pools)
        command = ["serve", art, "--port", "0"]
        if case.endswith("--max-batch"):
            extra, needles = ["--max-batch", "4", "--step-tokens", "8"], ["4 request(s)", "--max-batch (now 4)"]
        else:
            needles = ["1 request(s) x 2147483647 tokens", "smaller --max-seq-len"]
    elif case == "batched int8":
        _edit_manifest(art, _huge_derived)
        extra, needles = ["--batched-int8"], ["--batched-int8 derived weights", "drop --batched-int8"]
    else:
        draft = artifact_copy(llama_case, "draft")
        _claim_huge_weights(draft)
        extra, needles = ["--draft", draft], ["--draft model", "drop --draft"]
    _edit_manifest(art, _spoil_first_checksum)
    built = _built_sessions(monkeypatch)
    code, out, err = run_cli(capsys, *command, *extra)
    line = assert_one_error(code, err, "needs about", "GiB is available", *needles)
    assert "sha256" not in line and out == ""
    assert built == [], f"sessions were built before the refusal: {built}"
