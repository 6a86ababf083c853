"""MixtralForCausalLM: Llama/Mistral attention + softmax top-k experts, always renormalised."""

import re

from graphkiln.models.config import LayerSpec, MoEConfig, parse_dense
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt, stacked_experts

ARCH = "MixtralForCausalLM"


def _parse(raw: dict):
    n = int(raw.get("num_hidden_layers", 0))
    window = raw.get("sliding_window")
    moe = MoEConfig(num_experts=int(raw.get("num_local_experts") or raw.get("num_experts") or 8), top_k=int(raw.get("num_experts_per_tok", 2)),
                    intermediate_size=int(raw.get("intermediate_size", 0)), normalize=True)
    return parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, mlp_bias=False,
                       layers=tuple(LayerSpec(window=window, ffn="moe") for _ in range(n)), moe=moe)


def _source(name: str, cfg):
    # Hub checkpoints keep the original block_sparse_moe per-expert layout; transformers 5
    # in-memory models use fused mlp.experts tensors. Accept either.
    m = re.match(r"model\.layers\.(\d+)\.mlp\.(gate\.weight|experts\.gate_up_proj|experts\.down_proj)$", name)
    if not m:
        return name
    layer, part = m.groups()
    if part == "gate.weight":
        return Alt((name, f"model.layers.{layer}.block_sparse_moe.gate.weight"))
    key = part.split(".")[1]
    legacy = stacked_experts(f"model.layers.{layer}.block_sparse_moe.experts", cfg.moe.num_experts, "w1", "w3", "w2")[key]
    fused = stacked_experts(f"model.layers.{layer}.mlp.experts", cfg.moe.num_experts, "gate_proj", "up_proj", "down_proj")[key]
    return Alt(fused.options + legacy.options)


FAMILY = register(ModelFamily(ARCH, _parse, _source))
