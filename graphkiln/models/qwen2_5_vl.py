"""Qwen2_5_VLForConditionalGeneration: a windowed ViT with 2-D rotary and a patch merger in front
of a Qwen2 decoder with multimodal rotary positions (M-RoPE).

Text: ``text_config`` (transformers 5) or, in hub configs written by 4.x, the text keys at the top
level, read by the Qwen2 family (no second implementation) with the vision seam on and
``mrope_section`` set, so the decoder graph takes ``rope_position_ids [3, batch, seq]``
(``runtime.request.mrope`` computes them as transformers' ``get_rope_index``). The text attention's head
size is ``hidden_size / num_attention_heads`` whatever ``head_dim`` says, as in transformers.
Checkpoint names: what ``save_pretrained`` writes (``model.*``, ``visual.*``, ``lm_head``) or the
in-memory layout (``model.language_model.*``, ``model.visual.*``).

Vision (``models.vision`` contract, ``models.qwen2_5_vl_vision``): the graph takes the processor's
flattened patches plus the patch grid and attention groups the runtime computes from the images'
grids (``runtime.backends.vision_groups``), and returns one row per merge unit in text hidden size.
Refused rather than approximated: another ``in_channels`` than 3, a window smaller than one merge
unit, a head size not divisible by 4 (the 2-D rotary splits it in quarters), a preprocessor whose
patch / merge / temporal sizes differ from the tower's, sliding-window text layers, a text rope
other than the default one.
"""

from __future__ import annotations

import dataclasses

from graphkiln.errors import GraphkilnError
from graphkiln.imaging import PlaceholderRule, check_compatible, preprocessing_from_config
from graphkiln.models.config import DecoderConfig, _int_ok, config_error
from graphkiln.models.registry import ModelFamily, family_for, register
from graphkiln.models.sources import Alt, Source
from graphkiln.models.vision import VisionConfig, VisionFamily, sub_config

ARCH = "Qwen2_5_VLForConditionalGeneration"
TEXT_ARCH = "Qwen2ForCausalLM"
# Qwen2_5_VLVisionConfig's defaults (transformers 5.24)
VISION_DEFAULTS = dict(depth=32, hidden_size=3584, hidden_act="silu", intermediate_size=3420, num_heads=16, in_channels=3,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112, out_hidden_size=3584,
                       fullatt_block_indexes=[7, 15, 23, 31])
DEFAULT_TEXT_THETA = 1_000_000.0  # Qwen2_5_VLTextConfig.default_theta
DEFAULT_MROPE_SECTION = [16, 24, 24]  # Qwen2_5_VLRotaryEmbedding's fallback
DEFAULT_IMAGE_TOKEN_ID = 151655
_VISION_PREFIXES = ("model.visual.", "visual.")
# top-level keys of the composite config that are not text keys (for 4.x flat configs)
_COMPOSITE_KEYS = {"vision_config", "text_config", "image_token_id", "video_token_id", "vision_start_token_id",
                   "vision_end_token_id", "vision_token_id", "architectures", "model_type", "transformers_version",
                   "tie_word_embeddings", "dtype", "torch_dtype"}


def _text_raw(raw: dict) -> dict:
    text = raw.get("text_config")
    if text is None:  # a 4.x config: the text keys sit at the top level
        text = {k: v for k, v in raw.items() if k not in _COMPOSITE_KEYS}
    elif not isinstance(text, dict):
        raise config_error("text_config", text, "an object (the text model's config)")
    return dict(text)


def _mrope(text: dict, head_dim: int) -> tuple[dict, tuple[int, ...]]:
    """The text rope parameters as the Qwen2 family reads them (rope_type "mrope" is transformers'
    old name for the default rope with sections) and the M-RoPE sections."""
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    where = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    if not isinstance(params, dict):
        raise config_error(f"text_config.{where}", params, "an object")
    params = dict(params)
    kind, old_name = params.pop("rope_type", None), params.pop("type", None)
    kind = kind or old_name or "default"
    if kind not in ("default", "mrope"):
        raise GraphkilnError(f"config.json: text rope_type {kind!r} is not supported for {ARCH}: graphkiln exports "
                             "its default multimodal rope only")
    theta = params.get("rope_theta", text.get("rope_theta", DEFAULT_TEXT_THETA))
    section = params.pop("mrope_section", DEFAULT_MROPE_SECTION)
    if not isinstance(section, list) or not section or not all(_int_ok(s) and s > 0 for s in section) \
            or sum(section) != head_dim // 2:
        raise config_error(f"text_config.{where}.mrope_section", section,
                           f"a list of positive integers summing to head_dim / 2 = {head_dim // 2}")
    return dict(params, rope_type="default", rope_theta=theta), tuple(section)


