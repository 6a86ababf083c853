"""``lower_moe_for_onnxruntime``: graphkiln.MoE -> routing in standard ops + com.microsoft.MoE.

Each case exports a tiny torch module calling ``torch.ops.graphkiln.moe`` with the real
exporter (dynamic token count), attaches the reference function, lowers a copy, and checks
that onnxruntime gives the same output for both graphs (the unlowered one runs the dense
reference function) at T=1 and T=37, and that both match the torch reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from graphkiln.export.custom_ops import registry as R  # noqa: E402
from graphkiln.ops.spec import DOMAIN  # noqa: E402
from graphkiln.export.lowering.ort_moe import lower_moe_for_onnxruntime  # noqa: E402

E, I, H = 8, 12, 32
TOKENS = (1, 37)
RTOL = 1e-5  # max |lowered - dense| / max |dense|

# (top_k, scoring, normalize, norm_eps, routed_scaling[, activation, alpha, limit])
VARIANTS = {
    "softmax_norm": (2, 0, 1, 0.0, 1.0),  # Qwen3-MoE norm_topk_prob=True, Mixtral
    "softmax_nonorm": (2, 0, 0, 0.0, 1.0),  # Qwen3-MoE norm_topk_prob=False
    "softmax_norm_eps_scaled": (2, 0, 1, 1e-6, 1.5),
    "sigmoid_bias_norm_eps": (2, 1, 1, 1e-6, 1.0),  # LFM2-MoE
    "sigmoid_bias_nonorm_scaled": (3, 1, 0, 0.0, 2.5),
    "sigmoid_bias_norm_scaled": (4, 1, 1, 0.0, 2.0),
    "sigmoid_top1": (1, 1, 1, 0.0, 1.0),
    "softmax_all_experts": (E, 0, 0, 0.0, 1.0),
    # with random expert biases (``BIASED``): gpt-oss's clamped SwiGLU (a limit that binds at the
    # test's scales) and Nemotron-H's relu² experts
    "gpt_oss": (4, 0, 1, 0.0, 1.0, 2, 1.702, 3.0),
    "nemotron_h": (2, 1, 1, 1e-20, 2.5, 1, 1.702, 7.0),
    "swiglu_biased": (2, 1, 1, 1e-6, 1.0),
}
BIASED = {"gpt_oss", "nemotron_h", "swiglu_biased"}


def _rows(cfg) -> int:
    """gate_up rows per expert: I for relu² (activation 1), else 2I."""
    return I if len(cfg) > 5 and cfg[5] == 1 else 2 * I


class _MoE(torch.nn.Module):
    """``layers`` graphkiln.MoE layers with residuals; weights are parameters (-> initializers).
    Expert biases are zeros (what a bias-free model passes) unless ``expert_biases``."""

    def __init__(self, cfg, seed=0, dtype=torch.float32, zero_bias=False, layers=1, expert_biases=False):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        f = _rows(cfg)
        self.gu = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, f, H, generator=g) * 0.3).to(dtype)) for _ in range(layers)])
        self.dn = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, H, I, generator=g) * 0.3).to(dtype)) for _ in range(layers)])
        bias = [torch.zeros(E) if zero_bias else torch.randn(E, generator=g) * 0.2 for _ in range(layers)]
        self.b = torch.nn.ParameterList([torch.nn.Parameter(b) for b in bias])
        scale = 0.5 if expert_biases else 0.0
        self.gub = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, f, generator=g) * scale).to(dtype)) for _ in range(layers)])
        self.dnb = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, H, generator=g) * scale).to(dtype)) for _ in range(layers)])

    def forward(self, h, lg):
        for gu, dn, b, gub, dnb in zip(self.gu, self.dn, self.b, self.gub, self.dnb):
            h = h + torch.ops.graphkiln.moe(h, lg, gu, dn, b, gub, dnb, *self.cfg)
        return h


class _MoEInputs(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, h, lg, gu, dn, b, gub, dnb):
        return torch.ops.graphkiln.moe(h, lg, gu, dn, b, gub, dnb, *self.cfg)


def _export(module, args) -> onnx.ModelProto:
    R.register_torch_ops()
    t = torch.export.Dim("T")
    dyn = ({0: t}, {0: t}) + (None,) * (len(args) - 2)
    module.eval()
    prog = torch.onnx.export(module, args, dynamo=True, opset_version=23, verbose=False,
                             custom_translation_table=R.translation_table(), dynamic_shapes=dyn)
    R.attach_functions(prog.model)
    return prog.model_proto


def _lowered(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out, lower_moe_for_onnxruntime(out)


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _feeds(t: int, dtype=np.float32, scale=2.0, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + t)
    return {"h": (rng.standard_normal((t, H)) * scale).astype(dtype),
            "lg": rng.standard_normal((t, E)).astype(np.float32)}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def _check_structure(model: onnx.ModelProto, n_moe: int = 1, cfg=(), biased: bool = False) -> None:
    """No graphkiln node or function left; each ORT MoE configured for ``cfg``'s activation, with
    bias inputs only when the expert biases are not zero (else the pre-bias node exactly)."""
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    assert not any(d == DOMAIN for d, _ in ops)
    assert ops.count(("com.microsoft", "MoE")) == n_moe
    assert {o.domain: o.version for o in model.opset_import}.get("com.microsoft") == 1
    assert not any(f.domain == DOMAIN for f in model.functions)
    assert DOMAIN not in {o.domain for o in model.opset_import}
    for n in model.graph.node:
        if n.op_type == "MoE":
            a = {x.name: onnx.helper.get_attribute_value(x) for x in n.attribute}
            assert a["activation_type"] == b"swiglu" and a["swiglu_fusion"] == 1
            activation = cfg[5] if len(cfg) > 5 else 0
            if activation == 2:
                assert a["activation_alpha"] == pytest.approx(cfg[6]) and a["activation_beta"] == 1.0
                assert a["swiglu_limit"] == pytest.approx(cfg[7])
            else:
                assert a["activation_alpha"] == np.float32(1e30 if activation == 1 else 1.0)
                assert a["activation_beta"] == 0.0 and "swiglu_limit" not in a
            assert len(n.input) == (6 if biased else 5) and all(n.input[i] for i in range(len(n.input)) if i != 3)
            if biased:
                assert n.input[3] and n.input[5]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lowered_matches_dense_function(variant):
    cfg = VARIANTS[variant]
    biased = variant in BIASED
    module = _MoE(cfg, seed=len(variant), expert_biases=biased)
    model = _export(module, tuple(torch.from_numpy(v) for v in _feeds(5).values()))
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered, cfg=cfg, biased=biased)
    names = {t.name for t in lowered.graph.initializer}
    assert not any(name.startswith("gu") and ".ort_" not in name for name in names)  # originals dropped
    assert biased or not any(name.startswith("dnb") for name in names)  # zero output biases dropped
    if len(cfg) > 5 and cfg[5] == 2:  # the clamps bind: on the gate from above, on up both ways
        y = np.einsum("efh,th->tef", module.gu[0].detach().numpy(), _feeds(37)["h"]) + module.gub[0].detach().numpy()
        assert (y[..., :I] > cfg[7]).any() and (y[..., I:] < -cfg[7]).any() and (y[..., I:] > cfg[7]).any()
    dense, sparse = _session(model), _session(lowered)
    for t in TOKENS:
        feeds = _feeds(t)
        want = dense.run(None, feeds)[0]
        got = sparse.run(None, feeds)[0]
        assert got.shape == want.shape == (t, H)
        assert _rel(got, want) < RTOL, (variant, t)
        with torch.no_grad():
            ref = module(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        assert _rel(got, ref) < RTOL, (variant, t)


def test_no_swiglu_clamp_and_zero_bias():
    """Gate pre-activations far above 7 (the GPT-OSS clamp) pass unclamped; a zero bias is dropped."""
    module = _MoE(VARIANTS["sigmoid_bias_norm_eps"], seed=3, zero_bias=True)
    model = _export(module, tuple(torch.from_numpy(v) for v in _feeds(5).values()))
    lowered, n = _lowered(model)
    assert n == 1
    assert len(lowered.graph.initializer) == 2  # interleaved gate_up + down; the zero bias is gone
    dense, sparse = _session(model), _session(lowered)
    for t in TOKENS:
        feeds = _feeds(t, scale=40.0)
        gate = np.einsum("eih,th->tei", module.gu[0].detach().numpy()[:, :I], feeds["h"])
        assert np.abs(gate).max() > 50
        assert _rel(sparse.run(None, feeds)[0], dense.run(None, feeds)[0]) < RTOL


@pytest.mark.parametrize("cfg", [VARIANTS["softmax_norm_eps_scaled"], VARIANTS["gpt_oss"], VARIANTS["nemotron_h"]],
                         ids=["swiglu", "gpt_oss", "nemotron_h"])
def test_weights_as_graph_inputs(cfg):
    """gate_up and gate_up_bias that are not initializers are interleaved (relu²: doubled) inside
    the graph."""
    rng = np.random.default_rng(7)
    w = {"gu": (rng.standard_normal((E, _rows(cfg), H)) * 0.3).astype(np.float32),
         "dn": (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32),
         "b": (rng.standard_normal(E) * 0.2).astype(np.float32),
         "gub": (rng.standard_normal((E, _rows(cfg))) * 0.5).astype(np.float32),
         "dnb": (rng.standard_normal((E, H)) * 0.5).astype(np.float32)}
    args = tuple(torch.from_numpy(v) for v in (*_feeds(5).values(), *w.values()))
    model = _export(_MoEInputs(cfg), args)
    assert not model.graph.initializer
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered, cfg=cfg, biased=True)
    dense, sparse = _session(model), _session(lowered)
    names = [i.name for i in model.graph.input]
    for t in TOKENS:
        feeds = dict(zip(names, (*_feeds(t).values(), *w.values())))
        assert _rel(sparse.run(None, feeds)[0], dense.run(None, feeds)[0]) < RTOL


def test_two_layers_and_external_data(tmp_path):
    """Two MoE nodes get distinct names; external data must be loaded before lowering."""
    module = _MoE(VARIANTS["softmax_norm"], seed=5, layers=2)
    model = _export(module, tuple(torch.from_numpy(v) for v in _feeds(5).values()))
    path = tmp_path / "moe.onnx"
    saved = onnx.ModelProto()
    saved.CopyFrom(model)  # onnx.save(save_as_external_data=True) rewrites the proto it is given
    onnx.save(saved, path, save_as_external_data=True, all_tensors_to_one_file=True, location="moe.data",
              size_threshold=0)
    unloaded = onnx.load(path, load_external_data=False)
    with pytest.raises(ValueError, match="external data"):
        lower_moe_for_onnxruntime(unloaded)
    loaded = onnx.load(path)
    assert lower_moe_for_onnxruntime(loaded) == 2
    _check_structure(loaded, n_moe=2)
    names = [n.name for n in loaded.graph.node]
    assert len(names) == len(set(names))
    out = tmp_path / "lowered.onnx"
    onnx.save(loaded, out, save_as_external_data=True, location="lowered.data")
    dense, sparse = _session(model), ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    for t in TOKENS:
        feeds = _feeds(t)
        assert _rel(sparse.run(None, feeds)[0], dense.run(None, feeds)[0]) < RTOL


@pytest.mark.parametrize("variant", ["sigmoid_bias_norm_eps", "gpt_oss", "nemotron_h"])
def test_float16_and_bfloat16(variant):
    """float16 lowers (ORT MoE has a float16 CPU kernel); bfloat16 has none and is left alone."""
    cfg = VARIANTS[variant]
    biased = variant in BIASED
    module = _MoE(cfg, seed=9, dtype=torch.float16, expert_biases=biased)
    model = _export(module, (torch.from_numpy(_feeds(5, np.float16)["h"]), torch.from_numpy(_feeds(5)["lg"])))
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered, cfg=cfg, biased=biased)
    dense, sparse = _session(model), _session(lowered)
    for t in TOKENS:
        feeds = _feeds(t, np.float16)
        got, want = sparse.run(None, feeds)[0], dense.run(None, feeds)[0]
        assert got.dtype == np.float16
        assert _rel(got, want) < 3e-3  # float16 rounding of both graphs

    bf16 = _export(_MoE(cfg, seed=9, dtype=torch.bfloat16),
                   (torch.from_numpy(_feeds(5)["h"]).bfloat16(), torch.from_numpy(_feeds(5)["lg"])))
    before = bf16.SerializeToString()
    assert lower_moe_for_onnxruntime(bf16) == 0
    assert bf16.SerializeToString() == before


def test_a_node_from_before_the_expert_biases_lowers():
    """A five-input node without activation attributes (artifacts exported before the op had
    them) lowers to the SwiGLU MoE with no biases, and computes the op with zero biases."""
    cfg = VARIANTS["sigmoid_bias_norm_eps"]
    rng = np.random.default_rng(3)
    w = {"gu": (rng.standard_normal((E, 2 * I, H)) * 0.3).astype(np.float32),
         "dn": (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32),
         "b": (rng.standard_normal(E) * 0.2).astype(np.float32)}
    node = onnx.helper.make_node("MoE", ["h", "lg", *w], ["out"], domain=DOMAIN, top_k=cfg[0], scoring=cfg[1],
                                 normalize=cfg[2], norm_eps=cfg[3], routed_scaling=cfg[4])
    graph = onnx.helper.make_graph(
        [node], "g", [onnx.helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, ["T", H]),
                      onnx.helper.make_tensor_value_info("lg", onnx.TensorProto.FLOAT, ["T", E])],
        [onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT, ["T", H])],
        [onnx.numpy_helper.from_array(v, k) for k, v in w.items()])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 23),
                                                         onnx.helper.make_opsetid(DOMAIN, 1)])
    assert lower_moe_for_onnxruntime(model) == 1
    _check_structure(model, cfg=cfg)
    sess = _session(model)
    R.register_torch_ops()
    for t in TOKENS:
        feeds = _feeds(t)
        want = torch.ops.graphkiln.moe(*(torch.from_numpy(v) for v in (*feeds.values(), *w.values())),
                                       torch.zeros(E, 2 * I), torch.zeros(E, H), *cfg)
        assert _rel(sess.run(None, feeds)[0], want.numpy()) < RTOL


def test_no_moe_is_a_no_op():
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 23)])
    before = m.SerializeToString()
    assert lower_moe_for_onnxruntime(m) == 0
    assert m.SerializeToString() == before


# ----------------------------------------------------------------------------------------------
# lower_attention_for_onnxruntime with per-token rotary (rope_layout=1, M-RoPE): q and k rotated
# by RotaryEmbedding in the graph, GroupQueryAttention without its own rotary. A two-layer
# module (full then sliding attention, both reading one in-graph M-RoPE cos/sin pair) runs a
# ragged prefill and decode steps on the lowered graph, with each step's present buffers fed
# back as the next step's past, against the module in torch.

from graphkiln.export.lowering.ort_attention import full_length_windows, lower_attention_for_onnxruntime  # noqa: E402
from graphkiln.manifest import GraphSpec, TensorSpec  # noqa: E402

A_HID, A_NQ, A_NKV, A_D, A_POS, A_CACHE = 32, 4, 2, 16, 64, 16
A_WINDOWS = (0, 3)  # layer 0 full, layer 1 sliding
SECTIONS = (2, 3, 3)  # M-RoPE frequency sections over D/2 = 8: stream j % 3 each


class _MRoPEAttention(torch.nn.Module):
    """Residual graphkiln.Attention layers (rope_layout=1) over one per-token cos/sin pair
    computed from 3-D rotary positions (Qwen2.5-VL's M-RoPE), as the decoder computes it."""

    def __init__(self, dtype=torch.float32, lookahead_input: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(11)

        def w(*shape):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * 0.3).to(dtype))

        self.wq = torch.nn.ParameterList([w(A_HID, A_NQ * A_D) for _ in A_WINDOWS])
        self.wk = torch.nn.ParameterList([w(A_HID, A_NKV * A_D) for _ in A_WINDOWS])
        self.wv = torch.nn.ParameterList([w(A_HID, A_NKV * A_D) for _ in A_WINDOWS])
        self.wo = torch.nn.ParameterList([w(A_NQ * A_D, A_HID) for _ in A_WINDOWS])
        inv = 1.0 / (100.0 ** (torch.arange(0, A_D, 2, dtype=torch.float32) / A_D))
        freqs = torch.arange(A_POS, dtype=torch.float32).unsqueeze(1) * inv
        self.cos_t, self.sin_t = torch.nn.Buffer(freqs.cos()), torch.nn.Buffer(freqs.sin())
        self.lookahead_input = lookahead_input

    def forward(self, hidden_states, position_ids, rope_position_ids, *rest):
        if self.lookahead_input:
            lookahead, states = rest[0], rest[1:]
        else:
            lookahead, states = torch.zeros(1, 1, dtype=torch.int64), rest

        def per_token(table):
            streams = table[rope_position_ids]  # [3, B, S, D/2]
            return torch.cat([part[j % 3] for j, part in enumerate(streams.split(SECTIONS, dim=-1))], dim=-1)

        cos, sin = per_token(self.cos_t), per_token(self.sin_t)
        x, new = hidden_states, []
        for i, window in enumerate(A_WINDOWS):
            out, nk, nv = torch.ops.graphkiln.attention(
                x @ self.wq[i], x @ self.wk[i], x @ self.wv[i], states[2 * i], states[2 * i + 1], position_ids, cos,
                sin, lookahead, torch.zeros(A_NQ), A_NQ, A_NKV, window, A_D ** -0.5, 0, 1)  # no sinks
            x = x + out @ self.wo[i]
            new += [nk, nv]
        return (x, *new)


