"""The TensorRT plugins' rules as plain functions: identity, signatures, shapes, dtypes, launch.

Everything here is decidable without TensorRT, so the CPU test suite checks it; ``register``
is the thin layer that hands these rules to ``tensorrt.plugin`` on a GPU machine. Dims are
whatever the caller has: ints (tests, Python launchers) or TensorRT's symbolic ``ShapeExpr``
(engine build). Rules only index shapes and pass dims on, never compute with them, so one rule
serves both.

What ``tensorrt.plugin`` (TensorRT >= 10.9, read in ``python/packaging/bindings_wheel/
tensorrt/plugin/{_lib,_validate,_plugin_class,_tensor,_autotune}.py``) requires, and what the
generated functions are built to satisfy:

* ``register`` reads ``inspect.signature``: every parameter positional-or-keyword, annotated,
  without a default; ``TensorDesc`` inputs first, then attributes annotated with a serializable
  built-in (int/float/str); return annotation ``TensorDesc`` (one output) or
  ``Tuple[TensorDesc, ...]`` with one entry *per output* (the count is the number of outputs).
  TensorRT calls it as ``f(*input_descs, **attrs)``.
* ``autotune``/``aot_impl``/``impl`` must name exactly the inputs, then the attributes used in
  register order, then ``outputs`` (then ``tactic`` / ``stream[, tactic]``); an annotated
  attribute must carry the registered type. ``aot_impl`` needs a return annotation of a 4-tuple
  (str|bytes, str|bytes, KernelLaunchParams, SymExprs subclass). The AOT plugin calls
  ``aot_impl(*descs, *all_attr_values, outputs, tactic)`` with EVERY attribute, so the generated
  functions always take all of them.
* Output aliasing is ``input_desc.aliased()`` on the very descriptor object TensorRT passed in.
* AOT extra arguments must be ``SymInt32`` (``SymIntExprs.from_tuple`` wraps plain ints as a
  base ``SymIntExpr``, which the plugin then refuses), so each is wrapped explicitly.
* ``ShapeExpr`` has ``+ - * //`` with the expression on the left only (no reflected
  operators) and ``trtp.cdiv`` refuses two ints: see ``make_cdiv``.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from functools import cache
from types import MappingProxyType
from typing import Any, Callable, List, Mapping, Sequence, Tuple, Union

from graphkiln.ops import op_modules
from graphkiln.ops.spec import CustomOpSpec
from graphkiln.plugins_trt.kernels import aot

KERNELS_PACKAGE = "graphkiln.plugins_trt.kernels"

# SPEC attribute kind -> the Python annotation tensorrt.plugin serializes it as (ONNX INT ->
# kINT32 field, FLOAT -> kFLOAT32, STRING -> kCHAR; the plugin casts the field back to these).
ATTR_TYPES: Mapping[str, type] = MappingProxyType({"int": int, "float": float, "string": str})

# ONNX node attributes TensorRT's parser consumes itself (which creator, AOT or JIT): they are
# never plugin fields, so an op attribute must not use these names; nor the names
# tensorrt.plugin reserves for its own parameters.
NODE_ONLY_ATTRS = frozenset({"plugin_namespace", "plugin_version", "aot"})
RESERVED_PARAMS = frozenset({"outputs", "stream", "tactic"})

# Activations (and the KV cache / state pool, stored in the model dtype) take any of these; the
# first is what a plugin is tuned with first.
ACTIVATION_DTYPES = ("float16", "bfloat16", "float32")

# Inputs whose dtype does not follow the model dtype: ids and Attention's lookahead are int64 and
# the rotary tables fp32 in the exported graph, constants or (rope_layout 1) per-token values
# gathered from them (graphkiln.export.onnx_export.decoder_io, models.decoder); Attention's sinks
# are fp32 (the decoder casts its parameter, exactly; a zero constant when the model has none);
# MoE's expert_bias is an fp32 routing table (the kernel reads it as fp32, as the reference
# does; the exporter writes fp32 zeros when a model has no bias); GatedDeltaRule's g and beta are
# fp32 (the model computes g in fp32 and beta in its dtype; the TensorRT lowering casts beta,
# exactly, as the reference reads both in fp32); SsmScan's A, D and dt_bias are fp32 (A is
# -exp(A_log) in fp32 as transformers computes it; the reference reads A and D in fp32 and rounds
# dt_bias to dt's dtype, which the kernel does too, so the lowering's casts change nothing).
# Every other input and output follows the activation dtype (SsmScan's dt too: the reference
# rounds dt + dt_bias in dt's dtype). The kernels' ``fixed_dtypes`` must agree (tested).
FIXED_INPUT_DTYPES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    "Attention": MappingProxyType({"position_ids": "int64", "cos_cache": "float32", "sin_cache": "float32",
                                   "lookahead": "int64", "sinks": "float32"}),
    "MoE": MappingProxyType({"expert_bias": "float32"}),
    "ShortConv": MappingProxyType({"slot_idx": "int64", "seq_lens": "int64"}),
    "GatedDeltaRule": MappingProxyType({"g": "float32", "beta": "float32", "slot_idx": "int64", "seq_lens": "int64"}),
    "SsmScan": MappingProxyType({"A": "float32", "D": "float32", "dt_bias": "float32", "slot_idx": "int64",
                                 "seq_lens": "int64"}),
})

# tensorrt.plugin.AutoTuneCombination type names ("FP32"/"FP16", else trt.DataType member names).
TRT_TYPE_NAMES: Mapping[str, str] = MappingProxyType(
    {"float32": "FP32", "float16": "FP16", "bfloat16": "BF16", "int64": "INT64", "int32": "INT32"})
# trt.DataType member name -> graphkiln dtype name (aot.TRITON_DTYPES keys).
DTYPE_FROM_TRT: Mapping[str, str] = MappingProxyType(
    {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32"})
# CUDA array interface type strings; bf16 has none, so it travels as int16 and is viewed back.
_TYPESTR = {"float32": ("<f4", 4), "float16": ("<f2", 2), "bfloat16": ("<i2", 2), "int64": ("<i8", 8),
            "int32": ("<i4", 4)}


@dataclass(frozen=True)
class InPlace:
    """An op whose state outputs may be written in place: with ``attr`` = 1 each output whose
    dtype comes from one of ``inputs`` is that input's buffer (TensorRT: aliased to it); with
    0 it is the new rows only."""

    attr: str
    inputs: tuple[str, ...]


# The in-place attribute when an op module does not name it (``IN_PLACE_ATTR``): the lead's
# design for issue 11. The op module's own ``IN_PLACE_ATTR`` wins.
IN_PLACE_ATTRS: Mapping[str, str] = MappingProxyType({"Attention": "kv_update", "ShortConv": "state_update",
                                                     "GatedDeltaRule": "state_update", "SsmScan": "state_update"})

# The mode a kernel module implements when its launch_plan does not take the attribute: it
# writes the rows into the aliased cache/pool and returns nothing else (TensorRT-target graphs
# set the attribute to 1 on every node).
KERNEL_IN_PLACE_MODE = 1


@dataclass(frozen=True)
class PluginDef:
    """One op's TensorRT plugin, derived from its ``CustomOpSpec`` (nothing restated)."""

    spec: CustomOpSpec
    kernel_module: str  # dotted name of the Triton kernel module
    runner: str  # its Python launcher, run_<module>
    in_place: InPlace | None = None

    @property
    def plugin_id(self) -> str:
        return self.spec.plugin_id

    @property
    def namespace(self) -> str:
        return self.spec.plugin_namespace

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def inputs(self) -> tuple[str, ...]:
        return self.spec.inputs

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.spec.outputs

    @property
    def attributes(self) -> tuple[tuple[str, type], ...]:
        """(name, annotation) in SPEC order, which is the plugin's field order."""
        return tuple((a.name, ATTR_TYPES[a.kind]) for a in self.spec.attributes)

    @property
    def defaults(self) -> Mapping[str, Any]:
        """SPEC defaults, for attributes a caller may leave out (tensorrt.plugin signatures may
        not carry defaults, so the generated functions fill them in)."""
        return {a.name: a.default for a in self.spec.attributes if getattr(a, "default", None) is not None}

    @property
    def activation_input(self) -> str:
        """The input whose dtype chooses the kernel's compiled dtype (q, hidden, x): the first
        output's dtype source."""
        return self.spec.output_dtypes_from[0]


