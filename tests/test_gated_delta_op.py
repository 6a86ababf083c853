"""graphkiln.GatedDeltaRule: the torch reference matches transformers' gated delta rule, and the
ONNX function onnxruntime runs matches the reference.

The op is exercised through its module (``graphkiln.ops.gated_delta``) directly: the torch face
is ``reference``; the ONNX face is a one-node model (the ``graphkiln`` node carrying every
attribute plus the plugin identity, as ``registry.translation_table`` emits it) with the
module's ``onnx_function`` attached as a model-local function, as ``registry.attach_functions``
attaches it. Dims are dynamic, so one session per attribute set serves every size.

Sizes are small (Hk=3, Hv=6: value heads share q/k heads, and Hk != Hv/Hk so a swapped head
expansion shows; Dk != Dv so a transposed state shows)
and the initial states are nonzero, so reading the wrong slot or dropping the state shows.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from graphkiln.ops import gated_delta as GD
from graphkiln.ops.spec import DOMAIN
from reference import assert_close

OPSET = 23
FACES = ("torch", "onnx")
HK, HV, DK, DV, SLOTS = 3, 6, 8, 6, 5
SCALE = DK ** -0.5


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _np(t):
    return t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


def make_inputs(gen, batch: int, seq: int, hk: int = HK, hv: int = HV):
    """q, k, v, g (<= 0, as -exp(A) * softplus(a + dt) is), beta (sigmoid-ed) and a nonzero pool."""
    q = torch.randn(batch, seq, hk, DK, generator=gen)
    k = torch.randn(batch, seq, hk, DK, generator=gen)
    v = torch.randn(batch, seq, hv, DV, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(batch, seq, hv, generator=gen)) * 0.7
    beta = torch.sigmoid(torch.randn(batch, seq, hv, generator=gen))
    pool = torch.randn(SLOTS, hv, DK, DV, generator=gen) * 0.5
    return q, k, v, g, beta, pool


# ----------------------------------------------------------------------------------------------
# the ONNX face: one graphkiln node + the attached function, run by onnxruntime


def _node_model(attrs: dict, act=None, pool=None, index=None, shapes: bool = True):
    """The one-node model; ``act`` / ``pool`` / ``index``: the activations', pool's and indices'
    element types (fp32, fp32, int64 unless given); ``shapes`` False: inputs of unknown rank."""
    import onnx
    from onnx import TensorProto, helper

    act, pool, index = act or TensorProto.FLOAT, pool or TensorProto.FLOAT, index or TensorProto.INT64
    dims = {"q": ["B", "S", HK, DK], "k": ["B", "S", HK, DK], "v": ["B", "S", HV, DV], "g": ["B", "S", HV],
            "beta": ["B", "S", HV], "state_pool": [SLOTS, HV, DK, DV], "slot_idx": ["B"], "seq_lens": ["B"]}
    types = {"q": act, "k": act, "v": act, "g": TensorProto.FLOAT, "beta": TensorProto.FLOAT, "state_pool": pool,
             "slot_idx": index, "seq_lens": index}
    inputs = [helper.make_tensor_value_info(n, types[n], dims[n] if shapes else None) for n in GD.SPEC.inputs]
    state_dims = [SLOTS, HV, DK, DV] if attrs.get("state_update") else ["B", HV, DK, DV]
    outputs = [helper.make_tensor_value_info("y", act, ["B", "S", HV, DV] if shapes else None),
               helper.make_tensor_value_info("new_state", pool, state_dims if shapes else None)]
    node = helper.make_node(GD.SPEC.name, list(GD.SPEC.inputs), list(GD.SPEC.outputs), domain=DOMAIN,
                            **attrs, plugin_namespace=GD.SPEC.plugin_namespace,
                            plugin_version=GD.SPEC.plugin_version)
    model = helper.make_model(helper.make_graph([node], "gated_delta", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                              functions=[GD.onnx_function(OPSET)])
    if shapes:  # the checker wants every graph input to have a shape; onnxruntime does not
        onnx.checker.check_model(model)
    return model


_SESSIONS: dict = {}


def _session(attrs: dict, **model_kw):
    import onnxruntime as ort

    key = (tuple(sorted(attrs.items())), tuple(sorted(model_kw.items())))
    if key not in _SESSIONS:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        _SESSIONS[key] = ort.InferenceSession(_node_model(attrs, **model_kw).SerializeToString(), opts,
                                              providers=["CPUExecutionProvider"])
    return _SESSIONS[key]


def run(face: str, q, k, v, g, beta, pool, slot_idx, seq_lens, scale=SCALE, qk_l2norm=1, state_update=0,
        node_attrs: dict | None = None):
    """The op through one face -> (y, new_state) as torch tensors."""
    if face == "torch":
        return GD.reference(q, k, v, g, beta, pool, slot_idx, seq_lens, scale, state_update, qk_l2norm)
    attrs = node_attrs if node_attrs is not None else dict(scale=scale, qk_l2norm=qk_l2norm,
                                                          state_update=state_update)
    feeds = dict(zip(GD.SPEC.inputs, (_np(x) for x in (q, k, v, g, beta, pool, slot_idx, seq_lens))))
    y, state = _session(attrs).run(None, feeds)
    return torch.from_numpy(y), torch.from_numpy(state)


# ----------------------------------------------------------------------------------------------
# the spec and the torch face's registration inputs


def test_spec_is_consistent():
    spec = GD.SPEC
    assert spec.domain == DOMAIN and spec.name == "GatedDeltaRule" and spec.torch_name == "gated_delta_rule"
    assert len(spec.output_dtypes_from) == len(spec.outputs)
    assert set(spec.output_dtypes_from) <= set(spec.inputs)
    assert {a.name for a in spec.attributes}.isdisjoint({"plugin_namespace", "plugin_version"})
    assert GD.IN_PLACE_ATTR in {a.name for a in spec.attributes}
    schema = torch._C.parse_schema(f"{spec.torch_qualname}{spec.torch_schema()}")
    assert [a.name for a in schema.arguments] == list(spec.inputs) + [a.name for a in spec.attributes]
    fn = GD.onnx_function(OPSET)
    assert (fn.domain, fn.name) == (DOMAIN, spec.name)
    assert list(fn.input) == list(spec.inputs) and len(fn.output) == len(spec.outputs)

    def domains(nodes):
        for n in nodes:
            yield n.domain
            for a in n.attribute:
                if a.g.node:
                    yield from domains(a.g.node)

    assert set(domains(fn.node)) <= {"", "ai.onnx"}, "the function must use standard ops only"


@pytest.mark.parametrize("state_update", [0, 1])
def test_fake_matches_reference_shapes(state_update):
    q, k, v, g, beta, pool = make_inputs(_gen(1), 2, 3)
    args = (q, k, v, g, beta, pool, torch.tensor([4, 1]), torch.tensor([3, 2]), SCALE, state_update, 1)
    for got, want in zip(GD.fake(*args), GD.reference(*args)):
        assert got.shape == want.shape and got.dtype == want.dtype


def test_torch_library_registration_traces():
    """What ``register_torch_ops`` will do (in a private namespace, so the real registration
    stays free): define the schema, implement it with the reference, trace with ``fake`` at
    dynamic batch and sequence."""
    spec = GD.SPEC
    ns = "graphkiln_gated_delta_test"
    lib = torch.library.Library(ns, "DEF")
    try:
        lib.define(spec.torch_name + spec.torch_schema())
        qualname = f"{ns}::{spec.torch_name}"
        torch.library.impl(qualname, "CompositeExplicitAutograd", lib=lib)(GD.reference)
        torch.library.register_fake(qualname, lib=lib)(GD.fake)
        op = getattr(getattr(torch.ops, ns), spec.torch_name).default

        class Layer(torch.nn.Module):
            def forward(self, q, k, v, g, beta, pool, slot_idx, seq_lens):
                return op(q, k, v, g, beta, pool, slot_idx, seq_lens, SCALE, 1, 1)

        q, k, v, g, beta, pool = make_inputs(_gen(2), 2, 3)
        args = (q, k, v, g, beta, pool, torch.tensor([4, 1]), torch.tensor([3, 2]))
        b, s = torch.export.Dim("B", min=1, max=SLOTS), torch.export.Dim("S")
        dyn = ({0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}, {0: b, 1: s}, None, {0: b}, {0: b})
        prog = torch.export.export(Layer(), args, dynamic_shapes=dyn)
        for got, want in zip(prog.module()(*args), GD.reference(*args, SCALE, 1, 1)):
            assert torch.equal(got, want)
    finally:
        lib._destroy()


# ----------------------------------------------------------------------------------------------
# 1. the reference is transformers' gated delta rule


def _hf(fn, q, k, v, g, beta, initial_state, l2norm: bool, **kw):
    return fn(q, k, v, g=g, beta=beta, initial_state=initial_state, output_final_state=True,
              use_qk_l2norm_in_kernel=l2norm, **kw)


@pytest.mark.parametrize("qk_l2norm", [1, 0], ids=["l2norm", "raw"])
@pytest.mark.parametrize("seq", [9, 70], ids=["loop", "chunked"])  # the reference picks the chunked form at >= 64
def test_reference_matches_transformers(qk_l2norm, seq):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    q, k, v, g, beta, pool = make_inputs(_gen(11 + seq), 2, seq)
    if not qk_l2norm:  # the un-normalised delta rule only stays bounded for small keys
        q, k = q * 0.3, k * 0.3
    slot_idx = torch.tensor([3, 1])
    y, state = GD.reference(q, k, v, g, beta, pool, slot_idx, torch.tensor([seq, seq]), SCALE, 0, qk_l2norm)
    initial = pool[slot_idx]
    for fn, kw in ((torch_recurrent_gated_delta_rule, {}), (torch_chunk_gated_delta_rule, {"chunk_size": 4}),
                   (torch_chunk_gated_delta_rule, {})):
        want_y, want_state = _hf(fn, q, k, v, g, beta, initial, bool(qk_l2norm), **kw)
        what = f"{fn.__name__}{kw}"
        assert_close(y, want_y, what=f"y vs {what}")
        assert_close(state, want_state, what=f"state vs {what}")


def test_both_forms_match_transformers_on_their_own():
    """recurrent and chunked (several chunks plus a partial one), each against both transformers forms."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)

    q, k, v, g, beta, pool = make_inputs(_gen(12), 2, 11)
    initial = pool[:2]
    qf, kf, vf, gf, bf, _ = GD.prepare(q, k, v, g, beta, torch.tensor([11, 11]), SCALE, 1)
    forms = {"recurrent": GD.recurrent(qf, kf, vf, gf, bf, initial),
             "chunked": GD.chunked(qf, kf, vf, gf, bf, initial, chunk_size=4)}
    for fn in (torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule):
        want_y, want_state = _hf(fn, q, k, v, g, beta, initial, True)
        for name, (y, state) in forms.items():
            assert_close(y.transpose(1, 2), want_y, what=f"{name} y vs {fn.__name__}")
            assert_close(state, want_state, what=f"{name} state vs {fn.__name__}")