def _attention_spec(dtype: str, lookahead_input: bool = False) -> GraphSpec:
    ins = [TensorSpec("hidden_states", dtype, ("batch", "seq", A_HID), "hidden_states"),
           TensorSpec("position_ids", "int64", ("batch", "seq"), "position_ids"),
           TensorSpec("rope_position_ids", "int64", (3, "batch", "seq"), "rope_position_ids")]
    if lookahead_input:
        ins.append(TensorSpec("lookahead", "int64", ("batch", "seq"), "lookahead"))
    outs = [TensorSpec("hidden_out", dtype, ("batch", "seq", A_HID), "hidden_states")]
    for i in range(len(A_WINDOWS)):
        for kind in ("key", "value"):
            ins.append(TensorSpec(f"past_{kind}.{i}", dtype, ("batch", A_NKV, "cache_len", A_D), f"past_{kind}", i))
            outs.append(TensorSpec(f"new_{kind}.{i}", dtype, ("batch", A_NKV, "seq", A_D), f"new_{kind}", i))
    return GraphSpec(name="stage0", file="stage0.onnx", inputs=tuple(ins), outputs=tuple(outs), opset=23)


def _export_attention(module, spec: GraphSpec) -> onnx.ModelProto:
    R.register_torch_ops()
    b, s, c = torch.export.Dim("B"), torch.export.Dim("S"), torch.export.Dim("C")
    dims = {"hidden_states": {0: b, 1: s}, "position_ids": {0: b, 1: s}, "rope_position_ids": {1: b, 2: s},
            "lookahead": {0: b, 1: s}}
    dtype = module.wq[0].dtype
    example = {"hidden_states": torch.zeros(2, 3, A_HID, dtype=dtype),
               "position_ids": torch.arange(3).repeat(2, 1), "rope_position_ids": torch.arange(3).repeat(3, 2, 1),
               "lookahead": torch.zeros(2, 3, dtype=torch.int64)}
    args, dyn = [], []
    for t in spec.inputs:
        args.append(example.get(t.name, torch.zeros(2, A_NKV, 5, A_D, dtype=dtype)))
        dyn.append(dims.get(t.name, {0: b, 2: c}))
    prog = torch.onnx.export(module.eval(), tuple(args), dynamo=True, opset_version=23, verbose=False,
                             input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
                             custom_translation_table=R.translation_table(),
                             dynamic_shapes=(dyn[0], dyn[1], dyn[2], tuple(dyn[3:])))  # forward(..., *rest)
    R.attach_functions(prog.model)
    return prog.model_proto


