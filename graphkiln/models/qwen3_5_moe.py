"""Qwen3_5MoeForCausalLM: Qwen3.5's gated-delta-net / gated-attention layers with a routed MoE in every layer.

Each MoE is softmax top-k routing, renormalised (always, in transformers' router), over fused
expert tensors (saved per expert, ``mlp.experts.{e}.gate_proj``..., as transformers writes them,
stacked on load), plus a shared expert scaled by ``sigmoid(mlp.shared_expert_gate(x))``.
"""

from dataclasses import replace

from graphkiln.models.config import LayerSpec, cfg_int, parse_dense
from graphkiln.models.mixtral import moe_config
from graphkiln.models.qwen3_5 import gated_delta_config, hybrid_layers, rotary_dim
from graphkiln.models.qwen3_moe import stacked_expert_source
from graphkiln.models.registry import ModelFamily, register

ARCH = "Qwen3_5MoeForCausalLM"


def _parse(raw: dict):
    layers = tuple(LayerSpec(mixer=l.mixer, ffn="moe") for l in hybrid_layers(raw, ARCH))
    moe = moe_config(raw, ARCH, experts_default=None, top_k_default=8, size_key="moe_intermediate_size",
                     normalize=True, shared_expert_size=cfg_int(raw, "shared_expert_intermediate_size", architecture=ARCH))
    # no dense MLP anywhere: the dense size parse_dense requires is the experts' (unused)
    dense = {**raw, "intermediate_size": moe.intermediate_size}
    cfg = parse_dense(dense, ARCH, qk_norm=True, mlp_bias=False, layers=layers, moe=moe,
                      gated_delta=gated_delta_config(raw, ARCH), attention_output_gate=True, norm_weight_offset=1.0)
    return replace(cfg, rotary_dim=rotary_dim(raw, cfg.head_dim), raw=raw)


FAMILY = register(ModelFamily(ARCH, _parse, stacked_expert_source))