def plugin_def(spec: CustomOpSpec, module_name: str, in_place_attr: str | None = None) -> PluginDef:
    """The plugin for ``spec``, defined in ``graphkiln.ops.<module_name>``; refuses a SPEC whose
    names tensorrt.plugin or the ONNX parser would reject or misread.

    ``in_place_attr`` names the int attribute that turns the state outputs (those whose dtype
    comes from an input other than the first output's) into their aliased inputs.
    """
    names = [a.name for a in spec.attributes]
    bad = [n for n in names if n in NODE_ONLY_ATTRS | RESERVED_PARAMS]
    if bad:
        raise ValueError(f"{spec.name}: attribute names {bad} are reserved by TensorRT")
    unknown = [a.kind for a in spec.attributes if a.kind not in ATTR_TYPES]
    if unknown:
        raise ValueError(f"{spec.name}: attribute kinds {unknown} have no TensorRT plugin type")
    clash = set(spec.inputs) & (set(names) | RESERVED_PARAMS)
    if clash or len(set(spec.inputs)) != len(spec.inputs) or len(set(names)) != len(names):
        raise ValueError(f"{spec.name}: input and attribute names must be distinct and not {sorted(RESERVED_PARAMS)}")
    if "." in spec.plugin_namespace or "." in spec.name or spec.plugin_namespace in ("", "trt", "tensorrt", "std"):
        raise ValueError(f"{spec.plugin_id} is not a valid tensorrt.plugin id")
    if spec.plugin_version != "1":
        # tensorrt.plugin registers every Python plugin creator as version "1".
        raise ValueError(f"{spec.plugin_id}: tensorrt.plugin only registers plugin_version '1'")
    if len(spec.output_dtypes_from) != len(spec.outputs) or not set(spec.output_dtypes_from) <= set(spec.inputs):
        raise ValueError(f"{spec.name}: output_dtypes_from must name one input per output")
    in_place = None
    if in_place_attr is not None:
        if dict((a.name, a.kind) for a in spec.attributes).get(in_place_attr) != "int":
            raise ValueError(f"{spec.name}: in-place attribute {in_place_attr} is not one of its int attributes")
        state = tuple(dict.fromkeys(n for n in spec.output_dtypes_from[1:] if n != spec.output_dtypes_from[0]))
        if not state:
            raise ValueError(f"{spec.name}: {in_place_attr} given but no output is state")
        in_place = InPlace(in_place_attr, state)
    return PluginDef(spec, f"{KERNELS_PACKAGE}.{module_name}", f"run_{module_name}", in_place)


