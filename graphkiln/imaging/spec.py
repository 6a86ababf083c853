"""What a model's image processor does and how an image becomes placeholder tokens: the frozen,
strictly validated dataclasses the manifest embeds (``ImagePreprocessing``, ``PlaceholderRule``),
and their one-line validation errors."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from functools import cache
from typing import Annotated, Any, Literal, Sequence

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, model_validator, with_config

from graphkiln.untrusted import show_json


STRICT = ConfigDict(extra="forbid", strict=True)  # as graphkiln.manifest (which embeds these classes)

MAX_SIDE = 16384  # any configured height / width / edge
# any configured area (size, crop_size, min_pixels / max_pixels): 2.6x Qwen2.5-VL's largest
# max_pixels (12845056); a manifest is untrusted and must not make one image take gigabytes
MAX_SPEC_PIXELS = 1 << 25
# Pillow's filters by the names the manifest records; the values are PIL.Image.Resampling's (what
# preprocessor_config.json's "resample" holds)
RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
RESAMPLE_NAMES = {v: k for k, v in RESAMPLE.items()}
KINDS = ("clip", "siglip", "gemma3", "qwen2_vl")
# a resize before the center crop (CLIP's shortest edge) of a very elongated image can be huge
# (a 1x10000 image at shortest edge 336 is 336x3360000): refuse beyond this many pixels
MAX_INTERMEDIATE_PIXELS = MAX_SPEC_PIXELS

Side = Annotated[int, Field(gt=0, le=MAX_SIDE)]
Mean = Annotated[float, Field(ge=-1e6, le=1e6, allow_inf_nan=False)]
Std = Annotated[float, Field(ge=1e-6, le=1e6, allow_inf_nan=False)]


@with_config(STRICT)
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


@with_config(STRICT)
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
    got = "" if e["type"].startswith("value_error") else f" (got {show_json(e.get('input'))})"
    more = len(exc.errors()) - 1
    head = f"{what}: " if what else ""
    return f"{head}{where + ' ' if where else ''}{problem}{got}" + (f" (and {more} more)" if more else "")