def test_value_heads_share_qk_heads_by_repeat_interleave():
    """Value head h reads q/k head h // (Hv / Hk): the op on Hk heads equals the op on q/k heads
    repeated (interleaved) to Hv; tiling them instead would differ."""
    q, k, v, g, beta, pool = make_inputs(_gen(13), 1, 4)
    args = (pool, torch.tensor([0]), torch.tensor([4]), SCALE)
    y, state = GD.reference(q, k, v, g, beta, *args)
    rep = HV // HK
    y2, state2 = GD.reference(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta, *args)
    assert_close(y, y2, what="y")
    assert_close(state, state2, what="state")
    y3, _ = GD.reference(q.repeat(1, 1, rep, 1), k.repeat(1, 1, rep, 1), v, g, beta, *args)
    assert not torch.allclose(y, y3, atol=1e-3), "tiled heads gave the same output: the test cannot tell"


# ----------------------------------------------------------------------------------------------
# 2. padding: rows right-padded inside S, each row reads and writes its own slot


def _garbage_padding(q, k, v, g, beta, seq_lens):
    """Large (finite) values past each row's real tokens: g > 0 would blow the state up and beta
    outside (0, 1) would overwrite it, so any leak into real outputs or states is obvious."""
    for b, n in enumerate(seq_lens.tolist()):
        for x, val in ((q, 30.0), (k, -20.0), (v, 1e3), (g, 40.0), (beta, 7.0)):
            x[b, n:] = val


