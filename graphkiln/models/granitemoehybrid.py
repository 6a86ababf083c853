"""GraniteMoeHybridForCausalLM (Granite 4.0-H): Mamba-2 and attention layers, each with a routed
MoE beside an always-on shared MLP (or the shared MLP alone when ``num_local_experts`` is 0).

Granite's scalings: embeddings times ``embedding_multiplier``, every sublayer's output times
``residual_multiplier`` before its residual add, attention scaled by ``attention_multiplier``
(not head_dim ** -0.5), logits divided by ``logits_scaling``. Attention has rotary positions only
when ``position_embedding_type`` is "rope" (Granite 4.0-H has none). Routing is softmax over the
top-k logits, which is the op's softmax-then-renormalise. Checkpoint tensors:
``block_sparse_moe.router.layer`` (router), ``block_sparse_moe.input_linear`` [E, 2I, H] (gate
rows then up rows) / ``output_linear``, ``shared_mlp.input_linear`` (gate rows then up rows) /
``output_linear``, ``mamba.*`` (the decoder's own names).
"""

from __future__ import annotations

import math
import re

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import (LayerSpec, MambaConfig, cfg_bool, cfg_float, cfg_int, config_error, num_layers,
                                     parse_dense)
from graphkiln.models.mixtral import moe_config
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Rows

ARCH = "GraniteMoeHybridForCausalLM"

_MIXERS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention"}


def _mixers(raw: dict, n: int) -> list[str]:
    types = raw.get("layer_types") or raw.get("layers_block_type")
    if types is None:  # transformers' default: every layer Mamba
        return ["mamba"] * n
    if not isinstance(types, list) or not all(isinstance(t, str) and t in _MIXERS for t in types):
        raise config_error("layer_types", types, f"a list of {', '.join(repr(k) for k in _MIXERS)}")
    if len(types) != n:
        raise GraphkilnError(f"config.json: 'layer_types' has {len(types)} entries but 'num_hidden_layers' is {n}: "
                             "fix config.json")
    return [_MIXERS[t] for t in types]


def _json_float(value):
    """A float as transformers writes one to config.json: a number, or {"__float__": "Infinity"}."""
    if isinstance(value, dict) and set(value) == {"__float__"} and isinstance(value["__float__"], str):
        try:
            return float(value["__float__"])
        except ValueError:
            return None
    return value


def dt_limits(raw: dict) -> tuple[float, float]:
    limit = raw.get("time_step_limit")
    if limit is None:
        return 0.0, math.inf
    values = [_json_float(v) for v in limit] if isinstance(limit, list) else None
    if (values is None or len(values) != 2 or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                      for v in values)
            or math.isnan(values[0]) or math.isnan(values[1]) or not 0 <= values[0] <= values[1]):
        raise config_error("time_step_limit", limit, "[min, max] with 0 <= min <= max")
    return float(values[0]), float(values[1])


def mamba_config(raw: dict, hidden: int) -> MambaConfig:
    heads = cfg_int(raw, "mamba_n_heads", 128)
    inner = cfg_int(raw, "mamba_expand", 2) * hidden
    head_dim = raw.get("mamba_d_head", "auto")
    head_dim = inner // heads if head_dim == "auto" else cfg_int(raw, "mamba_d_head")
    if heads * head_dim != inner:
        raise GraphkilnError(f"config.json: 'mamba_n_heads' {heads} x 'mamba_d_head' {head_dim} is not "
                             f"'mamba_expand' x 'hidden_size' ({inner}): fix config.json")
    low, high = dt_limits(raw)
    m = MambaConfig(num_heads=heads, head_dim=head_dim, state_size=cfg_int(raw, "mamba_d_state", 256),
                    n_groups=cfg_int(raw, "mamba_n_groups", 1), conv_kernel=cfg_int(raw, "mamba_d_conv", 4, min=2),
                    conv_bias=cfg_bool(raw, "mamba_conv_bias", True), proj_bias=cfg_bool(raw, "mamba_proj_bias", False),
                    dt_min=low, dt_max=high)
    if heads % m.n_groups:
        raise GraphkilnError(f"config.json: 'mamba_n_heads' {heads} is not a multiple of 'mamba_n_groups' "
                             f"{m.n_groups}: fix config.json")
    return m


def _multiplier(raw: dict, key: str) -> float | None:
    """A Granite scaling, None when it is 1 (no graph op for a no-op)."""
    value = cfg_float(raw, key, 1.0, positive=True)
    return None if value == 1.0 else value


def _parse(raw: dict):
    n = num_layers(raw, ARCH)
    experts = cfg_int(raw, "num_local_experts", 8, min=0)
    shared = cfg_int(raw, "shared_intermediate_size", 1024)
    # the routed experts beside the shared MLP, which is the MoE's ungated shared expert
    moe = moe_config(raw, ARCH, experts_default=experts, top_k_default=2, size_key="intermediate_size",
                     experts_first="num_local_experts", normalize=True, shared_expert_size=shared,
                     shared_expert_gate=False) if experts else None
    layers = tuple(LayerSpec(mixer=m, ffn="moe" if experts else "mlp") for m in _mixers(raw, n))
    rope = raw.get("position_embedding_type")
    if rope not in (None, "rope", "nope"):
        raise config_error("position_embedding_type", rope, '"rope" or null')
    return parse_dense(raw, ARCH, layers=layers, mlp_bias=False, intermediate_size=shared, moe=moe,
                       mamba=mamba_config(raw, cfg_int(raw, "hidden_size", architecture=ARCH)),
                       rotary_dim=None if rope == "rope" else 0,
                       embed_scale=_multiplier(raw, "embedding_multiplier"),
                       residual_multiplier=_multiplier(raw, "residual_multiplier"),
                       attention_scale=cfg_float(raw, "attention_multiplier", 1.0, positive=True),
                       logits_scaling=_multiplier(raw, "logits_scaling"))


def _source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$", name)
    if m:
        layer, part = m.groups()
        return f"{layer}.block_sparse_moe." + {"gate.weight": "router.layer.weight",
                                               "experts.gate_up_proj": "input_linear.weight",
                                               "experts.down_proj": "output_linear.weight"}[part]
    m = re.match(r"(model\.layers\.\d+)\.mlp\.(?:shared_expert\.)?(gate_proj|up_proj|down_proj)\.weight$", name)
    if m:
        layer, part = m.groups()
        if part == "down_proj":
            return f"{layer}.shared_mlp.output_linear.weight"
        inter = cfg.moe.shared_expert_size if cfg.moe else cfg.intermediate_size
        half = (0, inter) if part == "gate_proj" else (inter, 2 * inter)
        return Rows((f"{layer}.shared_mlp.input_linear.weight",), (half,), 2 * inter)
    return name


FAMILY = register(ModelFamily(ARCH, _parse, _source))
