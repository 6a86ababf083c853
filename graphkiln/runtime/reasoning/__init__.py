"""Reasoning content: a reasoning model's thinking split from its answer.

One module per output format behind a registry, as model families are: ``think`` (``<think>…</think>``:
Qwen3, DeepSeek-R1, QwQ, SmolLM3 and the others that copied it) and ``harmony`` (gpt-oss: the
``analysis`` channel). A format is chosen from the artifact's chat template (``detect``) or by name
(``graphkiln serve --reasoning-parser NAME``, vLLM's names accepted as aliases: ``by_name``).

Per request, ``ReasoningFormat.session(prompt)`` gives a ``ReasoningSession``: it consumes the
generated text delta by delta (with each delta's token id, for formats whose markers are special
tokens that decoding drops) and returns ``Split(reasoning, content)`` pieces, so a streamed reply's
``delta.reasoning_content`` and ``delta.content`` and a whole reply's ``message.reasoning_content``
and ``message.content`` come from the same code (``split_all``). The rendered prompt says where the
output starts: a template that opens ``<think>`` in its generation prompt (DeepSeek-R1, Qwen3
thinking models) starts the output inside the thinking.

``ReasoningFormat.frame(prompt)`` is the Lark frame (``GenerationConfig.constraint_frame``) that
lets a request's JSON schema, regex, grammar or tool-call constraint apply after the thinking ends,
never to the thinking itself: the engine's grammar matches the thinking as free text up to its end
marker, then the constraint (``runtime.request.constraint._framed``). This is the grammar route
llguidance's own tool-calling tags take (lazy lexemes, nested grammars); vLLM instead gates its
grammar on ``reasoning_parser.is_reasoning_end(token_ids)`` inside the engine, which would need
the parser below the scheduler. The cost here is the mask computed during the thinking too.

Users: the server's chat and responses routes (``graphkiln.serve``); this package imports nothing
of the server.
"""

from __future__ import annotations

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.reasoning.base import ReasoningFormat, ReasoningSession, Split, special_tokens, split_all
from graphkiln.runtime.reasoning.harmony import Harmony
from graphkiln.runtime.reasoning.think import Think

# detection order: the first format whose markers the template writes
FORMATS: dict[str, type[ReasoningFormat]] = {cls.name: cls for cls in (Harmony, Think)}
ALIASES = {alias: cls.name for cls in FORMATS.values() for alias in cls.aliases}
NONE = "none"  # --reasoning-parser none: no split, even where the template has markers

__all__ = ["FORMATS", "ReasoningFormat", "ReasoningSession", "Split", "by_name", "detect", "load", "split_all"]


def names() -> list[str]:
    return sorted([*FORMATS, *ALIASES, NONE])


def by_name(name: str) -> type[ReasoningFormat] | None:
    """The format called ``name`` (its own name or a vLLM alias); None for ``none``."""
    if name == NONE:
        return None
    cls = FORMATS.get(ALIASES.get(name, name))
    if cls is None:
        raise GraphkilnError(f"unknown reasoning parser {name!r}: use one of {', '.join(names())}")
    return cls


def detect(template: str | None) -> type[ReasoningFormat] | None:
    """The format whose markers the chat template's text writes, or None."""
    if not template:
        return None
    return next((cls for cls in FORMATS.values() if cls.detects(template)), None)


def load(name: str | None, template: str | None, tokenizer) -> ReasoningFormat | None:
    """The server's format: ``name`` (``--reasoning-parser``; None: from the template), bound to
    the artifact's tokenizer (``tokenizers.Tokenizer``: which markers are special tokens), or None."""
    cls = detect(template) if name is None else by_name(name)
    return None if cls is None else cls(special_tokens(tokenizer))
