"""NemotronHForCausalLM: Mamba-2, attention, MLP and MoE blocks in a pattern, one sublayer each.

Each checkpoint block is one of ``linear_attention`` (Mamba-2; pattern letter ``M``),
``full_attention`` (``*``: grouped-query attention with no position encoding at all), ``mlp``
(``-``: a non-gated relu2 MLP) or ``moe`` (``E``), behind its own pre-norm; it becomes one decoder
layer whose other half is "none" (``LayerSpec``), so layer indices are the checkpoint's. The block
list is ``layers_block_type`` (transformers 5), or ``hybrid_override_pattern`` as Hub configs write
it. Checkpoint tensors live under ``backbone.`` (``embeddings``, ``layers.i.norm``,
``layers.i.mixer.*``, ``norm_f``).
"""

from __future__ import annotations

import re

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import (LayerSpec, MambaConfig, MoEConfig, cfg_bool, cfg_float, cfg_int, cfg_str,
                                     config_error, parse_dense)
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt, Stack, renamer

ARCH = "NemotronHForCausalLM"

_BLOCKS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention", "attention": "attention",
           "mlp": "mlp", "moe": "moe"}
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def block_types(raw: dict) -> list[str]:
    """Each block's kind (a key of _BLOCKS), from ``layers_block_type`` or the pattern string."""
    types = raw.get("layers_block_type") or raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not types or not all(isinstance(t, str) and t in _BLOCKS for t in types):
            raise config_error("layers_block_type", types, f"a list of {', '.join(repr(k) for k in _BLOCKS)}")
        return types
    pattern = raw.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(_PATTERN):
        raise config_error("hybrid_override_pattern", pattern, "a string of M, *, - and E (one letter per block)")
    return [_PATTERN[c] for c in pattern]


def _get(raw: dict, key: str, legacy: str):
    """``key``, or its pre-5.x name (``mamba_n_groups`` for ``n_groups``...) as Hub configs spell it."""
    return key if raw.get(key) is not None or raw.get(legacy) is None else legacy


def mamba_config(raw: dict) -> MambaConfig:
    act = cfg_str(raw, "mamba_hidden_act", "silu")
    if act != "silu":
        raise GraphkilnError(f"config.json: 'mamba_hidden_act' is '{act}'; graphkiln's Mamba-2 layers implement "
                             "silu only: fix config.json")
    m = MambaConfig(num_heads=cfg_int(raw, "mamba_num_heads", architecture=ARCH),
                    head_dim=cfg_int(raw, "mamba_head_dim", architecture=ARCH),
                    state_size=cfg_int(raw, "ssm_state_size", architecture=ARCH),
                    n_groups=cfg_int(raw, _get(raw, "n_groups", "mamba_n_groups"), 8),
                    conv_kernel=cfg_int(raw, _get(raw, "conv_kernel", "mamba_d_conv"), 4, min=2),
                    conv_bias=cfg_bool(raw, _get(raw, "use_conv_bias", "mamba_conv_bias"), True),
                    proj_bias=cfg_bool(raw, "use_bias", False),
                    # transformers' NemotronH mixer clamps dt to (time_step_min, inf) whatever
                    # time_step_limit says (graphkiln.ops.ssm_scan, "dt limits")
                    dt_min=cfg_float(raw, _get(raw, "time_step_min", "mamba_dt_min"), 0.001, min=0))
    if m.num_heads % m.n_groups:
        raise GraphkilnError(f"config.json: 'mamba_num_heads' {m.num_heads} is not a multiple of 'n_groups' "
                             f"{m.n_groups}: fix config.json")
    return m


