"""The vision graph's input from RGB images, value for value as transformers' PIL processors
compute it: resize plan (``plan``, ``smart_resize``), Pillow resize, center crop or pad, rescale
and normalise through a lookup table, Qwen2-VL's patches (``preprocess`` -> ``PreprocessedImages``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import numpy as np
from PIL import Image

from graphkiln.imaging.loading import ImageError, convert_to_rgb
from graphkiln.imaging.spec import MAX_INTERMEDIATE_PIXELS, RESAMPLE, ImagePreprocessing, PlaceholderRule


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
    return convert_to_rgb(image, f"image {index} ({image.mode})")


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
