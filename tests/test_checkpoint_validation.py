"""A checkpoint is untrusted input: export refuses what would make a wrong, broken or unsafe
artifact, with one ``error:`` line, exit status 2, no traceback and nothing written.

Classes swept here (issue 10): non-finite weights (found while the data file is streamed),
integer/bool tensors where float weights belong and stored quantization, ill-typed or
out-of-range config.json values, checkpoint tensors that nothing reads, wrong shapes on every
source path (plain, fused Cat, stacked experts), ``architectures`` that is not a list of
strings, checkpoint code (``auto_map``), malformed generation_config.json, block sizes
MatMulNBits does not accept, and a --max-seq-len the export cannot build.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cli_contract import assert_nothing_written, assert_one_error, export_fails, run_cli


# -- helpers (as in test_bad_input.py) ----------------------------------------------------------

def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text()) if path.exists() else {}
    for k, v in changes.items():
        if v is _DROP:
            d.pop(k, None)
        else:
            d[k] = v
    path.write_text(json.dumps(d))  # NaN is written as the NaN literal json.loads accepts


_DROP = object()


def edit_tensors(ckpt: Path, change) -> None:
    """Apply ``change(dict name -> numpy array)`` to a single-file checkpoint's tensors."""
    from safetensors.numpy import load_file, save_file

    f = ckpt / "model.safetensors"
    tensors = dict(load_file(f))
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})


@pytest.fixture
def out_dir(tmp_path) -> Path:
    return tmp_path / "outputs" / "artifact"


@pytest.fixture(scope="session")
def moe_case(tiny):
    return tiny("qwen3_moe")


# -- 1. non-finite weights ----------------------------------------------------------------------

VALUES = {"nan": np.nan, "+inf": np.inf, "-inf": -np.inf}


def _poison(name: str, value: float, index=(3, 5)):
    def change(tensors):
        t = tensors[name].copy()
        t[index[: t.ndim]] = value
        tensors[name] = t
    return change


# Every location with every value would be 15 exports; each value meets several kinds of weight
# (fused q/k/v, fused gate/up, down, embedding row, an RMSNorm weight small enough to stay inline
# in the graph, lm_head stored under an unnamed transposed initializer), and the writer's
# block check is swept value x dtype x layout below without exporting.
@pytest.mark.parametrize("tensor,value", [
    ("model.layers.1.self_attn.k_proj.weight", "nan"),
    ("model.layers.0.self_attn.o_proj.weight", "+inf"),
    ("model.layers.0.mlp.up_proj.weight", "-inf"),
    ("model.layers.1.mlp.down_proj.weight", "nan"),
    ("model.embed_tokens.weight", "+inf"),
    ("model.layers.1.post_attention_layernorm.weight", "-inf"),
    ("lm_head.weight", "nan"),
])
def test_non_finite_weight_is_refused_naming_it(llama_case, checkpoint_copy, out_dir, capsys, tensor, value):
    ckpt = checkpoint_copy(llama_case)
    edit_tensors(ckpt, _poison(tensor, VALUES[value]))
    kind = "NaN" if value == "nan" else "infinite"
    export_fails(capsys, ckpt, out_dir, f"'{tensor}'", f"has {kind} values")


def test_non_finite_weight_is_refused_naming_it_when_quantizing(llama_case, checkpoint_copy, out_dir, capsys):
    """A streamed quantized export reads each weight only as it quantizes it, inside the lowering
    (export.streamed_weights): the NaN is still named as the checkpoint's tensor."""
    ckpt = checkpoint_copy(llama_case)
    tensor = "model.layers.1.mlp.down_proj.weight"
    edit_tensors(ckpt, _poison(tensor, np.nan))
    export_fails(capsys, ckpt, out_dir, f"'{tensor}'", "has NaN values", extra=("--quant", "int4"))


@pytest.mark.parametrize("value", ["nan"])  # infinities: the dense cases above (same check)
def test_non_finite_expert_weight_is_refused_naming_it(moe_case, checkpoint_copy, out_dir, capsys, value):
    ckpt = checkpoint_copy(moe_case)
    tensor = "model.layers.2.mlp.experts.5.down_proj.weight"
    edit_tensors(ckpt, _poison(tensor, VALUES[value]))
    export_fails(capsys, ckpt, out_dir, f"'{tensor}'", "nan" if value == "nan" else "infinite")


