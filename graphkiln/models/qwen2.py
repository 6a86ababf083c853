"""Qwen2ForCausalLM: Llama plus q/k/v bias (never o_proj), optional sliding layers."""

from graphkiln.models.config import parse_dense, windows_from_layer_types
from graphkiln.models.registry import ModelFamily, register


def _parse(raw: dict):
    return parse_dense(
        raw, "Qwen2ForCausalLM", qkv_bias=True, o_bias=False, mlp_bias=False, layer_windows=windows_from_layer_types(raw)
    )


FAMILY = register(ModelFamily("Qwen2ForCausalLM", _parse))
