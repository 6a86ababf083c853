"""graphkiln.SsmScan (``graphkiln.ops.ssm_scan``): the Mamba-2 scan, its torch reference and its
ONNX function, against transformers' Mamba-2 code and the semantics its docstring states.

Two faces: ``torch`` (the module's ``reference``) and ``onnx`` (a one-node model whose
``graphkiln`` node onnxruntime runs through the attached function, as exported models do).
Oracles: transformers' own scan functions (the chunked segment-sum path every prompt takes and
the single-token update every decode step takes, NemotronH's copies, which GraniteMoeHybrid's
and Bamba's equal) and a whole NemotronH Mamba-2 mixer rebuilt around the op from graphkiln's
ShortConv; then ragged rows, slots and chained calls, each against the unpadded one-pass run.
The pool is [slots, H, N, P]; transformers keeps [B, H, P, N], so its states are transposed
where they are compared (N != P here, so a layout mix-up cannot pass).

The generic checks every registered op gets (export, schema, in-place mode) are in
tests/test_custom_ops.py; the TensorRT kernel's in tests/test_trt_kernels_ssm_scan.py and the
onnxruntime lowering's in tests/test_ort_ssm_scan.py.
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from graphkiln.ops import short_conv, ssm_scan
from graphkiln.ops.spec import DOMAIN
from reference import assert_close

OPSET = 23
FACES = ("torch", "onnx")
# heads, head dim, groups (three heads each: G != H / G, so a head-group mix-up cannot pass by
# symmetry), state size, slots in the pool
H, P, G, N, SLOTS = 6, 3, 2, 5, 5
FMAX = ssm_scan.FLOAT32_MAX


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def scan_inputs(gen, batch: int, seq: int, dtype=torch.float32, seq_lens=None, index_dtype=torch.int64):
    """Op inputs: random activations, distinct slots, a pool of distinct nonzero states; A and
    dt_bias spread so the decays run from near 0 to near 1. Rows' lengths default to full."""
    a_log = torch.rand(H, generator=gen) * 2.0  # A in [-7.4, -1]
    slot_idx = torch.randperm(SLOTS, generator=gen)[:batch]
    lens = torch.full((batch,), seq) if seq_lens is None else torch.as_tensor(seq_lens)
    return (_randn(gen, batch, seq, H, P, dtype=dtype), _randn(gen, batch, seq, H, dtype=dtype),
            -torch.exp(a_log), _randn(gen, batch, seq, G, N, dtype=dtype), _randn(gen, batch, seq, G, N, dtype=dtype),
            _randn(gen, H, dtype=dtype), _randn(gen, H, scale=1.5, dtype=dtype) - 1.0,
            _randn(gen, SLOTS, H, N, P), slot_idx.to(index_dtype), lens.to(index_dtype))


# ----------------------------------------------------------------------------------------------
# the onnx face: one graphkiln node + the attached function, run by onnxruntime


_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int64: 7, torch.int32: 6}
# symbolic dims per input and output (the function is shape-generic)
_DIMS = dict(x="BSHP", dt="BSH", A="H", Bm="BSGN", Cm="BSGN", D="H", dt_bias="H", state_pool="THNP", slot_idx="B",
             seq_lens="B", y="BSHP")  # the pool is [slots, H, N, P]


def _model(dtypes: tuple, state_update: int, dt_min: float, dt_max: float):
    import onnx_ir as ir
    from onnx import helper

    spec = ssm_scan.SPEC
    # through onnx_ir and back, as registry.attach_functions attaches it to exported models
    function = ir.serde.serialize_function(ir.serde.deserialize_function(ssm_scan.onnx_function(OPSET)))
    node = helper.make_node(spec.name, list(spec.inputs), list(spec.outputs), domain=DOMAIN,
                            state_update=state_update, dt_min=dt_min, dt_max=dt_max,
                            plugin_namespace=spec.plugin_namespace, plugin_version=spec.plugin_version)
    out_types = [dtypes[spec.inputs.index(src)] for src in spec.output_dtypes_from]
    graph = helper.make_graph(
        [node], "ssm_scan",
        [helper.make_tensor_value_info(n, d, list(_DIMS[n])) for n, d in zip(spec.inputs, dtypes)],
        [helper.make_tensor_value_info(n, d, list(_DIMS.get(n, "RHNP"))) for n, d in zip(spec.outputs, out_types)])
    return helper.make_model(graph, functions=[function],
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, spec.version)])