@cache
def plugin_defs() -> Mapping[str, PluginDef]:
    """Every custom op's plugin by op name, from ``graphkiln.ops``."""
    defs = {}
    for name, m in op_modules().items():
        attr = getattr(m, "IN_PLACE_ATTR", None) or IN_PLACE_ATTRS.get(name)
        if attr not in {a.name for a in m.SPEC.attributes}:
            attr = None  # the op does not (yet) define the mode: its state outputs are new rows
        defs[name] = plugin_def(m.SPEC, m.__name__.rsplit(".", 1)[1], attr)
    return MappingProxyType(defs)


# ----------------------------------------------------------------------------------------------
# generated functions (tensorrt.plugin inspects their signatures)

P = inspect.Parameter


def _params(names: Sequence[str], annotation) -> list[inspect.Parameter]:
    return [P(n, P.POSITIONAL_OR_KEYWORD, annotation=annotation) for n in names]


def _attr_params(d: PluginDef) -> list[inspect.Parameter]:
    return [P(n, P.POSITIONAL_OR_KEYWORD, annotation=t) for n, t in d.attributes]


def _outputs_type(d: PluginDef, cls: type):
    return Tuple[tuple(cls for _ in d.outputs)]


def register_signature(d: PluginDef, api) -> inspect.Signature:
    """``(inputs: TensorDesc..., attrs...) -> TensorDesc | Tuple[TensorDesc x outputs]``.
    ``api`` is ``tensorrt.plugin`` or anything with the same classes (tests)."""
    ret = api.TensorDesc if len(d.outputs) == 1 else _outputs_type(d, api.TensorDesc)
    return inspect.Signature(_params(d.inputs, api.TensorDesc) + _attr_params(d), return_annotation=ret)


