"""polygraphy (NVIDIA's TensorRT debugging tool) on graphkiln's graphs, on the CPU.

What runs here: polygraphy's onnxruntime runner over every target's decoder graph with the
feeds ``graphkiln.trt_build.compare`` makes (prefill, decode, a chunk onto a filled cache; LoRA
inputs included), its comparator across the targets and against graphkiln's own runtime, and
the ``polygraphy run ... --onnxrt`` command lines docs/tensorrt.md documents. The TensorRT runners
(a built engine; polygraphy building one with graphkiln's plugins registered) need TensorRT and a
GPU: tests/test_trt_build.py::test_tensorrt_build compares the engine where both are.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.trt_build.compare import (STEPS, FeedSizes, Step, compare_graphs, compare_results, data_loader,
                                         decoder_graph, feed_sizes, onnxrt_runner, run, step_outputs)

TARGETS = ("tensorrt", "onnxruntime", "portable")  # the first is the reference: the graph TensorRT parses
POLYGRAPHY = str(Path(sys.executable).parent / "polygraphy")


def test_every_target_agrees_with_the_tensorrt_graph_step_by_step(lora_case):
    """The three targets' graphs of one artifact (LoRA inputs: every row on an adapter) in
    polygraphy's onnxruntime runner, compared by its comparator on logits and the state rows
    each step wrote; the same comparator fails on a one-row change of any of them."""
    comparison = compare_graphs(lora_case.artifact, TARGETS)
    assert comparison.passed, comparison.summary()
    layers = range(lora_case.manifest.model.num_layers)
    outputs = {"logits"} | {f"{kind}.{i}" for kind in ("key", "value") for i in layers}
    assert {(d.want, d.got, d.iteration, d.output) for d in comparison.diffs} == {
        ("onnxruntime tensorrt", f"onnxruntime {t}", s.name, o) for t in TARGETS[1:] for s in STEPS for o in outputs}
    assert comparison.max_absdiff < 1e-4  # one computation in three lowerings, all fp32 on one CPU

    manifest = Manifest.read(lora_case.artifact)
    spec = decoder_graph(manifest, "portable")
    feeds = data_loader(manifest, spec, feed_sizes(manifest))
    (got,) = run([onnxrt_runner(lora_case.artifact / spec.file)], feeds).values()
    defined = [step_outputs(spec, step, it) for step, it in zip(STEPS, got)]
    for i, output in enumerate(("logits", "key.0", f"value.{len(layers) - 1}")):  # one kind per step
        changed = [dict(d) for d in defined]
        changed[i][output] = changed[i][output].copy()
        changed[i][output][..., -1, :] += 0.1  # the last token's logits / the last written row
        bad = compare_results({"reference": defined, "changed": changed}, iterations=[s.name for s in STEPS])
        assert [(d.iteration, d.output) for d in bad.diffs if not d.passed] == [(STEPS[i].name, output)]


@pytest.mark.parametrize("fixture", ["llama_case", "tok_case"])
def test_polygraphy_prefill_matches_the_runtime(request, fixture):
    """polygraphy's run of the prefill step equals graphkiln's runtime on the same prompts
    (Engine.prompt_logits at each row's last real token): the feeds mean what the runtime means
    (positions from each row's start, logits at its last real token, padding after it)."""
    case = request.getfixturevalue(fixture)
    manifest = case.manifest
    spec = decoder_graph(manifest)
    prefill = STEPS[0]
    assert len(set(prefill.lengths)) > 1 and set(prefill.starts) == {0}  # ragged rows from empty caches
    feeds = data_loader(manifest, spec, feed_sizes(manifest), [prefill], seed=7)
    (got,) = run([onnxrt_runner(case.artifact / spec.file)], feeds).values()
    prompts = [feeds[0]["input_ids"][b, :n].tolist() for b, n in enumerate(prefill.lengths)]
    ours = np.stack([logits[-1:] for logits in case.engine.prompt_logits(prompts)])
    comparison = compare_results({"graphkiln runtime": [{"logits": ours}], "polygraphy onnxrt": [got[0]]},
                                 tolerance=(1e-5, 1e-5))
    assert comparison.passed, comparison.summary()
    assert [d.output for d in comparison.diffs] == ["logits"]


@pytest.mark.parametrize("step", [Step("too wide", (0, 0, 0), (1, 1, 1)), Step("too long", (0,), (17,)),
                                  Step("past the end", (12,), (5,))])
def test_a_step_that_does_not_fit_the_sizes_is_one_error_line(llama_case, step):
    manifest = llama_case.manifest
    with pytest.raises(GraphkilnError) as e:
        data_loader(manifest, decoder_graph(manifest), FeedSizes(slots=2, cache_len=16), [step])
    assert "\n" not in str(e.value) and "--max-batch or --max-seq-len" in str(e.value)
    with pytest.raises(GraphkilnError, match="no decoder graph for target 'tensorrt'"):
        decoder_graph(manifest, "tensorrt")


def _cli(*args, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=240, **kw)


def test_polygraphy_run_command_lines(lora_case, tmp_path):
    """docs/tensorrt.md's CPU command lines: our feeds written for polygraphy (one file for every
    target's graph), the tensorrt-target graph run by ``polygraphy run --onnxrt`` with its
    logits saved, then the onnxruntime-target graph run and compared against them by polygraphy
    itself, every step passing (logits only: a present cache's rows past a row's end are not part
    of the contract)."""
    from polygraphy.json import load_json

    from graphkiln.trt_build.compare import main

    art = lora_case.artifact
    feeds = tmp_path / "feeds.json"
    assert main(["inputs", str(art), "-o", str(feeds)]) == 0
    manifest = Manifest.read(art)
    names = {t.name for g in manifest.graphs for t in g.inputs}
    assert [set(f) for f in load_json(feeds)] == [names] * len(STEPS)
    saved = _cli(POLYGRAPHY, "run", art / decoder_graph(manifest, "tensorrt").file, "--onnxrt", "--load-inputs", feeds,
                 "--onnx-outputs", "logits", "--save-outputs", tmp_path / "tensorrt-graph.json")
    assert saved.returncode == 0, saved.stdout[-2000:] + saved.stderr[-2000:]
    compared = _cli(POLYGRAPHY, "run", art / decoder_graph(manifest, "onnxruntime").file, "--onnxrt", "--load-inputs",
                    feeds, "--onnx-outputs", "logits", "--load-outputs", tmp_path / "tensorrt-graph.json",
                    "--atol", "1e-4", "--rtol", "1e-4")
    assert compared.returncode == 0, compared.stdout[-2000:] + compared.stderr[-2000:]
    assert f"Passed: {len(STEPS)}/{len(STEPS)} iterations" in compared.stdout + compared.stderr


def test_the_command_refuses_in_one_line(llama_case, tmp_path, capsys):
    """``python -m graphkiln.trt_build.compare``: what it cannot do is one ``error:`` line, exit 2,
    nothing written: not an artifact, a target the artifact lacks, sizes the steps do not fit, an
    engine build's sizes it refuses, and polygraphy with our plugins where TensorRT is missing."""
    import importlib.util

    from graphkiln.trt_build.compare import main

    out = tmp_path / "feeds.json"
    cases = [["inputs", tmp_path, "-o", out], ["inputs", llama_case.artifact, "-o", out, "--target", "tensorrt"],
             ["inputs", llama_case.artifact, "-o", out, "--max-batch", "1"],
             ["inputs", llama_case.artifact, "-o", out, "--max-seq-len", "100000"],
             ["trt-shapes", llama_case.artifact]]  # a portable-only artifact: no tensorrt-target graph
    if importlib.util.find_spec("tensorrt") is None:
        cases.append(["polygraphy", "run", llama_case.artifact / "decoder.onnx", "--trt"])
    for argv in cases:
        assert main([str(a) for a in argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, (argv, err)
        assert not out.exists()
