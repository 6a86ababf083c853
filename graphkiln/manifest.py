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
to the same buffer it feeds as ``past_key``/``past_value``, and takes ``seq_lens``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from graphkiln.errors import GraphkilnError

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``shape`` mixes ints and symbolic dimension names."""

    name: str
    dtype: str  # numpy-style name: "int64", "float32", "float16", "bfloat16"
    shape: tuple[int | str, ...]
    role: str  # "input_ids", "position_ids", "logits_index", "logits", "past_key", ...
    layer: int | None = None


@dataclass(frozen=True)
class GraphSpec:
    name: str
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    opset: int
    target: str = "portable"  # which runtime the graph was lowered for


@dataclass(frozen=True)
class StateSpec:
    """A kind of per-request state and the layers that hold it (see module docstring).

    ``kv``: one cache per attention flavor (full, or each sliding window), fields
    num_kv_heads/head_dim/max_seq_len/sliding_window. ``conv``: per conv layer a pool
    ``[slots, channels, width]`` (width = kernel - 1, the last inputs, oldest first) that the
    graph reads at ``slot_idx`` and whose new rows it returns (``update: "slot_rows"``).
    """

    kind: str  # "kv" | "conv"
    layers: tuple[int, ...]
    num_kv_heads: int
    head_dim: int
    max_seq_len: int
    dtype: str
    layout: str = "batch,kv_heads,seq,head_dim"
    update: str = "scatter_rows"
    sliding_window: int | None = None
    channels: int | None = None
    width: int | None = None


@dataclass(frozen=True)
class CustomOpRef:
    """A custom op a graph uses; the runtime refuses artifacts naming ops it does not know."""

    domain: str
    name: str
    version: int
    plugin_namespace: str
    plugin_version: str


@dataclass(frozen=True)
class ModelInfo:
    architecture: str
    source: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_parameters: int
    dtype: str  # of activations and of the weights that are not quantized
    quant: str | None = None  # weight-only quantization of the Linear layers: "int4" | "int8"
    quant_block_size: int | None = None  # weights per quantization block (along the input features)
    quant_symmetric: bool | None = None  # True: no zero points (the kernel's midpoint); False: per-block zero points


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 128


@dataclass(frozen=True)
class Manifest:
    model: ModelInfo
    graphs: tuple[GraphSpec, ...]
    states: tuple[StateSpec, ...]
    generation: GenerationDefaults
    tokenizer_files: tuple[str, ...]
    tool_versions: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    custom_ops: tuple[CustomOpRef, ...] = ()
    format_version: int = FORMAT_VERSION

    def graph(self, name: str) -> GraphSpec:
        for g in self.graphs:
            if g.name == name:
                return g
        raise GraphkilnError(f"artifact has no graph '{name}' (it has {', '.join(g.name for g in self.graphs)})")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, where: str = "manifest.json") -> "Manifest":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GraphkilnError(f"{where} is not valid JSON ({exc}): re-export the artifact") from None
        version = d.get("format_version") if isinstance(d, dict) else None
        if version != FORMAT_VERSION:
            raise GraphkilnError(
                f"{where} has format_version {version!r}, this graphkiln reads {FORMAT_VERSION}: "
                "re-export the artifact with this graphkiln or install the version that wrote it"
            )
        try:
            return cls(
                model=ModelInfo(**d["model"]),
                graphs=tuple(
                    GraphSpec(
                        **{
                            **g,
                            "inputs": tuple(_tensor(t) for t in g["inputs"]),
                            "outputs": tuple(_tensor(t) for t in g["outputs"]),
                        }
                    )
                    for g in d["graphs"]
                ),
                states=tuple(StateSpec(**{**s, "layers": tuple(s["layers"])}) for s in d["states"]),
                generation=GenerationDefaults(
                    **{**d["generation"], "eos_token_ids": tuple(d["generation"]["eos_token_ids"])}
                ),
                tokenizer_files=tuple(d["tokenizer_files"]),
                tool_versions=dict(d["tool_versions"]),
                files=dict(d["files"]),
                custom_ops=tuple(CustomOpRef(**c) for c in d.get("custom_ops", ())),
                format_version=version,
            )
        except (KeyError, TypeError) as exc:
            raise GraphkilnError(f"{where} is malformed ({type(exc).__name__}: {exc}): re-export the artifact") from None

    @classmethod
    def read(cls, artifact_dir: Path) -> "Manifest":
        path = Path(artifact_dir) / MANIFEST_NAME
        if not path.is_file():
            raise GraphkilnError(f"{artifact_dir} has no {MANIFEST_NAME}: pass a directory written by 'graphkiln export'")
        return cls.from_json(path.read_text(), str(path))


def _tensor(t: dict) -> TensorSpec:
    return TensorSpec(**{**t, "shape": tuple(t["shape"])})
