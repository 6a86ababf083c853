"""graphkiln custom ops: every face of every op agrees, and the ops match the layers they replace.

A custom op (``graphkiln.export.custom_ops``) has four faces that must agree:

* torch: ``registry.torch_op(name)`` (the module's ``reference``), what the model code calls;
* ONNX: one node in the ``graphkiln`` domain that onnxruntime runs through the attached
  model-local function (``onnx_function``);
* the ONNX schema registered for checkers (``register_onnx_schemas``);
* the TensorRT plugin identity (``plugin_namespace::Name``, ``plugin_version``) carried on the node.

Every op in ``registry.specs()`` needs an entry in ``OP_CASES`` (a test fails otherwise), which
the generic face tests run on random inputs. Op-specific tests then compare the ops with the
transformers layers they replace (Qwen3-MoE, Mixtral and LFM2-MoE sparse blocks; LFM2's short
convolution) and with the semantics their docstrings state, for the torch reference and the
onnxruntime-run function alike.

Exported ONNX models are shared through the module-scoped ``exported`` cache (one export per op
configuration, dynamic token/batch/sequence dims), so the whole file runs in about half a minute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphkiln.export.custom_ops import registry as R
from graphkiln.ops.spec import DOMAIN
from reference import assert_close

OPSET = 23
FACES = ("torch", "onnx")

# MoE sizes: hidden, experts, expert intermediate size, experts per token
H, E, I, TOP_K = 32, 8, 16, 2
# ShortConv sizes: channels, kernel, slots in the state pool
C, K, SLOTS = 16, 3, 4
# Attention sizes: query heads, kv heads, head dim, rotary table positions
NQ, NKV, D, POSITIONS = 4, 2, 16, 64
# GatedDeltaRule sizes: q/k heads, value heads (a multiple), key and value head dims (different,
# so a transposed state shows); its pool has SLOTS slots
GHK, GHV, GDK, GDV = 2, 4, 8, 6
# SsmScan sizes: heads, head dim, groups (three heads each), state size (N != P, so a transposed
# state shows); its pool has SLOTS slots
SH, SP, SG, SN = 6, 3, 2, 5

MOE_ATTRS = ("top_k", "scoring", "normalize", "norm_eps", "routed_scaling", "activation", "alpha", "limit")


# ----------------------------------------------------------------------------------------------
# helpers


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, *shape, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _np(t):
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


class OpModule(torch.nn.Module):
    """Calls one custom op with fixed attributes; every tensor input is a graph input."""

    def __init__(self, name: str, attrs: tuple):
        super().__init__()
        self.op = R.torch_op(name)
        self.attrs = attrs

    def forward(self, *inputs):
        return self.op(*inputs, *self.attrs)


@dataclass
class Exported:
    model: object  # onnx.ModelProto
    session: object  # onnxruntime.InferenceSession | None
    session_error: str | None
    used: list  # what attach_functions returned

    def run(self, *inputs) -> list[np.ndarray]:
        if self.session is None:
            raise RuntimeError(f"onnxruntime could not load the exported model: {self.session_error}")
        feeds = {i.name: _np(x) for i, x in zip(self.session.get_inputs(), inputs)}
        assert len(feeds) == len(inputs), "graph inputs and op inputs differ in number"
        return self.session.run(None, feeds)


def _export(module: torch.nn.Module, args: tuple, dynamic_shapes) -> Exported:
    import onnxruntime as ort

    if isinstance(module, OpModule):  # forward(*inputs): one varargs entry holding every input's dims
        dynamic_shapes = (dynamic_shapes,)
    prog = torch.onnx.export(module.eval(), args, dynamo=True, opset_version=OPSET, verbose=False,
                             custom_translation_table=R.translation_table(), dynamic_shapes=dynamic_shapes)
    used = R.attach_functions(prog.model)
    model = prog.model_proto
    try:
        session, error = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), None
    except Exception as e:  # kept so the fp16 test can skip with the reason; fp32 tests fail on it
        session, error = None, f"{type(e).__name__}: {e}"
    return Exported(model, session, error, used)


@pytest.fixture(scope="module")
def exported():
    """Factory: ``exported(key, make)`` -> Exported, exporting ``make()``'s (module, args, dyn) once per file."""
    cache: dict = {}

    def get(key, make: Callable[[], tuple]) -> Exported:
        if key not in cache:
            cache[key] = _export(*make())
        return cache[key]

    return get


# ----------------------------------------------------------------------------------------------
# op cases: inputs, attributes and dynamic dims per op (every op in registry.specs() needs one)


def moe_inputs(gen, tokens: int, dtype=torch.float32, bias_scale: float = 0.3, activation: int = 0,
               expert_biases: bool = True, weight_scale: float = 0.3):
    """hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias; gate_up has
    I rows per expert for the non-gated activation 1, else 2I; the expert biases are random
    (zeros with ``expert_biases`` False, what bias-free models pass)."""
    f = I if activation == 1 else 2 * I
    ins = (_randn(gen, tokens, H, dtype=dtype),  # hidden
           _randn(gen, tokens, E, scale=1.5, dtype=dtype),  # router_logits
           _randn(gen, E, f, H, scale=weight_scale, dtype=dtype),  # gate_up
           _randn(gen, E, H, I, scale=0.3, dtype=dtype),  # down
           _randn(gen, E, scale=bias_scale))  # expert_bias (fp32, as the models keep it)
    biases = (_randn(gen, E, f, scale=0.5, dtype=dtype), _randn(gen, E, H, scale=0.5, dtype=dtype))
    if not expert_biases:
        biases = tuple(torch.zeros_like(b) for b in biases)
    return ins + biases


def short_conv_inputs(gen, batch: int, seq: int, dtype=torch.float32, index_dtype=torch.int64):
    slot_idx = torch.randperm(SLOTS, generator=gen)[:batch].to(index_dtype)
    seq_lens = torch.randint(0, seq + 1, (batch,), generator=gen).to(index_dtype)
    seq_lens[0] = seq  # at least one full row
    return (_randn(gen, batch, seq, C, dtype=dtype), _randn(gen, C, K, scale=0.5, dtype=dtype),
            _randn(gen, C, dtype=dtype), _randn(gen, SLOTS, C, K - 1, dtype=dtype), slot_idx, seq_lens)


def gated_delta_inputs(gen, batch: int, seq: int, dtype=torch.float32, index_dtype=torch.int64):
    """q, k, v (activations), g <= 0 and beta in (0, 1) (fp32, as the models compute them), a
    nonzero pool, distinct slots and ragged lengths (row 0 full)."""
    slot_idx = torch.randperm(SLOTS, generator=gen)[:batch].to(index_dtype)
    seq_lens = torch.randint(0, seq + 1, (batch,), generator=gen).to(index_dtype)
    seq_lens[0] = seq
    return (_randn(gen, batch, seq, GHK, GDK, dtype=dtype), _randn(gen, batch, seq, GHK, GDK, dtype=dtype),
            _randn(gen, batch, seq, GHV, GDV, dtype=dtype),
            -F.softplus(_randn(gen, batch, seq, GHV)) * 0.7, torch.sigmoid(_randn(gen, batch, seq, GHV)),
            _randn(gen, SLOTS, GHV, GDK, GDV, scale=0.5, dtype=dtype), slot_idx, seq_lens)


def ssm_scan_inputs(gen, batch: int, seq: int, dtype=torch.float32, index_dtype=torch.int64):
    """x, dt, Bm, Cm (activations), A < 0, D and dt_bias (fp32, as the TensorRT plugin reads
    them), a nonzero pool [slots, H, N, P], distinct slots and ragged lengths (row 0 full)."""
    slot_idx = torch.randperm(SLOTS, generator=gen)[:batch].to(index_dtype)
    seq_lens = torch.randint(0, seq + 1, (batch,), generator=gen).to(index_dtype)
    seq_lens[0] = seq
    return (_randn(gen, batch, seq, SH, SP, dtype=dtype), _randn(gen, batch, seq, SH, dtype=dtype),
            -torch.exp(torch.rand(SH, generator=gen) * 2.0), _randn(gen, batch, seq, SG, SN, dtype=dtype),
            _randn(gen, batch, seq, SG, SN, dtype=dtype), _randn(gen, SH), _randn(gen, SH, scale=1.5) - 1.0,
            _randn(gen, SLOTS, SH, SN, SP, scale=0.5, dtype=dtype), slot_idx, seq_lens)