def test_values_that_overflow_fp16_are_refused(llama_case, checkpoint_copy, out_dir, capsys):
    ckpt = checkpoint_copy(llama_case)
    edit_tensors(ckpt, _poison("model.layers.0.mlp.gate_proj.weight", 1e6))
    export_fails(capsys, ckpt, out_dir, "'model.layers.0.mlp.gate_proj.weight'", "too large for --dtype fp16",
                 extra=("--dtype", "fp16"))


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "inline"])
@pytest.mark.parametrize("value", list(VALUES))
def test_writer_checks_every_block(tmp_path, monkeypatch, dtype, layout, value):
    """save_model's streaming check, on every path a tensor takes through the writer (blocks of a
    contiguous tensor, bands of a transposed one, small tensors left in the graph), with the bad
    value in the last block so a check of the first block only would miss it."""
    import ml_dtypes
    import onnx_ir as ir

    from graphkiln.export import external_data

    monkeypatch.setattr(external_data, "_BLOCK", 256)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    shape = (4, 8) if layout == "inline" else (64, 48)
    good = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    bad = good.copy()
    bad[-1, -1] = VALUES[value]

    def model_of(arr):
        arr = arr.astype(np_dtype)
        arr = arr.T if layout == "transposed" else arr
        value_ = ir.Value(name="w", const_value=ir.Tensor(arr, name="w"), shape=ir.Shape(arr.shape),
                          type=ir.TensorType(ir.Tensor(arr).dtype))
        graph = ir.Graph([], [], nodes=[], initializers=[value_], opset_imports={"": 21}, name="g")
        return ir.Model(graph, ir_version=10)

    external_data.save_model(model_of(good), tmp_path / "good.onnx")
    with pytest.raises(external_data.NonFiniteWeight) as exc:
        external_data.save_model(model_of(bad), tmp_path / "bad.onnx")
    assert exc.value.initializer == "w"


# -- 2. integer / bool tensors, stored quantization ---------------------------------------------

@pytest.mark.parametrize("dtype,stored", [("int8", "I8"), ("int32", "I32"), ("int64", "I64"), ("uint8", "U8"),
                                          ("bool", "BOOL")])
