"""MixtralForCausalLM: Llama/Mistral attention + softmax top-k experts, always renormalised."""

import re

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import REQUIRED, LayerSpec, MoEConfig, cfg_int, cfg_window, num_layers, parse_dense
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt, stacked_experts

ARCH = "MixtralForCausalLM"


def experts_key(raw: dict, first: str) -> str:
    """Which of num_experts / num_local_experts (aliases: hub configs say one, transformers 5 writes
    the other) a family reads: ``first`` when present."""
    other = "num_experts" if first == "num_local_experts" else "num_local_experts"
    return first if raw.get(first) is not None else other


def moe_config(raw: dict, architecture: str, *, experts_default: int | None, top_k_default: int, size_key: str,
               experts_first: str = "num_experts", **fields) -> MoEConfig:
    """Routed-expert settings, shared by the MoE families: a positive expert count,
    1 <= top_k <= experts, a positive expert size."""
    key = experts_key(raw, experts_first)
    experts = cfg_int(raw, key, REQUIRED if experts_default is None else experts_default, architecture=architecture)
    top_k = cfg_int(raw, "num_experts_per_tok", top_k_default)
    if top_k > experts:
        raise GraphkilnError(f"config.json: 'num_experts_per_tok' {top_k} is more than the {experts} experts "
                             f"('{key}'): fix config.json")
    return MoEConfig(num_experts=experts, top_k=top_k, intermediate_size=cfg_int(raw, size_key, architecture=architecture),
                     **fields)


def _parse(raw: dict):
    n = num_layers(raw, ARCH)
    window = cfg_window(raw)
    moe = moe_config(raw, ARCH, experts_default=8, top_k_default=2, size_key="intermediate_size",
                     experts_first="num_local_experts", normalize=True)
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
