"""The streamed export (issue 36): memory that does not grow with the model, and the same artifact.

``load_decoder(streamed=True)`` traces from one layer per kind and reads every other weight from the
checkpoint as it is written or quantized. These tests hold it to two things: its peak memory does not
grow with the number of layers (measured in subprocesses), and it writes exactly the artifact that
loading the whole model first (``ExportOptions(streamed=False)``, the path before streaming) writes:
every graph node and every initializer byte, for a dense, an MoE, a hybrid, a vision-language, a
staged and a LoRA export, in fp32 and int4 (GGUF input: tests/test_gguf.py; preflight refusals:
here too).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (LORA_EXPORT, MAX_SEQ_LEN, SPECS, Spec, assert_same_artifact, build_checkpoint,
                      checkpoint_claiming_a_huge_layer)

# --------------------------------------------------------------------------- the memory bound

_WIDE = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_key_value_heads=4, vocab_size=1024,
             max_position_embeddings=256, tie_word_embeddings=False)
# one layer's fp32 bytes: q/o 768x768, k/v 768x256, gate/up/down 768x3072, two norms
_LAYER_BYTES = 4 * (2 * 768 * 768 + 2 * 768 * 256 + 3 * 768 * 3072 + 2 * 768)

_MEASURE = """
import json, sys
from pathlib import Path
from graphkiln.export.pipeline import ExportOptions, export_model
export_model(sys.argv[1], Path(sys.argv[2]), ExportOptions(progress=False, max_seq_len=64, quant=sys.argv[3] or None,
                                                           quant_method="search"))
# VmHWM, not ru_maxrss: getrusage keeps the high-water mark across execve, so a child forked from
# this (large) test process would report the parent's size
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"peak": hwm * 1024}))
"""


def _peak_export(checkpoint: Path, out: Path, quant: str = "") -> int:
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(checkpoint), str(out), quant], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])["peak"]


@pytest.mark.parametrize("quant", ["", "int4"])
def test_peak_memory_does_not_grow_with_layers(tmp_path, quant):
    """2 and 16 layers of the same width: peak RSS within two layers' bytes of each other (the whole-model
    path differs by 14 layers, ~530 MB, and fails this)."""
    peaks = {}
    for layers in (2, 16):
        spec = Spec(f"wide{layers}", "LlamaForCausalLM", dict(_WIDE, num_hidden_layers=layers), seed=5, features=())
        ckpt = build_checkpoint(spec, tmp_path / f"ckpt{layers}")
        peaks[layers] = _peak_export(ckpt, tmp_path / f"art{layers}", quant)
    grown = peaks[16] - peaks[2]
    assert grown < 2 * _LAYER_BYTES, (f"peak RSS grew by {grown / 2**20:.0f} MiB from 2 to 16 layers "
                                      f"(one layer: {_LAYER_BYTES / 2**20:.0f} MiB): {peaks}")


# --------------------------------------------------------------------------- the same artifact


def _whole_model_export(checkpoint: Path, out: Path, **options):
    from graphkiln.export.pipeline import ExportOptions, export_model

    export_model(str(checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, streamed=False, **options))
    return out


@pytest.mark.parametrize("name,target", [("llama_gqa_bias", "portable"), ("qwen3_moe", "onnxruntime"),
                                         ("lfm2", "onnxruntime"), ("llava_siglip", "portable")])
def test_streamed_equals_whole_model(tiny, tmp_path, name, target):
    """fp32: a dense (untied head), an MoE (experts interleaved as written), a conv hybrid and a
    vision-language export (tied head) equal the whole-model path's, byte for byte."""
    case = tiny(name, target)
    assert_same_artifact(case.artifact, _whole_model_export(case.checkpoint, tmp_path / "whole", target=target))


