"""FP8 and NVFP4 Hugging Face checkpoints as export input (``graphkiln.models.hf_quantized.fp8`` /
``nvfp4``), kept quantized: their values become MatMulNBits integer blocks on conversion.

A tiny random Llama's Linear weights (lm_head included) are quantized here as the writers store
them: ``quant_method: fp8`` block-scaled e4m3 with ``weight_scale_inv`` over 64 x 64 tiles (k_proj
has 32 rows: a partial tile), compressed-tensors ``float-quantized`` per channel (``weight_scale``
``[N, 1]``), and ModelOpt NVFP4 (``hf_quant_config.json``; E2M1 pairs low nibble first, an e4m3
scale per 16, a per-tensor fp32 ``weight_scale_2``). The reference is transformers on a float
checkpoint of the stored values dequantized in this file (``weight * scale``); for the fp8 one,
transformers' own FP8 loader (``dequantize`` on CPU) is checked to read the same weights.

Checked: NVFP4 into int8 blocks of 16 is exact, so with fp32 activations (accuracy_level 0) the
artifact is the reference within 1e-4 and greedy tokens equal; FP8 into int8 blocks of 32 is the
nearest (the summary reports its error), prompt logits within a stated bound of the reference
(greedy paths of a tiny random model split at near-ties under that noise, as under int8
activations); ``--quant none`` gives the float artifact of the exact values, tokens equal; NVFP4
``--quant int4`` is the export's own int4 quantization of the stored values, within a wider bound; compressed-tensors FP8 per channel is checked at
conversion (its export is the fp8 layout's). Malformed checkpoints and formats not read are one
``error:`` line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cli_contract import export_fails

LAYERS, HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 2, 64, 128, 4, 2, 320
MAX_SEQ_LEN = 64
STEPS = 12
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
# FP8 into int8 blocks of 32 (nearest; weights' relative RMS error 5.4e-3) at accuracy_level 0: prompt
# logits vs the FP8 reference, RMS error over RMS spread, measured 0.021-0.022 (top-1 0.95-1.0): the
# size of int8 activations' noise on this random model (test_hf_quantized); a wrong model is ~1.4.
FP8_INT8_RMS = 0.06
# NVFP4's stored values quantized to int4 by the export (rtn, block 32), shipped (int8 activations):
# RMS error / RMS spread of the logits, measured 0.34 (top-1 0.53: the tiny random model's logits are
# near-flat, int4 round-to-nearest moves them); wrong weights (nibbles swapped) measure ~1.4.
NVFP4_INT4_RMS = 0.5


def _modules() -> list[str]:
    return [f"model.layers.{i}.{m}" for i in range(LAYERS) for m in LINEARS] + ["lm_head"]


@pytest.fixture(scope="module")
def base():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import _randomize_init_constants

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=MAX_SEQ_LEN, initializer_range=0.15, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(43)
    model = LlamaForCausalLM(config).eval()
    _randomize_init_constants(model, 43)
    return config, {k: v.detach().float() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- the writers' layouts


def fp8_tiles(w, bn: int, bk: int):
    """e4m3 values and one fp32 scale per bn x bk tile (ceil at the edges), amax / 448 as
    transformers' finegrained FP8 quantizer takes it: ``W ~ q * scale[n // bn, k // bk]``."""
    import torch

    n, k = w.shape
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.zeros(rows, cols)
    for i in range(rows):
        for j in range(cols):
            scale[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max() / 448
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return (w / full).to(torch.float8_e4m3fn), scale


def nvfp4(w):
    """ModelOpt's NVFP4: per-tensor scale2 = amax / (6 * 448); per 16 inputs an e4m3 scale of the
    block's amax / 6 / scale2; E2M1 codes (sign bit 3) of w / (scale * scale2), two a byte, the
    even input in the low nibble."""
    import torch

    n, k = w.shape
    s2 = (w.abs().max() / (6 * 448)).reshape(())
    blocks = w.reshape(n, k // 16, 16)
    s = (blocks.abs().amax(-1) / 6 / s2).to(torch.float8_e4m3fn)
    x = (blocks / (s.float() * s2)[..., None]).reshape(n, k).numpy()
    idx = np.abs(np.abs(x)[..., None] - E2M1).argmin(-1).astype(np.uint8) | ((x < 0) << 3).astype(np.uint8)
    packed = idx[:, 0::2] | (idx[:, 1::2] << 4)
    return torch.from_numpy(packed), s, s2.float()


def unpack_nvfp4(packed, s, s2):
    import torch

    codes = packed.numpy()
    lut = np.concatenate([E2M1, -E2M1])
    v = np.empty((codes.shape[0], codes.shape[1] * 2), np.float32)
    v[:, 0::2], v[:, 1::2] = lut[codes & 15], lut[codes >> 4]
    return torch.from_numpy(v) * (s.float() * s2).repeat_interleave(16, 1)


SCHEMES = ("fp8-block", "ct-fp8-channel", "nvfp4")


def _build(name: str, base, root: Path) -> tuple[Path, Path]:
    """(quantized checkpoint, reference float checkpoint of its dequantized values)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    config, state = base
    tensors = {k: v.to(torch.bfloat16) for k, v in state.items() if k.removesuffix(".weight") not in _modules()}
    ref = {k: v.float() for k, v in tensors.items()}
    for m in _modules():
        w = state[f"{m}.weight"]
        if name == "fp8-block":
            q, scale = fp8_tiles(w, 64, 64)
            tensors.update({f"{m}.weight": q, f"{m}.weight_scale_inv": scale})
            ref[f"{m}.weight"] = q.float() * scale.repeat_interleave(64, 0)[:w.shape[0]].repeat_interleave(64, 1)[:, :w.shape[1]]
        elif name == "ct-fp8-channel":
            q, scale = fp8_tiles(w, 1, w.shape[1])
            tensors.update({f"{m}.weight": q, f"{m}.weight_scale": scale.to(torch.bfloat16),
                            f"{m}.input_scale": torch.ones(1)})  # a static activation scale: dropped
            ref[f"{m}.weight"] = q.float() * scale.to(torch.bfloat16).float()
        else:
            packed, s, s2 = nvfp4(w)
            tensors.update({f"{m}.weight": packed, f"{m}.weight_scale": s, f"{m}.weight_scale_2": s2,
                            f"{m}.input_scale": torch.ones(())})
            ref[f"{m}.weight"] = unpack_nvfp4(packed, s, s2)
    reference = root / "reference"
    model = LlamaForCausalLM(config)
    model.load_state_dict(ref)
    model.save_pretrained(reference)
    q = root / "quantized"
    q.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(q / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((reference / "config.json").read_text())
    raw["dtype"] = "bfloat16"
    if name == "fp8-block":
        raw["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64],
                                      "activation_scheme": "dynamic"}
    elif name == "ct-fp8-channel":
        raw["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}},
            "ignore": [], "kv_cache_scheme": None}
    else:  # ModelOpt: config.json without quantization_config, hf_quant_config.json beside it
        (q / "hf_quant_config.json").write_text(json.dumps({
            "producer": {"name": "modelopt", "version": "0.29.0"},
            "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                             "exclude_modules": []}}))
    (q / "config.json").write_text(json.dumps(raw))
    (q / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return q, reference


@pytest.fixture(scope="module")
def built(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-nvfp4")
    cache: dict[str, tuple[Path, Path]] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _build(name, base, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def exported(built, tmp_path_factory):
    """(scheme, --quant or None) -> (quantized, reference, artifact, what the export said)."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    root = tmp_path_factory.mktemp("fp8-nvfp4-art")
    cache = {}

    def get(name: str, quant: str | None = None):
        key = (name, quant)
        if key not in cache:
            q, ref = built(name)
            art = root / f"{name}-{quant}"
            said = []
            import graphkiln.export.pipeline as pipeline

            real = pipeline._say
            pipeline._say = lambda opts, msg: said.append(msg)
            try:
                export_model(str(q), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, quant=quant,
                                                        quant_method="rtn"))
            finally:
                pipeline._say = real
            cache[key] = (q, ref, art, "\n".join(said))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(11)
    return [rng.integers(3, VOCAB, n).tolist() for n in (7, 12)]


def _reference_model(ref: Path, art: Path):
    """transformers on the reference checkpoint, its embedding the artifact's (which the export
    quantizes itself: the checkpoint stores it float)."""
    import torch
    from transformers import AutoModelForCausalLM

    from test_hf_quantized import _artifact_embedding_table

    model = AutoModelForCausalLM.from_pretrained(str(ref), dtype=torch.float32).eval()
    table = _artifact_embedding_table(art)
    if table is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(torch.from_numpy(table))
    return model


def _compare(engine, model, prompts, atol: float) -> float:
    """Prompt logits and greedy steps against transformers; returns the largest logit difference."""
    from graphkiln.runtime import GenerationConfig
    from reference import greedy

    worst = 0.0
    config = GenerationConfig(max_new_tokens=STEPS, do_sample=False, stop_token_ids=(), output_logits=True)
    for result, p in zip(engine.generate(prompts, config), prompts):
        tokens, logits = greedy(model, p, STEPS)
        assert result.token_ids == tokens
        worst = max(worst, float(np.abs(np.asarray(result.logits) - logits).max()))
    assert worst <= atol, worst
    return worst


def test_transformers_fp8_loader_reads_the_reference_weights(built):
    """The fp8 reference is what transformers' own FP8 loader computes on a CPU (dequantize)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    q, ref = built("fp8-block")
    loaded = AutoModelForCausalLM.from_pretrained(str(q), dtype=torch.float32).state_dict()
    for k, v in load_file(str(ref / "model.safetensors")).items():
        assert torch.equal(loaded[k].float(), v), k


def test_compressed_tensors_fp8_per_channel_converts(built, tmp_path):
    """compressed-tensors FP8 per channel (bf16 scales [N, 1], a static input_scale): the converted
    float weights are the stored values exactly, the int8 blocks of 32 within half a step (1/254 of
    a block's peak) of them, the activation scales dropped; the same layout's export path is the
    fp8 one's (test_artifact_computes_with_the_stored_values)."""
    from safetensors.torch import load_file

    from graphkiln.models.hf_quantized import convert_quantized_checkpoint

    q, ref = built("ct-fp8-channel")
    derived = convert_quantized_checkpoint(q, tmp_path / "converted")
    try:
        want = load_file(str(ref / "model.safetensors"))
        assert not any(n.endswith("input_scale") for n in [*derived.tensors, *derived.shards])
        assert "int8 blocks of 32" in derived.summary and "relative RMS" in derived.summary
        for m in _modules():
            w = want[f"{m}.weight"].numpy()
            np.testing.assert_array_equal(derived.read(f"{m}.weight"), w, err_msg=m)
            b = derived.tensors[f"{m}.weight"].blocks.make()
            assert (b.bits, b.block_size) == (8, 32)
            peak = np.abs(w).reshape(w.shape[0], -1, 32).max(-1).repeat(32, 1)
            assert (np.abs(b.dequantize() - w) <= peak / 254 * 1.001 + 1e-12).all(), m
    finally:
        derived.close()


@pytest.mark.parametrize("name, quant", [("nvfp4", None), ("fp8-block", None), ("fp8-block", "none")])
def test_artifact_computes_with_the_stored_values(name, quant, exported, prompts, tmp_path):
    """accuracy_level 0 (fp32 activations): NVFP4's int8 blocks and the float (--quant none) artifact
    are the reference within 1e-4; FP8's int8 blocks (nearest) within FP8_INT8_ATOL; greedy tokens
    equal. The blocks' summary line names their error."""
    from graphkiln.runtime import Engine
    from reference import ATOL
    from test_hf_quantized import _nbits, _with_accuracy_level

    q, ref, art, said = exported(name, quant)
    manifest = json.loads((art / "manifest.json").read_text())
    nbits = list(_nbits(art))
    if quant == "none":
        assert manifest["model"]["quant"] is None and not nbits
        engine = Engine.load(art)
    else:
        assert manifest["model"]["quant"] == "int8"
        linear = [n for n, attrs, *_ in nbits if attrs["K"] in (HIDDEN, INTERMEDIATE)]
        assert len(linear) == 4 * LAYERS + 1  # qkv, o, gate_up, down per layer, and lm_head: all blocks
        assert {attrs["block_size"] for _, attrs, *_ in nbits} == {16 if name == "nvfp4" else 32}
        engine = Engine.load(_with_accuracy_level(art, 0, tmp_path / "level0"))
    if name == "nvfp4":
        assert "every block exact" in said, said
    elif quant is None:
        assert "error against the stored values: relative RMS" in said, said
    model = _reference_model(ref, art)
    if name == "nvfp4" or quant == "none":
        _compare(engine, model, prompts, ATOL)
    else:  # nearest blocks: the tiny random model amplifies their error (greedy paths split at near-ties)
        rms, top1 = _logit_error(engine, model, prompts)
        assert rms <= FP8_INT8_RMS and top1 >= 0.8, (rms, top1)


def _logit_error(engine, model, prompts) -> tuple[float, float]:
    """Prompt logits against transformers: RMS error over the RMS spread, top-1 agreement."""
    from reference import forward_logits

    ours = np.concatenate(engine.prompt_logits(prompts))
    want = np.concatenate([forward_logits(model, p) for p in prompts])
    rms = float(np.sqrt(np.square(ours - want).sum() / np.square(want - want.mean(-1, keepdims=True)).sum()))
    top1 = float(np.mean(ours.argmax(-1) == want.argmax(-1)))
    return rms, top1


def test_nvfp4_int4_is_the_exports_own_quantization(exported, prompts):
    """--quant int4: int4 blocks cannot hold E2M1 x scale, so no blocks are offered and the export
    quantizes the stored values itself (here rtn, block 32); shipped (accuracy_level 4) logits
    within NVFP4_INT4_RMS of their spread."""
    from graphkiln.runtime import Engine
    from test_hf_quantized import _nbits

    q, ref, art, said = exported("nvfp4", "int4")
    assert "stored values quantized to int4 by the export's own quantizer" in said, said
    assert json.loads((art / "manifest.json").read_text())["model"]["quant_method"] == "rtn"  # not "+checkpoint"
    nbits = [attrs for _, attrs, *_ in _nbits(art) if attrs["K"] in (HIDDEN, INTERMEDIATE)]
    assert len(nbits) >= 4 * LAYERS + 1 and {(a["bits"], a["block_size"]) for a in nbits} == {(4, 32)}
    rms, top1 = _logit_error(Engine.load(art), _reference_model(ref, art), prompts)
    assert rms <= NVFP4_INT4_RMS and top1 >= 0.4, (rms, top1)


# --------------------------------------------------------------------------- refusals


def _variant(built, name: str, tmp_path: Path, config=None, tensors=None, modelopt=None) -> Path:
    import torch
    from safetensors.torch import load_file, save_file

    q, _ = built(name)
    out = tmp_path / "ckpt"
    shutil.copytree(q, out)
    if config:
        raw = json.loads((out / "config.json").read_text())
        raw["quantization_config"].update(config)
        (out / "config.json").write_text(json.dumps(raw))
    if modelopt:
        raw = json.loads((out / "hf_quant_config.json").read_text())
        raw["quantization"].update(modelopt)
        (out / "hf_quant_config.json").write_text(json.dumps(raw))
    if tensors:
        data = tensors(dict(load_file(str(out / "model.safetensors"))))
        save_file({k: v.contiguous() for k, v in data.items()}, str(out / "model.safetensors"))
    return out


def _set(name, fn):
    def f(t):
        t[name] = fn(t[name])
        return t
    return f


def _drop(name):
    def f(t):
        del t[name]
        return t
    return f


def _poke(value, dtype=None):
    def f(x):
        x = x.float().clone()
        x.view(-1)[3 % x.numel()] = value
        return x.to(dtype) if dtype is not None else x
    return f


_L = "model.layers.1."
REFUSALS = {
    "fp8-scale-shape": ("fp8-block", None, _set(_L + "mlp.up_proj.weight_scale_inv", lambda s: s[:1].clone()),
                        None, (_L + "mlp.up_proj.weight_scale_inv", "shape", "[2, 1]")),
    "fp8-scale-nan": ("fp8-block", None, _set(_L + "self_attn.o_proj.weight_scale_inv", _poke(float("nan"))), None,
                      (_L + "self_attn.o_proj.weight_scale_inv", "NaN")),
    "fp8-scale-negative": ("fp8-block", None, _set(_L + "mlp.down_proj.weight_scale_inv", _poke(-1.0)), None,
                           (_L + "mlp.down_proj.weight_scale_inv", "negative")),
    "fp8-scale-overflow": ("fp8-block", None, _set(_L + "mlp.down_proj.weight_scale_inv", _poke(3e38)), None,
                           (_L + "mlp.down_proj", "overflow")),
    "fp8-missing-scale": ("fp8-block", None, _drop(_L + "mlp.gate_proj.weight_scale_inv"), None,
                          (_L + "mlp.gate_proj.weight", "FP8", "missing half")),
    "fp8-block-size": ("fp8-block", {"weight_block_size": [0, 64]}, None, None, ("weight_block_size",)),
    "fp8-fmt": ("fp8-block", {"fmt": "e3m4"}, None, None, ("fmt 'e3m4'",)),
    "ct-fp8-strategy": ("ct-fp8-channel", {"config_groups": {"g": {"targets": ["Linear"], "format": "float-quantized",
                        "weights": {"num_bits": 8, "type": "float", "strategy": "token"}}}}, None, None,
                        ("strategy 'token'",)),
    "ct-fp8-ignored": ("ct-fp8-channel", {"ignore": ["re:.*down_proj"]}, None, None, ("down_proj", "ignore")),
    "nvfp4-missing-scale2": ("nvfp4", None, _drop(_L + "mlp.up_proj.weight_scale_2"), None,
                             (_L + "mlp.up_proj.weight", "weight_scale_2", "missing half")),
    "nvfp4-scale-shape": ("nvfp4", None, _set(_L + "mlp.up_proj.weight_scale", lambda s: s[:, :-1].clone()), None,
                          (_L + "mlp.up_proj.weight_scale", "shape", "[128, 4]")),
    "nvfp4-scale2-inf": ("nvfp4", None, _set(_L + "mlp.up_proj.weight_scale_2", _poke(float("inf"))), None,
                         (_L + "mlp.up_proj.weight_scale_2", "infinite")),
    "nvfp4-algo": ("nvfp4", None, None, {"quant_algo": "W4A8_AWQ"}, ("quant_algo 'W4A8_AWQ'", "NVFP4 and FP8")),
    "unknown-method": ("fp8-block", {"quant_method": "bitsandbytes"}, None, None,
                       ("quant_method 'bitsandbytes'", "modelopt (NVFP4, FP8)", "fp8 (block-scaled e4m3)")),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_refused_with_one_line(case, built, tmp_path, capsys):
    name, config, tensors, modelopt, needles = REFUSALS[case]
    ckpt = _variant(built, name, tmp_path, config, tensors, modelopt)
    before = sorted(p.name for p in ckpt.iterdir())
    export_fails(capsys, ckpt, tmp_path / "out" / "art", *needles)
    assert sorted(p.name for p in ckpt.iterdir()) == before