@cache
def _session(dtypes: tuple, state_update: int, dt_min: float, dt_max: float):
    import onnx
    import onnxruntime as ort

    model = _model(dtypes, state_update, dt_min, dt_max)
    onnx.checker.check_model(model)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _ortvalue(t: torch.Tensor):
    """An OrtValue over t's own memory (bf16, which numpy lacks, as its int16 bits)."""
    import onnxruntime as ort

    arr = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()
    return arr, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, _ONNX_TYPES[t.dtype])


def run_onnx(*inputs, state_update: int = 0, dt_min: float = 0.0, dt_max: float = FMAX):
    """The one-node model on onnxruntime; outputs written into tensors of the shapes and dtypes
    the spec promises (onnxruntime refuses a run whose outputs do not fit them)."""
    inputs = [t.contiguous() for t in inputs]
    session = _session(tuple(_ONNX_TYPES[t.dtype] for t in inputs), state_update, float(np.float32(dt_min)), dt_max)
    x, pool = inputs[0], inputs[7]
    outputs = (torch.empty_like(x),
               torch.empty(pool.shape if state_update else (x.shape[0], *pool.shape[1:]), dtype=pool.dtype))
    binding, held = session.io_binding(), []  # arrays and OrtValues stay alive until the run is done
    for names, tensors, bind in ((ssm_scan.SPEC.inputs, inputs, binding.bind_ortvalue_input),
                                 (ssm_scan.SPEC.outputs, outputs, binding.bind_ortvalue_output)):
        for name, t in zip(names, tensors):
            held.append(_ortvalue(t))
            bind(name, held[-1][1])
    session.run_with_iobinding(binding)
    return outputs


def run(face: str, *inputs, state_update: int = 0, dt_min: float = 0.0, dt_max: float = FMAX):
    if face == "torch":
        return ssm_scan.reference(*inputs, state_update, dt_min, dt_max)
    return run_onnx(*inputs, state_update=state_update, dt_min=dt_min, dt_max=dt_max)


# ----------------------------------------------------------------------------------------------
# 1. transformers' Mamba-2 scan: the chunked path and the single-token path, then a whole mixer


def _hf_scan_functions():
    from transformers.models.nemotron_h import modeling_nemotron_h as m

    return m.mamba2_chunk_scan, m.mamba2_selective_state_update


