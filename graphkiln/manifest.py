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
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import stat
import unicodedata
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Annotated, BinaryIO, Literal

from pydantic import (AfterValidator, ConfigDict, Field, PlainValidator, TypeAdapter, ValidationError,
                      model_validator, with_config)

from graphkiln.errors import GraphkilnError
from graphkiln.imaging import ImagePreprocessing, PlaceholderRule, check_compatible

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # format 1 had states[].update (see the module docstring)
MANIFEST_NAME = "manifest.json"
MAX_MANIFEST_BYTES = 16 << 20  # a 100-layer model's manifest is ~100 KB; refuse to read a huge one into memory

# What the runtime understands; anything else in a manifest is refused (see the validators below).
STATE_KINDS = ("kv", "conv", "recurrent")
KV_ROLES = ("past_key", "past_value", "new_key", "new_value", "present_key", "present_value")
CONV_ROLES = ("conv_state", "new_conv_state")
# a linear-recurrent layer's matrix state (gated delta net, Mamba-2): a pool [slots, heads, rows, cols]
RECURRENT_ROLES = ("recurrent_state", "new_recurrent_state")
# per-slot states (conv, recurrent): the input role -> the output role that updates it
SLOT_STATE_ROLES = {"conv_state": "new_conv_state", "recurrent_state": "new_recurrent_state"}
SLOT_STATE_INPUTS = {out: inp for inp, out in SLOT_STATE_ROLES.items()}  # the other way round
# LoRA (``LoraSpec``): per targeted projection of a layer, the adapter slots' stacks (``module`` names
# the projection), and per row the slot it uses
LORA_STACK_ROLES = ("lora_a", "lora_b")
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INPUT_ROLES = ("hidden_states", "input_ids", "position_ids", "logits_index", "vision_embeddings", "vision_scatter_indices", "seq_lens",
               "slot_idx", "past_key", "past_value", "conv_state", "recurrent_state", "total_sequence_length", "pixel_values",
               "image_grid_thw", "rope_position_ids", "lookahead", "patch_positions", "window_groups", "window_slots",
               "image_groups", "image_slots", "lora_rows", "lora_slots", "lora_a", "lora_b")
OUTPUT_ROLES = ("hidden_states", "logits", "next_token", "last_hidden_state", "new_key", "new_value", "new_conv_state",
                "new_recurrent_state", "present_key", "present_value", "image_embeddings")
# ``last_hidden_state`` (export --return-hidden-states): the last layer's hidden states AFTER the final
# norm (transformers' ``last_hidden_state`` == ``hidden_states[-1]``), [batch, n_logits, hidden] in the
# model dtype, at the logits_index positions; ``hidden_states`` is a pipeline stage's pre-norm residual
# stream, which a later stage takes as its input.
# graph name -> (input roles, output roles) it may have; "vision" is a vision-language model's encoder:
# preprocessed pixels (graphkiln.imaging) -> one embedding row per placeholder token, in decoder hidden size
GRAPH_ROLES = {
    "decoder": (("input_ids", "position_ids", "logits_index", "vision_embeddings", "vision_scatter_indices", "seq_lens",
                 "slot_idx", "past_key", "past_value", "conv_state", "recurrent_state", "total_sequence_length",
                 "rope_position_ids", "lookahead", "lora_rows", "lora_slots", "lora_a", "lora_b"),
                ("logits", "next_token", "last_hidden_state", "new_key", "new_value", "new_conv_state",
                 "new_recurrent_state", "present_key", "present_value")),
    # patch_positions .. image_slots: a windowed tower's patch grid and attention groups (runtime.backends.vision_groups)
    "vision": (("pixel_values", "image_grid_thw", "patch_positions", "window_groups", "window_slots", "image_groups",
                "image_slots"), ("image_embeddings",)),
}
# A pipeline stage's decoder graph (``stages``, export.stages): named stage0, stage1, ...; a decoder
# graph whose first input may be the previous stage's hidden_states and whose output, but for
# the last stage, is hidden_states [batch, seq, hidden] instead of logits.
STAGE_GRAPH = re.compile(r"stage[0-9]{1,4}")


