"""The manifest's records, one dataclass each (tensors, graphs, states, engines, vision, LoRA,
stages), each validating what it holds on its own; what ties sections together is
``manifest.checks``. How a graph updates a state is read off its outputs (``state_update``)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, model_validator, with_config

from graphkiln.imaging import ImagePreprocessing, PlaceholderRule
from graphkiln.manifest.fields import (STRICT, Count, Dim, FieldError, Name, PosInt, RelPath, Role, StateDtype,
                                       TensorDtype, Text, module_path)
from graphkiln.manifest.vocabulary import (ALLOCATED_DIMS, CONV_ROLES, GRAPH_ROLES, KV_ROLES, LORA_MODULES,
                                           LORA_STACK_ROLES, RECURRENT_ROLES, SLOT_STATE_INPUTS, SLOT_STATE_ROLES,
                                           STAGE_GRAPH, STATE_KINDS, Target, graph_roles)


@with_config(STRICT)
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
            raise FieldError(("module",), f"is missing: a {self.role} tensor names its projection" if self.module is None
                              else f"must be null for a {self.role} tensor (got {self.module})")
        if self.role in LORA_STACK_ROLES and (len(self.shape) != 3 or not all(type(d) is int for d in self.shape)):
            raise FieldError(("shape",), f"of a {self.role} tensor must be 3 fixed sizes (got {list(self.shape)})")
        if per_layer and self.layer is None:
            raise FieldError(("layer",), f"is missing: a {self.role} tensor belongs to a layer")
        if not per_layer and self.layer is not None:
            raise FieldError(("layer",), f"must be null for a {self.role} tensor (got {self.layer})")
        if self.role in KV_ROLES and len(self.shape) != 4:
            raise FieldError(("shape",), f"of a {self.role} tensor must have 4 dimensions (got {len(self.shape)})")
        if self.role in CONV_ROLES and len(self.shape) != 3:
            raise FieldError(("shape",), f"of a {self.role} tensor must have 3 dimensions (got {len(self.shape)})")
        if self.role in RECURRENT_ROLES and len(self.shape) != 4:
            raise FieldError(("shape",), f"of a {self.role} tensor must have 4 dimensions (got {len(self.shape)})")
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




@with_config(STRICT)
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
            raise FieldError(("name",), f"{self.name!r} is not a graph this runtime runs ({', '.join(GRAPH_ROLES)})")
        graph_inputs, graph_outputs = graph_roles(self.name)
        for side, tensors, roles in (("inputs", self.inputs, graph_inputs), ("outputs", self.outputs, graph_outputs)):
            names, keys = set(), set()
            for i, t in enumerate(tensors):
                if t.role not in roles:
                    raise FieldError((side, i, "role"), f"{t.role!r} is not a{'n' if self.name[0] in 'aeiou' else ''} "
                                      f"{self.name} graph {side[:-1]} role")
                if t.name in names:
                    raise FieldError((side, i, "name"), f"{t.name!r} appears twice")
                if t.key in keys:
                    raise FieldError((side, i), f"repeats role {t.role} for layer {t.layer}"
                                      + (f" {t.module}" if t.module else ""))
                names.add(t.name)
                keys.add(t.key)
        if self.name == "vision":
            if sum(t.role == "image_embeddings" for t in self.outputs) != 1 or not any(
                    t.role == "pixel_values" for t in self.inputs):
                raise FieldError(("outputs",), "of a vision graph must be one image_embeddings tensor, from pixel_values")
            return self
        if STAGE_GRAPH.fullmatch(self.name):
            if sum(t.role in ("logits", "hidden_states") for t in self.outputs) != 1:
                raise FieldError(("outputs",), "of a stage graph must hold exactly one logits or hidden_states tensor")
            if sum(t.role in ("input_ids", "hidden_states") for t in self.inputs) != 1:
                raise FieldError(("inputs",), "of a stage graph must hold exactly one input_ids or hidden_states tensor")
            for side, tensors in (("inputs", self.inputs), ("outputs", self.outputs)):
                for i, t in enumerate(tensors):
                    if t.role == "hidden_states" and (len(t.shape) != 3 or tuple(t.shape[:2]) != ("batch", "seq")):
                        raise FieldError((side, i, "shape"), f"of hidden_states must be [batch, seq, hidden] "
                                          f"(got {list(t.shape)})")
        elif sum(t.role == "logits" for t in self.outputs) != 1 and not (
                not any(t.role == "logits" for t in self.outputs)
                and sum(t.role == "last_hidden_state" for t in self.outputs) == 1):
            # an embedding artifact's decoder (export --task embed) returns last_hidden_state alone
            raise FieldError(("outputs",), "must hold exactly one logits tensor (or, for an embedding artifact, "
                              "exactly one last_hidden_state and no logits)")
        if sum(t.role in ("vision_embeddings", "vision_scatter_indices") for t in self.inputs) not in (0, 2):
            raise FieldError(("inputs",), "must hold vision_embeddings and vision_scatter_indices together (the seam)")
        inputs = {(t.role, t.layer) for t in self.inputs}
        for i, t in enumerate(self.outputs):
            # a layer's new rows go into (or are written in place over) the state the graph read
            needs = SLOT_STATE_INPUTS.get(t.role, t.role.replace("new_", "past_").replace("present_", "past_"))
            if t.layer is not None and (needs, t.layer) not in inputs:
                raise FieldError(("outputs", i), f"{t.name!r} has no matching {needs} input for layer {t.layer}")
            # the runtime allocates the other outputs by their shape; these it binds to a state buffer
            if t.role not in ("present_key", "present_value") and not is_pool_output(t):
                bad = [d for d in t.shape if isinstance(d, str) and d not in ALLOCATED_DIMS]
                if bad:
                    raise FieldError(("outputs", i, "shape"), f"uses dimension {bad[0]!r}; an output the runtime "
                                      f"allocates may only use {', '.join(ALLOCATED_DIMS)}")
        return self


@with_config(STRICT)
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
            raise FieldError(("layers",), f"lists a layer twice (got {list(self.layers)})")
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
                raise FieldError((name,), f"must be > 0 for a {self.kind} state (got {value})")
        if self.layout != layout:
            raise FieldError(("layout",), f"of a {self.kind} state must be {layout!r} (got {self.layout!r})")
        return self

    def slot_shape(self) -> tuple[int, ...]:
        """One slot's rows of a per-slot state (conv, recurrent)."""
        return (self.channels, self.width) if self.kind == "conv" else tuple(self.dims)