@pytest.mark.parametrize("face", FACES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_matches_transformers_chunked_scan(face, dtype):
    """Prefill from nonzero states over several chunks (the last one partial), both dt clamps
    active. fp16 / bf16: dt + dt_bias and softplus are rounded to that dtype where transformers
    rounds them (its fp32 final state shows a mismatch there); the rest is fp32 in both, and
    transformers' y is fp32 where ours is rounded to x's dtype."""
    chunk_scan, _ = _hf_scan_functions()
    seq, lo, hi = 8, 0.05, 1.5
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = scan_inputs(_gen(1), 3, seq, dtype)
    start = pool[slot_idx].transpose(2, 3)  # transformers' states are [B, H, P, N]
    with torch.no_grad():
        want_y, want_state = chunk_scan(x, dt, a, bm, cm, chunk_size=3, D=d, dt_bias=dt_bias, initial_states=start,
                                        dt_softplus=True, dt_limit=(lo, hi), return_final_states=True)
    sp = F.softplus(dt.float() + dt_bias.float())
    assert (sp < lo).any() and (sp > hi).any(), "neither clamp is exercised: the test has no teeth"
    y, state = run(face, x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens, dt_min=lo, dt_max=hi)
    assert y.dtype == dtype and state.dtype == torch.float32
    assert_close(state, want_state.transpose(2, 3), what=f"{face} final state")
    rounding = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # ours rounded to x's dtype
    assert_close(y, want_y, rel=rounding, what=f"{face} y")
    if dtype != torch.float32:  # rounding dt is what makes the states agree (~1e-4 apart without)
        unrounded = (x.float(), dt.float(), a, bm.float(), cm.float(), d.float(), dt_bias.float())
        _, state32 = ssm_scan.reference(*unrounded, pool, slot_idx, seq_lens, 0, lo, hi)
        assert (state32 - want_state.transpose(2, 3)).abs().max() > 1e-5 * want_state.abs().max(), "no teeth"


@pytest.mark.parametrize("face", FACES)
def test_matches_transformers_single_token_update(face):
    """Decode steps from nonzero states (transformers' selective_state_update has no dt limit:
    the op runs with the defaults, which clamp nothing)."""
    _, state_update = _hf_scan_functions()
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = scan_inputs(_gen(2), 3, 1)
    hf_state = pool[slot_idx].transpose(2, 3).contiguous()  # transformers' [B, H, P, N]
    with torch.no_grad():
        want_y = state_update(hf_state, x[:, 0], dt[:, 0, :, None].expand(-1, -1, P),
                              a[:, None, None].expand(-1, P, N), bm[:, 0], cm[:, 0], d[:, None].expand(-1, P),
                              dt_bias=dt_bias[:, None].expand(-1, P), dt_softplus=True)
    y, state = run(face, x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens)
    assert_close(y[:, 0], want_y, what=f"{face} y")
    assert_close(state, hf_state.transpose(2, 3), what=f"{face} state")  # transformers updated hf_state in place


def _hf_mixer():
    import transformers
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = transformers.NemotronHConfig(hidden_size=16, mamba_num_heads=H, mamba_head_dim=P, n_groups=G,
                                       ssm_state_size=N, conv_kernel=4, chunk_size=4, layer_types=["linear_attention"],
                                       vocab_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    mixer = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    g = _gen(5)
    with torch.no_grad():
        for name, p in mixer.named_parameters():
            p.copy_(_randn(g, *p.shape, scale=0.5))
        mixer.A_log.copy_(torch.rand(H, generator=g) * 2.0)
        mixer.norm.weight.add_(1.0)
        # head 0's dt sits at NemotronH's lower limit (time_step_min): the clamp matters
        mixer.dt_bias[0] = -7.0
    assert mixer.time_step_limit == (cfg.time_step_min, float("inf")) and cfg.time_step_min > 0
    return cfg, mixer


class OpMixer:
    """The NemotronH Mamba-2 mixer rebuilt from graphkiln ops (what the integrator exports):
    in_proj -> (gate, xBC, dt); ShortConv + SiLU over xBC; split x / B / C; SsmScan; gated
    grouped RMSNorm (the mixer's own) and out_proj. Conv and SSM states live in slot pools."""

    def __init__(self, mixer, face: str):
        self.m, self.face = mixer, face
        self.conv_dim = mixer.conv_dim
        self.conv_pool = torch.zeros(SLOTS, self.conv_dim, mixer.conv_kernel_size - 1)
        self.ssm_pool = torch.zeros(SLOTS, H, N, P)

    def __call__(self, hidden, slot_idx, seq_lens, dt_min: float):
        m = self.m
        b, s, _ = hidden.shape
        gate, xbc, dt = m.in_proj(hidden).split([H * P, self.conv_dim, H], dim=-1)
        conv, conv_rows = short_conv.reference(xbc, m.conv1d.weight.squeeze(1), m.conv1d.bias, self.conv_pool, slot_idx,
                                               seq_lens, self.conv_dim)
        x, bm, cm = F.silu(conv).split([H * P, G * N, G * N], dim=-1)
        y, ssm_rows = run(self.face, x.reshape(b, s, H, P), dt, -torch.exp(m.A_log.float()), bm.reshape(b, s, G, N),
                          cm.reshape(b, s, G, N), m.D, m.dt_bias, self.ssm_pool, slot_idx, seq_lens, dt_min=dt_min)
        self.conv_pool[slot_idx] = conv_rows
        self.ssm_pool[slot_idx] = ssm_rows
        return m.out_proj(m.norm(y.reshape(b, s, H * P), gate))


@pytest.mark.parametrize("face", FACES)
def test_rebuilt_mixer_matches_transformers_nemotron_h(face):
    """A NemotronH Mamba-2 mixer with random weights: one uncached pass; then, with a cache, a
    prefill and single-token steps. The prefill clamps dt at time_step_min (the op's dt_min);
    transformers' single-token path clamps nothing, so the steps run with dt_min = 0."""
    from transformers.cache_utils import DynamicCache

    cfg, mixer = _hf_mixer()
    batch, prompt, steps = 2, 7, 3
    hidden = _randn(_gen(6), batch, prompt + steps, 16)
    slot_idx, lo = torch.tensor([3, 1]), cfg.time_step_min
    with torch.no_grad():
        whole = mixer(hidden)  # no cache: the chunked path over two chunks, from zero states
        assert_close(OpMixer(mixer, face)(hidden, slot_idx, torch.full((batch,), prompt + steps), lo), whole,
                     what=f"{face} uncached pass")
        unclamped = OpMixer(mixer, face)(hidden, slot_idx, torch.full((batch,), prompt + steps), 0.0)
        assert (unclamped - whole).abs().max() > 1e-4 * whole.abs().max(), "dt_min changes nothing: no teeth"

        cache = DynamicCache(config=cfg)
        ours = OpMixer(mixer, face)
        want = mixer(hidden[:, :prompt], cache=cache)
        assert_close(ours(hidden[:, :prompt], slot_idx, torch.full((batch,), prompt), lo), want, what=f"{face} prefill")
        for t in range(prompt, prompt + steps):
            want = mixer(hidden[:, t:t + 1], cache=cache)  # transformers' recurrent (single-token) path
            assert_close(ours(hidden[:, t:t + 1], slot_idx, torch.ones(batch, dtype=torch.int64), 0.0), want,
                         what=f"{face} step {t}")
        assert_close(ours.ssm_pool[slot_idx], cache.get_recurrent_state(0, state_idx=0).transpose(2, 3),
                     what=f"{face} ssm state")
        assert cache.get_recurrent_state(0, state_idx=0).dtype == torch.float32  # why the pool is fp32


# ----------------------------------------------------------------------------------------------
# 2. ragged rows and slots


@pytest.mark.parametrize("face", FACES)
def test_padding_rows_and_slots(face):
    """seq_lens [5, 1, 0] within S = 5: every row equals its unpadded run from its own slot;
    padding (NaN in one row, huge values in another) reaches neither states nor outputs; a row
    with no tokens keeps its state bit-for-bit; state_update=1 writes only the batch's slots."""
    seq, lens = 5, [5, 1, 0]
    inputs = list(scan_inputs(_gen(10), 3, seq, seq_lens=lens))
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, seq_lens = inputs
    for t, fill in ((x, float("nan")), (dt, float("nan")), (bm, float("nan")), (cm, float("nan"))):
        t[1, 1:] = fill
    for t in (x, dt, bm, cm):
        t[2] = 1e4
    before = pool.clone()
    y, rows = run(face, *inputs)
    assert torch.equal(pool, before), "the op modified its state_pool input"
    assert torch.isfinite(y).all() and not y[1, 1:].any() and not y[2].any(), "padding outputs must be zeros"
    for b, n in enumerate(lens):
        if n:
            alone = [t[b:b + 1, :n] for t in (x, dt)] + [a, bm[b:b + 1, :n], cm[b:b + 1, :n], d, dt_bias, pool,
                                                         slot_idx[b:b + 1], torch.tensor([n])]
            want_y, want_row = ssm_scan.reference(*alone)
            assert_close(y[b, :n], want_y[0], what=f"{face} row {b} outputs")
            assert_close(rows[b], want_row[0], what=f"{face} row {b} state")
            assert not torch.equal(rows[b], pool[slot_idx[b]])
    assert torch.equal(rows[2], pool[slot_idx[2]]), "a row with no tokens must keep its state exactly"

    _, whole = run(face, *inputs, state_update=1)
    assert whole.shape == pool.shape
    want = pool.clone()
    want[slot_idx] = rows
    assert_close(whole, want, what=f"{face} pool")
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[slot_idx] = False
    assert torch.equal(whole[others], pool[others]), "slots outside the batch changed"


# ----------------------------------------------------------------------------------------------
# 3. chained calls


@pytest.mark.parametrize("state_update", [0, 1])
@pytest.mark.parametrize("face", FACES)
def test_prefill_then_steps_equals_one_pass(face, state_update):
    """A prompt of 5 in one call, then single tokens, state carried through the pool, equals one
    9-token pass; each sequence keeps to its slot."""
    seq, prompt = 9, 5
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, _ = scan_inputs(_gen(20), 2, seq)
    whole_y, whole_rows = ssm_scan.reference(x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, torch.full((2,), seq))
    state = pool.clone()
    ys = []
    for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, seq)]:
        part = [t[:, lo:hi] for t in (x, dt)] + [a, bm[:, lo:hi], cm[:, lo:hi], d, dt_bias]
        y, new = run(face, *part, state, slot_idx, torch.full((2,), hi - lo), state_update=state_update)
        ys.append(y)
        if state_update:
            state = new
        else:
            state[slot_idx] = new
    assert_close(torch.cat(ys, dim=1), whole_y, what=f"{face} chained outputs")
    assert_close(state[slot_idx], whole_rows, what=f"{face} chained states")
    others = torch.ones(SLOTS, dtype=torch.bool)
    others[slot_idx] = False
    assert torch.equal(state[others], pool[others])


