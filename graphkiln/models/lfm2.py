"""Lfm2ForCausalLM: gated short-convolution layers interleaved with full attention.

Also holds what LFM2-MoE and LFM3 share: layer-type parsing and the LFM weight names.
"""

import re

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import LayerSpec, cfg_bool, cfg_float, cfg_int, cfg_int_list, cfg_layer_types, num_layers, parse_dense
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt, renamer, stacked_experts

ARCH = "Lfm2ForCausalLM"

# canonical name -> LFM checkpoint name
LFM_RENAMES = [
    (r"\.input_layernorm\.", ".operator_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.post_mixer_norm\.", ".post_operator_norm."),
    (r"\.mlp\.gate_proj\.", ".feed_forward.w1."),
    (r"\.mlp\.up_proj\.", ".feed_forward.w3."),
    (r"\.mlp\.down_proj\.", ".feed_forward.w2."),
    (r"\.mlp\.", ".feed_forward."),
    (r"^model\.norm\.", "model.embedding_norm."),
]
LFM2_ATTENTION_RENAMES = [
    (r"\.self_attn\.o_proj\.", ".self_attn.out_proj."),
    (r"\.self_attn\.q_norm\.", ".self_attn.q_layernorm."),
    (r"\.self_attn\.k_norm\.", ".self_attn.k_layernorm."),
]


def layer_types(raw: dict, allowed: tuple[str, ...] = ("conv", "full_attention"), architecture: str = ARCH) -> list[str]:
    n = num_layers(raw, architecture)
    types = cfg_layer_types(raw, allowed, n)
    if not types:
        full = cfg_int_list(raw, "full_attn_idxs", below=n)
        full = set(range(n)) if full is None else set(full)
        types = ["full_attention" if i in full else "conv" for i in range(n)]
    return list(types)


def conv_fields(raw: dict) -> dict:
    """The short-conv settings every LFM shares (the kernel needs a state of width >= 1)."""
    return dict(conv_kernel=cfg_int(raw, "conv_L_cache", 3, min=2), conv_bias=cfg_bool(raw, "conv_bias", False),
                tie_word_embeddings=cfg_bool(raw, "tie_word_embeddings", True))


def lfm2_intermediate(raw: dict) -> int:
    size = cfg_int(raw, "intermediate_size", architecture=ARCH)
    if cfg_bool(raw, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = cfg_float(raw, "block_ffn_dim_multiplier", None, positive=True)
        if multiplier is not None:
            size = int(multiplier * size)
            multiple = cfg_int(raw, "block_multiple_of", 256)
            size = multiple * ((size + multiple - 1) // multiple)
    if size < 1:
        raise GraphkilnError(f"config.json: the feed-forward size works out to {size}: fix 'intermediate_size' "
                             "or 'block_ffn_dim_multiplier' in config.json")
    return size


def _parse(raw: dict):
    layers = tuple(LayerSpec(mixer="conv" if t == "conv" else "attention") for t in layer_types(raw))
    return parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, layers=layers,
                       intermediate_size=lfm2_intermediate(raw), **conv_fields(raw))


def lfm_source(extra_rules):
    rename = renamer(extra_rules + LFM_RENAMES)

    def source(name: str, cfg):
        m = re.match(r"(model\.layers\.\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m:
            return stacked_experts(f"{m.group(1)}.feed_forward.experts", cfg.moe.num_experts, "w1", "w3", "w2")[m.group(2)]
        if name == "lm_head.weight":
            return Alt(("lm_head.weight", "model.embed_tokens.weight"))
        return rename(name)

    return source


FAMILY = register(ModelFamily(ARCH, _parse, lfm_source(LFM2_ATTENTION_RENAMES)))
