"""A generated reply split into reasoning, content and tool calls: the layer the chat and
responses routes share (each shapes the pieces into its own JSON and events).

Per request, ``Reply.feed`` takes each token event's text and id and returns a ``Piece``. The
reasoning session (``graphkiln.runtime.reasoning``) goes first, the tool-call parser
(``graphkiln.runtime.tools``) reads what it leaves as content; for a format whose calls are
messages beside the thinking in one structure (harmony), the tool parser reads the raw stream
(it drops the analysis channel itself) and the reasoning session gives the reasoning only.
Invariant: the pieces of every ``feed`` and the final ``finish`` joined are the whole reply's
split, however the text was cut into deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphkiln.runtime.reasoning import ReasoningSession
from graphkiln.runtime.tools import ToolCall, ToolCallParser


@dataclass(frozen=True)
class Piece:
    reasoning: str = ""
    content: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __add__(self, other: "Piece") -> "Piece":
        return Piece(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


class Reply:
    def __init__(self, reasoning: ReasoningSession | None = None, tools: ToolCallParser | None = None,
                 tools_read_raw: bool = False) -> None:
        self.reasoning, self.tools, self.raw = reasoning, tools, tools_read_raw

    def feed(self, text: str, token_id: int = -1) -> Piece:
        return self._step(text, token_id, last=False)

    def finish(self) -> Piece:
        return self._step("", -1, last=True)

    def _step(self, text: str, token_id: int, last: bool) -> Piece:
        thought, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.finish() if last else self.reasoning.feed(text, token_id)
            thought, content = split.reasoning, split.content
        if self.tools is None:
            return Piece(thought, content)
        if self.raw:
            parsed = self.tools.finish() if last else self.tools.feed(text, token_id)
        elif last:
            parsed = self.tools.feed(content, -1) + self.tools.finish() if content else self.tools.finish()
        else:
            parsed = self.tools.feed(content, token_id)
        return Piece(thought, parsed.content, parsed.calls)

    def whole(self, pieces) -> Piece:
        """A whole reply's split: every (text, token id) fed, then finished."""
        out = Piece()
        for text, token in pieces:
            out += self.feed(text, token)
        return out + self.finish()