# ----------------------------------------------------------------------------------------------
# 4. the onnx function against the reference


@pytest.mark.parametrize("state_update", [0, 1])
@pytest.mark.parametrize("case", ["decode", "prefill_padded", "int32_indices"])
def test_onnx_function_matches_reference(case, state_update):
    if case == "decode":
        inputs = scan_inputs(_gen(30), 4, 1, seq_lens=[1, 1, 0, 1])
    else:
        index_dtype = torch.int32 if case == "int32_indices" else torch.int64
        inputs = scan_inputs(_gen(31), 4, 7, seq_lens=[7, 3, 0, 6], index_dtype=index_dtype)
    want = ssm_scan.reference(*inputs, state_update)
    got = run_onnx(*inputs, state_update=state_update)
    for name, g, w in zip(ssm_scan.SPEC.outputs, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert_close(g, w, rel=1e-4, what=f"{case} {name}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_onnx_function_half_activations(dtype):
    """fp16 / bf16 activations and parameters with an fp32 pool (how the models keep it)."""
    inputs = scan_inputs(_gen(32), 3, 6, dtype, seq_lens=[6, 2, 4])
    for state_update in (0, 1):
        want = ssm_scan.reference(*inputs, state_update, 0.01, 2.0)
        got = run_onnx(*inputs, state_update=state_update, dt_min=0.01, dt_max=2.0)
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        assert_close(got[0], want[0], rel=1e-2, what=f"{dtype} y")
        assert_close(got[1], want[1], rel=1e-4, what="fp32 state")


@pytest.mark.parametrize("face", FACES)
def test_half_activations_with_the_default_dt_limits(face):
    """fp16 cannot hold dt_max's default (the largest fp32): the op still runs at the defaults,
    and equals a run with no upper limit that fits fp16 (none of these dt reach it)."""
    inputs = scan_inputs(_gen(33), 2, 4, torch.float16, seq_lens=[4, 2])
    y, state = run(face, *inputs)
    want_y, want_state = ssm_scan.reference(*inputs, 0, 0.0, 6e4)
    assert torch.isfinite(y).all() and torch.isfinite(state).all()
    assert_close(y, want_y, rel=1e-3, what=f"{face} y")
    assert_close(state, want_state, what=f"{face} state")


def test_onnx_function_shape():
    """Standard ops only, a Scan over the tokens, and the spec's attributes (plugin ones too)."""
    fn = ssm_scan.onnx_function(OPSET)
    spec = ssm_scan.SPEC
    assert (fn.domain, fn.name) == (DOMAIN, spec.name)
    assert list(fn.input) == list(spec.inputs) and len(fn.output) == len(spec.outputs)
    attrs = set(fn.attribute) | {a.name for a in fn.attribute_proto}
    assert attrs == {a.name for a in spec.attributes} | {"plugin_namespace", "plugin_version"}
    defaults = {a.name: a for a in fn.attribute_proto}
    assert defaults["state_update"].i == 0 and defaults["dt_min"].f == 0.0 and defaults["dt_max"].f == np.float32(FMAX)
    assert all(n.domain in ("", "ai.onnx") for n in fn.node)
    assert "Scan" in [n.op_type for n in fn.node]


# ----------------------------------------------------------------------------------------------
# the torch face's registration: schema and fake


def test_torch_schema_and_fake():
    from graphkiln.ops import torch_op

    op = torch_op("SsmScan")
    schema = str(op._schema)
    assert "int state_update=0, float dt_min=0., float dt_max=3.4028234663852886e+38" in schema, schema
    for state_update in (0, 1):
        for seq, lens in ((4, [4, 1]), (1, [1, 0])):
            args = (*scan_inputs(_gen(40), 2, seq, seq_lens=lens), state_update, 0.01, 3.0)
            result = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
            assert all(v == "SUCCESS" for v in result.values()), result
    # the defaults are the reference's: a call without the attributes is the state_update=0 call
    inputs = scan_inputs(_gen(41), 2, 3)
    for g, w in zip(op(*inputs), ssm_scan.reference(*inputs, 0, 0.0, FMAX)):
        assert torch.equal(g, w)


def test_spec_is_consistent():
    spec = ssm_scan.SPEC
    assert (spec.name, spec.torch_name, spec.domain) == ("SsmScan", "ssm_scan", "graphkiln")
    assert spec.attributes[0].name == ssm_scan.IN_PLACE_ATTR == "state_update"  # (*required, mode) positionally
    assert all(a.default is not None for a in spec.attributes)
    assert len(spec.output_dtypes_from) == len(spec.outputs) and set(spec.output_dtypes_from) <= set(spec.inputs)
    assert spec.doc.strip()
