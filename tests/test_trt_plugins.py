"""TensorRT plugin definitions (graphkiln.plugins_trt.rules / register), checked without TensorRT.

``register.register_plugins`` needs TensorRT and a GPU and is never called here. Everything it
decides lives in ``rules`` and is tested here against the ops' one definition
(``graphkiln.ops``): the plugin identity and attributes come from each SPEC; the generated
functions have the signatures tensorrt.plugin's validators accept (rules read in its
``_validate.py``/``_lib.py``/``_plugin_class.py``) and bind the way TensorRT calls them;
output shapes/aliasing agree with each op's ``fake``; autotune dtypes agree with what the
exported model feeds the ops; launch parameters come from each kernel module's plan, work
with symbolic dims that support only what TensorRT's ``ShapeExpr`` supports, and match what
the module's Python launcher uses.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import pkgutil
import subprocess
import sys
import typing
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from graphkiln.ops import op_modules, specs
from graphkiln.ops.spec import AttrSpec
from graphkiln.plugins_trt import rules
from graphkiln.plugins_trt.kernels import aot

OPS = tuple(sorted(specs()))
KERNEL_MODULES = {"Attention": "attention", "MoE": "moe", "ShortConv": "short_conv", "GatedDeltaRule": "gated_delta",
                  "SsmScan": "ssm_scan"}
IN_PLACE_OPS = ["Attention", "ShortConv", "GatedDeltaRule", "SsmScan"]


# ----------------------------------------------------------------------------------------------
# stand-ins for tensorrt.plugin's classes (the signature builders take any such namespace)


class TensorDesc:
    pass


class Tensor:
    pass


class KernelLaunchParams:
    pass


class SymExprs:
    pass


class SymIntExprs(SymExprs):
    pass


class AutoTuneCombination:
    pass


API = SimpleNamespace(TensorDesc=TensorDesc, Tensor=Tensor, KernelLaunchParams=KernelLaunchParams,
                      SymIntExprs=SymIntExprs, AutoTuneCombination=AutoTuneCombination)
SERIALIZABLE = (int, float, bytes, bool, str)


def _defn(name: str) -> rules.PluginDef:
    return rules.plugin_defs()[name]


def _module_name(name: str) -> str:
    return op_modules()[name].__name__.rsplit(".", 1)[1]


# ----------------------------------------------------------------------------------------------
# identity and attributes from the SPEC


@pytest.mark.parametrize("name", OPS)
def test_identity_and_attributes_come_from_the_spec(name):
    spec = specs()[name]
    d = _defn(name)
    assert d.plugin_id == f"{spec.plugin_namespace}::{spec.name}" == spec.plugin_id
    assert d.inputs == spec.inputs and d.outputs == spec.outputs
    kinds = {"int": int, "float": float, "string": str}
    assert d.attributes == tuple((a.name, kinds[a.kind]) for a in spec.attributes)
    # ONNX node attributes the parser itself reads are never plugin fields
    assert not {"plugin_namespace", "plugin_version", "aot"} & {n for n, _ in d.attributes}
    assert d.kernel_module == f"graphkiln.plugins_trt.kernels.{KERNEL_MODULES[name]}"
    assert d.runner == f"run_{KERNEL_MODULES[name]}"


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("change", ["rename", "namespace", "new_float_attr", "new_string_attr", "drop_attr", "new_input"])
def test_a_spec_change_shows_up_in_the_plugin(name, change):
    spec = specs()[name]
    if change == "rename":
        new = dataclasses.replace(spec, name=spec.name + "X")
    elif change == "namespace":
        new = dataclasses.replace(spec, plugin_namespace="othernamespace")
    elif change == "new_float_attr":
        new = dataclasses.replace(spec, attributes=spec.attributes + (AttrSpec("new_float_knob", "float"),))
    elif change == "new_string_attr":
        new = dataclasses.replace(spec, attributes=spec.attributes + (AttrSpec("mode_name", "string"),))
    elif change == "drop_attr":
        new = dataclasses.replace(spec, attributes=spec.attributes[:-1])
    else:
        new = dataclasses.replace(spec, inputs=spec.inputs + ("extra",))
    d = rules.plugin_def(new, _module_name(name))
    sig = rules.register_signature(d, API)
    assert d.plugin_id == f"{new.plugin_namespace}::{new.name}"
    assert list(sig.parameters) == list(new.inputs) + [a.name for a in new.attributes]
    ann = {"int": int, "float": float, "string": str}
    for a in new.attributes:
        assert sig.parameters[a.name].annotation is ann[a.kind]
    for n in new.inputs:
        assert sig.parameters[n].annotation is TensorDesc


@pytest.mark.parametrize("bad", [
    {"attributes": (AttrSpec("aot", "int"),)},
    {"attributes": (AttrSpec("plugin_namespace", "string"),)},
    {"attributes": (AttrSpec("plugin_version", "string"),)},
    {"attributes": (AttrSpec("tactic", "int"),)},
    {"attributes": (AttrSpec("outputs", "int"),)},
    {"attributes": (AttrSpec("stream", "int"),)},
    {"attributes": (AttrSpec("sizes", "ints"),)},
    {"attributes": (AttrSpec("q", "int"),)},
    {"plugin_version": "2"},
    {"plugin_namespace": "trt"},
    {"plugin_namespace": ""},
    {"plugin_namespace": "a.b"},
    {"output_dtypes_from": ("q",)},
])
def test_specs_tensorrt_would_reject_are_refused(bad):
    spec = dataclasses.replace(specs()["Attention"], **bad)
    with pytest.raises(ValueError):
        rules.plugin_def(spec, "attention")


# ----------------------------------------------------------------------------------------------
# generated signatures: what tensorrt.plugin's validators check, and TensorRT's call conventions


def _check_register_signature(d, sig):
    seen_attr = False
    for i, (n, p) in enumerate(sig.parameters.items()):
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        assert p.annotation is not p.empty and p.default is p.empty
        if inspect.isclass(p.annotation) and issubclass(p.annotation, TensorDesc):
            assert not seen_attr, "TensorDescs and attributes interspersed"
        else:
            assert i > 0 and p.annotation in SERIALIZABLE and n not in ("outputs", "stream", "tactic")
            seen_attr = True
    ret = sig.return_annotation
    if typing.get_origin(ret) is tuple:
        args = typing.get_args(ret)
        assert all(issubclass(a, TensorDesc) for a in args)
        n_out = len(args)
    else:
        assert inspect.isclass(ret) and issubclass(ret, TensorDesc)
        n_out = 1
    assert n_out == len(d.outputs)


def _check_companion(d, sig, tail, tensor_cls):
    names = list(sig.parameters)
    assert names == list(d.inputs) + [n for n, _ in d.attributes] + tail
    registered = dict(d.attributes)
    for n, p in sig.parameters.items():
        if n == "outputs":
            assert typing.get_origin(p.annotation) is tuple
            assert all(issubclass(a, tensor_cls) for a in typing.get_args(p.annotation))
        elif n in ("tactic", "stream"):
            assert issubclass(p.annotation, int)
        elif n in registered:
            assert p.annotation == registered[n]
        else:
            assert issubclass(p.annotation, tensor_cls) and n in d.inputs


@pytest.mark.parametrize("name", OPS)
def test_generated_signatures_pass_tensorrt_plugin_checks(name):
    d = _defn(name)
    _check_register_signature(d, rules.register_signature(d, API))
    auto = rules.autotune_signature(d, API)
    _check_companion(d, auto, ["outputs"], TensorDesc)
    assert typing.get_origin(auto.return_annotation) is list
    assert typing.get_args(auto.return_annotation) == (AutoTuneCombination,)

    aot_sig = rules.aot_impl_signature(d, API)
    _check_companion(d, aot_sig, ["outputs", "tactic"], TensorDesc)
    ret = aot_sig.return_annotation
    assert typing.get_origin(ret) is tuple
    name_t, ptx_t, lp_t, extra_t = typing.get_args(ret)
    for t in (name_t, ptx_t):
        assert typing.get_origin(t) is typing.Union and set(typing.get_args(t)) == {str, bytes}
    assert issubclass(lp_t, KernelLaunchParams) and issubclass(extra_t, SymExprs)

    impl = rules.impl_signature(d, API)
    _check_companion(d, impl, ["outputs", "stream", "tactic"], Tensor)
    assert impl.return_annotation is None


@pytest.mark.parametrize("name", OPS)
def test_generated_functions_bind_as_tensorrt_calls_them(name):
    d = _defn(name)
    descs = [object() for _ in d.inputs]
    attrs = {n: t(7) if t is not str else "s" for n, t in d.attributes}
    outs = tuple(object() for _ in d.outputs)
    seen = []

    def body(args):
        seen.append(args)
        return "ret"

    reg = rules.make_function("r", rules.register_signature(d, API), body)
    assert inspect.signature(reg) == rules.register_signature(d, API)
    assert reg.__annotations__["return"] == rules.register_signature(d, API).return_annotation
    assert reg(*descs, **attrs) == "ret"  # get_output_shapes: f(*input_descs, **attrs)
    aot_fn = rules.make_function("a", rules.aot_impl_signature(d, API), body)
    aot_fn(*descs, *attrs.values(), outs, 3)  # get_launch_params: every attribute, positionally
    impl = rules.make_function("i", rules.impl_signature(d, API), body)
    impl(*descs, *attrs.values(), outs, 11, 2)  # enqueue with a tactic
    auto = rules.make_function("t", rules.autotune_signature(d, API), body)
    auto(*descs, *attrs.values(), outs)

    for args in seen:
        ins, got_attrs = rules.split_args(d, args)
        assert list(ins.values()) == descs and got_attrs == attrs
    assert seen[1]["outputs"] is outs and seen[1]["tactic"] == 3
    assert seen[2]["stream"] == 11 and seen[2]["tactic"] == 2
    with pytest.raises(TypeError):
        reg(*descs)  # attributes are required: no defaults


# ----------------------------------------------------------------------------------------------
# output shapes, dtypes and aliasing

B, S_PREFILL, NQ, NKV, D, CACHE = 3, 7, 4, 2, 16, 32
CH, K, SLOTS = 8, 4, 5
T, H, E, I = 6, 16, 4, 8
GHK, GHV, GDK, GDV = 2, 4, 8, 6  # GatedDeltaRule: q/k heads, value heads, key / value head dims
SH, SP, SG, SN = 6, 3, 2, 5  # SsmScan: heads, head dim, groups, state size


def _attention_shapes(b, s):
    """A text model's node: rotary tables, a constant zero lookahead [1, 1], sinks [Nq]."""
    return {"q": (b, s, NQ * D), "k": (b, s, NKV * D), "v": (b, s, NKV * D), "past_key": (b, NKV, CACHE, D),
            "past_value": (b, NKV, CACHE, D), "position_ids": (b, s), "cos_cache": (64, D // 2),
            "sin_cache": (64, D // 2), "lookahead": (1, 1), "sinks": (NQ,)}


def _short_conv_shapes(b, s):
    return {"x": (b, s, CH), "weight": (CH, K), "bias": (CH,), "state_pool": (SLOTS, CH, K - 1), "slot_idx": (b,),
            "seq_lens": (b,)}


def _gated_delta_shapes(b, s):
    return {"q": (b, s, GHK, GDK), "k": (b, s, GHK, GDK), "v": (b, s, GHV, GDV), "g": (b, s, GHV),
            "beta": (b, s, GHV), "state_pool": (SLOTS, GHV, GDK, GDV), "slot_idx": (b,), "seq_lens": (b,)}


def _ssm_scan_shapes(b, s):
    return {"x": (b, s, SH, SP), "dt": (b, s, SH), "A": (SH,), "Bm": (b, s, SG, SN), "Cm": (b, s, SG, SN),
            "D": (SH,), "dt_bias": (SH,), "state_pool": (SLOTS, SH, SN, SP), "slot_idx": (b,), "seq_lens": (b,)}


def _state_shapes(name, b, s):
    return {"Attention": _attention_shapes, "ShortConv": _short_conv_shapes,
            "GatedDeltaRule": _gated_delta_shapes, "SsmScan": _ssm_scan_shapes}[name](b, s)


def _moe_shapes(t):
    return {"hidden": (t, H), "router_logits": (t, E), "gate_up": (E, 2 * I, H), "down": (E, H, I), "expert_bias": (E,),
            "gate_up_bias": (E, 2 * I), "down_bias": (E, H)}


def _attrs(name, mode=None):
    base = {"Attention": {"num_heads": NQ, "num_kv_heads": NKV, "window": 0, "scale": D ** -0.5},
            # activation 2 (gpt-oss), the one that reads alpha and limit
            "MoE": {"top_k": 2, "scoring": 0, "normalize": 1, "norm_eps": 1e-6, "routed_scaling": 1.0,
                    "activation": 2, "alpha": 1.702, "limit": 7.0},
            "ShortConv": {"channels": CH}, "GatedDeltaRule": {"scale": GDK ** -0.5},
            "SsmScan": {"dt_min": 0.01, "dt_max": 4.0}}[name]
    if mode is not None:
        base[_defn(name).in_place.attr] = mode
    return base


SHAPE_CASES = [
    ("Attention", "decode", _attention_shapes(B, 1)),
    ("Attention", "prefill", _attention_shapes(2, S_PREFILL)),
    ("ShortConv", "decode", _short_conv_shapes(B, 1)),
    ("ShortConv", "prefill", _short_conv_shapes(2, S_PREFILL)),
    ("GatedDeltaRule", "decode", _gated_delta_shapes(B, 1)),
    ("GatedDeltaRule", "prefill", _gated_delta_shapes(2, S_PREFILL)),
    ("SsmScan", "decode", _ssm_scan_shapes(B, 1)),
    ("SsmScan", "prefill", _ssm_scan_shapes(2, S_PREFILL)),
    ("MoE", "decode", _moe_shapes(B)),
    ("MoE", "prefill", _moe_shapes(2 * S_PREFILL)),
]


def _fake_outputs(name, shapes, attrs):
    """The op's own ``fake`` (its one shape definition) on meta tensors."""
    mod = op_modules()[name]
    tensors = [torch.empty(shapes[n], device="meta") for n in mod.SPEC.inputs]
    known = {a.name for a in mod.SPEC.attributes}
    out = mod.fake(*tensors, **{k: v for k, v in attrs.items() if k in known})
    return [tuple(t.shape) for t in (out if isinstance(out, tuple) else (out,))]


@pytest.mark.parametrize("name,phase,shapes", SHAPE_CASES, ids=[f"{n}-{p}" for n, p, _ in SHAPE_CASES])
def test_new_rows_mode_outputs_match_the_ops_fake(name, phase, shapes):
    d = _defn(name)
    attrs = _attrs(name, 0 if d.in_place else None)
    out = rules.output_rules(d, shapes, attrs)
    assert [r.name for r in out] == list(d.outputs)
    assert [r.shape for r in out] == _fake_outputs(name, shapes, attrs)
    assert [r.dtype_from for r in out] == list(specs()[name].output_dtypes_from)
    assert all(r.aliased_to is None for r in out)
    # the first output is shaped like the activation input, with its dtype
    assert out[0].like == d.activation_input == out[0].dtype_from


IN_PLACE_SHAPE_CASES = [c for c in SHAPE_CASES if c[0] in IN_PLACE_OPS]


@pytest.mark.parametrize("name,phase,shapes", IN_PLACE_SHAPE_CASES, ids=[f"{n}-{p}" for n, p, _ in IN_PLACE_SHAPE_CASES])
def test_in_place_mode_aliases_state_outputs_to_their_inputs(name, phase, shapes):
    d = _defn(name)
    attrs = _attrs(name, 1)
    out = rules.output_rules(d, shapes, attrs)
    aliased = {r.name: r.aliased_to for r in out if r.aliased_to}
    assert sorted(aliased.values()) == sorted({"Attention": ["past_key", "past_value"], "ShortConv": ["state_pool"],
                                               "GatedDeltaRule": ["state_pool"], "SsmScan": ["state_pool"]}[name])
    for r in out:
        if r.aliased_to:
            assert r.shape == shapes[r.aliased_to] and r.dtype_from == r.aliased_to and r.like is None
        else:
            assert r.like == d.activation_input and r.shape == shapes[d.activation_input]
    # the op's fake agrees: the whole cache / pool
    assert [r.shape for r in out] == _fake_outputs(name, shapes, attrs)
    assert rules.aliased_outputs(d, attrs) == tuple(r.aliased_to is not None for r in out)
    assert not any(rules.aliased_outputs(d, _attrs(name, 0)))


@pytest.mark.parametrize("name", IN_PLACE_OPS)
def test_in_place_attribute_is_the_ops_own(name):
    mod = op_modules()[name]
    d = _defn(name)
    assert d.in_place is not None and d.in_place.attr == mod.IN_PLACE_ATTR
    assert dict(d.attributes)[d.in_place.attr] is int
    assert d.defaults.get(d.in_place.attr) == 0  # the op's default: new rows
    assert _defn("MoE").in_place is None


@pytest.mark.parametrize("name", IN_PLACE_OPS)
def test_a_spec_without_the_mode_attribute_has_new_rows_outputs(name):
    spec = specs()[name]
    old = dataclasses.replace(spec, attributes=tuple(a for a in spec.attributes if a.name != _defn(name).in_place.attr))
    d = rules.plugin_def(old, _module_name(name))
    shapes = _state_shapes(name, 2, 3)
    assert d.in_place is None
    assert all(r.aliased_to is None for r in rules.output_rules(d, shapes, _attrs(name)))
    with pytest.raises(ValueError):
        rules.plugin_def(old, _module_name(name), in_place_attr=_defn(name).in_place.attr)


def _module_taking(attr, takes):
    """A stand-in kernel module whose launch_plan does / does not take ``attr``."""
    if takes:
        ns = {}
        exec(f"def launch_plan(x_shape, *, {attr}=1): pass", ns)
        return SimpleNamespace(launch_plan=ns["launch_plan"], __name__="m")
    return SimpleNamespace(launch_plan=lambda x_shape: None, __name__="m")


@pytest.mark.parametrize("name", IN_PLACE_OPS)
@pytest.mark.parametrize("mode", [0, None])
def test_a_kernel_that_only_writes_in_place_refuses_the_new_rows_mode(name, mode):
    """A kernel module whose launch_plan does not take the mode attribute writes the state in
    place only: a node with mode 0 (or the default 0) is refused with the fix."""
    d = _defn(name)
    attrs = _attrs(name, mode)
    only_in_place = _module_taking(d.in_place.attr, False)
    assert rules.kernel_modes(d, only_in_place) == (1,)
    with pytest.raises(ValueError, match=f"{d.in_place.attr}=1"):
        rules.check_kernel_mode(d, attrs, only_in_place)
    shapes = _state_shapes(name, 1, 1)
    with pytest.raises(ValueError, match=f"{d.in_place.attr}=1"):
        rules.launch_plan(d, attrs, shapes, aot.ceil_div, module=only_in_place)
    rules.check_kernel_mode(d, _attrs(name, 1), only_in_place)
    both = _module_taking(d.in_place.attr, True)
    assert rules.kernel_modes(d, both) == (0, 1)
    rules.check_kernel_mode(d, attrs, both)
    assert rules.kernel_modes(_defn("MoE"), both) == (0,)


@pytest.mark.parametrize("name", IN_PLACE_OPS)
@pytest.mark.parametrize("mode", [2, -1, "1", True])
def test_in_place_mode_must_be_0_or_1(name, mode):
    shapes = _state_shapes(name, 1, 1)
    with pytest.raises(ValueError):
        rules.output_rules(_defn(name), shapes, _attrs(name, mode))


class Dim:
    """An opaque dim: rules must pass it on untouched (TensorRT gives ShapeExprs)."""

    def __init__(self, label):
        self.label = label

    def __repr__(self):
        return self.label


@pytest.mark.parametrize("name,phase,shapes", SHAPE_CASES, ids=[f"{n}-{p}" for n, p, _ in SHAPE_CASES])
@pytest.mark.parametrize("mode", [0, 1])
def test_shape_rules_only_pass_symbolic_dims_on(name, phase, shapes, mode):
    d = _defn(name)
    sym = {n: tuple(Dim(f"{n}[{i}]") for i in range(len(s))) for n, s in shapes.items()}
    got = rules.output_rules(d, sym, _attrs(name, mode if d.in_place else None))
    concrete = rules.output_rules(d, shapes, _attrs(name, mode if d.in_place else None))
    where = {id(x): (n, i) for n, s in sym.items() for i, x in enumerate(s)}
    for g, c in zip(got, concrete):
        assert all(id(x) in where for x in g.shape), "a rule computed a dim instead of passing one on"
        assert tuple(shapes[where[id(x)][0]][where[id(x)][1]] for x in g.shape) == c.shape


@pytest.mark.parametrize("name,bad", [("Attention", {"q": (2, 3)}), ("Attention", {"past_key": (2, 2, 4)}),
                                      ("ShortConv", {"state_pool": (4, 8)}), ("Attention", {"missing": None}),
                                      ("GatedDeltaRule", {"state_pool": (4, 8, 6)}),
                                      ("GatedDeltaRule", {"v": (2, 3, 24)}),
                                      ("SsmScan", {"state_pool": (4, SH, SN * SP)}),
                                      ("SsmScan", {"x": (2, 3, SH * SP)})])
def test_wrong_ranks_or_missing_shapes_are_refused(name, bad):
    shapes = _state_shapes(name, 2, 3)
    if "missing" in bad:
        del shapes["cos_cache"]
    else:
        shapes.update(bad)
    with pytest.raises(ValueError):
        rules.output_rules(_defn(name), shapes, _attrs(name, 0))


# ----------------------------------------------------------------------------------------------
# dtypes and autotune


def _expand(types: str) -> list[tuple[str, ...]]:
    """tensorrt.plugin's '|' semantics: positions with k alternatives are one dependent choice."""
    cols = [c.strip().split("|") for c in types.split(",")]
    k = max(len(c) for c in cols)
    assert all(len(c) in (1, k) for c in cols)
    return [tuple(c[0] if len(c) == 1 else c[i] for c in cols) for i in range(k)]


TRT = {"float16": "FP16", "bfloat16": "BF16", "float32": "FP32", "int64": "INT64"}


@pytest.mark.parametrize("name", OPS)
def test_autotune_offers_each_activation_dtype_with_ids_and_tables_fixed(name):
    d = _defn(name)
    combos = _expand(rules.autotune_types(d))
    assert len(combos) == len(rules.ACTIVATION_DTYPES)
    fixed = {"Attention": {"position_ids": "INT64", "cos_cache": "FP32", "sin_cache": "FP32", "lookahead": "INT64",
                           "sinks": "FP32"},
             "ShortConv": {"slot_idx": "INT64", "seq_lens": "INT64"}, "MoE": {"expert_bias": "FP32"},
             "GatedDeltaRule": {"g": "FP32", "beta": "FP32", "slot_idx": "INT64", "seq_lens": "INT64"},
             "SsmScan": {"A": "FP32", "D": "FP32", "dt_bias": "FP32", "slot_idx": "INT64", "seq_lens": "INT64"}}[name]
    positions = list(d.inputs) + [f"out:{o}" for o in d.outputs]
    for act, combo in zip(rules.ACTIVATION_DTYPES, combos):
        want = {p: fixed.get(p, TRT[act]) for p in positions}
        assert dict(zip(positions, combo)) == want
    assert rules.autotune_layouts(d).split(", ") == ["LINEAR"] * len(positions)


@pytest.mark.parametrize("member,want", [("FLOAT", "float32"), ("HALF", "float16"), ("BF16", "bfloat16"),
                                         ("INT64", "int64"), ("INT32", "int32")])
def test_trt_dtypes_map_by_member_name(member, want):
    assert rules.dtype_name(SimpleNamespace(name=member)) == want
    assert rules.dtype_name(f"DataType.{member}") == want


@pytest.mark.parametrize("member", ["INT8", "FP8", "BOOL"])
def test_unsupported_trt_dtypes_are_refused(member):
    with pytest.raises(ValueError):
        rules.dtype_name(SimpleNamespace(name=member))


def _tiny_hybrid_decoder(dtype, expert_bias):
    from graphkiln.models.config import DecoderConfig, GatedDeltaConfig, LayerSpec, MoEConfig, RopeConfig
    from graphkiln.models.decoder import DecoderForExport

    cfg = DecoderConfig(
        architecture="test", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=3, num_heads=2,
        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope=RopeConfig(10000.0), max_position_embeddings=64,
        tie_word_embeddings=False, layers=(LayerSpec("attention", ffn="moe"), LayerSpec("conv"),
                                           LayerSpec("gated_delta")),
        moe=MoEConfig(num_experts=4, top_k=2, intermediate_size=8, expert_bias=expert_bias), conv_kernel=3,
        gated_delta=GatedDeltaConfig(num_k_heads=1, num_v_heads=2, head_k_dim=8, head_v_dim=4, conv_kernel=4))
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    model = DecoderForExport(cfg, {"default": inv}, {"default": 1.0})
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return cfg, model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("expert_bias", [False, True])
def test_autotune_dtypes_are_what_the_exported_model_feeds_the_ops(dtype, expert_bias):
    """The decoder the exporter traces, run in each dtype: every custom-op call's tensor dtypes
    must be a combination the plugin advertises, or the engine build finds no kernel."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphkiln.ops import register_torch_ops

    register_torch_ops()
    torch_names = {specs()[n].torch_name: n for n in OPS}
    seen = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ns, _, op = func._schema.name.partition("::")
            if ns == "graphkiln" and op in torch_names:
                name = torch_names[op]
                seen[name] = tuple(str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor))
                out = func(*args, **(kwargs or {}))
                outs = out if isinstance(out, tuple) else (out,)
                seen[name] += tuple(str(o.dtype).removeprefix("torch.") for o in outs)
                return out
            return func(*args, **(kwargs or {}))

    cfg, model = _tiny_hybrid_decoder(dtype, expert_bias)
    b, s = 2, 3
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    pos = torch.arange(s).expand(b, s).contiguous()
    past = torch.zeros(b, cfg.num_kv_heads, 4, cfg.head_dim, dtype=dtype)
    pool = torch.zeros(3, cfg.hidden_size, cfg.conv_kernel - 1, dtype=dtype)
    gd = cfg.gated_delta
    gd_pools = [torch.zeros(3, *st.shape, dtype=dtype) for st in cfg.slot_states(2)]  # conv, recurrent
    assert gd.conv_dim == gd_pools[0].shape[1]
    with torch.no_grad(), Record():
        model(ids, pos, torch.zeros(b, 1, dtype=torch.int64), torch.full((b,), s), torch.tensor([2, 0]), past,
              past.clone(), pool, *gd_pools)
    # SsmScan is checked once this decoder has a mamba layer (the Mamba-2 model code is in progress)
    assert set(seen) <= set(OPS) and set(OPS) - set(seen) <= {"SsmScan"}, sorted(set(OPS) - set(seen))
    act = str(dtype).removeprefix("torch.")
    for name, got in seen.items():
        want = rules.io_dtypes(_defn(name), act)
        if name == "MoE" and expert_bias and dtype != torch.float32:
            # the kernel reads an fp32 routing table; a model with a learned bias passes it in
            # the model dtype (the exporter's zeros for a model without one are fp32), so the
            # TensorRT lowering inserts a Cast to fp32 (tests/test_trt_target.py checks it)
            assert got[:4] == want[:4] and got[5:] == want[5:] and got[4] == act
            continue
        if name == "GatedDeltaRule" and dtype != torch.float32:
            # g is computed in fp32 (what the kernel reads); beta in the model dtype, which the
            # TensorRT lowering casts to fp32 (tests/test_trt_target.py)
            assert got[:4] == want[:4] and got[5:] == want[5:] and got[4] == act
            continue
        if name == "SsmScan" and dtype != torch.float32:
            # A, D and dt_bias may be parameters in the model dtype, which the TensorRT lowering
            # casts to fp32 (trt_target.FP32_INPUTS, exact); every other position must match
            cast = {_defn(name).inputs.index(n) for n in ("A", "D", "dt_bias")}
            assert all(g == w or (i in cast and g == act) for i, (g, w) in enumerate(zip(got, want))), got
            continue
        assert got == want, name


# ----------------------------------------------------------------------------------------------
# kernels: plans, launch parameters, tactics


class Sym:
    """A symbolic dim with exactly TensorRT ShapeExpr's arithmetic: ``+ - * //`` with the
    expression on the left, comparisons that build expressions, no conversion to int/bool.
    ``value`` evaluates it for the concrete dims it was built from."""

    def __init__(self, value, label="e"):
        self.value, self.label = value, label

    def _op(self, other, f, sym):
        if isinstance(other, Sym):
            return Sym(f(self.value, other.value), f"({self.label}{sym}{other.label})")
        if isinstance(other, int) and not isinstance(other, bool):
            return Sym(f(self.value, other), f"({self.label}{sym}{other})")
        return NotImplemented

    def __add__(self, o):
        return self._op(o, lambda a, b: a + b, "+")

    def __sub__(self, o):
        return self._op(o, lambda a, b: a - b, "-")

    def __mul__(self, o):
        return self._op(o, lambda a, b: a * b, "*")

    def __floordiv__(self, o):
        return self._op(o, lambda a, b: a // b, "//")

    def __eq__(self, o):
        return self._op(o, lambda a, b: int(a == b), "==")

    def __lt__(self, o):
        return self._op(o, lambda a, b: int(a < b), "<")

    __hash__ = object.__hash__

    def __bool__(self):
        raise TypeError(f"a symbolic dim has no truth value at build time: {self.label}")

    def __index__(self):
        raise TypeError(f"a symbolic dim is not an int at build time: {self.label}")

    __int__ = __index__

    def __repr__(self):
        return self.label


def sym_cdiv(a, b):
    """trtp.cdiv: refuses two ints, wraps an int first operand."""
    if isinstance(a, int) and isinstance(b, int):
        raise ValueError("Both arguments cannot be 'int's")
    a = a if isinstance(a, Sym) else Sym(a, str(a))
    return a._op(b, lambda x, y: -(-x // y), " cdiv ")


def _evaluate(x):
    return x.value if isinstance(x, Sym) else x


def test_make_cdiv_divides_ints_here_and_hands_symbols_on():
    cdiv = rules.make_cdiv(sym_cdiv)
    assert cdiv(7, 2) == 4 and cdiv(8, 2) == 4 and cdiv(1, 16) == 1
    assert _evaluate(cdiv(Sym(7), 2)) == 4 and _evaluate(cdiv(7, Sym(2))) == 4
    with pytest.raises(ValueError):
        sym_cdiv(7, 2)


def _kernel_module(name):
    try:
        return importlib.import_module(_defn(name).kernel_module)
    except ModuleNotFoundError as exc:
        if exc.name == _defn(name).kernel_module:
            pytest.skip(f"{exc.name} does not exist (kernels are another part of issue 11)")
        raise


def _plan_shapes(name, phase):
    return {"Attention": {"decode": _attention_shapes(2, 1), "prefill": _attention_shapes(2, 5)},
            "ShortConv": {"decode": _short_conv_shapes(2, 1), "prefill": _short_conv_shapes(2, 5)},
            "GatedDeltaRule": {"decode": _gated_delta_shapes(2, 1), "prefill": _gated_delta_shapes(2, 5)},
            "SsmScan": {"decode": _ssm_scan_shapes(2, 1), "prefill": _ssm_scan_shapes(2, 5)},
            "MoE": {"decode": _moe_shapes(2), "prefill": _moe_shapes(20)}}[name][phase]


def _kernel_attr_sets(name, mod):
    """Attributes of the nodes the plugin runs: each in-place mode the kernel module takes."""
    d = _defn(name)
    if d.in_place is None:
        return [_attrs(name)]
    return [_attrs(name, m) for m in rules.kernel_modes(d, mod)]


def _tactics(module):
    return rules.tactic_list(module) or [0]


def _symbolic(shapes, constant=()):
    """Shapes as TensorRT gives them: symbolic dims, except those resolve_dim makes ints
    (weights' dims, the head dim: build-time constants)."""
    out = {}
    for n, s in shapes.items():
        out[n] = tuple(v if (n, i) in constant else Sym(v, f"{n}{i}") for i, v in enumerate(s))
    return out


# Dims that are build-time constants in any engine: weights and the head dim / channel count.
STATIC = {
    "Attention": {("q", 2), ("k", 2), ("v", 2), ("past_key", 1), ("past_key", 3), ("past_value", 1),
                  ("past_value", 3), ("cos_cache", 1), ("sin_cache", 1), ("lookahead", 0), ("lookahead", 1),
                  ("sinks", 0)},
    "MoE": {("hidden", 1), ("router_logits", 1), ("gate_up", 0), ("gate_up", 1), ("gate_up", 2), ("down", 0),
            ("down", 1), ("down", 2), ("expert_bias", 0), ("gate_up_bias", 0), ("gate_up_bias", 1),
            ("down_bias", 0), ("down_bias", 1)},
    "ShortConv": {("x", 2), ("weight", 0), ("weight", 1), ("bias", 0), ("state_pool", 1), ("state_pool", 2)},
    "GatedDeltaRule": {("q", 2), ("q", 3), ("k", 2), ("k", 3), ("v", 2), ("v", 3), ("g", 2), ("beta", 2),
                       ("state_pool", 1), ("state_pool", 2), ("state_pool", 3)},
    "SsmScan": {("x", 2), ("x", 3), ("dt", 2), ("A", 0), ("Bm", 2), ("Bm", 3), ("Cm", 2), ("Cm", 3), ("D", 0),
                ("dt_bias", 0), ("state_pool", 1), ("state_pool", 2), ("state_pool", 3)},
}

PLAN_CASES = [(n, p) for n in OPS for p in ("decode", "prefill")]


@pytest.mark.parametrize("name,phase", PLAN_CASES)
def test_plans_with_tensorrt_symbolic_dims_equal_plans_with_ints(name, phase):
    """What aot_impl computes with TensorRT's expressions (batch, sequence, cache, pool and
    table lengths symbolic) evaluates to what the Python launcher computes with ints."""
    mod = _kernel_module(name)
    d = _defn(name)
    shapes = _plan_shapes(name, phase)
    sym = _symbolic(shapes, STATIC[name])
    cdiv = rules.make_cdiv(sym_cdiv)
    for attrs, tactic in [(a, t) for a in _kernel_attr_sets(name, mod) for t in _tactics(mod)]:
        for dtype in rules.ACTIVATION_DTYPES:
            ints = rules.launch_plan(d, attrs, shapes, cdiv, dtype=dtype, tactic=tactic, module=mod)
            symbolic = rules.launch_plan(d, attrs, sym, cdiv, dtype=dtype, tactic=tactic, module=mod)
            assert symbolic.kernel is ints.kernel
            assert dict(symbolic.constexprs) == dict(ints.constexprs)
            assert tuple(map(_evaluate, symbolic.grid)) == tuple(ints.grid)
            assert tuple(map(_evaluate, symbolic.scalars)) == tuple(ints.scalars)
            assert all(isinstance(g, int) and g >= 1 for g in ints.grid)
            assert all(isinstance(x, int) for x in ints.scalars)
            assert len(ints.scalars) == len(ints.kernel.scalars)
            assert all(isinstance(v, (int, float, bool)) for v in ints.constexprs.values())


@pytest.mark.parametrize("rope_layout", [0, 1])
def test_attention_plans_take_a_lookahead_input_and_per_token_rotary(rope_layout):
    """Gemma3's nodes read lookahead [batch, seq] (a graph input: symbolic dims, indexed) where
    text models pass a constant [1, 1] (broadcast); Qwen2.5-VL's (rope_layout 1) read cos/sin
    [batch, seq, D/2]. The symbolic plan equals the int one and picks the kernel's modes."""
    mod, d = _kernel_module("Attention"), _defn("Attention")
    attrs = {**_attrs("Attention", 1), "rope_layout": rope_layout}
    rotary = (2, 5, D // 2) if rope_layout else (64, D // 2)
    cases = {(1, 1): (0, 0), (2, 5): (1, 1), (2, 1): (1, 0), (1, 5): (0, 1)}  # lookahead shape -> (B, S) indexed
    for la_shape, indexed in cases.items():
        shapes = {**_attention_shapes(2, 5), "lookahead": la_shape, "cos_cache": rotary, "sin_cache": rotary}
        static = {("q", 2), ("k", 2), ("v", 2), ("past_key", 1), ("past_key", 3), ("past_value", 1),
                  ("past_value", 3), ("cos_cache", len(rotary) - 1), ("sin_cache", len(rotary) - 1)}
        static |= {("lookahead", i) for i, n in enumerate(la_shape) if n == 1}  # a constant's dims
        cdiv = rules.make_cdiv(sym_cdiv)
        for tactic in _tactics(mod):
            ints = rules.launch_plan(d, attrs, shapes, cdiv, dtype="float16", tactic=tactic, module=mod)
            symbolic = rules.launch_plan(d, attrs, _symbolic(shapes, static), cdiv, dtype="float16", tactic=tactic,
                                         module=mod)
            assert dict(symbolic.constexprs) == dict(ints.constexprs)
            assert tuple(map(_evaluate, symbolic.grid)) == tuple(ints.grid)
            c = ints.constexprs
            assert (c["LOOKAHEAD_B"], c["LOOKAHEAD_S"], c["ROPE_LAYOUT"]) == (*indexed, rope_layout), la_shape
        rules_out = rules.output_rules(d, shapes, attrs)  # outputs do not depend on either
        assert [r.aliased_to or r.like for r in rules_out] == ["q", "past_key", "past_value"]
    bad = [({"lookahead": (3, 5)}, "lookahead's batch dim is 3"), ({"lookahead": (2, 5, 1)}, "lookahead has rank 3"),
           ({"cos_cache": rotary[1:] if rope_layout else (2, 5, D // 2)}, "cos_cache has rank"),
           ({"lookahead": (2, 4)}, "lookahead's sequence dim is 4")]
    if rope_layout:
        bad.append(({"cos_cache": (2, 4, D // 2)}, "per-token cos_cache's sequence dim is 4"))
    for change, match in bad:
        shapes = {**_attention_shapes(2, 5), "cos_cache": rotary, "sin_cache": rotary, **change}
        with pytest.raises(ValueError, match=match):
            rules.launch_plan(d, attrs, shapes, aot.ceil_div, dtype="float16", module=mod)
    with pytest.raises(ValueError, match="rope_layout 2"):
        rules.launch_plan(d, {**attrs, "rope_layout": 2}, _attention_shapes(2, 5), aot.ceil_div, module=mod)


def test_resolve_dim_makes_build_time_constants_ints():
    class ShapeExpr:  # tensorrt.plugin's: is_fake / is_constant properties, constant_value() method
        def __init__(self, value=None, fake=False):
            self.value, self.is_fake = value, fake

        @property
        def is_constant(self):
            if self.is_fake:
                raise RuntimeError("fake")
            return self.value is not None

        def constant_value(self):
            return self.value

    dynamic, fake = ShapeExpr(), ShapeExpr(fake=True)
    assert rules.resolve_dim(ShapeExpr(64)) == 64 and isinstance(rules.resolve_dim(ShapeExpr(64)), int)
    assert rules.resolve_dim(dynamic) is dynamic and rules.resolve_dim(fake) is fake and rules.resolve_dim(5) == 5
    got = rules.resolve_shapes({"q": (dynamic, ShapeExpr(3), 7)})
    assert got == {"q": (dynamic, 3, 7)}


@pytest.mark.parametrize("name", OPS)
def test_kernels_take_the_ops_inputs_and_outputs_with_the_advertised_dtypes(name):
    mod = _kernel_module(name)
    d = _defn(name)
    for kernel in mod.KERNELS:
        assert isinstance(kernel, aot.KernelSpec)
        # pointer parameters bind to the op's I/O in SPEC order (TensorRT passes them all)
        assert len(kernel.inputs) == len(d.inputs) and len(kernel.outputs) == len(d.outputs), kernel.name
        for act in rules.ACTIVATION_DTYPES:
            io = rules.io_dtypes(d, act)
            declared = tuple(kernel.fixed_dtypes.get(p, act) for p in kernel.inputs + kernel.outputs)
            assert declared == io, (kernel.name, act)


@pytest.mark.parametrize("name", OPS)
def test_float_attributes_are_compile_time_constants(name):
    """TensorRT's AOT extras are int32 only: each float attribute must reach the kernel as a
    constexpr, so a plugin with another value compiles (and caches) another kernel."""
    mod = _kernel_module(name)
    d = _defn(name)
    floats = [n for n, t in d.attributes if t is float]
    assert floats or name == "ShortConv"
    shapes = _plan_shapes(name, "decode")
    for base, tactic in [(a, t) for a in _kernel_attr_sets(name, mod) for t in _tactics(mod)]:
        plan = rules.launch_plan(d, base, shapes, aot.ceil_div, dtype="float16", tactic=tactic, module=mod)
        for f in floats:
            other = dict(base, **{f: base[f] * 3.0 + 0.125})
            changed = rules.launch_plan(d, other, shapes, aot.ceil_div, dtype="float16", tactic=tactic, module=mod)
            diff = {k for k in plan.constexprs if plan.constexprs[k] != changed.constexprs.get(k)}
            assert diff, f"{f} does not reach the kernel's constexprs"
            assert other[f] in [changed.constexprs[k] for k in diff]


# Compiling runs with the interpreter off: under TRITON_INTERPRET=1 a kernel's @triton.jit
# helpers are interpreter objects the compiler cannot call.
_COMPILE_SCRIPT = """
import json, sys
from graphkiln.plugins_trt import rules
from graphkiln.plugins_trt.kernels import aot
out = []
for name, attrs, shapes, tactic in json.loads(sys.stdin.read()):
    d = rules.plugin_defs()[name]
    shapes = {k: tuple(v) for k, v in shapes.items()}
    plan = rules.launch_plan(d, attrs, shapes, aot.ceil_div, dtype="float16", tactic=tactic)
    compiled = rules.compile_plan(plan, "float16", 90)
    lp = rules.launch_params(plan, compiled)
    out.append(dict(name=name, tactic=tactic, mode=attrs, kernel=plan.kernel.name, grid=list(plan.grid),
                    scalars=list(plan.scalars), num_warps=plan.num_warps, lp_grid=list(lp.grid), block=list(lp.block),
                    shared=lp.shared_mem, extra=list(lp.extra_args), compiled_warps=compiled.num_warps,
                    compiled_shared=compiled.shared_mem, params=list(compiled.params),
                    expected=list(aot.expected_params(plan.kernel)), arch=compiled.arch,
                    sm90=".target sm_90" in compiled.ptx, entry=compiled.name,
                    cached=rules.compile_plan(plan, "float16", 90) is compiled))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_launches():
    jobs = []
    for name in OPS:
        mod = _kernel_module(name)
        for attrs in _kernel_attr_sets(name, mod):
            for tactic in _tactics(mod):
                jobs.append((name, attrs, {k: list(v) for k, v in _plan_shapes(name, "prefill").items()}, tactic))
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], input=json.dumps(jobs), capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), jobs


@pytest.mark.parametrize("name", OPS)
def test_launch_params_come_from_the_plan_and_the_compiled_kernel(name, compiled_launches):
    results, jobs = compiled_launches
    mine = [r for r in results if r["name"] == name]
    assert len(mine) == len([j for j in jobs if j[0] == name]) > 0
    for r in mine:
        assert r["lp_grid"] == r["grid"] and all(isinstance(g, int) and g >= 1 for g in r["grid"])
        assert r["block"] == [r["num_warps"] * 32, 1, 1] == [r["compiled_warps"] * 32, 1, 1]
        assert r["shared"] == r["compiled_shared"]
        assert r["extra"] == r["scalars"]
        assert r["params"] == r["expected"]  # inputs, int32 extras, outputs: what TensorRT passes
        assert r["arch"] == 90 and r["sm90"] and r["cached"]
    # every tactic is its own launch
    assert len({(r["kernel"], tuple(r["grid"]), json.dumps(r["mode"], sort_keys=True)) for r in mine}) == len(mine) \
        or len(mine) == 1


@pytest.mark.parametrize("name", OPS)
def test_tactics_name_every_kernel_variant(name):
    mod = _kernel_module(name)
    options = rules.tactic_options(mod)
    tactics = rules.tactic_list(mod)
    if len(mod.KERNELS) > 1:
        assert [o["kernel"] for o in options] == list(mod.KERNELS)
    elif len(getattr(mod, "TACTICS", ())) > 1:
        names = list(dict.fromkeys(k if isinstance(k, str) else k[0] for k in mod.TACTICS))
        assert [o["tactic"] for o in options] == names and len(names) > 1
    else:
        assert options == () and tactics is None
    if options:
        assert tactics == list(range(1, len(options) + 1))
        assert [rules.tactic_arguments(mod, t) for t in tactics] == list(options)
        assert rules.tactic_arguments(mod, 0) == options[0]
        # each tactic is a different launch (else TensorRT would time one kernel twice)
        d = _defn(name)
        shapes = _plan_shapes(name, "prefill")
        attrs = _kernel_attr_sets(name, mod)[-1]
        plans = [rules.launch_plan(d, attrs, shapes, aot.ceil_div, "float16", t, mod) for t in tactics]
        keys = {(p.kernel.name, tuple(p.grid), tuple(sorted(p.constexprs.items()))) for p in plans}
        assert len(keys) == len(plans)
    with pytest.raises(ValueError):
        rules.tactic_arguments(mod, len(options) + 1 if options else 2)


def _inputs(shapes, dtype, gen):
    """Small valid inputs (ids in range, tables and expert bias fp32)."""
    out = {}
    for n, s in shapes.items():
        if n == "position_ids":
            start = torch.tensor([3, 0])[: s[0]].unsqueeze(1)
            out[n] = (start + torch.arange(s[1])).to(torch.int64)
        elif n == "lookahead":
            out[n] = torch.zeros(s, dtype=torch.int64)
        elif n == "slot_idx":
            out[n] = torch.tensor([4, 1])[: s[0]].to(torch.int64)
        elif n == "seq_lens":
            out[n] = torch.full((s[0],), 1, dtype=torch.int64)
        elif n in ("cos_cache", "sin_cache", "sinks", "expert_bias", "g", "beta", "A", "D", "dt_bias"):
            out[n] = torch.randn(s, generator=gen)
        else:
            out[n] = (torch.randn(s, generator=gen) * 0.5).to(dtype)
    return out


class _Planned(Exception):
    """Stops a launcher once it has its plan: the launch itself is the kernel tests' business
    (and needs their interpreter fixes); what matters here is which plan it launches with."""


@pytest.mark.parametrize("name", OPS)
@pytest.mark.parametrize("phase", ["decode", "prefill"])
def test_python_launcher_uses_the_plugins_plan(name, phase, monkeypatch):
    """``run_<op>`` (the plugin's debugging impl) launches with a plan aot_impl would give for
    one of its tactics: same kernel, grid, int32 scalars and constexprs."""
    mod = _kernel_module(name)
    d = _defn(name)
    run = getattr(mod, d.runner)
    shapes = _plan_shapes(name, phase)
    tensors = _inputs(shapes, torch.float16, torch.Generator().manual_seed(1))
    real = mod.launch_plan
    for attrs in _kernel_attr_sets(name, mod):
        plans = []

        def recording(*args, **kwargs):
            plans.append(real(*args, **kwargs))
            raise _Planned

        monkeypatch.setattr(mod, "launch_plan", recording)
        with pytest.raises(_Planned):
            run(**rules.bind_by_name(run, rules.run_values(d, tensors, attrs), d.runner))
        monkeypatch.setattr(mod, "launch_plan", real)
        assert len(plans) == 1, f"{d.runner} does not build its launch through {mod.__name__}.launch_plan"
        key = lambda p: (p.kernel, tuple(p.grid), tuple(p.scalars), tuple(sorted(p.constexprs.items())))
        ours = [rules.launch_plan(d, attrs, shapes, aot.ceil_div, "float16", t, mod) for t in _tactics(mod)]
        assert key(plans[0]) in [key(p) for p in ours], attrs


def test_bind_by_name_refuses_parameters_it_cannot_supply():
    def plan(q_shape, num_heads, cdiv, unknown):
        pass

    def fine(q_shape, num_heads, cos_shape, cdiv, block=64, **rest):
        return q_shape, num_heads, cos_shape, block

    d = _defn("Attention")
    shapes = _attention_shapes(1, 1)
    values = rules.plan_values(d, _attrs("Attention"), shapes, aot.ceil_div)
    with pytest.raises(TypeError, match="unknown"):
        rules.bind_by_name(plan, values, "plan")
    # <input>_shape, or <prefix>_shape for the one input named <prefix>_...
    assert fine(**rules.bind_by_name(fine, values, "fine")) == ((1, 1, NQ * D), NQ, shapes["cos_cache"], 64)
    assert values["past_key_shape"] == shapes["past_key"] and "past_shape" not in values  # ambiguous prefix


# ----------------------------------------------------------------------------------------------
# the debugging impl's tensor plumbing


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
@pytest.mark.parametrize("transpose", [False, True])
def test_array_interface_describes_the_tensor_memory(dtype, transpose):
    """The same dict over host memory (numpy's ``__array_interface__``) must read back the tensor:
    byte strides, type string, and bf16 travelling as int16."""
    t = (torch.arange(24).reshape(4, 6) * 3 - 7).to(dtype)
    if transpose:
        t = t.t()
    desc, view = rules.cuda_array_interface(t.data_ptr(), tuple(t.shape), t.stride(), str(dtype).split(".")[1], None)
    holder = SimpleNamespace(__array_interface__={k: v for k, v in desc.items() if k != "stream"})
    back = torch.from_numpy(np.array(holder, copy=True))
    if view:
        back = back.view(getattr(torch, view))
    assert back.dtype == dtype and torch.equal(back, t)
    assert desc["version"] == 3 and desc["stream"] is None and desc["data"][1] is False


def test_write_outputs_copies_new_tensors_and_skips_in_place_ones():
    out0, state = torch.zeros(2, 3), torch.zeros(4, 5)
    result0 = torch.ones(2, 3)
    state[1] = 7  # the kernel wrote the aliased state in place
    rules.write_outputs((result0, state), (out0, state), (False, True))
    assert torch.equal(out0, result0) and state[1].eq(7).all() and state[0].eq(0).all()
    # a launcher that returns only the non-aliased outputs (run_attention returns out)
    out0.zero_()
    rules.write_outputs(result0, (out0, state, state), (False, True, True))
    assert torch.equal(out0, result0) and state[1].eq(7).all()
    single = torch.zeros(3)
    rules.write_outputs(torch.arange(3.0), (single,))
    assert torch.equal(single, torch.arange(3.0))
    with pytest.raises(ValueError):
        rules.write_outputs((result0,), (out0, state))
    with pytest.raises(ValueError):
        rules.write_outputs((result0, result0), (out0, state, state), (False, True, True))


def test_generated_functions_fill_spec_defaults_for_left_out_keywords():
    d = _defn("Attention")
    sig = rules.register_signature(d, API)
    assert all(p.default is p.empty for p in sig.parameters.values())  # tensorrt.plugin allows none
    fn = rules.make_function("r", sig, lambda args: args, d.defaults)
    descs = [object() for _ in d.inputs]
    attrs = {k: v for k, v in _attrs("Attention").items()}
    assert fn(*descs, **attrs)[d.in_place.attr] == 0
    assert fn(*descs, **attrs, **{d.in_place.attr: 1})[d.in_place.attr] == 1
    with pytest.raises(TypeError, match="num_heads"):
        fn(*descs, **{k: v for k, v in attrs.items() if k != "num_heads"})


def test_device_arch_defaults_to_sm90_without_a_gpu():
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        assert rules.device_arch() == major * 10 + minor
    else:
        assert rules.device_arch() == 90 and rules.device_arch(default=80) == 80


# ----------------------------------------------------------------------------------------------
# importing the package needs no TensorRT


def test_every_plugins_trt_module_imports_without_tensorrt():
    import graphkiln.plugins_trt as pkg

    names = sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    assert {"graphkiln.plugins_trt.rules", "graphkiln.plugins_trt.register"} <= set(names)
    code = (
        "import importlib, sys\n"
        "class NoTensorRT:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorrt' or name.startswith('tensorrt.'):\n"
        "            raise ImportError('tensorrt is not installed here')\n"
        "sys.meta_path.insert(0, NoTensorRT())\n"
        f"for name in {names!r}:\n"
        "    importlib.import_module(name)\n"
        "bad = sorted(m for m in sys.modules if m == 'tensorrt' or m.startswith('tensorrt.'))\n"
        "assert not bad, bad\n"
        "print('ok', len(sys.modules))\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-2000:]
