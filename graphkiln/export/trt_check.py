"""Static check: would TensorRT's ONNX parser take this graph? (``graphkiln check ART --backend tensorrt``)

Every node of every graph (subgraphs of If/Loop/Scan included) is compared with the parser's
published operator support list for the pinned TensorRT version, vendored as package data
(``trt_support/operators-<version>.md``, onnx-tensorrt's ``docs/operators.md`` verbatim with
its source and the date read in a header), parsed here at check time:

* default-domain nodes: the op is listed as supported; the element type of each input (and of
  the output where an attribute chooses it: Cast, Constant, ...) is among the op's listed
  types; the model's default opset is inside the list's opset range. An op's restriction note
  is reported once per op as a warning: the list states it in prose, so it is for a person to
  confirm, not a failure;
* ``graphkiln`` nodes: a known op (``graphkiln.ops.specs()``) with its plugin identity
  (``plugin_namespace``, ``plugin_version``), ``aot=1``, exactly the spec's attributes (those
  with a default may be left off) of the spec's types, the spec's input/output counts, the
  domain imported at the spec's version, for ops with in-place state, the in-place mode
  (``IN_PLACE_ATTR`` = 1: the plugin aliases its state outputs to its inputs), the element type
  of each input the plugin takes in one fixed type (``plugins_trt.rules.FIXED_INPUT_DTYPES``:
  int64 ids and Attention's lookahead, fp32 rotary values) where the graph states it, and
  Attention's ``rope_layout`` (0 or 1, with cos/sin of rank 2 or 3 where the graph states
  the rank; a lookahead may be a constant or a graph input, [B|1, S|1] either way). Their
  model-local function bodies are not checked: the parser imports such a node as the plugin
  before it looks for a function;
* any other domain (``com.microsoft`` contrib ops above all) is an error: the parser has no
  importer for it;
* graph inputs and outputs have types TensorRT has.

``check_model`` checks one ``onnx.ModelProto``; ``check_artifact`` every TensorRT-target graph of
an artifact (every graph when it has none). Both return a ``TrtCheckReport``; nothing here
imports TensorRT.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal, Mapping

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show

TRT_VERSION = "10.15"  # the TensorRT whose parser the vendored list describes
SUPPORT_PACKAGE, SUPPORT_DIR = "graphkiln.export", "trt_support"  # package data: graphkiln/export/trt_support/

# ONNX TensorProto element type -> the list's type name (types TensorRT has; anything else fails)
TRT_TYPE_NAMES: Mapping[int, str] = {1: "FP32", 10: "FP16", 16: "BF16", 6: "INT32", 7: "INT64", 3: "INT8",
                                     2: "UINT8", 9: "BOOL", 17: "FP8", 23: "FP4", 22: "INT4", 11: "DOUBLE"}
# ops whose output element type an attribute chooses: their outputs are checked too
_ATTRIBUTE_TYPED = frozenset({"Cast", "Constant", "ConstantOfShape", "EyeLike", "RandomNormal", "RandomNormalLike",
                              "RandomUniform", "RandomUniformLike"})
_CONSTANT_TYPES = {"value_float": 1, "value_floats": 1, "value_int": 7, "value_ints": 7, "value_string": 8,
                   "value_strings": 8}
_PLUGIN_ATTRS = ("plugin_namespace", "plugin_version")
_STD_DOMAINS = ("", "ai.onnx")
_ATTR_KINDS = {"int": 2, "float": 1, "string": 3}  # AttrSpec.kind -> onnx AttributeProto.AttributeType


@dataclass(frozen=True)
class OpSupport:
    """One row of the support list."""

    name: str
    supported: bool
    types: frozenset[str]
    restrictions: str


@dataclass(frozen=True)
class SupportList:
    """The parsed support list of one TensorRT version."""

    trt_version: str
    opset_min: int
    opset_max: int
    ops: Mapping[str, OpSupport]
    source: str  # the vendored file's source line


def parse_support_list(text: str) -> SupportList:
    """Parse onnx-tensorrt's ``docs/operators.md``: the header sentence naming the TensorRT
    version and opset range, then the ``| Operator | Supported | Types | Restrictions |`` table
    (some rows lack cells or the trailing ``|``). ValueError when either is missing."""
    head = re.search(r"TensorRT (\d+(?:\.\d+)*) supports operators in the inclusive range of opset (\d+) to opset (\d+)",
                     text)
    if head is None:
        raise ValueError("no 'TensorRT X supports operators in the inclusive range of opset A to opset B' sentence")
    source = re.search(r"^source: (\S+)", text, re.M)
    ops: dict[str, OpSupport] = {}
    in_table = False
    for line in text.splitlines():
        if line.startswith("## Operator Support Matrix"):
            in_table = True
            continue
        if not in_table or not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not cells[0] or cells[0] == "Operator" or set(cells[0]) <= {"-", ":"}:
            continue
        cells += [""] * (4 - len(cells))
        ops[cells[0]] = OpSupport(cells[0], cells[1].split()[:1] == ["Y"],
                                  frozenset(t.strip() for t in cells[2].split(",") if t.strip()), cells[3])
    if not ops:
        raise ValueError("no operator table under '## Operator Support Matrix'")
    return SupportList(head.group(1), int(head.group(2)), int(head.group(3)), ops,
                       source.group(1) if source else "unknown")


@cache
def support_list(version: str = TRT_VERSION) -> SupportList:
    """The vendored list for ``version`` (package data), parsed once."""
    text = resources.files(SUPPORT_PACKAGE).joinpath(SUPPORT_DIR, f"operators-{version}.md").read_text(encoding="utf-8")
    parsed = parse_support_list(text)
    if parsed.trt_version != version:
        raise ValueError(f"operators-{version}.md describes TensorRT {parsed.trt_version}")
    return parsed


@dataclass(frozen=True)
class Finding:
    """What would fail (``error``) or needs a person's look (``warning``) in one graph."""

    severity: Literal["error", "warning"]
    graph: str  # the graph's file (or the name given to check_model)
    op: str  # "domain.op_type" ("Add" for the default domain); "" for the graph itself
    node: str  # the node's name; "" for a note about every node of the op
    message: str

    def line(self) -> str:
        where = f"{self.op} node {self.node}" if self.op and self.node else (self.op or "graph")
        return f"{self.severity}: {self.graph}: {where}: {self.message}"


