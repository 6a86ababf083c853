"""The onnxruntime lowering of graphkiln.SsmScan (``graphkiln.export.lowering.ort_ssm_scan``)
against the op's own ONNX function, both run by onnxruntime on the same one-node model.

The function is the oracle (tests/test_ssm_scan_op.py checks it against transformers' Mamba-2
and the torch reference), so each case runs the model as exported and as lowered and compares
y and the new state: fp32 to 1e-5 of the output scale. Cases have G < H (the kernel's inverse-GQA
head map must be the op's h // (H / G)), nonzero starting states, ragged rows with non-finite
padding, both state_update modes, int32 indices, half activations with the dt clamps biting.

``python tests/test_ort_ssm_scan.py`` prints the timing the lowering's docstring quotes.
"""

from __future__ import annotations

import time
from functools import cache

import numpy as np
import onnx
import pytest
import torch

from graphkiln.export.lowering.ort_ssm_scan import lower_ssm_scan_for_onnxruntime
from graphkiln.ops import ssm_scan
from graphkiln.ops.spec import DOMAIN
from reference import assert_close

OPSET = 23
H, P, G, N, SLOTS = 6, 3, 2, 5, 5  # three heads per group; N != P so a transposed state shows
_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.bfloat16: 16, torch.int64: 7, torch.int32: 6}


def _model(dtypes: tuple, sizes: tuple, state_update: int, dt_min: float, dt_max: float,
           static_heads: bool = True) -> onnx.ModelProto:
    """One SsmScan node with its function attached (as exported models carry it). Batch,
    sequence and slots are symbolic; heads, head dim, groups and state size are static unless
    ``static_heads`` is False."""
    import onnx_ir as ir
    from onnx import helper

    spec = ssm_scan.SPEC
    h, p, g, n = sizes if static_heads else ("H", "P", "G", "N")
    dims = dict(x=["B", "S", h, p], dt=["B", "S", h], A=[h], Bm=["B", "S", g, n], Cm=["B", "S", g, n], D=[h],
                dt_bias=[h], state_pool=["T", h, n, p], slot_idx=["B"], seq_lens=["B"], y=["B", "S", h, p],
                new_state=["T" if state_update else "B", h, n, p])
    function = ir.serde.serialize_function(ir.serde.deserialize_function(ssm_scan.onnx_function(OPSET)))
    node = helper.make_node(spec.name, list(spec.inputs), list(spec.outputs), name="mixer.ssm", domain=DOMAIN,
                            state_update=state_update, dt_min=dt_min, dt_max=dt_max,
                            plugin_namespace=spec.plugin_namespace, plugin_version=spec.plugin_version)
    out_types = [dtypes[spec.inputs.index(src)] for src in spec.output_dtypes_from]
    graph = helper.make_graph(
        [node], "ssm_scan",
        [helper.make_tensor_value_info(nm, t, dims[nm]) for nm, t in zip(spec.inputs, dtypes)],
        [helper.make_tensor_value_info(nm, t, dims[nm]) for nm, t in zip(spec.outputs, out_types)])
    return helper.make_model(graph, functions=[function],
                             opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, spec.version)])


def _lowered(model: onnx.ModelProto) -> onnx.ModelProto:
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    assert lower_ssm_scan_for_onnxruntime(lowered) == 1
    return lowered


@cache
def _sessions(dtypes: tuple, sizes: tuple, state_update: int, dt_min: float, dt_max: float, threads: int = 1):
    """(function session, lowered session) for one configuration."""
    import onnxruntime as ort

    model = _model(dtypes, sizes, state_update, dt_min, dt_max)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return tuple(ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
                 for m in (model, _lowered(model)))


def _feed(t: torch.Tensor):
    import onnxruntime as ort

    arr = (t.contiguous().view(torch.int16) if t.dtype == torch.bfloat16 else t.contiguous()).numpy()
    return arr, ort.OrtValue.ortvalue_from_numpy_with_onnx_type(arr, _ONNX_TYPES[t.dtype])


