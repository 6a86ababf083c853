"""Qwen3MoeForCausalLM: Qwen3 attention + softmax-routed experts (top-k, optional renorm)."""

import re

from graphkiln.models.config import LayerSpec, cfg_bool, cfg_int, cfg_int_list, cfg_window, num_layers, parse_dense, windows_from_layer_types
from graphkiln.models.mixtral import experts_key, moe_config
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import stacked_experts

ARCH = "Qwen3MoeForCausalLM"


def _parse(raw: dict):
    n = num_layers(raw, ARCH)
    # Unlike dense Qwen3, the MoE model slides every layer when use_sliding_window is set.
    window = cfg_window(raw) if cfg_bool(raw, "use_sliding_window", False) else None
    windows = (windows_from_layer_types(raw) or (None,) * n) if raw.get("layer_types") else (window,) * n
    step = cfg_int(raw, "decoder_sparse_step", 1)
    dense_only = set(cfg_int_list(raw, "mlp_only_layers", below=n) or ())
    # Hub configs say num_experts; transformers 5 writes num_local_experts (an attribute_map alias).
    # Zero experts is a dense model.
    experts = cfg_int(raw, experts_key(raw, "num_experts"), 0, min=0)
    layers = tuple(
        LayerSpec(window=windows[i], ffn="moe" if i not in dense_only and experts > 0 and (i + 1) % step == 0 else "mlp")
        for i in range(n))
    moe = moe_config(raw, ARCH, experts_default=experts, top_k_default=1, size_key="moe_intermediate_size",
                     normalize=cfg_bool(raw, "norm_topk_prob", False)) if experts else None
    return parse_dense(raw, ARCH, qk_norm=True, mlp_bias=False, layers=layers, moe=moe)


def stacked_expert_source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
    if m:
        return stacked_experts(m.group(1), cfg.moe.num_experts, "gate_proj", "up_proj", "down_proj")[m.group(2)]
    return name


FAMILY = register(ModelFamily(ARCH, _parse, stacked_expert_source))
