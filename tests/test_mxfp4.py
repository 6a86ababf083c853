"""gpt-oss checkpoints in the Hub's MXFP4 form (models.mxfp4): exported directly, experts as
onnxruntime QMoE blocks (int8 exact, int4 approximate), against transformers loading the same
checkpoint with ``Mxfp4Config(dequantize=True)`` in fp32; malformed MXFP4 tensors refused in one line.

The tiny gpt-oss (tests/conftest.py's ``gpt_oss`` spec) has its experts packed to MXFP4 here, as the
Hub's checkpoints store them: ``*_blocks`` [E, out, in/32, 16] (low nibble first), ``*_scales``
[E, out, in/32] (E8M0), gate and up rows alternating.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import MAX_SEQ_LEN, SPECS, build_checkpoint
from reference import forward_logits, greedy

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def pack_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float [..., out, in] -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32]):
    each block's power of two puts its largest magnitude at most 6, values rounded to the nearest E2M1."""
    *lead, k = w.shape
    b = w.reshape(*lead, k // 32, 32).astype(np.float32)
    amax = np.abs(b).max(-1, keepdims=True)
    exp = np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)).astype(np.int32)
    x = np.abs(b) / np.ldexp(np.float32(1), exp)
    mag = np.abs(x[..., None] - E2M1).argmin(-1).astype(np.uint8)
    codes = mag | ((b < 0) & (mag > 0)).astype(np.uint8) << 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exp[..., 0] + 127).astype(np.uint8)


def mxfp4_checkpoint(src: Path, out: Path) -> Path:
    """``src`` (a float gpt-oss checkpoint) with its experts as MXFP4, as the Hub stores them."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    for shard in out.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            w = tensors.pop(name).float().numpy().swapaxes(-1, -2)  # x @ W [E, in, out] -> [E, out, in]
            blocks, scales = pack_mxfp4(w)
            tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
            tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        save_file(tensors, str(shard), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mxfp4")
    # 4 layers: two of each kind, so the export stamps layers from a template and streams the rest
    # (the path a real checkpoint takes; with every layer a template the export traces them all)
    spec = dataclasses.replace(SPECS["gpt_oss"], config={**SPECS["gpt_oss"].config, "num_hidden_layers": 4})
    return mxfp4_checkpoint(build_checkpoint(spec, root / "float"), root / "mxfp4")


@pytest.fixture(scope="module")
def reference(mxfp4):
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    model = AutoModelForCausalLM.from_pretrained(str(mxfp4), dtype=torch.float32,
                                                 quantization_config=Mxfp4Config(dequantize=True)).eval()
    # transformers says it dequantizes to bf16 on CPU: the MXFP4 values are exact in bf16; compute in fp32
    model.float()
    assert model.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    return model


def _export(ckpt: Path, out: Path, expert_quant: str, quant: str | None = None):
    from graphkiln.export.pipeline import ExportOptions, export_model

    return export_model(str(ckpt), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, quant=quant,
                                                      expert_quant=expert_quant, quant_method="rtn"))


@pytest.fixture(scope="module")
def artifacts(mxfp4, tmp_path_factory):
    """The experts as QMoE int8 and int4 blocks, everything else float (fp32): the experts' error alone."""
    root = tmp_path_factory.mktemp("mxfp4-artifacts")
    return {q: (_export(mxfp4, root / q, q), root / q) for q in ("int8", "int4")}


def _greedy(n):
    from graphkiln.runtime import GenerationConfig

    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=())  # exactly n tokens, as greedy()


PROMPT = [5, 17, 42, 99, 7, 230, 64, 3, 150, 12]


def test_experts_become_qmoe_blocks(artifacts):
    import onnx

    for quant, (manifest, art) in artifacts.items():
        graph = onnx.load(str(art / manifest.graphs[0].file), load_external_data=False).graph
        ops = [n.op_type for n in graph.node]
        assert ops.count("QMoE") == 4 and "MoE" not in ops, quant
        bits = {a.name: a.i for n in graph.node if n.op_type == "QMoE" for a in n.attribute}["expert_weight_bits"]
        assert bits == {"int8": 8, "int4": 4}[quant]
        # no float expert weights anywhere in the artifact
        assert not [t.name for t in graph.initializer if t.name.endswith(("experts.gate_up", "experts.down"))]