def _parse_text(raw: dict) -> DecoderConfig:
    text = _text_raw(raw)
    hidden, heads = text.get("hidden_size", 8192), text.get("num_attention_heads", 64)
    if not (_int_ok(hidden) and _int_ok(heads) and heads > 0 and hidden > 0 and hidden % heads == 0):
        raise GraphkilnError(f"config.json: text hidden_size {hidden!r} must be a positive multiple of "
                             f"num_attention_heads {heads!r} (the head size is their ratio): fix config.json")
    head_dim = hidden // heads
    if text.get("head_dim") not in (None, head_dim):
        raise config_error("text_config.head_dim", text["head_dim"],
                           f"{head_dim} or absent ({ARCH} uses hidden_size / num_attention_heads)")
    if text.get("use_sliding_window"):
        raise GraphkilnError(f"config.json: use_sliding_window is true: graphkiln exports {ARCH} with full attention "
                             "only (as released); set it to false")
    rope, section = _mrope(text, head_dim)
    for key in ("rope_scaling", "rope_theta", "head_dim", "layer_types"):
        text.pop(key, None)
    text.update(architectures=[TEXT_ARCH], rope_parameters=rope, hidden_size=hidden, num_attention_heads=heads)
    text.setdefault("rms_norm_eps", 1e-5)
    text.setdefault("max_position_embeddings", 32768)
    text["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
    text["model_type"] = "qwen2"
    cfg = family_for(TEXT_ARCH).parse_config(text)
    return dataclasses.replace(cfg, vision_seam=True, mrope_section=section)


def _source(name: str, cfg: DecoderConfig) -> Source:
    """Either checkpoint layout (see the module docstring); lm_head is the same in both."""
    if name.startswith("model."):
        return Alt((name, f"model.language_model.{name[6:]}"))
    return name


def vision_fields(raw: dict) -> dict:
    """``vision_config`` with transformers' defaults, every value checked; ``window`` is the
    attention window in merge units (window_size // spatial_merge_size // patch_size)."""
    v = dict(VISION_DEFAULTS, **{k: x for k, x in sub_config(raw, "vision_config").items() if x is not None})
    for key in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
        if not _int_ok(v[key]) or v[key] <= 0:
            raise config_error(f"vision_config.{key}", v[key], "a positive integer")
    if v["in_channels"] != 3:
        raise config_error("vision_config.in_channels", v["in_channels"], "3 (the processor makes RGB patches)")
    if v["hidden_size"] % v["num_heads"] or (v["hidden_size"] // v["num_heads"]) % 4:
        raise GraphkilnError(f"config.json: vision_config.hidden_size {v['hidden_size']} / num_heads {v['num_heads']} "
                             "must be a whole head size divisible by 4 (the 2-D rotary uses quarters): fix config.json")
    if v["hidden_act"] not in ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu", "relu"):
        raise config_error("vision_config.hidden_act", v["hidden_act"], "one of silu, gelu, gelu_pytorch_tanh, "
                           "quick_gelu, relu")
    full = v["fullatt_block_indexes"]
    if not isinstance(full, (list, tuple)) or not all(_int_ok(i) and 0 <= i < v["depth"] for i in full):
        raise config_error("vision_config.fullatt_block_indexes", full, f"a list of block indices in [0, {v['depth']})")
    v["window"] = v["window_size"] // v["spatial_merge_size"] // v["patch_size"]
    if v["window"] < 1:
        raise GraphkilnError(f"config.json: vision_config.window_size {v['window_size']} is smaller than one merge unit "
                             f"({v['spatial_merge_size']} x {v['patch_size']} pixels): fix config.json")
    rope = v.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") != "axial":
        raise config_error("vision_config.rope_parameters", rope, 'an object with rope_type "axial"')
    theta = rope.get("rope_theta", v.get("rope_theta", 10000.0))
    if not (_int_ok(theta) or isinstance(theta, float)) or not theta > 0 or theta == float("inf"):
        raise config_error("vision_config.rope_parameters.rope_theta", theta, "a positive number")
    v["rope_theta"] = float(theta)
    return v


def _parse_vision(raw: dict, preprocessor: dict) -> VisionConfig:
    v = vision_fields(raw)
    text_hidden = _parse_text(raw).hidden_size
    if v["out_hidden_size"] != text_hidden:
        raise config_error("vision_config.out_hidden_size", v["out_hidden_size"],
                           f"the text hidden_size {text_hidden} (the merger's output enters the decoder)")
    token = raw.get("image_token_id", DEFAULT_IMAGE_TOKEN_ID)
    if not _int_ok(token) or token < 0:
        raise config_error("image_token_id", token, "a token id (an integer >= 0)")
    try:
        preprocessing = preprocessing_from_config(preprocessor, model_type="qwen2_5_vl")
        rule = PlaceholderRule("merged_grid", merge_size=v["spatial_merge_size"]).validated()
        check_compatible(preprocessing, rule)
    except ValueError as exc:
        raise GraphkilnError(f"{exc}: fix preprocessor_config.json / config.json") from None
    for ours, theirs in (("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
                         ("temporal_patch_size", "temporal_patch_size")):
        if getattr(preprocessing, ours) != v[theirs]:
            raise GraphkilnError(f"preprocessor_config.json has {ours} {getattr(preprocessing, ours)} but the vision "
                                 f"tower's {theirs} is {v[theirs]}: make them equal")
    return VisionConfig(token, None, rule, preprocessing, raw, positions="mrope")


def _reads(name: str) -> bool:
    return name.startswith(_VISION_PREFIXES)


def _check(src, vcfg: VisionConfig) -> None:
    from graphkiln.models.qwen2_5_vl_vision import check_qwen_vision

    check_qwen_vision(src, vision_fields(vcfg.raw))


def _build(src, vcfg: VisionConfig, dtype: str):
    from graphkiln.models.qwen2_5_vl_vision import build_qwen_vision

    return build_qwen_vision(src, vision_fields(vcfg.raw), dtype)


FAMILY = register(ModelFamily(ARCH, _parse_text, _source, vision=VisionFamily(_parse_vision, _reads, _check, _build)))
