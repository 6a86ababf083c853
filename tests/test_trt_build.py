"""graphkiln build ART --backend tensorrt: profiles, refusals, publication into the artifact.

Everything but the TensorRT build itself runs here: the profiles are checked against the
shapes the real ``StatePool`` hands a runner, refusals go through the CLI with the artifact
compared byte for byte, and the publication function writes real bytes into a real artifact
that must then pass the same checks ``Engine.load`` makes. The build itself
(``test_tensorrt_build``) runs only where TensorRT and an NVIDIA GPU are.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest

from cli_contract import assert_one_error, run_cli
from graphkiln.artifact import check_artifact
from graphkiln.trt_build.profiles import (DECODE, INT32_MAX, PREFILL, BuildSizes, admits, build_sizes, make_profiles,
                                      select_profile, state_pool_bytes, tensorrt_graph)
from graphkiln.trt_build.publish import engine_paths, publish_engine
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, EngineSpec, Manifest
from graphkiln.runtime.backends.state import StatePool

DENSE, HYBRID, SLIDING = "llama_gqa_bias", "lfm2", "mistral_sliding"
HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (bytes) and directory (None) under root, hidden ones included."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            out[os.path.relpath(os.path.join(dirpath, f), root)] = Path(dirpath, f).read_bytes()
    return out


def _engine_record(manifest: Manifest, sizes: BuildSizes, **fields) -> EngineSpec:
    """An engine entry as build writes it; the TensorRT fields are labels here, no engine is claimed to exist."""
    graph = tensorrt_graph(manifest)
    plan, cache = engine_paths(graph)
    values = dict(graph=graph.name, target=graph.target, file=plan, backend="tensorrt",
                  profiles=make_profiles(manifest, graph, sizes), max_batch=sizes.max_batch,
                  max_seq_len=sizes.max_seq_len, tensorrt_version="11.4.0.106", gpu_name="label only",
                  compute_capability="9.0", timing_cache=cache)
    values.update(fields)
    return EngineSpec(**values)


# -- profiles ---------------------------------------------------------------------------------


def test_dense_profiles_are_exact(tiny):
    m = tiny(DENSE, "tensorrt").manifest
    prefill, decode = make_profiles(m, tensorrt_graph(m), build_sizes(m, 3, 64))
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert prefill.shapes["input_ids"] == ((1, 1), (3, 32), (3, 64))
    assert prefill.shapes["logits_index"] == ((1, 1), (3, 1), (3, 1))
    assert decode.shapes["input_ids"] == decode.shapes["position_ids"] == ((1, 1), (3, 1), (3, 1))
    # the cache is bound whole: only the batch (live slots) varies
    for p in (prefill, decode):
        assert p.shapes["past_key.0"] == ((1, 2, 64, 16), (3, 2, 64, 16), (3, 2, 64, 16))
        assert set(p.shapes) == {t.name for t in tensorrt_graph(m).inputs}  # every input of this graph is dynamic
    # the record build writes is one a reader accepts
    record = _engine_record(m, build_sizes(m, 3, 64))
    dataclasses.replace(m, engines=(record,), files={**m.files, record.file: "0" * 64,
                                                     record.timing_cache: "1" * 64}).validated()


def test_default_seq_len_is_the_states(tiny):
    m = tiny(DENSE, "tensorrt").manifest
    assert build_sizes(m) == BuildSizes(8, 128)
    assert build_sizes(m, 2) == BuildSizes(2, 128)


@pytest.mark.parametrize("name", [DENSE, HYBRID, SLIDING])
def test_profiles_admit_what_the_runner_binds(tiny, name):
    """The shapes a runner binds over the real StatePool (reserved at the engine's sizes) are
    admitted: decode steps by the decode profile, prompts of any length by prefill; anything
    the pool would not have at those sizes is not."""
    m = tiny(name, "tensorrt").manifest
    graph = tensorrt_graph(m)
    b, n_tokens = 3, 40
    sizes = build_sizes(m, b, n_tokens)
    engine = _engine_record(m, sizes)

    def shapes(pool: StatePool, n: int, seq: int, n_logits: int = 1) -> dict[str, tuple[int, ...]]:
        keys, values = pool.kv_views(n)
        given = {"input_ids": (n, seq), "position_ids": (n, seq), "logits_index": (n, n_logits), "seq_lens": (n,),
                 "slot_idx": (n,)}
        out = {}
        for t in graph.inputs:
            if t.role == "past_key":
                out[t.name] = keys[t.layer].shape
            elif t.role == "past_value":
                out[t.name] = values[t.layer].shape
            elif t.role == "conv_state":
                out[t.name] = pool.conv[t.layer].shape
            else:
                out[t.name] = given[t.role]
        return out

    pool = StatePool(m.states, np.dtype(np.float32))
    pool.reserve(b, n_tokens)
    for n in range(1, b + 1):
        step = shapes(pool, n, 1)
        assert select_profile(engine, step) == DECODE
        assert admits(engine.profiles[PREFILL], step) is None  # a one-token prompt is a prefill too
        for seq in (2, n_tokens // 2, n_tokens):
            assert admits(engine.profiles[DECODE], shapes(pool, n, seq)) is not None
            assert select_profile(engine, shapes(pool, n, seq)) == PREFILL

    with pytest.raises(GraphkilnError, match="no profile for this step"):
        select_profile(engine, shapes(pool, 1, n_tokens + 1))  # longer than the engine's sequences
    with pytest.raises(GraphkilnError, match="logits_index"):
        select_profile(engine, shapes(pool, 2, 8, n_logits=8))  # logits at every position: prompt_logits
    bigger = StatePool(m.states, np.dtype(np.float32))
    bigger.reserve(b + 1, n_tokens)
    with pytest.raises(GraphkilnError, match="no profile for this step"):
        select_profile(engine, shapes(bigger, b + 1, 1))  # more live requests than slots
    shorter = StatePool(m.states, np.dtype(np.float32))
    shorter.reserve(b, n_tokens - 1)  # what the CPU engine reserves for a short session: not the engine's pool
    assert select_profile(engine, shapes(pool, 1, 1)) == DECODE
    if any(s.kind == "kv" for s in m.states):
        with pytest.raises(GraphkilnError, match="past_"):
            select_profile(engine, shapes(shorter, 1, 1))


def test_conv_pools_and_sliding_caches_are_bound_whole(tiny):
    m = tiny(HYBRID, "tensorrt").manifest
    prefill, decode = make_profiles(m, tensorrt_graph(m), build_sizes(m, 5, 32))
    conv = [t for t in tensorrt_graph(m).inputs if t.role == "conv_state"]
    assert conv
    for t in conv:
        whole = (5, t.shape[1], t.shape[2])
        assert prefill.shapes[t.name] == decode.shapes[t.name] == (whole, whole, whole)
    assert decode.shapes["slot_idx"] == ((1,), (5,), (5,))

    m = tiny(SLIDING, "tensorrt").manifest
    assert all(s.sliding_window for s in m.states)
    prefill, decode = make_profiles(m, tensorrt_graph(m), build_sizes(m, 2, 100))
    for t in tensorrt_graph(m).inputs:
        if t.role in ("past_key", "past_value"):  # full-length rows, longer than the window
            assert [s[2] for s in prefill.shapes[t.name]] == [100, 100, 100] == [s[2] for s in decode.shapes[t.name]]


def test_state_pool_bytes_matches_the_real_pool(tiny):
    m = tiny(HYBRID, "tensorrt").manifest
    sizes = build_sizes(m, 3, 50)
    pool = StatePool(m.states, np.dtype(np.float32))
    pool.reserve(3, 50)
    assert state_pool_bytes(m, sizes) == pool.nbytes


def test_size_refusals(tiny):
    m = tiny(DENSE, "tensorrt").manifest
    graph = tensorrt_graph(m)
    for kwargs, needle in [({"max_seq_len": 129}, "longer than the artifact's 128"), ({"max_seq_len": 1}, ">= 2"),
                           ({"max_batch": 0}, ">= 1"), ({"max_batch": True}, ">= 1"), ({"max_seq_len": 64.0}, ">= 2")]:
        with pytest.raises(GraphkilnError, match=needle):
            build_sizes(m, **kwargs)
    # kv heads 2 x head_dim 16 x 128 tokens = 4096 elements per slot: 2**19 slots overflow int32
    huge = BuildSizes(2**19, 128)
    with pytest.raises(GraphkilnError, match=r"past_key\.0 would be \[524288, 2, 128, 16\].*2\*\*31 - 1"):
        make_profiles(m, graph, huge)
    make_profiles(m, graph, BuildSizes(INT32_MAX // (128 * 64), 128))  # the largest that fits: hidden 64 x 128 tokens


def test_no_tensorrt_graph_is_refused(tiny, artifact_copy, capsys):
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest = json.loads((art / MANIFEST_NAME).read_text())
    manifest["graphs"][0]["target"] = "portable"  # the same graph, recorded for another target
    (art / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    before = _tree(art)
    code, out, err = run_cli(capsys, "build", art, "--backend", "tensorrt")
    assert_one_error(code, err, "no tensorrt-target decoder graph", "--target tensorrt", alone=True)
    assert _tree(art) == before


@pytest.mark.parametrize("argv, needles", [
    (["--max-seq-len", "129"], ["--max-seq-len 129", "128"]),
    (["--max-seq-len", "1"], ["--max-seq-len", ">= 2"]),
    (["--max-batch", "0"], ["--max-batch", ">= 1"]),
    (["--max-batch", "two"], ["--max-batch", "not an integer"]),
    (["--max-batch", str(2**19)], ["past_key.0", "lower --max-batch or --max-seq-len"]),
    (["--backend", "onnxruntime"], ["--backend", "tensorrt"]),
])
def test_cli_refusals_are_one_line_and_write_nothing(tiny, artifact_copy, capsys, argv, needles):
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    before = _tree(art)
    args = ["build", art] + (argv if "--backend" in argv else ["--backend", "tensorrt"] + argv)
    code, _, err = run_cli(capsys, *args)
    assert_one_error(code, err, *needles, alone=True)
    assert _tree(art) == before


@pytest.mark.skipif(HAS_TENSORRT, reason="TensorRT is installed here: the missing-TensorRT refusal cannot happen")
def test_missing_tensorrt_is_one_line_and_writes_nothing(tiny, artifact_copy, capsys):
    art = artifact_copy(tiny(HYBRID, "tensorrt"))
    before = _tree(art)
    code, out, err = run_cli(capsys, "build", art, "--backend", "tensorrt", "--max-batch", "2")
    assert_one_error(code, err, "needs TensorRT 11 (tensorrt-cu13) and an NVIDIA GPU",
                     "pip install 'graphkiln[tensorrt]'", alone=True)
    assert out == ""
    assert _tree(art) == before


def test_a_corrupt_artifact_is_refused_before_anything(tiny, artifact_copy, capsys):
    art = artifact_copy(tiny(HYBRID, "tensorrt"))
    data = bytearray((art / "decoder.onnx.data").read_bytes())
    data[100] ^= 1
    (art / "decoder.onnx.data").write_bytes(bytes(data))
    before = _tree(art)
    code, _, err = run_cli(capsys, "build", art, "--backend", "tensorrt")
    assert_one_error(code, err, "decoder.onnx.data", "sha256", alone=True)
    assert _tree(art) == before


def test_a_second_build_of_one_artifact_is_refused(tiny, artifact_copy, capsys):
    from graphkiln.trt_build.publish import lock_artifact

    art = artifact_copy(tiny(HYBRID, "tensorrt"))
    before = _tree(art)
    with lock_artifact(art):  # what a running build holds
        code, _, err = run_cli(capsys, "build", art, "--backend", "tensorrt")
    assert_one_error(code, err, "another graphkiln build is writing", alone=True)
    assert _tree(art) == before


# -- publication ------------------------------------------------------------------------------


def test_publish_writes_files_and_a_manifest_that_loads(tiny, artifact_copy, capsys):
    case = tiny(HYBRID, "tensorrt")
    art = artifact_copy(case)
    manifest, digest = Manifest.read_with_digest(art)
    sizes = build_sizes(manifest, 2, 64)
    record = _engine_record(manifest, sizes)
    rng = np.random.default_rng(0)
    plan, cache = rng.bytes(300_000), rng.bytes(1_000)
    new, new_digest = publish_engine(art, manifest, digest, record,
                                     {record.file: memoryview(plan), record.timing_cache: cache})

    assert (art / "engines/tensorrt/decoder.plan").read_bytes() == plan
    assert (art / "engines/tensorrt/timing.cache").read_bytes() == cache
    assert new_digest == hashlib.sha256((art / MANIFEST_NAME).read_bytes()).hexdigest() != digest
    read, read_digest = Manifest.read_with_digest(art, expected_digest=new_digest)
    assert read == new and read.engines == (record,)
    assert read.files[record.file] == hashlib.sha256(plan).hexdigest()
    check_artifact(art, read)  # every file, the engine's included, against its sha256
    assert not [p for p in _tree(art) if ".partial-" in p]
    code, out, _ = run_cli(capsys, "inspect", art)
    assert code == 0
    assert "engine       decoder (tensorrt): engines/tensorrt/decoder.plan" in out
    assert f"digest       {new_digest}" in out

    # a rebuild replaces the entry and the files; what the old manifest listed is gone
    plan2 = rng.bytes(200_000)
    record2 = _engine_record(manifest, build_sizes(manifest, 4, 32), gpu_name="another label")
    newer, newer_digest = publish_engine(art, read, read_digest, record2,
                                         {record2.file: plan2, record2.timing_cache: cache + b"more"})
    again = Manifest.read(art)
    assert again == newer and again.engines == (record2,)
    assert again.files[record2.file] == hashlib.sha256(plan2).hexdigest()
    check_artifact(art, again)
    assert newer_digest not in (digest, new_digest)
    # and the rest of the artifact is what export wrote
    assert {k: v for k, v in again.files.items() if not k.startswith("engines/")} == case.manifest.files


def test_publish_refuses_a_file_it_does_not_own(tiny, artifact_copy):
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    record = _engine_record(manifest, build_sizes(manifest, 2, 32))
    (art / "engines/tensorrt").mkdir(parents=True)
    (art / "engines/tensorrt/timing.cache").write_bytes(b"the user's")
    before = _tree(art)
    with pytest.raises(GraphkilnError, match="does not list it as an engine file"):
        publish_engine(art, manifest, digest, record, {record.file: b"plan", record.timing_cache: b"cache"})
    assert _tree(art) == before


def test_publish_refuses_a_manifest_changed_since_the_build_started(tiny, artifact_copy):
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    record = _engine_record(manifest, build_sizes(manifest, 2, 32))
    before = _tree(art)
    with pytest.raises(GraphkilnError, match="changed while the engine was built"):
        publish_engine(art, manifest, "0" * 64, record, {record.file: b"plan", record.timing_cache: b"cache"})
    assert _tree(art) == before


@pytest.mark.parametrize("failing_fsync", [1, 2, 3])
def test_an_interrupted_publish_leaves_the_artifact_as_it_was(tiny, artifact_copy, monkeypatch, failing_fsync):
    """Ctrl-C while the new files are written: temporary files and the directories this
    publish created are removed; the artifact is byte-identical."""
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    record = _engine_record(manifest, build_sizes(manifest, 2, 32))
    before = _tree(art)
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == failing_fsync:
            raise KeyboardInterrupt
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        publish_engine(art, manifest, digest, record, {record.file: b"plan" * 1000, record.timing_cache: b"c"})
    assert _tree(art) == before


@pytest.mark.parametrize("failing_fsync", [1, 2, 3, 4])
def test_an_interrupted_rebuild_keeps_the_previous_engine(tiny, artifact_copy, monkeypatch, failing_fsync):
    """The same for a rebuild (one more staged file: the manifest without the old entry): the
    previous engine, its files and its manifest entry stay as they were."""
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    record = _engine_record(manifest, build_sizes(manifest, 2, 32))
    first, first_digest = publish_engine(art, manifest, digest, record, {record.file: b"old plan",
                                                                         record.timing_cache: b"old cache"})
    before = _tree(art)
    real_fsync, calls = os.fsync, []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == failing_fsync:
            raise KeyboardInterrupt
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(KeyboardInterrupt):
        publish_engine(art, first, first_digest, _engine_record(manifest, build_sizes(manifest, 4, 64)),
                       {record.file: b"new plan", record.timing_cache: b"new cache"})
    assert _tree(art) == before
    check_artifact(art, Manifest.read(art))


def test_build_summary_names_the_engine_and_the_new_digest(tiny, artifact_copy):
    from graphkiln.trt_build import BuildResult

    art = artifact_copy(tiny(HYBRID, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    sizes = build_sizes(manifest, 4, 64)
    record = _engine_record(manifest, sizes)
    _, new_digest = publish_engine(art, manifest, digest, record, {record.file: b"p" * 5000,
                                                                   record.timing_cache: b"c"})
    text = BuildResult(art, record, 5000, state_pool_bytes(manifest, sizes), new_digest, digest, False, False,
                       3.0).summary()
    lines = text.splitlines()
    assert lines[0].startswith("engine       decoder (tensorrt): engines/tensorrt/decoder.plan, 4.9 KiB")
    assert "0 prefill: batch 1..4 x seq 1..64 (tuned at 4 x 32); 1 decode: batch 1..4 x seq 1" in text
    assert lines[-1].startswith(f"digest       {new_digest}  (") and f"changed it from {digest}" in lines[-1]


def test_publish_into_a_read_only_artifact_is_one_line(tiny, artifact_copy):
    if os.geteuid() == 0:
        pytest.skip("root writes through directory permissions: a read-only artifact cannot be made here")
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    manifest, digest = Manifest.read_with_digest(art)
    record = _engine_record(manifest, build_sizes(manifest, 2, 32))
    before = _tree(art)
    art.chmod(0o555)
    try:
        with pytest.raises(GraphkilnError, match="read-only or permission denied"):
            publish_engine(art, manifest, digest, record, {record.file: b"plan", record.timing_cache: b"c"})
    finally:
        art.chmod(0o755)
    assert _tree(art) == before


# -- the real build (TensorRT and an NVIDIA GPU) ------------------------------------------------


def test_tensorrt_build(tiny, artifact_copy, capsys):
    trt = pytest.importorskip("tensorrt", reason="TensorRT is not installed (pip install 'graphkiln[tensorrt]' on a "
                                                 "machine with an NVIDIA GPU)")
    from graphkiln.trt_build.tensorrt import find_gpu

    try:
        find_gpu()
    except GraphkilnError as exc:
        pytest.skip(f"no usable NVIDIA GPU: {exc}")
    art = artifact_copy(tiny(DENSE, "tensorrt"))
    code, out, err = run_cli(capsys, "build", art, "--backend", "tensorrt", "--max-batch", "2", "--max-seq-len", "32")
    assert code == 0, err
    manifest, digest = Manifest.read_with_digest(art)
    assert f"digest       {digest}" in out
    check_artifact(art, manifest)
    (engine,) = manifest.engines
    assert (engine.max_batch, engine.max_seq_len) == (2, 32)
    assert engine.tensorrt_version == trt.__version__
    plan = (art / engine.file).read_bytes()
    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    cuda_engine = runtime.deserialize_cuda_engine(plan)
    assert cuda_engine is not None
    assert cuda_engine.num_optimization_profiles == 2
    for i, profile in enumerate(engine.profiles):
        for name, shapes in profile.shapes.items():
            got = tuple(tuple(s) for s in cuda_engine.get_tensor_profile_shape(name, i))
            assert got == shapes, (profile.name, name)
    # the engine against its graph in onnxruntime, step by step, through polygraphy (as scripts/gpu_check.py)
    from graphkiln.trt_build.compare import compare_engine

    comparison = compare_engine(art)
    assert comparison.passed, comparison.summary()
    # a rebuild reuses the timing cache and replaces the entry
    code, out, err = run_cli(capsys, "build", art, "--backend", "tensorrt", "--max-batch", "2", "--max-seq-len", "32")
    assert code == 0, err
    assert "reused" in out and "replacing the previous one" in out
    assert len(Manifest.read(art).engines) == 1
