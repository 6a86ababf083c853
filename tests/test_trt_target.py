"""The TensorRT-target graph (``graphkiln export --target tensorrt``) and its static check.

Every supported architecture is exported for TensorRT once (the session's ``tiny`` fixture) and
must (1) pass ``graphkiln check --backend tensorrt`` against the vendored parser support list,
with the shape the parser needs: every graphkiln node ``aot=1`` and in its in-place mode, no
onnxruntime-only op, native RMSNormalization, the state outputs the whole cache / pool; and
(2) run on onnxruntime through the ops' function bodies, with the state outputs bound to the
runtime's own state buffers, at parity with transformers (fp32 logits within 1e-4, identical
greedy tokens over 32 steps, one prompt and a ragged batch of three).

The checker must also fail what TensorRT would not take: an onnxruntime-target artifact, the
portable graph (no aot, state not in place), and hand-broken graphs, each with its own finding.
Nothing here runs TensorRT (it cannot be installed on these machines).
"""

from __future__ import annotations

import copy
import json

import onnx
import pytest
from onnx import TensorProto, helper

from cli_contract import assert_nothing_written, assert_one_error, run_cli
from conftest import PARITY_CASES, SPECS, VLM_SPECS, own_file_vlm_architectures
from graphkiln.export.trt_check import TRT_VERSION, check_artifact, check_model, parse_support_list, support_list
from graphkiln.manifest import Manifest, state_update
from graphkiln.ops import op_modules, specs
from graphkiln.runtime import GenerationConfig
from reference import ATOL, forward_logits, greedy, max_abs, teacher_forced_logits

TRT = "tensorrt"
STEPS = 32
BATCHES = {"batch1": (12,), "batch3": (5, 19, 11)}


@pytest.fixture(scope="module", params=PARITY_CASES)
def trt_case(request, tiny):
    return tiny(request.param, TRT)


def _model(case) -> onnx.ModelProto:
    return onnx.load(str(case.artifact / case.manifest.graph("decoder").file), load_external_data=False)


def test_every_supported_architecture_is_covered():
    from graphkiln.models.registry import supported_architectures

    # vision-language ones: their decoder's tensorrt graph in tests/test_vlm_export.py, except the
    # ones tested in their own files on onnxruntime and portable only (README says so)
    not_on_tensorrt = own_file_vlm_architectures()
    assert set(supported_architectures()) - not_on_tensorrt <= {SPECS[n].architecture for n in PARITY_CASES} | {
        s.architecture for s in VLM_SPECS.values()}


# ----------------------------------------------------------------------------------------------
# the vendored support list


def test_support_list_is_the_pinned_version_with_its_source():
    s = support_list()
    assert (s.trt_version, s.opset_min, s.opset_max) == (TRT_VERSION, 9, 24)
    assert s.source == "https://github.com/onnx/onnx-tensorrt/blob/main/docs/operators.md"
    assert len(s.ops) > 150
    # rows as the file has them, including ones without a trailing '|' or restrictions cell
    assert s.ops["RMSNormalization"].supported and s.ops["RMSNormalization"].types == {"FP32", "FP16", "BF16"}
    assert s.ops["ScatterND"].restrictions == "`reduction` other than `none` is not supported"
    assert s.ops["Xor"].supported and s.ops["Xor"].types == {"BOOL"} and not s.ops["Xor"].restrictions
    assert s.ops["Selu"].types == {"FP32", "FP16", "BF16"}  # its types cell ends in a stray comma
    assert not s.ops["Unique"].supported and not s.ops["DynamicQuantizeLinear"].supported
    assert "GroupQueryAttention" not in s.ops


@pytest.mark.parametrize("text, problem", [
    ("# Supported ONNX Operators\n\n| Abs | Y | FP32 |\n", "no 'TensorRT X supports"),
    ("TensorRT 10.15 supports operators in the inclusive range of opset 9 to opset 24.\n", "no operator table"),
])
def test_a_support_list_without_header_or_table_is_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        parse_support_list(text)


# ----------------------------------------------------------------------------------------------
# every architecture's tensorrt graph: the parser's shape, and the checker passes it