@pytest.fixture(scope="module")
def mrope_graphs():
    """(module, lowered model, lowered spec, rewritten nodes) in fp32."""
    module = _MRoPEAttention()
    spec = _attention_spec("float32")
    lowered = _export_attention(module, spec)
    new_spec, n = lower_attention_for_onnxruntime(lowered, spec)
    return module, lowered, new_spec, n


def _step_inputs(rng, starts, lengths, seq, image_rows=()):
    """position_ids continuing each row's cache; rotary positions on 3 streams, apart (an
    image) for the tokens of ``image_rows`` and equal elsewhere."""
    pos = torch.tensor(starts).unsqueeze(1) + torch.arange(seq)
    rope = pos.unsqueeze(0).repeat(3, 1, 1) + 2
    for r in image_rows:
        n = lengths[r]
        rope[1, r, :n] = torch.from_numpy(rng.integers(0, A_POS - 1, n))
        rope[2, r, :n] = torch.from_numpy(rng.integers(0, A_POS - 1, n))
    return pos, rope


def test_per_token_rotary_lowers_to_rotary_embedding_and_gqa(mrope_graphs):
    module, lowered, spec, n = mrope_graphs
    assert n == len(A_WINDOWS)
    ops = [(nd.domain, nd.op_type) for nd in lowered.graph.node]
    assert not any(d == DOMAIN for d, _ in ops) and not any(f.domain == DOMAIN for f in lowered.functions)
    assert ops.count(("", "RotaryEmbedding")) == 2 * len(A_WINDOWS)  # q and k of each layer
    for nd in lowered.graph.node:
        if nd.op_type == "GroupQueryAttention":
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nd.attribute}
            assert attrs["do_rotary"] == 0 and len(nd.input) == 7  # no cos/sin: q and k come rotated
            assert all(i.endswith("_rotated") for i in nd.input[:2])
    assert [t.role for t in spec.outputs].count("present_key") == len(A_WINDOWS)


