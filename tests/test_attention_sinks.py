"""Attention sinks (gpt-oss) in ``graphkiln.Attention``: ``use_sinks=1`` with ``sinks`` [Nq].

* the op's reference against transformers' own gpt-oss attention (``eager_attention_forward``
  with ``module.sinks``, its rotary and its causal / sliding-window masks), for a batch of rows
  with different cache lengths, prefill and decode, full and sliding layers;
* the onnxruntime lowering: sinks go to GroupQueryAttention's ``head_sink`` (cast to the
  query's type), a node without sinks lowers to the very GQA node it lowered to before the
  input existed (no head_sink, its unread zero constant dropped), and the lowered graph follows
  the torch module over a ragged prefill and decode steps, with its present caches fed back.

The documented semantics in both faces (torch reference, ONNX function) are in
test_custom_ops.py (``test_attention_sinks_match_documented_semantics``), the Triton kernel's
in test_trt_kernels_attention.py (``SINKS_CASES``).
"""

from __future__ import annotations

import types

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from graphkiln.export.custom_ops import registry as R  # noqa: E402
from graphkiln.export.lowering.ort_attention import full_length_windows, lower_attention_for_onnxruntime  # noqa: E402
from graphkiln.manifest import GraphSpec, TensorSpec  # noqa: E402
from graphkiln.ops.attention import reference, write_rows  # noqa: E402
from graphkiln.ops.spec import DOMAIN  # noqa: E402

