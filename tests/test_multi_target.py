"""One artifact, several targets' graphs over one weights file (``--target onnxruntime,tensorrt``).

The same directory must run on a laptop CPU (onnxruntime picks its own graph) and be built into
engines on a GPU machine (the tensorrt graph, which TensorRT's checker accepts): both graphs read
the one data file, and each runs at parity with transformers on onnxruntime. Also here: the
manifest's per-graph state update (format 2) and reading a format-1 manifest.
"""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from cli_contract import assert_nothing_written, assert_one_error, run_cli
from graphkiln.artifact import graph_external_data
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, Manifest, state_update
from graphkiln.runtime import Engine, GenerationConfig
from reference import ATOL, forward_logits, greedy, max_abs

BOTH = "onnxruntime,tensorrt"
# conv + attention + MoE (interleaved experts for onnxruntime), mixed sliding windows, and gated
# delta nets (conv and recurrent pools, both in place in the tensorrt graph)
CASES = ("lfm2_moe", "qwen3_mixed_sliding", "qwen3_5")
STEPS = 24


@pytest.fixture(scope="module", params=CASES)
def both(request, tiny):
    return tiny(request.param, BOTH)


def _data_files(art: Path, manifest: Manifest, target: str) -> set[str]:
    return set(graph_external_data(art, manifest.graph("decoder", target).file))


def test_one_artifact_holds_one_graph_per_target(both):
    m = both.manifest
    assert [(g.name, g.target, g.file) for g in m.graphs] == [
        ("decoder", "onnxruntime", "decoder.onnx"), ("decoder", "tensorrt", "decoder.tensorrt.onnx")]
    ort, trt = m.graph("decoder", "onnxruntime"), m.graph("decoder", "tensorrt")
    # each graph keeps its own state contract over the same states
    for s in m.states:
        assert state_update(trt, s) == "in_place"
        assert state_update(ort, s) in ("in_place", "slot_rows", "scatter_rows")
    # the runtime's choice: onnxruntime's own graph on the CPU, the tensorrt graph for TensorRT
    assert m.graph_for("decoder", "onnxruntime") is ort
    assert m.graph_for("decoder", "tensorrt") is trt
    assert m.graph("decoder") is ort


def test_the_weights_file_is_shared(both, tiny):
    """The tensorrt graph reads only the traced data file, and the onnxruntime graph reads it too
    (plus, for MoE, a file holding just the experts it interleaves): the artifact is nowhere near
    two single-target artifacts."""
    art, m = both.artifact, both.manifest
    trt_data, ort_data = _data_files(art, m, "tensorrt"), _data_files(art, m, "onnxruntime")
    assert trt_data == {"decoder.onnx.data"}
    assert "decoder.onnx.data" in ort_data
    assert ort_data - trt_data <= {"decoder.onnx.onnxruntime.data"}
    has_moe = any(o.name == "MoE" for o in m.custom_ops)
    assert ("decoder.onnx.onnxruntime.data" in ort_data) == has_moe
    size = sum((art / f).stat().st_size for f in m.files)
    single = sum((tiny(both.spec.name, "tensorrt").artifact / f).stat().st_size
                 for f in tiny(both.spec.name, "tensorrt").manifest.files)
    extra = (art / "decoder.onnx.onnxruntime.data").stat().st_size if has_moe else 0
    graphs = sum((art / g.file).stat().st_size for g in m.graphs)
    # one copy of the weights: the single tensorrt artifact, plus one more graph proto and the
    # interleaved experts
    assert size <= single + graphs + extra
    # and every byte of the shared data file is read by the tensorrt graph (no orphaned copy)
    model = onnx.load(str(art / "decoder.tensorrt.onnx"), load_external_data=False)
    used = sum(int({e.key: e.value for e in t.external_data}["length"]) for t in model.graph.initializer
               if t.external_data)
    assert used == (art / "decoder.onnx.data").stat().st_size