def graph_roles(name: str) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(input roles, output roles) a graph named ``name`` may have; None for a name no runtime runs."""
    if STAGE_GRAPH.fullmatch(name):
        ins, outs = GRAPH_ROLES["decoder"]
        return ("hidden_states",) + ins, ("hidden_states",) + outs
    return GRAPH_ROLES.get(name)


# symbolic dimensions; the runtime sizes the outputs it allocates from the first three
DIM_NAMES = ("batch", "seq", "n_logits", "cache_len", "slots", "vision_rows", "images", "patches", "image_rows",
             "windows", "image_patches", "lora_rows")
_ALLOCATED_DIMS = ("batch", "seq", "n_logits")

_STRICT = ConfigDict(extra="forbid", strict=True)
_DRIVE = re.compile(r"[A-Za-z]:")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SHOULD = re.compile(r"^(Input|String|Tuple|Dictionary|List|Object) should")


class _FieldError(ValueError):
    """Raised by a validator about a field below the object it validates: ``loc`` is relative
    to that object, so the one-line error names the exact field (pydantic reports the object)."""

    def __init__(self, loc: tuple[str | int, ...], problem: str) -> None:
        super().__init__(problem)
        self.loc, self.problem = loc, problem


def _has_control(text: str) -> bool:
    # control, format (bidi overrides, zero-width) and surrogate characters: escapes and spoofing on a terminal
    return any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in text)


def plain_relative_path(path: str) -> str:
    """Return ``path`` if it is a plain relative POSIX name of a file inside a directory (no
    ``..``/``.``/empty component, not absolute, no drive letter, backslash or control
    character); else raise ValueError saying why. Lexical only: see ``artifact_file``."""
    if not path:
        raise ValueError("is empty, not a file name")
    if _has_control(path):
        raise ValueError("contains a control character")
    if "\\" in path:
        raise ValueError("contains a backslash (artifact paths use '/')")
    if path.startswith("/") or _DRIVE.match(path):
        raise ValueError("is an absolute path (artifact paths are relative to the artifact)")
    parts = path.split("/")
    for bad in ("..", ".", ""):
        if bad in parts:
            raise ValueError(f"has a{'n empty' if not bad else ' ' + repr(bad)} component (artifact paths are plain names)")
    return path


def _dim(value: object) -> int | str:
    # strict by hand: a PlainValidator sees the raw JSON value (bool is not an int here)
    if (type(value) is int and value >= 0) or (type(value) is str and value in DIM_NAMES):
        return value
    raise ValueError(f"must be an int >= 0 or one of {', '.join(DIM_NAMES)}")


def _printable(text: str) -> str:
    if _has_control(text):
        raise ValueError("contains a control character")  # inspect prints it: no terminal escapes
    return text


def _sha256(text: str) -> str:
    if not _SHA256.fullmatch(text):
        raise ValueError("must be a sha256 digest: 64 lowercase hex digits")
    return text


def _module_path(text: str) -> str:
    if text.count("{layer}") != 1 or not re.fullmatch(r"[A-Za-z0-9_.]+", text.replace("{layer}", "0")):
        raise ValueError("must be a dotted module path holding {layer} once (e.g. model.layers.{layer}.self_attn.q_proj)")
    return text


PosInt = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
Text = Annotated[str, AfterValidator(_printable)]
Name = Annotated[str, Field(min_length=1), AfterValidator(_printable)]
RelPath = Annotated[str, AfterValidator(plain_relative_path)]
Sha256 = Annotated[str, AfterValidator(_sha256)]
Dim = Annotated[int | str, PlainValidator(_dim)]
TensorDtype = Literal["float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"]
StateDtype = Literal["float32", "float16", "bfloat16"]
Role = Literal[INPUT_ROLES + OUTPUT_ROLES]  # type: ignore[valid-type]


@with_config(_STRICT)
@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``shape`` mixes ints and symbolic dimension names."""

    name: Name
    dtype: TensorDtype  # numpy-style name: "int64", "float32", "float16", "bfloat16"
    shape: tuple[Dim, ...]
    role: Role  # "input_ids", "position_ids", "logits_index", "logits", "past_key", ...
    layer: Count | None = None
    module: Literal[LORA_MODULES] | None = None  # type: ignore[valid-type]  # a LoRA stack's projection

    @property
    def key(self) -> tuple:
        """What identifies the tensor within one side of a graph: (role, layer, module)."""
        return (self.role, self.layer, self.module)

    @model_validator(mode="after")
    def _layer_iff_per_layer_role(self) -> "TensorSpec":
        per_layer = self.role in KV_ROLES + CONV_ROLES + RECURRENT_ROLES + LORA_STACK_ROLES
        if (self.module is None) == (self.role in LORA_STACK_ROLES):
            raise _FieldError(("module",), f"is missing: a {self.role} tensor names its projection" if self.module is None
                              else f"must be null for a {self.role} tensor (got {self.module})")
        if self.role in LORA_STACK_ROLES and (len(self.shape) != 3 or not all(type(d) is int for d in self.shape)):
            raise _FieldError(("shape",), f"of a {self.role} tensor must be 3 fixed sizes (got {list(self.shape)})")
        if per_layer and self.layer is None:
            raise _FieldError(("layer",), f"is missing: a {self.role} tensor belongs to a layer")
        if not per_layer and self.layer is not None:
            raise _FieldError(("layer",), f"must be null for a {self.role} tensor (got {self.layer})")
        if self.role in KV_ROLES and len(self.shape) != 4:
            raise _FieldError(("shape",), f"of a {self.role} tensor must have 4 dimensions (got {len(self.shape)})")
        if self.role in CONV_ROLES and len(self.shape) != 3:
            raise _FieldError(("shape",), f"of a {self.role} tensor must have 3 dimensions (got {len(self.shape)})")
        if self.role in RECURRENT_ROLES and len(self.shape) != 4:
            raise _FieldError(("shape",), f"of a {self.role} tensor must have 4 dimensions (got {len(self.shape)})")
        return self


def is_state(t: TensorSpec) -> bool:
    """A per-layer state tensor (KV, conv, recurrent), as opposed to a LoRA stack (also per layer)."""
    return t.layer is not None and t.role not in LORA_STACK_ROLES


def is_pool_output(t: TensorSpec) -> bool:
    """A per-slot state output (conv, recurrent) that is the whole pool (written in place), not the batch's rows."""
    return t.role in SLOT_STATE_ROLES.values() and bool(t.shape) and t.shape[0] == "slots"


def state_kind(role: str) -> str:
    """The ``StateSpec.kind`` a per-layer tensor role belongs to."""
    return "kv" if role in KV_ROLES else "conv" if role in CONV_ROLES else "recurrent"


TARGETS = ("portable", "onnxruntime", "tensorrt")
Target = Literal[TARGETS]  # type: ignore[valid-type]
# backend -> graph targets it runs, best first (Manifest.graph_for)
BACKEND_TARGETS = {"onnxruntime": ("onnxruntime", "portable", "tensorrt"), "tensorrt": ("tensorrt",)}