def _run(session, inputs, state_update: int):
    """Outputs as torch tensors (bf16 read back from its bits)."""
    held = [_feed(t) for t in inputs]  # arrays alive until the run is done
    binding = session.io_binding()
    for name, (_, value) in zip(ssm_scan.SPEC.inputs, held):
        binding.bind_ortvalue_input(name, value)
    x, pool = inputs[0], inputs[7]
    outs = (torch.empty_like(x),
            torch.empty(pool.shape if state_update else (x.shape[0], *pool.shape[1:]), dtype=pool.dtype))
    out_held = [_feed(t) for t in outs]
    for name, (_, value) in zip(ssm_scan.SPEC.outputs, out_held):
        binding.bind_ortvalue_output(name, value)
    session.run_with_iobinding(binding)
    return outs


def scan_inputs(seed: int, batch: int, seq: int, lens, dtype=torch.float32, index_dtype=torch.int64, sizes=None,
                slots: int = SLOTS):
    """Random activations, A in [-7.4, -1], dt_bias spread so decays run from near 0 to near 1,
    a pool of distinct nonzero states, distinct slots; NaN in every padded x / dt / Bm / Cm."""
    h, p, g, n = sizes or (H, P, G, N)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, h, p, generator=gen)
    dt = torch.randn(batch, seq, h, generator=gen)
    bm = torch.randn(batch, seq, g, n, generator=gen)
    cm = torch.randn(batch, seq, g, n, generator=gen)
    seq_lens = torch.as_tensor(lens)
    pad = torch.arange(seq).unsqueeze(0) >= seq_lens.unsqueeze(1)
    for t in (x, dt, bm, cm):
        t[pad] = float("nan")
    return (x.to(dtype), dt.to(dtype), -torch.exp(torch.rand(h, generator=gen) * 2.0), bm.to(dtype), cm.to(dtype),
            torch.randn(h, generator=gen).to(dtype), (torch.randn(h, generator=gen) * 1.5 - 1.0).to(dtype),
            torch.randn(slots, h, n, p, generator=gen) * 0.5,
            torch.randperm(slots, generator=gen)[:batch].to(index_dtype), seq_lens.to(index_dtype))


CASES = {  # (batch, seq, lens, index dtype)
    "decode": (4, 1, [1, 1, 0, 1], torch.int64),
    "prefill_padded": (4, 9, [9, 3, 0, 6], torch.int64),
    "int32_indices": (3, 7, [7, 1, 4], torch.int32),
}