def test_per_token_rotary_lowered_matches_torch_over_prefill_and_decode(mrope_graphs):
    module, lowered, spec, _ = mrope_graphs
    from graphkiln.ops.attention import write_rows

    sess = _session(lowered)
    names = [o.name for o in sess.get_outputs()]
    rng = np.random.default_rng(3)
    lengths = [6, 4]  # ragged prefill: row 1 padded, its padding continuing its positions
    cache_t = [torch.zeros(2, A_NKV, A_CACHE, A_D) for _ in range(2 * len(A_WINDOWS))]
    cache_o = [c.numpy().copy() for c in cache_t]
    starts, seq = [0, 0], 6
    for step in range(4):
        image_rows = (0, 1) if step == 0 else ()
        pos, rope = _step_inputs(rng, starts, lengths, seq, image_rows)
        x = torch.from_numpy(rng.standard_normal((2, seq, A_HID)).astype(np.float32))
        with torch.no_grad():
            want = module(x, pos, rope, *cache_t)
        feeds = {"hidden_states": x.numpy(), "position_ids": pos.numpy(), "rope_position_ids": rope.numpy(),
                 "seq_lens": np.array(lengths, np.int64),
                 "total_sequence_length": np.array(max(s + n for s, n in zip(starts, lengths)), np.int32)}
        feeds.update(full_length_windows(feeds))
        feeds.update({f"past_{kind}.{i}": cache_o[2 * i + j] for i in range(len(A_WINDOWS))
                      for j, kind in enumerate(("key", "value"))})
        got = dict(zip(names, sess.run(None, feeds)))
        for r, n in enumerate(lengths):  # padding tokens' outputs are not part of the contract
            assert _rel(got["hidden_out"][r, :n], want[0][r, :n].numpy()) <= RTOL, (step, r)
        real = [p[:n] for p, n in zip(pos, lengths)]
        for i in range(len(A_WINDOWS)):
            for j, kind in enumerate(("key", "value")):
                rows = want[1 + 2 * i + j]
                for r, p in enumerate(real):  # the reference's cache: each row's real rows written
                    cache_t[2 * i + j][r:r + 1] = write_rows(cache_t[2 * i + j][r:r + 1], rows[r:r + 1, :, :len(p)],
                                                             p.unsqueeze(0))
                present = got[f"present_{kind}.{i}"]
                for r, p in enumerate(real):
                    want_rows = cache_t[2 * i + j][r][:, p].numpy()
                    assert _rel(present[r][:, p.numpy()], want_rows) <= RTOL, (step, kind, i, r)
                cache_o[2 * i + j] = present
        starts = [s + n for s, n in zip(starts, lengths)]
        lengths, seq = [1, 1], 1  # decode: rows at different lengths