def test_int8_greedy_equals_dequantized_transformers(artifacts, reference):
    from graphkiln.runtime import Engine

    manifest, art = artifacts["int8"]
    got = Engine.load(art).generate([PROMPT], _greedy(12))[0].token_ids
    want, _ = greedy(reference, PROMPT, 12)
    assert list(got) == want


# The experts' error alone (everything else fp32) on this tiny model, whose logits move by 1.6 when
# its float experts are packed to MXFP4 at all: int8 blocks are the MXFP4 values exactly but the
# kernel quantizes activations to int8 (measured 0.084); int4 blocks hold E2M1 values approximately
# (models.mxfp4.STEPS_INT4; measured 0.55).
INT4_LOGITS_ATOL = 0.8
INT8_LOGITS_ATOL = 0.15


@pytest.mark.parametrize("quant, atol", [("int8", INT8_LOGITS_ATOL), ("int4", INT4_LOGITS_ATOL)])
def test_prompt_logits_near_dequantized_transformers(artifacts, reference, quant, atol):
    from graphkiln.runtime import Engine

    manifest, art = artifacts[quant]
    ours = Engine.load(art).prompt_logits([PROMPT])[0]
    ref = forward_logits(reference, PROMPT)
    err = float(np.abs(np.asarray(ours) - ref).max())
    print(f"{quant}: max |logits - reference| {err:.4f} (reference spread {float(np.abs(ref).max()):.2f})")
    assert err <= atol


def test_requantized_blocks_against_mxfp4_values():
    """int8 blocks are the MXFP4 values exactly; int4's error is bounded (and measured in docs)."""
    from graphkiln.models.mxfp4 import HALVES, dequantize, requantize, requantized_values

    rng = np.random.default_rng(0)
    halves = HALVES[rng.integers(0, 16, (64, 128))]
    scales = rng.integers(100, 140, (64, 4)).astype(np.uint8)
    exact = dequantize(halves, scales)
    q8, s8 = requantize(halves, scales, 8)
    assert np.array_equal(requantized_values(q8, s8, 8), exact)
    q4, s4 = requantize(halves, scales, 4)
    err = requantized_values(q4, s4, 4) - exact
    rel = np.sqrt(np.square(err).sum() / np.square(exact).sum())
    assert 0 < rel < 0.2, rel


@pytest.mark.parametrize("damage, message", [
    ("drop_scales", "has no 'model.layers.0.mlp.experts.gate_up_proj_scales' beside it"),
    ("drop_blocks", "has no 'model.layers.1.mlp.experts.down_proj_blocks' beside it"),
    ("float_blocks", "is stored as F32, not U8"),
    ("short_scales", "do not pair"),
    ("nan_scale", "out of range"),
    ("wrong_shape", "but config.json implies"),
])
def test_malformed_mxfp4_is_one_line(mxfp4, tmp_path, damage, message):
    import torch
    from safetensors.torch import load_file, save_file

    from graphkiln.errors import GraphkilnError

    ckpt = tmp_path / "ckpt"
    shutil.copytree(mxfp4, ckpt)
    (shard,) = ckpt.glob("*.safetensors")
    t = load_file(str(shard))
    if damage == "drop_scales":
        del t["model.layers.0.mlp.experts.gate_up_proj_scales"]
    elif damage == "drop_blocks":
        del t["model.layers.1.mlp.experts.down_proj_blocks"]
    elif damage == "float_blocks":
        t["model.layers.0.mlp.experts.down_proj_blocks"] = t["model.layers.0.mlp.experts.down_proj_blocks"].float()
    elif damage == "short_scales":
        t["model.layers.0.mlp.experts.down_proj_scales"] = t["model.layers.0.mlp.experts.down_proj_scales"][:, :-1].contiguous()
    elif damage == "nan_scale":
        t["model.layers.1.mlp.experts.gate_up_proj_scales"][0, 0, 0] = 255
    elif damage == "wrong_shape":  # blocks and scales agree with each other, not with config.json
        for half in ("blocks", "scales"):
            name = f"model.layers.0.mlp.experts.down_proj_{half}"
            t[name] = t[name][:, :-1].contiguous()
    save_file(t, str(shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(GraphkilnError) as err:
        _export(ckpt, out, "int8", quant="int8")
    text = str(err.value)
    assert message in text and "\n" not in text, text
    assert not out.exists()