@pytest.mark.parametrize("face", FACES)
def test_padded_rows_equal_each_row_alone(face):
    rel = 1e-5 if face == "torch" else 1e-4
    seq_lens = torch.tensor([5, 1, 0])
    slot_idx = torch.tensor([3, 0, 2])
    q, k, v, g, beta, pool = make_inputs(_gen(21), 3, 5)
    _garbage_padding(q, k, v, g, beta, seq_lens)
    pool_before = pool.clone()
    y, rows = run(face, q, k, v, g, beta, pool, slot_idx, seq_lens)
    assert torch.equal(pool, pool_before), "the op modified its state_pool input"
    assert y.shape == v.shape and rows.shape == (3, HV, DK, DV)
    for b, (n, slot) in enumerate(zip(seq_lens.tolist(), slot_idx.tolist())):
        if n:
            alone = [x[b:b + 1, :n] for x in (q, k, v, g, beta)]
            want_y, want_state = GD.reference(*alone, pool, torch.tensor([slot]), torch.tensor([n]), SCALE)
            assert_close(y[b, :n], want_y[0], rel, what=f"row {b} outputs")
            assert_close(rows[b], want_state[0], rel, what=f"row {b} state")
        assert torch.all(y[b, n:] == 0), f"row {b}: padded outputs must be zero"
    assert torch.equal(rows[2], pool[2]), "a row with no tokens must keep its state"

    _, whole = run(face, q, k, v, g, beta, pool, slot_idx, seq_lens, state_update=1)
    assert whole.shape == pool.shape
    written = pool.clone()
    written[slot_idx] = rows
    assert_close(whole, written, rel, what="state_update=1 pool")
    untouched = torch.tensor([s not in slot_idx.tolist() for s in range(SLOTS)])
    assert torch.equal(whole[untouched], pool[untouched]), "slots not in slot_idx changed"
    assert torch.equal(whole[2], pool[2]), "the empty row's slot changed"


