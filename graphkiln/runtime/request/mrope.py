"""Multimodal rotary positions (M-RoPE, Qwen2-VL / Qwen2.5-VL) of one request: numpy only.

transformers' ``Qwen2_5_VLModel.get_rope_index`` for images, per prompt:

- text tokens: one position per token, the same in all three streams (temporal, height, width),
  continuing from ``current``, the next free position;
- an image with grid ``(t, h, w)`` (patches) has ``t * (h/m) * (w/m)`` placeholder tokens (m: the
  merge size) in (t, row, column) order; token (ti, r, c) gets ``(current + ti, current + r,
  current + c)``; then ``current`` advances by ``max(h, w) / m``, so the text after an image
  continues from the image's largest position + 1 (for t = 1);
- ``rope_delta`` = largest prompt position + 1 - prompt length: generated token at cache position
  p has rotary position ``p + rope_delta`` in every stream (``PromptLayout.rope_positions_at``).

Two images next to each other (no text between) are two images here; transformers' grouping of
consecutive image tokens would read them as one (real prompts put vision start/end tokens
between images, where the two agree).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from graphkiln.errors import GraphkilnError


def rope_positions(prompt_len: int, spans: Sequence[tuple[int, int]], grids: Sequence[tuple[int, int, int]],
                   merge: int) -> tuple[np.ndarray, int]:
    """(int64 [3, prompt_len] positions, rope_delta) for a prompt whose image placeholder tokens
    are ``spans`` (start, end) with grids ``grids`` (see the module docstring)."""
    out = np.empty((3, prompt_len), np.int64)
    current = at = 0
    for (start, end), (t, h, w) in zip(spans, grids):
        gt, gh, gw = int(t), int(h) // merge, int(w) // merge
        if end - start != gt * gh * gw:
            raise GraphkilnError(f"an image of grid {t}x{h}x{w} has {end - start} placeholder tokens, not "
                                 f"{gt * gh * gw}: the artifact's vision spec is inconsistent; re-export it")
        out[:, at:start] = np.arange(current, current + start - at)
        current += start - at
        ti, r, c = np.meshgrid(np.arange(gt), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, start:end] = np.stack([ti.ravel(), r.ravel(), c.ravel()]) + current
        current += max(gh, gw)
        at = end
    out[:, at:] = np.arange(current, current + prompt_len - at)
    delta = int(out.max(initial=-1)) + 1 - prompt_len
    return out, delta


def with_rope_positions(layout, ids: Sequence[int], images: Sequence, vision_spec):
    """``layout`` (``runtime.prompt_layout.PromptLayout``) with the request's M-RoPE positions and
    ``rope_delta``; ``images`` are the request's ``runtime.backends.vision.ImageInput`` in prompt order
    (each carrying its grid), ``vision_spec`` the manifest's ``VisionSpec``."""
    if len(images) != len(layout.image_spans):
        raise GraphkilnError(f"{len(images)} images for {len(layout.image_spans)} image spans: report this")
    grids = []
    for k, im in enumerate(images):
        if getattr(im, "grid", None) is None:
            raise GraphkilnError(f"image {k} has no patch grid, which M-RoPE positions need: the artifact's "
                                 "preprocessing must be qwen2_vl; re-export it")
        grids.append(im.grid)
    merge = vision_spec.preprocessing.merge_size or 1
    positions, delta = rope_positions(layout.prompt_len, layout.image_spans, grids, merge)
    return dataclasses.replace(layout, rope_positions=positions, rope_delta=delta)
