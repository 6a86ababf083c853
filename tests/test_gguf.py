"""GGUF files as export input (graphkiln.models.gguf): ``graphkiln export model.gguf -o ART``.

A tiny random Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, untied head, a byte-level BPE
vocabulary of 400 with a chat template) is written as a GGUF the way llama.cpp's
convert_hf_to_gguf.py writes one (attn_q / attn_k rows permuted, F32 norms) in a mix of tensor
types: Q4_0 and Q8_0 (which map onto MatMulNBits exactly), Q4_1 (which does not), F16.

Checked: the converted checkpoint is bit for bit what transformers' GGUF loader loads (weights,
config, tokenizer, chat template); the sidecar's blocks dequantize bit for bit to gguf's own
dequantization; the exported artifact's MatMulNBits initializers are those blocks; ``verify``
against the GGUF passes; greedy decoding equals transformers loaded with ``gguf_file=``; bad
files are one ``error:`` line with nothing written. The real checkpoint (SmolLM2-135M-Instruct's
Q4_1 GGUF, Q8_0 token embedding tied to the head) is exported from the file itself and its head's
blocks checked.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")  # transformers' GGUF loader (the reference) needs it

from gguf import GGMLQuantizationType as Q  # noqa: E402

from cli_contract import export_fails  # noqa: E402

HEADS, KV_HEADS, HIDDEN, FFN, LAYERS = 4, 2, 64, 128, 2
MAX_SEQ_LEN = 1024  # verify scores a quantized artifact on text windows of 512 tokens: they must fit
STEPS = 24
PROMPT = "The quick brown fox jumps over the lazy dog, and then"
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
# Layer 0's q/k/v are all Q4_0 (a fused 4-bit qkv, rows permuted) and layer 1's all Q8_0; gate/up
# mix Q4_0 with Q4_1 in layer 0 (no blocks: quantized from the floats) and are Q8_0 in layer 1.
TYPES = {
    "token_embd.weight": Q.Q8_0, "output.weight": Q.Q4_0,
    "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q4_0, "blk.0.attn_v.weight": Q.Q4_0,
    "blk.0.attn_output.weight": Q.Q8_0, "blk.0.ffn_gate.weight": Q.Q4_0, "blk.0.ffn_up.weight": Q.Q4_1,
    "blk.0.ffn_down.weight": Q.Q8_0,
    "blk.1.attn_q.weight": Q.Q8_0, "blk.1.attn_k.weight": Q.Q8_0, "blk.1.attn_v.weight": Q.Q8_0,
    "blk.1.attn_output.weight": Q.Q4_0, "blk.1.ffn_gate.weight": Q.Q8_0, "blk.1.ffn_up.weight": Q.Q8_0,
    "blk.1.ffn_down.weight": Q.Q4_1, "blk.1.ffn_norm.weight": Q.F16,
}
EXACT = (Q.Q4_0, Q.Q8_0)
_LEAF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
         "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "lm_head.weight": "output.weight",
        "model.norm.weight": "output_norm.weight"}
# graphkiln's fused parameters and their checkpoint parts
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
# GGUF architecture -> (transformers model, its config's extra settings); Qwen3's head_dim is the
# config class's default (128), which transformers' GGUF config mapping leaves in place
ARCHS = {"llama": ("LlamaForCausalLM", {}), "qwen2": ("Qwen2ForCausalLM", {}),
         "qwen3": ("Qwen3ForCausalLM", {"head_dim": 128})}


def gguf_name(hf: str) -> str:
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{_LEAF['.'.join(parts[3:-1])]}.{parts[-1]}"


def llama_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (attn_q with n_head, attn_k with n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, arch: str = "llama", types: dict | None = None, block_count: int = LAYERS,
                    seed: int = 7, tied: bool = False, name: str = "tiny") -> None:
    """A random tiny decoder as llama.cpp's converter writes it (a llama's attn_q / attn_k rows
    permuted), in ``types`` (F32 for the rest); a tied one has no output.weight. An architecture
    outside ARCHS is written as a llama under that name."""
    import torch
    import transformers

    from graphkiln.demo.run import train_tokenizer

    types = TYPES if types is None else types
    model_cls, extra = ARCHS.get(arch, ARCHS["llama"])
    tokdir = path.parent / f"{path.stem}-tokenizer"
    tokdir.mkdir(parents=True, exist_ok=True)
    vocab = train_tokenizer(tokdir, 400)
    model_json = json.loads((tokdir / "tokenizer.json").read_text())["model"]
    tokens = sorted(model_json["vocab"], key=model_json["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model_json["merges"]]
    cls = getattr(transformers, model_cls)
    cfg = cls.config_class(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=1024,
                           initializer_range=0.15, tie_word_embeddings=tied, rms_norm_eps=1e-5, **extra)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.copy_(1.0 + torch.randn(p.shape) * 0.2)
            elif n.endswith(".bias"):
                p.copy_(torch.randn(p.shape) * 0.1)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(block_count)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(extra.get("head_dim", HIDDEN // HEADS))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in ("<unk>", "<s>", "</s>") else 1 for t in tokens])  # 3: control
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, tensor in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        arr = tensor.float().numpy()
        gname = gguf_name(hf)
        if model_cls == "LlamaForCausalLM" and gname.endswith("attn_q.weight"):
            arr = llama_permute(arr, HEADS, HEADS)
        elif model_cls == "LlamaForCausalLM" and gname.endswith("attn_k.weight"):
            arr = llama_permute(arr, HEADS, KV_HEADS)
        qtype = types.get(gname, Q.F32)
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        elif qtype == Q.Q8_1:  # no quantizer in gguf-py (nor a dequantizer): bytes of the right size
            raw = np.random.default_rng(0).integers(0, 256, (arr.shape[0], arr.shape[1] // 32 * 40), np.uint8)
            w.add_tensor(gname, raw, raw_dtype=qtype)
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bits_of(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """(model, tokenizer) as transformers loads them from the GGUF itself, fp32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    d, name = str(tiny_gguf.parent), tiny_gguf.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=name)