def test_tensorrt_graph_passes_the_checker(trt_case):
    report = check_artifact(trt_case.artifact)
    assert report.passed, report.summary()
    assert report.graphs == ("decoder.onnx",) and report.nodes_checked > 10
    assert all(f.severity == "warning" for f in report.findings)
    assert report.summary().splitlines()[-1].startswith("PASS: 0 error(s)")


def test_tensorrt_graph_has_the_parsers_shape(trt_case):
    from graphkiln.export.custom_ops import registry as R

    m = trt_case.manifest
    graph = m.graph("decoder")
    model = _model(trt_case)
    assert graph.target == TRT and graph.opset == 23
    assert model.ir_version == 11 and {o.domain: o.version for o in model.opset_import}[""] == 23
    R.register_onnx_schemas()  # the graphkiln nodes (aot included) against their schemas
    onnx.checker.check_model(str(trt_case.artifact / graph.file))  # by path: it finds the data file
    assert not [n for n in model.graph.node if n.domain not in ("", "graphkiln")]
    ops = {n.op_type for n in model.graph.node}
    # Gated delta nets' output norm (models.decoder.RMSNormGated: RMSNorm times silu(gate)) is
    # not fused by the exporter: one decomposed norm (Pow, ReduceMean, Sqrt, Reciprocal, all in
    # the parser's list) per GatedDeltaRule node is allowed until it is; every other norm is native.
    unfused = {op: sum(n.op_type == op for n in model.graph.node) for op in ("ReduceMean", "Pow", "Sqrt", "Reciprocal")}
    gated_norms = sum(n.op_type == "GatedDeltaRule" for n in model.graph.node)
    assert "RMSNormalization" in ops and all(c == gated_norms for c in unfused.values()), f"norms not native: {unfused}"
    custom = [n for n in model.graph.node if n.domain == "graphkiln"]
    assert custom
    for node in custom:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        spec = specs()[node.op_type]
        assert attrs["aot"] == 1 and attrs["plugin_namespace"] == b"graphkiln" and attrs["plugin_version"] == b"1"
        mode = getattr(op_modules()[node.op_type], "IN_PLACE_ATTR", None)
        if mode:
            assert attrs[mode] == 1
        assert set(attrs) == {a.name for a in spec.attributes} | {"plugin_namespace", "plugin_version", "aot"}
    # state outputs are the whole state, shaped like the input the runtime binds them to
    ins = {(t.role, t.layer): t for t in graph.inputs}
    graph_types = {v.name: v.type for v in list(model.graph.input) + list(model.graph.output)}
    roles = {t.role for t in graph.outputs}
    assert not roles & {"new_key", "new_value"}
    for t in graph.outputs:
        if t.layer is None:
            continue
        src = ins[{"present_key": "past_key", "present_value": "past_value", "new_conv_state": "conv_state",
                   "new_recurrent_state": "recurrent_state"}[t.role], t.layer]
        assert t.shape == src.shape and t.dtype == src.dtype, t
        assert graph_types[t.name] == graph_types[src.name], t.name
        if t.role in ("new_conv_state", "new_recurrent_state"):
            assert t.shape[0] == "slots"
    assert {s.kind: state_update(m.graphs[0], s) for s in m.states} == {s.kind: "in_place" for s in m.states}


# ----------------------------------------------------------------------------------------------
# onnxruntime runs the tensorrt graph (the functions' in-place mode) at parity with transformers