@pytest.mark.parametrize("options", [dict(quant="int4"), dict(quant="int4", stages=2)], ids=["int4", "int4-staged"])
def test_streamed_equals_whole_model_quantized(tiny, tmp_path, options):
    """int4 with calibration (layer by layer vs one whole pass: the same statistics, so the same
    blocks), unstaged and in two stages, on the tied-head Llama with a tokenizer."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    case = tiny("llama_tok")
    streamed = tmp_path / "streamed"
    export_model(str(case.checkpoint), streamed, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, **options))
    manifest = json.loads((streamed / "manifest.json").read_text())
    assert manifest["model"]["quant_method"] == "calibrated"
    assert_same_artifact(streamed, _whole_model_export(case.checkpoint, tmp_path / "whole", **options))


def test_streamed_equals_whole_model_lora(lora_case, tmp_path):
    """LoRA stacks as graph inputs over three targets sharing one weights file."""
    assert_same_artifact(lora_case.artifact, _whole_model_export(lora_case.checkpoint, tmp_path / "whole",
                                                                 **LORA_EXPORT))


# --------------------------------------------------------------------------- preflight


@pytest.mark.parametrize("short", ["memory", "disk"])
def test_preflight_refuses_in_one_line_and_writes_nothing(tiny, tmp_path, monkeypatch, capsys, short):
    """A machine too small for the export (memory, or the output's disk) is one error line naming the
    figures and the remedy, exit status 2, and no output directory."""
    import shutil

    from graphkiln.cli import main
    from graphkiln.export import preflight

    case = tiny("llama_gqa_bias")
    checkpoint = case.checkpoint
    if short == "memory":  # sparse shards claiming a layer of 1.5x the memory available (no mock)
        checkpoint = checkpoint_claiming_a_huge_layer(case.checkpoint, tmp_path / "huge")
    else:
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    from cli_contract import assert_one_error

    out = tmp_path / "out"
    code = main(["export", str(checkpoint), "-o", str(out), "--max-seq-len", str(MAX_SEQ_LEN)])
    needles = ("GiB of memory", "--dtype fp16") if short == "memory" else ("no space left", "--quant int4", "--output")
    assert_one_error(code, capsys.readouterr().err, *needles)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name not in ("out", "huge")]


def _estimate(checkpoint, **options):
    from graphkiln.export import preflight
    from graphkiln.export.layer_stamping import template_layers
    from graphkiln.export.pipeline import ExportOptions
    from graphkiln.models.config import architecture_of
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import CheckpointWeights, meta_decoder, read_config

    raw = read_config(checkpoint)
    family = family_for(architecture_of(raw))
    cfg = family.parse_config(raw)
    weights = CheckpointWeights(checkpoint, family, cfg, "fp32")
    try:
        return preflight.estimate(meta_decoder(cfg), ExportOptions(**options), ("onnxruntime",), template_layers(cfg),
                                  weights)
    finally:
        weights.close()


def test_preflight_counts_what_stages_and_vision_towers_hold(tmp_path):
    """The estimate covers every path's resident layers: a pipeline stage's layers are all read for its
    trace (not one layer of each kind), and a vision tower is loaded whole."""
    import math

    from conftest import VLM_SPECS
    from graphkiln.models.weights import tensor_headers

    from graphkiln.models.config import architecture_of
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import meta_decoder, read_config

    ckpt = build_checkpoint(SPECS["lfm2"], tmp_path / "lfm2")  # 4 layers, conv and attention
    raw = read_config(ckpt)
    decoder = meta_decoder(family_for(architecture_of(raw)).parse_config(raw))
    size = [sum(p.numel() * 4 for p in layer.parameters()) for layer in decoder.model.layers]
    plain = _estimate(ckpt)
    assert plain.template < sum(size)  # one layer of each kind
    for options, stage in (({"stage_layers": "0:3,3:4"}, sum(size[:3])), ({"stage_layers": "0:1,1:4"}, sum(size[1:])),
                           ({"stages": 2}, min(sum(size), -(-sum(size) // 2) + max(size)))):
        assert _estimate(ckpt, **options).template == max(plain.template, stage) > plain.template, options
    from graphkiln.export.layer_stamping import template_layers

    vlm = build_checkpoint(VLM_SPECS["llava_clip"], tmp_path / "llava")
    raw = read_config(vlm)
    cfg = family_for(architecture_of(raw)).parse_config(raw)
    text = sum(p.numel() * 4 for i in template_layers(cfg) for p in meta_decoder(cfg).model.layers[i].parameters())
    tower = sum(math.prod(h["shape"]) for n, h in tensor_headers(vlm).items() if "vision" in n or "projector" in n)
    assert _estimate(vlm).template >= text + tower * 4 > text
