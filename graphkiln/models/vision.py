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
the patch grid of ``runtime.vision_groups``) says so with a ``graph_io(hidden, dtype)`` method
returning (input specs, output specs, example args, dynamic shapes); ``export.vision_export``
traces it with those.

Torch is imported only by ``build``; parsing stays torch-free like the decoder families'.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from graphkiln.imaging import ImagePreprocessing, PlaceholderRule


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