@pytest.fixture(scope="module")
def reference_state(reference) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reference[0].state_dict().items()}


@pytest.fixture(scope="module")
def exported(tiny_gguf, tmp_path_factory):
    from graphkiln.export.pipeline import ExportOptions, export_model

    art = tmp_path_factory.mktemp("gguf-artifact") / "art"
    # --quant int8: the Q4_1 weights (no blocks of their own) are requantized finely, so the logits
    # checks below measure the stored blocks and the int8 activations, not a coarse int4 requantization
    manifest = export_model(str(tiny_gguf), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, quant="int8"))
    return art, manifest


# --------------------------------------------------------------------------- the conversion


def converted(gguf_path: Path, dest: Path):
    """(every float tensor as the converted checkpoint reads it, every tensor's blocks loaded)."""
    from graphkiln.models.gguf import convert_gguf

    derived = convert_gguf(gguf_path, dest)
    return ({n: derived.read(n) for n in derived.tensors},
            {n: b.load() for n, b in derived.blocks().items()})


def test_converted_checkpoint_is_what_transformers_loads(tiny_gguf, reference, reference_state, tmp_path):
    from transformers import AutoConfig

    ckpt = tmp_path / "ckpt"
    weights, blocks = converted(tiny_gguf, ckpt)
    assert sorted(weights) == sorted(reference_state)  # untied: lm_head.weight is stored
    for name, ref in reference_state.items():
        assert weights[name].dtype == np.float32 and weights[name].shape == ref.shape, name
        assert np.array_equal(bits_of(weights[name]), bits_of(ref)), f"{name} differs from transformers' GGUF load"

    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    ref_config = json.loads(AutoConfig.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name).to_json_string())
    for key, value in ref_config.items():
        if key not in ("architectures", "dtype", "transformers_version"):
            assert config.get(key) == value, key
    assert json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"] == 2

    tokenizer = reference[1]
    assert json.loads((ckpt / "tokenizer.json").read_text()) == json.loads(tokenizer.backend_tokenizer.to_str())
    assert (ckpt / "chat_template.jinja").read_text() == CHAT_TEMPLATE

    # the blocks: every 2-D Q4_0 / Q8_0 tensor, nothing else, each bit-exact with its float weight
    want = {hf for hf in reference_state if TYPES.get(gguf_name(hf)) in EXACT}
    assert set(blocks) == want
    for hf, b in blocks.items():
        q4 = TYPES[gguf_name(hf)] == Q.Q4_0
        assert (b.bits, b.block_size, b.format) == ((4, 32, "gguf:Q4_0") if q4 else (8, 32, "gguf:Q8_0"))
        assert (b.zero_points == (8 if q4 else 128)).all()
        assert np.array_equal(bits_of(b.dequantize()), bits_of(reference_state[hf])), hf


