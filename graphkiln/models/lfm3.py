"""Lfm3ForCausalLM: short conv + full attention + sliding-window attention, each attention
flavor with its own rope; attention output gate; sandwich norms."""

from graphkiln.models.config import LayerSpec, RopeConfig, parse_dense
from graphkiln.models.lfm2 import layer_types, lfm_source
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Alt

ARCH = "Lfm3ForCausalLM"


def _parse(raw: dict):
    types = layer_types(raw)
    window = raw.get("sliding_window")
    params = raw.get("rope_parameters") or {}
    ropes = {t: RopeConfig(theta=float(p.get("rope_theta", 10000.0)), rope_type=p.get("rope_type", "default"), parameters=p)
             for t, p in params.items() if t in types}
    layers = tuple(
        LayerSpec(mixer="conv", rope="") if t == "conv"
        else LayerSpec(window=window if t == "sliding_attention" else None, rope=t)
        for t in types)
    if not ropes:
        from graphkiln.errors import GraphkilnError

        raise GraphkilnError("config.json for Lfm3ForCausalLM has no per-layer-type rope_parameters: re-save it with transformers")
    return parse_dense(raw, ARCH, qkv_bias=bool(raw.get("attention_bias", False)), mlp_bias=False, qk_norm=True,
                       layers=layers, ropes=ropes, rope=next(iter(ropes.values())),
                       conv_kernel=int(raw.get("conv_L_cache", 3)), conv_bias=bool(raw.get("conv_bias", False)),
                       attention_gate=bool(raw.get("use_attention_gate", True)),
                       sandwich_norm=bool(raw.get("use_sandwich_norm", True)),
                       tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))


_lfm_source = lfm_source([])


def _source(name: str, cfg):
    # The attention gate is g_proj in transformers' module but gate_proj in saved checkpoints.
    if name.endswith(".self_attn.g_proj.weight"):
        return Alt((name.replace(".g_proj.", ".gate_proj."), name))
    return _lfm_source(name, cfg)


FAMILY = register(ModelFamily(ARCH, _parse, _source))
