"""Pipeline stages on the tensorrt export target (issue 15: stages for both export targets).

Two staged artifacts (N=2, planned by bytes): a dense model with tied embeddings for ``--target
tensorrt`` alone, and an LFM2-MoE hybrid (conv pools, attention, MoE with its onnxruntime
lowering's own interleaved-expert file) for ``--target onnxruntime,tensorrt`` in one artifact.
What runs here:

* each tensorrt stage graph is lowered as the single tensorrt graph is (same IR version and
  opsets, and together the same graphkiln nodes with the same attributes: aot=1, in-place
  state), and ``graphkiln check --backend tensorrt`` passes every stage graph;
* onnxruntime on the CPU runs the tensorrt stage graphs through the ops' function bodies, with
  present_* / whole-pool outputs bound to each stage's own pools, and its logits equal the single
  tensorrt-target artifact's within 1e-5 with identical greedy tokens over 32 steps (ragged batch
  of 3); with two targets, each target's stage graphs against the single graph of that target;
* the TensorRT runner and ``graphkiln build`` refuse a staged artifact with one line.

What never runs here: TensorRT itself (no engine is built or run; none can be installed).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper

from cli_contract import assert_one_error, run_cli
from graphkiln.artifact import graph_external_data
from graphkiln.errors import GraphkilnError
from graphkiln.export.trt_check import check_artifact
from graphkiln.runtime import Engine, GenerationConfig

TRT = "tensorrt"
# (checkpoint, targets): dense tied (mixed sliding windows), and a conv/attention/MoE hybrid for both targets
CASES = [("qwen3_mixed_sliding", TRT), ("lfm2_moe", f"onnxruntime,{TRT}")]
STEPS = 32


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-{t}" for n, t in CASES])
def staged(request, tiny, tmp_path_factory):
    """(single-graph case of the same targets, staged artifact dir, its manifest)."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    name, targets = request.param
    single = tiny(name, targets)
    out = tmp_path_factory.mktemp("staged-trt") / name
    manifest = export_model(str(single.checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN,
                                                                       target=targets, stages=2))
    return single, out, manifest


def _custom_nodes(path: Path) -> tuple[onnx.ModelProto, Counter]:
    """The graph (no weights) and its graphkiln nodes as (op, attributes) with a count."""
    model = onnx.load(str(path), load_external_data=False)
    nodes = Counter((n.op_type, tuple(sorted((a.name, repr(helper.get_attribute_value(a))) for a in n.attribute)))
                    for n in model.graph.node if n.domain == "graphkiln")
    return model, nodes


def _tree(root: Path) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): Path(d, f).read_bytes()
            for d, _, files in os.walk(root) for f in files}


def test_stage_graphs_are_lowered_as_the_single_graph(staged):
    single, art, m = staged
    targets = {g.target for g in single.manifest.graphs}
    assert {g.target for g in m.graphs} == targets and len(m.stages) == 2
    single_model, single_nodes = _custom_nodes(single.artifact / single.manifest.graph("decoder", TRT).file)
    staged_nodes = Counter()
    for st in m.stages:
        graphs = [g for g in m.graphs if g.name == st.graph]
        assert {g.target for g in graphs} == targets  # one graph per target under the stage's one name
        # the stage's files: every target's graph and every data file any of them reads, nothing else
        read = {g.file for g in graphs} | {f for g in graphs for f in graph_external_data(art, g.file)}
        assert set(st.files) == read, (st.files, read)
        trt = m.graph(st.graph, TRT)
        assert set(graph_external_data(art, trt.file)) == {f"{st.graph}.onnx.data"}  # the traced weights, shared
        model, nodes = _custom_nodes(art / trt.file)
        staged_nodes += nodes
        assert model.ir_version == single_model.ir_version and trt.opset == 23
        assert ({o.domain: o.version for o in model.opset_import}
                == {o.domain: o.version for o in single_model.opset_import})
        assert not [n for n in model.graph.node if n.domain not in ("", "graphkiln")]
        assert "RMSNormalization" in {n.op_type for n in model.graph.node}
        # state written in place: present_* and whole pools, bound to the stage's own state inputs
        roles = {t.role for t in trt.outputs if t.layer is not None}
        assert roles and not roles & {"new_key", "new_value"}
        assert {t.layer for t in trt.outputs if t.layer is not None} == {l for s in st.states for l in s.layers}
    # together the stages hold exactly the single graph's plugin nodes, attributes and all
    assert staged_nodes == single_nodes
    assert any(("aot", "1") in attrs for _, attrs in single_nodes)


def test_check_passes_every_stage_graph(staged, capsys):
    _, art, m = staged
    report = check_artifact(art)
    assert report.graphs == tuple(m.graph(st.graph, TRT).file for st in m.stages)
    assert report.passed and not report.errors and report.nodes_checked > 0
    code, out, err = run_cli(capsys, "check", art, "--backend", TRT)
    assert code == 0 and "0 error(s)" in out, out + err
    assert all(m.graph(st.graph, TRT).file in out for st in m.stages)


def test_tensorrt_stage_graphs_run_at_parity_with_the_single_graph(staged):
    single, art, m = staged
    prompts = single.prompts([7, 3, 12], salt=5)
    config = GenerationConfig(max_new_tokens=STEPS, stop_token_ids=(), output_logits=True)
    for target in sorted({g.target for g in m.graphs}):
        one, chained = Engine.load(single.artifact, target=target), Engine.load(art, target=target)
        assert [r.spec.target for r in chained.decoder.runners] == [target] * 2
        for a, b in zip(one.prompt_logits(prompts), chained.prompt_logits(prompts)):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
        for a, b in zip(one.generate(prompts, config), chained.generate(prompts, config)):
            assert b.token_ids == a.token_ids and len(a.token_ids) == STEPS, target
            np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
        # each stage's pool holds only its own layers' state
        for st, pool in zip(m.stages, chained.pool.pools):
            assert set(pool.keys) | set(pool.conv) == {l for s in st.states for l in s.layers}


def test_tensorrt_runner_and_build_refuse_a_staged_artifact(staged, capsys):
    _, art, m = staged
    before = _tree(art)
    with pytest.raises(GraphkilnError, match="pipeline-staged artifacts run on onnxruntime on the CPU only") as info:
        Engine.load(art, backend=TRT)
    assert "\n" not in str(info.value)
    code, _, err = run_cli(capsys, "run", art, "--prompt-ids", "3,4", "--backend", TRT)
    assert_one_error(code, err, "pipeline-staged artifacts run on onnxruntime on the CPU only")
    # refused from the manifest, before TensorRT or a GPU is looked for: the same line on any machine
    code, _, err = run_cli(capsys, "build", art, "--backend", TRT)
    assert_one_error(code, err, "artifact is pipeline-staged (2 stage graphs)", "without --stages")
    assert _tree(art) == before


def test_every_target_is_a_stage_target_and_an_unknown_one_is_refused():
    from graphkiln.export.stage_plan import STAGE_TARGETS, check_stage_request
    from graphkiln.manifest import TARGETS

    # a target added to the manifest without a per-stage lowering must be refused, not exported unlowered
    assert set(STAGE_TARGETS) == set(TARGETS)
    assert check_stage_request(2, None, 3, ("onnxruntime", TRT)) == ()
    with pytest.raises(GraphkilnError, match=r"--stages with --target onnxruntime,newrt is not supported yet") as info:
        check_stage_request(2, None, 3, ("onnxruntime", "newrt"))
    assert "\n" not in str(info.value)
