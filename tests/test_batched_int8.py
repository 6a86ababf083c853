"""Quantized artifacts' batched-step graph (``graphkiln.batched_int8``, ``Engine.load(batched_int8=True)``).

The tiny Llama with attention and MLP biases (so the bias path is covered), exported int4 with and
without zero points through the CLI: the artifact carries the batched graph and its smoothing
factors and nothing large; with ``batched_int8`` steps of at least ``min_rows`` token rows run it
(their logits differ from the block graph's, within the bound below) and smaller steps run the
block graph (identical logits); bad manifests and impossible requests get one line. Real-weight
quality is in test_quant_quality.py.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from graphkiln.batched_int8 import DERIVED_LOCATION, dequantize, quantize_per_channel, smoothing
from graphkiln.cli import main
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime import Engine

pytest.importorskip("onnxruntime")

SCHEMES = {"int4": "sym", "int4-asym": "asym"}
# batched vs block logits, same prompts: (max RMS error / RMS spread, min top-1 agreement).
# Measured on this model (two prompt sets, both schemes): 0.036-0.039 / 93-98%; for scale, the int4
# blocks vs the fp32 artifact are 0.32 / 63% (test_quantize.py).
BOUNDS = (0.1, 0.85)


@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory):
    base = tiny("llama_gqa_bias", "onnxruntime")
    root = tmp_path_factory.mktemp("batched")
    out = {}
    for name, scheme in SCHEMES.items():
        out[name] = root / name
        assert main(["export", str(base.checkpoint), "-o", str(out[name]), "--max-seq-len", "128", "--quant", "int4",
                     "--quant-scheme", scheme]) == 0
    return base, out


def _rms_rel(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.square(ours - ref).sum() / np.square(ref - ref.mean(-1, keepdims=True)).sum()))


def test_artifact_carries_the_graph_and_no_weights(artifacts):
    _, arts = artifacts
    for art in arts.values():
        m = Manifest.read(art)
        (spec,) = m.batched
        block = onnx.load(str(art / "decoder.onnx"), load_external_data=False)
        batched = onnx.load(str(art / spec.file), load_external_data=False)
        n_blocks = sum(n.op_type == "MatMulNBits" for n in block.graph.node)
        assert n_blocks == len(spec.weights) > 0
        assert sum(n.op_type == "MatMulNBits" for n in batched.graph.node) == 0
        assert sum(n.op_type == "MatMulInteger" for n in batched.graph.node) == n_blocks
        # the int8 weights are not in the artifact: their initializers name no file, and the batched
        # data file (smoothing factors, block tensors the block graph stores inline) is smaller than they are
        derived = {t.name: t for t in batched.graph.initializer if t.name in {d.weight for d in spec.weights}}
        assert len(derived) == len(spec.weights)
        assert all({e.key: e.value for e in t.external_data}["location"] == DERIVED_LOCATION for t in derived.values())
        int8_bytes = sum(int(np.prod(t.dims)) for t in derived.values())
        assert (art / "decoder.batched.data").stat().st_size < int8_bytes / 2
        assert set(m.files) >= {spec.file, "decoder.batched.data"}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_big_steps_run_int8_small_steps_run_blocks(name, artifacts):
    base, arts = artifacts
    block = Engine.load(arts[name], threads=2, prefix_cache=False)
    batched = Engine.load(arts[name], threads=2, prefix_cache=False, batched_int8=True)
    min_rows = Manifest.read(arts[name]).batched[0].min_rows
    prompts = base.prompts([9, 23, 5])
    ours, ref = np.concatenate(batched.prompt_logits(prompts)), np.concatenate(block.prompt_logits(prompts))
    rms = _rms_rel(ours, ref)
    top1 = float(np.mean(ours.argmax(-1) == ref.argmax(-1)))
    assert 0 < rms <= BOUNDS[0] and top1 >= BOUNDS[1], (rms, top1)  # > 0: the int8 graph ran
    short = base.prompts([min_rows - 1])
    assert np.array_equal(batched.prompt_logits(short)[0], block.prompt_logits(short)[0])


def test_derivation_matches_the_blocks():
    """Wq * c / s reproduces the dequantized blocks to int8 per-channel precision."""
    rng = np.random.default_rng(0)
    k, n, block = 80, 24, 32  # K not a multiple of the block: the kernel's zero-padded last block
    k_blocks = -(-k // block)
    codes = rng.integers(0, 16, (n, k_blocks, block), dtype=np.uint8)
    blob = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = rng.uniform(0.01, 0.1, (n, k_blocks)).astype(np.float32)
    w = dequantize(blob, scales, None, k, 4)
    expect = ((codes.astype(np.float32) - 8) * scales[..., None]).reshape(n, -1)[:, :k].T
    assert np.array_equal(w, expect)
    s = smoothing(w, rng.uniform(0.1, 10, k))
    q, c = quantize_per_channel(w, s)
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    back = q.astype(np.float32) * c / s[:, None]
    assert np.abs(back - w).max() <= (c / s[:, None]).max() / 2 + 1e-6


def test_refusals_are_one_line(artifacts, tiny, tmp_path, capsys):
    base, arts = artifacts
    with pytest.raises(GraphkilnError, match="has none .it is not quantized"):
        Engine.load(base.artifact, batched_int8=True)
    assert main(["run", str(base.artifact), "--prompt-ids", "3,4,5", "--max-new-tokens", "1", "--batched-int8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "--batched-int8" in err[0]

    # a manifest pointing a weight's blocks past the end of their file (the file itself intact)
    art = tmp_path / "art"
    shutil.copytree(arts["int4"], art)
    d = json.loads((art / "manifest.json").read_text())
    d["batched"][0]["weights"][0]["source"]["offset"] = (art / "decoder.onnx.data").stat().st_size
    (art / "manifest.json").write_text(json.dumps(d))
    Engine.load(art)  # the block graph alone never reads it
    with pytest.raises(GraphkilnError, match="ends before"):
        Engine.load(art, batched_int8=True)

    # blocks that cannot be MatMulNBits' for the weight's K: refused by the manifest check
    d["batched"][0]["weights"][0]["source"]["offset"] = 0
    d["batched"][0]["weights"][0]["block_size"] = 64
    (art / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(GraphkilnError, match="not MatMulNBits' B"):
        Engine.load(art)
