"""Artifact directories on disk: checksums, and what the runtime may open. Publishing one safely is graphkiln.publish."""

from __future__ import annotations

import hashlib
import posixpath
from functools import cache
from pathlib import Path

from graphkiln.batched_int8 import DERIVED_LOCATION
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, Manifest, artifact_file, open_artifact_file, plain_relative_path


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def checksum_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest itself, keyed by relative path."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def is_sha256(text: object) -> bool:
    """Whether text is a sha256 hex digest (either case), as a deployer would paste one."""
    return isinstance(text, str) and len(text) == 64 and all(c in "0123456789abcdefABCDEF" for c in text)


def verify_checksums(root: Path, manifest: Manifest) -> None:
    """Every file the manifest lists is a regular file inside root with its recorded sha256."""
    for rel, expected in manifest.files.items():
        with open_artifact_file(root, rel) as f:
            actual = hashlib.file_digest(f, "sha256").hexdigest()
        if actual != expected:
            raise GraphkilnError(
                f"artifact file {rel} fails its sha256 check (modified or corrupt): re-export or re-copy the artifact"
            )


def check_artifact(root: Path, manifest: Manifest, hash_files: bool = True) -> None:
    """Before the runtime opens anything: every listed file resolves inside root (checked for all
    of them before any is read, so a hostile entry never gets an outside file opened), its sha256
    matches (``hash_files``), and every external data file a graph names is listed too. The
    manifest's validation already ensured each graph and tokenizer file is listed, so every file
    the runtime opens is covered by a checksum, and pinning the manifest pins the artifact."""
    for rel in manifest.files:
        artifact_file(root, rel)
    if hash_files:
        verify_checksums(root, manifest)
    graph_files = [(g.file, None) for g in manifest.graphs] + [(b.file, DERIVED_LOCATION) for b in manifest.batched]
    for file, derived in graph_files:  # a batched graph's int8 weights are computed at load, from no file
        for rel, location in graph_external_data(root, file).items():
            if location == derived:
                continue
            if rel not in manifest.files:
                raise GraphkilnError(f"graph {file} reads external data from {location!r}, which the manifest does not "
                                     "list in files (no checksum covers it): re-export the artifact")


def graph_external_data(root: Path, graph_file: str) -> dict[str, str]:
    """The external data files the ONNX graph ``graph_file`` names, as artifact-relative path ->
    the location string in the graph; read without loading any weights.

    onnx is not a runtime dependency, so the graph is parsed with protobuf (onnxruntime's own
    dependency) against the few messages of onnx.proto that can hold a tensor; every other field
    is skipped as unknown. A location must be a plain relative name: onnxruntime resolves it
    against the graph's directory."""
    from google.protobuf.message import DecodeError

    with open_artifact_file(root, graph_file) as f:
        data = f.read()
    model = _onnx_tensor_holders()["ModelProto"]()
    try:
        model.ParseFromString(data)
    except (DecodeError, RecursionError) as exc:
        raise GraphkilnError(f"graph {graph_file} is not a readable ONNX model ({' '.join(str(exc).split())}): "
                             "re-export the artifact") from None
    locations: set[str] = set()

    def tensor(t) -> None:
        locations.update(e.value for e in t.external_data if e.key == "location")

    def attribute(a) -> None:
        for t in [a.t, *a.tensors, *(x for s in [a.sparse_tensor, *a.sparse_tensors] for x in (s.values, s.indices))]:
            tensor(t)
        for sub in [a.g, *a.graphs]:
            graph(sub)

    def graph(g) -> None:
        for t in [*g.initializer, *(x for s in g.sparse_initializer for x in (s.values, s.indices))]:
            tensor(t)
        for node in g.node:
            for a in node.attribute:
                attribute(a)

    graph(model.graph)
    for info in model.training_info:
        graph(info.initialization)
        graph(info.algorithm)
    for fn in model.functions:
        for a in fn.attribute_proto:
            attribute(a)
        for node in fn.node:
            for a in node.attribute:
                attribute(a)
    base = posixpath.dirname(graph_file)
    out = {}
    for location in sorted(locations):
        rel = posixpath.join(base, location) if base else location
        try:
            plain_relative_path(rel)
        except ValueError as exc:
            raise GraphkilnError(f"graph {graph_file} names external data {location!r}, which {exc}: "
                                 "re-export the artifact") from None
        out[rel] = location
    return out


@cache
def _onnx_tensor_holders() -> dict[str, type]:
    """Message classes for the subset of onnx.proto (same field numbers) that can hold a tensor."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    messages = {
        "StringStringEntryProto": [("key", 1, "string", False), ("value", 2, "string", False)],
        "TensorProto": [("external_data", 13, "StringStringEntryProto", True), ("data_location", 14, "int32", False)],
        "SparseTensorProto": [("values", 1, "TensorProto", False), ("indices", 2, "TensorProto", False)],
        "AttributeProto": [("t", 5, "TensorProto", False), ("g", 6, "GraphProto", False),
                           ("tensors", 10, "TensorProto", True), ("graphs", 11, "GraphProto", True),
                           ("sparse_tensor", 22, "SparseTensorProto", False),
                           ("sparse_tensors", 23, "SparseTensorProto", True)],
        "NodeProto": [("attribute", 5, "AttributeProto", True)],
        "GraphProto": [("node", 1, "NodeProto", True), ("initializer", 5, "TensorProto", True),
                       ("sparse_initializer", 15, "SparseTensorProto", True)],
        "TrainingInfoProto": [("initialization", 1, "GraphProto", False), ("algorithm", 2, "GraphProto", False)],
        "FunctionProto": [("node", 7, "NodeProto", True), ("attribute_proto", 11, "AttributeProto", True)],
        "ModelProto": [("graph", 7, "GraphProto", False), ("training_info", 20, "TrainingInfoProto", True),
                       ("functions", 25, "FunctionProto", True)],
    }
    package = "graphkiln_onnx_subset"
    file = descriptor_pb2.FileDescriptorProto(name=f"{package}.proto", package=package, syntax="proto2")
    for name, fields in messages.items():
        msg = file.message_type.add(name=name)
        for field_name, number, kind, repeated in fields:
            f = msg.field.add(name=field_name, number=number,
                              label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if kind in messages:
                f.type, f.type_name = F.TYPE_MESSAGE, f".{package}.{kind}"
            else:
                f.type = F.TYPE_STRING if kind == "string" else F.TYPE_INT32
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}")) for name in messages}