def autotune_signature(d: PluginDef, api) -> inspect.Signature:
    params = _params(d.inputs, api.TensorDesc) + _attr_params(d)
    params.append(P("outputs", P.POSITIONAL_OR_KEYWORD, annotation=_outputs_type(d, api.TensorDesc)))
    return inspect.Signature(params, return_annotation=List[api.AutoTuneCombination])


def aot_impl_signature(d: PluginDef, api) -> inspect.Signature:
    params = _params(d.inputs, api.TensorDesc) + _attr_params(d)
    params.append(P("outputs", P.POSITIONAL_OR_KEYWORD, annotation=_outputs_type(d, api.TensorDesc)))
    params.append(P("tactic", P.POSITIONAL_OR_KEYWORD, annotation=int))
    ret = Tuple[Union[str, bytes], Union[str, bytes], api.KernelLaunchParams, api.SymIntExprs]
    return inspect.Signature(params, return_annotation=ret)


def impl_signature(d: PluginDef, api) -> inspect.Signature:
    params = _params(d.inputs, api.Tensor) + _attr_params(d)
    params.append(P("outputs", P.POSITIONAL_OR_KEYWORD, annotation=_outputs_type(d, api.Tensor)))
    params.append(P("stream", P.POSITIONAL_OR_KEYWORD, annotation=int))
    params.append(P("tactic", P.POSITIONAL_OR_KEYWORD, annotation=int))
    return inspect.Signature(params, return_annotation=None)


def make_function(name: str, signature: inspect.Signature, body: Callable[[dict[str, Any]], Any],
                  defaults: Mapping[str, Any] | None = None) -> Callable:
    """A function whose ``inspect.signature`` is ``signature`` and that calls ``body`` with its
    arguments bound by name, however the caller passes them (TensorRT mixes positional and
    keyword calls). ``defaults`` fill parameters a keyword caller left out (a node without an
    attribute that has a SPEC default); the signature itself carries none, as tensorrt.plugin
    requires."""
    defaults = dict(defaults or {})

    def fn(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs)
        values = dict(bound.arguments)
        for p in signature.parameters:
            if p not in values:
                if p not in defaults:
                    raise TypeError(f"{name}() missing argument {p!r}")
                values[p] = defaults[p]
        return body({p: values[p] for p in signature.parameters})

    fn.__signature__ = signature
    fn.__name__ = fn.__qualname__ = name
    fn.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
    fn.__annotations__["return"] = signature.return_annotation
    return fn