def test_conversion_writes_no_weights_and_reads_rows(tiny_gguf, reference_state, tmp_path):
    """The converted directory holds the config and tokenizer only (issue 36: no full-precision copy
    of the model on disk); a band of rows is those rows of the whole tensor, for a table, a tensor
    whose rows llama.cpp permuted (attn_q) and one stored in a type without blocks (Q4_1)."""
    from graphkiln.models.gguf import convert_gguf

    ckpt = tmp_path / "ckpt"
    derived = convert_gguf(tiny_gguf, ckpt)
    assert not [p.name for p in ckpt.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")]
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 100_000
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.0.mlp.up_proj.weight"):
        want = reference_state[name]
        assert np.array_equal(bits_of(derived.tensors[name].rows(3, 11)), bits_of(want[3:11])), name


def test_name_map_is_transformers(reference):
    """The one-level name map equals transformers' get_gguf_hf_weights_map (which walks every submodule)."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor, get_gguf_hf_weights_map

    from graphkiln.models.gguf import gguf_name_map

    model = reference[0]
    processor = LlamaTensorProcessor(config={"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS})
    ours = gguf_name_map("llama", LAYERS, model.state_dict().keys(), processor)
    assert ours == get_gguf_hf_weights_map(model, processor)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_ggufs_convert_as_transformers_loads_them(arch, tmp_path):
    """Qwen2 (q/k/v biases) and Qwen3 (q/k norms), tied, no row permutation: the same checks."""
    import torch
    from transformers import AutoModelForCausalLM

    types = {"token_embd.weight": Q.Q8_0, "blk.0.attn_q.weight": Q.Q4_0, "blk.0.attn_k.weight": Q.Q8_0,
             "blk.1.ffn_up.weight": Q.Q4_1, "blk.1.attn_output.weight": Q.Q4_0}
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch=arch, types=types, tied=True)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ref = {k: v.numpy() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    weights, blocks = converted(path, tmp_path / "ckpt")
    assert sorted(weights) == sorted(ref)
    assert any(k.endswith("q_proj.bias") for k in ref) == (arch == "qwen2")
    assert any(k.endswith("q_norm.weight") for k in ref) == (arch == "qwen3")
    for name, want in ref.items():
        assert np.array_equal(bits_of(weights[name]), bits_of(want)), name
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["architectures"] == [ARCHS[arch][0]]
    assert sorted(blocks) == sorted(["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight",
                                     "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.o_proj.weight"])
    for name, b in blocks.items():
        assert np.array_equal(bits_of(b.dequantize()), bits_of(ref[name])), name


def test_llama_gguf_named_mistral_converts_to_mistral(tiny_gguf, tmp_path):
    """transformers reads a llama GGUF named "mistral" as MistralForCausalLM, and then its GGUF
    loader raises (the gguf package has no "mistral" tensor names); graphkiln converts it with
    llama's names and permutation: the weights of the same file named otherwise."""
    named = tmp_path / "named.gguf"
    write_tiny_gguf(named, name="mistral")
    ours, _ = converted(named, tmp_path / "mistral")
    theirs, _ = converted(tiny_gguf, tmp_path / "llama")
    config = json.loads((tmp_path / "mistral" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["MistralForCausalLM"], "mistral")
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert np.array_equal(bits_of(ours[name]), bits_of(theirs[name])), name


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0])
def test_blocks_dequantize_to_ggufs_own_values(qtype):
    """BlockQuantized from Q4_0 / Q8_0 bytes dequantizes bit for bit to gguf.dequantize, on random
    rows plus the edge blocks: all zeros (d = 0), a lone negative or positive extreme (the sign of
    d), values that round to the codes' ends, subnormal fp16 scales."""
    from graphkiln.models.gguf import TensorInfo, exact_blocks

    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    w[1] = 0.0
    w[2, :32] = 0.01
    w[2, 5] = -3.0
    w[3, 32:64] = rng.uniform(-1, 1, 32)
    w[3, 40] = 7.5
    w[4] *= 1e-6
    w[5] *= 1e4
    raw = gguf.quants.quantize(w, qtype)
    ref = gguf.quants.dequantize(raw, qtype)
    b = exact_blocks(raw, TensorInfo("t", w.shape, qtype, 0, raw.nbytes), ref)
    assert b is not None
    assert np.array_equal(bits_of(b.dequantize()), bits_of(ref))
    blob = raw.reshape(6, 4, -1)
    if qtype == Q.Q8_0:  # codes are the int8 values + 128
        assert np.array_equal(b.codes.astype(np.int16) - 128, blob[..., 2:].view(np.int8).reshape(6, 128))
    else:  # codes are the nibbles: low ones first
        assert np.array_equal(b.codes.reshape(6, 4, 32)[..., :16], blob[..., 2:] & 0x0F)
    assert np.array_equal(b.scales, blob[..., :2].copy().view(np.float16)[..., 0].astype(np.float32))


