"""Lfm2MoeForCausalLM: LFM2 with sigmoid-routed experts (expert bias) after the first dense layers."""

from graphkiln.models.config import LayerSpec, MoEConfig, parse_dense
from graphkiln.models.lfm2 import LFM2_ATTENTION_RENAMES, layer_types, lfm_source
from graphkiln.models.registry import ModelFamily, register

ARCH = "Lfm2MoeForCausalLM"


def _parse(raw: dict):
    dense = int(raw.get("num_dense_layers", 0))
    layers = tuple(LayerSpec(mixer="conv" if t == "conv" else "attention", ffn="mlp" if i < dense else "moe")
                   for i, t in enumerate(layer_types(raw)))
    moe = MoEConfig(num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 0), top_k=int(raw.get("num_experts_per_tok", 1)),
                    intermediate_size=int(raw.get("moe_intermediate_size", 0)), scoring=1,
                    normalize=bool(raw.get("norm_topk_prob", True)), norm_eps=1e-6,
                    routed_scaling=float(raw.get("routed_scaling_factor", 1.0)),
                    expert_bias=bool(raw.get("use_expert_bias", True)))
    return parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=True, layers=layers, moe=moe,
                       conv_kernel=int(raw.get("conv_L_cache", 3)), conv_bias=bool(raw.get("conv_bias", False)),
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


FAMILY = register(ModelFamily(ARCH, _parse, lfm_source(LFM2_ATTENTION_RENAMES)))