@pytest.mark.parametrize("tensor", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.v_proj.weight"])
def test_integer_or_bool_weights_are_refused(llama_case, checkpoint_copy, out_dir, capsys, dtype, stored, tensor):
    ckpt = checkpoint_copy(llama_case)

    def change(tensors):
        tensors[tensor] = (tensors[tensor] > 0) if dtype == "bool" else (tensors[tensor] * 10).astype(dtype)

    edit_tensors(ckpt, change)
    export_fails(capsys, ckpt, out_dir, f"'{tensor}'", f"stored as {stored}", "not as a float type")


def test_float64_weights_are_converted(llama_case, checkpoint_copy):
    import torch

    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import check_checkpoint, load_decoder, read_config

    ckpt = checkpoint_copy(llama_case)
    name = "model.layers.0.mlp.down_proj.weight"
    edit_tensors(ckpt, lambda t: t.__setitem__(name, t[name].astype(np.float64)))
    raw = read_config(ckpt)
    family = family_for(raw["architectures"][0])
    cfg = family.parse_config(raw)
    check_checkpoint(ckpt, family, cfg)
    decoder = load_decoder(ckpt, family, cfg, "fp32", progress=False)
    w = decoder.model.layers[0].mlp.down_proj.weight
    assert w.dtype == torch.float32
    ref = load_decoder(llama_case.checkpoint, family, cfg, "fp32", progress=False).model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(w, ref)


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq"])
def test_quantized_checkpoints_are_refused(llama_case, checkpoint_copy, out_dir, capsys, method):
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", quantization_config={"quant_method": method, "bits": 4})
    export_fails(capsys, ckpt, out_dir, f"quantized checkpoints (quant_method '{method}') are not supported",
                 "use --quant")


@pytest.mark.parametrize("method, needle", [("gptq", "no checkpoint tensor is a '*.qweight'"),
                                            ("awq", "no checkpoint tensor is a '*.qweight'"),
                                            ("compressed-tensors", "'config_groups' is missing"),
                                            ("fp8", "no checkpoint tensor is a '*.weight_scale_inv'")])
def test_convertible_quant_methods_without_their_tensors_are_refused(llama_case, checkpoint_copy, out_dir, capsys,
                                                                     method, needle):
    """A config.json claiming a method graphkiln converts (tests/test_hf_quantized.py) over float weights."""
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", quantization_config={"quant_method": method, "bits": 4})
    export_fails(capsys, ckpt, out_dir, needle)


# -- 3. ill-typed config values -----------------------------------------------------------------

BAD_SIZES = [0, -4, 2.5, True, "4"]


def _config_cases():
    cases = []
    for v in [True, 2.7, "2", -1, 0, None]:
        cases.append(("llama", {"num_hidden_layers": v}, "num_hidden_layers"))
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
                "head_dim", "max_position_embeddings"):
        for v in BAD_SIZES:
            cases.append(("llama", {key: v}, key))
    for v in [-1e-6, "1e-6", math.nan, True]:
        cases.append(("llama", {"rms_norm_eps": v}, "rms_norm_eps"))
    for v in [0, -10000.0, "10000", math.inf]:
        cases.append(("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": v}}, "rope_theta"))
        cases.append(("llama", {"rope_parameters": None, "rope_theta": v}, "rope_theta"))
    for v in ["false", 0, 1, "yes"]:
        cases.append(("llama", {"tie_word_embeddings": v}, "tie_word_embeddings"))
    for v in ["true", 1]:
        cases.append(("llama", {"attention_bias": v}, "attention_bias"))
    cases.append(("llama", {"hidden_act": 3}, "hidden_act"))
    # families that read more keys, on the same checkpoint: config errors come before the weights
    for v in [-8, 0, 4.5, "8", True]:
        cases.append(("llama", {"architectures": ["MistralForCausalLM"], "sliding_window": v}, "sliding_window"))
        cases.append(("llama", {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": True,
                                "sliding_window": v}, "sliding_window"))
    cases.append(("llama", {"architectures": ["Qwen3ForCausalLM"], "use_sliding_window": "yes"}, "use_sliding_window"))
    cases.append(("llama", {"architectures": ["Qwen3ForCausalLM"],
                            "layer_types": ["full_attention", "linear_attention"]}, "layer_types"))
    cases.append(("llama", {"architectures": ["Qwen3ForCausalLM"], "layer_types": ["full_attention"]}, "layer_types"))
    cases.append(("llama", {"architectures": ["Lfm2ForCausalLM"], "conv_L_cache": 1}, "conv_L_cache"))
    cases.append(("llama", {"architectures": ["Lfm2ForCausalLM"], "full_attn_idxs": [0, 5]}, "full_attn_idxs"))
    cases.append(("llama", {"architectures": ["MixtralForCausalLM"], "num_local_experts": 2,
                            "num_experts_per_tok": 3}, "num_experts_per_tok"))
    cases.append(("llama", {"architectures": ["MixtralForCausalLM"], "num_local_experts": 2.0}, "num_local_experts"))
    # the tiny Qwen3-MoE config says num_local_experts (transformers 5's spelling)
    for key, v in [("num_local_experts", -1), ("num_local_experts", 2.5), ("num_local_experts", "8"),
                   ("num_experts", -1), ("num_experts", True), ("num_experts_per_tok", 9),
                   ("num_experts_per_tok", 0), ("moe_intermediate_size", 0), ("norm_topk_prob", "no"),
                   ("decoder_sparse_step", 0), ("mlp_only_layers", [7]), ("mlp_only_layers", "1")]:
        cases.append(("moe", {key: v}, key))
    return cases


CONFIG_CASES = _config_cases()


@pytest.mark.parametrize("which,changes,key", CONFIG_CASES,
                         ids=[f"{w}-{json.dumps(c, allow_nan=True)[:70]}" for w, c, _ in CONFIG_CASES])
def test_ill_typed_config_values_are_refused(llama_case, moe_case, checkpoint_copy, out_dir, capsys, which,
                                             changes, key):
    ckpt = checkpoint_copy(llama_case if which == "llama" else moe_case)
    edit_json(ckpt / "config.json", **{k: (_DROP if v is None else v) for k, v in changes.items()})
    export_fails(capsys, ckpt, out_dir, "config.json", key)


