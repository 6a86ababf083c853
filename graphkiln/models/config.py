"""``DecoderConfig``: everything the export-friendly decoder needs, parsed from config.json.

Families translate their Hugging Face ``config.json`` into this one typed shape, so the
torch modules in ``decoder.py`` never read HF config attributes directly.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show

# Activations the export-friendly MLP implements (see decoder._ACTIVATIONS).
SUPPORTED_ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "relu", "relu2")


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
    """One decoder layer: its token mixer, attention window, rope flavor and feed-forward kind.

    Either half may be "none" (Nemotron-H's blocks are one sublayer each: a Mamba, attention, MLP
    or MoE block with its own pre-norm); a layer keeps the norm of each half it has."""

    mixer: str = "attention"  # "attention" | "conv" | "gated_delta" | "mamba" | "none"
    window: int | None = None  # sliding window of an attention layer; None = full attention
    rope: str = "default"  # key into DecoderConfig.ropes
    ffn: str = "mlp"  # "mlp" | "moe" | "none"


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
    # the experts' activation (graphkiln.MoE ``activation``): 0 SwiGLU silu(gate) * up; 1 relu(up)^2,
    # non-gated, gate_up_proj then holds only the up rows (Nemotron-H); 2 gpt-oss's clamped SwiGLU
    # with ``alpha`` and ``limit`` (its swiglu_alpha, swiglu_limit)
    activation: int = 0
    alpha: float = 1.702
    limit: float = 7.0
    # per-expert biases experts.gate_up_proj_bias [E, F] and experts.down_proj_bias [E, H] (gpt-oss);
    # without them the op gets zeros
    expert_biases: bool = False
    router_bias: bool = False  # the router Linear (``gate``) has a bias (gpt-oss)
    # router logits from fp32 hidden states and weights (Nemotron-H keeps gate.weight in fp32)
    router_fp32: bool = False
    # experts (and their biases) work in a latent space of this size: fc1_latent_proj maps the hidden
    # states there and fc2_latent_proj back, the router still reads the hidden states (Nemotron-H
    # moe_latent_size); 0: none
    latent_size: int = 0
    # a shared expert every token goes through beside the routed ones, its output scaled by
    # sigmoid(shared_expert_gate(x)) (Qwen3-Next, Qwen3.5-MoE); 0: none
    shared_expert_size: int = 0
    shared_expert_gate: bool = True  # False: the shared expert's output is added unscaled (Nemotron-H)


@dataclass(frozen=True)
class GatedDeltaConfig:
    """A gated-delta-net layer's sizes (Qwen3.5, Qwen3-Next ``linear_attention`` layers): q/k heads
    of ``head_k_dim``, v heads of ``head_v_dim`` (a multiple of the q/k heads), and the causal conv
    over the concatenated q, k, v of ``conv_kernel`` taps."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class MambaConfig:
    """A Mamba-2 mixer's sizes (Nemotron-H, Granite 4 ``mamba`` layers): ``num_heads`` heads of
    ``head_dim`` channels, ``n_groups`` groups of B/C with ``state_size`` state channels, the causal
    conv over x, B and C of ``conv_kernel`` taps; softplus(dt + dt_bias) clamped to [dt_min, dt_max]
    (graphkiln.SsmScan); the gated output norm over ``n_groups`` groups of channels."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int
    conv_kernel: int
    conv_bias: bool = True
    proj_bias: bool = False
    dt_min: float = 0.0
    dt_max: float = float("inf")

    @property
    def inner_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner_size + 2 * self.n_groups * self.state_size


@dataclass(frozen=True)
class SlotState:
    """One per-slot state a layer's mixer holds (``manifest.StateSpec`` kinds ``conv``/``recurrent``):
    the graph reads the pool ``[slots, *shape]`` at ``slot_idx`` and returns the rows it wrote."""

    kind: str  # "conv" | "recurrent"
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LoraShape:
    """``export --lora-rank``: the adapter stacks the graph takes (``manifest.LoraSpec``): ``modules``
    (checkpoint projection names: q_proj .. down_proj) of every layer that has them, ``max_loras``
    adapter slots plus slot 0 (no adapter), each of rank ``rank``."""

    rank: int
    max_loras: int
    modules: tuple[str, ...]


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
    gated_delta: GatedDeltaConfig | None = None  # the gated_delta layers' sizes
    mamba: MambaConfig | None = None  # the mamba layers' sizes
    # False: the MLP is down(act(up(x))) with no gate (Nemotron-H's relu2 MLP, ``mlp.up_proj``)
    mlp_gated: bool = True
    residual_multiplier: float | None = None  # each sublayer's output times this before the residual add (Granite)
    logits_scaling: float | None = None  # logits divided by this, in the model dtype (Granite)
    # Rotary over the first rotary_dim of each head only (partial_rotary_factor); None: the whole
    # head; 0: no rotary at all (Nemotron-H's attention layers have no position encoding)
    rotary_dim: int | None = None
    # q_proj yields each head's query then as many gate values; the attention output is multiplied
    # by sigmoid(gate) elementwise before o_proj (Qwen3-Next, Qwen3.5)
    attention_output_gate: bool = False
    attention_gate: bool = False  # per-head sigmoid gate on the attention output (LFM3)
    attention_sinks: bool = False  # a learned per-head logit self_attn.sinks joins each softmax, then dropped (gpt-oss)
    sandwich_norm: bool = False  # extra norms after the mixer and the FFN (LFM3, Gemma3)
    # Numerical conventions some families have; each default is the Llama behaviour.
    embed_scale: float | None = None  # token embeddings times this, as an fp32 scalar cast to the model dtype (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # multiplies q.k; None = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    # Checkpoint RMSNorm weights are stored as an offset from this (Gemma keeps w, computes x * (1 + w)):
    # the loader adds it in fp32 before the cast to the model dtype, so the graph holds the plain scale
    # and its norms fuse (onnxruntime's and TensorRT's norm kernels then scale in fp32, as Gemma does).
    norm_weight_offset: float = 0.0
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap) in the model dtype (Gemma2-style)
    # The decoder of a vision-language model: its graph takes vision_embeddings and
    # vision_scatter_indices (see models.decoder), the seam the vision graph's output enters by.
    vision_seam: bool = False
    # M-RoPE (Qwen2-VL family): the graph takes rope_position_ids [3, batch, seq]; the head_dim/2
    # rotary frequencies split into these sections (temporal, height, width), section j rotating by
    # stream j's position. None: rotary positions are the cache positions (position_ids).
    mrope_section: tuple[int, ...] | None = None
    # Gemma3's images: the graph takes lookahead [batch, seq] (graphkiln.Attention), so an image's
    # tokens see the whole image. False: every token is causal (a constant zero lookahead).
    image_lookahead: bool = False
    # export --lora-rank: per-row LoRA adapters on the projections named there (``lora_targets``)
    lora: LoraShape | None = None
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

    @property
    def partial_rotary(self) -> bool:
        """Whether attention rotates less than the whole head (or nothing): the layers then rotate
        their heads themselves and graphkiln.Attention gets identity tables."""
        return self.rotary_dim is not None and self.rotary_dim < self.head_dim

    def layers_of(self, mixer: str) -> tuple[int, ...]:
        return tuple(i for i, l in enumerate(self.layers) if l.mixer == mixer)

    def slot_states(self, layer: int) -> tuple[SlotState, ...]:
        """The per-slot states of ``layer``'s mixer, in the order the graph takes them (none for attention)."""
        mixer = self.layers[layer].mixer
        if mixer == "conv":
            return (SlotState("conv", (self.hidden_size, self.conv_kernel - 1)),)
        if mixer == "gated_delta":
            g = self.gated_delta
            return (SlotState("conv", (g.conv_dim, g.conv_kernel - 1)),
                    SlotState("recurrent", (g.num_v_heads, g.head_k_dim, g.head_v_dim)))
        if mixer == "mamba":  # graphkiln.SsmScan's pool rows: [heads, state_size, head_dim]
            m = self.mamba
            return (SlotState("conv", (m.conv_dim, m.conv_kernel - 1)),
                    SlotState("recurrent", (m.num_heads, m.state_size, m.head_dim)))
        return ()

    def state_arity(self, layer: int) -> int:
        """How many state inputs (and outputs) ``layer`` has in the graph: past key and value for
        attention, its slot states otherwise."""
        return 2 if self.layers[layer].mixer == "attention" else len(self.slot_states(layer))

    def lora_targets(self, layer: int) -> tuple[tuple[str, int, int], ...]:
        """(module, in features, out features) of each projection of ``layer`` that takes LoRA
        stacks, in the graph's order: an attention mixer's q/k/v/o and a dense MLP's gate/up/down,
        as far as ``lora.modules`` names them. MoE FFNs and the recurrent/conv mixers take none."""
        if self.lora is None:
            return ()
        spec, h = self.layers[layer], self.hidden_size
        sizes = {}
        if spec.mixer == "attention":
            q = self.num_heads * self.head_dim * (2 if self.attention_output_gate else 1)
            kv = self.num_kv_heads * self.head_dim
            sizes.update(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(self.num_heads * self.head_dim, h))
        if spec.ffn == "mlp":
            inter = self.intermediate_size
            sizes.update(up_proj=(h, inter), down_proj=(inter, h))
            if self.mlp_gated:
                sizes["gate_proj"] = (h, inter)
        order = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
        return tuple((m, *sizes[m]) for m in order if m in sizes and m in self.lora.modules)

    @property
    def has_slot_states(self) -> bool:
        """Whether any layer keeps per-slot state: the graph then takes seq_lens and slot_idx."""
        return any(self.slot_states(i) for i in range(self.num_layers))


