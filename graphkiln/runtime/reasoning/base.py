"""What every reasoning format shares: ``Split``, the session and format interfaces, the
artifact's special tokens (markers that decoding drops) and the Lark spelling of a marker."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar, Iterable


@dataclass(frozen=True)
class Split:
    """A piece of output: ``reasoning`` (the thinking) and ``content`` (the answer), either empty."""

    reasoning: str = ""
    content: str = ""

    def __add__(self, other: "Split") -> "Split":
        return Split(self.reasoning + other.reasoning, self.content + other.content)


class ReasoningSession:
    """One request's splitter. Invariant: the reasoning and content of every ``feed`` and the
    final ``finish`` joined are the output's text less the format's markers; text that may be the
    start of a marker is held back until the next delta (or ``finish``) settles it."""

    def feed(self, text: str, token_id: int = -1) -> Split:
        raise NotImplementedError

    def finish(self) -> Split:
        raise NotImplementedError


class ReasoningFormat:
    """One output format (a module below this package). ``specials``: the artifact's special
    tokens, text -> id (``special_tokens``)."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    # whether this output's tool calls are parts of one structure with the thinking (harmony: both
    # are messages), so the tool-call format's grammar writes the thinking itself (no frame around
    # it) and its parser reads the raw reply (the thinking is the reasoning session's only)
    tools_see_reasoning: ClassVar[bool] = False

    def __init__(self, specials: dict[str, int]) -> None:
        self.specials = specials

    @classmethod
    def detects(cls, template: str) -> bool:
        raise NotImplementedError

    def session(self, prompt: str) -> ReasoningSession:
        """A splitter for the output that follows ``prompt`` (the rendered prompt text)."""
        raise NotImplementedError

    def frame(self, prompt: str) -> str:
        """Lark (``GenerationConfig.constraint_frame``): the thinking this prompt lets the model
        write, then ``@constraint``."""
        raise NotImplementedError

    def literal(self, marker: str) -> str:
        """``marker`` in Lark: the special token by id where the artifact has one (a grammar's
        string never matches a special token), else the text."""
        token = self.specials.get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)


def special_tokens(tokenizer) -> dict[str, int]:
    """The added tokens ``tokenizer`` (``tokenizers.Tokenizer``, or None) marks special: text -> id."""
    if tokenizer is None:
        return {}
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def split_all(session: ReasoningSession, pieces: Iterable[tuple[str, int]]) -> Split:
    """A whole output's split: every (text, token id) delta fed, then finished."""
    out = Split()
    for text, token in pieces:
        out += session.feed(text, token)
    return out + session.finish()


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
