"""Per-token decoder inputs beyond ids and cache positions, for one request.

Some decoders take more per token than its id and cache position:

- ``rope_position_ids [3, batch, seq]`` (M-RoPE, Qwen2.5-VL): the rotary position of each token
  in three streams (temporal, height, width). Text tokens have the same value in all three; an
  image's tokens have their grid coordinates, and text after an image continues from the image's
  largest position + 1, so rotary positions fall behind cache positions by a per-request
  ``rope_delta`` that every later token keeps.
- ``lookahead [batch, seq]`` (Gemma3's images): how many positions past its own a token may also
  see (``graphkiln.Attention``); an image's tokens see to the image's last token.

A ``PromptLayout`` is built once per request before anything runs and answers those inputs for
any slice of the request's positions (prompt and generated), so a prefill chunk and a decode step
ask the same way; ``chunk_end`` keeps an image inside one prefill chunk (the lookahead of a
bidirectional image cannot reach into the next chunk). ``pack`` fills a step's batch arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

# Decoder input roles whose values a layout gives (graphkiln.manifest GRAPH_ROLES["decoder"]).
LAYOUT_ROLES = ("rope_position_ids", "lookahead")


@dataclass(frozen=True, eq=False)
class PromptLayout:
    """One request's per-token extras. Invariants: ``image_spans`` are ``(start, end)`` prompt
    positions (end exclusive) of each image's placeholder tokens, in order and disjoint;
    ``rope_positions`` is None or int64 ``[3, prompt_len]``; a token at position p >= prompt_len
    has rotary position ``p + rope_delta`` in every stream."""

    prompt_len: int
    image_spans: tuple[tuple[int, int], ...] = ()
    rope_positions: np.ndarray | None = None
    rope_delta: int = 0
    bidirectional_images: bool = False

    def rope_positions_at(self, start: int, n: int) -> np.ndarray:
        """int64 ``[3, n]``: rotary positions of positions start..start+n-1."""
        pos = np.arange(start, start + n, dtype=np.int64)
        out = np.broadcast_to(pos + self.rope_delta * (pos >= self.prompt_len), (3, n)).copy()
        if self.rope_positions is not None:
            inside = pos < self.prompt_len
            out[:, inside] = self.rope_positions[:, pos[inside]]
        return out

    def lookahead_at(self, start: int, n: int) -> np.ndarray:
        """int64 ``[n]``: extra positions each of start..start+n-1 may see (0 outside images)."""
        out = np.zeros(n, np.int64)
        if self.bidirectional_images:
            for s, e in self.image_spans:
                lo, hi = max(s, start), min(e, start + n)
                if lo < hi:
                    out[lo - start: hi - start] = (e - 1) - np.arange(lo, hi)
        return out

    def chunk_end(self, start: int, budget: int) -> int:
        """Where a prefill chunk from ``start`` with at most ``budget`` tokens should end: at
        start+budget or the prompt's end, pulled back to the start of an image it would split,
        unless that image starts at ``start`` (then the whole image, over budget if it must be)."""
        end = min(start + max(budget, 1), self.prompt_len)
        if not self.bidirectional_images:
            return end  # rotary positions and seam rows need no whole images
        for s, e in self.image_spans:
            if s < end < e:
                return e if s <= start else s
        return end


def pack(roles: Sequence[str], layouts: Sequence[PromptLayout | None], starts: np.ndarray, seq: int) -> dict[str, np.ndarray]:
    """A step's arrays for the layout ``roles`` the graph takes: row b covers positions
    ``starts[b] .. starts[b] + seq - 1`` of request ``layouts[b]`` (None: a text request or a
    padding row, whose positions are plain and causal). Padding tokens beyond a row's real ones
    get their own positions' values, which no real token reads."""
    out: dict[str, np.ndarray] = {}
    batch = len(layouts)
    if "rope_position_ids" in roles:
        rope = np.empty((3, batch, seq), np.int64)
        for b, (layout, start) in enumerate(zip(layouts, starts)):
            rope[:, b] = (layout.rope_positions_at(int(start), seq) if layout is not None
                          else np.arange(start, start + seq, dtype=np.int64))
        out["rope_position_ids"] = rope
    if "lookahead" in roles:
        ahead = np.zeros((batch, seq), np.int64)
        for b, (layout, start) in enumerate(zip(layouts, starts)):
            if layout is not None:
                ahead[b] = layout.lookahead_at(int(start), seq)
        out["lookahead"] = ahead
    return out


def needed_roles(input_roles: Mapping[str, str] | Sequence[str]) -> tuple[str, ...]:
    """The layout roles among a graph's input roles."""
    return tuple(r for r in LAYOUT_ROLES if r in input_roles)
