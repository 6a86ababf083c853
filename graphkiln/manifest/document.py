"""``Manifest``: the whole artifact description, its lookups (which graph a backend runs, which
engine), and reading it from disk (bounded, hashed as read, format 1 upgraded, validated; any
problem one ``GraphkilnError`` line)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated

from pydantic import Field, TypeAdapter, ValidationError, model_validator, with_config

from graphkiln.errors import GraphkilnError
from graphkiln.manifest.checks import check_cross_references
from graphkiln.manifest.fields import STRICT, RelPath, Sha256, Text
from graphkiln.manifest.paths import open_artifact_file
from graphkiln.manifest.specs import (BatchedGraphSpec, CustomOpRef, EmbeddingSpec, EngineSpec, GenerationDefaults, GraphSpec,
                                      LoraSpec, ModelInfo, StageSpec, StateSpec, VisionSpec, state_update)
from graphkiln.manifest.summary import one_line, summarise
from graphkiln.manifest.vocabulary import (BACKEND_TARGETS, FORMAT_VERSION, MANIFEST_NAME, MAX_MANIFEST_BYTES,
                                           READABLE_VERSIONS)
from graphkiln.untrusted import show_json


@with_config(STRICT)
@dataclass(frozen=True)
class Manifest:
    model: ModelInfo
    graphs: Annotated[tuple[GraphSpec, ...], Field(min_length=1)]
    states: Annotated[tuple[StateSpec, ...], Field(min_length=1)]
    generation: GenerationDefaults
    tokenizer_files: tuple[RelPath, ...]
    tool_versions: dict[Text, Text]
    files: dict[RelPath, Sha256] = field(default_factory=dict)  # relative path -> sha256
    custom_ops: tuple[CustomOpRef, ...] = ()
    engines: tuple[EngineSpec, ...] = ()
    vision: VisionSpec | None = None
    stages: tuple[StageSpec, ...] = ()  # a pipeline-staged artifact: no "decoder" graph, one per stage
    batched: tuple[BatchedGraphSpec, ...] = ()  # int8 stand-ins for steps of many rows (graphkiln.batched_int8)
    lora: LoraSpec | None = None  # adapter stacks as graph inputs (export --lora-rank)
    # an embedding artifact (export --task embed): no logits, its default pooling; absent (None) in
    # every generation artifact, so manifests written before it existed read unchanged
    embedding: EmbeddingSpec | None = None
    format_version: int = FORMAT_VERSION

    def graph(self, name: str, target: str | None = None) -> GraphSpec:
        """Graph ``name`` lowered for ``target``; with no target, the one the CPU runtime prefers
        (``graph_for(name, "onnxruntime")``)."""
        if target is None:
            return self.graph_for(name, "onnxruntime")
        for g in self.graphs:
            if g.name == name and g.target == target:
                return g
        have = ", ".join(f"{g.name} ({g.target})" for g in self.graphs)
        raise GraphkilnError(f"artifact has no graph '{name}' for target {target} (it has {have}): re-export it "
                             f"with --target {target} (several targets: --target onnxruntime,{target})")

    def graph_for(self, name: str, backend: str) -> GraphSpec:
        """The graph ``name`` that ``backend`` runs best: its own target's, else the next in
        ``BACKEND_TARGETS[backend]`` (onnxruntime runs every target's graph, through the custom
        ops' function bodies; TensorRT builds only the tensorrt-target graph)."""
        order = BACKEND_TARGETS[backend]
        found = sorted((g for g in self.graphs if g.name == name and g.target in order),
                       key=lambda g: order.index(g.target))
        if found:
            return found[0]
        have = ", ".join(f"{g.name} ({g.target})" for g in self.graphs)
        raise GraphkilnError(f"artifact has no graph '{name}' that {backend} runs (it has {have}): re-export it "
                             f"with --target {order[0]}")

    def engine_for(self, graph: GraphSpec, backend: str) -> EngineSpec | None:
        for e in self.engines:
            if e.graph == graph.name and e.target == graph.target and e.backend == backend:
                return e
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    def validated(self, where: str = MANIFEST_NAME) -> "Manifest":
        """This manifest if a reader would accept it (export checks what it writes); else GraphkilnError."""
        return Manifest.from_json(self.to_json(), where)

    @model_validator(mode="after")
    def _cross_references(self) -> "Manifest":
        """What the runtime assumes across sections (``manifest.checks``)."""
        check_cross_references(self)
        return self

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST_NAME) -> "Manifest":
        """Parse and validate a manifest; any problem is one GraphkilnError line naming the field."""
        if text[:3] == b"\xef\xbb\xbf" or text[:1] == "\ufeff":  # json.loads would take it, pydantic would not
            raise GraphkilnError(f"{where} starts with a byte-order mark, which JSON does not allow and graphkiln "
                                 "never writes (an editor added it): save it as UTF-8 without BOM, or re-export the "
                                 "artifact")
        try:
            d = json.loads(text)
        except (ValueError, RecursionError) as exc:  # bad JSON, bad UTF-8, nesting too deep
            raise GraphkilnError(f"{where} is not valid JSON ({one_line(str(exc) or type(exc).__name__)}): "
                                 "re-export the artifact") from None
        version = d.get("format_version") if isinstance(d, dict) else None
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise GraphkilnError(
                f"{where} has format_version {show_json(version)}, this graphkiln reads "
                f"{' and '.join(map(str, READABLE_VERSIONS))}: "
                "re-export the artifact with this graphkiln or install the version that wrote it"
            )
        updates = None
        if version == 1:
            text, updates = _from_format_1(d)
        try:
            # strict mode takes JSON arrays for tuples only when validating JSON, so validate the text itself
            manifest = _adapter().validate_json(text)
        except ValidationError as exc:
            raise GraphkilnError(summarise(exc, where)) from None
        for i, (state, update) in enumerate(zip(manifest.states, updates or ())):
            got = state_update(manifest.graphs[0], state)
            if update != got:
                raise GraphkilnError(f"{where}: states[{i}].update is {show_json(update)}, but graph "
                                     f"{manifest.graphs[0].file} updates that state {got}: re-export the artifact")
        return manifest

    @classmethod
    def read(cls, artifact_dir: Path) -> "Manifest":
        return cls.read_with_digest(artifact_dir)[0]

    @classmethod
    def read_with_digest(cls, artifact_dir: Path, expected_digest: str | None = None) -> tuple["Manifest", str]:
        """The artifact's manifest and the sha256 of its bytes (which pins every file, through
        their recorded checksums). The bytes are read once: what is hashed is what is parsed.
        With ``expected_digest``, a manifest with another digest is refused before it is parsed."""
        root = Path(artifact_dir)
        path = root / MANIFEST_NAME
        if not os.path.lexists(path):
            raise GraphkilnError(f"{artifact_dir} has no {MANIFEST_NAME}: pass a directory written by 'graphkiln export'")
        with open_artifact_file(root, MANIFEST_NAME) as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
        if len(data) > MAX_MANIFEST_BYTES:
            raise GraphkilnError(f"{path} is larger than {MAX_MANIFEST_BYTES >> 20} MiB, far more than any manifest "
                                 "graphkiln writes: re-export the artifact")
        digest = hashlib.sha256(data).hexdigest()
        if expected_digest is not None and digest != expected_digest.lower():
            raise GraphkilnError(f"{path} has sha256 {digest}, not the expected {expected_digest.lower()}: "
                                 "the artifact is not the one pinned; restore it or pin the new digest")
        return cls.from_json(data, str(path)), digest


def _from_format_1(d: dict) -> tuple[str, list]:
    """A format-1 manifest as format-2 JSON text, and its states' recorded updates (checked
    against the graph once validated). Format 1 had one graph and ``states[].update``."""
    updates = []
    states = d.get("states")
    if isinstance(states, list):
        for s in states:
            if isinstance(s, dict):
                default = "slot_rows" if s.get("kind") == "conv" else "scatter_rows"
                updates.append(s.pop("update", default))
    if isinstance(d.get("graphs"), list) and len(d["graphs"]) > 1:
        raise GraphkilnError("a format-1 manifest has more than one graph: re-export the artifact")
    d["format_version"] = FORMAT_VERSION
    return json.dumps(d), updates


@cache
def _adapter() -> TypeAdapter:
    return TypeAdapter(Manifest)