@dataclass(frozen=True)
class TrtCheckReport:
    """The outcome of checking graphs against the pinned parser's list; ``passed``: no errors."""

    trt_version: str
    opset_range: tuple[int, int]
    graphs: tuple[str, ...]
    nodes_checked: int
    findings: tuple[Finding, ...]

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")

    @property
    def warnings(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "warning")

    @property
    def passed(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        lines = [f.line() for f in self.errors + self.warnings]
        verdict = "PASS" if self.passed else "FAIL"
        lines.append(f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s) over "
                     f"{self.nodes_checked} nodes of {', '.join(self.graphs)} against TensorRT {self.trt_version}'s "
                     f"ONNX parser (opsets {self.opset_range[0]}-{self.opset_range[1]})")
        return "\n".join(lines)


def _types(graph, known: dict[str, int]) -> dict[str, int]:
    """Element types of the values visible in ``graph`` (outer scopes' included via ``known``)."""
    from onnx import helper

    types = dict(known)
    for v in list(graph.input) + list(graph.output) + list(graph.value_info):
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            types[v.name] = v.type.tensor_type.elem_type
    for t in graph.initializer:
        types[t.name] = t.data_type
    for n in graph.node:
        if n.op_type == "Cast" and n.domain in _STD_DOMAINS and n.output and n.output[0] not in types:
            types.update({n.output[0]: a.i for a in n.attribute if a.name == "to"})
        if n.op_type == "Constant" and n.domain in _STD_DOMAINS:
            for a in n.attribute:
                if a.name == "value":
                    types[n.output[0]] = helper.get_attribute_value(a).data_type
                elif a.name in _CONSTANT_TYPES:
                    types[n.output[0]] = _CONSTANT_TYPES[a.name]
    return types


