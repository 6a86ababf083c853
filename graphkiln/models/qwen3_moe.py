"""Qwen3MoeForCausalLM: Qwen3 attention + softmax-routed experts (top-k, optional renorm)."""

import re

from graphkiln.models.config import LayerSpec, MoEConfig, parse_dense, windows_from_layer_types
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import stacked_experts

ARCH = "Qwen3MoeForCausalLM"


def _parse(raw: dict):
    n = int(raw.get("num_hidden_layers", 0))
    # Unlike dense Qwen3, the MoE model slides every layer when use_sliding_window is set.
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    windows = windows_from_layer_types(raw) if raw.get("layer_types") else (window,) * n
    step, dense_only = int(raw.get("decoder_sparse_step", 1) or 1), set(raw.get("mlp_only_layers") or ())
    # Hub configs say num_experts; transformers 5 writes num_local_experts (an attribute_map alias).
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    layers = tuple(
        LayerSpec(window=windows[i], ffn="moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "mlp")
        for i in range(n))
    moe = MoEConfig(num_experts=experts, top_k=int(raw.get("num_experts_per_tok", 1)),
                    intermediate_size=int(raw.get("moe_intermediate_size", 0)),
                    normalize=bool(raw.get("norm_topk_prob", False))) if experts else None
    return parse_dense(raw, ARCH, qk_norm=True, mlp_bias=False, layers=layers, moe=moe)


def _source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if m:
        return stacked_experts(m.group(1), cfg.moe.num_experts, "gate_proj", "up_proj", "down_proj")[m.group(2)]
    return name


FAMILY = register(ModelFamily(ARCH, _parse, _source))
