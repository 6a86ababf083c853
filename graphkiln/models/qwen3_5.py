"""Qwen3_5ForCausalLM: gated-delta-net layers (``linear_attention``) with gated full attention every few layers.

The attention layers are Qwen3's with three differences: q_proj also yields a per-element output
gate (``DecoderConfig.attention_output_gate``), rotary covers only ``partial_rotary_factor`` of
each head (``rotary_dim``), and every RMSNorm weight is stored as an offset from 1 (the gated
delta net's own output norm excepted: its weight is plain). Text positions only: the M-RoPE
sections of the vision-language checkpoints collapse to plain rotary when all three streams
carry the token position, as they do for text.
"""

from dataclasses import replace

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import (GatedDeltaConfig, LayerSpec, cfg_float, cfg_int, cfg_layer_types, num_layers,
                                     parse_dense)
from graphkiln.models.registry import ModelFamily, register

ARCH = "Qwen3_5ForCausalLM"


def gated_delta_config(raw: dict, architecture: str) -> GatedDeltaConfig:
    g = GatedDeltaConfig(num_k_heads=cfg_int(raw, "linear_num_key_heads", 16),
                         num_v_heads=cfg_int(raw, "linear_num_value_heads", 32),
                         head_k_dim=cfg_int(raw, "linear_key_head_dim", 128),
                         head_v_dim=cfg_int(raw, "linear_value_head_dim", 128),
                         conv_kernel=cfg_int(raw, "linear_conv_kernel_dim", 4, min=2))
    if g.num_v_heads % g.num_k_heads:
        raise GraphkilnError(f"config.json: 'linear_num_value_heads' {g.num_v_heads} is not a multiple of "
                             f"'linear_num_key_heads' {g.num_k_heads}: fix config.json")
    return g


def hybrid_layers(raw: dict, architecture: str) -> tuple[LayerSpec, ...]:
    """``layer_types`` (linear_attention / full_attention), or transformers' default: every
    ``full_attention_interval``-th layer full attention."""
    n = num_layers(raw, architecture)
    types = cfg_layer_types(raw, ("linear_attention", "full_attention"), n)
    if not types:
        interval = cfg_int(raw, "full_attention_interval", 4)
        types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    return tuple(LayerSpec(mixer="gated_delta" if t == "linear_attention" else "attention") for t in types)


def rotary_dim(raw: dict, head_dim: int, default: float = 0.25) -> int:
    """The rotated dims of each head: ``partial_rotary_factor`` (in rope_parameters or at the top)
    times head_dim, even and at least 2."""
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    source = rope if "partial_rotary_factor" in rope else raw
    factor = cfg_float(source, "partial_rotary_factor", default, positive=True)
    dim = int(head_dim * factor)
    if dim < 2 or dim > head_dim or dim % 2:
        raise GraphkilnError(f"config.json: 'partial_rotary_factor' {factor} gives {dim} rotary dimensions of a "
                             f"{head_dim}-dimension head (needs an even number, 2 to {head_dim}): fix config.json")
    return dim


def _parse(raw: dict):
    cfg = parse_dense(raw, ARCH, qk_norm=True, mlp_bias=False, layers=hybrid_layers(raw, ARCH),
                      gated_delta=gated_delta_config(raw, ARCH), attention_output_gate=True, norm_weight_offset=1.0)
    return replace(cfg, rotary_dim=rotary_dim(raw, cfg.head_dim))


FAMILY = register(ModelFamily(ARCH, _parse))
