"""``DecoderConfig``: everything the export-friendly decoder needs, parsed from config.json.

Families translate their Hugging Face ``config.json`` into this one typed shape, so the
torch modules in ``decoder.py`` never read HF config attributes directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Activations the export-friendly MLP implements (see decoder._ACTIVATIONS).
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters as HF's ``rope_parameters`` dict holds them."""

    theta: float
    rope_type: str = "default"
    # The full HF rope_parameters dict, kept so scaled variants (llama3, yarn, linear...)
    # can be evaluated by the reference's own init functions at export time.
    parameters: dict = field(default_factory=dict, hash=False, compare=False)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: its token mixer, attention window, rope flavor and feed-forward kind."""

    mixer: str = "attention"  # "attention" | "conv"
    window: int | None = None  # sliding window of an attention layer; None = full attention
    rope: str = "default"  # key into DecoderConfig.ropes
    ffn: str = "mlp"  # "mlp" | "moe"


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts; field meanings follow the graphkiln.MoE custom op's attributes."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: int = 0  # 0 softmax, 1 sigmoid
    normalize: bool = True
    norm_eps: float = 0.0
    routed_scaling: float = 1.0
    expert_bias: bool = False


@dataclass(frozen=True)
class DecoderConfig:
    """A pre-norm decoder whose layers mix attention/short-conv mixers and MLP/MoE FFNs.

    Dense families (Llama, Qwen2/3, Mistral) are all-attention, all-MLP; hybrids (LFM2/3)
    interleave conv layers; MoE families route some or all FFNs through experts.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    hidden_act: str = "silu"
    layer_windows: tuple[int | None, ...] = ()
    layers: tuple[LayerSpec, ...] = ()
    ropes: dict = field(default_factory=dict, hash=False, compare=False)  # flavor -> RopeConfig
    moe: MoEConfig | None = None
    conv_kernel: int = 0
    conv_bias: bool = False
    attention_gate: bool = False  # per-head sigmoid gate on the attention output (LFM3)
    sandwich_norm: bool = False  # extra norms after the mixer and the FFN (LFM3)
    # The raw HF config dict, for rope init functions that want more fields.
    raw: dict = field(default_factory=dict, hash=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.layers:
            windows = self.layer_windows or (None,) * self.num_layers
            object.__setattr__(self, "layers", tuple(LayerSpec(window=w) for w in windows))
        object.__setattr__(self, "layer_windows", tuple(l.window for l in self.layers))
        if not self.ropes:
            object.__setattr__(self, "ropes", {"default": self.rope})
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if len(self.layers) != self.num_layers:
            raise ValueError(f"{len(self.layers)} layer types for {self.num_layers} layers")

    def layers_of(self, mixer: str) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if l.mixer == mixer)


def _require(raw: dict, key: str, architecture: str):
    if key not in raw or raw[key] is None:
        from graphkiln.errors import GraphkilnError

        raise GraphkilnError(
            f"config.json for {architecture} has no '{key}': the checkpoint's config is "
            "incomplete; re-save it with transformers' save_pretrained"
        )
    return raw[key]


def rope_from_raw(raw: dict, architecture: str) -> RopeConfig:
    """Read rotary parameters from either the 5.x ``rope_parameters`` or older fields."""
    params = dict(raw.get("rope_parameters") or {})
    if not params:
        params = dict(raw.get("rope_scaling") or {})
        if "type" in params and "rope_type" not in params:
            params["rope_type"] = params.pop("type")
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return RopeConfig(theta=float(params["rope_theta"]), rope_type=params["rope_type"], parameters=params)


def parse_dense(
    raw: dict,
    architecture: str,
    *,
    qkv_bias: bool | None = None,
    o_bias: bool | None = None,
    qk_norm: bool = False,
    mlp_bias: bool | None = None,
    layer_windows: tuple[int | None, ...] | None = None,
    **overrides,
) -> DecoderConfig:
    """Common parsing for Llama-style configs; families pass what differs."""
    hidden = int(_require(raw, "hidden_size", architecture))
    heads = int(_require(raw, "num_attention_heads", architecture))
    layers = int(_require(raw, "num_hidden_layers", architecture))
    attention_bias = bool(raw.get("attention_bias", False))
    head_dim = raw.get("head_dim") or hidden // heads
    act = str(raw.get("hidden_act", "silu"))
    if act not in SUPPORTED_ACTIVATIONS:
        from graphkiln.errors import GraphkilnError

        raise GraphkilnError(
            f"hidden_act '{act}' in config.json is not supported: graphkiln implements {', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    fields = dict(
        architecture=architecture,
        vocab_size=int(_require(raw, "vocab_size", architecture)),
        hidden_size=hidden,
        intermediate_size=int(_require(raw, "intermediate_size", architecture)),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", raw.get("norm_eps", 1e-6))),
        rope=rope_from_raw(raw, architecture),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)) if mlp_bias is None else mlp_bias,
        qk_norm=qk_norm,
        hidden_act=act,
        layer_windows=layer_windows or (None,) * layers,
        raw=raw,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def windows_from_layer_types(raw: dict) -> tuple[int | None, ...] | None:
    """Per-layer windows for configs that list ``layer_types`` (Qwen2/Qwen3)."""
    types = raw.get("layer_types")
    window = raw.get("sliding_window")
    if "use_sliding_window" in raw and not raw["use_sliding_window"]:
        window = None
    if not types:
        if not window:
            return None
        # Configs written before layer_types existed: transformers slides layers >= max_window_layers.
        first = int(raw.get("max_window_layers", 0))
        return tuple(window if i >= first else None for i in range(int(raw.get("num_hidden_layers", 0))))
    return tuple(window if t == "sliding_attention" and window else None for t in types)
