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

One job a module: ``spec`` (the dataclasses and their validation), ``processor_config``
(preprocessor_config.json), ``loading`` (untrusted image input), ``preprocess`` (pixels for the
vision graph). Import from ``graphkiln.imaging``: the names below are the public ones.
"""

from graphkiln.imaging.loading import SAFE_FORMATS, ImageError, content_hash, load_image
from graphkiln.imaging.preprocess import PreprocessedImages, plan, preprocess, smart_resize
from graphkiln.imaging.processor_config import (IMAGENET_STANDARD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD,
                                                preprocessing_from_config, processor_class_name)
from graphkiln.imaging.spec import (KINDS, MAX_INTERMEDIATE_PIXELS, MAX_SIDE, MAX_SPEC_PIXELS, RESAMPLE,
                                    ImagePreprocessing, PlaceholderRule, check_compatible)

__all__ = [
    "IMAGENET_STANDARD", "KINDS", "MAX_INTERMEDIATE_PIXELS", "MAX_SIDE", "MAX_SPEC_PIXELS", "OPENAI_CLIP_MEAN",
    "OPENAI_CLIP_STD", "RESAMPLE", "SAFE_FORMATS", "ImageError", "ImagePreprocessing", "PlaceholderRule",
    "PreprocessedImages", "check_compatible", "content_hash", "load_image", "plan", "preprocess",
    "preprocessing_from_config", "processor_class_name", "smart_resize",
]
