"""LlavaForConditionalGeneration: a CLIP or SigLIP vision tower + a two-layer projector in front
of a Llama / Qwen2 / Mistral decoder.

Text: the ``text_config`` goes through that decoder's own family (no second implementation),
with the vision seam on; checkpoint names are the family's under ``model.language_model.``
(transformers 5) or ``language_model.model.`` (earlier saves; ``lm_head`` likewise).

Vision (``models.vision`` contract): the tower is transformers' own CLIPVisionModel /
SiglipVisionModel built from ``vision_config`` (eager attention, so it traces to plain ONNX ops)
with the layers past the deepest ``vision_feature_layer`` dropped (never computed by the
reference either way); the selected hidden states (``vision_feature_select_strategy``
"default" drops the first token, CLIP's CLS) are concatenated along features and projected by
linear -> ``projector_hidden_act`` -> linear, as LlavaModel.get_image_features does.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.imaging import PlaceholderRule
from graphkiln.models.config import DecoderConfig, config_error
from graphkiln.models.registry import ModelFamily, family_for, register
from graphkiln.models.sources import Source
from graphkiln.models.vision import VisionConfig, VisionFamily, square_image_config, sub_config, text_source_in_vlm

ARCH = "LlavaForConditionalGeneration"
# text_config.model_type -> the decoder family that reads it
TEXT_FAMILIES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
# vision_config.model_type -> (transformers model class, leading tokens before the patches)
TOWERS = {"clip_vision_model": ("CLIPVisionModel", 1), "siglip_vision_model": ("SiglipVisionModel", 0)}
_VISION_PREFIXES = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def _text_family(raw: dict) -> ModelFamily:
    text = sub_config(raw, "text_config")
    model_type = text.get("model_type", "llama")
    if model_type not in TEXT_FAMILIES:
        raise GraphkilnError(f"config.json: text_config.model_type {model_type!r} is not supported for {ARCH}: "
                             f"graphkiln exports LLaVA with a {', '.join(TEXT_FAMILIES)} text model")
    return family_for(TEXT_FAMILIES[model_type])


def _parse_text(raw: dict) -> DecoderConfig:
    family = _text_family(raw)
    text = dict(sub_config(raw, "text_config"), architectures=[family.architecture])
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return dataclasses.replace(family.parse_config(text), vision_seam=True)


def _source(name: str, cfg: DecoderConfig) -> Source:
    family = family_for(TEXT_FAMILIES[cfg.raw.get("model_type", "llama")])
    return text_source_in_vlm(family.source(name, cfg))


def _feature_layers(raw: dict, num_layers: int) -> tuple[int, ...]:
    """``vision_feature_layer`` (int or list) as hidden-state indices 0..num_layers (0: the embeddings)."""
    value = raw.get("vision_feature_layer", -2)
    values = value if isinstance(value, list) else [value]
    if not values or not all(type(v) is int for v in values):
        raise config_error("vision_feature_layer", value, "an integer or a non-empty list of integers")
    out = []
    for v in values:
        k = v + num_layers + 1 if v < 0 else v
        if not 0 <= k <= num_layers:
            raise config_error("vision_feature_layer", value, f"hidden-state indices of a {num_layers}-layer tower")
        out.append(k)
    return tuple(out)


def _tower(raw: dict) -> tuple[str, int]:
    """``TOWERS``' entry for the checkpoint's vision tower (refused when there is none)."""
    model_type = sub_config(raw, "vision_config").get("model_type", "clip_vision_model")
    if model_type not in TOWERS:
        raise GraphkilnError(f"config.json: vision_config.model_type {model_type!r} is not supported for {ARCH}: "
                             f"graphkiln exports {', '.join(TOWERS)} towers")
    return TOWERS[model_type]


def _vision_layers(raw: dict) -> tuple[int, ...]:
    """The tower's hidden states the projector reads (``_feature_layers`` of its depth)."""
    return _feature_layers(raw, sub_config(raw, "vision_config").get("num_hidden_layers", 12))


def _parse_vision(raw: dict, preprocessor: dict) -> VisionConfig:
    vision = sub_config(raw, "vision_config")
    _, extra = _tower(raw)
    size, patch = vision.get("image_size", 224), vision.get("patch_size", 32)
    for key, value in (("image_size", size), ("patch_size", patch)):
        if type(value) is not int or value <= 0:
            raise config_error(f"vision_config.{key}", value, "a positive integer")
    _vision_layers(raw)
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise config_error("vision_feature_select_strategy", strategy, '"default" or "full"')
    token = raw.get("image_token_index", raw.get("image_token_id", 32000))
    if type(token) is not int or token < 0:
        raise config_error("image_token_index", token, "a token id (an integer >= 0)")
    rule = PlaceholderRule("patch_grid", patch_size=patch, num_additional_image_tokens=extra,
                           vision_feature_select_strategy=strategy)
    return square_image_config(token, size, rule, preprocessor, "llava", raw, "size / crop_size")


def _reads(name: str) -> bool:
    return name.startswith(_VISION_PREFIXES)


def _check(src: Path, vcfg: VisionConfig) -> None:
    from graphkiln.models.llava_vision import check_llava_vision

    check_llava_vision(src, vcfg, _tower(vcfg.raw)[0])


def _build(src: Path, vcfg: VisionConfig, dtype: str):
    """The vision graph's torch module with the checkpoint's weights (see the module docstring)."""
    from graphkiln.models.llava_vision import build_llava_vision

    return build_llava_vision(src, vcfg, dtype, _tower(vcfg.raw)[0], _vision_layers(vcfg.raw))


# cfg.raw is the text config (what the rope init functions and _source read), not the VLM's
FAMILY = register(ModelFamily(ARCH, _parse_text, _source, vision=VisionFamily(_parse_vision, _reads, _check, _build)))