@with_config(_STRICT)
@dataclass(frozen=True)
class GraphSpec:
    """One ONNX graph of the artifact, lowered for ``target``; ``(name, target)`` is unique."""

    name: Name
    file: RelPath
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: PosInt
    target: Target = "portable"  # which runtime the graph was lowered for

    @model_validator(mode="after")
    def _io_consistent(self) -> "GraphSpec":
        if graph_roles(self.name) is None:
            raise _FieldError(("name",), f"{self.name!r} is not a graph this runtime runs ({', '.join(GRAPH_ROLES)})")
        graph_inputs, graph_outputs = graph_roles(self.name)
        for side, tensors, roles in (("inputs", self.inputs, graph_inputs), ("outputs", self.outputs, graph_outputs)):
            names, keys = set(), set()
            for i, t in enumerate(tensors):
                if t.role not in roles:
                    raise _FieldError((side, i, "role"), f"{t.role!r} is not a{'n' if self.name[0] in 'aeiou' else ''} "
                                      f"{self.name} graph {side[:-1]} role")
                if t.name in names:
                    raise _FieldError((side, i, "name"), f"{t.name!r} appears twice")
                if t.key in keys:
                    raise _FieldError((side, i), f"repeats role {t.role} for layer {t.layer}"
                                      + (f" {t.module}" if t.module else ""))
                names.add(t.name)
                keys.add(t.key)
        if self.name == "vision":
            if sum(t.role == "image_embeddings" for t in self.outputs) != 1 or not any(
                    t.role == "pixel_values" for t in self.inputs):
                raise _FieldError(("outputs",), "of a vision graph must be one image_embeddings tensor, from pixel_values")
            return self
        if STAGE_GRAPH.fullmatch(self.name):
            if sum(t.role in ("logits", "hidden_states") for t in self.outputs) != 1:
                raise _FieldError(("outputs",), "of a stage graph must hold exactly one logits or hidden_states tensor")
            if sum(t.role in ("input_ids", "hidden_states") for t in self.inputs) != 1:
                raise _FieldError(("inputs",), "of a stage graph must hold exactly one input_ids or hidden_states tensor")
            for side, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
                for i, t in enumerate(tensors):
                    if t.role == "hidden_states" and (len(t.shape) != 3 or tuple(t.shape[:2]) != ("batch", "seq")):
                        raise _FieldError((side, i, "shape"), f"of hidden_states must be [batch, seq, hidden] "
                                          f"(got {list(t.shape)})")
        elif sum(t.role == "logits" for t in self.outputs) != 1:
            raise _FieldError(("outputs",), "must hold exactly one logits tensor")
        if sum(t.role in ("vision_embeddings", "vision_scatter_indices") for t in self.inputs) not in (0, 2):
            raise _FieldError(("inputs",), "must hold vision_embeddings and vision_scatter_indices together (the seam)")
        inputs = {(t.role, t.layer) for t in self.inputs}
        for i, t in enumerate(self.outputs):
            # a layer's new rows go into (or are written in place over) the state the graph read
            needs = SLOT_STATE_INPUTS.get(t.role, t.role.replace("new_", "past_").replace("present_", "past_"))
            if t.layer is not None and (needs, t.layer) not in inputs:
                raise _FieldError(("outputs", i), f"{t.name!r} has no matching {needs} input for layer {t.layer}")
            # the runtime allocates the other outputs by their shape; these it binds to a state buffer
            if t.role not in ("present_key", "present_value") and not is_pool_output(t):
                bad = [d for d in t.shape if isinstance(d, str) and d not in _ALLOCATED_DIMS]
                if bad:
                    raise _FieldError(("outputs", i, "shape"), f"uses dimension {bad[0]!r}; an output the runtime "
                                      f"allocates may only use {', '.join(_ALLOCATED_DIMS)}")
        return self