def test_per_token_rotary_casts_cos_sin_once_for_every_layer():
    """fp16: cos/sin (fp32, computed in the graph) are cast to the query's type once, not per
    layer; the lowered prefill agrees with the function body within fp16 rounding."""
    module = _MRoPEAttention(dtype=torch.float16)
    spec = _attention_spec("float16")
    model = _export_attention(module, spec)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    _, n = lower_attention_for_onnxruntime(lowered, spec)
    assert n == len(A_WINDOWS)
    casts = [nd for nd in lowered.graph.node if nd.op_type == "Cast" and nd.name.endswith(".as_float16")]
    assert len(casts) == 2  # cos and sin
    rng = np.random.default_rng(5)
    pos, rope = _step_inputs(rng, [0], [5], 5, image_rows=(0,))
    x = rng.standard_normal((1, 5, A_HID)).astype(np.float16)
    feeds = {"hidden_states": x, "position_ids": pos.numpy(), "rope_position_ids": rope.numpy()}
    feeds.update({t.name: np.zeros((1, A_NKV, A_CACHE, A_D), np.float16) for t in spec.inputs if t.layer is not None})
    want = _session(model).run(None, feeds)[0]
    lengths = {"seq_lens": np.array([5]), "total_sequence_length": np.array(5, np.int32)}
    got = _session(lowered).run(None, {**feeds, **lengths, **full_length_windows({**feeds, **lengths})})[0]
    assert got.dtype == np.float16 and _rel(got, want) < 3e-3


def test_a_lookahead_input_keeps_the_function():
    """GQA has no lookahead: a node fed a non-constant one (Gemma3's images) is not lowered,
    and the graph is left as it was (rows contract, the op's function)."""
    module = _MRoPEAttention(lookahead_input=True)
    spec = _attention_spec("float32", lookahead_input=True)
    model = _export_attention(module, spec)
    before = model.SerializeToString()
    new_spec, n = lower_attention_for_onnxruntime(model, spec)
    assert n == 0 and new_spec == spec and model.SerializeToString() == before
