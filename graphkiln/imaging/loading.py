"""Untrusted image input (a path, bytes, a PIL image, a uint8 array) -> an RGB PIL image, converted
as transformers converts that kind of input; only safe formats, the pixel limit checked from the
header before any pixel is decoded; ``ImageError`` for every refusal; ``content_hash``, the
embedding cache key."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import warnings
from typing import Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import show_json


class ImageError(GraphkilnError, ValueError):
    """An image graphkiln refuses: ``str(err)`` is one line naming the problem and the fix."""


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
    what = f"image file {show_json(path, 120)}"
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
    return convert_to_rgb(img, what)


def convert_to_rgb(img: Image.Image, what: str) -> Image.Image:
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
        image = convert_to_rgb(image, f"the PIL image ({image.mode})")
    h = hashlib.sha256(b"graphkiln-image-rgb8-v1\0")
    h.update(np.array(image.size, dtype="<u8").tobytes())
    h.update(image.tobytes())
    return h.hexdigest()


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