def state_update(graph: GraphSpec, state: StateSpec) -> str | None:
    """How ``graph`` updates ``state`` (see the module docstring), read off its outputs:
    ``in_place`` when it returns the whole cache/pool (``present_*``, a pool-shaped
    ``new_conv_state``), else ``scatter_rows`` (kv) / ``slot_rows`` (conv); None when the graph
    returns nothing for the state's layers. The manifest validator makes it one mode per state."""
    modes = {output_mode(t) for t in graph.outputs if t.layer in state.layers and state_kind(t.role) == state.kind}
    return next(iter(modes)) if len(modes) == 1 else None


def first_output(graph: GraphSpec, state: StateSpec) -> int:
    return next(i for i, t in enumerate(graph.outputs) if t.layer in state.layers and state_kind(t.role) == state.kind)


def output_mode(t: TensorSpec) -> str:
    if t.role in ("present_key", "present_value") or is_pool_output(t):
        return "in_place"
    return "slot_rows" if t.role in SLOT_STATE_ROLES.values() else "scatter_rows"


@with_config(STRICT)
@dataclass(frozen=True)
class CustomOpRef:
    """A custom op a graph uses; the runtime refuses artifacts naming ops it does not know."""

    domain: Name
    name: Name
    version: PosInt
    plugin_namespace: Text
    plugin_version: Text


@with_config(STRICT)
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
                raise FieldError((name,), "must be set exactly when quant is" + (" (quant is null)" if self.quant is None else ""))
        return self


@with_config(STRICT)
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


@with_config(STRICT)
@dataclass(frozen=True)
class ProfileSpec:
    """One TensorRT optimization profile: per dynamic graph input, its min/opt/max shapes."""

    name: Literal["prefill", "decode"]
    shapes: dict[Name, tuple[tuple[Count, ...], tuple[Count, ...], tuple[Count, ...]]]


@with_config(STRICT)
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


@with_config(STRICT)
@dataclass(frozen=True)
class TensorRef:
    """A tensor's bytes inside an artifact file: ``shape`` elements of ``dtype`` from ``offset``."""

    file: RelPath
    offset: Count
    shape: Annotated[tuple[PosInt, ...], Field(min_length=1, max_length=4)]
    dtype: Literal["uint8", "float32", "float16"]


@with_config(STRICT)
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
            raise FieldError(("source",), "must be a uint8 [N, k_blocks, blob] tensor (MatMulNBits' B)")
        n, k_blocks, blob = self.source.shape
        if len(self.smooth.shape) != 1 or self.smooth.dtype != "float32":
            raise FieldError(("smooth",), "must be a float32 [K] tensor")
        k = self.smooth.shape[0]
        if blob * 8 != self.block_size * self.bits or k_blocks != -(-k // self.block_size):
            raise FieldError(("source", "shape"), f"is {list(self.source.shape)}, not MatMulNBits' B for K={k}, "
                              f"{self.bits} bits, block {self.block_size}")
        if self.source_scales.dtype == "uint8" or math.prod(self.source_scales.shape) != n * k_blocks:
            raise FieldError(("source_scales",), f"must be {n * k_blocks} float scales")
        zp = self.source_zero_points
        if zp is not None and (zp.dtype != "uint8" or math.prod(zp.shape) != n * -(-k_blocks * self.bits // 8)):
            raise FieldError(("source_zero_points",), "must be MatMulNBits' packed uint8 zero points")
        return self


@with_config(STRICT)
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


@with_config(STRICT)
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


@with_config(STRICT)
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
    module_paths: dict[Literal[LORA_MODULES], Annotated[str, AfterValidator(module_path)]] = field(  # type: ignore[valid-type]
        default_factory=dict)

    @model_validator(mode="after")
    def _paths_cover_modules(self) -> "LoraSpec":
        missing = [m for m in self.modules if m not in self.module_paths]
        if missing:
            raise FieldError(("module_paths",), f"lacks {missing[0]}, one of modules")
        return self


EMBEDDING_POOLINGS = ("last", "mean")


@with_config(STRICT)
@dataclass(frozen=True)
class EmbeddingSpec:
    """An embedding artifact (``export --task embed``): its decoder graph returns
    ``last_hidden_state`` (the final-norm hidden states at the ``logits_index`` positions) and no
    logits; ``pooling`` is how a text's rows become one vector by default ("last": the last
    token's row, the pooling of decoder embedding models such as Qwen3-Embedding; "mean": the
    average over the text's tokens), ``normalize`` whether it is scaled to unit L2 norm. A request
    may choose otherwise (``runtime.embed``); these are what the checkpoint was trained for."""

    pooling: Literal[EMBEDDING_POOLINGS]  # type: ignore[valid-type]
    normalize: bool


@with_config(STRICT)
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