def test_onnxruntime_runs_the_tensorrt_graph_at_parity(trt_case):
    engine = trt_case.engine
    # the in-place bindings are in use: present_* and (conv models) the whole pools
    assert engine.decoder.present
    slot_states = {(s.kind, layer) for s in trt_case.manifest.states if s.kind in ("conv", "recurrent")
                   for layer in s.layers}
    assert {({"conv_state": "conv", "recurrent_state": "recurrent"}[role], layer)
            for role, layer in engine.decoder.pool_outputs} == slot_states
    config = GenerationConfig(max_new_tokens=STEPS, do_sample=False, stop_token_ids=(), output_logits=True)
    for batch, lengths in BATCHES.items():
        prompts = trt_case.prompts(lengths, salt=21)
        for p, got in zip(prompts, engine.prompt_logits(prompts)):
            err = max_abs(got, forward_logits(trt_case.reference, p))
            assert err <= ATOL, f"{trt_case.name} {batch}: prompt logits differ by {err:.3g}"
        for i, (p, res) in enumerate(zip(prompts, engine.generate(prompts, config))):
            ref_tokens, ref_logits = greedy(trt_case.reference, p, STEPS)
            assert res.token_ids == ref_tokens, f"{trt_case.name} {batch} request {i}: greedy tokens differ"
            err = max(max_abs(res.logits, ref_logits), max_abs(res.logits, teacher_forced_logits(trt_case.reference, p,
                                                                                                  res.token_ids)))
            assert err <= ATOL, f"{trt_case.name} {batch} request {i}: step logits differ by {err:.3g}"


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_tensorrt_graph_passes_the_checker(tiny, tmp_path, dtype):
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.export.verify import DEFAULT_ATOL, verify_artifact

    case = tiny("lfm2_moe", TRT)  # conv pools, attention and MoE in one model
    art = tmp_path / dtype
    m = export_model(str(case.checkpoint), art, ExportOptions(dtype=dtype, progress=False, max_seq_len=64, target=TRT))
    report = check_artifact(art)
    assert report.passed, report.summary()
    assert {t.dtype for t in m.graph("decoder").inputs if t.layer is not None} == {"float16" if dtype == "fp16"
                                                                                   else "bfloat16"}
    # the MoE plugin routes with an fp32 bias table: the learned bias (model dtype) is cast for it
    model = onnx.load(str(art / "decoder.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    producers = {o: n for n in model.graph.node for o in n.output}
    moe = [n for n in model.graph.node if n.op_type == "MoE"]
    assert moe and case.spec.config.get("num_experts")
    for n in moe:
        cast = producers[n.input[4]]
        assert (cast.op_type, helper.get_attribute_value(cast.attribute[0])) == ("Cast", TensorProto.FLOAT)
        assert types[cast.input[0]] == (TensorProto.FLOAT16 if dtype == "fp16" else TensorProto.BFLOAT16)
    if dtype == "fp16":  # onnxruntime CPU has no bf16 MatMul
        result = verify_artifact(art, str(case.checkpoint), steps=12)
        assert result.passed, result.summary()
        assert result.atol == DEFAULT_ATOL["fp16"] and result.max_abs_error > 1e-6


def test_half_precision_gated_delta_graph_feeds_the_plugin_fp32_gates(tiny, tmp_path):
    """The GatedDeltaRule plugin reads g and beta in fp32 (plugins_trt.rules.FIXED_INPUT_DTYPES):
    g the model computes in fp32 already; beta (a sigmoid in the model dtype) gets a Cast."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    case = tiny("qwen3_5", TRT)
    art = tmp_path / "fp16"
    export_model(str(case.checkpoint), art, ExportOptions(dtype="fp16", progress=False, max_seq_len=64, target=TRT))
    report = check_artifact(art)
    assert report.passed, report.summary()
    model = onnx.load(str(art / "decoder.onnx"), load_external_data=False)
    types = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.value_info) + list(model.graph.input)}
    producers = {o: n for n in model.graph.node for o in n.output}
    nodes = [n for n in model.graph.node if n.op_type == "GatedDeltaRule"]
    assert nodes
    for n in nodes:
        g, beta = n.input[3], n.input[4]
        assert producers[g].op_type != "Cast" and types[g] == TensorProto.FLOAT
        cast = producers[beta]
        assert (cast.op_type, helper.get_attribute_value(cast.attribute[0])) == ("Cast", TensorProto.FLOAT)
        assert types[cast.input[0]] == TensorProto.FLOAT16


# ----------------------------------------------------------------------------------------------
# what the checker must fail


@pytest.mark.parametrize("target, needles", [
    ("onnxruntime", ["com.microsoft.GroupQueryAttention", "com.microsoft.SkipSimplifiedLayerNormalization",
                     "onnxruntime contrib op"]),
    ("portable", ["graphkiln.Attention", "aot is None", "kv_update is 0"]),
])
def test_other_targets_fail_the_checker(tiny, capsys, target, needles):
    case = tiny("llama_gqa_bias", target)
    report = check_artifact(case.artifact)
    assert not report.passed
    text = report.summary()
    for needle in needles:
        assert needle in text, text
    assert f"was exported for target {target}, not tensorrt" in text
    code, out, err = run_cli(capsys, "check", case.artifact, "--backend", "tensorrt")
    assert code == 1 and not err
    assert out.strip().splitlines()[-1].startswith(f"FAIL: {len(report.errors)} error(s)")
    assert sum(line.startswith("error: ") for line in out.splitlines()) == len(report.errors)


def _node(model, domain, op_type):
    return next(n for n in model.graph.node if n.domain == domain and n.op_type == op_type)


def _set(node, name, value):
    for a in list(node.attribute):
        if a.name == name:
            node.attribute.remove(a)
    if value is not None:
        node.attribute.append(helper.make_attribute(name, value))


def _attention(m):
    return _node(m, "graphkiln", "Attention")


def _std_into_ms(m):
    n = _node(m, "", "RMSNormalization")
    n.domain, n.op_type = "com.microsoft", "SimplifiedLayerNormalization"


def _if_with_unsupported_body(m):
    body = helper.make_graph([helper.make_node("Unique", ["input_ids"], ["u"])], "then",
                             [], [helper.make_tensor_value_info("u", TensorProto.INT64, None)])
    cond = helper.make_tensor("cond", TensorProto.BOOL, [], [True])
    m.graph.initializer.append(cond)
    m.graph.node.append(helper.make_node("If", ["cond"], ["picked"], then_branch=body, else_branch=body))


def _lookahead_as_int32(m):
    node = _attention(m)
    m.graph.node.append(helper.make_node("Cast", [node.input[8]], ["lookahead.i32"], to=TensorProto.INT32))
    node.input[8] = "lookahead.i32"


def _sinks_as_fp16(m):
    node = _attention(m)
    m.graph.node.append(helper.make_node("Cast", [node.input[9]], ["sinks.f16"], to=TensorProto.FLOAT16))
    node.input[9] = "sinks.f16"


def _cast_to_double(m):
    m.graph.node.append(helper.make_node("Cast", ["position_ids"], ["as_double"], to=TensorProto.DOUBLE))


def _double_input(m):
    m.graph.input.append(helper.make_tensor_value_info("extra", TensorProto.DOUBLE, [1]))


def _opset(m, version):
    next(o for o in m.opset_import if o.domain in ("", "ai.onnx")).version = version


def _domain_version(m):
    next(o for o in m.opset_import if o.domain == "graphkiln").version = 2


BREAKS = {
    # graphkiln nodes: what the parser needs to find and build the plugin
    "no_aot": (lambda m: _set(_attention(m), "aot", None), "graphkiln.Attention", "aot is None"),
    "jit": (lambda m: _set(_attention(m), "aot", 0), "graphkiln.Attention", "aot is 0"),
    "rows_mode": (lambda m: _set(_attention(m), "kv_update", 0), "graphkiln.Attention", "kv_update is 0"),
    "pool_rows_mode": (lambda m: _set(_node(m, "graphkiln", "ShortConv"), "state_update", None), "graphkiln.ShortConv",
                       "state_update is 0"),
    "namespace": (lambda m: _set(_attention(m), "plugin_namespace", "other"), "graphkiln.Attention",
                  "plugin_namespace is 'other'"),
    "plugin_version": (lambda m: _set(_attention(m), "plugin_version", "2"), "graphkiln.Attention",
                       "plugin_version is '2'"),
    "unknown_field": (lambda m: _set(_attention(m), "softcap", 30.0), "graphkiln.Attention",
                      "attribute 'softcap' is not a field"),
    "missing_field": (lambda m: _set(_attention(m), "num_heads", None), "graphkiln.Attention",
                      "attribute 'num_heads' is missing"),
    "field_type": (lambda m: _set(_attention(m), "scale", 1), "graphkiln.Attention", "attribute 'scale' must be float"),
    "unknown_op": (lambda m: setattr(_attention(m), "op_type", "Mamba"), "graphkiln.Mamba", "is not a graphkiln op"),
    "extra_input": (lambda m: _attention(m).input.append("position_ids"), "graphkiln.Attention", "has 11 inputs"),
    "rope_layout": (lambda m: _set(_attention(m), "rope_layout", 2), "graphkiln.Attention", "rope_layout is 2"),
    # layout 1 reads per-token cos/sin [B, S, D/2]; the graph still feeds the [P, D/2] tables
    "rope_layout_rank": (lambda m: _set(_attention(m), "rope_layout", 1), "graphkiln.Attention",
                         "with rope_layout 1 the plugin takes rank 3"),
    "lookahead_type": (_lookahead_as_int32, "graphkiln.Attention", "input lookahead ('lookahead.i32') is INT32"),
    "sinks_type": (_sinks_as_fp16, "graphkiln.Attention", "input sinks ('sinks.f16') is FLOAT16"),
    "domain_version": (_domain_version, ("graphkiln.Attention", "graphkiln.ShortConv"), "at version 2"),
    # other domains and standard ops
    "contrib_op": (_std_into_ms, "com.microsoft.SimplifiedLayerNormalization", "onnxruntime contrib op"),
    "other_domain": (lambda m: setattr(_node(m, "", "MatMul"), "domain", "ai.onnx.ml"), "ai.onnx.ml.MatMul",
                     "has no importer"),
    "unsupported_op": (lambda m: setattr(_node(m, "", "Add"), "op_type", "BitwiseAnd"), "BitwiseAnd",
                       "is marked unsupported"),
    "unlisted_op": (lambda m: setattr(_node(m, "", "Add"), "op_type", "Swish"), "Swish", "is not in"),
    "in_a_subgraph": (_if_with_unsupported_body, "Unique", "is marked unsupported"),
    "type": (_cast_to_double, "Cast", "output 'as_double' is DOUBLE"),
    "input_type": (_double_input, "graph", "graph input 'extra' has element type DOUBLE"),
    "opset_25": (lambda m: _opset(m, 25), "graph", "opset 25 is outside TensorRT 10.15's opsets 9-24"),
    "opset_8": (lambda m: _opset(m, 8), "graph", "opset 8 is outside"),
}


def _gated_delta(m):
    return _node(m, "graphkiln", "GatedDeltaRule")


def _beta_as_fp16(m):
    node = _gated_delta(m)
    m.graph.node.append(helper.make_node("Cast", [node.input[4]], ["beta.fp16"], to=TensorProto.FLOAT16))
    node.input[4] = "beta.fp16"


GATED_DELTA_BREAKS = {
    "recurrent_rows_mode": (lambda m: _set(_gated_delta(m), "state_update", 0), "state_update is 0"),
    "no_aot": (lambda m: _set(_gated_delta(m), "aot", None), "aot is None"),
    "beta_type": (_beta_as_fp16, "input beta ('beta.fp16') is FLOAT16"),
}


@pytest.mark.parametrize("name", list(GATED_DELTA_BREAKS))
def test_hand_broken_gated_delta_nodes_fail_with_their_finding(tiny, name):
    base = _model(tiny("qwen3_5", TRT))
    assert check_model(base, "decoder.onnx").passed
    broken = copy.deepcopy(base)
    edit, needle = GATED_DELTA_BREAKS[name]
    edit(broken)
    report = check_model(broken, "decoder.onnx")
    assert not report.passed
    assert [f for f in report.errors if needle in f.message and f.op == "graphkiln.GatedDeltaRule"], report.summary()
    assert {f.op for f in report.errors} == {"graphkiln.GatedDeltaRule"}, report.summary()


@pytest.mark.parametrize("name", list(BREAKS))
def test_hand_broken_graphs_fail_with_their_finding(tiny, name):
    base = _model(tiny("lfm2", TRT))  # conv, attention: both in-place ops
    assert check_model(base, "decoder.onnx").passed
    broken = copy.deepcopy(base)
    edit, ops, needle = BREAKS[name]
    ops = {ops} if isinstance(ops, str) else set(ops)
    edit(broken)
    report = check_model(broken, "decoder.onnx")
    assert not report.passed
    # the finding, on each op it concerns, and nothing else: every error is about the edit
    for op in ops:
        assert [f for f in report.errors if needle in f.message and (f.op or "graph") == op], (
            f"no error on {op} containing {needle!r}:\n{report.summary()}")
    assert {f.op or "graph" for f in report.errors} == ops, report.summary()


def test_checker_takes_a_lookahead_input_and_per_token_rotary(tiny):
    """Gemma3's nodes (lookahead a graph input [batch, seq]) and Qwen2.5-VL's (rope_layout 1,
    cos/sin computed per token) pass as the text models' constant-zero, table-fed ones do."""
    model = copy.deepcopy(_model(tiny("lfm2", TRT)))
    node = _attention(model)
    half = next(t for t in model.graph.initializer if t.name == node.input[6]).dims[1]
    model.graph.input.extend([
        helper.make_tensor_value_info("lookahead", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("rope_cos", TensorProto.FLOAT, ["batch", "seq", half]),
        helper.make_tensor_value_info("rope_sin", TensorProto.FLOAT, ["batch", "seq", half])])
    node.input[6], node.input[7], node.input[8] = "rope_cos", "rope_sin", "lookahead"
    _set(node, "rope_layout", 1)
    report = check_model(model, "decoder.onnx")
    assert report.passed, report.summary()


# ----------------------------------------------------------------------------------------------
# CLI contract and export refusals


def test_check_cli_passes_a_tensorrt_artifact(tiny, capsys):
    code, out, err = run_cli(capsys, "check", tiny("lfm2", TRT).artifact, "--backend", "tensorrt")
    assert code == 0 and not err
    assert out.strip().splitlines()[-1].startswith("PASS: 0 error(s)")
    assert not any(line.startswith("error:") for line in out.splitlines())


def _garbage_graph(art):
    (art / "decoder.onnx").write_bytes(b"\x00not an onnx model" * 10)


def _no_manifest(art):
    (art / "manifest.json").unlink()


def _bad_manifest(art):
    d = json.loads((art / "manifest.json").read_text())
    d["graphs"][0]["target"] = "cuda"
    (art / "manifest.json").write_text(json.dumps(d))


def _conv_update_mismatch(art):
    d = json.loads((art / "manifest.json").read_text())
    out = next(t for t in d["graphs"][0]["outputs"] if t["role"] == "new_conv_state")
    out["shape"] = ["batch"] + out["shape"][1:]  # one layer returns rows, the others the whole pool
    (art / "manifest.json").write_text(json.dumps(d))


@pytest.mark.parametrize("breakage, needles", [
    (_garbage_graph, ["decoder.onnx is not a readable ONNX model", "re-export"]),
    (_no_manifest, ["has no manifest.json"]),
    (_bad_manifest, ["graphs[0].target"]),
    (_conv_update_mismatch, ["of the same conv state", "a graph updates a state one way"]),
])
def test_check_cli_refuses_a_non_artifact_with_one_error_line(tiny, artifact_copy, capsys, breakage, needles):
    art = artifact_copy(tiny("lfm2", TRT))
    breakage(art)
    code, out, err = run_cli(capsys, "check", art, "--backend", "tensorrt")
    assert_one_error(code, err, *needles, alone=True)
    assert not out


def test_check_cli_refuses_a_missing_path_and_an_unknown_backend(tiny, tmp_path, capsys):
    code, _, err = run_cli(capsys, "check", tmp_path / "nowhere", "--backend", "tensorrt")
    assert_one_error(code, err, "has no manifest.json", alone=True)
    code, _, err = run_cli(capsys, "check", tiny("lfm2", TRT).artifact, "--backend", "cuda")
    assert_one_error(code, err, "--backend", "invalid choice", alone=True)


@pytest.mark.parametrize("extra, needles", [
    (("--quant", "int4"), ["--quant int4 is not supported with --target tensorrt", "drop --quant"]),
    (("--quant", "int8", "--dtype", "fp16"), ["--quant int8 is not supported with --target tensorrt"]),
    (("--opset", "22"), ["--opset 22 does not suit --target tensorrt", "RMSNormalization needs opset 23"]),
])
def test_export_refuses_what_the_tensorrt_target_cannot_hold(tiny, tmp_path, capsys, extra, needles):
    out = tmp_path / "out" / "art"
    code, _, err = run_cli(capsys, "export", tiny("lfm2", TRT).checkpoint, "-o", out, "--target", TRT, *extra)
    assert_one_error(code, err, *needles)
    assert_nothing_written(out)


def test_manifest_of_a_tensorrt_artifact_round_trips(tiny):
    case = tiny("lfm2", TRT)
    m = Manifest.read(case.artifact)
    assert m == case.manifest.validated()
    assert m.graphs[0].target == TRT
    outputs = {t.name: t for t in m.graphs[0].outputs}
    assert outputs["new_conv_state.0"].shape == ("slots", 64, 2)
    assert outputs["present_key.1"].shape == ("batch", 2, "cache_len", 16)
