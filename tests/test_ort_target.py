"""The onnxruntime export target's graph rewrites, checked on the exported tiny models.

Parity of these artifacts with transformers is in test_parity.py (every case runs for both
targets); here: the portable graph stays free of onnxruntime-only ops, the lowered graph has
the fused kernels it should (GroupQueryAttention with the KV cache in place, fused sibling
MatMuls, SkipSimplifiedLayerNormalization), the manifest describes the changed KV contract,
and the runtime really writes the cache in place.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest

from conftest import PARITY_CASES
from graphkiln.manifest import state_update
from graphkiln.ops.spec import DOMAIN
from graphkiln.runtime import Engine, GenerationConfig

MS = "com.microsoft"


def _ops(case) -> Counter:
    model = onnx.load(str(case.artifact / case.manifest.graphs[0].file), load_external_data=False)
    return Counter((n.domain or "", n.op_type) for n in model.graph.node)


def _head_dim(case) -> int:
    return case.manifest.states[0].head_dim


@pytest.mark.parametrize("name", PARITY_CASES)
def test_portable_graph_has_no_onnxruntime_ops(tiny, name):
    case = tiny(name, "portable")
    ops = _ops(case)
    assert not any(d == MS for d, _ in ops), sorted(ops)
    assert case.manifest.graphs[0].target == "portable"
    attention = [i for i, l in enumerate(case.manifest.states) if l.kind == "kv"]
    assert ops[(DOMAIN, "Attention")] == sum(len(case.manifest.states[i].layers) for i in attention)
    assert all(state_update(case.manifest.graphs[0], s) in ("scatter_rows", "slot_rows") for s in case.manifest.states)


@pytest.mark.parametrize("name", PARITY_CASES)
def test_onnxruntime_graph_uses_fused_kernels(tiny, name):
    case = tiny(name, "onnxruntime")
    ops = _ops(case)
    m = case.manifest
    kv_layers = sorted(l for s in m.states if s.kind == "kv" for l in s.layers)
    names = {t.name for t in m.graphs[0].outputs}
    roles = {t.role for t in m.graphs[0].inputs}
    assert m.graphs[0].target == "onnxruntime"
    if _head_dim(case) % 16 == 0:  # GroupQueryAttention's requirement
        assert ops[(MS, "GroupQueryAttention")] == len(kv_layers)
        assert ops[(DOMAIN, "Attention")] == 0
        assert "Attention" not in {o.name for o in m.custom_ops}
        assert all(state_update(m.graphs[0], s) == "in_place" for s in m.states if s.kind == "kv")
        assert {f"present_key.{i}" for i in kv_layers} <= names and not any(n.startswith("new_key") for n in names)
        assert "seq_lens" in roles
    else:  # left in its portable form, with the portable KV contract
        assert ops[(MS, "GroupQueryAttention")] == 0
        assert ops[(DOMAIN, "Attention")] == len(kv_layers)
        assert all(state_update(m.graphs[0], s) == "scatter_rows" for s in m.states if s.kind == "kv")
    # one residual Add + RMSNorm pair per norm except the first layer's input norm and the final norm
    # (it reads the gathered logits rows); a Nemotron-H block has one sublayer, so one norm
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import read_config

    cfg = family_for(m.model.architecture).parse_config(read_config(case.checkpoint))
    norms = sum((l.mixer != "none") + (l.ffn != "none") for l in cfg.layers) + 1
    assert ops[(MS, "SkipSimplifiedLayerNormalization")] == norms - 2
    # the lowering changes nodes, not weights: the Linear layers are the portable graph's
    assert ops[("", "MatMul")] == _ops(tiny(name, "portable"))[("", "MatMul")]


@pytest.mark.parametrize("target", ["portable", "onnxruntime"])
def test_fused_matmul_counts_for_a_dense_model(tiny, target):
    """llama_gqa_bias (2 layers, biases everywhere): per layer qkv, o, gate_up, down + lm_head,
    q/k/v and gate/up each one Linear in the decoder itself."""
    ops = _ops(tiny("llama_gqa_bias", target))
    assert ops[("", "MatMul")] == 4 * 2 + 1
    # gate/up; q/k/v too in the portable graph, packed into GroupQueryAttention in the lowered one
    assert ops[("", "Split")] == {"portable": 4, "onnxruntime": 2}[target]


def test_kv_cache_is_written_in_place_by_the_graph(tiny):
    """After a request, the pool holds the same keys/values whichever contract wrote them."""
    portable, lowered = tiny("qwen3_mixed_sliding", "portable"), tiny("qwen3_mixed_sliding", "onnxruntime")
    prompts = portable.prompts((7, 3), salt=61)
    engines = [Engine.load(c.artifact) for c in (portable, lowered)]
    results = [e.generate(prompts, GenerationConfig(max_new_tokens=5, do_sample=False, stop_token_ids=()))
               for e in engines]
    assert [r.token_ids for r in results[0]] == [r.token_ids for r in results[1]]
    # both requests ran to the end; the last token's row is never written (it was not fed back)
    for layer in engines[0].pool.keys:
        for b, p in enumerate(prompts):
            n = len(p) + 5 - 1
            for pool_a, pool_b in ((engines[0].pool.keys, engines[1].pool.keys),
                                   (engines[0].pool.values, engines[1].pool.values)):
                a, b_ = pool_a[layer][b, :, :n], pool_b[layer][b, :, :n]
                assert np.abs(a).max() > 0
                np.testing.assert_allclose(b_, a, atol=1e-5)


@pytest.mark.parametrize("scale_type, fused", [(onnx.TensorProto.FLOAT16, 1), (onnx.TensorProto.FLOAT, 0)])
def test_skip_rmsnorm_fuses_only_when_scale_and_activations_share_a_type(scale_type, fused):
    """SkipSimplifiedLayerNormalization takes one type for activations and scale: an fp16 residual
    normed with an fp32 scale stays unfused (onnxruntime refuses to load the fused graph), and
    what is left runs."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from graphkiln.export.lowering.ort_fusions import fuse_skip_rmsnorm

    half = TensorProto.FLOAT16
    scale = numpy_helper.from_array(np.linspace(0.5, 1.5, 8).astype(onnx.helper.tensor_dtype_to_np_dtype(scale_type)), "w")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "y"], ["sum"]),
         helper.make_node("RMSNormalization", ["sum", "w"], ["out"], axis=-1, epsilon=1e-5, stash_type=1)],
        "g", [helper.make_tensor_value_info(n, half, [2, 8]) for n in ("x", "y")],
        [helper.make_tensor_value_info("out", half, [2, 8])], [scale])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    model.ir_version = 11
    assert fuse_skip_rmsnorm(model) == fused
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float16)
    if fused:  # the unfused mixed-type graph is not onnxruntime-CPU's to run either; the fused one is
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        out = session.run(None, {"x": x, "y": x})[0]
        s = (2 * x).astype(np.float32)
        ref = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * np.linspace(0.5, 1.5, 8)
        assert np.abs(out.astype(np.float32) - ref).max() < 1e-2