def split_args(d: PluginDef, args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(inputs by name, attributes by name) from a generated function's bound arguments."""
    return {n: args[n] for n in d.inputs}, {n: args[n] for n, _ in d.attributes}


# ----------------------------------------------------------------------------------------------
# output shapes, dtypes and aliasing


@dataclass(frozen=True)
class OutputRule:
    """One output: an input's whole buffer (``aliased_to``), a fresh tensor shaped like an
    input (``like``), or fresh with ``shape``; its dtype is always ``dtype_from``'s."""

    name: str
    dtype_from: str
    shape: tuple
    like: str | None = None
    aliased_to: str | None = None


def in_place_mode(d: PluginDef, attrs: Mapping[str, Any]) -> int:
    """0 (return the new rows) or 1 (write the state input in place); 0 when the op has no such
    attribute (its SPEC predates it or the op keeps no state)."""
    if d.in_place is None:
        return 0
    mode = attrs.get(d.in_place.attr, d.defaults.get(d.in_place.attr, 0))
    if mode not in (0, 1) or isinstance(mode, bool):
        raise ValueError(f"{d.name}: {d.in_place.attr} must be 0 or 1, got {mode!r}")
    return int(mode)


def kernel_modes(d: PluginDef, module) -> tuple[int, ...]:
    """The in-place modes ``module``'s kernels run: both when its ``launch_plan`` takes the mode
    attribute (it plans either), else only the in-place one (issue 11's design: plugin
    kernels write the new rows into the aliased cache/pool)."""
    if d.in_place is None:
        return (0,)
    if d.in_place.attr in inspect.signature(module.launch_plan).parameters:
        return (0, 1)
    return (KERNEL_IN_PLACE_MODE,)


def check_kernel_mode(d: PluginDef, attrs: Mapping[str, Any], module) -> None:
    """Refuse a node whose in-place mode the plugin's kernel cannot run, naming the fix."""
    modes = kernel_modes(d, module)
    if in_place_mode(d, attrs) not in modes:
        raise ValueError(f"{d.plugin_id}: the TensorRT plugin writes {', '.join(d.in_place.inputs)} in place; "
                         f"export the TensorRT graph with {d.in_place.attr}={modes[0]} on every {d.name} node")


def resolve_dim(x):
    """An int for a build-time-constant dim (a weight's or the head dim; kernel plans size tiles
    with them), else ``x`` unchanged. TensorRT's ``ShapeExpr``: ``is_fake`` (no expression
    outside a shape context), ``is_constant`` (property) and ``constant_value()`` (method)."""
    if isinstance(x, int) or getattr(x, "is_fake", False):
        return x
    if getattr(x, "is_constant", False):
        value = x.constant_value
        return int(value() if callable(value) else value)
    return x


def resolve_shapes(shapes: Mapping[str, Sequence]) -> dict[str, tuple]:
    return {n: tuple(resolve_dim(x) for x in s) for n, s in shapes.items()}


def _rank(d: PluginDef, shapes: Mapping[str, Sequence], name: str, rank: int) -> tuple:
    shape = tuple(shapes[name])
    if len(shape) != rank:
        raise ValueError(f"{d.name}: input {name} must have rank {rank}, got {len(shape)}")
    return shape


def _new_rows(d: PluginDef, shapes: Mapping[str, Sequence], state: str) -> tuple:
    """Shape of the rows a state output returns in mode 0 (``fake`` of the op, generalised)."""
    if d.name == "Attention":  # q [B, S, Nq*D], past [B, Nkv, C, D] -> [B, Nkv, S, D]
        q = _rank(d, shapes, "q", 3)
        past = _rank(d, shapes, state, 4)
        return (q[0], past[1], q[1], past[3])
    if d.name == "ShortConv":  # x [B, S, C], pool [slots, C, K-1] -> [B, C, K-1]
        x = _rank(d, shapes, "x", 3)
        pool = _rank(d, shapes, state, 3)
        return (x[0], pool[1], pool[2])
    if d.name == "GatedDeltaRule":  # v [B, S, Hv, Dv], pool [slots, Hv, Dk, Dv] -> [B, Hv, Dk, Dv]
        v = _rank(d, shapes, "v", 4)
        pool = _rank(d, shapes, state, 4)
        return (v[0], pool[1], pool[2], pool[3])
    if d.name == "SsmScan":  # x [B, S, H, P], pool [slots, H, N, P] -> [B, H, N, P]
        x = _rank(d, shapes, "x", 4)
        pool = _rank(d, shapes, state, 4)
        return (x[0], pool[1], pool[2], pool[3])
    raise ValueError(f"{d.name}: no new-rows rule for state input {state}")


def output_rules(d: PluginDef, shapes: Mapping[str, Sequence], attrs: Mapping[str, Any]) -> tuple[OutputRule, ...]:
    """Each output's shape, dtype source and aliasing, in SPEC output order.

    Outputs whose dtype comes from a state input (KV cache, conv state pool) are that input
    aliased when the op's in-place attribute is 1, else its new rows; every other output is
    shaped like the input it takes its dtype from (out like q/hidden, y like x).
    """
    missing = [n for n in d.inputs if n not in shapes]
    if missing:
        raise ValueError(f"{d.name}: shapes missing for inputs {missing}")
    mode = in_place_mode(d, attrs)
    state_inputs = d.in_place.inputs if d.in_place else ()
    result = []
    for out, src in zip(d.outputs, d.spec.output_dtypes_from):
        if src in state_inputs:
            if mode == 1:
                result.append(OutputRule(out, src, tuple(shapes[src]), aliased_to=src))
            else:
                result.append(OutputRule(out, src, _new_rows(d, shapes, src)))
        else:
            result.append(OutputRule(out, src, tuple(shapes[src]), like=src))
    return tuple(result)


# ----------------------------------------------------------------------------------------------
# dtypes and autotune


def io_dtypes(d: PluginDef, activation: str) -> tuple[str, ...]:
    """Every input's then every output's dtype when the activations are ``activation``."""
    fixed = FIXED_INPUT_DTYPES.get(d.name, {})
    ins = {n: fixed.get(n, activation) for n in d.inputs}
    return tuple(ins[n] for n in d.inputs) + tuple(ins[src] for src in d.spec.output_dtypes_from)


def autotune_types(d: PluginDef, activations: Sequence[str] = ACTIVATION_DTYPES) -> str:
    """The ``AutoTuneCombination`` type string: activation positions are one dependent choice
    ("FP16|BF16|FP32" at each: all equal), fixed positions a single type."""
    per_choice = [io_dtypes(d, a) for a in activations]
    cols = []
    for pos in range(len(d.inputs) + len(d.outputs)):
        names = [TRT_TYPE_NAMES[c[pos]] for c in per_choice]
        cols.append(names[0] if len(set(names)) == 1 else "|".join(names))
    return ", ".join(cols)


def autotune_layouts(d: PluginDef) -> str:
    """Every position LINEAR (row-major, what the kernels index)."""
    return ", ".join("LINEAR" for _ in range(len(d.inputs) + len(d.outputs)))


def dtype_name(trt_dtype) -> str:
    """graphkiln's dtype name for a ``trt.DataType`` (by member name, so tests need no TensorRT)."""
    name = getattr(trt_dtype, "name", str(trt_dtype)).rsplit(".", 1)[-1]
    if name not in DTYPE_FROM_TRT:
        raise ValueError(f"TensorRT dtype {name} is not one the graphkiln plugins take")
    return DTYPE_FROM_TRT[name]


# ----------------------------------------------------------------------------------------------
# kernels and launch


def kernel_module(d: PluginDef):
    return importlib.import_module(d.kernel_module)


def make_cdiv(symbolic_cdiv: Callable) -> Callable:
    """A ``cdiv`` for ``launch_plan``: ints divide here (``trtp.cdiv`` refuses two ints),
    anything symbolic goes to ``symbolic_cdiv``."""

    def cdiv(a, b):
        if isinstance(a, int) and isinstance(b, int):
            return aot.ceil_div(a, b)
        return symbolic_cdiv(a, b)

    return cdiv


def tactic_options(module) -> tuple[Mapping[str, Any], ...]:
    """The plan variants a plugin offers TensorRT as custom tactics (it times them and keeps the
    fastest), each as extra ``launch_plan`` arguments: one per kernel when a module has several
    (``kernel=``), else one per named tile configuration in its ``TACTICS`` (``tactic=``), else
    none (a single variant, TensorRT's default tactic)."""
    if len(module.KERNELS) > 1:
        return tuple(MappingProxyType({"kernel": k}) for k in module.KERNELS)
    # TACTICS keys are tactic names, or tuples led by one (a name per dtype class, say)
    keys = getattr(module, "TACTICS", ()) or ()
    names = tuple(dict.fromkeys(k if isinstance(k, str) else k[0] for k in keys))
    if len(names) > 1:
        return tuple(MappingProxyType({"tactic": n}) for n in names)
    return ()


def tactic_list(module) -> list[int] | None:
    """The custom tactics to advertise: 1..n (0 is TensorRT's default), None for one variant."""
    n = len(tactic_options(module))
    return list(range(1, n + 1)) if n else None


def tactic_arguments(module, tactic: int) -> Mapping[str, Any]:
    """The ``launch_plan`` arguments TensorRT tactic ``tactic`` stands for (0: the module's own
    choice, i.e. the first variant when it has several)."""
    options = tactic_options(module)
    if not options:
        if tactic not in (0, 1):
            raise ValueError(f"tactic {tactic}: {module.__name__} has a single kernel variant")
        return {}
    index = max(tactic, 1) - 1
    if index >= len(options):
        raise ValueError(f"tactic {tactic} is not one of the {len(options)} variants of {module.__name__}")
    return options[index]


def bind_by_name(fn: Callable, values: Mapping[str, Any], what: str) -> dict[str, Any]:
    """Keyword arguments for ``fn`` taken from ``values`` by parameter name; a parameter with a
    default may be left out, any other missing one is a mismatch between a kernel module and
    its op's SPEC."""
    kwargs = {}
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            continue
        if name in values:
            kwargs[name] = values[name]
        elif p.default is P.empty:
            raise TypeError(f"{what}: cannot supply parameter {name!r} (known: {sorted(values)})")
    return kwargs


def plan_values(d: PluginDef, attrs: Mapping[str, Any], shapes: Mapping[str, Sequence], cdiv: Callable,
                dtype: str | None = None) -> dict[str, Any]:
    """What a kernel module's ``launch_plan`` may ask for, by parameter name: each attribute,
    each input's shape as ``<input>_shape`` (or ``<prefix>_shape`` for the one input named
    ``<prefix>_...``, e.g. cos_shape), ``shapes``/``attrs`` mappings, ``cdiv`` and ``dtype``."""
    values: dict[str, Any] = {"cdiv": cdiv, "shapes": dict(shapes), "attrs": dict(attrs)}
    if dtype is not None:
        values["dtype"] = dtype
    prefixes: dict[str, list[str]] = {}
    for n in d.inputs:
        values[f"{n}_shape"] = tuple(shapes[n])
        parts = n.split("_")
        for k in range(1, len(parts)):
            prefixes.setdefault("_".join(parts[:k]), []).append(n)
    for prefix, names in prefixes.items():
        if len(names) == 1 and f"{prefix}_shape" not in values:
            values[f"{prefix}_shape"] = tuple(shapes[names[0]])
    values.update(attrs)
    return values


def launch_plan(d: PluginDef, attrs: Mapping[str, Any], shapes: Mapping[str, Sequence], cdiv: Callable,
                dtype: str | None = None, tactic: int = 0, module=None) -> aot.LaunchPlan:
    """The kernel module's plan for these attributes and shapes (ints or symbolic) and TensorRT
    tactic; refuses what the plugin kernel cannot run."""
    module = module or kernel_module(d)
    check_kernel_mode(d, attrs, module)
    fn = module.launch_plan
    values = {**plan_values(d, attrs, shapes, cdiv, dtype), **tactic_arguments(module, tactic)}
    plan = fn(**bind_by_name(fn, values, f"{module.__name__}.launch_plan"))
    if plan.kernel not in module.KERNELS:
        raise ValueError(f"{module.__name__}.launch_plan chose a kernel that is not in its KERNELS")
    if len(plan.scalars) != len(plan.kernel.scalars):
        raise ValueError(f"{plan.kernel.name}: plan gives {len(plan.scalars)} scalars, "
                         f"kernel takes {len(plan.kernel.scalars)}")
    if len(plan.grid) != 3:
        raise ValueError(f"{plan.kernel.name}: grid must be (x, y, z)")
    return plan


@dataclass(frozen=True)
class LaunchParams:
    """``tensorrt.plugin.KernelLaunchParams`` plus the ``SymInt32`` extra arguments, before
    conversion: grid from the plan, one block of num_warps*32 threads, the compiled kernel's
    shared memory, the plan's int32 scalars (between the input and output pointers)."""

    grid: tuple[Any, Any, Any]
    block: tuple[int, int, int]
    shared_mem: int
    extra_args: tuple[Any, ...]


def launch_params(plan: aot.LaunchPlan, compiled: aot.CompiledKernel) -> LaunchParams:
    if compiled.num_warps != plan.num_warps:
        raise ValueError(f"{plan.kernel.name}: compiled with {compiled.num_warps} warps, planned {plan.num_warps}")
    return LaunchParams(tuple(plan.grid), (compiled.block_threads, 1, 1), compiled.shared_mem, tuple(plan.scalars))


def compile_plan(plan: aot.LaunchPlan, dtype: str, arch: int) -> aot.CompiledKernel:
    """PTX for ``plan`` (cached by kernel, dtype, constexpr values — float attributes among
    them — arch and warps, so an engine with many layers compiles each distinct kernel once)."""
    return aot.compile_kernel(plan.kernel, dtype, plan.constexprs, arch=arch, num_warps=plan.num_warps)


def device_arch(default: int = 90) -> int:
    """The compute capability to compile for: the current CUDA device's (major*10 + minor),
    asked through cuda-python (the tensorrt extra's) or else torch, else ``default``.
    tensorrt.plugin does not tell the plugin."""
    try:
        from cuda.bindings import runtime as cudart

        err, device = cudart.cudaGetDevice()
        if err == cudart.cudaError_t.cudaSuccess:
            err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, device)
            err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, device)
            if err == err2 == cudart.cudaError_t.cudaSuccess:
                return major * 10 + minor
    except Exception:  # no cuda-python or no device: try torch
        pass
    try:
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return major * 10 + minor
    except Exception:  # no usable torch/CUDA: fall back, the build machine decides
        pass
    return default