@pytest.mark.parametrize("target", ["onnxruntime", "tensorrt"])
def test_each_graph_runs_at_parity_on_onnxruntime(both, target):
    engine = Engine.load(both.artifact, target=target)
    assert engine.decoder.spec.target == target
    config = GenerationConfig(max_new_tokens=STEPS, do_sample=False, stop_token_ids=(), output_logits=True)
    for lengths in ((9,), (4, 17, 11)):
        prompts = both.prompts(lengths, salt=31)
        for p, got in zip(prompts, engine.prompt_logits(prompts)):
            assert max_abs(got, forward_logits(both.reference, p)) <= ATOL
        for i, (p, res) in enumerate(zip(prompts, engine.generate(prompts, config))):
            ref_tokens, ref_logits = greedy(both.reference, p, STEPS)
            assert res.token_ids == ref_tokens, f"{both.name} {target} request {i}: greedy tokens differ"
            assert max_abs(res.logits, ref_logits) <= ATOL


def test_default_engine_runs_the_onnxruntime_graph(both):
    assert Engine.load(both.artifact).decoder.spec.target == "onnxruntime"


def test_tensorrt_check_passes_and_looks_only_at_the_tensorrt_graph(both, capsys):
    code, out, err = run_cli(capsys, "check", both.artifact, "--backend", "tensorrt")
    assert code == 0, out + err
    assert "decoder.tensorrt.onnx" in out and "0 error(s)" in out
    # the onnxruntime graph (com.microsoft ops TensorRT lacks) is not TensorRT's to build
    assert "decoder.onnx:" not in out and "exported for target" not in out


def test_verify_checks_every_graph(tiny, capsys):
    case = tiny("lfm2_moe", BOTH)
    code, out, err = run_cli(capsys, "verify", case.artifact, "--reference", case.checkpoint, "--steps", "4")
    assert code == 0, out + err
    lines = out.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("decoder.onnx (target onnxruntime): ") and lines[0].endswith("PASS")
    assert lines[1].startswith("decoder.tensorrt.onnx (target tensorrt): ") and lines[1].endswith("PASS")
    code, out, err = run_cli(capsys, "verify", case.artifact, "--reference", case.checkpoint, "--steps", "4",
                             "--target", "tensorrt")
    assert code == 0 and len(out.strip().splitlines()) == 1 and "target" not in out


def test_run_and_load_refuse_a_target_the_artifact_lacks(tiny, capsys):
    art = tiny("llama_gqa_bias", "onnxruntime").artifact
    with pytest.raises(GraphkilnError, match=r"has no graph 'decoder' for target tensorrt .*--target tensorrt"):
        Engine.load(art, target="tensorrt")
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "3,4", "--target", "tensorrt")
    assert_one_error(code, err, "has no graph 'decoder' for target tensorrt", alone=True)
    with pytest.raises(GraphkilnError, match="backend 'tpu' is not supported"):
        Engine.load(art, backend="tpu")
    with pytest.raises(GraphkilnError, match="graph target 'cuda' is not one of"):
        Engine.load(art, target="cuda")


@pytest.mark.parametrize("target, needles", [
    ("onnxruntime,", ["names an empty name"]),
    ("onnxruntime,cuda", ["names 'cuda', not a target", "onnxruntime,tensorrt"]),
    ("tensorrt,tensorrt", ["names tensorrt twice"]),
    ("", ["names an empty name"]),
])
def test_export_refuses_a_bad_target_list(llama_case, tmp_path, capsys, target, needles):
    out = tmp_path / "art"
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", out, "--target", target)
    assert_one_error(code, err, *needles, alone=True)
    assert_nothing_written(out)


