"""``CustomOpSpec``: the identity of a custom op, shared by every target (no torch, no onnx)."""

from __future__ import annotations

import json
from dataclasses import dataclass

DOMAIN = "graphkiln"


@dataclass(frozen=True)
class AttrSpec:
    """An op attribute. ``kind`` is "int", "float" or "string" (TensorRT: int32, float32, char).
    ``default`` None: every caller passes it; else callers may leave it out (a node without it
    means the default), so adding such an attribute keeps older callers and artifacts valid."""

    name: str
    kind: str
    doc: str = ""
    default: int | float | str | None = None


@dataclass(frozen=True)
class CustomOpSpec:
    name: str  # ONNX op_type and TensorRT plugin name
    torch_name: str  # torch.library name inside the graphkiln namespace
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: tuple[AttrSpec, ...]
    output_dtypes_from: tuple[str, ...]  # per output, the input whose dtype it has
    doc: str
    domain: str = DOMAIN
    version: int = 1
    plugin_namespace: str = DOMAIN
    plugin_version: str = "1"

    @property
    def plugin_id(self) -> str:
        """What ``tensorrt.plugin.register`` takes: "namespace::name"."""
        return f"{self.plugin_namespace}::{self.name}"

    @property
    def torch_qualname(self) -> str:
        return f"{DOMAIN}::{self.torch_name}"

    def torch_schema(self) -> str:
        kinds = {"int": "int", "float": "float", "string": "str"}
        args = [f"Tensor {n}" for n in self.inputs] + [
            f"{kinds[a.kind]} {a.name}" + ("" if a.default is None else f"={json.dumps(a.default)}") for a in self.attributes]
        outs = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return f"({', '.join(args)}) -> {outs}"