class _Checker:
    def __init__(self, model, graph_name: str, support: SupportList) -> None:
        self.model, self.name, self.support = model, graph_name, support
        self.findings: list[Finding] = []
        self.nodes = 0
        self.imports = {o.domain or "": o.version for o in model.opset_import}
        self.restricted: Counter[str] = Counter()

    def error(self, op: str, node: str, message: str) -> None:
        self.findings.append(Finding("error", self.name, op, node, message))

    def run(self) -> list[Finding]:
        opset = self.imports.get("", self.imports.get("ai.onnx"))
        s = self.support
        if opset is None or not s.opset_min <= opset <= s.opset_max:
            self.error("", "", f"default-domain opset {opset} is outside TensorRT {s.trt_version}'s opsets "
                               f"{s.opset_min}-{s.opset_max}: export with --opset 23")
        g = self.model.graph
        for side, values in (("input", g.input), ("output", g.output)):
            for v in values:
                elem = v.type.tensor_type.elem_type if v.type.HasField("tensor_type") else 0
                if TRT_TYPE_NAMES.get(elem) in (None, "DOUBLE"):
                    self.error("", "", f"graph {side} {v.name!r} has element type {_type_name(elem)}, which TensorRT "
                                       "does not have")
        self.graph(g, {})
        for op, count in sorted(self.restricted.items()):
            self.findings.append(Finding("warning", self.name, op, "", f"{count} node{'s' * (count > 1)}; check the "
                                         f"parser's restriction: {self.support.ops[op].restrictions}"))
        return self.findings

    def graph(self, graph, outer: dict[str, int]) -> None:
        from onnx import AttributeProto

        types = _types(graph, outer)
        ranks = _ranks(graph)
        for node in graph.node:
            self.nodes += 1
            name = node.name or (node.output[0] if node.output else "?")
            if node.domain in _STD_DOMAINS:
                self.standard(node, name, types)
            elif node.domain == _gk_domain():
                self.custom(node, name, types, ranks)
            elif node.domain == "com.microsoft":
                self.error(f"com.microsoft.{node.op_type}", name, "is an onnxruntime contrib op, which TensorRT's "
                           "parser does not import: export with --target tensorrt")
            else:
                self.error(f"{node.domain}.{node.op_type}", name, f"domain {node.domain!r} has no importer in "
                           "TensorRT's parser")
            for a in node.attribute:  # If / Loop / Scan bodies are imported too
                subgraphs = [a.g] if a.type == AttributeProto.GRAPH else list(a.graphs)
                for sub in subgraphs:
                    self.graph(sub, types)

    def standard(self, node, name: str, types: dict[str, int]) -> None:
        row = self.support.ops.get(node.op_type)
        if row is None or not row.supported:
            why = "is not in" if row is None else "is marked unsupported in"
            self.error(node.op_type, name, f"{why} TensorRT {self.support.trt_version}'s ONNX operator list")
            return
        values = [(i, "input") for i in node.input if i]
        if node.op_type in _ATTRIBUTE_TYPED:
            values += [(o, "output") for o in node.output if o]
        for value, side in values:
            elem = types.get(value)
            if elem is None:
                continue  # untyped here: the parser infers it; nothing to compare
            trt = TRT_TYPE_NAMES.get(elem)
            if trt not in row.types:
                self.error(node.op_type, name, f"{side} {value!r} is {_type_name(elem)}; TensorRT "
                           f"{self.support.trt_version} supports {node.op_type} on {', '.join(sorted(row.types))}")
        if row.restrictions:
            self.restricted[node.op_type] += 1

    def custom(self, node, name: str, types: dict[str, int], ranks: dict[str, int]) -> None:
        from onnx import helper

        from graphkiln.ops import op_modules, specs
        from graphkiln.plugins_trt.rules import FIXED_INPUT_DTYPES

        op = f"{node.domain}.{node.op_type}"
        spec = specs().get(node.op_type)
        if spec is None:
            self.error(op, name, f"is not a graphkiln op (known: {', '.join(sorted(specs()))}): no TensorRT plugin "
                       "is registered for it")
            return
        if self.imports.get(spec.domain) != spec.version:
            self.error(op, name, f"the model imports domain {spec.domain!r} at version "
                       f"{self.imports.get(spec.domain)}, the plugin is version {spec.version}")
        if (len(node.input), len(node.output)) != (len(spec.inputs), len(spec.outputs)):
            self.error(op, name, f"has {len(node.input)} inputs and {len(node.output)} outputs; the plugin takes "
                       f"{len(spec.inputs)} and returns {len(spec.outputs)}")
        attrs = {a.name: a for a in node.attribute}
        value = {n: helper.get_attribute_value(a) for n, a in attrs.items()}
        for attr, want in zip(_PLUGIN_ATTRS, (spec.plugin_namespace, spec.plugin_version)):
            got = value.get(attr)
            if got != want.encode():
                self.error(op, name, f"{attr} is {show(_text(got))}, the plugin's is {want!r}: the parser would not find "
                           "the plugin")
        if value.get("aot") != 1 or attrs["aot"].type != _ATTR_KINDS["int"]:
            self.error(op, name, f"aot is {show(_text(value.get('aot')))}: set aot=1 (the plugin's ahead-of-time kernel, "
                       "so the engine runs without Python)")
        fields = {a.name: a for a in spec.attributes}
        for attr, a in attrs.items():
            if attr in _PLUGIN_ATTRS or attr == "aot":
                continue
            if attr not in fields:
                self.error(op, name, f"attribute {attr!r} is not a field of the {spec.plugin_id} plugin")
            elif a.type != _ATTR_KINDS[fields[attr].kind]:
                self.error(op, name, f"attribute {attr!r} must be {fields[attr].kind}")
        for f in spec.attributes:
            if f.default is None and f.name not in attrs:
                self.error(op, name, f"attribute {f.name!r} is missing (the plugin has no default for it)")
        in_place = getattr(op_modules()[spec.name], "IN_PLACE_ATTR", None)
        if in_place is not None and value.get(in_place, fields[in_place].default) != 1:
            self.error(op, name, f"{in_place} is {value.get(in_place, fields[in_place].default)}: the plugin writes "
                       f"its state in place, so set {in_place}=1 (export with --target tensorrt)")
        inputs = dict(zip(spec.inputs, node.input))
        for input_name, dtype in FIXED_INPUT_DTYPES.get(spec.name, {}).items():
            elem = types.get(inputs.get(input_name, ""))
            want = _DTYPE_ELEM[dtype]
            if elem is not None and elem != want:
                self.error(op, name, f"input {input_name} ({inputs[input_name]!r}) is {_type_name(elem)}; the plugin "
                           f"takes {_type_name(want)}: cast it to {_type_name(want)}")
        if spec.name == "Attention":
            self.attention(op, name, value.get("rope_layout", fields["rope_layout"].default), inputs, ranks)

    def attention(self, op: str, name: str, layout, inputs: Mapping[str, str], ranks: dict[str, int]) -> None:
        """rope_layout picks how the kernel reads cos/sin: tables [P, D/2] or per token [B, S, D/2]."""
        if layout not in (0, 1):
            self.error(op, name, f"rope_layout is {show(_text(layout))}: the plugin takes 0 (cos/sin tables [P, D/2]) or "
                       "1 (per-token cos/sin [B, S, D/2])")
            return
        for input_name, want, why in (("cos_cache", 2 + layout, f"with rope_layout {layout} "),
                                      ("sin_cache", 2 + layout, f"with rope_layout {layout} "),
                                      ("lookahead", 2, ""), ("sinks", 1, "")):
            rank = ranks.get(inputs.get(input_name, ""))
            if rank is not None and rank != want:
                self.error(op, name, f"input {input_name} ({inputs[input_name]!r}) has rank {rank}; {why}the plugin "
                           f"takes rank {want}")