# --- typed reads of config.json values -------------------------------------------------------
# config.json is untrusted input: transformers' own config classes refuse ill-typed values
# (a float or a bool where an int belongs), and a zero or negative size would only fail deep in
# the exporter. Every value the families read goes through these, so one message shape names
# the key, the value as JSON spells it, and what was expected.

REQUIRED = object()  # default meaning "must be present"


def config_error(key: str, value, expected: str, file: str = "config.json") -> GraphkilnError:
    return GraphkilnError(f"{file}: '{key}' is {_json(value)}, expected {expected}: fix {file}")


def _json(value) -> str:
    try:
        text = json.dumps(value, allow_nan=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _missing(raw: dict, key: str, default, architecture: str):
    if default is REQUIRED:
        raise GraphkilnError(
            f"config.json for {architecture or 'this model'} has no '{key}': the "
            "checkpoint's config is incomplete; re-save it with transformers' save_pretrained"
        )
    return default


def _int_ok(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def cfg_int(raw: dict, key: str, default=REQUIRED, *, min: int = 1, architecture: str = "") -> int:
    """``raw[key]`` as an int >= ``min``; absent or null gives ``default`` (unchecked, may be None)."""
    value = raw.get(key)
    if value is None:
        return _missing(raw, key, default, architecture)
    if not _int_ok(value) or value < min:
        raise config_error(key, value, "a positive integer" if min == 1 else f"an integer >= {min}")
    return value


def cfg_float(raw: dict, key: str, default=REQUIRED, *, min: float | None = None, positive: bool = False,
              max: float | None = None, architecture: str = "") -> float:
    """``raw[key]`` as a finite float (ints accepted), > 0 when ``positive``, within [min, max]."""
    value = raw.get(key)
    if value is None:
        return _missing(raw, key, default, architecture)
    ok = (_int_ok(value) or isinstance(value, float)) and math.isfinite(value)
    ok = ok and not (positive and value <= 0) and not (min is not None and value < min) \
        and not (max is not None and value > max)
    if not ok:
        what = "a positive number" if positive else "a finite number"
        if min is not None:
            what += f" >= {min}"
        if max is not None:
            what += f" <= {max}"
        raise config_error(key, value, what)
    return float(value)


def cfg_bool(raw: dict, key: str, default=REQUIRED, *, architecture: str = "") -> bool:
    value = raw.get(key)
    if value is None:
        return _missing(raw, key, default, architecture)
    if not isinstance(value, bool):
        raise config_error(key, value, "true or false")
    return value


def cfg_str(raw: dict, key: str, default=REQUIRED, *, architecture: str = "") -> str:
    value = raw.get(key)
    if value is None:
        return _missing(raw, key, default, architecture)
    if not isinstance(value, str):
        raise config_error(key, value, "a string")
    return value


def cfg_int_list(raw: dict, key: str, *, below: int, min: int = 0) -> tuple[int, ...] | None:
    """A list of ints in [min, below) (layer indices), or None when absent."""
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_int_ok(v) and min <= v < below for v in value):
        raise config_error(key, value, f"a list of integers in [{min}, {below})")
    return tuple(value)


def cfg_layer_types(raw: dict, allowed: tuple[str, ...], num_layers: int) -> list[str] | None:
    """``layer_types``: one known string per layer, or None when absent. An unknown type (say a
    linear-attention layer) must not silently become full attention."""
    value = raw.get("layer_types")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(t, str) and t in allowed for t in value):
        raise config_error("layer_types", value, f"a list of {', '.join(repr(a) for a in allowed)}")
    if len(value) != num_layers:
        raise GraphkilnError(f"config.json: 'layer_types' has {len(value)} entries but 'num_hidden_layers' is "
                             f"{num_layers}: fix config.json")
    return value