@pytest.mark.parametrize("value,bad", [(2.7, "2.7"), (True, "true"), ("2", '"2"'), (0, "0"), (-1, "-1")])
def test_config_error_names_key_value_and_fix(llama_case, checkpoint_copy, out_dir, capsys, value, bad):
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", num_hidden_layers=value)
    line = export_fails(capsys, ckpt, out_dir)
    assert line == (f"error: config.json: 'num_hidden_layers' is {bad}, expected a positive integer: "
                    "fix config.json")


# -- 4. tensors nothing reads; shapes on every source path --------------------------------------

def test_fewer_layers_than_the_checkpoint_is_refused(llama_case, checkpoint_copy, out_dir, capsys):
    from safetensors import safe_open

    ckpt = checkpoint_copy(llama_case)
    with safe_open(str(ckpt / "model.safetensors"), "np") as f:
        layer1 = sorted(k for k in f.keys() if k.startswith("model.layers.1."))
    edit_json(ckpt / "config.json", num_hidden_layers=1)
    export_fails(capsys, ckpt, out_dir, f"{len(layer1)} tensors that nothing reads", f"'{layer1[0]}'")


@pytest.mark.parametrize("arch,first", [
    ("MistralForCausalLM", "model.layers.0.mlp.down_proj.bias"),  # Llama's biases: Mistral has none
    ("Qwen2ForCausalLM", "model.layers.0.mlp.down_proj.bias"),
])
def test_wrong_family_leaves_tensors_unread(llama_case, checkpoint_copy, out_dir, capsys, arch, first):
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", architectures=[arch])
    export_fails(capsys, ckpt, out_dir, "nothing reads", f"'{first}'")


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.extra_proj.weight", "vision_tower.patch_embed.weight",
                                   "model.layers.5.mlp.up_proj.weight"])
def test_extra_tensor_is_refused(llama_case, checkpoint_copy, out_dir, capsys, extra):
    ckpt = checkpoint_copy(llama_case)
    edit_tensors(ckpt, lambda t: t.__setitem__(extra, np.zeros((4, 4), np.float32)))
    export_fails(capsys, ckpt, out_dir, "1 tensor that nothing reads", f"'{extra}'")


@pytest.mark.parametrize("which,extra", [
    ("llama", "model.layers.0.self_attn.rotary_emb.inv_freq"),
    ("llama", "model.layers.1.self_attn.rotary_emb.inv_freq"),
    ("llama", "model.position_ids"),
    ("tied", "lm_head.weight"),  # transformers ties it to the embedding and ignores the stored copy
])
def test_ignorable_tensors_are_accepted(llama_case, tok_case, checkpoint_copy, which, extra):
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import check_checkpoint, read_config

    case = llama_case if which == "llama" else tok_case
    ckpt = checkpoint_copy(case)
    edit_tensors(ckpt, lambda t: t.__setitem__(extra, np.zeros((8,), np.float32)))
    raw = read_config(ckpt)
    family = family_for(raw["architectures"][0])
    check_checkpoint(ckpt, family, family.parse_config(raw))


@pytest.mark.parametrize("which,tensor,shape,expected", [
    ("llama", "model.layers.0.self_attn.k_proj.weight", (24, 64), (32, 64)),  # fused q/k/v (Cat with sizes)
    ("llama", "model.layers.1.self_attn.q_proj.bias", (60,), (64,)),
    ("llama", "model.layers.0.mlp.gate_proj.weight", (128, 60), (128, 64)),  # fused gate/up
    ("llama", "model.layers.0.mlp.down_proj.weight", (64, 100), (64, 128)),
    ("llama", "model.embed_tokens.weight", (300, 64), (320, 64)),
    ("llama", "model.layers.1.input_layernorm.weight", (32,), (64,)),
    ("moe", "model.layers.2.mlp.experts.6.up_proj.weight", (16, 64), (32, 64)),  # stacked experts
    ("moe", "model.layers.0.mlp.experts.1.down_proj.weight", (64, 30), (64, 32)),
    ("moe", "model.layers.0.mlp.gate.weight", (7, 64), (8, 64)),
])
def test_wrong_shape_names_tensor_and_shapes(llama_case, moe_case, checkpoint_copy, out_dir, capsys, which, tensor,
                                             shape, expected):
    ckpt = checkpoint_copy(llama_case if which == "llama" else moe_case)
    edit_tensors(ckpt, lambda t: t.__setitem__(tensor, np.zeros(shape, np.float32)))
    export_fails(capsys, ckpt, out_dir, f"'{tensor}'", f"has shape {shape}", f"implies {expected}")