# --------------------------------------------------------------------------- the artifact


def _matmulnbits(art: Path) -> dict[str, dict]:
    """{parameter name: {"bits", "k", "w" (the float [N, K] weight the node computes with)}}."""
    import onnx
    from onnx import numpy_helper

    from graphkiln.export.lowering.quantize import dequantize_reference

    model = onnx.load(str(art / "decoder.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        packed, scales = (numpy_helper.to_array(inits[i]) for i in node.input[1:3])
        zp = numpy_helper.to_array(inits[node.input[3]]) if len(node.input) > 3 and node.input[3] else None
        w = dequantize_reference(packed, scales, zp, attrs["K"], attrs["bits"]).T
        param = node.input[1].rsplit(".", 1)[0].removesuffix(".T")
        out[param] = {"bits": attrs["bits"], "block": attrs["block_size"], "w": w}
    return out


def _parts(param: str) -> list[str]:
    for fused, parts in _FUSED.items():
        if f".{fused}." in param:
            return [param.replace(fused, p) for p in parts]
    return [param]


def test_matmulnbits_blocks_are_the_gguf_blocks(exported, reference_state):
    art, manifest = exported
    assert manifest.model.quant == "int8" and manifest.model.quant_method == "calibrated+checkpoint"
    nodes = _matmulnbits(art)
    exact = []
    for param, node in nodes.items():
        if param == "lm_head.weight" or not param.startswith("model."):
            continue  # the head: test_untied_head_keeps_its_blocks
        types = {TYPES.get(gguf_name(p)) for p in _parts(param)}
        if len(types) == 1 and types <= set(EXACT):
            want = np.concatenate([reference_state[p] for p in _parts(param)])
            assert (node["bits"], node["block"]) == ((4 if types == {Q.Q4_0} else 8), 32), param
            assert np.array_equal(bits_of(node["w"]), bits_of(want)), f"{param}: not the GGUF's blocks"
            exact.append(param)
    assert sorted(exact) == sorted([
        "model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.qkv_proj.weight",
        "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"])


def test_untied_head_keeps_its_blocks(exported, reference_state):
    """The untied head (output.weight, Q4_0) computes with the file's blocks too (needs the exporter
    to name the head's transposed weight ``lm_head.weight.T``, which quantize's provided= looks up)."""
    nodes = _matmulnbits(exported[0])
    head = [n for p, n in nodes.items() if not p.startswith("model.layers.")]
    assert len(head) == 1
    assert head[0]["bits"] == 4
    assert np.array_equal(bits_of(head[0]["w"]), bits_of(reference_state["lm_head.weight"]))


def test_embedding_lookup_reads_the_gguf_blocks(exported, reference_state):
    """The token embedding (Q8_0) is gathered from the file's own blocks: the artifact's lookup,
    run alone in onnxruntime over every id, gives the GGUF's dequantized rows bit for bit."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.load(str(exported[0] / "decoder.onnx"))
    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    (lookup,) = [n for n in model.graph.node if n.op_type in ("Gather", "GatherBlockQuantized")
                 and n.input[1] == "input_ids"]
    nodes, needed = [lookup], list(lookup.input)
    while needed:  # the lookup's inputs back to initializers (a Reshape of the packed blocks)
        name = needed.pop()
        if name in producers and producers[name] not in nodes:
            nodes.insert(0, producers[name])
            needed += list(producers[name].input)
    used = {i for n in nodes for i in n.input}
    vocab, hidden = reference_state["model.embed_tokens.weight"].shape
    graph = helper.make_graph(nodes, "lookup", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [vocab])],
                              [helper.make_tensor_value_info(lookup.output[0], TensorProto.FLOAT, None)],
                              [inits[i] for i in used if i in inits])
    one = helper.make_model(graph, opset_imports=list(model.opset_import))
    one.ir_version = model.ir_version
    session = ort.InferenceSession(one.SerializeToString(), providers=["CPUExecutionProvider"])
    (rows,) = session.run(None, {"input_ids": np.arange(vocab, dtype=np.int64)})
    assert lookup.op_type == "GatherBlockQuantized"
    assert np.array_equal(bits_of(rows.reshape(vocab, hidden)), bits_of(reference_state["model.embed_tokens.weight"]))


def test_verify_against_the_gguf_passes(exported, tiny_gguf):
    from graphkiln.export.verify import verify_artifact

    report = verify_artifact(exported[0], str(tiny_gguf), steps=16)
    assert report.passed, report.summary()


def _reference_greedy(reference):
    from reference import greedy

    model, tokenizer = reference
    prompt = tokenizer(PROMPT).input_ids
    tokens, logits = greedy(model, prompt, STEPS)
    return prompt, tokens, logits


def test_float_artifact_decodes_exactly_as_transformers_gguf(tiny_gguf, reference, tmp_path):
    """The portable target ignores the blocks: a float artifact of the converted weights, which must
    be transformers' GGUF model itself (greedy tokens identical, logits within fp32 noise)."""
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig
    from reference import ATOL

    art = tmp_path / "float"
    manifest = export_model(str(tiny_gguf), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN,
                                                               target="portable"))
    assert manifest.model.quant is None
    prompt, want, ref_logits = _reference_greedy(reference)
    (got,) = Engine.load(art).generate(prompt, GenerationConfig(max_new_tokens=STEPS, do_sample=False,
                                                                stop_token_ids=(), output_logits=True))
    assert got.token_ids == want
    assert np.abs(got.logits - ref_logits).max() <= ATOL


# The quantized artifact's logits against transformers' (fp32, the GGUF's dequantized weights), on
# the reference's own greedy sequence. Measured: RMS error / RMS spread 0.029, max abs 0.31 (logits
# spread 1.2; the default calibrated search for the requantized weights; 0.028 / 0.25 with rtn).
# Not zero although the Q4_0/Q8_0 weights are bit-exact: MatMulNBits runs with accuracy_level 4
# (int8 activations, per block), which alone gives 0.024 / 0.22 (measured with every weight in exact
# blocks); the rest is the Q4_1 tensors requantized to int8. The bounds are ~1.7x the
# measurement; a wrong block layout or permutation gives ~1.
QUANT_RMS_REL, QUANT_MAX_ABS = 0.05, 0.5


def test_quantized_artifact_matches_transformers_gguf(exported, reference):
    from graphkiln.runtime import Engine, GenerationConfig

    prompt, want, ref_logits = _reference_greedy(reference)
    engine = Engine.load(exported[0])
    forced = engine.prompt_logits([prompt + want[:-1]])[0][len(prompt) - 1:]
    err = np.abs(forced.astype(np.float64) - ref_logits)
    rms_rel = float(np.sqrt((err ** 2).mean()) / ref_logits.std())
    assert rms_rel < QUANT_RMS_REL and err.max() < QUANT_MAX_ABS, (rms_rel, err.max())
    # greedy: fed the reference's tokens, the artifact picks the same next token at nearly every
    # step (measured: 23 of 24); its own greedy run is then the reference's up to the first step
    # where it would not (a near-tie flipped by the noise above: the reference's top-2 margin goes
    # down to 0.008 on this path), and that step's token is the one it picked when fed
    picks = forced.argmax(-1)
    assert (picks == np.array(want)).mean() >= 0.9, picks.tolist()
    flip = next((i for i, (a, b) in enumerate(zip(picks, want)) if a != b), STEPS)
    (got,) = engine.generate(prompt, GenerationConfig(max_new_tokens=STEPS, do_sample=False, stop_token_ids=()))
    assert got.token_ids[:flip] == want[:flip]
    if flip < STEPS:
        assert got.token_ids[flip] == picks[flip]


# --------------------------------------------------------------------------- bad files


def _truncated(src: Path, dst: Path, keep) -> Path:
    data = src.read_bytes()
    dst.write_bytes(data[:keep(len(data))])
    return dst


BAD = {
    # name: (how to make it from the tiny GGUF, words the error line must hold)
    "empty": (lambda src, p: p.write_bytes(b""), "not a valid GGUF"),
    "random": (lambda src, p: p.write_bytes(np.random.default_rng(3).bytes(50_000)), "magic"),
    "header-cut": (lambda src, p: _truncated(src, p, lambda n: 40), "truncated"),
    "metadata-cut": (lambda src, p: _truncated(src, p, lambda n: 3000), "truncated"),
    "data-cut": (lambda src, p: _truncated(src, p, lambda n: n - 100), "truncated"),
    "huge-count": (lambda src, p: p.write_bytes(src.read_bytes()[:16] + (2**63).to_bytes(8, "little")
                                                + src.read_bytes()[24:]), "more than"),
    "unknown-architecture": (lambda src, p: write_tiny_gguf(p, arch="gpt-neox-ish", types={}), "gpt-neox-ish"),
    # a metadata value echoed escaped and clipped (no newline or terminal escape reaches the terminal)
    "escaping-architecture": (lambda src, p: write_tiny_gguf(p, arch="x\n\x1b[2J\x1b[31m" + "x" * 1000, types={}),
                              "architecture 'x\\n\\x1b[2J"),
    "undequantizable-type": (lambda src, p: write_tiny_gguf(p, types={"blk.0.ffn_up.weight": Q.Q8_1}), "Q8_1"),
    "inconsistent-metadata": (lambda src, p: write_tiny_gguf(p, types={}, block_count=5), "num_hidden_layers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_gguf_is_one_error_line(case, tiny_gguf, tmp_path, capsys, monkeypatch):
    make, needle = BAD[case]
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    bad = src_dir / f"{case}.gguf"
    make(tiny_gguf, bad)
    scratch = tmp_path / "scratch"  # where the conversion's temporary directory goes
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "out" / "art"
    export_fails(capsys, bad, out, needle)
    assert list(scratch.iterdir()) == [], "the conversion left files behind"


def test_conversion_without_disk_space_is_refused_before_writing(tiny_gguf, tmp_path, capsys, monkeypatch):
    """The conversion's preflight (export.preflight.check_conversion): a disk too full for the
    converted directory's files is one line before anything is written (the free space reported
    by the OS is the one figure set here; the needs are the conversion's own)."""
    import shutil

    from graphkiln.export import preflight

    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    usage = shutil.disk_usage(scratch)
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    export_fails(capsys, tiny_gguf, tmp_path / "out" / "art", "no space left", "converting the GGUF", "TMPDIR")
    assert list(scratch.iterdir()) == []


# --------------------------------------------------------------------------- the real checkpoint


def test_real_gguf_exports_with_its_q8_0_head_blocks(smollm2_gguf, tmp_path):
    """SmolLM2-135M-Instruct's GGUF (Q4_1 layers, Q8_0 token embedding tied to the head), exported
    from the file: the head's MatMulNBits blocks are bit-exact with gguf's dequantization of
    token_embd, and the embedding lookup reads those very blocks (or, gathering floats, the same
    values); the Q4_1 layers are int4 from their floats, the width the file mostly stores (``rtn``
    here: the method does not touch the file's own blocks, and the default calibrated search costs
    ~30 s more on this model)."""
    import onnx
    from onnx import numpy_helper
    from onnx.external_data_helper import load_external_data_for_tensor

    from graphkiln.export.lowering.quantize import dequantize_reference
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.models.gguf import read_layout, tensor_data

    art = tmp_path / "art"
    manifest = export_model(str(smollm2_gguf), art, ExportOptions(progress=False, max_seq_len=256, quant_method="rtn"))
    assert manifest.model.quant == "int4" and manifest.model.quant_method == "rtn+checkpoint"

    layout = read_layout(smollm2_gguf)
    (embd,) = [t for t in layout.tensors if t.name == "token_embd.weight"]
    assert embd.qtype == Q.Q8_0
    want = gguf.quants.dequantize(tensor_data(smollm2_gguf, layout, embd), embd.qtype)

    model = onnx.load(str(art / "decoder.onnx"), load_external_data=False)
    inits = {t.name: t for t in model.graph.initializer}

    def array(name: str) -> np.ndarray:
        t = inits[name]
        load_external_data_for_tensor(t, str(art))
        return numpy_helper.to_array(t)

    (head,) = [n for n in model.graph.node if n.op_type == "MatMulNBits" and n.input[1].startswith("lm_head.")]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in head.attribute}
    assert (attrs["bits"], attrs["block_size"], attrs["N"]) == (8, 32, 49152)
    zp = array(head.input[3]) if len(head.input) > 3 and head.input[3] else None
    w = dequantize_reference(array(head.input[1]), array(head.input[2]), zp, attrs["K"], 8).T
    assert np.array_equal(bits_of(w), bits_of(want))

    producers = {o: n for n in model.graph.node for o in n.output}
    lookups = [n for n in model.graph.node if n.op_type in ("Gather", "GatherBlockQuantized")
               and n.input[0] in inits | producers and "input_ids" in n.input[1]]
    assert len(lookups) == 1, [(n.op_type, list(n.input)) for n in lookups]
    lookup = lookups[0]
    if lookup.op_type == "GatherBlockQuantized":  # the head's own tensors: [N, K/32, 32] as stored, scales reshaped
        assert lookup.input[0] == head.input[1]
        assert list(producers[lookup.input[2]].input)[0] == head.input[2]
    else:
        assert np.array_equal(bits_of(array(lookup.input[0])), bits_of(want))


def test_streamed_export_equals_whole_model(tiny_gguf, exported, tmp_path):
    """The streamed export of a GGUF (its own blocks where they map, the rest quantized as it is
    written) equals the whole-model path's, byte for byte (issue 36; tests/test_streamed_export.py)."""
    from conftest import assert_same_artifact

    from graphkiln.export.pipeline import ExportOptions, export_model

    whole = tmp_path / "whole"
    export_model(str(tiny_gguf), whole, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, quant="int8", streamed=False))
    assert_same_artifact(exported[0], whole)