# ----------------------------------------------------------------------------------------------
# the debugging impl: TensorRT tensors as torch tensors, results into TensorRT's outputs


def cuda_array_interface(data_ptr: int, shape: Sequence[int], strides: Sequence[int], dtype: str,
                         stream: int | None) -> tuple[dict[str, Any], str | None]:
    """(``__cuda_array_interface__`` v3 dict, dtype to ``.view`` the result as or None) for a
    TensorRT tensor (strides in elements, as TensorRT gives them). tensorrt.plugin's own
    interface refuses bf16, so bf16 travels as int16 and is viewed back."""
    typestr, size = _TYPESTR[dtype]
    desc = {"shape": tuple(int(s) for s in shape), "typestr": typestr, "data": (int(data_ptr), False),
            "strides": tuple(int(s) * size for s in strides), "version": 3, "stream": stream}
    return desc, ("bfloat16" if dtype == "bfloat16" else None)


def run_values(d: PluginDef, tensors: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, Any]:
    return {**tensors, **attrs}


def aliased_outputs(d: PluginDef, attrs: Mapping[str, Any]) -> tuple[bool, ...]:
    """Per output: is it an input's buffer (written in place, nothing to copy)?"""
    state = d.in_place.inputs if d.in_place and in_place_mode(d, attrs) == 1 else ()
    return tuple(src in state for src in d.spec.output_dtypes_from)


def write_outputs(results, outputs: Sequence, aliased: Sequence[bool] | None = None) -> None:
    """Copy a launcher's results into TensorRT's output tensors.

    A launcher returns either every output or only the non-aliased ones (the in-place state it
    wrote into its input, which is the aliased output's memory). A result that already is its
    output's memory is not copied.
    """
    results = (results,) if not isinstance(results, (tuple, list)) else tuple(results)
    aliased = tuple(aliased) if aliased is not None else (False,) * len(outputs)
    if len(aliased) != len(outputs):
        raise ValueError("one aliasing flag per output")
    if len(results) == len(outputs):
        pairs = list(zip(results, outputs))
    elif len(results) == aliased.count(False):
        pairs = list(zip(results, [o for o, a in zip(outputs, aliased) if not a]))
    else:
        raise ValueError(f"launcher returned {len(results)} tensors for {len(outputs)} outputs "
                         f"({aliased.count(True)} of them written in place)")
    for r, o in pairs:
        if r.data_ptr() == o.data_ptr() and tuple(r.shape) == tuple(o.shape) and r.stride() == o.stride():
            continue
        o.copy_(r)