def test_chunked_form_masks_padding():
    """The chunked form (several chunks, padding inside one) gives the loop's results on padded rows."""
    seq_lens = torch.tensor([7, 3, 0])
    q, k, v, g, beta, pool = make_inputs(_gen(22), 3, 7)
    _garbage_padding(q, k, v, g, beta, seq_lens)
    qf, kf, vf, gf, bf, valid = GD.prepare(q, k, v, g, beta, seq_lens, SCALE, 1)
    initial = pool[:3]
    y1, s1 = GD.recurrent(qf, kf, vf, gf, bf, initial)
    y2, s2 = GD.chunked(qf, kf, vf, gf, bf, initial, chunk_size=2)
    m = valid.unsqueeze(1).unsqueeze(-1)
    assert_close(y2 * m, y1 * m, what="outputs at real tokens")
    assert_close(s2, s1, what="states")
    assert torch.equal(s1[2], pool[2])


# ----------------------------------------------------------------------------------------------
# 3. decode chaining: a prefill then token-by-token steps through the pool equals one pass


@pytest.mark.parametrize("state_update", [0, 1])
@pytest.mark.parametrize("face", FACES)
def test_prefill_then_decode_equals_one_pass(face, state_update):
    rel = 1e-5 if face == "torch" else 1e-4
    total = 7
    q, k, v, g, beta, pool = make_inputs(_gen(31), 2, total)
    slot_idx = torch.tensor([4, 1])
    pool[slot_idx] = 0  # fresh sequences: the runtime zeroes a claimed slot
    others = pool.clone()
    whole_y, whole_state = run(face, q, k, v, g, beta, pool, slot_idx, torch.tensor([total, total]))
    # the whole pass from zero states is transformers' forward with no cache
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    want_y, want_state = _hf(torch_chunk_gated_delta_rule, q, k, v, g, beta, None, True)
    assert_close(whole_y, want_y, rel, what="whole pass vs transformers")
    assert_close(whole_state, want_state, rel, what="whole state vs transformers")

    # row 0 prefills 4 tokens, row 1 only 3 (padded to 4), then both decode one token per step;
    # row 0, done first, sits out the last step (seq_lens 0)
    pos = [0, 0]
    ys = [[], []]
    schedule = [(4, 3), (1, 1), (1, 1), (1, 1), (0, 1)]
    for n0, n1 in schedule:
        s = max(n0, n1)
        chunk = [torch.zeros((2, s) + x.shape[2:]) for x in (q, k, v, g, beta)]
        for b, n in enumerate((n0, n1)):
            for c, x in zip(chunk, (q, k, v, g, beta)):
                c[b, :n] = x[b, pos[b]:pos[b] + n]
        lens = torch.tensor([n0, n1])
        y, new_state = run(face, *chunk, pool, slot_idx, lens, state_update=state_update)
        for b, n in enumerate((n0, n1)):
            ys[b].append(y[b, :n])
            pos[b] += n
        if state_update:
            pool = new_state  # the whole pool comes back, rows written in place
        else:
            pool = pool.clone()
            pool[slot_idx] = new_state  # the caller writes the rows back into pool[slot_idx]
    assert pos == [total, total]
    for b in range(2):
        assert_close(torch.cat(ys[b]), whole_y[b], rel, what=f"row {b} chunked outputs")
        assert_close(pool[slot_idx[b]], whole_state[b], rel, what=f"row {b} state after the steps")
    mask = torch.ones(SLOTS, dtype=torch.bool)
    mask[slot_idx] = False
    assert torch.equal(pool[mask], others[mask]), "other slots changed"


