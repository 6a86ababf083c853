"""Lfm3ForCausalLM: short conv + full attention + sliding-window attention, each attention
flavor with its own rope; attention output gate; sandwich norms."""

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import LayerSpec, _rope_config, cfg_bool, cfg_window, config_error, parse_dense
from graphkiln.models.lfm2 import conv_fields, layer_types, lfm_source
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt

ARCH = "Lfm3ForCausalLM"


def _parse(raw: dict):
    types = layer_types(raw, ("conv", "full_attention", "sliding_attention"), ARCH)
    window = cfg_window(raw)
    params = raw.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise config_error("rope_parameters", params, "an object with one entry per attention layer type")
    ropes = {t: _rope_config(p, f"rope_parameters.{t}", 10000.0) for t, p in params.items() if t in types}
    if "sliding_attention" in types and window is None:
        raise GraphkilnError("config.json for Lfm3ForCausalLM has sliding_attention layers but no 'sliding_window': "
                             "fix config.json")
    layers = tuple(
        LayerSpec(mixer="conv", rope="") if t == "conv"
        else LayerSpec(window=window if t == "sliding_attention" else None, rope=t)
        for t in types)
    if not ropes:
        raise GraphkilnError("config.json for Lfm3ForCausalLM has no per-layer-type rope_parameters: re-save it with transformers")
    missing = [t for t in dict.fromkeys(types) if t != "conv" and t not in ropes]
    if missing:
        raise GraphkilnError(f"config.json for Lfm3ForCausalLM has no rope_parameters for '{missing[0]}' layers: "
                             "re-save it with transformers")
    return parse_dense(raw, ARCH, qkv_bias=cfg_bool(raw, "attention_bias", False), mlp_bias=False, qk_norm=True,
                       layers=layers, ropes=ropes, rope=next(iter(ropes.values())),
                       attention_gate=cfg_bool(raw, "use_attention_gate", True),
                       sandwich_norm=cfg_bool(raw, "use_sandwich_norm", True), **conv_fields(raw))


_lfm_source = lfm_source([])


def _source(name: str, cfg):
    # The attention gate is g_proj in transformers' module but gate_proj in saved checkpoints.
    if name.endswith(".self_attn.g_proj.weight"):
        return Alt((name.replace(".g_proj.", ".gate_proj."), name))
    return _lfm_source(name, cfg)


FAMILY = register(ModelFamily(ARCH, _parse, _source))
