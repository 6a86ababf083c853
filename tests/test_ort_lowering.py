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

# (top_k, scoring, normalize, norm_eps, routed_scaling)
VARIANTS = {
    "softmax_norm": (2, 0, 1, 0.0, 1.0),  # Qwen3-MoE norm_topk_prob=True, Mixtral
    "softmax_nonorm": (2, 0, 0, 0.0, 1.0),  # Qwen3-MoE norm_topk_prob=False
    "softmax_norm_eps_scaled": (2, 0, 1, 1e-6, 1.5),
    "sigmoid_bias_norm_eps": (2, 1, 1, 1e-6, 1.0),  # LFM2-MoE
    "sigmoid_bias_nonorm_scaled": (3, 1, 0, 0.0, 2.5),
    "sigmoid_bias_norm_scaled": (4, 1, 1, 0.0, 2.0),
    "sigmoid_top1": (1, 1, 1, 0.0, 1.0),
    "softmax_all_experts": (E, 0, 0, 0.0, 1.0),
}


class _MoE(torch.nn.Module):
    """``layers`` graphkiln.MoE layers with residuals; weights are parameters (-> initializers)."""

    def __init__(self, cfg, seed=0, dtype=torch.float32, zero_bias=False, layers=1):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.gu = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, 2 * I, H, generator=g) * 0.3).to(dtype)) for _ in range(layers)])
        self.dn = torch.nn.ParameterList(
            [torch.nn.Parameter((torch.randn(E, H, I, generator=g) * 0.3).to(dtype)) for _ in range(layers)])
        bias = [torch.zeros(E) if zero_bias else torch.randn(E, generator=g) * 0.2 for _ in range(layers)]
        self.b = torch.nn.ParameterList([torch.nn.Parameter(b) for b in bias])

    def forward(self, h, lg):
        for gu, dn, b in zip(self.gu, self.dn, self.b):
            h = h + torch.ops.graphkiln.moe(h, lg, gu, dn, b, *self.cfg)
        return h


class _MoEInputs(torch.nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def forward(self, h, lg, gu, dn, b):
        return torch.ops.graphkiln.moe(h, lg, gu, dn, b, *self.cfg)


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


def _check_structure(model: onnx.ModelProto, n_moe: int = 1) -> None:
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
            assert a["activation_alpha"] == 1.0 and a["activation_beta"] == 0.0 and "swiglu_limit" not in a


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_lowered_matches_dense_function(variant):
    cfg = VARIANTS[variant]
    module = _MoE(cfg, seed=len(variant))
    model = _export(module, tuple(torch.from_numpy(v) for v in _feeds(5).values()))
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered)
    names = {t.name for t in lowered.graph.initializer}
    assert not any(name.startswith("gu") and "ort_interleaved" not in name for name in names)  # original dropped
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


def test_weights_as_graph_inputs():
    """gate_up that is not an initializer is interleaved inside the graph."""
    cfg = VARIANTS["softmax_norm_eps_scaled"]
    rng = np.random.default_rng(7)
    w = {"gu": (rng.standard_normal((E, 2 * I, H)) * 0.3).astype(np.float32),
         "dn": (rng.standard_normal((E, H, I)) * 0.3).astype(np.float32),
         "b": (rng.standard_normal(E) * 0.2).astype(np.float32)}
    args = tuple(torch.from_numpy(v) for v in (*_feeds(5).values(), *w.values()))
    model = _export(_MoEInputs(cfg), args)
    assert not model.graph.initializer
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered)
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


def test_float16_and_bfloat16():
    """float16 lowers (ORT MoE has a float16 CPU kernel); bfloat16 has none and is left alone."""
    cfg = VARIANTS["sigmoid_bias_norm_eps"]
    module = _MoE(cfg, seed=9, dtype=torch.float16)
    model = _export(module, (torch.from_numpy(_feeds(5, np.float16)["h"]), torch.from_numpy(_feeds(5)["lg"])))
    lowered, n = _lowered(model)
    assert n == 1
    _check_structure(lowered)
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


def test_no_moe_is_a_no_op():
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    m = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 23)])
    before = m.SerializeToString()
    assert lower_moe_for_onnxruntime(m) == 0
    assert m.SerializeToString() == before
