"""Gemma3ForCausalLM: sliding and full attention layers (each with its own rope), sandwich norms,
q/k norm, scaled embeddings, RMSNorm as x * (1 + w), query_pre_attn_scalar, GELU-tanh MLP.

Read as transformers 5.24's ``Gemma3TextConfig`` reads config.json: ``layer_types`` or, in older
configs, ``sliding_window_pattern`` (every n-th layer full); per-layer-type ``rope_parameters`` or,
in older configs, ``rope_theta`` + ``rope_scaling`` for full layers and ``rope_local_base_freq``
for sliding ones. What the export cannot reproduce (attention-score softcapping, bidirectional
attention) is refused rather than silently dropped.
"""

from __future__ import annotations

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import (SUPPORTED_ACTIVATIONS, LayerSpec, _rope_config, cfg_bool, cfg_float, cfg_int,
                                     _json, cfg_layer_types, cfg_str, config_error, num_layers,
                                     parse_dense)
from graphkiln.models.registry import ModelFamily, register

ARCH = "Gemma3ForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")
# Gemma3TextConfig's defaults for keys a hub config.json may leave out.
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
DEFAULT_SLIDING_WINDOW = 4096
DEFAULT_PATTERN = 6

# canonical name -> checkpoint name. Gemma's post_attention_layernorm is the norm after the
# mixer (our post_mixer_norm); its pre_feedforward_layernorm is our post_attention_layernorm.
_NORMS = {
    "post_mixer_norm": "post_attention_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "post_ffn_norm": "post_feedforward_layernorm",
}


def layer_types(raw: dict) -> list[str]:
    n = num_layers(raw, ARCH)
    types = cfg_layer_types(raw, LAYER_TYPES, n)
    if types:
        return list(types)
    pattern = cfg_int(raw, "sliding_window_pattern", DEFAULT_PATTERN)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def ropes(raw: dict, types: list[str]) -> dict:
    """One RopeConfig per layer type in use, merged as ``Gemma3TextConfig.convert_rope_params_to_dict``
    does: ``rope_scaling`` applies to full layers only; a missing theta comes from ``rope_theta``
    (full) or ``rope_local_base_freq`` (sliding)."""
    params = raw.get("rope_parameters")
    if params is None:
        params = {}
    if not isinstance(params, dict) or not set(params) <= set(LAYER_TYPES) \
            or not all(p is None or isinstance(p, dict) for p in params.values()):
        # transformers ignores a flat {"rope_type": ..., "rope_theta": ...} here and uses its
        # defaults, which is never what such a config meant
        raise config_error("rope_parameters", params, "an object with a 'full_attention' and/or 'sliding_attention' "
                                                      "entry (each an object)")
    params = {t: dict(params.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    scaling = raw.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, dict):
            raise config_error("rope_scaling", scaling, "an object")
        # merged as is: transformers 5.24 keeps the entry's rope_type "default" over an old-style
        # {"type": "linear"} here, and the export follows the reference
        params["full_attention"].update(scaling)
    defaults = {"full_attention": cfg_float(raw, "rope_theta", DEFAULT_THETA["full_attention"], positive=True),
                "sliding_attention": cfg_float(raw, "rope_local_base_freq", DEFAULT_THETA["sliding_attention"],
                                               positive=True)}
    return {t: _rope_config(params[t], f"rope_parameters.{t}", defaults[t]) for t in dict.fromkeys(types)}


def _refuse_if_set(raw: dict, key: str, why: str) -> None:
    value = raw.get(key)
    if value is not None and value is not False:
        raise GraphkilnError(f"config.json for {ARCH} sets '{key}' to {_json(value)}: {why}; graphkiln cannot export it")


def parse_text_config(raw: dict):
    """The DecoderConfig of a Gemma3 text config.json (also usable for a Gemma3ForConditionalGeneration's
    ``text_config``, whose model_type is gemma3_text too)."""
    _refuse_if_set(raw, "attn_logit_softcapping", "the attention op has no score softcapping")
    _refuse_if_set(raw, "use_bidirectional_attention", "bidirectional text attention is not causal decoding")
    types = layer_types(raw)
    if "sliding_attention" in types and "sliding_window" in raw and raw["sliding_window"] is None:
        raise GraphkilnError(f"config.json for {ARCH} has sliding_attention layers but 'sliding_window' is null: "
                             "fix config.json")
    window = cfg_int(raw, "sliding_window", DEFAULT_SLIDING_WINDOW)
    act = cfg_str(raw, "hidden_activation", "gelu_pytorch_tanh")
    if act not in SUPPORTED_ACTIVATIONS:
        raise GraphkilnError(f"hidden_activation '{act}' in config.json is not supported: graphkiln implements "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
    hidden = cfg_int(raw, "hidden_size", architecture=ARCH)
    flavors = ropes(raw, types)
    layers = tuple(LayerSpec(window=window if t == "sliding_attention" else None, rope=t) for t in types)
    return parse_dense(
        raw, ARCH, mlp_bias=False, qk_norm=True, layers=layers, ropes=flavors, rope=next(iter(flavors.values())),
        hidden_act=act, sandwich_norm=True,
        head_dim=cfg_int(raw, "head_dim", 256),
        num_kv_heads=cfg_int(raw, "num_key_value_heads", 4),
        tie_word_embeddings=cfg_bool(raw, "tie_word_embeddings", True),
        max_position_embeddings=cfg_int(raw, "max_position_embeddings", 131_072),
        embed_scale=hidden**0.5,
        attention_scale=cfg_float(raw, "query_pre_attn_scalar", 256, positive=True) ** -0.5,
        norm_weight_offset=1.0,
        final_logit_softcap=cfg_float(raw, "final_logit_softcapping", None, positive=True),
    )


def _source(name: str, cfg) -> str:
    parts = name.split(".")
    if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3] in _NORMS:
        parts[3] = _NORMS[parts[3]]
    return ".".join(parts)


FAMILY = register(ModelFamily(ARCH, parse_text_config, _source))
