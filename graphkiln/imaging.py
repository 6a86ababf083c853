"""Image loading and preprocessing for vision-language artifacts: numpy + Pillow only.

This module sits below both ``graphkiln.export`` and ``graphkiln.runtime`` and imports neither
torch, transformers nor onnx. It reproduces what transformers' PIL-backed image processors
(``CLIPImageProcessorPil``, ``LlavaImageProcessorPil``, ``SiglipImageProcessorPil``,
``Gemma3ImageProcessorPil``, ``Qwen2VLImageProcessorPil`` in transformers 5.24) compute, value for
value: the same Pillow resize with the same filter, the same center crop (zero padding when the
image is smaller), the same float64 rescale cast to float32 and the same float32 normalisation
(done here through a per-channel 256-entry lookup table holding exactly those values).

- ``ImagePreprocessing``: what a model's image processor does, as a frozen, strictly validated
  dataclass of plain JSON types (it is embedded in the artifact manifest, which is untrusted).
- ``preprocessing_from_config(d)``: parse a checkpoint's ``preprocessor_config.json`` with the
  defaults of the transformers class it names; anything graphkiln does not reproduce is a
  one-line ``ValueError`` (export turns it into ``GraphkilnError``).
- ``load_image(source, max_pixels)``: a path, bytes, a PIL image or a uint8 array -> an RGB PIL
  image, converted as transformers converts that kind of input (see ``load_image``); the pixel
  limit is checked from the header before any pixel is decoded.
- ``preprocess(images, spec)``: the vision graph's input (``PreprocessedImages``).
- ``PlaceholderRule``: how many placeholder tokens an image expands to in the prompt (model
  config values, filled by export); ``content_hash``: the embedding cache key.

Every refusal about an image is an ``ImageError`` (a ``GraphkilnError`` and a ``ValueError``)
whose message is one line naming the problem and the fix.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import stat
import warnings
from dataclasses import asdict, dataclass
from functools import cache, lru_cache
from typing import Annotated, Any, Literal, Sequence

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator, with_config

from graphkiln.errors import GraphkilnError


class ImageError(GraphkilnError, ValueError):
    """An image graphkiln refuses: ``str(err)`` is one line naming the problem and the fix."""


# ---------------------------------------------------------------------------------------------
# the spec

_STRICT = ConfigDict(extra="forbid", strict=True)  # as graphkiln.manifest (which embeds these classes)

MAX_SIDE = 16384  # any configured height / width / edge
# any configured area (size, crop_size, min_pixels / max_pixels): 2.6x Qwen2.5-VL's largest
# max_pixels (12845056); a manifest is untrusted and must not make one image take gigabytes
MAX_SPEC_PIXELS = 1 << 25
# Pillow's filters by the names the manifest records; the values are PIL.Image.Resampling's (what
# preprocessor_config.json's "resample" holds)
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
_RESAMPLE_NAMES = {v: k for k, v in RESAMPLE.items()}
KINDS = ("clip", "siglip", "gemma3", "qwen2_vl")
# a resize before the center crop (CLIP's shortest edge) of a very elongated image can be huge
# (a 1x10000 image at shortest edge 336 is 336x3360000): refuse beyond this many pixels
MAX_INTERMEDIATE_PIXELS = MAX_SPEC_PIXELS

Side = Annotated[int, Field(gt=0, le=MAX_SIDE)]
Mean = Annotated[float, Field(ge=-1e6, le=1e6, allow_inf_nan=False)]
Std = Annotated[float, Field(ge=1e-6, le=1e6, allow_inf_nan=False)]


@with_config(_STRICT)
@dataclass(frozen=True)
class ImagePreprocessing:
    """Exactly what a model's image processor does to one RGB image, in this order:

    ``clip`` (CLIPImageProcessor, LlavaImageProcessor) and ``siglip`` (SiglipImageProcessor):
    [pad to a square filled with ``int(255 * image_mean)``, LLaVA's ``do_pad``] -> resize to
    ``size`` (height, width) or so the shortest edge is ``shortest_edge`` (aspect kept, the long
    edge truncated to int) -> [center crop to ``crop_size``, zero-padded when smaller] ->
    rescale -> normalize; output ``[n, 3, H, W]`` float32.
    ``gemma3`` (Gemma3ImageProcessor without pan-and-scan): resize to ``size`` -> rescale ->
    normalize; ``[n, 3, H, W]``.
    ``qwen2_vl`` (Qwen2VLImageProcessor, also Qwen2.5-VL's): smart-resize to multiples of
    ``patch_size * merge_size`` with ``min_pixels <= h * w <= max_pixels`` -> rescale ->
    normalize -> patches ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` (rows in
    merge-window order, each ``(channel, t, py, px)`` with the frame repeated over t) and the grid
    ``(1, grid_h, grid_w)``; several images' rows are concatenated.

    Rescale is ``float32(float64(u8) * rescale_factor)``, normalize ``(x - mean) / std`` in float32.
    Built by ``preprocessing_from_config`` or read from a manifest (``validated`` checks one).
    """

    kind: Literal[KINDS]  # type: ignore[valid-type]
    resample: Literal[tuple(RESAMPLE)] = "bicubic"  # type: ignore[valid-type]
    do_resize: bool = True
    size: tuple[Side, Side] | None = None  # (height, width) of a fixed-size resize
    shortest_edge: Side | None = None  # clip/siglip: aspect-keeping resize
    min_pixels: Annotated[int, Field(gt=0, le=MAX_SPEC_PIXELS)] | None = None  # qwen2_vl
    max_pixels: Annotated[int, Field(gt=0, le=MAX_SPEC_PIXELS)] | None = None  # qwen2_vl
    do_center_crop: bool = False
    crop_size: tuple[Side, Side] | None = None  # (height, width)
    pad_to_square: bool = False  # clip (LlavaImageProcessor's do_pad), before the resize
    do_rescale: bool = True
    rescale_factor: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[Mean, Mean, Mean] = (0.5, 0.5, 0.5)
    image_std: tuple[Std, Std, Std] = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True  # False: the processor takes RGB images only
    patch_size: Annotated[int, Field(gt=0, le=1024)] | None = None  # qwen2_vl
    temporal_patch_size: Annotated[int, Field(gt=0, le=64)] | None = None  # qwen2_vl
    merge_size: Annotated[int, Field(gt=0, le=64)] | None = None  # qwen2_vl

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "ImagePreprocessing":
        qwen = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
        if self.kind == "qwen2_vl":
            _require(self, qwen, "a qwen2_vl")
            _forbid(self, ("size", "shortest_edge", "crop_size"), "a qwen2_vl")
            if not self.do_resize:
                raise ValueError("do_resize must be true for qwen2_vl (its patch grid needs the smart resize)")
            if self.do_center_crop or self.pad_to_square:
                raise ValueError("qwen2_vl does not center-crop or pad (do_center_crop and pad_to_square must be false)")
            if self.min_pixels > self.max_pixels:
                raise ValueError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
            factor = self.patch_size * self.merge_size
            if factor * factor > self.max_pixels:
                raise ValueError(f"max_pixels ({self.max_pixels}) is below one merge window "
                                 f"((patch_size * merge_size)**2 = {factor * factor})")
            return self
        _forbid(self, qwen, f"a {self.kind}")
        for name in ("size", "crop_size"):
            hw = getattr(self, name)
            if hw is not None and hw[0] * hw[1] > MAX_SPEC_PIXELS:
                raise ValueError(f"{name} {hw[0]}x{hw[1]} has more than {MAX_SPEC_PIXELS} pixels")
        if self.do_resize and (self.size is None) == (self.shortest_edge is None):
            raise ValueError("a resize needs exactly one of size (height, width) and shortest_edge")
        if not self.do_resize:
            _forbid(self, ("size", "shortest_edge"), "a non-resizing")
        if self.do_center_crop != (self.crop_size is not None):
            raise ValueError("crop_size must be set exactly when do_center_crop is true")
        if self.kind == "gemma3" and (self.shortest_edge is not None or self.do_center_crop or not self.do_resize):
            raise ValueError("gemma3 resizes to a fixed size and does not crop (needs size, do_resize true, "
                             "do_center_crop false)")
        if self.pad_to_square and self.kind != "clip":
            raise ValueError(f"pad_to_square is LLaVA's (clip kind) only, not {self.kind}'s")
        if self.pad_to_square and not all(0 <= m <= 1 for m in self.image_mean):
            raise ValueError("pad_to_square fills with 255 * image_mean, so image_mean must lie in [0, 1]")
        if not self.do_center_crop and self.size is None:
            raise ValueError("the output size would vary with the input image (no fixed-size resize and no "
                             "center crop); the vision graph takes one size")
        return self

    @property
    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every output image for the fixed-size kinds; None for qwen2_vl."""
        if self.kind == "qwen2_vl":
            return None
        return self.crop_size if self.do_center_crop else self.size

    def validated(self, what: str = "image preprocessing") -> "ImagePreprocessing":
        """This spec as a manifest reader validates it (from JSON); else a one-line ValueError."""
        try:
            return _adapter(ImagePreprocessing).validate_json(json.dumps(asdict(self)))
        except ValidationError as exc:
            raise ValueError(_summarise(exc, what)) from None


def _require(spec: Any, names: Sequence[str], what: str) -> None:
    for name in names:
        if getattr(spec, name) is None:
            raise ValueError(f"{name} is required for {what} preprocessing")


def _forbid(spec: Any, names: Sequence[str], what: str) -> None:
    for name in names:
        if getattr(spec, name) is not None:
            raise ValueError(f"{name} must be null for {what} preprocessing")


@with_config(_STRICT)
@dataclass(frozen=True)
class PlaceholderRule:
    """How many placeholder (image) tokens one image expands to in the prompt; values from the
    model and processor config, filled by export:

    - ``patch_grid`` (LLaVA with a CLIP or SigLIP tower; LlavaProcessor's rule):
      ``(H // patch_size) * (W // patch_size) + num_additional_image_tokens``, minus 1 when
      ``vision_feature_select_strategy`` is ``"default"`` (the model drops the first feature).
      ``num_additional_image_tokens`` is the tower's extra leading tokens: 1 for CLIP (its CLS
      token), 0 for SigLIP. (H, W) is the processed image's size.
    - ``fixed`` (Gemma3: ``mm_tokens_per_image``): ``tokens_per_image`` for every image.
    - ``merged_grid`` (Qwen2-VL / Qwen2.5-VL): ``t * h * w // merge_size**2`` of the image's grid.

    What replaces the prompt's placeholder (``runtime.backends.vision.expand_placeholders``): ``prefix_ids``,
    then that many ``row_token_id`` tokens (the ones whose embeddings the image's rows replace;
    None: the placeholder's own id), then ``suffix_ids``. LLaVA and Qwen: no prefix or suffix, the
    placeholder repeated. Gemma3 (``Gemma3Processor``): the prompt holds ``<start_of_image>`` and
    each becomes ``"\n\n" <start_of_image> <image_soft_token> x n <end_of_image> "\n\n"``, the
    newlines' ids taken from the checkpoint's tokenizer at export.
    """

    kind: Literal["patch_grid", "fixed", "merged_grid"]
    patch_size: Annotated[int, Field(gt=0, le=1024)] | None = None
    num_additional_image_tokens: Annotated[int, Field(ge=0, le=64)] = 0
    vision_feature_select_strategy: Literal["default", "full"] = "full"
    tokens_per_image: Annotated[int, Field(gt=0, le=1 << 20)] | None = None
    merge_size: Annotated[int, Field(gt=0, le=64)] | None = None
    row_token_id: Annotated[int, Field(ge=0)] | None = None
    prefix_ids: Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(max_length=16)] = ()
    suffix_ids: Annotated[tuple[Annotated[int, Field(ge=0)], ...], Field(max_length=16)] = ()

    @model_validator(mode="after")
    def _fields_of_kind(self) -> "PlaceholderRule":
        need = {"patch_grid": ("patch_size",), "fixed": ("tokens_per_image",), "merged_grid": ("merge_size",)}[self.kind]
        other = {"patch_size", "tokens_per_image", "merge_size"} - set(need)
        _require(self, need, f"a {self.kind} placeholder rule's")
        _forbid(self, sorted(other), f"a {self.kind} placeholder rule's")
        if self.kind != "patch_grid" and (self.num_additional_image_tokens or self.vision_feature_select_strategy != "full"):
            raise ValueError("num_additional_image_tokens and vision_feature_select_strategy belong to a patch_grid rule")
        return self

    def num_tokens(self, image_size: tuple[int, int], grid: tuple[int, int, int] | None = None) -> int:
        """Placeholder tokens for one processed image of ``image_size`` (height, width) and, for
        ``merged_grid``, its ``grid`` (t, h, w)."""
        if self.kind == "fixed":
            return self.tokens_per_image
        if self.kind == "merged_grid":
            if grid is None:
                raise ValueError("a merged_grid placeholder rule needs the image's grid (t, h, w)")
            t, h, w = grid
            return t * h * w // (self.merge_size * self.merge_size)
        height, width = image_size
        n = (height // self.patch_size) * (width // self.patch_size) + self.num_additional_image_tokens
        return n - 1 if self.vision_feature_select_strategy == "default" else n

    def validated(self) -> "PlaceholderRule":
        try:
            return _adapter(PlaceholderRule).validate_json(json.dumps(asdict(self)))
        except ValidationError as exc:
            raise ValueError(_summarise(exc, "placeholder rule")) from None


def check_compatible(spec: ImagePreprocessing, rule: PlaceholderRule) -> None:
    """ValueError (one line) unless ``rule`` can count ``spec``'s images: the merged grid goes with
    qwen2_vl (same merge size), the fixed-size kinds take a patch grid of at least one token or a
    fixed count."""
    if spec.kind == "qwen2_vl":
        if rule.kind != "merged_grid":
            raise ValueError(f"qwen2_vl preprocessing needs a merged_grid placeholder rule (got {rule.kind})")
        if rule.merge_size != spec.merge_size:
            raise ValueError(f"the placeholder rule's merge_size ({rule.merge_size}) differs from the "
                             f"preprocessing's ({spec.merge_size})")
        return
    if rule.kind == "merged_grid":
        raise ValueError(f"a merged_grid placeholder rule needs qwen2_vl preprocessing (got {spec.kind})")
    if rule.kind == "patch_grid" and rule.num_tokens(spec.output_size) < 1:
        raise ValueError(f"the placeholder rule gives no token for a {spec.output_size[0]}x{spec.output_size[1]} "
                         f"image (patch size {rule.patch_size})")


@cache
def _adapter(cls: type) -> TypeAdapter:
    return TypeAdapter(cls)


def _summarise(exc: ValidationError, what: str) -> str:
    """pydantic's report as one line: the first problem (field, what it must be, the value)."""
    e = exc.errors(include_url=False)[0]
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
    problem = " ".join(str(e["msg"]).removeprefix("Value error, ").split())
    for should in ("Input should be", "Input should"):
        problem = problem.replace(should, "must be" if should.endswith("be") else "must")
    got = "" if e["type"].startswith("value_error") else f" (got {_show(e.get('input'))})"
    more = len(exc.errors()) - 1
    head = f"{what}: " if what else ""
    return f"{head}{where + ' ' if where else ''}{problem}{got}" + (f" (and {more} more)" if more else "")


def _show(value: object, limit: int = 60) -> str:
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError):
        text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# preprocessor_config.json

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGENET_STANDARD = (0.5, 0.5, 0.5)

# the class attributes of transformers 5.24's *ImageProcessorPil classes (and BaseImageProcessor's
# rescale_factor 1/255): what a key left out of, or null in, preprocessor_config.json means
_CLIP_DEFAULTS = dict(resample=3, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD, size={"shortest_edge": 224},
                      default_to_square=False, crop_size={"height": 224, "width": 224}, do_resize=True,
                      do_center_crop=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                      do_convert_rgb=True, do_pad=None)
_DEFAULTS: dict[str, dict[str, Any]] = {
    "CLIPImageProcessor": _CLIP_DEFAULTS,
    "LlavaImageProcessor": dict(_CLIP_DEFAULTS, do_pad=False),
    "SiglipImageProcessor": dict(resample=3, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=False, do_resize=True,
                                 do_rescale=True, rescale_factor=1 / 255, do_normalize=True, do_convert_rgb=True,
                                 do_center_crop=None, crop_size=None, do_pad=None),
    "Gemma3ImageProcessor": dict(resample=2, image_mean=IMAGENET_STANDARD, image_std=IMAGENET_STANDARD,
                                 size={"height": 224, "width": 224}, default_to_square=True, do_convert_rgb=True,
                                 do_resize=True, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                                 do_center_crop=None, crop_size=None, do_pad=None, do_pan_and_scan=None),
    "Qwen2VLImageProcessor": dict(resample=3, size={"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                                  default_to_square=False, do_resize=True, do_rescale=True, rescale_factor=1 / 255,
                                  do_normalize=True, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
                                  do_convert_rgb=True, patch_size=14, temporal_patch_size=2, merge_size=2,
                                  do_center_crop=None, crop_size=None, do_pad=None),
}
_KIND_OF = {"CLIPImageProcessor": "clip", "LlavaImageProcessor": "clip", "SiglipImageProcessor": "siglip",
            "Gemma3ImageProcessor": "gemma3", "Qwen2VLImageProcessor": "qwen2_vl"}
# what transformers' AutoImageProcessor picks from the model config's model_type when the
# preprocessor config names no class (IMAGE_PROCESSOR_MAPPING_NAMES in 5.24)
_BY_MODEL_TYPE = {"clip": "CLIPImageProcessor", "llava": "LlavaImageProcessor", "siglip": "SiglipImageProcessor",
                  "paligemma": "SiglipImageProcessor", "gemma3": "Gemma3ImageProcessor",
                  "qwen2_vl": "Qwen2VLImageProcessor", "qwen2_5_vl": "Qwen2VLImageProcessor"}
# the processor classes of those models, for a config that has processor_class and nothing else
_BY_PROCESSOR_CLASS = {"CLIPProcessor": "CLIPImageProcessor", "LlavaProcessor": "LlavaImageProcessor",
                       "SiglipProcessor": "SiglipImageProcessor", "PaliGemmaProcessor": "SiglipImageProcessor",
                       "Gemma3Processor": "Gemma3ImageProcessor", "Qwen2VLProcessor": "Qwen2VLImageProcessor",
                       "Qwen2_5_VLProcessor": "Qwen2VLImageProcessor"}
# keys that name things or only matter elsewhere (the processor, the torchvision backend); checked
# for their JSON type, otherwise ignored
_INFO_KEYS = {"image_processor_type": str, "feature_extractor_type": str, "processor_class": str,
              "image_seq_length": int, "disable_grouping": bool}
# keys ImagesKwargs has that must hold their neutral value here
_NEUTRAL = {"data_format": ("channels_first",), "input_data_format": (), "device": (), "return_tensors": (),
            "pad_size": ()}
_QWEN_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size")
_PAS_KEYS = ("pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops", "pan_and_scan_min_ratio_to_activate")
_VALID_SIZE_KEYS = ({"height", "width"}, {"shortest_edge"}, {"shortest_edge", "longest_edge"}, {"longest_edge"},
                    {"max_height", "max_width"}, {"min_pixels", "max_pixels"})

_WHERE = "preprocessor_config.json"


def processor_class_name(d: dict, model_type: str | None = None) -> str:
    """The transformers image processor class ``d`` selects, without backend suffix (as
    AutoImageProcessor resolves it: image_processor_type, else feature_extractor_type with
    FeatureExtractor -> ImageProcessor, else the model config's ``model_type``; graphkiln also takes
    processor_class). ValueError when none of them names one."""
    for key in ("image_processor_type", "feature_extractor_type"):
        name = d.get(key)
        if name is not None:
            if type(name) is not str:
                raise ValueError(f"{_WHERE}: {key} must be a string (got {_show(name)})")
            name = name.replace("FeatureExtractor", "ImageProcessor")
            for suffix in ("Fast", "Pil"):
                name = name.removesuffix(suffix)
            return name
    if model_type is not None:
        if model_type in _BY_MODEL_TYPE:
            return _BY_MODEL_TYPE[model_type]
        raise ValueError(f"{_WHERE} names no image_processor_type and graphkiln has no image processor for model "
                         f"type {_show(model_type)}: add image_processor_type to {_WHERE}")
    pc = d.get("processor_class")
    if type(pc) is str and pc in _BY_PROCESSOR_CLASS:
        return _BY_PROCESSOR_CLASS[pc]
    raise ValueError(f"{_WHERE} names no image processor (no image_processor_type, feature_extractor_type or known "
                     f"processor_class): add \"image_processor_type\", e.g. \"CLIPImageProcessor\"")


def preprocessing_from_config(d: dict, model_type: str | None = None) -> ImagePreprocessing:
    """Parse a checkpoint's ``preprocessor_config.json`` (as a dict) into an ``ImagePreprocessing``,
    with the defaults of the transformers 5.24 class it names (``model_type``, the model config's,
    is the fallback transformers uses when it names none). A key left out takes the class default;
    a null one is None, as transformers 5.24 reads it (false for a flag, so Gemma3's released
    ``"do_convert_rgb": null`` means no RGB conversion; refused where a value is needed). Strict:
    a wrong JSON type, an unknown key, an unknown processor or an option graphkiln does not
    reproduce (pan-and-scan, a size form the processor would not take, ...) is a one-line
    ValueError saying what to change.
    """
    if not isinstance(d, dict):
        raise ValueError(f"{_WHERE} must hold a JSON object (got {type(d).__name__})")
    if "auto_map" in d:
        raise ValueError(f"{_WHERE} has auto_map: its image processor is Python code of the checkpoint's own, which "
                         "graphkiln does not run; use a checkpoint with a transformers image processor")
    cls = processor_class_name(d, model_type)
    if cls not in _DEFAULTS:
        raise ValueError(f"{_WHERE}: image processor {_show(cls)} is not supported (graphkiln reproduces "
                         f"{', '.join(_DEFAULTS)}): use a checkpoint with one of these")
    kind = _KIND_OF[cls]
    defaults = _DEFAULTS[cls]
    known = set(defaults) | set(_INFO_KEYS) | set(_NEUTRAL) | {"do_center_crop", "crop_size", "do_pad"}
    if kind == "qwen2_vl":
        known |= set(_QWEN_KEYS)
    if kind == "gemma3":
        known |= set(_PAS_KEYS) | {"do_pan_and_scan"}
    for key in d:
        if key not in known:
            raise ValueError(f"{_WHERE}: {_show(key)} is not an option of {cls} that graphkiln reproduces: "
                             f"remove it if it has no effect, or use a checkpoint without it")

    for key, typ in _INFO_KEYS.items():
        if d.get(key) is not None and type(d[key]) is not typ:
            raise ValueError(f"{_WHERE}: {key} must be a {typ.__name__} (got {_show(d[key])})")
    for key, allowed in _NEUTRAL.items():
        if d.get(key) is not None and d[key] not in allowed:
            raise ValueError(f"{_WHERE}: {key} {_show(d[key])} is not supported (graphkiln takes "
                             f"{' or '.join(map(_show, allowed + (None,)))}): remove it")

    def get(key: str) -> Any:
        # a key left out takes the class default; a null one stays None, as in transformers (its
        # ImageProcessingMixin.__init__ sets the instance attribute to None first): None is false
        # for a flag and refused where a value is needed
        return d[key] if key in d else defaults.get(key)

    flags = {}
    for key in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb", "do_center_crop", "do_pad",
                "default_to_square", "do_pan_and_scan"):
        value = get(key)
        if value is not None and type(value) is not bool:
            raise ValueError(f"{_WHERE}: {key} must be true, false or null (got {_show(value)})")
        flags[key] = bool(value)

    def needed(key: str, flag: str) -> Any:
        value = get(key)
        if value is None and flags[flag]:
            raise ValueError(f"{_WHERE}: {key} is null but {flag} is true (transformers would fail too): set {key} "
                             "or remove it for the default")
        return defaults[key] if value is None else value

    if flags["do_pan_and_scan"]:
        raise ValueError(f"{_WHERE}: do_pan_and_scan is true: graphkiln does not implement Gemma3's pan-and-scan "
                         "crops; set it to false (or null) to export this model")
    for key in _PAS_KEYS:
        if d.get(key) is not None and type(d[key]) not in (int, float):
            raise ValueError(f"{_WHERE}: {key} must be a number or null (got {_show(d[key])})")

    resample = needed("resample", "do_resize")
    if type(resample) is not int or resample not in _RESAMPLE_NAMES:
        raise ValueError(f"{_WHERE}: resample must be one of Pillow's filters 0-5 "
                         f"({', '.join(f'{v}={k}' for k, v in sorted(RESAMPLE.items(), key=lambda kv: kv[1]))}) "
                         f"(got {_show(resample)})")
    rescale_factor = needed("rescale_factor", "do_rescale")
    if type(rescale_factor) not in (int, float):
        raise ValueError(f"{_WHERE}: rescale_factor must be a number (got {_show(rescale_factor)})")
    mean = _triple(needed("image_mean", "do_normalize"), "image_mean")
    std = _triple(needed("image_std", "do_normalize"), "image_std")

    fields: dict[str, Any] = dict(
        kind=kind, resample=_RESAMPLE_NAMES[resample], do_resize=flags["do_resize"], do_rescale=flags["do_rescale"],
        rescale_factor=float(rescale_factor), do_normalize=flags["do_normalize"], image_mean=mean, image_std=std,
        do_convert_rgb=flags["do_convert_rgb"])

    if kind == "qwen2_vl":
        # Qwen2VLImageProcessor.__init__: a null size is the class default, and top-level
        # min_pixels / max_pixels override the size dict's edges
        size = _size_dict(defaults["size"] if d.get("size") is None else d["size"], "size", flags["default_to_square"])
        for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if d.get(key) is not None:
                size[edge] = _int(d[key], key)
                size.pop(key, None)
        if set(size) != {"shortest_edge", "longest_edge"}:
            raise ValueError(f"{_WHERE}: {cls} needs size {{\"shortest_edge\": min_pixels, \"longest_edge\": "
                             f"max_pixels}} (or min_pixels and max_pixels), got size keys {sorted(size)}")
        fields.update(min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"],
                      **{k: _int(get(k), k) for k in ("patch_size", "temporal_patch_size", "merge_size")})
        if not flags["do_resize"]:
            raise ValueError(f"{_WHERE}: do_resize is {_show(d.get('do_resize'))}: {cls} needs its smart resize for "
                             "the patch grid; set it to true")
    else:
        if flags["do_resize"]:
            size = _size_dict(needed("size", "do_resize"), "size", flags["default_to_square"])
            if set(size) == {"height", "width"}:
                fields["size"] = (size["height"], size["width"])
            elif set(size) == {"shortest_edge"} and kind != "gemma3":
                fields["shortest_edge"] = size["shortest_edge"]
            else:
                raise ValueError(f"{_WHERE}: size with keys {sorted(size)} is not supported for {cls} (graphkiln "
                                 "takes {\"height\", \"width\"}" + (" or {\"shortest_edge\"}" if kind != "gemma3" else "")
                                 + ")")
        # Gemma3ImageProcessor never center-crops (its _preprocess has no crop step)
        if flags["do_center_crop"] and kind != "gemma3":
            crop = _size_dict(needed("crop_size", "do_center_crop"), "crop_size", True)
            if set(crop) != {"height", "width"}:
                raise ValueError(f"{_WHERE}: crop_size must have height and width (got keys {sorted(crop)})")
            fields.update(do_center_crop=True, crop_size=(crop["height"], crop["width"]))
        if cls == "LlavaImageProcessor":
            fields["pad_to_square"] = flags["do_pad"]
        elif flags["do_pad"] and d.get("pad_size") is not None:  # (pad_size is refused above anyway)
            raise ValueError(f"{_WHERE}: do_pad with pad_size is not supported: remove them")
        # otherwise do_pad pads a batch to its largest image, and every image comes out the same size
    try:
        return ImagePreprocessing(**fields).validated(what="")
    except ValueError as exc:
        raise ValueError(f"{_WHERE} ({cls}): {exc}: fix {_WHERE} or use a checkpoint graphkiln supports") from None


def _int(value: Any, name: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{_WHERE}: {name} must be an integer (got {_show(value)})")
    return value


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if type(value) in (int, float):  # one value for every channel, as transformers' normalize takes it
        value = [value] * 3
    if not isinstance(value, (list, tuple)) or len(value) != 3 or any(type(v) not in (int, float) for v in value):
        raise ValueError(f"{_WHERE}: {name} must be a number or a list of 3 numbers, one per RGB channel "
                         f"(got {_show(value)})")
    return tuple(float(v) for v in value)


def _size_dict(value: Any, name: str, default_to_square: bool) -> dict[str, int]:
    """transformers' get_size_dict: an int is (n, n) or a shortest edge, a 2-list (height, width)."""
    if type(value) is int:
        size = {"height": value, "width": value} if default_to_square else {"shortest_edge": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        size = {"height": value[0], "width": value[1]}
    elif isinstance(value, dict):
        size = dict(value)
    else:
        raise ValueError(f"{_WHERE}: {name} must be an integer, [height, width] or a dict (got {_show(value)})")
    if set(size) not in _VALID_SIZE_KEYS:
        raise ValueError(f"{_WHERE}: {name} keys {sorted(size)} are not a size transformers takes")
    for key, v in size.items():
        if type(v) is not int:
            raise ValueError(f"{_WHERE}: {name}.{key} must be an integer (got {_show(v)})")
    return size


# ---------------------------------------------------------------------------------------------
# loading

# formats Image.open may try (Pillow also opens EPS through Ghostscript, PSD, FITS, ...: not for
# untrusted bytes); JPEG covers MPO
Image.init()
SAFE_FORMATS = tuple(f for f in ("PNG", "JPEG", "GIF", "BMP", "WEBP", "TIFF", "PPM", "AVIF") if f in Image.OPEN)
_FORMATS_TEXT = "PNG, JPEG, GIF, BMP, WebP, TIFF, PPM" + (", AVIF" if "AVIF" in SAFE_FORMATS else "")


def load_image(source: Any, max_pixels: int) -> Image.Image:
    """An RGB PIL image from ``source``, converted as transformers converts that kind of input:

    - a path (str / os.PathLike) or the bytes of an image file: decoded as
      ``transformers.image_utils.load_image`` decodes a file (what a processor does with a path):
      the first frame of an animated image, EXIF orientation applied, ``convert("RGB")`` (an alpha
      channel is dropped, not composited). Formats: PNG, JPEG, GIF, BMP, WebP, TIFF, PPM (AVIF).
    - a PIL image: as the processors' ``convert_to_rgb`` (transparency composited onto white,
      other modes ``convert("RGB")``; no EXIF rotation); a lazily opened one is decoded here.
    - a numpy array, ``uint8`` ``[H, W]`` (grey) or ``[H, W, C]`` with C 1, 3 or 4 (channels last):
      as ``convert_to_rgb`` on an array (grey repeated, RGBA composited onto white and rounded).

    ``max_pixels`` bounds width * height, checked from the file header before any pixel is
    decoded (and Pillow's own decompression-bomb limit, ``Image.MAX_IMAGE_PIXELS``, applies too).
    Refusals are ``ImageError``: a missing or unreadable file, not an image, a truncated or
    corrupt one (decoded in full here, so it cannot fail later), too many pixels, an array of the
    wrong dtype or shape.
    """
    if type(max_pixels) is not int or max_pixels <= 0:
        raise ValueError(f"max_pixels must be a positive int (got {max_pixels!r})")
    if isinstance(source, (str, os.PathLike)):
        return _load_file(source, max_pixels)
    if isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise ImageError("the image data is empty (0 bytes): pass the contents of an image file")
        return _decode_file(io.BytesIO(bytes(source)), "the image data", max_pixels)
    if isinstance(source, Image.Image):
        return _from_pil(source, max_pixels)
    if isinstance(source, np.ndarray):
        return _from_array(source, max_pixels)
    raise ImageError(f"an image must be a file path, bytes, a PIL image or a numpy array (got "
                     f"{type(source).__name__})")


def _load_file(source: str | os.PathLike, max_pixels: int) -> Image.Image:
    path = os.fspath(source)
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    what = f"image file {_show(path, 120)}"
    if not path:
        raise ImageError("the image path is empty: pass the path of an image file")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ImageError(f"{what} does not exist: check the path") from None
    except OSError as exc:
        raise ImageError(f"cannot read {what} ({exc.strerror or type(exc).__name__}): check the path and its "
                         "permissions") from None
    if stat.S_ISDIR(st.st_mode):
        raise ImageError(f"{what} is a directory: pass the path of an image file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or a device could block or never end
        raise ImageError(f"{what} is not a regular file: pass the path of an image file")
    if st.st_size == 0:
        raise ImageError(f"{what} is empty: pass the path of an image file")
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise ImageError(f"cannot read {what} ({exc.strerror or type(exc).__name__}): check its permissions") from None
    with f:
        return _decode_file(f, what, max_pixels)


def _open(fp: Any, what: str, max_pixels: int) -> Image.Image:
    """Image.open (header only) and the pixel limit, before any pixel is decoded."""
    try:
        with warnings.catch_warnings():  # above MAX_IMAGE_PIXELS (not 2x): refused below or allowed on purpose
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(fp, formats=SAFE_FORMATS)
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what} is too large to decode ({_one_line(exc)}): downscale it first") from None
    except UnidentifiedImageError:
        raise ImageError(f"{what} is not an image in a supported format ({_FORMATS_TEXT}): pass an image file") from None
    except Exception as exc:  # a decoder's header parser on hostile bytes: any failure means a bad file
        raise ImageError(f"{what} is not a valid image ({_one_line(exc)}): re-save or re-download it") from None
    _check_pixels(img.size, what, max_pixels)
    return img


def _check_pixels(size: tuple[int, int], what: str, max_pixels: int) -> None:
    width, height = size
    if width <= 0 or height <= 0:
        raise ImageError(f"{what} has no pixels ({width}x{height}): pass a non-empty image")
    if width * height > max_pixels:
        raise ImageError(f"{what} is {width}x{height} = {width * height} pixels, more than the limit of {max_pixels}: "
                         "downscale it first or raise the pixel limit")


def _decode(img: Image.Image, what: str) -> None:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()  # a full decode: a truncated or corrupt file fails here, not later
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{what} is too large to decode ({_one_line(exc)}): downscale it first") from None
    except Exception as exc:  # OSError (truncated), SyntaxError (bad PNG chunk), ValueError, EOFError, zlib.error ...
        raise ImageError(f"{what} is truncated or corrupt ({_one_line(exc)}): re-save or re-download it") from None


def _decode_file(fp: Any, what: str, max_pixels: int) -> Image.Image:
    img = _open(fp, what, max_pixels)
    _decode(img, what)
    try:
        img = ImageOps.exif_transpose(img)  # as transformers.image_utils.load_image
        rgb = img.convert("RGB")
    except Exception as exc:
        raise ImageError(f"{what} cannot be converted to RGB ({_one_line(exc)}): re-save it as an RGB image") from None
    return rgb


def _from_pil(img: Image.Image, max_pixels: int) -> Image.Image:
    what = f"the PIL image ({img.mode} {img.size[0]}x{img.size[1]})"
    _check_pixels(img.size, what, max_pixels)
    _decode(img, what)
    return _convert_to_rgb(img, what)


def _convert_to_rgb(img: Image.Image, what: str) -> Image.Image:
    """transformers.image_transforms.convert_to_rgb on a PIL image."""
    try:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        return img.convert("RGB")
    except Exception as exc:
        raise ImageError(f"{what} cannot be converted to RGB ({_one_line(exc)}): pass an RGB, RGBA, L or P image") from None


def _from_array(a: np.ndarray, max_pixels: int) -> Image.Image:
    what = f"the image array (shape {list(a.shape)}, {a.dtype})"
    if a.dtype != np.uint8:
        raise ImageError(f"{what} must be uint8 (0-255): convert it, e.g. (x * 255).round().astype(np.uint8)")
    if a.ndim == 3 and a.shape[-1] not in (1, 3, 4):
        raise ImageError(f"{what} must be [height, width, channels] with 1, 3 or 4 channels last "
                         "(a channels-first array: np.moveaxis(a, 0, -1))")
    if a.ndim not in (2, 3):
        raise ImageError(f"{what} must be [height, width] or [height, width, channels]")
    _check_pixels((a.shape[1], a.shape[0]), what, max_pixels)
    if a.ndim == 2:
        a = a[:, :, None]
    channels = a.shape[-1]
    if channels == 1:
        a = np.repeat(a, 3, axis=-1)
    elif channels == 4:  # convert_to_rgb's array branch: blend onto white in float64, round
        alpha = a[..., 3:4] / 255
        a = np.round(alpha * a[..., :3] + (1 - alpha) * 255).astype(np.uint8)
    return Image.fromarray(np.ascontiguousarray(a))


def content_hash(image: Image.Image) -> str:
    """sha256 (hex) of an image's decoded RGB pixels and size: the embedding cache key. Equal for
    the same pixels however they arrived (file, bytes, array); the cache must also key by the
    artifact (its preprocessing and vision graph)."""
    if not isinstance(image, Image.Image):
        raise ImageError(f"content_hash takes a loaded PIL image (got {type(image).__name__}): use load_image first")
    if image.mode != "RGB":
        image = _convert_to_rgb(image, f"the PIL image ({image.mode})")
    h = hashlib.sha256(b"graphkiln-image-rgb8-v1\0")
    h.update(np.array(image.size, dtype="<u8").tobytes())
    h.update(image.tobytes())
    return h.hexdigest()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."


# ---------------------------------------------------------------------------------------------
# preprocessing

@dataclass(frozen=True, eq=False)
class PreprocessedImages:
    """The vision graph's input for a list of images.

    ``pixel_values``: float32, ``[n, 3, H, W]`` for clip / siglip / gemma3; for qwen2_vl the
    patches of every image one after the other, ``[sum(t * h * w), 3 * temporal_patch_size *
    patch_size**2]``. ``image_sizes``: (height, width) of each processed image (after resize and
    crop). ``grids``: qwen2_vl's (t, h, w) per image (transformers' ``image_grid_thw``), else None.
    ``rows``: how many rows of ``pixel_values`` each image has (1 for the NCHW kinds)."""

    pixel_values: np.ndarray
    image_sizes: tuple[tuple[int, int], ...]
    grids: tuple[tuple[int, int, int], ...] | None
    rows: tuple[int, ...]

    @property
    def image_grid_thw(self) -> np.ndarray | None:
        return None if self.grids is None else np.array(self.grids, dtype=np.int64).reshape(-1, 3)

    def num_tokens(self, rule: PlaceholderRule) -> tuple[int, ...]:
        """Placeholder tokens each image expands to in the prompt."""
        grids = self.grids or (None,) * len(self.image_sizes)
        return tuple(rule.num_tokens(s, g) for s, g in zip(self.image_sizes, grids))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's smart_resize (transformers 5.24), operation for operation; ImageError beyond its
    aspect-ratio limit of 200."""
    if max(height, width) / min(height, width) > 200:
        raise ImageError(f"the image is {width}x{height}, an aspect ratio above 200, which Qwen2-VL's processor "
                         "refuses: crop or pad it first")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _resize_target(spec: ImagePreprocessing, height: int, width: int) -> tuple[int, int] | None:
    """(height, width) the image is resized to (after LLaVA's pad), None when it is not resized."""
    if spec.kind == "qwen2_vl":
        return smart_resize(height, width, spec.patch_size * spec.merge_size, spec.min_pixels, spec.max_pixels)
    if not spec.do_resize:
        return None
    if spec.size is not None:
        return spec.size
    # get_resize_output_image_size(default_to_square=False): the long edge truncated to int
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = spec.shortest_edge, int(spec.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def plan(spec: ImagePreprocessing, width: int, height: int) -> tuple[tuple[int, int], tuple[int, int, int] | None]:
    """What ``preprocess`` makes of a ``width`` x ``height`` image, without its pixels: the
    processed (height, width) and, for qwen2_vl, the grid (t, h, w). For counting placeholder
    tokens before preprocessing (``PlaceholderRule.num_tokens(*plan(...))``)."""
    if spec.pad_to_square:
        height = width = max(height, width)
    target = _resize_target(spec, height, width)
    size = (height, width) if target is None else target
    if spec.kind == "qwen2_vl":
        return size, (1, size[0] // spec.patch_size, size[1] // spec.patch_size)
    return (spec.crop_size if spec.do_center_crop else size), None


@lru_cache(maxsize=32)
def _lut(spec: ImagePreprocessing) -> np.ndarray:
    """[3, 256] float32: each channel's output value for each uint8 input, computed with exactly
    transformers' operations (rescale: float64 multiply, cast to float32; normalize: float32)."""
    x: np.ndarray = np.broadcast_to(np.arange(256, dtype=np.uint8), (3, 256))
    if spec.do_rescale:
        x = (x.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    if spec.do_normalize:
        x = x.astype(np.float32)
        mean = np.array(spec.image_mean, dtype=np.float32)[:, None]
        std = np.array(spec.image_std, dtype=np.float32)[:, None]
        x = (x - mean) / std
    return np.ascontiguousarray(x, dtype=np.float32)


def _center_crop(a: np.ndarray, crop_h: int, crop_w: int) -> np.ndarray:
    """transformers.image_transforms.center_crop on an [H, W, C] array: zero-padded when smaller."""
    h, w = a.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:  # (bottom <= h and right <= w follow)
        return a[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w) + a.shape[2:], dtype=a.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[top_pad:top_pad + h, left_pad:left_pad + w] = a
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def _pad_to_square(a: np.ndarray, mean: tuple[float, float, float]) -> np.ndarray:
    """LlavaImageProcessor.pad_to_square: centred on a square of int(255 * image_mean)."""
    h, w = a.shape[:2]
    if h == w:
        return a
    side = max(h, w)
    out = np.empty((side, side, 3), dtype=np.uint8)
    out[...] = np.array([int(m * 255) for m in mean], dtype=np.uint8)
    if w > h:
        start = (side - h) // 2
        out[start:start + h] = a
    else:
        start = (side - w) // 2
        out[:, start:start + w] = a
    return out


def _chw(a: np.ndarray, spec: ImagePreprocessing) -> np.ndarray:
    """[H, W, 3] uint8 -> [3, H, W] float32, rescaled and normalised through the lookup table."""
    lut = _lut(spec)
    out = np.empty((3,) + a.shape[:2], dtype=np.float32)
    for c in range(3):
        np.take(lut[c], a[..., c], out=out[c])
    return out


def _patchify(chw: np.ndarray, spec: ImagePreprocessing) -> tuple[np.ndarray, int, int]:
    """Qwen2VLImageProcessorPil.patchify."""
    p, m, t = spec.patch_size, spec.merge_size, spec.temporal_patch_size
    c, height, width = chw.shape
    gh, gw = height // p, width // p
    x = chw.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # (gh/m, gw/m, m, m, C, p, p)
    x = np.broadcast_to(x[:, :, :, :, :, None], x.shape[:5] + (t,) + x.shape[5:])
    return x.reshape(gh * gw, c * t * p * p), gh, gw


def _rgb_input(image: Any, spec: ImagePreprocessing, index: int) -> Image.Image:
    if not isinstance(image, Image.Image):
        raise ImageError(f"image {index} is a {type(image).__name__}, not a PIL image: load it with "
                         "graphkiln.imaging.load_image first")
    if image.mode == "RGB":
        return image
    if not spec.do_convert_rgb:
        raise ImageError(f"image {index} is {image.mode}, and this model's processor does not convert to RGB "
                         "(do_convert_rgb is false): pass an RGB image")
    return _convert_to_rgb(image, f"image {index} ({image.mode})")


def preprocess(images: Sequence[Image.Image], spec: ImagePreprocessing) -> PreprocessedImages:
    """The pixel values ``spec``'s vision graph takes for ``images`` (PIL images, as ``load_image``
    returns them; a non-RGB one is converted as the processor converts it), equal to what
    transformers' PIL-backed processor makes of the same images within float32 rounding (in
    practice bit for bit). An empty list gives zero rows."""
    if isinstance(images, Image.Image):
        images = [images]
    resample = RESAMPLE[spec.resample]
    arrays, sizes, grids = [], [], []
    for i, image in enumerate(images):
        img = _rgb_input(image, spec, i)
        width, height = img.size
        if spec.pad_to_square and width != height:
            img = Image.fromarray(_pad_to_square(np.asarray(img), spec.image_mean))
            width, height = img.size
        target = _resize_target(spec, height, width)
        if target is not None:
            th, tw = target
            if th * tw > MAX_INTERMEDIATE_PIXELS:
                raise ImageError(f"image {i} ({width}x{height}) would be resized to {tw}x{th} before cropping, more "
                                 f"than {MAX_INTERMEDIATE_PIXELS} pixels: crop it closer to a square first")
            img = img.resize((tw, th), resample=resample)
        a = np.asarray(img)
        if spec.do_center_crop:
            a = _center_crop(a, *spec.crop_size)
        chw = _chw(a, spec)
        sizes.append(chw.shape[1:])
        if spec.kind == "qwen2_vl":
            patches, gh, gw = _patchify(chw, spec)
            arrays.append(patches)
            grids.append((1, gh, gw))
        else:
            arrays.append(chw[None])
    if spec.kind == "qwen2_vl":
        dim = 3 * spec.temporal_patch_size * spec.patch_size * spec.patch_size
        pixel_values = np.concatenate(arrays) if arrays else np.zeros((0, dim), dtype=np.float32)
        rows = tuple(g[0] * g[1] * g[2] for g in grids)
        return PreprocessedImages(pixel_values, tuple(sizes), tuple(grids), rows)
    oh, ow = spec.output_size
    pixel_values = np.concatenate(arrays) if arrays else np.zeros((0, 3, oh, ow), dtype=np.float32)
    return PreprocessedImages(pixel_values, tuple(sizes), None, (1,) * len(arrays))
