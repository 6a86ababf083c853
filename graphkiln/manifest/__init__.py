"""The artifact manifest: a versioned JSON description of everything in an artifact.

Written by ``graphkiln.export``, read by ``graphkiln.runtime``; this module imports neither
torch nor onnx. ``FORMAT_VERSION`` changes whenever a reader of an older version could
misread a newer manifest; readers refuse versions they do not know.

State layout. Each ``StateSpec`` is one kind of per-request state the runtime owns. For the
KV cache (kind ``"kv"``) the graph reads ``past_key.{layer}``/``past_value.{layer}`` of shape
``[batch, kv_heads, cache_len, head_dim]`` and returns only the rows it computed
(``new_key.{layer}``/``new_value.{layer}``, ``[batch, kv_heads, seq, head_dim]``); the
runtime stores those rows at cache position == token position (``update: "scatter_rows"``).
Because the graph never returns a whole new cache, the runtime can keep one buffer at a
fixed address for a session's life, which is what in-place plugins, slot pools and
CUDA-graph replay need. A graph that writes the rows itself (the onnxruntime target's
GroupQueryAttention) declares ``update: "in_place"``: it returns ``present_key.{layer}`` /
``present_value.{layer}`` ``[batch, kv_heads, cache_len, head_dim]``, which the runtime binds
to the same buffer it feeds as ``past_key``/``past_value``, and takes ``seq_lens``. A conv
state (kind ``"conv"``, a pool ``[slots, channels, width]`` read at ``slot_idx``) is returned
as the new rows (``new_conv_state.{layer}`` ``[batch, channels, width]``, stored by the runtime
at ``slot_idx``: ``update: "slot_rows"``) or, by a graph that writes the rows itself (the
tensorrt target's plugins), as the whole pool ``[slots, channels, width]`` bound to the
``conv_state`` buffer (``update: "in_place"``).

The update contract belongs to a graph, not to the state: it is read off the graph's outputs
(``state_update``), so one artifact can carry several targets' graphs (``graphs[].target``;
a graph is named by ``(name, target)``) over the same states and the same weights file, and
each runtime picks the graph for its backend (``Manifest.graph_for``). Format 1 recorded the
update in ``states[].update``; a format-1 manifest is still read (that field is checked
against the graph, then dropped).

Engines. ``graphkiln build`` adds one ``EngineSpec`` per graph it built (a TensorRT plan file
inside the artifact, its optimization profiles and what it was built on); the files are
checksummed like every other.

Untrusted input. A manifest read from disk is validated against the dataclasses below with
pydantic (strict types, no unknown keys, the value ranges and cross-references the runtime
relies on) before anything uses it; a failure is one ``GraphkilnError`` line naming the
field. Every path it names is a plain relative POSIX name (``plain_relative_path``), and
files are opened only through ``artifact_file``/``open_artifact_file``, which refuse a
symlink that leads outside the artifact. Dataclasses built in Python (by export) are not
validated on construction; ``Manifest.validated`` checks one.

One job a module: ``vocabulary`` (versions, roles, graph and dimension names, targets),
``fields`` (field types and validators), ``specs`` (the records, each valid on its own),
``checks`` (what the sections must agree on), ``document`` (``Manifest``: lookups, reading),
``paths`` (opening the files it names), ``summary`` (a validation failure as one line). Import
from ``graphkiln.manifest``: the names below are the public ones.
"""

from graphkiln.manifest.document import Manifest
from graphkiln.manifest.fields import plain_relative_path
from graphkiln.manifest.paths import artifact_file, open_artifact_file
from graphkiln.manifest.specs import (DEFAULT_MAX_IMAGE_PIXELS, EMBEDDING_POOLINGS, BatchedGraphSpec, CustomOpRef,
                                      DerivedWeight, EmbeddingSpec,
                                      EngineSpec, GenerationDefaults, GraphSpec, LoraSpec, ModelInfo, ProfileSpec,
                                      StageSpec, StateSpec, TensorRef, TensorSpec, VisionSpec, is_pool_output,
                                      is_state, state_kind, state_update)
from graphkiln.manifest.vocabulary import (BACKEND_TARGETS, CONV_ROLES, DIM_NAMES, FORMAT_VERSION, GRAPH_ROLES,
                                           INPUT_ROLES, KV_ROLES, LORA_MODULES, LORA_STACK_ROLES, MANIFEST_NAME,
                                           MAX_MANIFEST_BYTES, OUTPUT_ROLES, READABLE_VERSIONS, RECURRENT_ROLES,
                                           SLOT_STATE_INPUTS, SLOT_STATE_ROLES, STAGE_GRAPH, STATE_KINDS, TARGETS,
                                           UPDATES, graph_roles)

__all__ = [
    "BACKEND_TARGETS", "CONV_ROLES", "DEFAULT_MAX_IMAGE_PIXELS", "DIM_NAMES", "FORMAT_VERSION", "GRAPH_ROLES",
    "INPUT_ROLES", "KV_ROLES", "LORA_MODULES", "LORA_STACK_ROLES", "MANIFEST_NAME", "MAX_MANIFEST_BYTES",
    "OUTPUT_ROLES", "READABLE_VERSIONS", "RECURRENT_ROLES", "SLOT_STATE_INPUTS", "SLOT_STATE_ROLES", "STAGE_GRAPH",
    "STATE_KINDS", "TARGETS", "UPDATES", "BatchedGraphSpec", "CustomOpRef", "DerivedWeight", "EMBEDDING_POOLINGS",
    "EmbeddingSpec", "EngineSpec",
    "GenerationDefaults", "GraphSpec", "LoraSpec", "Manifest", "ModelInfo", "ProfileSpec", "StageSpec", "StateSpec",
    "TensorRef", "TensorSpec", "VisionSpec", "artifact_file", "graph_roles", "is_pool_output", "is_state",
    "open_artifact_file", "plain_relative_path", "state_kind", "state_update",
]