@with_config(_STRICT)
@dataclass(frozen=True)
class StateSpec:
    """A kind of per-request state and the layers that hold it (see module docstring).

    ``kv``: one cache per attention flavor (full, or each sliding window), fields
    num_kv_heads/head_dim/max_seq_len/sliding_window. ``conv``: per conv layer a pool
    ``[slots, channels, width]`` (width = kernel - 1, the last inputs, oldest first) that the
    graph reads at ``slot_idx``. ``recurrent``: per linear-recurrent layer (gated delta net,
    Mamba-2) a pool ``[slots, *dims]`` = ``[slots, heads, rows, cols]``, the layer's matrix state
    after its last token, read at ``slot_idx`` like conv state (such a layer also holds a conv
    state: the one layer that may be in two states, one of each kind). How a graph updates the
    state is the graph's (``state_update``).
    """

    kind: Literal[STATE_KINDS]  # type: ignore[valid-type]  # "kv" | "conv" | "recurrent"
    layers: Annotated[tuple[Count, ...], Field(min_length=1)]
    num_kv_heads: Count
    head_dim: Count
    max_seq_len: Annotated[int, Field(ge=2)]
    dtype: StateDtype
    layout: Literal["batch,kv_heads,seq,head_dim", "slots,channels,width",
                    "slots,heads,rows,cols"] = "batch,kv_heads,seq,head_dim"
    sliding_window: PosInt | None = None
    channels: PosInt | None = None
    width: PosInt | None = None
    dims: tuple[PosInt, PosInt, PosInt] | None = None  # a recurrent state's (heads, rows, cols)

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "StateSpec":
        if len(set(self.layers)) != len(self.layers):
            raise _FieldError(("layers",), f"lists a layer twice (got {list(self.layers)})")
        if self.kind == "kv":
            required = {"num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}
            layout = "batch,kv_heads,seq,head_dim"
        elif self.kind == "conv":
            required = {"channels": self.channels, "width": self.width}
            layout = "slots,channels,width"
        else:
            required = {"dims": self.dims}
            layout = "slots,heads,rows,cols"
        for name, value in required.items():
            if not value:
                raise _FieldError((name,), f"must be > 0 for a {self.kind} state (got {value})")
        if self.layout != layout:
            raise _FieldError(("layout",), f"of a {self.kind} state must be {layout!r} (got {self.layout!r})")
        return self

    def slot_shape(self) -> tuple[int, ...]:
        """One slot's rows of a per-slot state (conv, recurrent)."""
        return (self.channels, self.width) if self.kind == "conv" else tuple(self.dims)


UPDATES = {"kv": ("scatter_rows", "in_place"), "conv": ("slot_rows", "in_place"), "recurrent": ("slot_rows", "in_place")}


def state_update(graph: GraphSpec, state: StateSpec) -> str | None:
    """How ``graph`` updates ``state`` (see the module docstring), read off its outputs:
    ``in_place`` when it returns the whole cache/pool (``present_*``, a pool-shaped
    ``new_conv_state``), else ``scatter_rows`` (kv) / ``slot_rows`` (conv); None when the graph
    returns nothing for the state's layers. The manifest validator makes it one mode per state."""
    modes = {_output_mode(t) for t in graph.outputs if t.layer in state.layers and state_kind(t.role) == state.kind}
    return next(iter(modes)) if len(modes) == 1 else None


def _first_output(graph: GraphSpec, state: StateSpec) -> int:
    return next(i for i, t in enumerate(graph.outputs) if t.layer in state.layers and state_kind(t.role) == state.kind)


def _output_mode(t: TensorSpec) -> str:
    if t.role in ("present_key", "present_value") or is_pool_output(t):
        return "in_place"
    return "slot_rows" if t.role in SLOT_STATE_ROLES.values() else "scatter_rows"


@with_config(_STRICT)
@dataclass(frozen=True)
class CustomOpRef:
    """A custom op a graph uses; the runtime refuses artifacts naming ops it does not know."""

    domain: Name
    name: Name
    version: PosInt
    plugin_namespace: Text
    plugin_version: Text


@with_config(_STRICT)
@dataclass(frozen=True)
class ModelInfo:
    architecture: Name
    source: Text
    vocab_size: PosInt
    hidden_size: PosInt
    num_layers: PosInt
    num_parameters: Count
    dtype: Literal["fp32", "fp16", "bf16"]  # of activations and of the weights that are not quantized
    quant: Literal["int4", "int8"] | None = None  # weight-only quantization of the Linear layers
    quant_block_size: PosInt | None = None  # weights per quantization block (along the input features)
    quant_symmetric: bool | None = None  # True: no zero points (the kernel's midpoint); False: per-block zero points
    # how the blocks were chosen (export.block_quant: rtn, search, calibrated; "+checkpoint" when some
    # are a GGUF/GPTQ/AWQ checkpoint's own); informational, absent in artifacts from before it existed
    quant_method: Text | None = None

    @model_validator(mode="after")
    def _quant_fields_together(self) -> "ModelInfo":
        for name in ("quant_block_size", "quant_symmetric"):
            if (getattr(self, name) is None) != (self.quant is None):
                raise _FieldError((name,), "must be set exactly when quant is" + (" (quant is null)" if self.quant is None else ""))
        return self


@with_config(_STRICT)
@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[Count, ...] = ()
    bos_token_id: Count | None = None
    pad_token_id: Count | None = None
    do_sample: bool = False
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 1.0
    top_k: Count = 0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    max_new_tokens: Count = 128


@with_config(_STRICT)
@dataclass(frozen=True)
class ProfileSpec:
    """One TensorRT optimization profile: per dynamic graph input, its min/opt/max shapes."""

    name: Literal["prefill", "decode"]
    shapes: dict[Name, tuple[tuple[Count, ...], tuple[Count, ...], tuple[Count, ...]]]


@with_config(_STRICT)
@dataclass(frozen=True)
class EngineSpec:
    """A serialized engine built from graph ``(graph, target)`` by ``graphkiln build``: valid
    only with the TensorRT version and the GPU's compute capability it records; the runtime
    refuses it elsewhere (rebuild). ``profiles[i]`` is the engine's optimization profile i."""

    graph: Name
    target: Target
    file: RelPath
    backend: Literal["tensorrt"]
    profiles: Annotated[tuple[ProfileSpec, ...], Field(min_length=1)]
    max_batch: PosInt
    max_seq_len: Annotated[int, Field(ge=2)]
    tensorrt_version: Name
    gpu_name: Text
    compute_capability: Annotated[str, Field(pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$")]
    timing_cache: RelPath | None = None


@with_config(_STRICT)
@dataclass(frozen=True)
class TensorRef:
    """A tensor's bytes inside an artifact file: ``shape`` elements of ``dtype`` from ``offset``."""

    file: RelPath
    offset: Count
    shape: Annotated[tuple[PosInt, ...], Field(min_length=1, max_length=4)]
    dtype: Literal["uint8", "float32", "float16"]


@with_config(_STRICT)
@dataclass(frozen=True)
class DerivedWeight:
    """One MatMulNBits weight of the block graph, as the batched graph takes it: initializers
    ``weight`` (int8 [K, N]) and ``scales`` (float32 [N]), computed at load from the block
    graph's ``source`` (packed B [N, k_blocks, block * bits / 8]), ``source_scales``,
    ``source_zero_points`` (none: the midpoint) and the smoothing factors ``smooth`` [K]
    (``graphkiln.batched_int8``)."""

    weight: Name
    scales: Name
    source: TensorRef
    source_scales: TensorRef
    source_zero_points: TensorRef | None
    smooth: TensorRef
    bits: Literal[4, 8]
    block_size: PosInt

    @model_validator(mode="after")
    def _shapes_agree(self) -> "DerivedWeight":
        if len(self.source.shape) != 3 or self.source.dtype != "uint8":
            raise _FieldError(("source",), "must be a uint8 [N, k_blocks, blob] tensor (MatMulNBits' B)")
        n, k_blocks, blob = self.source.shape
        if len(self.smooth.shape) != 1 or self.smooth.dtype != "float32":
            raise _FieldError(("smooth",), "must be a float32 [K] tensor")
        k = self.smooth.shape[0]
        if blob * 8 != self.block_size * self.bits or k_blocks != -(-k // self.block_size):
            raise _FieldError(("source", "shape"), f"is {list(self.source.shape)}, not MatMulNBits' B for K={k}, "
                              f"{self.bits} bits, block {self.block_size}")
        if self.source_scales.dtype == "uint8" or math.prod(self.source_scales.shape) != n * k_blocks:
            raise _FieldError(("source_scales",), f"must be {n * k_blocks} float scales")
        zp = self.source_zero_points
        if zp is not None and (zp.dtype != "uint8" or math.prod(zp.shape) != n * -(-k_blocks * self.bits // 8)):
            raise _FieldError(("source_zero_points",), "must be MatMulNBits' packed uint8 zero points")
        return self


@with_config(_STRICT)
@dataclass(frozen=True)
class BatchedGraphSpec:
    """A graph that stands in for graph ``(graph, target)`` in steps of at least ``min_rows`` token
    rows (``graphkiln.batched_int8``): same inputs, outputs and state pools, its MatMulNBits
    replaced by int8 per-channel matmuls whose ``weights`` the runtime derives at load. Used
    only where a deployment turns it on (``Engine.load(batched_int8=True)``)."""

    graph: Name
    target: Target
    file: RelPath
    min_rows: PosInt
    weights: Annotated[tuple[DerivedWeight, ...], Field(min_length=1)]


DEFAULT_MAX_IMAGE_PIXELS = 64 << 20  # images larger than this are refused before they are decoded


@with_config(_STRICT)
@dataclass(frozen=True)
class VisionSpec:
    """How a vision-language artifact turns an image into decoder rows: the runtime decodes it
    (at most ``max_image_pixels``, checked before decoding), preprocesses it as the model's
    processor does (``preprocessing``), runs the ``vision`` graph, and each ``image_token_id``
    the prompt holds expands as ``placeholder`` says (its rows, and around them any prefix and
    suffix tokens: Gemma3), the rows taking the image's embeddings, in order, through the
    decoder's seam. ``positions``: "1d" (placeholders count as ordinary
    positions) or "mrope" (Qwen2.5-VL: the decoder takes ``rope_position_ids``, 3-D rotary
    positions computed from each image's grid; ``runtime.prompt_layout``)."""

    image_token_id: Count
    preprocessing: ImagePreprocessing
    placeholder: PlaceholderRule
    positions: Literal["1d", "mrope"] = "1d"
    max_image_pixels: PosInt = DEFAULT_MAX_IMAGE_PIXELS


@with_config(_STRICT)
@dataclass(frozen=True)
class LoraSpec:
    """An adapter-capable artifact (``export --lora-rank``): its decoder (or stage) graphs take, per
    targeted projection ``modules`` of every layer that has it, an A stack ``lora_a``
    ``[max_loras + 1, in, rank]`` and a B stack ``lora_b`` ``[max_loras + 1, rank, out]``, and
    ``lora_rows`` / ``lora_slots`` (int64 ``[lora_rows]``): the batch rows that use an adapter and
    each one's slot (slots 1..max_loras; slot 0 stays zeros). Row ``r = lora_rows[j]``'s projection
    is ``base(x) + (x @ A[lora_slots[j]]) @ B[lora_slots[j]]``, B pre-scaled (``runtime.lora``);
    the other rows are the base model's, and a step with no adapter row passes zero rows, so its
    adapter ops run on empty tensors. The stacks are float32 whatever the model dtype."""

    rank: PosInt
    max_loras: PosInt
    modules: Annotated[tuple[Literal[LORA_MODULES], ...], Field(min_length=1)]  # type: ignore[valid-type]
    # each adaptable projection's module path in the checkpoint's model, "{layer}" standing for the
    # layer number (how PEFT names its tensors: base_model.model.<path>.lora_A.weight); a superset of
    # ``modules`` (a projection the model has but the export left out is refused by name)
    module_paths: dict[Literal[LORA_MODULES], Annotated[str, AfterValidator(_module_path)]] = field(  # type: ignore[valid-type]
        default_factory=dict)

    @model_validator(mode="after")
    def _paths_cover_modules(self) -> "LoraSpec":
        missing = [m for m in self.modules if m not in self.module_paths]
        if missing:
            raise _FieldError(("module_paths",), f"lacks {missing[0]}, one of modules")
        return self


@with_config(_STRICT)
@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage (export.stages): graph ``graph`` (one per target, by name) runs layers
    ``layers`` = [start, end); ``files`` are the graph and data files only it reads (what a
    process running only this stage needs); ``states`` the manifest's states restricted to its
    layers (the pools it allocates); ``tied_head``: the last stage's own copy of a head tied to
    the embedding (the first stage holds the embedding)."""

    graph: Name
    layers: tuple[Count, Count]
    files: Annotated[tuple[RelPath, ...], Field(min_length=1)]
    states: Annotated[tuple[StateSpec, ...], Field(min_length=1)]
    tied_head: bool = False


@with_config(_STRICT)
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
        """What the runtime assumes across sections: one decoder graph; every graph and tokenizer
        file checksummed; layers in range, each in one state, the graph's state tensors matching it;
        token ids inside the vocabulary."""
        vocab, num_layers = self.model.vocab_size, self.model.num_layers
        keys = [(g.name, g.target) for g in self.graphs]
        for i, (name, target) in enumerate(keys):
            if (name, target) in keys[:i]:
                raise _FieldError(("graphs", i, "name"), f"{name!r} appears twice for target {target}")
        names = [g.name for g in self.graphs]
        if "decoder" not in names and not self.stages:
            raise _FieldError(("graphs",), "has no graph named 'decoder'")
        self._check_stages(names)
        if MANIFEST_NAME in self.files:
            raise _FieldError(("files",), f"lists {MANIFEST_NAME}, which cannot hold its own checksum")
        for i, g in enumerate(self.graphs):
            if g.file not in self.files:
                raise _FieldError(("graphs", i, "file"), f"{g.file!r} is not listed in files (no checksum covers it)")
        for i, f in enumerate(self.tokenizer_files):
            if f not in self.files:
                raise _FieldError(("tokenizer_files", i), f"{f!r} is not listed in files (no checksum covers it)")
            if f in self.tokenizer_files[:i]:
                raise _FieldError(("tokenizer_files", i), f"{f!r} appears twice")
        owner: dict[tuple[int, str], StateSpec] = {}  # (layer, kind) -> its state
        for i, s in enumerate(self.states):
            for j, layer in enumerate(s.layers):
                if layer >= num_layers:
                    raise _FieldError(("states", i, "layers", j), f"is {layer}, not a layer of this {num_layers}-layer model")
                kinds = {k for (held, k) in owner if held == layer} | {s.kind}
                if (layer, s.kind) in owner or (len(kinds) > 1 and kinds != {"conv", "recurrent"}):
                    raise _FieldError(("states", i, "layers", j), f"layer {layer} is in two states")
                owner[layer, s.kind] = s
            if s.dtype != self.states[0].dtype:
                raise _FieldError(("states", i, "dtype"), f"is {s.dtype}, but states[0] is {self.states[0].dtype} "
                                  "(the runtime keeps all state in one dtype)")
        for i, g in enumerate(self.graphs):
            for side in ("inputs", "outputs"):
                for j, t in enumerate(getattr(g, side)):
                    where = ("graphs", i, side, j)
                    if t.role in LORA_STACK_ROLES:
                        self._check_lora_stack(where, t)
                        continue
                    if t.layer is None:
                        if t.role == "logits" and t.shape and isinstance(t.shape[-1], int) and t.shape[-1] != vocab:
                            raise _FieldError(where + ("shape",), f"ends in {t.shape[-1]}, not the vocabulary size {vocab}")
                        if t.role == "last_hidden_state":
                            hidden = self.model.hidden_size
                            if tuple(t.shape) != ("batch", "n_logits", hidden):
                                raise _FieldError(where + ("shape",), f"is {list(t.shape)}, not ['batch', 'n_logits', "
                                                  f"{hidden}] (the logits positions' final-norm hidden states)")
                            if g.target == "tensorrt":  # its runners bind every output to a buffer they know
                                raise _FieldError(where, "last_hidden_state is not supported on a tensorrt-target graph")
                        continue
                    kind = state_kind(t.role)
                    s = owner.get((t.layer, kind))
                    if s is None or s.kind != kind:
                        raise _FieldError(where + ("layer",), f"{t.layer} has no {kind} state (see states[].layers)")
                    if side == "outputs" and _output_mode(t) != _output_mode(g.outputs[_first_output(g, s)]):
                        first = g.outputs[_first_output(g, s)]
                        raise _FieldError(where, f"{t.name!r} is updated {_output_mode(t)} but {first.name!r} of the "
                                          f"same {kind} state {_output_mode(first)}: a graph updates a state one way")
                    want = (s.num_kv_heads, s.head_dim) if kind == "kv" else s.slot_shape()
                    got = (t.shape[1], t.shape[3]) if kind == "kv" else tuple(t.shape[1:])
                    if any(isinstance(x, int) and x != y for x, y in zip(got, want)):
                        fields = {"kv": "num_kv_heads, head_dim", "conv": "channels, width", "recurrent": "dims"}[kind]
                        raise _FieldError(where + ("shape",), f"{list(t.shape)} does not match its {kind} state "
                                          f"({fields} {list(want)})")
        for i, e in enumerate(self.engines):
            if (e.graph, e.target) not in keys:
                raise _FieldError(("engines", i, "graph"), f"{e.graph!r} ({e.target}) is not a graph of this artifact")
            if e.target != "tensorrt":
                raise _FieldError(("engines", i, "target"), f"is {e.target}: TensorRT engines are built from the "
                                  "tensorrt-target graph")
            for loc, rel in ((("file",), e.file), (("timing_cache",), e.timing_cache)):
                if rel is not None and rel not in self.files:
                    raise _FieldError(("engines", i) + loc, f"{rel!r} is not listed in files (no checksum covers it)")
            if e.max_seq_len > min(s.max_seq_len for s in self.states):
                raise _FieldError(("engines", i, "max_seq_len"), f"is {e.max_seq_len}, longer than the states' "
                                  f"max_seq_len {min(s.max_seq_len for s in self.states)}")
            inputs = {t.name for t in self.graphs[keys.index((e.graph, e.target))].inputs}
            for j, p in enumerate(e.profiles):
                for name, shapes in p.shapes.items():
                    if name not in inputs:
                        raise _FieldError(("engines", i, "profiles", j, "shapes"), f"names {name!r}, not an input "
                                          f"of graph {e.graph!r}")
                    if len({len(x) for x in shapes}) != 1 or any(a > b for lo, hi in zip(shapes, shapes[1:])
                                                                 for a, b in zip(lo, hi)):
                        raise _FieldError(("engines", i, "profiles", j, "shapes", name),
                                          f"{[list(x) for x in shapes]} is not min <= opt <= max of one rank")
            if (e.graph, e.target, e.backend) in [(o.graph, o.target, o.backend) for o in self.engines[:i]]:
                raise _FieldError(("engines", i), f"repeats the {e.backend} engine of graph {e.graph!r}")
        for i, b in enumerate(self.batched):
            if (b.graph, b.target) not in keys:
                raise _FieldError(("batched", i, "graph"), f"{b.graph!r} ({b.target}) is not a graph of this artifact")
            if b.file not in self.files:
                raise _FieldError(("batched", i, "file"), f"{b.file!r} is not listed in files (no checksum covers it)")
            for j, d in enumerate(b.weights):
                for field_name in ("source", "source_scales", "source_zero_points", "smooth"):
                    ref = getattr(d, field_name)
                    if ref is not None and ref.file not in self.files:
                        raise _FieldError(("batched", i, "weights", j, field_name, "file"),
                                          f"{ref.file!r} is not listed in files (no checksum covers it)")
        has_vision_graph = "vision" in names
        # the seam is the first graph's: the decoder's, or a staged artifact's first stage's
        first = "stage0" if self.stages else "decoder"
        seams = [g for g in self.graphs if any(t.role == "vision_embeddings" for t in g.inputs)]
        if any(g.name != first for g in seams):
            raise _FieldError(("graphs",), f"graph {next(g.name for g in seams if g.name != first)!r} takes "
                              f"vision_embeddings, which only the {first} graph may take")
        if self.vision is not None:
            if not has_vision_graph:
                raise _FieldError(("vision",), "is set but the artifact has no graph named 'vision'")
            if len(seams) != names.count(first):
                raise _FieldError(("vision",), f"is set but a {first} graph lacks the vision_embeddings seam")
            if self.stages:  # the process running the first stage runs the vision graph too
                for g in self.graphs:
                    if g.name == "vision" and g.file not in self.stages[0].files:
                        raise _FieldError(("stages", 0, "files"), f"does not list the vision graph file {g.file!r} "
                                          "(the vision graph belongs to the first stage)")
            if self.vision.image_token_id >= vocab:
                raise _FieldError(("vision", "image_token_id"), f"is {self.vision.image_token_id}, outside the "
                                  f"vocabulary [0, {vocab})")
            rule = self.vision.placeholder
            for name in ("row_token_id", "prefix_ids", "suffix_ids"):
                ids = getattr(rule, name, None)
                bad = [t for t in (ids if isinstance(ids, tuple) else (ids,)) if t is not None and not 0 <= t < vocab]
                if bad:
                    raise _FieldError(("vision", "placeholder", name), f"holds token id {bad[0]}, outside the "
                                      f"vocabulary [0, {vocab})")
            try:
                check_compatible(self.vision.preprocessing, self.vision.placeholder)
            except ValueError as exc:
                raise _FieldError(("vision", "placeholder"), str(exc)) from None
            hidden = self.model.hidden_size
            for i, g in enumerate(self.graphs):
                for j, t in enumerate(g.outputs if g.name == "vision" else g.inputs):
                    if t.role in ("image_embeddings", "vision_embeddings") and t.shape[-1] != hidden:
                        raise _FieldError(("graphs", i, "outputs" if g.name == "vision" else "inputs", j, "shape"),
                                          f"ends in {t.shape[-1]}, not the model's hidden size {hidden}")
        elif has_vision_graph or seams:
            raise _FieldError(("vision",), "is missing: the artifact has a vision graph or seam but no vision spec")
        self._check_lora_graphs()
        gen = self.generation
        for loc, token in [(("eos_token_ids", i), t) for i, t in enumerate(gen.eos_token_ids)] + [
                (("bos_token_id",), gen.bos_token_id), (("pad_token_id",), gen.pad_token_id)]:
            if token is not None and token >= vocab:
                raise _FieldError(("generation",) + loc, f"is {token}, outside the vocabulary [0, {vocab})")
        return self

    def _check_lora_stack(self, where: tuple, t: TensorSpec) -> None:
        """A LoRA stack input matches the manifest's ``lora`` record: [slots, in, rank] / [slots, rank, out]."""
        if self.lora is None:
            raise _FieldError(where, f"{t.name!r} is a LoRA input, but the manifest has no lora record")
        if t.module not in self.lora.modules:
            raise _FieldError(where + ("module",), f"is {t.module}, not one of lora.modules {list(self.lora.modules)}")
        if t.layer >= self.model.num_layers:
            raise _FieldError(where + ("layer",), f"is {t.layer}, not a layer of this {self.model.num_layers}-layer model")
        slots, rows, cols = t.shape
        rank_at = 2 if t.role == "lora_a" else 1
        if slots != self.lora.max_loras + 1 or t.shape[rank_at] != self.lora.rank or t.dtype != "float32":
            raise _FieldError(where + ("shape",), f"is {t.dtype} {list(t.shape)}; a {t.role} stack is float32 with {self.lora.max_loras + 1} slots and rank "
                              f"{self.lora.rank} (lora.max_loras + 1, lora.rank)")

    def _check_stages(self, names: list[str]) -> None:
        """A staged artifact (``stages``): stage k is graph ``stage{k}``, the stages cover the
        layers in order, each graph reads and writes only its own layers' state, takes
        input_ids (first) or hidden_states (later) and returns logits (last) or hidden_states,
        and each stage's states are the manifest's states restricted to its layers."""
        stage_graphs = sorted({n for n in names if STAGE_GRAPH.fullmatch(n)})
        if not self.stages:
            if stage_graphs:
                raise _FieldError(("stages",), f"is empty but the artifact has stage graph {stage_graphs[0]!r}")
            return
        if "decoder" in names:
            raise _FieldError(("graphs",), "holds a 'decoder' graph beside pipeline stages: a staged artifact has "
                              "one graph per stage")
        if len(stage_graphs) != len(self.stages):
            raise _FieldError(("stages",), f"lists {len(self.stages)} stages but the artifact has "
                              f"{len(stage_graphs)} stage graphs")
        last = len(self.stages) - 1
        expected = 0
        for i, st in enumerate(self.stages):
            where = ("stages", i)
            if st.graph != f"stage{i}" or st.graph not in names:
                raise _FieldError(where + ("graph",), f"is {st.graph!r}, not the artifact's graph 'stage{i}'")
            start, end = st.layers
            if start != expected or end <= start:
                raise _FieldError(where + ("layers",), f"is {[start, end]}: stages must cover the layers in order, "
                                  f"without gaps or overlaps (this one must start at {expected})")
            expected = end
            if st.tied_head and i != last:
                raise _FieldError(where + ("tied_head",), "is set on a stage that is not the last (the head's copy "
                                  "belongs to the last stage)")
            for j, f in enumerate(st.files):
                if f not in self.files:
                    raise _FieldError(where + ("files", j), f"{f!r} is not listed in files (no checksum covers it)")
            held: set[tuple[int, str]] = set()
            for j, s in enumerate(st.states):
                for k, layer in enumerate(s.layers):
                    owner = next((g for g in self.states if layer in g.layers and g.kind == s.kind), None)
                    if not start <= layer < end or owner is None:
                        raise _FieldError(where + ("states", j, "layers", k), f"is {layer}, not a stateful layer of "
                                          f"this stage ({start}:{end})")
                    if asdict(owner) | {"layers": None} != asdict(s) | {"layers": None}:
                        raise _FieldError(where + ("states", j), f"differs from the manifest state holding layer {layer}")
                    if (layer, s.kind) in held:
                        raise _FieldError(where + ("states", j, "layers", k), f"layer {layer} is in two states")
                    held.add((layer, s.kind))
            owned = {(layer, g.kind) for g in self.states for layer in g.layers if start <= layer < end}
            if held != owned:
                raise _FieldError(where + ("states",), f"misses the {min(owned - held)[1]} state of layer "
                                  f"{min(owned - held)[0]}")
            for g in self.graphs:
                if g.name != st.graph:
                    continue
                if g.file not in st.files:
                    raise _FieldError(where + ("files",), f"does not list the stage's graph file {g.file!r}")
                roles_in = {t.role for t in g.inputs}
                roles_out = {t.role for t in g.outputs}
                want_in, want_out = ("input_ids" if i == 0 else "hidden_states"), ("logits" if i == last else "hidden_states")
                if want_in not in roles_in or want_out not in roles_out:
                    raise _FieldError(where + ("graph",), f"graph {g.file} must take {want_in} and return {want_out} "
                                      f"as stage {i} of {last + 1}")
                for t in g.inputs + g.outputs:
                    if t.layer is not None and not start <= t.layer < end:
                        raise _FieldError(where + ("graph",), f"graph {g.file} has {t.name!r}, a tensor of layer "
                                          f"{t.layer} outside the stage's layers {start}:{end}")
        if expected != self.model.num_layers:
            raise _FieldError(("stages",), f"cover layers 0:{expected}, not the model's {self.model.num_layers} layers")

    def _check_lora_graphs(self) -> None:
        """Each decoder or stage graph of an adapter-capable artifact that takes LoRA stacks takes
        lora_rows and lora_slots and, per stack, its partner; an artifact without a lora record has
        none of them."""
        for i, g in enumerate(self.graphs):
            stacks = {(t.layer, t.module, t.role) for t in g.inputs if t.role in LORA_STACK_ROLES}
            routing = {t.role for t in g.inputs if t.role in ("lora_rows", "lora_slots")}
            if self.lora is None:
                if routing:
                    raise _FieldError(("graphs", i, "inputs"), f"takes {min(routing)}, but the manifest has no lora record")
                continue
            if stacks and routing != {"lora_rows", "lora_slots"}:
                raise _FieldError(("graphs", i, "inputs"), "takes LoRA stacks but not both lora_rows and lora_slots")
            for layer, module, role in sorted(stacks):
                other = "lora_b" if role == "lora_a" else "lora_a"
                if (layer, module, other) not in stacks:
                    raise _FieldError(("graphs", i, "inputs"), f"has the {role} stack of layer {layer} {module} "
                                      f"but not its {other}")

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
            raise GraphkilnError(f"{where} is not valid JSON ({_one_line(str(exc) or type(exc).__name__)}): "
                                 "re-export the artifact") from None
        version = d.get("format_version") if isinstance(d, dict) else None
        if type(version) is not int or version not in READABLE_VERSIONS:
            raise GraphkilnError(
                f"{where} has format_version {_show(version)}, this graphkiln reads "
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
            raise GraphkilnError(_summarise(exc, where)) from None
        for i, (state, update) in enumerate(zip(manifest.states, updates or ())):
            got = state_update(manifest.graphs[0], state)
            if update != got:
                raise GraphkilnError(f"{where}: states[{i}].update is {_show(update)}, but graph "
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


def artifact_file(root: Path, rel: str) -> Path:
    """The real path of artifact member ``rel``; GraphkilnError when ``rel`` is not a plain
    relative name or (through a symlink in any component) resolves outside ``root``.

    Only the link chain is examined (readlink/lstat): nothing outside is opened."""
    try:
        plain_relative_path(rel)
    except ValueError as exc:
        raise GraphkilnError(f"artifact path {_show(rel)} {exc}: re-export the artifact") from None
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise GraphkilnError(f"artifact file {rel} resolves outside the artifact through a symlink (to {real}): "
                             "copy the file into the artifact instead of linking it")
    return Path(real)


def open_artifact_file(root: Path, rel: str) -> BinaryIO:
    """Open artifact member ``rel`` for reading: only a regular file inside the artifact (a FIFO
    or device is refused before it is read, so it cannot block or stream forever)."""
    path = artifact_file(root, rel)
    # the resolved path has no symlinks: O_NOFOLLOW refuses one swapped in since it was resolved
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise GraphkilnError(f"artifact file {rel} is missing: re-export or re-copy the artifact") from None
    except OSError as exc:
        raise GraphkilnError(f"cannot read artifact file {rel} ({exc.strerror}): re-export or re-copy the artifact") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GraphkilnError(f"artifact file {rel} is not a regular file: re-export or re-copy the artifact")
    return os.fdopen(fd, "rb")


def _show(value: object, limit: int = 60) -> str:
    """A JSON value as it appeared in the manifest, on one line and short."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _field_path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if part == "[key]":
            out += " key"
        elif isinstance(part, int):
            out += f"[{part}]"
        elif i == 1 and loc[0] in ("files", "tool_versions"):
            out += f"[{_show(part)}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "the manifest"


def _summarise(exc: ValidationError, where: str) -> str:
    """pydantic's multi-line report as one line: the first problem, and how many more there are."""
    errors = exc.errors(include_url=False)
    # pydantic also reports a tuple whose bad items were dropped as too short: not a problem of its own
    locs = [tuple(e["loc"]) for e in errors]
    errors = [e for e, loc in zip(errors, locs) if not (
        e["type"] == "too_short" and any(len(other) > len(loc) and other[: len(loc)] == loc for other in locs))]
    e = errors[0]
    if e["type"] == "json_invalid":  # the whole text, not a field
        return f"{where} is not valid JSON ({_one_line(e['msg'])}): re-export the artifact"
    loc, problem = tuple(e["loc"]), e["msg"]
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldError):
        loc, problem = loc + cause.loc, cause.problem
    elif e["type"] == "unexpected_keyword_argument":
        problem = "is not a manifest field"
    elif e["type"] in ("missing_argument", "missing"):
        problem = "is missing"
    else:
        problem = _SHOULD.sub("must", problem.removeprefix("Value error, "))
        problem = f"{problem[:1].lower()}{problem[1:]} (got {_show(e.get('input'))})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}: {_field_path(loc)} {_one_line(problem)}{more}: re-export the artifact"
