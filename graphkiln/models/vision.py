"""The vision graph spec of a vision-language model: what a family provides beside its decoder.

A vision-language family is a decoder family (its text part reuses an existing one, with the
decoder's vision seam switched on) plus a ``VisionFamily``: it parses the vision half of the
config into a ``VisionConfig`` (everything the artifact's ``VisionSpec`` records, and what the
export needs to build the tower), says which checkpoint tensors belong to it (so the decoder's
"nothing left unread" check does not count them), and builds the export-friendly torch module
whose forward is the vision graph contract:

    pixel_values float32 [images, 3, H, W]  (graphkiln.imaging's output for the processor)
    -> image_embeddings [images * tokens_per_image, text hidden]  (model dtype; image by image)

A module whose graph takes other inputs (Qwen2.5-VL: flattened patches ``[patches, C*t*p*p]`` and
the patch grid of ``runtime.backends.vision_groups``) says so with a ``graph_io(hidden, dtype)`` method
returning (input specs, output specs, example args, dynamic shapes); ``export.vision_export``
traces it with those.

Torch is imported only by ``build``; parsing stays torch-free like the decoder families'.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.imaging import ImagePreprocessing, PlaceholderRule, check_compatible, preprocessing_from_config
from graphkiln.models.config import config_error
from graphkiln.models.sources import Alt, Source


@dataclass(frozen=True)
class VisionConfig:
    """The vision half of a vision-language config, as the export needs it."""

    image_token_id: int
    # (height, width) of the processed image the graph takes; None when the processor resizes each
    # image to its own patch grid (Qwen2.5-VL: the graph takes flattened patches)
    image_size: tuple[int, int] | None
    placeholder: PlaceholderRule
    preprocessing: ImagePreprocessing
    raw: dict = field(default_factory=dict, hash=False, compare=False, repr=False)  # the whole config.json
    positions: str = "1d"  # the manifest VisionSpec's position rule: "1d" or "mrope"


@dataclass(frozen=True)
class VisionFamily:
    """How one vision-language architecture's vision graph is built (see the module docstring).

    ``parse(raw, preprocessor) -> VisionConfig`` reads config.json and preprocessor_config.json;
    ``reads(name)`` is True for the checkpoint tensors the vision graph uses; ``check(src, vcfg)``
    refuses what ``build`` would about the weights, from the shard headers alone (run before the
    output exists); ``build(src, vcfg, dtype)`` returns the torch module (weights loaded, eval
    mode) whose forward is the contract. ``complete(src, vcfg)``, when set, returns ``vcfg`` with
    what config.json and preprocessor_config.json cannot say, read from the checkpoint's other
    files (Gemma3: the ids of the text its processor wraps each image in, from tokenizer.json);
    export runs it right after ``parse``, before ``check``."""

    parse: Callable[[dict, dict], VisionConfig]
    reads: Callable[[str], bool]
    check: Callable[[Path, VisionConfig], None]
    build: Callable[[Path, VisionConfig, str], object]
    complete: Callable[[Path, VisionConfig], VisionConfig] | None = None


def sub_config(raw: dict, key: str) -> dict:
    """A vision-language config's sub-model config (``text_config``, ``vision_config``)."""
    value = raw.get(key)
    if not isinstance(value, dict):
        raise config_error(key, value, "an object (the sub-model's config)")
    return value


def text_source_in_vlm(src: Source) -> Source:
    """A text family's checkpoint source inside a vision-language checkpoint: each tensor under
    either layout, ``model.language_model.*`` (transformers 5) or ``language_model.model.*``
    (earlier saves; ``lm_head`` likewise under ``language_model.``)."""
    if isinstance(src, str):
        if src.startswith("model."):
            return Alt((f"model.language_model.{src[6:]}", f"language_model.{src}"))
        return Alt((src, f"language_model.{src}"))
    if isinstance(src, Alt):
        return Alt(tuple(text_source_in_vlm(o) for o in src.options))
    return dataclasses.replace(src, parts=tuple(text_source_in_vlm(p) for p in src.parts))


def square_image_config(image_token_id: int, size: int, rule: PlaceholderRule, preprocessor: dict, model_type: str,
                        raw: dict, size_fields: str = "size") -> VisionConfig:
    """The ``VisionConfig`` of a tower that takes ``size`` x ``size`` images: the processor's
    preprocessing must be compatible with ``rule`` and produce exactly that size (one-line
    refusals naming the processor's ``size_fields`` to fix)."""
    try:
        preprocessing = preprocessing_from_config(preprocessor, model_type=model_type)
        rule = rule.validated()
        check_compatible(preprocessing, rule)
    except ValueError as exc:
        raise GraphkilnError(f"{exc}: fix preprocessor_config.json / config.json") from None
    if preprocessing.output_size != (size, size):
        raise GraphkilnError(f"preprocessor_config.json makes {preprocessing.output_size[0]}x"
                             f"{preprocessing.output_size[1]} images but the vision tower takes {size}x{size}: "
                             f"fix the processor's {size_fields}")
    return VisionConfig(image_token_id, (size, size), rule, preprocessing, raw)
