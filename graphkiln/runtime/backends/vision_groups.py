"""The patch grid of a windowed vision tower (Qwen2.5-VL), computed in numpy from the images' grids.

Qwen2.5-VL's tower attends within windows of ``window x window`` merge units in most layers and
within a whole image in the others; which patches share a window follows from each image's grid
``(t, h, w)``, a data-dependent ragged structure the vision graph cannot derive cheaply. The runtime
computes it here and feeds it as graph inputs (roles in ``graphkiln.manifest.GRAPH_ROLES["vision"]``):

  patch_positions int64 [patches, 2]      (row, column) of each patch in its image's grid: 2-D rotary
  window_groups   int64 [windows, L]      the patches of each window, padded with ``patches`` (a row
                                          of zeros the graph appends); L = (window * merge)**2, static
  window_slots    int64 [patches]         each patch's flat index in ``window_groups`` (the way back)
  image_groups    int64 [images, image_patches], image_slots int64 [patches]: the same per image
                                          (the full-attention layers)

Patches are in the processor's order (``imaging.preprocess``: merge-window-major), which the graph
keeps throughout: attention within a group does not depend on the order of its members, so
transformers' window permutation (``window_index``) and its inverse are not needed, and the merger
reads four consecutive rows as one merge unit as before. Torch-free; export uses it for its
example inputs.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

GROUP_ROLES = ("patch_positions", "window_groups", "window_slots", "image_groups", "image_slots")


def window_area(merge: int, window: int) -> int:
    """L: patches in one full window of ``window`` x ``window`` merge units."""
    return (window * merge) ** 2


def window_from_area(area: int, merge: int) -> int:
    """The window (in merge units) whose area is ``area`` patches; ValueError unless it is one."""
    side = math.isqrt(area) if isinstance(area, int) and area > 0 else 0
    if side * side != area or side % merge or side == 0:
        raise ValueError(f"window of {area} patches is not a square of whole {merge}x{merge} merge units")
    return side // merge


def _groups(ids: np.ndarray, count: int, width: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Patches grouped by ``ids`` (0..count-1, every group non-empty), members in patch order,
    padded to ``width`` (None: the largest group) with len(ids); and each patch's flat slot."""
    n = len(ids)
    order = np.argsort(ids, kind="stable")
    sizes = np.bincount(ids, minlength=count)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rank = np.arange(n) - starts[ids[order]]
    width = int(sizes.max(initial=0)) if width is None else width
    groups = np.full((count, width), n, np.int64)
    groups[ids[order], rank] = order
    slots = np.empty(n, np.int64)
    slots[order] = ids[order] * width + rank
    return groups, slots


def patch_groups(grids: Sequence[Sequence[int]], merge: int, window: int) -> dict[str, np.ndarray]:
    """The inputs above for images with grids ``(t, h, w)`` (patches; h and w multiples of ``merge``),
    windows of ``window`` x ``window`` merge units, as transformers' Qwen2.5-VL tower groups them
    (``get_vision_window_index``: windows tile each frame's merge-unit grid from its top-left
    corner; the last row/column of windows may be partial)."""
    positions, window_ids, image_ids = [], [], []
    windows = 0
    for i, (t, h, w) in enumerate(grids):
        t, h, w = int(t), int(h), int(w)
        mh, mw = h // merge, w // merge
        r = np.arange(h * w)
        unit, within = r // (merge * merge), r % (merge * merge)
        urow, ucol = unit // mw, unit % mw
        rows, cols = urow * merge + within // merge, ucol * merge + within % merge
        wh, ww = -(-mh // window), -(-mw // window)
        frame_windows = (urow // window) * ww + ucol // window
        for f in range(t):
            positions.append(np.stack([rows, cols], axis=1))
            window_ids.append(windows + f * wh * ww + frame_windows)
        windows += t * wh * ww
        image_ids.append(np.full(t * h * w, i, np.int64))
    if not positions:
        return {"patch_positions": np.zeros((0, 2), np.int64),
                "window_groups": np.zeros((0, window_area(merge, window)), np.int64),
                "window_slots": np.zeros(0, np.int64), "image_groups": np.zeros((0, 0), np.int64),
                "image_slots": np.zeros(0, np.int64)}
    window_groups, window_slots = _groups(np.concatenate(window_ids), windows, window_area(merge, window))
    image_groups, image_slots = _groups(np.concatenate(image_ids), len(grids), None)
    return {"patch_positions": np.concatenate(positions).astype(np.int64), "window_groups": window_groups,
            "window_slots": window_slots, "image_groups": image_groups, "image_slots": image_slots}