_DTYPE_ELEM = {"float32": 1, "float16": 10, "bfloat16": 16, "int64": 7, "int32": 6}  # dtype name -> ONNX elem type


def _ranks(graph) -> dict[str, int]:
    """Ranks the graph states: its inputs' and value_info's shapes, initializers' and Constant
    nodes' dims (values of unknown rank are left out: nothing to compare)."""
    ranks = {}
    for v in list(graph.input) + list(graph.value_info) + list(graph.output):
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            ranks[v.name] = len(v.type.tensor_type.shape.dim)
    for t in graph.initializer:
        ranks[t.name] = len(t.dims)
    for n in graph.node:
        if n.op_type == "Constant" and n.domain in _STD_DOMAINS:
            for a in n.attribute:
                if a.name == "value":
                    ranks[n.output[0]] = len(a.t.dims)
    return ranks


@cache
def _gk_domain() -> str:
    from graphkiln.ops import DOMAIN

    return DOMAIN


def _type_name(elem: int) -> str:
    from onnx import TensorProto

    try:
        return TensorProto.DataType.Name(elem)
    except ValueError:
        return str(elem)


def _text(value):
    """An ONNX attribute's value as a message shows it: a string attribute's bytes decoded."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def check_model(model, graph_name: str = "model", support: SupportList | None = None) -> TrtCheckReport:
    """Check one ``onnx.ModelProto`` (weights need not be loaded) against ``support`` (default:
    the vendored list of ``TRT_VERSION``)."""
    support = support or support_list()
    checker = _Checker(model, graph_name, support)
    findings = checker.run()
    return TrtCheckReport(support.trt_version, (support.opset_min, support.opset_max), (graph_name,), checker.nodes,
                          tuple(findings))


def check_artifact(artifact_dir: str | Path, support: SupportList | None = None) -> TrtCheckReport:
    """Check an artifact's TensorRT-target graphs (all of its graphs if it has none, each other
    graph then noted as exported for another target). GraphkilnError when ``artifact_dir`` is
    not an artifact or a graph file is not a readable ONNX model."""
    from graphkiln.manifest import Manifest, open_artifact_file

    root = Path(artifact_dir)
    manifest = Manifest.read(root)
    try:
        import onnx
    except ImportError:
        raise GraphkilnError("graphkiln check needs onnx: install the export extra (pip install "
                             "'graphkiln[export]')") from None
    support = support or support_list()
    graphs = [g for g in manifest.graphs if g.target == "tensorrt"] or list(manifest.graphs)
    findings: list[Finding] = []
    nodes = 0
    for spec in graphs:
        with open_artifact_file(root, spec.file) as f:
            data = f.read()
        try:
            model = onnx.load_model_from_string(data)
        except Exception as exc:  # protobuf's DecodeError and friends: an untrusted file
            raise GraphkilnError(f"graph {spec.file} is not a readable ONNX model ({type(exc).__name__}): "
                                 "re-export the artifact") from None
        if spec.target != "tensorrt":
            findings.append(Finding("warning", spec.file, "", "", f"was exported for target {spec.target}, not "
                                    "tensorrt: export with --target tensorrt"))
        report = check_model(model, spec.file, support)
        findings += report.findings
        nodes += report.nodes_checked
    return TrtCheckReport(support.trt_version, (support.opset_min, support.opset_max), tuple(g.file for g in graphs),
                          nodes, tuple(findings))