def attention_inputs(gen, batch: int, seq: int, cache: int, window: int = 0, dtype=torch.float32):
    """Rows with different numbers of cached tokens (start_b in 0..cache; row 0 has none); the
    cache beyond each row's start holds garbage that must not be read; each new token looks
    0..2 positions ahead (lookahead [B, S]), so every face is checked with the mask it opens;
    sinks fp32 [Nq] random, which the op must not read unless use_sinks=1."""
    lookahead = torch.randint(0, 3, (batch, seq), generator=gen)
    starts = torch.randint(0, cache + 1, (batch,), generator=gen)
    starts[0] = 0
    position_ids = starts.unsqueeze(1) + torch.arange(seq)
    inv = 1.0 / (100.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    freqs = torch.arange(POSITIONS, dtype=torch.float32).unsqueeze(1) * inv
    scaling = 1.3  # a rope attention scaling folded into the tables (yarn-style)
    return (_randn(gen, batch, seq, NQ * D, dtype=dtype), _randn(gen, batch, seq, NKV * D, dtype=dtype),
            _randn(gen, batch, seq, NKV * D, dtype=dtype), _randn(gen, batch, NKV, cache, D, dtype=dtype),
            _randn(gen, batch, NKV, cache, D, dtype=dtype), position_ids,
            freqs.cos() * scaling, freqs.sin() * scaling, lookahead, _randn(gen, NQ, scale=2.0))


def naive_attention(q, k, v, past_key, past_value, position_ids, cos_cache, sin_cache, lookahead, sinks, window: int,
                    scale: float, rope_layout: int = 0, use_sinks: int = 0):
    """The op's documented semantics, one row, head and token at a time, in float64 numpy
    (with use_sinks, sinks[h] is one more logit of head h's softmax, its weight dropped)."""
    q, k, v, pk, pv, pos, cos_t, sin_t = (_np(x).astype(np.float64) if i != 5 else _np(x)
                                          for i, x in enumerate((q, k, v, past_key, past_value, position_ids,
                                                                 cos_cache, sin_cache)))
    ahead = np.broadcast_to(_np(lookahead), pos.shape)
    b, s, _ = q.shape
    nkv, d = pk.shape[1], pk.shape[3]
    nq = q.shape[2] // d
    out = np.zeros_like(q)
    new_k = np.zeros((b, nkv, s, d))
    new_v = np.zeros((b, nkv, s, d))

    def rot(x, r, t):  # token t of row b: the table at its position, or (layout 1) its own values
        half_c, half_s = (cos_t[r, t], sin_t[r, t]) if rope_layout else (cos_t[pos[r, t]], sin_t[pos[r, t]])
        c, sn = np.concatenate([half_c] * 2), np.concatenate([half_s] * 2)
        return x * c + np.concatenate([-x[d // 2:], x[: d // 2]]) * sn

    for r in range(b):
        start = pos[r, 0]
        for t in range(s):
            for j in range(nkv):
                new_k[r, j, t] = rot(k[r, t, j * d:(j + 1) * d], r, t)
                new_v[r, j, t] = v[r, t, j * d:(j + 1) * d]
        for t in range(s):
            p = pos[r, t]
            for h in range(nq):
                j = h // (nq // nkv)
                qh = rot(q[r, t, h * d:(h + 1) * d], r, t)
                keys = [(pk[r, j, c], pv[r, j, c], c) for c in range(start)]
                keys += [(new_k[r, j, u], new_v[r, j, u], pos[r, u]) for u in range(s)]
                keys = [(kk, vv) for kk, vv, kp in keys if kp <= p + ahead[r, t] and (window == 0 or kp > p - window)]
                sc = np.array([qh @ kk for kk, _ in keys]) * scale
                sink = float(_np(sinks)[h]) if use_sinks else -np.inf
                top = max(sc.max(), sink)
                w = np.exp(sc - top)
                w /= w.sum() + np.exp(sink - top)
                out[r, t, h * d:(h + 1) * d] = sum(wi * vv for wi, (_, vv) in zip(w, keys))
    return out, new_k, new_v


def _attention_dyn(rope_layout: int = 0):
    b, s, c = torch.export.Dim("B"), torch.export.Dim("S"), torch.export.Dim("C")
    rope = {0: b, 1: s} if rope_layout else None  # per-token [B, S, D/2], or a table
    return ({0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}, {0: b, 2: c}, {0: b, 2: c}, {0: b, 1: s}, rope, rope,
            {0: b, 1: s}, None)


def attention_export(exported, window: int, scale: float, kv_update: int = 0, rope_layout: int = 0,
                     use_sinks: int = 0) -> Exported:
    """The op alone with these attributes, exported once per file (lookahead a [B, S] input)."""
    attrs = (NQ, NKV, window, scale, kv_update, rope_layout, use_sinks)

    def make():
        inputs = list(attention_inputs(_gen(0), 3, 4, 6))
        if rope_layout:
            inputs[6], inputs[7] = inputs[6][inputs[5]], inputs[7][inputs[5]]
        return OpModule("Attention", attrs), tuple(inputs), _attention_dyn(rope_layout)

    return exported(("attention", *attrs), make)


def _moe_dyn():
    t = torch.export.Dim("T")
    return ({0: t}, {0: t}, None, None, None, None, None)


def _short_conv_dyn():
    b, s = torch.export.Dim("B"), torch.export.Dim("S")
    return ({0: b, 1: s}, None, None, None, {0: b}, {0: b})


def _gated_delta_dyn():
    b, s = torch.export.Dim("B"), torch.export.Dim("S")
    return ({0: b, 1: s},) * 5 + (None, {0: b}, {0: b})


def _ssm_scan_dyn():
    b, s = torch.export.Dim("B"), torch.export.Dim("S")
    return ({0: b, 1: s}, {0: b, 1: s}, None, {0: b, 1: s}, {0: b, 1: s}, None, None, None, {0: b}, {0: b})


@dataclass(frozen=True)
class OpCase:
    attrs: tuple  # attribute values, in spec order
    make_inputs: Callable  # (generator, size) -> input tensors, in spec order
    sizes: tuple  # sizes to run (the first also serves as the export example)
    dynamic_shapes: Callable  # () -> torch.export dynamic_shapes for the inputs


OP_CASES: dict[str, OpCase] = {
    # sizes: (batch, new tokens, cache length); a window shorter than the sequences
    "Attention": OpCase(attrs=(NQ, NKV, 5, D ** -0.5), make_inputs=lambda g, sz: attention_inputs(g, *sz),
                        sizes=((3, 4, 6), (2, 1, 9), (1, 7, 2), (4, 3, 3)), dynamic_shapes=_attention_dyn),
    # sigmoid scoring with expert bias, normalize with eps, routed scaling: every routing knob on
    "MoE": OpCase(attrs=(TOP_K, 1, 1, 1e-6, 1.5), make_inputs=lambda g, n: moe_inputs(g, n),
                  sizes=(5, 1, 17), dynamic_shapes=_moe_dyn),
    "ShortConv": OpCase(attrs=(C,), make_inputs=lambda g, bs: short_conv_inputs(g, *bs),
                        sizes=((3, 6), (1, 1), (2, 9)), dynamic_shapes=_short_conv_dyn),
    # sizes: (batch, new tokens); attrs (scale,): qk_l2norm and state_update at their defaults
    "GatedDeltaRule": OpCase(attrs=(GDK ** -0.5,), make_inputs=lambda g, bs: gated_delta_inputs(g, *bs),
                             sizes=((3, 6), (1, 1), (2, 9)), dynamic_shapes=_gated_delta_dyn),
    # sizes: (batch, new tokens); attrs (state_update, dt_min, dt_max): both dt clamps on
    "SsmScan": OpCase(attrs=(0, 0.05, 2.0), make_inputs=lambda g, bs: ssm_scan_inputs(g, *bs),
                      sizes=((3, 6), (1, 1), (2, 9)), dynamic_shapes=_ssm_scan_dyn),
}


def _export_case(exported, name: str) -> Exported:
    case = OP_CASES[name]

    def make():
        return OpModule(name, case.attrs), case.make_inputs(_gen(0), case.sizes[0]), case.dynamic_shapes()

    return exported(("case", name), make)


def test_every_custom_op_has_a_test_case():
    assert set(OP_CASES) == set(R.specs()), (
        f"custom ops without an entry in OP_CASES: {sorted(set(R.specs()) - set(OP_CASES))}; "
        f"entries for unknown ops: {sorted(set(OP_CASES) - set(R.specs()))}")


def test_specs_are_consistent():
    for name, spec in R.specs().items():
        assert spec.name == name
        assert spec.domain == DOMAIN == "graphkiln"
        assert len(spec.output_dtypes_from) == len(spec.outputs)
        assert set(spec.output_dtypes_from) <= set(spec.inputs)
        assert len({a.name for a in spec.attributes}) == len(spec.attributes)
        assert {a.name for a in spec.attributes}.isdisjoint({"plugin_namespace", "plugin_version"})
        assert all(a.kind in ("int", "float", "string") for a in spec.attributes)
        assert spec.doc.strip()


# ----------------------------------------------------------------------------------------------
# 1. the four faces of every op agree


@pytest.mark.parametrize("name", sorted(R.specs()))
def test_torch_face_matches_onnxruntime_face(exported, name):
    case = OP_CASES[name]
    ex = _export_case(exported, name)
    op = R.torch_op(name)
    for i, size in enumerate(case.sizes):
        inputs = case.make_inputs(_gen(100 + i), size)
        want = op(*inputs, *case.attrs)
        want = want if isinstance(want, tuple) else (want,)
        got = ex.run(*inputs)
        assert len(got) == len(want) == len(R.specs()[name].outputs)
        for out_name, g, w in zip(R.specs()[name].outputs, got, want):
            assert g.dtype == _np(w).dtype, f"{name}.{out_name} at {size}: dtype {g.dtype} != {w.dtype}"
            assert_close(g, w, what=f"{name}.{out_name} at size {size}")


@pytest.mark.parametrize("name", sorted(R.specs()))
def test_torch_op_registration_and_fake(name):
    """The torch face: the op is registered under its spec's name, and its fake matches the real op."""
    spec = R.specs()[name]
    case = OP_CASES[name]
    op = R.torch_op(name)
    assert op is getattr(torch.ops.graphkiln, spec.torch_name).default
    # compared parsed: torch prints a float default its own way (0.0 as "0.")
    assert str(op._schema) == str(torch._C.parse_schema(spec.torch_qualname + spec.torch_schema()))
    args = (*case.make_inputs(_gen(7), case.sizes[-1]), *case.attrs)
    result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    assert all(v == "SUCCESS" for v in result.values()), result
    if name in IN_PLACE_CASES:  # and in the in-place mode, whose state outputs have the state's shape
        ip = IN_PLACE_CASES[name]
        for size in ip.sizes.values():
            result = torch.library.opcheck(op, (*ip.make_inputs(_gen(8), size), *ip.attrs, 1),
                                           test_utils=("test_schema", "test_faketensor"))
            assert all(v == "SUCCESS" for v in result.values()), (size, result)


@pytest.mark.parametrize("name", sorted(R.specs()))
def test_onnx_schema_is_registered(name):
    import onnx
    from onnx.defs import OpSchema

    R.register_onnx_schemas()
    spec = R.specs()[name]
    assert onnx.defs.has(spec.name, DOMAIN)
    schema = onnx.defs.get_schema(spec.name, domain=DOMAIN)
    assert schema.since_version == spec.version
    assert [p.name for p in schema.inputs] == list(spec.inputs)
    assert [p.name for p in schema.outputs] == list(spec.outputs)
    kinds = {"int": OpSchema.AttrType.INT, "float": OpSchema.AttrType.FLOAT, "string": OpSchema.AttrType.STRING}
    want = {a.name: kinds[a.kind] for a in spec.attributes}
    want.update(plugin_namespace=OpSchema.AttrType.STRING, plugin_version=OpSchema.AttrType.STRING,
                aot=OpSchema.AttrType.INT)
    assert {n: a.type for n, a in schema.attributes.items()} == want
    # an attribute with a default may be left off a node (older artifacts); aot is TensorRT's only
    optional = {a.name for a in spec.attributes if a.default is not None} | {"aot"}
    assert {n for n, a in schema.attributes.items() if not a.required} == optional


@pytest.mark.parametrize("name", sorted(R.specs()))
def test_tensorrt_plugin_identity(name):
    spec = R.specs()[name]
    assert spec.plugin_namespace == "graphkiln"
    assert spec.plugin_id == f"graphkiln::{spec.name}"
    assert isinstance(spec.plugin_version, str) and spec.plugin_version


# ----------------------------------------------------------------------------------------------
# 2. exported graphs: opaque nodes with the plugin identity, functions attached, opset declared


def _check_exported_graph(model, expected_ops: set[str]) -> None:
    import onnx

    onnx.checker.check_model(model, full_check=True)
    specs = R.specs()
    custom = [n for n in model.graph.node if n.domain == DOMAIN]
    assert {n.op_type for n in custom} == expected_ops
    for node in custom:
        spec = specs[node.op_type]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert attrs.get("plugin_namespace") == spec.plugin_namespace.encode(), node.name
        assert attrs.get("plugin_version") == spec.plugin_version.encode(), node.name
        assert set(attrs) == {a.name for a in spec.attributes} | {"plugin_namespace", "plugin_version"}
        assert len(node.input) == len(spec.inputs) and len(node.output) == len(spec.outputs)
    functions = {(f.domain, f.name): f for f in model.functions}
    for op_name in expected_ops:
        spec = specs[op_name]
        fn = functions.get((DOMAIN, op_name))
        assert fn is not None, f"no function {DOMAIN}.{op_name} attached"
        assert list(fn.input) == list(spec.inputs) and len(fn.output) == len(spec.outputs)
        fn_attrs = set(fn.attribute) | {a.name for a in fn.attribute_proto}
        assert fn_attrs == {a.name for a in spec.attributes} | {"plugin_namespace", "plugin_version"}
        assert len(fn.node) > 1  # the decomposition, not a single opaque node
        assert all(n.domain in ("", "ai.onnx") for n in fn.node), "function must use standard ops only"
    assert len(model.functions) == len(functions), "a function is attached twice"
    imports = {o.domain: o.version for o in model.opset_import}
    assert imports.get(DOMAIN) == max(specs[n].version for n in expected_ops)
    assert imports.get("", imports.get("ai.onnx")) == OPSET
    for out in model.graph.output:
        assert out.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED, f"output {out.name} untyped"


@pytest.mark.parametrize("name", sorted(R.specs()))
def test_exported_graph_carries_plugin_identity_and_function(exported, name):
    ex = _export_case(exported, name)
    _check_exported_graph(ex.model, {name})
    assert [s.name for s in ex.used] == [name]
    # one opaque node: the exporter did not inline the op into standard ops
    assert [n.op_type for n in ex.model.graph.node] == [name]
    spec = R.specs()[name]
    # output dtypes follow output_dtypes_from
    import onnx

    in_types = {i.name: i.type.tensor_type.elem_type for i in ex.model.graph.input}
    node = next(n for n in ex.model.graph.node if n.domain == DOMAIN)
    graph_in = {op_in: node.input[spec.inputs.index(op_in)] for op_in in spec.inputs}
    for out_name, src in zip(spec.outputs, spec.output_dtypes_from):
        out = node.output[spec.outputs.index(out_name)]
        vi = {v.name: v for v in list(ex.model.graph.value_info) + list(ex.model.graph.output)}[out]
        if graph_in[src] in in_types:
            assert vi.type.tensor_type.elem_type == in_types[graph_in[src]], (out_name, src)
        assert vi.type.tensor_type.elem_type != onnx.TensorProto.UNDEFINED


class EveryOp(torch.nn.Module):
    """Every op in one graph: short conv over the sequence, a gated delta rule on its output
    and a Mamba-2 scan on that (each added back, as a residual), attention over a cache, then
    routed experts on every token."""

    def __init__(self):
        super().__init__()
        g = _gen(3)
        self.router = torch.nn.Parameter(_randn(g, E, C))
        self.gate_up = torch.nn.Parameter(_randn(g, E, 2 * I, C, scale=0.3))
        self.down = torch.nn.Parameter(_randn(g, E, C, I, scale=0.3))
        self.expert_bias = torch.nn.Buffer(_randn(g, E, scale=0.3))
        self.gate_up_bias = torch.nn.Parameter(_randn(g, E, 2 * I, scale=0.3))
        self.down_bias = torch.nn.Parameter(_randn(g, E, C, scale=0.3))
        self.weight = torch.nn.Parameter(_randn(g, C, K, scale=0.5))
        self.bias = torch.nn.Parameter(_randn(g, C))
        self.wq = torch.nn.Parameter(_randn(g, C, NQ * D, scale=0.3))
        self.wk = torch.nn.Parameter(_randn(g, C, NKV * D, scale=0.3))
        self.wv = torch.nn.Parameter(_randn(g, C, NKV * D, scale=0.3))
        self.wo = torch.nn.Parameter(_randn(g, NQ * D, C, scale=0.3))
        _, _, _, _, _, _, cos, sin, _, sinks = attention_inputs(g, 1, 1, 1)
        self.cos, self.sin, self.sinks = torch.nn.Buffer(cos), torch.nn.Buffer(sin), torch.nn.Buffer(sinks)
        self.gq = torch.nn.Parameter(_randn(g, C, GHK * GDK, scale=0.3))
        self.gk = torch.nn.Parameter(_randn(g, C, GHK * GDK, scale=0.3))
        self.gv = torch.nn.Parameter(_randn(g, C, GHV * GDV, scale=0.3))
        self.ga = torch.nn.Parameter(_randn(g, C, GHV, scale=0.3))
        self.gb = torch.nn.Parameter(_randn(g, C, GHV, scale=0.3))
        self.go = torch.nn.Parameter(_randn(g, GHV * GDV, C, scale=0.3))
        self.sx = torch.nn.Parameter(_randn(g, C, SH * SP, scale=0.3))
        self.sdt = torch.nn.Parameter(_randn(g, C, SH, scale=0.3))
        self.sb = torch.nn.Parameter(_randn(g, C, SG * SN, scale=0.3))
        self.sc = torch.nn.Parameter(_randn(g, C, SG * SN, scale=0.3))
        self.so = torch.nn.Parameter(_randn(g, SH * SP, C, scale=0.05))  # small: the scan's states grow
        self.ssm_a = torch.nn.Buffer(-torch.exp(torch.rand(SH, generator=g) * 2.0))
        self.ssm_d = torch.nn.Parameter(_randn(g, SH))
        self.ssm_dt_bias = torch.nn.Parameter(_randn(g, SH) - 1.0)

    def forward(self, x, pool, recurrent_pool, ssm_pool, slot_idx, seq_lens, past_key, past_value, position_ids):
        y, new_state = R.torch_op("ShortConv")(x, self.weight, self.bias, pool, slot_idx, seq_lens, C)
        b, s, _ = y.shape
        r, new_recurrent = R.torch_op("GatedDeltaRule")(
            (y @ self.gq).reshape(b, s, GHK, GDK), (y @ self.gk).reshape(b, s, GHK, GDK),
            (y @ self.gv).reshape(b, s, GHV, GDV), -F.softplus(y @ self.ga), torch.sigmoid(y @ self.gb),
            recurrent_pool, slot_idx, seq_lens, GDK ** -0.5)
        y = y + r.reshape(b, s, GHV * GDV) @ self.go
        z, new_ssm = R.torch_op("SsmScan")(
            (y @ self.sx).reshape(b, s, SH, SP), y @ self.sdt, self.ssm_a, (y @ self.sb).reshape(b, s, SG, SN),
            (y @ self.sc).reshape(b, s, SG, SN), self.ssm_d, self.ssm_dt_bias, ssm_pool, slot_idx, seq_lens,
            0, 0.01, 2.0)
        y = y + z.reshape(b, s, SH * SP) @ self.so
        a, new_k, new_v = R.torch_op("Attention")(y @ self.wq, y @ self.wk, y @ self.wv, past_key, past_value,
                                                  position_ids, self.cos, self.sin,
                                                  torch.zeros(1, 1, dtype=torch.int64),  # a text model's constant
                                                  self.sinks, NQ, NKV, 0, D ** -0.5)
        flat = (a @ self.wo).reshape(-1, C)
        out = R.torch_op("MoE")(flat, flat @ self.router.T, self.gate_up, self.down, self.expert_bias,
                                self.gate_up_bias, self.down_bias, TOP_K, 1, 1, 1e-6, 2.0)
        return out.reshape(y.shape), new_state, new_recurrent, new_ssm, new_k, new_v


def _every_op_inputs(gen, batch, seq, cache):
    x, _, _, pool, slot_idx, seq_lens = short_conv_inputs(gen, batch, seq)
    recurrent_pool = gated_delta_inputs(gen, batch, seq)[5]
    ssm_pool = ssm_scan_inputs(gen, batch, seq)[7]
    _, _, _, past_key, past_value, position_ids, _, _, _, _ = attention_inputs(gen, batch, seq, cache)
    return x, pool, recurrent_pool, ssm_pool, slot_idx, seq_lens, past_key, past_value, position_ids


def test_graph_with_every_op(exported):
    names = set(R.specs())
    assert names == {"MoE", "ShortConv", "Attention", "GatedDeltaRule", "SsmScan"}, "extend EveryOp with the new op"
    module = EveryOp()

    def make():
        b, s, c = torch.export.Dim("B"), torch.export.Dim("S"), torch.export.Dim("C")
        return module, _every_op_inputs(_gen(1), 3, 6, 4), ({0: b, 1: s}, None, None, None, {0: b}, {0: b},
                                                            {0: b, 2: c}, {0: b, 2: c}, {0: b, 1: s})

    ex = exported("every_op", make)
    _check_exported_graph(ex.model, names)
    assert {s.name for s in ex.used} == names
    for size in ((3, 6, 4), (1, 1, 7), (2, 4, 2)):
        inputs = _every_op_inputs(_gen(11), *size)
        want = module(*inputs)
        for g, w, what in zip(ex.run(*inputs), want, ("out", "new_state", "new_recurrent_state", "new_ssm_state",
                                                      "new_key", "new_value"), strict=True):
            assert_close(g, w, what=f"{what} at {size}")


def test_attach_functions_is_idempotent(exported):
    """Calling attach_functions again (e.g. after another pass) neither duplicates nor drops anything."""
    import onnx_ir as ir

    ex = _export_case(exported, "MoE")
    model = ir.serde.deserialize_model(ex.model)
    before = set(model.functions)
    R.attach_functions(model)
    assert set(model.functions) == before
    _check_exported_graph(ir.serde.serialize_model(model), {"MoE"})


# ----------------------------------------------------------------------------------------------
# MoE: the documented semantics, and the transformers blocks it replaces


def moe_per_docstring(hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias, top_k, scoring,
                      normalize, norm_eps, routed_scaling, activation=0, alpha=1.702, limit=7.0):
    """moe.py's docstring, token by token in float64: an oracle independent of the implementation."""
    hidden, logits = hidden.double(), router_logits.double()
    gate_up, down, bias = gate_up.double(), down.double(), expert_bias.double()
    gate_up_bias, down_bias = gate_up_bias.double(), down_bias.double()
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        scores = torch.sigmoid(logits[t]) if scoring == 1 else torch.softmax(logits[t], -1)
        experts = torch.topk(scores + bias, top_k).indices  # "experts = top_k of scores + expert_bias"
        w = scores[experts]
        if normalize:
            w = w / (w.sum() + norm_eps)
        w = w * routed_scaling
        for e, we in zip(experts.tolist(), w):
            y = gate_up[e] @ hidden[t] + gate_up_bias[e]
            if activation == 1:  # "relu(y)^2, non-gated"
                act = torch.clamp(y, min=0) ** 2
            else:
                gate, up = y[:I], y[I:]
                if activation == 2:  # "g * sigmoid(alpha * g) * (u + 1)"
                    g, u = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
                    act = g * torch.sigmoid(alpha * g) * (u + 1)
                else:
                    act = F.silu(gate) * up
            out[t] += we * (down[e] @ act + down_bias[e])
    return out


def _moe_export(exported, attrs: tuple, dtype=torch.float32) -> Exported:
    def make():
        activation = attrs[5] if len(attrs) > 5 else 0
        return OpModule("MoE", attrs), moe_inputs(_gen(0), 5, dtype, activation=activation), _moe_dyn()

    return exported(("MoE", attrs, dtype), make)


def _run_moe(exported, face: str, inputs: tuple, attrs: tuple) -> torch.Tensor:
    if face == "torch":
        return R.torch_op("MoE")(*inputs, *attrs)
    return torch.from_numpy(_moe_export(exported, attrs, inputs[0].dtype).run(*inputs)[0])


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("scoring,normalize,norm_eps,routed_scaling", [
    (1, 1, 1e-6, 2.0),  # LFM2-MoE
    (1, 0, 0.0, 1.0),
    (0, 1, 0.0, 1.0),  # Mixtral / Qwen3-MoE norm_topk_prob
    (0, 0, 0.0, 2.5),
    (0, 1, 0.5, 1.0),  # a large eps, so a missing or misplaced eps shows
], ids=["sigmoid-norm-eps-scale", "sigmoid-plain", "softmax-norm", "softmax-plain-scale", "softmax-norm-bigeps"])
def test_moe_matches_documented_semantics(exported, face, scoring, normalize, norm_eps, routed_scaling):
    """Routing and experts exactly as moe.py's docstring states, with a non-zero expert_bias.

    The bias is large enough to change which experts are selected; the docstring applies it to
    the selection whatever the scoring ("experts = top_k of scores + expert_bias").
    """
    attrs = (TOP_K, scoring, normalize, norm_eps, routed_scaling)
    for tokens in (1, 17):
        inputs = moe_inputs(_gen(tokens), tokens, bias_scale=1.0)
        got = _run_moe(exported, face, inputs, attrs)
        want = moe_per_docstring(*inputs, *attrs)
        assert_close(got, want, what=f"{face} face, {tokens} tokens")


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("activation,alpha,limit", [(1, 1.702, 7.0), (2, 1.702, 0.8), (2, 0.7, 1.1)],
                         ids=["relu2", "clamped-swiglu", "clamped-swiglu-alpha"])
def test_moe_activations_match_documented_semantics(exported, face, activation, alpha, limit):
    """The relu² and clamped-SwiGLU experts with random expert biases, as the docstring states.

    Weights large enough (and limits small enough) that the clamps bind and relu cuts: checked,
    so a missing clamp or a relu instead of relu² cannot pass.
    """
    attrs = (TOP_K, 1, 1, 1e-6, 1.5, activation, alpha, limit)
    for tokens in (1, 17):
        inputs = moe_inputs(_gen(40 + tokens), tokens, activation=activation, weight_scale=0.6)
        y = torch.einsum("th,efh->tef", inputs[0], inputs[2]) + inputs[5]
        if activation == 2:
            assert (y[..., :I] > limit).any() and (y[..., I:].abs() > limit).any(), "no clamp binds"
        else:
            assert (y < 0).any() and (y > 1).any()
        got = _run_moe(exported, face, inputs, attrs)
        want = moe_per_docstring(*inputs, *attrs)
        assert_close(got, want, what=f"{face} face, {tokens} tokens")


def test_moe_default_activation_is_todays_swiglu():
    """activation 0 (the default) with zero expert biases is bit for bit what the op computed
    before it had biases and activations: silu(gate) * up through bias-free linears."""
    inputs = moe_inputs(_gen(3), 17, expert_biases=False)
    attrs = (TOP_K, 1, 1, 1e-6, 1.5)
    w, idx = R.op_modules()["MoE"].routing(inputs[1], inputs[4], *attrs)
    want = torch.zeros_like(inputs[0])
    for e in range(E):
        tok, slot = torch.where(idx == e)
        gate, up = F.linear(inputs[0][tok], inputs[2][e]).chunk(2, dim=-1)
        want.index_add_(0, tok, F.linear(F.silu(gate) * up, inputs[3][e]) * w.to(want.dtype)[tok, slot, None])
    got = R.torch_op("MoE")(*inputs, *attrs)
    assert torch.equal(got, want)
    assert torch.equal(got, R.torch_op("MoE")(*inputs, *attrs, 0, 5.0, 0.1)), "alpha/limit read by activation 0"


def test_moe_zero_expert_bias_is_neutral(exported):
    """With zero bias, selection is by the scores alone (what softmax routers and bias-free LFM2 do)."""
    for scoring in (0, 1):
        attrs = (TOP_K, scoring, 1, 1e-6, 1.0)
        h, lg, gu, dn, _, gub, dnb = moe_inputs(_gen(5), 9)
        inputs = (h, lg, gu, dn, torch.zeros(E), gub, dnb)
        want = moe_per_docstring(*inputs, *attrs)
        for face in FACES:
            assert_close(_run_moe(exported, face, inputs, attrs), want, what=f"scoring {scoring}, {face}")


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Random values for every parameter and float buffer (transformers leaves fused experts empty)."""
    g = _gen(seed)
    scales = {"gate.weight": 0.5, "experts.gate_up_proj": 0.3, "experts.down_proj": 0.3, "expert_bias": 0.3}
    with torch.no_grad():
        for n, p in list(module.named_parameters()) + list(module.named_buffers()):
            if p.is_floating_point():
                p.copy_(_randn(g, *p.shape, scale=scales.get(n, 0.3)))


def _hf_moe_block(kind: str):
    """(transformers block, MoE attributes) for a tiny random config of ``kind``."""
    import transformers

    common = dict(hidden_size=H, num_experts_per_tok=TOP_K, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, vocab_size=64)
    if kind.startswith("qwen3"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        norm = kind == "qwen3_norm"
        cfg = transformers.Qwen3MoeConfig(moe_intermediate_size=I, num_experts=E, norm_topk_prob=norm, **common)
        block, attrs = Qwen3MoeSparseMoeBlock(cfg), (TOP_K, 0, int(norm), 0.0, 1.0)
    elif kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        cfg = transformers.MixtralConfig(intermediate_size=I, num_local_experts=E, **common)
        block, attrs = MixtralSparseMoeBlock(cfg), (TOP_K, 0, 1, 0.0, 1.0)
    elif kind == "lfm2":
        from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

        cfg = transformers.Lfm2MoeConfig(moe_intermediate_size=I, num_experts=E, use_expert_bias=True,
                                         norm_topk_prob=True, routed_scaling_factor=2.0, **common)
        block, attrs = Lfm2MoeSparseMoeBlock(cfg), (TOP_K, 1, 1, 1e-6, 2.0)
    else:
        raise ValueError(kind)
    _randomize(block.eval(), seed=sum(map(ord, kind)))
    if kind == "lfm2":
        assert block.expert_bias.abs().min() > 0
    return block, attrs


def _moe_op_inputs(block, hidden: torch.Tensor) -> tuple:
    """The transformers block's weights mapped to the op's inputs."""
    router = block.gate.weight  # [E, H]
    assert router.shape == (E, H)
    assert block.experts.gate_up_proj.shape == (E, 2 * I, H) and block.experts.down_proj.shape == (E, H, I)
    bias = getattr(block, "expert_bias", None)
    bias = torch.zeros(E) if bias is None else bias
    return (hidden, hidden @ router.T, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(),
            bias.detach(), torch.zeros(E, 2 * I), torch.zeros(E, H))


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("kind", ["qwen3_norm", "qwen3_nonorm", "mixtral", "lfm2"])
def test_moe_matches_transformers_block(exported, kind, face):
    block, attrs = _hf_moe_block(kind)
    for tokens in (1, 17):
        hidden = _randn(_gen(tokens), 1, tokens, H)
        with torch.no_grad():
            want = block(hidden)[0]
            inputs = _moe_op_inputs(block, hidden[0])
            got = _run_moe(exported, face, inputs, attrs)
        assert_close(got, want, what=f"{kind}, {face} face, {tokens} tokens")


def test_moe_routing_changes_with_the_knobs():
    """Guard against a vacuous comparison: each HF setting really gives a different output here."""
    block, _ = _hf_moe_block("lfm2")
    hidden = _randn(_gen(17), 17, H)
    inputs = _moe_op_inputs(block, hidden)
    op = R.torch_op("MoE")
    base = op(*inputs, TOP_K, 1, 1, 1e-6, 2.0)
    for attrs in [(TOP_K, 0, 1, 1e-6, 2.0), (TOP_K, 1, 0, 1e-6, 2.0), (TOP_K, 1, 1, 1e-6, 1.0), (1, 1, 1, 1e-6, 2.0)]:
        assert (op(*inputs, *attrs) - base).abs().max() > 1e-3 * base.abs().max(), attrs
    zero_bias = op(*inputs[:4], torch.zeros(E), *inputs[5:], TOP_K, 1, 1, 1e-6, 2.0)
    assert (zero_bias - base).abs().max() > 1e-3 * base.abs().max(), "expert_bias changes no selection"


# ----------------------------------------------------------------------------------------------
# ShortConv: transformers' LFM2 conv, chunked prefill + decode through the pool, ragged rows


def _short_conv_export(exported, dtype=torch.float32, index_dtype=torch.int64) -> Exported:
    def make():
        return (OpModule("ShortConv", (C,)), short_conv_inputs(_gen(0), 3, 6, dtype, index_dtype),
                _short_conv_dyn())

    return exported(("ShortConv", dtype, index_dtype), make)


def _run_short_conv(exported, face, x, weight, bias, pool, slot_idx, seq_lens):
    if face == "torch":
        return R.torch_op("ShortConv")(x, weight, bias, pool, slot_idx, seq_lens, C)
    y, state = _short_conv_export(exported, x.dtype, seq_lens.dtype).run(x, weight, bias, pool, slot_idx, seq_lens)
    return torch.from_numpy(y), torch.from_numpy(state)


def _hf_short_conv(bias: bool):
    import transformers
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    cfg = transformers.Lfm2Config(hidden_size=C, intermediate_size=2 * C, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=2, vocab_size=64, conv_L_cache=K, conv_bias=bias,
                                  layer_types=["conv"])
    layer = Lfm2ShortConv(cfg, layer_idx=0).eval()
    _randomize(layer, seed=77 + bias)
    return layer


def _layer_conv_params(layer):
    weight = layer.conv.weight.detach().squeeze(1)  # [C, K]
    bias = layer.conv.bias.detach() if layer.conv.bias is not None else torch.zeros(C)
    return weight, bias


def _bx(layer, hidden):
    """in_proj -> B, C, x as the HF layer splits them; returns (B * x, C gate), both [batch, S, C]."""
    b, c, x = layer.in_proj(hidden).chunk(3, dim=-1)
    return b * x, c


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("conv_bias", [True, False], ids=["bias", "nobias"])
def test_short_conv_matches_transformers_lfm2(exported, face, conv_bias):
    layer = _hf_short_conv(conv_bias)
    weight, bias = _layer_conv_params(layer)
    batch, seq = 3, 7
    hidden = _randn(_gen(21), batch, seq, C)
    with torch.no_grad():
        want_layer = layer(hidden)  # no cache: the whole sequence from a zero state
        bx, c_gate = _bx(layer, hidden)
        want_conv = F.conv1d(bx.transpose(1, 2), weight.unsqueeze(1), bias, padding=K - 1, groups=C)[..., :seq]
        want_conv = want_conv.transpose(1, 2)
        pool = torch.zeros(SLOTS, C, K - 1)
        slot_idx = torch.tensor([2, 0, 3])
        y, new_state = _run_short_conv(exported, face, bx, weight, bias, pool, slot_idx, torch.full((batch,), seq))
        assert_close(y, want_conv, what="conv output")
        assert_close(layer.out_proj(c_gate * y), want_layer, what="layer output")
        assert_close(new_state, bx[:, -(K - 1):].transpose(1, 2), what="new state = last K-1 inputs")


def _state_after(prev_state, x_real):
    """The documented new state: the last K-1 columns of state ++ real tokens ([C, K-1])."""
    return torch.cat((prev_state, x_real.T), dim=1)[:, -(K - 1):]


@pytest.mark.parametrize("face", FACES)
def test_short_conv_chunked_prefill_then_decode_equals_whole(exported, face):
    layer = _hf_short_conv(True)
    weight, bias = _layer_conv_params(layer)
    seq = 8
    hidden = _randn(_gen(31), 1, seq, C)
    with torch.no_grad():
        bx, _ = _bx(layer, hidden)
        whole, whole_state = _run_short_conv(exported, face, bx, weight, bias, torch.zeros(SLOTS, C, K - 1),
                                             torch.tensor([1]), torch.tensor([seq]))
        # the whole pass itself is transformers' convolution
        want = F.conv1d(bx.transpose(1, 2), weight.unsqueeze(1), bias, padding=K - 1, groups=C)[..., :seq]
        assert_close(whole, want.transpose(1, 2), what="whole pass vs transformers")

        pool = _randn(_gen(32), SLOTS, C, K - 1)
        pool[1] = 0  # slot 1 starts fresh; the other slots hold other sequences' states
        others = pool.clone()
        ys = []
        for start, stop in [(0, 4), (4, 5), (5, 6), (6, 7), (7, 8)]:  # prefill 4, then 1-token decode steps
            y, new_state = _run_short_conv(exported, face, bx[:, start:stop], weight, bias, pool, torch.tensor([1]),
                                           torch.tensor([stop - start]))
            ys.append(y)
            pool[1] = new_state[0]  # the caller writes the rows back into pool[slot_idx]
        assert_close(torch.cat(ys, dim=1), whole, what="chunked outputs")
        assert_close(pool[1], whole_state[0], what="state after the chunks")
        mask = torch.ones(SLOTS, dtype=torch.bool)
        mask[1] = False
        assert torch.equal(pool[mask], others[mask]), "other slots changed"


@pytest.mark.parametrize("face", FACES)
def test_short_conv_ragged_rows_and_slots(exported, face):
    """Right-padded rows: outputs and states only from the real tokens; rows read their own slot."""
    g = _gen(41)
    weight, bias = _randn(g, C, K, scale=0.5), _randn(g, C)
    pool = _randn(g, SLOTS, C, K - 1)  # distinct states, so reading the wrong slot shows
    pool_before = pool.clone()
    seq = 5
    seq_lens = torch.tensor([5, 2, 1, 0])
    slot_idx = torch.tensor([3, 0, 2, 1])
    x = _randn(g, len(seq_lens), seq, C)
    for b, n in enumerate(seq_lens.tolist()):
        x[b, n:] = 1e4  # garbage padding: any leak into real outputs or states is obvious
    y, new_state = _run_short_conv(exported, face, x, weight, bias, pool, slot_idx, seq_lens)
    assert torch.equal(pool, pool_before), "the op modified its state_pool input"
    for b, (n, slot) in enumerate(zip(seq_lens.tolist(), slot_idx.tolist())):
        # each row alone, unpadded, from its own slot's state
        if n:
            ext = torch.cat((pool[slot], x[b, :n].T), dim=1)
            want_y = F.conv1d(ext[None], weight.unsqueeze(1), bias, groups=C)[0].T
            assert_close(y[b, :n], want_y, what=f"row {b} outputs")
        assert_close(new_state[b], _state_after(pool[slot], x[b, :n]), what=f"row {b} state")
    assert torch.equal(new_state[3], pool[1]), "a row with no tokens must keep its state"

    # two rows of a smaller batch map to slots [3, 0]; writing back touches only those slots
    y2, state2 = _run_short_conv(exported, face, x[:2], weight, bias, pool, torch.tensor([3, 0]), seq_lens[:2])
    assert_close(y2, y[:2], what="batch of two")
    written = pool.clone()
    written[torch.tensor([3, 0])] = state2
    assert torch.equal(written[1:3], pool[1:3]), "slots 1 and 2 must stay untouched"
    assert_close(written[3], _state_after(pool[3], x[0]), what="slot 3")
    assert_close(written[0], _state_after(pool[0], x[1, :2]), what="slot 0")


@pytest.mark.parametrize("face", FACES)
def test_short_conv_interleaved_sequences_share_a_pool(exported, face):
    """Two sequences of different lengths, batched ragged then decoded, each equal to its whole pass."""
    g = _gen(51)
    weight, bias = _randn(g, C, K, scale=0.5), _randn(g, C)
    seqs = {3: _randn(g, 7, C), 0: _randn(g, 4, C)}  # slot -> the sequence's conv inputs
    pool = torch.zeros(SLOTS, C, K - 1)
    outputs = {s: [] for s in seqs}
    pos = {s: 0 for s in seqs}
    # step: {slot: tokens this step}; padded to the longest row
    for step in [{3: 5, 0: 2}, {3: 1, 0: 1}, {0: 1}, {3: 1, 0: 0}]:
        slots = list(step)
        seq = max(step.values()) or 1
        x = torch.zeros(len(slots), seq, C)
        for b, s in enumerate(slots):
            x[b, :step[s]] = seqs[s][pos[s]:pos[s] + step[s]]
            x[b, step[s]:] = -3e3
        y, new_state = _run_short_conv(exported, face, x, weight, bias, pool, torch.tensor(slots),
                                       torch.tensor([step[s] for s in slots]))
        for b, s in enumerate(slots):
            outputs[s].append(y[b, :step[s]])
            pos[s] += step[s]
        pool[torch.tensor(slots)] = new_state
    for s, full in seqs.items():
        n = pos[s]
        want = F.conv1d(full[:n].T[None], weight.unsqueeze(1), bias, padding=K - 1, groups=C)[0, :, :n].T
        assert_close(torch.cat(outputs[s]), want, what=f"slot {s} outputs")
        assert_close(pool[s], _state_after(torch.zeros(C, K - 1), full[:n]), what=f"slot {s} state")
    assert not pool[1:3].any(), "unused slots changed"


@pytest.mark.parametrize("face", FACES)
def test_short_conv_int32_indices(exported, face):
    """slot_idx / seq_lens as int32 (TensorRT's native index type; the schema allows it)."""
    inputs64 = short_conv_inputs(_gen(61), 3, 6)
    inputs32 = (*inputs64[:4], inputs64[4].int(), inputs64[5].int())
    want = R.torch_op("ShortConv")(*inputs64, C)
    got = _run_short_conv(exported, face, *inputs32)
    for g, w, what in zip(got, want, ("y", "new_state")):
        assert_close(g, w, what=what)


# ----------------------------------------------------------------------------------------------
# 5. fp16 through the onnxruntime function


def _ort_or_skip(ex: Exported) -> None:
    if ex.session is None and ("NOT_IMPLEMENTED" in ex.session_error or "Could not find an implementation"
                               in ex.session_error):
        pytest.skip(f"onnxruntime CPU has no fp16 kernel for an op of the function: {ex.session_error[:300]}")


def test_moe_fp16_onnxruntime(exported):
    attrs = (TOP_K, 1, 1, 1e-6, 2.0)
    ex = _moe_export(exported, attrs, torch.float16)
    _ort_or_skip(ex)
    assert ex.model.graph.output[0].type.tensor_type.elem_type == 10  # FLOAT16
    for tokens in (1, 17):
        inputs = moe_inputs(_gen(70 + tokens), tokens, torch.float16)
        got = ex.run(*inputs)[0]
        assert got.dtype == np.float16
        want32 = R.torch_op("MoE")(*(t.float() for t in inputs), *attrs)
        assert_close(got, want32, rel=1e-2, what=f"fp16 ORT vs fp32 reference, {tokens} tokens")
        assert_close(got, R.torch_op("MoE")(*inputs, *attrs), rel=1e-2, what="fp16 ORT vs fp16 reference")


@pytest.mark.parametrize("pool_dtype", [torch.float16, torch.float32], ids=["pool16", "pool32"])
def test_short_conv_fp16_onnxruntime(exported, pool_dtype):
    ex = _short_conv_export(exported, torch.float16)
    _ort_or_skip(ex)
    inputs = short_conv_inputs(_gen(81), 2, 9, torch.float16)
    inputs = (*inputs[:3], inputs[3].to(pool_dtype), *inputs[4:])
    if pool_dtype != torch.float16:  # the graph's pool input is fp16: export one with an fp32 pool
        def make():
            ex_in = short_conv_inputs(_gen(0), 3, 6, torch.float16)
            return OpModule("ShortConv", (C,)), (*ex_in[:3], ex_in[3].float(), *ex_in[4:]), _short_conv_dyn()

        ex = exported(("ShortConv", "fp16-pool32"), make)
        _ort_or_skip(ex)
    y, state = ex.run(*inputs)
    assert y.dtype == np.float16 and state.dtype == _np(inputs[3]).dtype
    want_y, want_state = R.torch_op("ShortConv")(*(t.float() if t.is_floating_point() else t for t in inputs), C)
    assert_close(y, want_y, rel=1e-2, what="fp16 y")
    assert_close(state, want_state, rel=1e-2, what="fp16 new_state")


# ----------------------------------------------------------------------------------------------
# Attention: documented semantics (rotary, grouped heads, cache validity by position, windows)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("size", [(3, 4, 6), (2, 1, 9), (2, 6, 0)], ids=["prefill_after_cache", "decode", "first_prompt"])
def test_attention_matches_documented_semantics(exported, face, window, size):
    attrs = (NQ, NKV, window, 0.3)
    inputs = attention_inputs(_gen(40 + size[0]), *size)
    want = naive_attention(*inputs, window=window, scale=0.3)
    if face == "torch":
        got = R.torch_op("Attention")(*inputs, *attrs)
    else:
        got = attention_export(exported, window, 0.3).run(*inputs)
    for name, g, w in zip(("out", "new_key", "new_value"), got, want):
        assert_close(g, w, what=f"{face} {name} window={window} size={size}")


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("size", [(3, 4, 6), (2, 1, 9), (2, 6, 0)], ids=["prefill_after_cache", "decode", "first_prompt"])
def test_attention_sinks_match_documented_semantics(exported, face, window, size):
    """use_sinks=1: sinks[h] is one more logit of head h's softmax (gpt-oss); use_sinks=0 never
    reads sinks (other values give bit-identical results)."""
    inputs = list(attention_inputs(_gen(50 + size[0]), *size))
    want = naive_attention(*inputs, window=window, scale=0.3, use_sinks=1)
    if face == "torch":
        def run(args, use_sinks):
            return R.torch_op("Attention")(*args, NQ, NKV, window, 0.3, 0, 0, use_sinks)
    else:
        def run(args, use_sinks):
            return [torch.from_numpy(o) for o in attention_export(exported, window, 0.3, 0, 0, use_sinks).run(*args)]
    got = run(inputs, 1)
    for name, g, w in zip(("out", "new_key", "new_value"), got, want):
        assert_close(g, w, what=f"{face} sinks {name} window={window} size={size}")
    without = naive_attention(*inputs, window=window, scale=0.3)
    assert not np.allclose(_np(got[0]), without[0], rtol=1e-3, atol=1e-3), "the sinks change nothing: no teeth"
    other = list(inputs)
    other[9] = torch.full_like(inputs[9], float("nan"))
    for g, w in zip(run(other, 0), run(inputs, 0)):
        assert torch.equal(torch.as_tensor(g), torch.as_tensor(w)), f"{face}: use_sinks=0 read the sinks"


def test_attention_ignores_cache_rows_at_or_after_a_rows_start():
    """Positions >= start_b in the cache are not part of row b's history (garbage there is free)."""
    op = R.torch_op("Attention")
    inputs = list(attention_inputs(_gen(5), 3, 2, 8))
    base = op(*inputs, NQ, NKV, 0, 0.25)
    starts = inputs[5][:, 0]
    for part in (3, 4):
        for r, st in enumerate(starts.tolist()):
            inputs[part][r, :, st:] = 1e4
    changed = op(*inputs, NQ, NKV, 0, 0.25)
    for a, b in zip(base, changed):
        assert torch.equal(a, b)
    inputs[3][1, :, : int(starts[1])] += 1.0  # and the rows before the start are read
    if int(starts[1]) > 0:
        assert not torch.equal(op(*inputs, NQ, NKV, 0, 0.25)[0][1], base[0][1])


# ----------------------------------------------------------------------------------------------
# Attention's lookahead: Gemma3's images, bidirectional within an image, as transformers masks them

# Each row's whole prompt, one letter per token: "t" text, an upper-case letter one image's
# tokens (adjacent letters: adjacent images), then how many tokens are cached before this step
# (never inside an image: the runtime keeps an image in one chunk). Images at a step's start,
# middle and end, two back to back, a row that ends on an image; rows of different lengths, so
# the shorter ones are padded (padding's lookahead is 0).
LOOKAHEAD_ROWS = (("ttAAAtBBttt", 0), ("tttttCCCCtt", 5), ("tttDDDEE", 2))


def _block_ids(prompt: str) -> torch.Tensor:
    """transformers' block_sequence_ids: an image's index for its tokens, -1 for text."""
    letters = sorted({c for c in prompt if c != "t"})
    return torch.tensor([letters.index(c) if c != "t" else -1 for c in prompt])


def _lookahead_step(gen, window: int):
    """(op inputs with lookahead [B, S], real new tokens per row, transformers' mask per row
    [new real tokens, cached + new real tokens]) for LOOKAHEAD_ROWS as one step."""
    from transformers.masking_utils import (and_masks, blockwise_overlay, causal_mask_function, or_masks,
                                            sliding_window_overlay)

    seq = max(len(p) - start for p, start in LOOKAHEAD_ROWS)
    cache = max(len(p) for p, _ in LOOKAHEAD_ROWS) + 2
    inputs = list(attention_inputs(gen, len(LOOKAHEAD_ROWS), seq, cache))
    starts = torch.tensor([start for _, start in LOOKAHEAD_ROWS])
    inputs[5] = starts.unsqueeze(1) + torch.arange(seq)  # padding continues each row's positions
    lookahead = torch.zeros(len(LOOKAHEAD_ROWS), seq, dtype=torch.int64)
    real, masks = [], []
    for b, (prompt, start) in enumerate(LOOKAHEAD_ROWS):
        for t in range(start, len(prompt)):  # an image token sees up to its image's last token
            end = t
            while prompt[t] != "t" and end + 1 < len(prompt) and prompt[end + 1] == prompt[t]:
                end += 1
            lookahead[b, t - start] = end - t
        blocks = _block_ids(prompt).unsqueeze(0)
        mask_fn = or_masks(causal_mask_function, blockwise_overlay(blocks))
        if window:
            mask_fn = and_masks(sliding_window_overlay(window), mask_fn)
        q_idx = torch.arange(start, len(prompt)).unsqueeze(1)
        masks.append(mask_fn(torch.tensor(0), torch.tensor(0), q_idx, torch.arange(len(prompt)).unsqueeze(0)))
        real.append(len(prompt) - start)
    inputs[8] = lookahead
    return tuple(inputs), real, masks


def _masked_attention(inputs, real, masks, scale: float):
    """out [B, S, Nq*D] (real tokens; padding left 0) and the rotated new keys [B, Nkv, S, D],
    in float64 with the given boolean masks over (cached + new) keys: the op's rotary and
    grouped heads written out plainly, the mask taken as given."""
    q, k, v, past_key, past_value, pos, cos_t, sin_t, _, _ = (x.double() if x.is_floating_point() else x
                                                             for x in inputs)
    b, s, _ = q.shape
    d = past_key.shape[-1]

    def rotate(x, c, sn):  # x [..., S, D]; c, sn [S, D/2]
        c, sn = torch.cat((c, c), -1), torch.cat((sn, sn), -1)
        return x * c + torch.cat((-x[..., d // 2:], x[..., : d // 2]), -1) * sn

    out = torch.zeros_like(q)
    new_k = torch.zeros(b, NKV, s, d, dtype=torch.float64)
    for r in range(b):
        c, sn = cos_t[pos[r]], sin_t[pos[r]]
        qr = rotate(q[r].view(s, NQ, d).transpose(0, 1), c, sn)  # [Nq, S, D]
        kr = rotate(k[r].view(s, NKV, d).transpose(0, 1), c, sn)
        new_k[r] = kr
        start, n = int(pos[r, 0]), real[r]
        keys = torch.cat((past_key[r, :, :start], kr[:, :n]), 1)  # [Nkv, start + n, D]
        values = torch.cat((past_value[r, :, :start], v[r].view(s, NKV, d).transpose(0, 1)[:, :n]), 1)
        heads = torch.arange(NQ) // (NQ // NKV)
        scores = (qr[:, :n] @ keys[heads].transpose(1, 2)) * scale  # [Nq, n, start + n]
        probs = torch.softmax(scores.masked_fill(~masks[r], float("-inf")), -1)
        out[r, :n] = (probs @ values[heads]).transpose(0, 1).reshape(n, NQ * d)
    return out, new_k


@pytest.mark.parametrize("kv_update", [0, 1])
@pytest.mark.parametrize("window", [0, 3], ids=["full", "sliding"])
@pytest.mark.parametrize("face", FACES)
def test_lookahead_is_transformers_block_mask(exported, face, window, kv_update):
    """lookahead = distance to the image's last token gives OR(causal, same block) on full
    layers and AND(sliding, OR(causal, same block)) on sliding ones (transformers' Gemma3
    masks, built here from block ids with transformers' own mask functions)."""
    inputs, real, masks = _lookahead_step(_gen(60), window)
    assert any(m.triu(1 + m.shape[1] - m.shape[0]).any() for m in masks), "no token sees ahead: the test has no teeth"
    scale = 0.3
    want_out, want_k = _masked_attention(inputs, real, masks, scale)
    if face == "torch":
        got = R.torch_op("Attention")(*inputs, NQ, NKV, window, scale, kv_update)
    else:
        got = [torch.from_numpy(o) for o in attention_export(exported, window, scale, kv_update).run(*inputs)]
    for r, n in enumerate(real):  # padding's outputs are not part of the contract
        assert_close(got[0][r, :n], want_out[r, :n], what=f"{face} out row {r}")
        rows = got[1][r, :, :n] if kv_update == 0 else got[1][r, :, inputs[5][r, :n]]
        assert_close(rows, want_k[r, :, :n], what=f"{face} rotated keys row {r}")


def _mrope(gen, batch: int, seq: int, sections=(2, 3, 3)):
    """M-RoPE-like per-token cos/sin [B, S, D/2]: three position streams (temporal, height,
    width; equal on text tokens, apart on image ones) and frequency section j read at stream
    j % 3's position — an independent gather, frequency by frequency."""
    assert sum(sections) == D // 2
    _, _, _, _, _, _, cos_t, sin_t, _, _ = attention_inputs(gen, 1, 1, 1)
    streams = torch.randint(0, POSITIONS, (3, batch, seq), generator=gen)
    streams[:, :, :2] = streams[0, :, :2]  # text tokens: one position on all three streams
    stream_of = [j % 3 for j, n in enumerate(sections) for _ in range(n)]
    cos = torch.empty(batch, seq, D // 2)
    sin = torch.empty(batch, seq, D // 2)
    for i, st in enumerate(stream_of):
        cos[..., i], sin[..., i] = cos_t[streams[st], i], sin_t[streams[st], i]
    return cos, sin


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("size", [(3, 4, 6), (2, 1, 9)], ids=["prefill_after_cache", "decode"])
def test_per_token_rotary(exported, face, size):
    """rope_layout=1: cos/sin equal to the gathered tables give exactly layout 0's outputs;
    M-RoPE-like mixes match the documented semantics computed independently (float64)."""
    inputs = list(attention_inputs(_gen(70 + size[1]), *size))
    gathered = list(inputs)
    gathered[6], gathered[7] = inputs[6][inputs[5]], inputs[7][inputs[5]]
    mixed = list(inputs)
    mixed[6], mixed[7] = _mrope(_gen(71), size[0], size[1])
    if face == "torch":
        def run(args, layout):
            return R.torch_op("Attention")(*args, NQ, NKV, 0, 0.3, 0, layout)
    else:
        def run(args, layout):
            return [torch.from_numpy(o) for o in attention_export(exported, 0, 0.3, 0, layout).run(*args)]
    for g, w in zip(run(gathered, 1), run(inputs, 0)):
        assert torch.equal(g, w), f"{face}: per-token tables differ from the gathered ones"
    want = naive_attention(*mixed, window=0, scale=0.3, rope_layout=1)
    got = run(mixed, 1)
    for name, g, w in zip(("out", "new_key", "new_value"), got, want):
        assert_close(g, w, what=f"{face} M-RoPE {name} at {size}")
    assert not torch.allclose(got[1], run(inputs, 0)[1]), "the mix rotates like the tables: the test has no teeth"


# ----------------------------------------------------------------------------------------------
# 6. in-place state outputs (Attention kv_update=1; ShortConv, GatedDeltaRule, SsmScan state_update=1): the whole
#    cache / pool with the new rows written in, which TensorRT aliases to the state input. Mode 1 must be
#    mode 0 plus an explicit scatter, in torch, in onnxruntime running the function, and with
#    onnxruntime writing into the very buffer it reads (how the runtime binds tensorrt graphs).


def _scatter_rows(cache, rows, position_ids):
    """Mode 0's rows written into a copy of the cache one (row, token) at a time; positions past
    the cache's end are dropped."""
    out = cache.clone()
    for b in range(position_ids.shape[0]):
        for s in range(position_ids.shape[1]):
            p = int(position_ids[b, s])
            if p < cache.shape[2]:
                out[b, :, p] = rows[b, :, s]
    return out


def _scatter_slots(pool, rows, slot_idx):
    out = pool.clone()
    for b, slot in enumerate(slot_idx.tolist()):
        out[slot] = rows[b]
    return out


def attention_inputs_at(gen, starts, seq: int, cache: int):
    """attention_inputs whose row b holds positions starts[b] + 0..seq-1."""
    inputs = list(attention_inputs(gen, len(starts), seq, cache))
    inputs[5] = torch.tensor(starts).unsqueeze(1) + torch.arange(seq)
    return tuple(inputs)


@dataclass(frozen=True)
class InPlaceCase:
    attrs: tuple  # every attribute but the mode attribute, which is last (0 or 1 appended)
    sizes: dict  # label -> size for make_inputs
    make_inputs: Callable
    scatter: Callable  # (state input, mode-0 rows, inputs) -> the state mode 1 returns
    state_inputs: tuple[int, ...]  # input index of each state output (outputs 1, 2, ...)


IN_PLACE_CASES: dict[str, InPlaceCase] = {
    # (starts per row, new tokens, cache length). past_the_end: rows whose positions run past the
    # cache's end (partly: start 4; wholly: start 6 = C) next to rows inside it; longer: a prefill
    # with more tokens than the cache; a window shorter than the sequences.
    "Attention": InPlaceCase(
        attrs=(NQ, NKV, 3, D ** -0.5),
        sizes={"decode": ((3, 0, 8), 1, 9), "past_the_end": ((0, 4, 6, 2), 3, 6), "longer_than_cache": ((0, 1), 7, 4),
               "empty_cache": ((0, 0), 5, 0)},
        make_inputs=lambda g, sz: attention_inputs_at(g, *sz),
        scatter=lambda state, rows, inputs: _scatter_rows(state, rows, inputs[5]),
        state_inputs=(3, 4)),
    "ShortConv": InPlaceCase(
        attrs=(C,), sizes={"decode": (3, 1), "prefill": (2, 6), "every_slot": (SLOTS, 3)},
        make_inputs=lambda g, sz: short_conv_inputs(g, *sz),
        scatter=lambda state, rows, inputs: _scatter_slots(state, rows, inputs[4]),
        state_inputs=(3,)),
    "GatedDeltaRule": InPlaceCase(
        attrs=(GDK ** -0.5,), sizes={"decode": (3, 1), "prefill": (2, 6), "every_slot": (SLOTS, 3)},
        make_inputs=lambda g, sz: gated_delta_inputs(g, *sz),
        scatter=lambda state, rows, inputs: _scatter_slots(state, rows, inputs[6]),
        state_inputs=(5,)),
    "SsmScan": InPlaceCase(
        attrs=(), sizes={"decode": (3, 1), "prefill": (2, 6), "every_slot": (SLOTS, 3)},
        make_inputs=lambda g, sz: ssm_scan_inputs(g, *sz),
        scatter=lambda state, rows, inputs: _scatter_slots(state, rows, inputs[8]),
        state_inputs=(7,)),
}
IN_PLACE_SIZES = [(n, s) for n, c in IN_PLACE_CASES.items() for s in c.sizes]


def test_every_in_place_op_has_a_case():
    from graphkiln.ops import op_modules

    mods = {n: m for n, m in op_modules().items() if hasattr(m, "IN_PLACE_ATTR")}
    assert set(mods) == set(IN_PLACE_CASES) == {"Attention", "ShortConv", "GatedDeltaRule", "SsmScan"}
    for name, mod in mods.items():
        spec = R.specs()[name]
        required = [a for a in spec.attributes if a.default is None]
        # right after the required attributes, so callers pass (*required, mode) positionally
        attr = spec.attributes[len(required)]
        assert spec.attributes[:len(required)] == tuple(required)
        assert (attr.name, attr.kind, attr.default) == (mod.IN_PLACE_ATTR, "int", 0)
        assert len(IN_PLACE_CASES[name].attrs) == len(required)
        assert len(IN_PLACE_CASES[name].state_inputs) == len(spec.outputs) - 1


def _in_place_export(exported, name: str) -> Exported:
    case, base = IN_PLACE_CASES[name], OP_CASES[name]

    def make():  # the base case's example inputs: sizes of 0 or 1 would specialise the dynamic dims
        return OpModule(name, (*case.attrs, 1)), base.make_inputs(_gen(0), base.sizes[0]), base.dynamic_shapes()

    return exported(("in_place", name), make)


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("name, size", IN_PLACE_SIZES)
def test_in_place_mode_is_rows_mode_plus_scatter(exported, face, name, size):
    case = IN_PLACE_CASES[name]
    inputs = case.make_inputs(_gen(90), case.sizes[size])
    before = [t.clone() for t in inputs]
    rows = R.torch_op(name)(*inputs, *case.attrs, 0)
    if face == "torch":
        got = R.torch_op(name)(*inputs, *case.attrs, 1)
    else:
        ex = _in_place_export(exported, name)
        node = next(n for n in ex.model.graph.node if n.domain == DOMAIN)
        assert {a.name: a.i for a in node.attribute if a.type == 2}[R.op_modules()[name].IN_PLACE_ATTR] == 1
        got = [torch.from_numpy(o) for o in ex.run(*inputs)]
    assert_close(got[0], rows[0], what=f"{name} {face} first output, in-place mode vs rows mode")
    for out, i in enumerate(case.state_inputs, start=1):
        want = case.scatter(inputs[i], rows[out], inputs)
        assert tuple(got[out].shape) == tuple(inputs[i].shape)
        assert got[out].dtype == inputs[i].dtype
        assert_close(got[out], want, what=f"{name} {face} state output {out} at {size}")
    for a, b in zip(inputs, before):
        assert torch.equal(a, b), "the op modified an input (only a bound output buffer may be written)"


def test_in_place_cases_are_not_vacuous():
    """Each in-place case writes something, and the past-the-end one really has skipped positions."""
    for name, size in IN_PLACE_SIZES:
        case = IN_PLACE_CASES[name]
        inputs = case.make_inputs(_gen(90), case.sizes[size])
        got = R.torch_op(name)(*inputs, *case.attrs, 1)
        changed = [not torch.equal(got[o], inputs[i]) for o, i in enumerate(case.state_inputs, start=1)]
        assert all(changed) or size == "empty_cache", (name, size)
    pos, cache = attention_inputs_at(_gen(0), *IN_PLACE_CASES["Attention"].sizes["past_the_end"])[5], 6
    assert (pos >= cache).any() and (pos < cache).any()
    assert (pos >= cache).all(dim=1).any(), "one row entirely past the end"


@pytest.mark.parametrize("name, size", IN_PLACE_SIZES)
def test_in_place_mode_on_onnxruntime_writing_the_state_it_reads(exported, name, size):
    """The state output bound (IOBinding) to the state input's own buffer: onnxruntime's scatter
    then writes into it without a copy, and the result is still mode 0 plus the scatter."""
    import onnxruntime as ort

    case = IN_PLACE_CASES[name]
    ex = _in_place_export(exported, name)
    inputs = case.make_inputs(_gen(91), case.sizes[size])
    rows = R.torch_op(name)(*inputs, *case.attrs, 0)
    want = {i: case.scatter(inputs[i], rows[o], inputs) for o, i in enumerate(case.state_inputs, start=1)}
    binding = ex.session.io_binding()
    held = []  # arrays and the OrtValues over them, alive until the run is done
    for arg, x in zip(ex.session.get_inputs(), inputs):
        arr = np.ascontiguousarray(_np(x))
        held.append((arr, ort.OrtValue.ortvalue_from_numpy(arr)))
        binding.bind_ortvalue_input(arg.name, held[-1][1])
    outs = ex.session.get_outputs()
    binding.bind_output(outs[0].name, "cpu")  # first: copy_outputs_to_cpu lists outputs in binding order
    for o, i in enumerate(case.state_inputs, start=1):
        binding.bind_ortvalue_output(outs[o].name, held[i][1])
    ex.session.run_with_iobinding(binding)
    assert_close(binding.copy_outputs_to_cpu()[0], rows[0], what=f"{name} first output")
    for i, w in want.items():
        assert_close(held[i][0], w, what=f"{name} state {i} written in place at {size}")
