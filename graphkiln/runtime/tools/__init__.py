"""Tool calling: each model family's call syntax, one module per format behind a registry, as
model families are: ``hermes`` (``<tool_call>{json}</tool_call>``: Hermes, Qwen2.5, Qwen3),
``qwen3_coder`` (``<function=...>`` XML), ``llama3_json`` (Llama 3.x JSON), ``mistral``
(``[TOOL_CALLS][...]``), ``harmony`` (gpt-oss: ``to=functions.NAME`` on the commentary channel).
A format is chosen from the artifact's chat template (``detect``) or by name (``graphkiln serve
--tool-call-parser NAME``, vLLM's names accepted as aliases: ``by_name``).

A format gives, per request, a ``ToolCallParser`` (text deltas in, content and completed calls
out: a streamed reply's deltas and a whole reply come from the same code, ``parse_all``) and a
Lark grammar (``ToolFormat.grammar``, llguidance's dialect, for ``GenerationConfig.grammar``) over
all offered tools: under ``tool_choice`` required or a named function the whole output is calls
whose arguments match their tools' JSON schemas; under auto free text, or text and then calls,
each constrained from its opening marker on. So a call the engine returns always parses and
validates; a call cut short by ``max_tokens`` comes back as content.

Users: the server's chat route (``graphkiln.serve.chat``) and its Responses route; this package
imports nothing of the server.
"""

from __future__ import annotations

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.tools.base import Parsed, Tool, ToolCall, ToolCallParser, ToolFormat, parse_all, special_tokens
from graphkiln.runtime.tools.harmony import Harmony
from graphkiln.runtime.tools.hermes import Hermes
from graphkiln.runtime.tools.llama3_json import Llama3Json
from graphkiln.runtime.tools.mistral import Mistral
from graphkiln.runtime.tools.qwen3_coder import Qwen3Coder

# detection order: the first format whose markers the template writes (Qwen3-Coder's XML before
# Hermes, whose <tool_call> it shares; harmony's channels before the rest)
FORMATS: dict[str, type[ToolFormat]] = {cls.name: cls for cls in (Harmony, Qwen3Coder, Hermes, Mistral, Llama3Json)}
ALIASES = {alias: cls.name for cls in FORMATS.values() for alias in cls.aliases}
NONE = "none"  # --tool-call-parser none: tools are refused, whatever the template writes

__all__ = ["FORMATS", "Parsed", "Tool", "ToolCall", "ToolCallParser", "ToolFormat", "by_name", "detect", "load",
           "names", "parse_all"]


def names() -> list[str]:
    return sorted([*FORMATS, *ALIASES, NONE])


def by_name(name: str) -> type[ToolFormat] | None:
    """The format called ``name`` (its own name or a vLLM alias); None for ``none``."""
    if name == NONE:
        return None
    cls = FORMATS.get(ALIASES.get(name, name))
    if cls is None:
        raise GraphkilnError(f"unknown tool-call parser {name!r}: use one of {', '.join(names())}")
    return cls


def detect(template: str | None) -> type[ToolFormat] | None:
    """The format whose markers the chat template's text writes, or None."""
    if not template:
        return None
    return next((cls for cls in FORMATS.values() if cls.detects(template)), None)


def load(name: str | None, template: str | None, tokenizer) -> ToolFormat | None:
    """The server's format: ``name`` (``--tool-call-parser``; None: from the template), bound to
    the artifact's tokenizer (``tokenizers.Tokenizer``: which markers are special tokens), or None."""
    cls = detect(template) if name is None else by_name(name)
    return None if cls is None else cls(special_tokens(tokenizer))