@pytest.mark.parametrize("targets, needle", [
    ("onnxruntime,tensorrt", "--quant int4 is not supported with --target tensorrt"),
    ("onnxruntime,portable", "--quant int4 needs --target onnxruntime"),
])
def test_quant_needs_onnxruntime_alone(llama_case, tmp_path, capsys, targets, needle):
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", tmp_path / "a", "--target", targets,
                           "--quant", "int4")
    assert_one_error(code, err, needle, alone=True)
    assert_nothing_written(tmp_path / "a")


def test_portable_and_tensorrt_share_the_traced_file(tiny):
    case = tiny("lfm2", "portable,tensorrt")
    m = case.manifest
    assert [(g.target, g.file) for g in m.graphs] == [("portable", "decoder.onnx"), ("tensorrt", "decoder.tensorrt.onnx")]
    assert _data_files(case.artifact, m, "portable") == _data_files(case.artifact, m, "tensorrt") == {"decoder.onnx.data"}
    # no onnxruntime graph: the CPU runtime runs the portable one (before the tensorrt one)
    assert Engine.load(case.artifact).decoder.spec.target == "portable"


# ----------------------------------------------------------------------------------------------
# the manifest: graphs named by (name, target); format 1 still read


def _manifest(art: Path) -> dict:
    return json.loads((art / MANIFEST_NAME).read_text())


def test_two_graphs_with_one_name_and_target_are_refused(both, artifact_copy):
    d = _manifest(both.artifact)
    d["graphs"][1]["target"] = "onnxruntime"
    with pytest.raises(GraphkilnError, match=r"graphs\[1\]\.name 'decoder' appears twice for target onnxruntime"):
        Manifest.from_json(json.dumps(d))


def _as_format_1(d: dict, update: str | None = None) -> str:
    """A one-graph format-2 manifest as format 1 wrote it: states[].update, the graph's contract."""
    m = Manifest.from_json(json.dumps(d))
    for s, spec in zip(d["states"], m.states):
        s["update"] = update or state_update(m.graphs[0], spec)
    d["format_version"] = 1
    return json.dumps(d)


@pytest.mark.parametrize("name", ["lfm2", "llama_gqa_bias"])
@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_a_format_1_manifest_is_still_read(tiny, artifact_copy, name, target):
    case = tiny(name, target)
    art = artifact_copy(case)
    (art / MANIFEST_NAME).write_text(_as_format_1(_manifest(case.artifact)))
    engine = Engine.load(art)
    assert engine.manifest.format_version == 2 and engine.manifest.graphs == case.manifest.graphs
    prompts = case.prompts((6, 3), salt=5)
    config = GenerationConfig(max_new_tokens=4, do_sample=False, stop_token_ids=())
    assert [r.token_ids for r in engine.generate(prompts, config)] == \
        [r.token_ids for r in case.engine.generate(prompts, config)]


def test_a_format_1_manifest_whose_update_disagrees_with_its_graph_is_refused(tiny):
    case = tiny("llama_gqa_bias", "onnxruntime")  # GroupQueryAttention: in place
    text = _as_format_1(_manifest(case.artifact), update="scatter_rows")
    with pytest.raises(GraphkilnError, match=r"states\[0\]\.update is \"scatter_rows\", but graph decoder.onnx "
                                             r"updates that state in_place: re-export"):
        Manifest.from_json(text)


def test_a_format_1_manifest_with_two_graphs_is_refused(both):
    d = _manifest(both.artifact)
    d["format_version"] = 1
    with pytest.raises(GraphkilnError, match="format-1 manifest has more than one graph"):
        Manifest.from_json(json.dumps(d))


def test_a_graph_that_updates_one_state_two_ways_is_refused(both):
    d = _manifest(both.artifact)
    g = d["graphs"][1]  # tensorrt: present_* for every attention layer
    out = next(t for t in g["outputs"] if t["role"] == "present_key")
    out.update(role="new_key", name=f"new_key.{out['layer']}", shape=["batch", out["shape"][1], "seq", out["shape"][3]])
    with pytest.raises(GraphkilnError, match="a graph updates a state one way"):
        Manifest.from_json(json.dumps(d))
