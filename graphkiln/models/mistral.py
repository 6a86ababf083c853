"""MistralForCausalLM: Llama without bias, every layer windowed when sliding_window is set."""

from graphkiln.models.config import cfg_window, num_layers, parse_dense
from graphkiln.models.registry import ModelFamily, register


def _parse(raw: dict):
    layers = num_layers(raw, "MistralForCausalLM")
    window = cfg_window(raw)
    return parse_dense(raw, "MistralForCausalLM", qkv_bias=False, o_bias=False, mlp_bias=False, layer_windows=(window,) * layers)


FAMILY = register(ModelFamily("MistralForCausalLM", _parse))