NQ, NKV, D, POSITIONS = 4, 2, 16, 64
RTOL = 1e-5  # max |got - want| / max |want|


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _tables():
    inv = 1.0 / (500.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(POSITIONS, dtype=torch.float32).unsqueeze(1) * inv
    return freqs.cos(), freqs.sin()


# ----------------------------------------------------------------------------------------------
# the reference against transformers' gpt-oss attention


def _hf_attention(q, k, v, past_key, past_value, position_ids, cos_t, sin_t, sinks, window: int, scale: float):
    """transformers' GptOssAttention after its projections, row by row (each row's own cache
    length): its rotary, its mask functions, ``eager_attention_forward`` with ``module.sinks``."""
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb, eager_attention_forward

    module = types.SimpleNamespace(sinks=sinks, num_key_value_groups=NQ // NKV, training=False)
    mask_fn = and_masks(sliding_window_overlay(window), causal_mask_function) if window else causal_mask_function
    b, s, _ = q.shape
    out = torch.empty_like(q)
    new_k = torch.empty(b, NKV, s, D)
    for r in range(b):
        start = int(position_ids[r, 0])
        cos, sin = cos_t[position_ids[r]][None], sin_t[position_ids[r]][None]  # [1, S, D/2]
        qh = q[r].view(1, s, NQ, D).transpose(1, 2)
        kh = k[r].view(1, s, NKV, D).transpose(1, 2)
        qh, kh = apply_rotary_pos_emb(qh, kh, cos, sin)
        keys = torch.cat((past_key[r:r + 1, :, :start], kh), dim=2)
        values = torch.cat((past_value[r:r + 1, :, :start], v[r].view(1, s, NKV, D).transpose(1, 2)), dim=2)
        q_idx = torch.arange(start, start + s).unsqueeze(1)
        kv_idx = torch.arange(start + s).unsqueeze(0)
        visible = mask_fn(torch.tensor(0), torch.tensor(0), q_idx, kv_idx)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        attn, _ = eager_attention_forward(module, qh, keys, values, mask, scale)
        out[r] = attn.reshape(s, NQ * D)
        new_k[r] = kh[0]
    return out, new_k


def _step(seed: int, starts, seq: int, cache: int = 12):
    g = torch.Generator().manual_seed(seed)
    b = len(starts)
    pos = torch.tensor(starts).unsqueeze(1) + torch.arange(seq)
    past_k = torch.randn(b, NKV, cache, D, generator=g)
    past_v = torch.randn(b, NKV, cache, D, generator=g)
    for r, st in enumerate(starts):  # positions >= start are not the row's history
        past_k[r, :, st:], past_v[r, :, st:] = 1e4, -1e4
    cos, sin = _tables()
    return (torch.randn(b, seq, NQ * D, generator=g), torch.randn(b, seq, NKV * D, generator=g),
            torch.randn(b, seq, NKV * D, generator=g), past_k, past_v, pos, cos, sin,
            torch.zeros(1, 1, dtype=torch.int64), torch.randn(NQ, generator=g) * 2.0)


@pytest.mark.parametrize("window", [0, 4], ids=["full", "sliding"])
@pytest.mark.parametrize("starts,seq", [((0, 3, 7), 5), ((1, 6, 11), 1)], ids=["prefill_after_cache", "decode"])
def test_reference_is_transformers_gpt_oss_attention(window, starts, seq):
    inputs = _step(len(starts) * seq + window, starts, seq)
    q, k, v, past_k, past_v, pos, cos, sin, lookahead, sinks = inputs
    scale = D ** -0.5
    want_out, want_k = _hf_attention(q, k, v, past_k, past_v, pos, cos, sin, sinks, window, scale)
    out, new_k, _ = reference(*inputs, NQ, NKV, window, scale, use_sinks=1)
    assert _rel(out, want_out) <= RTOL
    assert _rel(new_k, want_k) <= RTOL
    # teeth: without its sinks the op is plain attention, far from gpt-oss's
    plain = reference(*inputs, NQ, NKV, window, scale)[0]
    assert _rel(plain, want_out) > 1e-2
    if window and seq > 1:  # the window cuts some keys off: the sliding case is not the full one
        assert _rel(reference(*inputs, NQ, NKV, 0, scale, use_sinks=1)[0], want_out) > 1e-3


# ----------------------------------------------------------------------------------------------
# the onnxruntime lowering: head_sink

HID, CACHE = 32, 16
LAYERS = ((4, True), (0, True), (0, False))  # (window, sinks): sliding + sinks, full + sinks, a plain layer


class _SinkLayers(torch.nn.Module):
    """Residual graphkiln.Attention layers as models.decoder calls them: sinks a parameter (the
    model's dtype) passed as fp32 with use_sinks=1, or a constant zero with use_sinks=0."""

    def __init__(self, dtype=torch.float32, rope_layout: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(21)

        def w(*shape, scale=0.3):
            return torch.nn.Parameter((torch.randn(*shape, generator=g) * scale).to(dtype))

        self.wq = torch.nn.ParameterList([w(HID, NQ * D) for _ in LAYERS])
        self.wk = torch.nn.ParameterList([w(HID, NKV * D) for _ in LAYERS])
        self.wv = torch.nn.ParameterList([w(HID, NKV * D) for _ in LAYERS])
        self.wo = torch.nn.ParameterList([w(NQ * D, HID) for _ in LAYERS])
        self.sinks = torch.nn.ParameterList([w(NQ, scale=2.0) for _ in LAYERS])
        cos, sin = _tables()
        self.cos_t, self.sin_t = torch.nn.Buffer(cos), torch.nn.Buffer(sin)
        self.rope_layout = rope_layout

    def forward(self, hidden_states, position_ids, *states):
        cos, sin = self.cos_t, self.sin_t
        if self.rope_layout:  # per-token values computed by the graph (as M-RoPE's are)
            cos, sin = cos[position_ids], sin[position_ids]
        lookahead = torch.zeros(1, 1, dtype=torch.int64)
        x, new = hidden_states, []
        for i, (window, has_sinks) in enumerate(LAYERS):
            sinks, use = (self.sinks[i].float(), 1) if has_sinks else (torch.zeros(NQ), 0)
            out, nk, nv = torch.ops.graphkiln.attention(
                x @ self.wq[i], x @ self.wk[i], x @ self.wv[i], states[2 * i], states[2 * i + 1], position_ids, cos,
                sin, lookahead, sinks, NQ, NKV, window, D ** -0.5, 0, self.rope_layout, use)
            x = x + out @ self.wo[i]
            new += [nk, nv]
        return (x, *new)


def _spec(dtype: str) -> GraphSpec:
    ins = [TensorSpec("hidden_states", dtype, ("batch", "seq", HID), "hidden_states"),
           TensorSpec("position_ids", "int64", ("batch", "seq"), "position_ids")]
    outs = [TensorSpec("hidden_out", dtype, ("batch", "seq", HID), "hidden_states")]
    for i in range(len(LAYERS)):
        for kind in ("key", "value"):
            ins.append(TensorSpec(f"past_{kind}.{i}", dtype, ("batch", NKV, "cache_len", D), f"past_{kind}", i))
            outs.append(TensorSpec(f"new_{kind}.{i}", dtype, ("batch", NKV, "seq", D), f"new_{kind}", i))
    return GraphSpec(name="stage0", file="stage0.onnx", inputs=tuple(ins), outputs=tuple(outs), opset=23)


def _export(module, spec: GraphSpec) -> onnx.ModelProto:
    R.register_torch_ops()
    b, s, c = torch.export.Dim("B"), torch.export.Dim("S"), torch.export.Dim("C")
    dtype = module.wq[0].dtype
    args = [torch.zeros(2, 3, HID, dtype=dtype), torch.arange(3).repeat(2, 1)]
    args += [torch.zeros(2, NKV, 5, D, dtype=dtype) for _ in range(2 * len(LAYERS))]
    dyn = ({0: b, 1: s}, {0: b, 1: s}, tuple({0: b, 2: c} for _ in range(2 * len(LAYERS))))
    prog = torch.onnx.export(module.eval(), tuple(args), dynamo=True, opset_version=23, verbose=False,
                             input_names=[t.name for t in spec.inputs], output_names=[t.name for t in spec.outputs],
                             custom_translation_table=R.translation_table(), dynamic_shapes=dyn)
    R.attach_functions(prog.model)
    return prog.model_proto


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module", params=[0, 1], ids=["tables", "per_token_rotary"])
def graphs(request):
    """(module, portable model, lowered model, lowered spec, rewritten nodes) in fp32."""
    module = _SinkLayers(rope_layout=request.param)
    spec = _spec("float32")
    portable = _export(module, spec)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(portable)
    new_spec, n = lower_attention_for_onnxruntime(lowered, spec)
    return module, portable, lowered, new_spec, n


def test_sinks_go_to_head_sink_and_plain_nodes_lower_as_before(graphs):
    module, portable, lowered, spec, n = graphs
    assert n == len(LAYERS)
    assert not any(nd.domain == DOMAIN for nd in lowered.graph.node)
    attention = [nd for nd in portable.graph.node if nd.domain == DOMAIN and nd.op_type == "Attention"]
    gqa = [nd for nd in lowered.graph.node if nd.op_type == "GroupQueryAttention"]
    per_token = module.rope_layout == 1
    for node, lowered_node, (window, has_sinks) in zip(attention, gqa, LAYERS):
        sinks = node.input[9]
        # a sliding layer's GQA rotates at the absolute positions (input 9): its cache is window-sized
        positions = [node.input[5]] if window and not per_token else []
        if has_sinks:
            assert len(lowered_node.input) == 12 and lowered_node.input[11] == sinks  # fp32 already: no cast
            assert list(lowered_node.input[7:11]) == (["", "", "", ""] if per_token else [node.input[6], node.input[7],
                                                                                          *(positions or [""]), ""])
        else:  # the node this pass wrote before sinks existed, and its zero constant is gone
            assert len(lowered_node.input) == (7 if per_token else 9 + len(positions))
            assert sinks not in {t.name for t in lowered.graph.initializer}
            assert sinks not in {o for nd in lowered.graph.node for o in nd.output}
    onnx.checker.check_model(lowered)


def test_lowered_sinks_follow_torch_over_prefill_and_decode(graphs):
    module, portable, lowered, spec, _ = graphs
    sess, plain = _session(lowered), _session(portable)
    names = [o.name for o in sess.get_outputs()]
    rng = np.random.default_rng(7)
    lengths = [7, 4]  # ragged prefill from empty caches (GQA's prefill contract), row 1 padded
    cache_t = [torch.zeros(2, NKV, CACHE, D) for _ in range(2 * len(LAYERS))]
    cache_o = [c.numpy().copy() for c in cache_t]
    starts, seq = [0, 0], 7
    for step in range(4):  # prefill, then decode steps with rows at different lengths (window 4 slides)
        pos = torch.tensor(starts).unsqueeze(1) + torch.arange(seq)
        x = torch.from_numpy(rng.standard_normal((2, seq, HID)).astype(np.float32))
        with torch.no_grad():
            want = module(x, pos, *cache_t)
        feeds = {"hidden_states": x.numpy(), "position_ids": pos.numpy(), "seq_lens": np.array(lengths, np.int64),
                 "total_sequence_length": np.array(max(s + n for s, n in zip(starts, lengths)), np.int32)}
        feeds.update(full_length_windows(feeds))
        feeds.update({f"past_{kind}.{i}": cache_o[2 * i + j] for i in range(len(LAYERS))
                      for j, kind in enumerate(("key", "value"))})
        got = dict(zip(names, sess.run(None, feeds)))
        if step == 0:  # the portable graph (the op's function) on the same step
            portable_out = plain.run(["hidden_out"], {k: v for k, v in feeds.items()
                                                      if k not in ("seq_lens", "total_sequence_length",
                                                                   "window_offset", "window_total_sequence_length")})[0]
            for r, n in enumerate(lengths):
                assert _rel(portable_out[r, :n], want[0][r, :n].numpy()) <= RTOL, ("portable", r)
        for r, n in enumerate(lengths):  # padding tokens' outputs are not part of the contract
            assert _rel(got["hidden_out"][r, :n], want[0][r, :n].numpy()) <= RTOL, (step, r)
        real = [p[:n] for p, n in zip(pos, lengths)]
        for i in range(len(LAYERS)):
            for j, kind in enumerate(("key", "value")):
                rows = want[1 + 2 * i + j]
                for r, p in enumerate(real):
                    cache_t[2 * i + j][r:r + 1] = write_rows(cache_t[2 * i + j][r:r + 1], rows[r:r + 1, :, :len(p)],
                                                             p.unsqueeze(0))
                present = got[f"present_{kind}.{i}"]
                for r, p in enumerate(real):
                    assert _rel(present[r][:, p.numpy()], cache_t[2 * i + j][r][:, p].numpy()) <= RTOL
                cache_o[2 * i + j] = present
        starts = [s + n for s, n in zip(starts, lengths)]
        lengths, seq = [1, 1], 1


def test_fp16_sinks_are_cast_to_the_query_type():
    """fp16: GQA's head_sink has the query's type; the fp32 sinks (the fp16 parameter, cast by
    the model) are cast back, exactly; the lowered prefill agrees with the function body."""
    module = _SinkLayers(dtype=torch.float16)
    spec = _spec("float16")
    model = _export(module, spec)
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    _, n = lower_attention_for_onnxruntime(lowered, spec)
    assert n == len(LAYERS)
    gqa = [nd for nd in lowered.graph.node if nd.op_type == "GroupQueryAttention"]
    casts = {nd.output[0]: nd for nd in lowered.graph.node if nd.op_type == "Cast"}
    for node, (_, has_sinks) in zip(gqa, LAYERS):
        if has_sinks:
            cast = casts[node.input[11]]
            assert onnx.helper.get_attribute_value(cast.attribute[0]) == onnx.TensorProto.FLOAT16
        else:
            assert len(node.input) == 9
    rng = np.random.default_rng(5)
    pos = torch.arange(6).unsqueeze(0)
    feeds = {"hidden_states": rng.standard_normal((1, 6, HID)).astype(np.float16), "position_ids": pos.numpy()}
    feeds.update({t.name: np.zeros((1, NKV, CACHE, D), np.float16) for t in spec.inputs if t.layer is not None})
    want = _session(model).run(None, feeds)[0]
    lengths = {"seq_lens": np.array([6]), "total_sequence_length": np.array(6, np.int32)}
    got = _session(lowered).run(None, {**feeds, **lengths, **full_length_windows({**feeds, **lengths})})[0]
    assert got.dtype == np.float16 and _rel(got, want) < 3e-3