def _parse(raw: dict):
    types = block_types(raw)
    layers = tuple(LayerSpec(mixer={"mamba": "mamba", "attention": "attention"}.get(_BLOCKS[t], "none"),
                             ffn=_BLOCKS[t] if _BLOCKS[t] in ("mlp", "moe") else "none") for t in types)
    # num_hidden_layers is derived from the block list (transformers ignores a stale one)
    raw = {**raw, "num_hidden_layers": len(types)}
    eps = cfg_float(raw, "layer_norm_epsilon", 1e-5, min=0)
    return parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, layers=layers, mamba=mamba_config(raw),
                       moe=moe_config(raw) if "moe" in types else None, hidden_act=_mlp_act(raw), mlp_gated=False,
                       rms_norm_eps=eps, rotary_dim=0, max_position_embeddings=cfg_int(raw, "max_position_embeddings", 4096))


def moe_config(raw: dict) -> MoEConfig:
    """The ``moe`` blocks: sigmoid scores, e_score_correction_bias for selection only, top-k renormalised
    (eps 1e-20) when norm_topk_prob, times routed_scaling_factor; non-gated experts with the MLP's
    activation (relu2), an ungated shared expert beside them, a router in fp32. Group-limited routing
    (n_group > 1 choosing topk_group groups) is not in graphkiln.MoE: refused unless every group is chosen."""
    groups, chosen = cfg_int(raw, "n_group", 1), cfg_int(raw, "topk_group", 1)
    if chosen < groups:
        raise GraphkilnError(f"config.json: 'topk_group' {chosen} of 'n_group' {groups}: group-limited expert "
                             "routing is not supported (graphkiln routes over all experts)")
    experts = cfg_int(raw, "n_routed_experts", 8)
    top_k = cfg_int(raw, "num_experts_per_tok", 2)
    if top_k > experts:
        raise GraphkilnError(f"config.json: 'num_experts_per_tok' {top_k} is more than the {experts} experts "
                             "('n_routed_experts'): fix config.json")
    if _mlp_act(raw) != "relu2":
        raise GraphkilnError(f"config.json: NemotronH experts with 'mlp_hidden_act' '{_mlp_act(raw)}': graphkiln's "
                             "non-gated experts implement relu2 only")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=cfg_int(raw, "moe_intermediate_size", 7688),
                     scoring=1, expert_bias=True, normalize=cfg_bool(raw, "norm_topk_prob", True), norm_eps=1e-20,
                     routed_scaling=cfg_float(raw, "routed_scaling_factor", 1.0, positive=True), activation=1,
                     router_fp32=True, latent_size=cfg_int(raw, "moe_latent_size", 0, min=0),
                     shared_expert_size=cfg_int(raw, "moe_shared_expert_intermediate_size", 7688, min=0),
                     shared_expert_gate=False)


def _mlp_act(raw: dict) -> str:
    act = cfg_str(raw, "mlp_hidden_act", "relu2")
    if act not in ("relu2", "relu", "silu", "gelu"):
        raise GraphkilnError(f"config.json: 'mlp_hidden_act' is '{act}': graphkiln's NemotronH MLP implements relu2, "
                             "relu, silu and gelu: fix config.json")
    return act


_rename = renamer([
    (r"^model\.embed_tokens\.", "backbone.embeddings."),
    (r"^model\.norm\.", "backbone.norm_f."),
    (r"^model\.layers\.(\d+)\.(?:input_layernorm|post_attention_layernorm)\.", r"backbone.layers.\1.norm."),
    (r"^model\.layers\.(\d+)\.(?:self_attn|mamba|mlp)\.", r"backbone.layers.\1.mixer."),
    (r"\.mixer\.expert_bias$", ".mixer.gate.e_score_correction_bias"),
    (r"\.mixer\.shared_expert\.", ".mixer.shared_experts."),
])


def _source(name: str, cfg):
    name = _rename(name)
    m = re.match(r"(backbone\.layers\.\d+\.mixer\.experts)\.(gate_up_proj|down_proj)$", name)
    if not m:
        return name
    prefix, part = m.groups()
    stored = "up_proj" if part == "gate_up_proj" else "down_proj"  # non-gated: our gate_up rows are the up rows
    return Alt((f"{prefix}.{stored}",
                Stack(tuple(f"{prefix}.{e}.{stored}.weight" for e in range(cfg.moe.num_experts)))))


FAMILY = register(ModelFamily(ARCH, _parse, _source))