def cfg_window(raw: dict) -> int | None:
    """``sliding_window``: None (no window) or a positive int."""
    return cfg_int(raw, "sliding_window", None)


def num_layers(raw: dict, architecture: str) -> int:
    return cfg_int(raw, "num_hidden_layers", architecture=architecture)


def architecture_of(raw: dict) -> str:
    """``architectures[0]``, refusing the shapes that would make it something else (a plain string
    would be read as its first letter)."""
    archs = raw.get("architectures")
    if archs is None or archs == []:
        raise GraphkilnError("config.json has no 'architectures' entry: re-save the checkpoint with save_pretrained")
    if not isinstance(archs, list) or not all(isinstance(a, str) and a for a in archs):
        raise GraphkilnError(f"config.json: 'architectures' is {_json(archs)}, but 'architectures' must be a list "
                             'of strings (e.g. ["LlamaForCausalLM"]): fix config.json')
    return archs[0]


def _rope_config(params, where: str, default_theta) -> RopeConfig:
    if not isinstance(params, dict):
        raise config_error(where, params, "an object")
    params = dict(params)
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", default_theta)
    if not isinstance(params["rope_type"], str):
        raise config_error(f"{where}.rope_type", params["rope_type"], "a string")
    theta = params["rope_theta"]
    if not (_int_ok(theta) or isinstance(theta, float)) or not math.isfinite(theta) or theta <= 0:
        raise config_error(f"{where}.rope_theta" if where else "rope_theta", theta, "a positive number")
    return RopeConfig(theta=float(theta), rope_type=params["rope_type"], parameters=params)