# ----------------------------------------------------------------------------------------------
# 4. onnxruntime runs the function: equal to the reference


@pytest.mark.parametrize("state_update", [0, 1])
@pytest.mark.parametrize("size", [(3, 1, (1, 0, 1)), (3, 7, (7, 4, 0)), (1, 7, (7,))],
                         ids=["decode", "prefill_padded", "prefill_one_row"])
def test_onnx_function_matches_reference(size, state_update):
    batch, seq, lens = size
    q, k, v, g, beta, pool = make_inputs(_gen(41 + seq), batch, seq)
    seq_lens = torch.tensor(lens)
    _garbage_padding(q, k, v, g, beta, seq_lens)
    slot_idx = torch.tensor([2, 4, 0][:batch])
    want = GD.reference(q, k, v, g, beta, pool, slot_idx, seq_lens, SCALE, state_update, 1)
    got = run("onnx", q, k, v, g, beta, pool, slot_idx, seq_lens, state_update=state_update)
    for name, gt, w in zip(GD.SPEC.outputs, got, want):
        assert gt.dtype == w.dtype, f"{name}: dtype {gt.dtype} != {w.dtype}"
        assert_close(gt, w, 1e-4, what=f"{name} at {size}")


def test_onnx_function_attributes():
    """qk_l2norm=0 and the scale reach the function; a node without the defaulted attributes
    means qk_l2norm=1, state_update=0 (the function's defaults)."""
    q, k, v, g, beta, pool = make_inputs(_gen(51), 2, 5)
    q, k = q * 0.3, k * 0.3
    args = (q, k, v, g, beta, pool, torch.tensor([1, 3]), torch.tensor([5, 2]))
    for scale, l2 in ((0.7, 0), (0.2, 1)):
        want = GD.reference(*args, scale, 0, l2)
        got = run("onnx", *args, scale=scale, qk_l2norm=l2)
        for name, gt, w in zip(GD.SPEC.outputs, got, want):
            assert_close(gt, w, 1e-4, what=f"{name} at scale {scale}, qk_l2norm {l2}")
    want = GD.reference(*args, SCALE)
    got = run("onnx", *args, node_attrs={"scale": SCALE})
    for name, gt, w in zip(GD.SPEC.outputs, got, want):
        assert_close(gt, w, 1e-4, what=f"{name} with defaulted attributes")


@pytest.mark.parametrize("state_update", [0, 1])
def test_onnx_function_runs_without_input_shapes_in_other_dtypes(state_update):
    """fp16 activations and pool, int32 indices, inputs of unknown rank (what a graph may feed
    the node): onnxruntime's Scan still runs (its body is typed), y and new_state keep their dtypes."""
    from onnx import TensorProto

    q, k, v, g, beta, pool = make_inputs(_gen(61), 2, 4)
    q, k, v, pool = (x.half() for x in (q, k, v, pool))
    slot_idx, seq_lens = torch.tensor([3, 1], dtype=torch.int32), torch.tensor([4, 2], dtype=torch.int32)
    want = GD.reference(q, k, v, g, beta, pool, slot_idx, seq_lens, SCALE, state_update, 1)
    sess = _session(dict(scale=SCALE, qk_l2norm=1, state_update=state_update), act=TensorProto.FLOAT16,
                    pool=TensorProto.FLOAT16, index=TensorProto.INT32, shapes=False)
    got = sess.run(None, dict(zip(GD.SPEC.inputs, (_np(x) for x in (q, k, v, g, beta, pool, slot_idx, seq_lens)))))
    for name, gt, w in zip(GD.SPEC.outputs, got, want):
        assert gt.dtype == np.float16, f"{name}: dtype {gt.dtype}"
        assert_close(gt, w.float(), 2e-3, what=name)
