"""Lfm2MoeForCausalLM: LFM2 with sigmoid-routed experts (expert bias) after the first dense layers."""

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import LayerSpec, cfg_bool, cfg_float, cfg_int, num_layers, parse_dense
from graphkiln.models.lfm2 import LFM2_ATTENTION_RENAMES, conv_fields, layer_types, lfm_source
from graphkiln.models.mixtral import moe_config
from graphkiln.models.registry import ModelFamily, register

ARCH = "Lfm2MoeForCausalLM"


def _parse(raw: dict):
    dense = cfg_int(raw, "num_dense_layers", 0, min=0)
    layers = tuple(LayerSpec(mixer="conv" if t == "conv" else "attention", ffn="mlp" if i < dense else "moe")
                   for i, t in enumerate(layer_types(raw, architecture=ARCH)))
    if dense > num_layers(raw, ARCH):
        raise GraphkilnError(f"config.json: 'num_dense_layers' {dense} is more than 'num_hidden_layers': fix config.json")
    moe = moe_config(raw, ARCH, experts_default=None, top_k_default=1, size_key="moe_intermediate_size", scoring=1,
                     normalize=cfg_bool(raw, "norm_topk_prob", True), norm_eps=1e-6,
                     routed_scaling=cfg_float(raw, "routed_scaling_factor", 1.0, positive=True),
                     expert_bias=cfg_bool(raw, "use_expert_bias", True))
    return parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, layers=layers, moe=moe,
                       **conv_fields(raw))


FAMILY = register(ModelFamily(ARCH, _parse, lfm_source(LFM2_ATTENTION_RENAMES)))