@pytest.mark.parametrize("state_update", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_lowered_matches_the_function(case, state_update):
    batch, seq, lens, index_dtype = CASES[case]
    inputs = scan_inputs(1, batch, seq, lens, index_dtype=index_dtype)
    dtypes = tuple(_ONNX_TYPES[t.dtype] for t in inputs)
    function, lowered = _sessions(dtypes, (H, P, G, N), state_update, 0.0, ssm_scan.FLOAT32_MAX)
    want = _run(function, inputs, state_update)
    got = _run(lowered, inputs, state_update)
    for name, g, w in zip(ssm_scan.SPEC.outputs, got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert_close(g, w, what=f"{case} {name}")
    real = torch.arange(seq).unsqueeze(0) < torch.as_tensor(lens).unsqueeze(1)
    assert not got[0][~real].any(), "y at padded positions must be 0"
    slot_idx, pool = inputs[8].long(), inputs[7]
    rows = got[1][slot_idx] if state_update else got[1]
    for b, n in enumerate(lens):  # a row with no real tokens keeps its state bit-for-bit
        if n == 0:
            assert torch.equal(rows[b], pool[slot_idx[b]])
        else:
            assert not torch.equal(rows[b], pool[slot_idx[b]])
    if state_update:
        others = torch.ones(SLOTS, dtype=torch.bool)
        others[slot_idx] = False
        assert torch.equal(got[1][others], pool[others]), "slots outside the batch changed"


def test_padded_rows_equal_their_unpadded_runs():
    """Each row of a ragged batch (NaN padding) equals the same row run alone without padding:
    padding neither decays nor feeds the state."""
    lens = [9, 4, 1]
    inputs = scan_inputs(2, 3, 9, lens)
    dtypes = tuple(_ONNX_TYPES[t.dtype] for t in inputs)
    _, lowered = _sessions(dtypes, (H, P, G, N), 0, 0.0, ssm_scan.FLOAT32_MAX)
    y, rows = _run(lowered, inputs, 0)
    x, dt, a, bm, cm, d, dt_bias, pool, slot_idx, _ = inputs
    for b, n in enumerate(lens):
        alone = (x[b:b + 1, :n], dt[b:b + 1, :n], a, bm[b:b + 1, :n], cm[b:b + 1, :n], d, dt_bias, pool,
                 slot_idx[b:b + 1], torch.tensor([n]))
        y1, row1 = _run(lowered, alone, 0)
        assert_close(y[b, :n], y1[0], rel=1e-6, what=f"row {b} y")
        assert_close(rows[b], row1[0], rel=1e-6, what=f"row {b} state")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_activations_with_dt_limits(dtype):
    """Half activations and parameters, fp32 pool; both dt clamps bite (and change the result)."""
    lo, hi = 0.1, 1.2
    inputs = scan_inputs(3, 3, 6, [6, 2, 4], dtype=dtype)
    sp = torch.nn.functional.softplus(inputs[1].float() + inputs[6].float())
    assert (sp < lo).any() and (sp > hi).any(), "neither clamp is exercised: the test has no teeth"
    dtypes = tuple(_ONNX_TYPES[t.dtype] for t in inputs)
    rows = {}
    for state_update in (0, 1):
        function, lowered = _sessions(dtypes, (H, P, G, N), state_update, lo, hi)
        want, got = _run(function, inputs, state_update), _run(lowered, inputs, state_update)
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
        assert_close(got[0], want[0], rel=1e-2, what=f"{dtype} y")  # one rounding to the half dtype apart
        assert_close(got[1], want[1], what="fp32 state")
        rows[state_update] = got[1]
    _, unclamped = _sessions(dtypes, (H, P, G, N), 0, 0.0, ssm_scan.FLOAT32_MAX)
    assert (_run(unclamped, inputs, 0)[1] - rows[0]).abs().max() > 1e-3, "the limits change nothing: no teeth"


def test_lowered_graph_is_one_linear_attention_with_the_ops_head_map():
    model = _model((1,) * 8 + (7, 7), (H, P, G, N), 1, 0.0, ssm_scan.FLOAT32_MAX)
    lowered = _lowered(model)
    onnx.checker.check_model(lowered, full_check=True)
    ops = [n.op_type for n in lowered.graph.node]
    assert "SsmScan" not in ops and ops.count("LinearAttention") == 1 and "Scan" not in ops
    (la,) = (n for n in lowered.graph.node if n.op_type == "LinearAttention")
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in la.attribute}
    assert la.domain == "com.microsoft"
    assert attrs == {"q_num_heads": G, "kv_num_heads": H, "scale": 1.0, "update_rule": b"gated"}
    assert not [f for f in lowered.functions if f.name == "SsmScan"], "the unused function stays attached"
    assert {o.domain for o in lowered.opset_import} == {"", "com.microsoft"}
    assert [o.name for o in lowered.graph.output] == list(ssm_scan.SPEC.outputs)


def test_a_node_with_unknown_head_counts_keeps_its_function():
    model = _model((1,) * 8 + (7, 7), (H, P, G, N), 0, 0.0, ssm_scan.FLOAT32_MAX, static_heads=False)
    before = model.SerializeToString()
    assert lower_ssm_scan_for_onnxruntime(model) == 0
    assert model.SerializeToString() == before


class _Mixer(torch.nn.Module):
    """The scan as a model calls it: x, dt, B and C projected from the hidden states and reshaped
    (so their head and group counts are only in the exported graph's value_info), A a buffer."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        gen = torch.Generator().manual_seed(4)
        self.proj = torch.nn.Parameter(torch.randn(hidden, H * P + H + 2 * G * N, generator=gen) * 0.4)
        self.a = torch.nn.Buffer(-torch.exp(torch.rand(H, generator=gen) * 2.0))
        self.d = torch.nn.Parameter(torch.randn(H, generator=gen))
        self.dt_bias = torch.nn.Parameter(torch.randn(H, generator=gen) - 1.0)

    def forward(self, hidden, pool, slot_idx, seq_lens):
        from graphkiln.ops import torch_op

        b, s, _ = hidden.shape
        x, dt, bm, cm = (hidden @ self.proj).split([H * P, H, G * N, G * N], dim=-1)
        return torch_op("SsmScan")(x.reshape(b, s, H, P), dt, self.a, bm.reshape(b, s, G, N),
                                   cm.reshape(b, s, G, N), self.d, self.dt_bias, pool, slot_idx, seq_lens, 1, 0.01)


def test_an_exported_graph_is_lowered_and_computes_the_same():
    """torch.onnx export of a module calling the op (dynamic batch and sequence): the lowering
    finds the head counts in the graph's value_info, and the lowered graph computes what the
    exported one does, writing the pool in place (state_update 1)."""
    import onnxruntime as ort

    from graphkiln.export.custom_ops import registry

    mixer = _Mixer().eval()
    gen = torch.Generator().manual_seed(5)
    b, s = torch.export.Dim("B"), torch.export.Dim("S")
    example = (torch.randn(3, 5, 8, generator=gen), torch.randn(SLOTS, H, N, P, generator=gen),
               torch.tensor([4, 0, 2]), torch.tensor([5, 2, 0]))
    prog = torch.onnx.export(mixer, example, dynamo=True, opset_version=OPSET, verbose=False,
                             custom_translation_table=registry.translation_table(),
                             dynamic_shapes=({0: b, 1: s}, None, {0: b}, {0: b}))
    registry.attach_functions(prog.model)
    model = prog.model_proto
    assert [n.op_type for n in model.graph.node if n.domain == DOMAIN] == ["SsmScan"]
    lowered = onnx.ModelProto()
    lowered.CopyFrom(model)
    assert lower_ssm_scan_for_onnxruntime(lowered) == 1
    sessions = [ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
                for m in (model, lowered)]
    for batch, seq, lens in ((2, 1, [1, 0]), (3, 9, [9, 4, 0])):
        feeds = (torch.randn(batch, seq, 8, generator=gen), torch.randn(SLOTS, H, N, P, generator=gen),
                 torch.randperm(SLOTS, generator=gen)[:batch], torch.tensor(lens))
        named = {i.name: t.numpy() for i, t in zip(sessions[0].get_inputs(), feeds)}
        want, got = (sess.run(None, named) for sess in sessions)
        with torch.no_grad():
            ref = mixer(*feeds)
        for w, g, r, what in zip(want, got, ref, ("y", "pool")):
            assert g.shape == tuple(r.shape), what
            assert_close(g, w, what=f"{what} at {batch}x{seq}")
            assert_close(g, r, what=f"{what} against the torch reference at {batch}x{seq}")


# ----------------------------------------------------------------------------------------------
# timing (not a test): python tests/test_ort_ssm_scan.py


def measure(threads: int = 2, repeats: int = 50, sizes=(32, 64, 4, 128), slots: int = 8) -> dict:
    """Median ms per run of the function and the lowering: a decode step (state_update 0, and 1
    with new_state bound to the pool's own buffer, as the runtime binds an in-place graph) and a
    128-token prefill, batch 1, fp32, everything bound once through IOBinding in host memory."""
    import onnxruntime as ort

    results = {}
    for label, seq, state_update in (("decode", 1, 0), ("decode", 1, 1), ("prefill", 128, 0)):
        inputs = scan_inputs(7, 1, seq, [seq], sizes=sizes, slots=slots)
        dtypes = tuple(_ONNX_TYPES[t.dtype] for t in inputs)
        model = _model(dtypes, sizes, state_update, 0.0, ssm_scan.FLOAT32_MAX)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        for kind, m in (("function", model), ("linear_attention", _lowered(model))):
            session = ort.InferenceSession(m.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            held = [_feed(t) for t in inputs]
            outs = [_feed(torch.empty_like(inputs[0]))]
            outs.append(held[7] if state_update else _feed(torch.empty(1, *inputs[7].shape[1:])))
            binding = session.io_binding()
            for name, (_, value) in zip(ssm_scan.SPEC.inputs, held):
                binding.bind_ortvalue_input(name, value)
            for name, (_, value) in zip(ssm_scan.SPEC.outputs, outs):
                binding.bind_ortvalue_output(name, value)
            for _ in range(3):
                session.run_with_iobinding(binding)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                session.run_with_iobinding(binding)
                times.append((time.perf_counter() - t0) * 1e3)
            results[(label, state_update, kind)] = float(np.median(times))
    return results


if __name__ == "__main__":
    for key, ms in measure().items():
        print(*key, f"{ms:.3f} ms")