def rope_from_raw(raw: dict, architecture: str) -> RopeConfig:
    """Read rotary parameters from either the 5.x ``rope_parameters`` or older fields."""
    default_theta = raw.get("rope_theta", 10000.0)
    if raw.get("rope_parameters"):
        return _rope_config(raw["rope_parameters"], "rope_parameters", default_theta)
    params = raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise config_error("rope_scaling", params, "an object")
    params = dict(params)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    return _rope_config(params, "rope_scaling" if params else "", default_theta)


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
    """Common parsing for Llama-style configs; families pass what differs.

    Every value is read through the typed ``cfg_*`` readers: a wrong type or an out-of-range size
    is a one-line GraphkilnError naming the key, never a silent ``int()`` of 2.7 or true.
    """
    a = architecture
    hidden = cfg_int(raw, "hidden_size", architecture=a)
    heads = cfg_int(raw, "num_attention_heads", architecture=a)
    layers = num_layers(raw, a)
    attention_bias = cfg_bool(raw, "attention_bias", False)
    head_dim = cfg_int(raw, "head_dim", None)
    if head_dim is None:
        if hidden < heads:
            raise GraphkilnError(f"config.json: 'hidden_size' {hidden} is smaller than 'num_attention_heads' {heads} "
                                 "and there is no 'head_dim': fix config.json")
        head_dim = hidden // heads
    act = cfg_str(raw, "hidden_act", "silu")
    if act not in SUPPORTED_ACTIVATIONS:
        raise GraphkilnError(
            f"hidden_act {show(act)} in config.json is not supported: graphkiln implements "
            f"{', '.join(SUPPORTED_ACTIVATIONS)}"
        )
    eps = cfg_float(raw, "rms_norm_eps", None, min=0)
    if eps is None:
        eps = cfg_float(raw, "norm_eps", 1e-6, min=0)
    fields = dict(
        architecture=architecture,
        vocab_size=cfg_int(raw, "vocab_size", architecture=a),
        hidden_size=hidden,
        intermediate_size=cfg_int(raw, "intermediate_size", architecture=a),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=cfg_int(raw, "num_key_value_heads", heads),
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope=rope_from_raw(raw, architecture),
        max_position_embeddings=cfg_int(raw, "max_position_embeddings", 2048),
        tie_word_embeddings=cfg_bool(raw, "tie_word_embeddings", False),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        o_bias=attention_bias if o_bias is None else o_bias,
        mlp_bias=cfg_bool(raw, "mlp_bias", False) if mlp_bias is None else mlp_bias,
        qk_norm=qk_norm,
        hidden_act=act,
        layer_windows=layer_windows or (None,) * layers,
        raw=raw,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


def windows_from_layer_types(raw: dict) -> tuple[int | None, ...] | None:
    """Per-layer windows for configs that list ``layer_types`` (Qwen2/Qwen3)."""
    n = num_layers(raw, "")
    types = cfg_layer_types(raw, ("full_attention", "sliding_attention"), n)
    window = cfg_window(raw)
    if not cfg_bool(raw, "use_sliding_window", True):
        window = None
    if not types:
        if not window:
            return None
        # Configs written before layer_types existed: transformers slides layers >= max_window_layers.
        first = cfg_int(raw, "max_window_layers", 0, min=0)
        return tuple(window if i >= first else None for i in range(n))
    return tuple(window if t == "sliding_attention" and window else None for t in types)
