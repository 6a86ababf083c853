"""Qwen3ForCausalLM: Llama plus per-head RMSNorm on q and k, optional sliding layers."""

from graphkiln.models.config import parse_dense, windows_from_layer_types
from graphkiln.models.registry import ModelFamily, register


def _parse(raw: dict):
    return parse_dense(raw, "Qwen3ForCausalLM", qk_norm=True, mlp_bias=False, layer_windows=windows_from_layer_types(raw))


FAMILY = register(ModelFamily("Qwen3ForCausalLM", _parse))
