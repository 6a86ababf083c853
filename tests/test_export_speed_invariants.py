"""The fast external-data writer (graphkiln.export.external_data) must write exactly what
``onnx_ir.save(..., external_data=...)`` writes: same graph file, same data file, and the
model left as it was. Covers the layouts the exporter hands it: contiguous torch-backed
weights, non-contiguous numpy views (folded transposes), bf16, tiny inline tensors, packed
4-bit tensors, and initializers in a subgraph; with a tiny block size so every tensor spans
several blocks.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from graphkiln.export import external_data
from torch.onnx._internal.exporter._core import TorchTensor


def _model() -> ir.Model:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((40, 24)).astype(np.float32)
    values = {
        "contiguous_torch": TorchTensor(torch.from_numpy(rng.standard_normal((24, 16)).astype(np.float32)), "contiguous_torch"),
        "folded_transpose": ir.Tensor(w.T, name="folded_transpose"),  # a strided view, as constant folding leaves it
        "strided_3d": ir.Tensor(rng.standard_normal((6, 8, 10)).astype(np.float32).transpose(2, 0, 1), name="strided_3d"),
        "bf16_torch": TorchTensor(torch.randn(32, 12, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).t(),
                                  "bf16_torch"),
        "tiny_inline": ir.Tensor(np.arange(4, dtype=np.float32), name="tiny_inline"),
        "int4_packed": ir.Tensor(rng.integers(-8, 8, size=(64, 20)).astype(np.int8), dtype=ir.DataType.INT4,
                                 name="int4_packed"),
        "reversed": ir.Tensor(w[::-1], name="reversed"),  # negative strides: torch cannot wrap it
    }
    inits = [ir.Value(name=n, shape=ir.Shape(t.shape), type=ir.TensorType(t.dtype), const_value=t)
             for n, t in values.items()]
    sub_init = ir.Value(name="sub_weight", shape=ir.Shape((30, 10)), type=ir.TensorType(ir.DataType.FLOAT),
                        const_value=ir.Tensor(rng.standard_normal((10, 30)).astype(np.float32).T, name="sub_weight"))
    sub_out = ir.Value(name="sub_out")
    sub = ir.Graph([], [sub_out], nodes=[ir.Node("", "Identity", [sub_init], outputs=[sub_out])],
                   initializers=[sub_init], name="branch")
    cond = ir.Value(name="cond", shape=ir.Shape(()), type=ir.TensorType(ir.DataType.BOOL))
    out = ir.Value(name="out")
    nodes = [ir.Node("", "Identity", [v], outputs=[ir.Value(name=f"{v.name}_out")]) for v in inits]
    nodes.append(ir.Node("", "If", [cond], attributes=[ir.AttrGraph("then_branch", sub), ir.AttrGraph("else_branch", sub)],
                         outputs=[out]))
    graph = ir.Graph([cond], [out, *(n.outputs[0] for n in nodes[:-1])], nodes=nodes, initializers=inits,
                     opset_imports={"": 21}, name="g")
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("block", [7, 64, external_data._BLOCK])
def test_writes_what_onnx_ir_writes(tmp_path, monkeypatch, block):
    monkeypatch.setattr(external_data, "_BLOCK", block)
    model = _model()
    before = {v.name: v.const_value for g in model.graphs() for v in g.initializers.values()}

    ours, ref = tmp_path / "ours", tmp_path / "ref"
    ours.mkdir()
    ref.mkdir()
    external_data.save_model(model, ours / "m.onnx")
    after = {v.name: v.const_value for g in model.graphs() for v in g.initializers.values()}
    assert all(after[n] is t for n, t in before.items()), "save_model must leave the model's tensors as they were"
    ir.save(model, ref / "m.onnx", external_data="m.onnx.data")

    assert (ours / "m.onnx.data").read_bytes() == (ref / "m.onnx.data").read_bytes()
    assert (ours / "m.onnx").read_bytes() == (ref / "m.onnx").read_bytes()

    loaded = ir.load(ours / "m.onnx")
    for g in loaded.graphs():
        for v in g.initializers.values():
            np.testing.assert_array_equal(v.const_value.numpy(), before[v.name].numpy())


def test_refuses_uninitialized_initializers(tmp_path):
    v = ir.Value(name="w", shape=ir.Shape((2,)), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([], [v], nodes=[], initializers=[v], opset_imports={"": 21})
    with pytest.raises(ValueError, match="without values"):
        external_data.save_model(ir.Model(graph, ir_version=10), tmp_path / "m.onnx")


def test_write_errors_surface_and_leave_the_model_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(external_data, "_BLOCK", 64)
    calls = []

    def failing_write(f, chunk):  # runs on the writer thread
        calls.append(len(chunk))
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return f.write(chunk)

    monkeypatch.setattr(external_data, "_write_all", failing_write)
    model = _model()
    before = {v.name: v.const_value for g in model.graphs() for v in g.initializers.values()}
    with pytest.raises(OSError, match="No space left"):
        external_data.save_model(model, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
    after = {v.name: v.const_value for g in model.graphs() for v in g.initializers.values()}
    assert all(after[n] is t for n, t in before.items())


def test_rewrite_external_data_keeps_disk_tensors_and_moves_new_ones_out(tmp_path):
    """The lowering's save: tensors still in the old data file are copied, in-memory ones over
    the threshold written out, small ones left inline; every value reads back unchanged."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(3)
    arrays = {f"w{i}": rng.standard_normal((50 + i, 30)).astype(np.float32) for i in range(4)}
    arrays["tiny"] = np.arange(5, dtype=np.float32)
    nodes = [helper.make_node("Identity", [n], [f"{n}_out"]) for n in arrays]
    graph = helper.make_graph(nodes, "g", [], [helper.make_tensor_value_info(f"{n}_out", onnx.TensorProto.FLOAT, None)
                                               for n in arrays],
                              [numpy_helper.from_array(a, n) for n, a in arrays.items()])
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.onnx.data", size_threshold=1024)
    model = onnx.load(str(path), load_external_data=False)
    # a pass replaces w1 in memory and adds a new big tensor; w0, w2, w3 stay on disk
    arrays["w1"] = rng.standard_normal((51, 30)).astype(np.float32)
    inits = {t.name: t for t in model.graph.initializer}
    inits["w1"].CopyFrom(numpy_helper.from_array(arrays["w1"], "w1"))
    arrays["added"] = rng.standard_normal((64, 64)).astype(np.float32)
    model.graph.initializer.append(numpy_helper.from_array(arrays["added"], "added"))

    external_data.rewrite_external_data(model, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx", "m.onnx.data"]
    saved = onnx.load(str(path), load_external_data=False)
    on_disk = {t.name for t in saved.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert on_disk == {"w0", "w1", "w2", "w3", "added"}
    loaded = onnx.load(str(path))
    got = {t.name: numpy_helper.to_array(t) for t in loaded.graph.initializer}
    assert set(got) == set(arrays)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(got[name], arr, err_msg=name)
    assert (tmp_path / "m.onnx.data").stat().st_size == sum(a.nbytes for n, a in arrays.items() if n != "tiny")