# -- 5. architectures must be a list of strings -------------------------------------------------

@pytest.mark.parametrize("value", ["LlamaForCausalLM", ["LlamaForCausalLM", 3], [3], [None], {"0": "Llama"}, [""]])
def test_architectures_must_be_a_list_of_strings(llama_case, checkpoint_copy, out_dir, capsys, value):
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", architectures=value)
    line = export_fails(capsys, ckpt, out_dir, "'architectures' must be a list of strings")
    assert "'L'" not in line


# -- 6. checkpoint code (auto_map) --------------------------------------------------------------

AUTO_MAP = {"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel",
            "AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_auto_map_is_refused_without_prompting(tok_case, checkpoint_copy, out_dir, capsys, monkeypatch, file):
    import io

    ckpt = checkpoint_copy(tok_case)
    edit_json(ckpt / file, auto_map=AUTO_MAP)
    (ckpt / "modeling_evil.py").write_text("raise SystemExit('checkpoint code ran')\n")
    monkeypatch.setattr(sys, "stdin", io.StringIO("y\n"))  # an answer, were anything to ask
    code, out, err = run_cli(capsys, "export", ckpt, "-o", out_dir)
    assert_one_error(code, err, "checkpoint needs its own Python code", f"auto_map in {file}",
                     "graphkiln does not run checkpoint code")
    assert "[y/N]" not in out + err and "trust_remote_code" not in out + err
    assert sys.stdin.read() == "y\n", "something read stdin"
    assert_nothing_written(out_dir)


def test_auto_map_in_a_real_process_with_stdin_closed(llama_case, checkpoint_copy, tmp_path):
    ckpt = checkpoint_copy(llama_case)
    edit_json(ckpt / "config.json", auto_map=AUTO_MAP)
    out = tmp_path / "outputs" / "artifact"
    proc = subprocess.run([sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(out)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [l for l in proc.stderr.splitlines() if l.startswith("error:")]
    assert len(proc.stderr.splitlines()) == 1 and "auto_map" in proc.stderr
    assert_nothing_written(out)


# -- 7. generation_config.json ------------------------------------------------------------------

GEN_CASES = [
    (b'{"eos_token_id": 2,', "generation_config.json", "not valid JSON"),
    (b'\xff\xfe binary', "generation_config.json", "not UTF-8"),
    (b'[2]', "generation_config.json", "not a JSON object"),
    (b'"eos"', "generation_config.json", "not a JSON object"),
] + [
    (json.dumps({key: value}).encode(), "generation_config.json", key) for key, value in [
        ("eos_token_id", "2"), ("eos_token_id", 2.5), ("eos_token_id", -1), ("eos_token_id", ["a", "b"]),
        ("eos_token_id", [2, True]), ("eos_token_id", 320), ("eos_token_id", [2, 10**6]),
        ("bos_token_id", 999), ("bos_token_id", "1"), ("bos_token_id", -2),
        ("temperature", -0.5), ("temperature", math.nan), ("temperature", "0.7"), ("temperature", math.inf),
        ("top_p", 1.5), ("top_p", 0), ("top_p", -0.1), ("top_k", -1), ("top_k", 2.5),
        ("max_new_tokens", -5), ("max_new_tokens", 10.5), ("do_sample", "yes"), ("pad_token_id", "0"),
    ]
]


@pytest.mark.parametrize("content,file,needle", GEN_CASES, ids=[c[:40].decode("latin-1") for c, _, _ in GEN_CASES])
def test_malformed_generation_config_is_refused(llama_case, checkpoint_copy, out_dir, capsys, content, file, needle):
    ckpt = checkpoint_copy(llama_case)
    (ckpt / "generation_config.json").write_bytes(content)
    export_fails(capsys, ckpt, out_dir, file, needle)


@pytest.mark.parametrize("key,value", [("eos_token_id", 320), ("bos_token_id", -1), ("eos_token_id", [1, "x"])])
def test_bad_token_ids_in_config_json_name_config_json(llama_case, checkpoint_copy, out_dir, capsys, key, value):
    ckpt = checkpoint_copy(llama_case)
    (ckpt / "generation_config.json").unlink()
    edit_json(ckpt / "config.json", **{key: value})
    export_fails(capsys, ckpt, out_dir, "config.json", key)


@pytest.mark.parametrize("source", ["generation_config.json", "config.json"])
@pytest.mark.parametrize("pad", [320, 10**6, -1])
def test_unusable_pad_id_is_dropped_with_a_note(llama_case, checkpoint_copy, source, pad):
    from graphkiln.export.assets import generation_defaults

    ckpt = checkpoint_copy(llama_case)
    raw = json.loads((ckpt / "config.json").read_text())
    if source == "config.json":
        raw["pad_token_id"] = pad
    else:
        edit_json(ckpt / "generation_config.json", pad_token_id=pad)
    notes = []
    gen = generation_defaults(ckpt, raw, 320, note=notes.append)
    assert gen.pad_token_id is None
    assert len(notes) == 1 and f"pad_token_id {pad}" in notes[0] and source in notes[0]
    raw["pad_token_id"] = 5
    (ckpt / "generation_config.json").unlink()
    assert generation_defaults(ckpt, raw, 320, note=notes.append).pad_token_id == 5


# -- 8. --quant-block-size, --max-seq-len ---------------------------------------------------------

@pytest.mark.parametrize("size", [8, 24, 48, 100, 512, 1024, 0, -32])
def test_unsupported_quant_block_size_fails_before_any_work(llama_case, out_dir, capsys, size):
    line = export_fails(capsys, llama_case.checkpoint, out_dir, f"--quant-block-size {size}",
                        "16, 32, 64, 128, 256", extra=("--quant", "int4", "--quant-block-size", size))
    assert "[1/4]" not in capsys.readouterr().err + line


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [8, 16, 24, 32, 48, 64, 128, 256, 512])
def test_matmul_nbits_block_sizes_are_what_onnxruntime_accepts(bits, block):
    """The allowed set is measured, not assumed: a block size is accepted exactly when
    onnxruntime's quantizer and CPU MatMulNBits kernel both take it and compute the product."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from graphkiln.export.block_quant import quantize_blocks
    from graphkiln.export.lowering.quantize import block_size_ok, dequantize_reference, pack_blocks

    k, n = 512, 16
    rng = np.random.default_rng(block)
    w, x = rng.standard_normal((k, n)).astype(np.float32), rng.standard_normal((2, k)).astype(np.float32)
    try:
        q, scales, _ = pack_blocks(quantize_blocks(np.ascontiguousarray(w.T), bits, block), np.float32)
        node = helper.make_node("MatMulNBits", ["A", "B", "S"], ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                                block_size=block, accuracy_level=0)
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, k])],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, n])],
                                  [numpy_helper.from_array(q, "B"), numpy_helper.from_array(scales, "S")])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                        helper.make_opsetid("com.microsoft", 1)], ir_version=10)
        so = ort.SessionOptions()
        so.log_severity_level = 4
        y = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, {"A": x})[0]
        works = np.allclose(y, x @ dequantize_reference(q, scales, None, k, bits), atol=1e-3)
    except Exception:
        works = False
    # every size graphkiln offers works; sizes the kernel refuses are refused (512 works in the kernel
    # but is not offered: nothing else here has been measured with it)
    if block_size_ok(block):
        assert works
    if block < 16 or block & (block - 1):  # the kernel takes powers of two from 16 only
        assert not works and not block_size_ok(block)


@pytest.mark.parametrize("value,needle", [(str(10**12), "too large"), (str(2**31), "too large"),
                                          (str(2**31 - 1), "GiB for rotary tables")])
def test_max_seq_len_the_export_cannot_build(llama_case, out_dir, capsys, value, needle):
    from graphkiln.memory import available_memory

    if needle.startswith("GiB") and (available_memory() or 0) > 2**38:
        pytest.skip("this machine could build 128 GiB of rotary tables")
    export_fails(capsys, llama_case.checkpoint, out_dir, f"--max-seq-len {value}", needle,
                 extra=("--max-seq-len", value))
