"""What every tool-call format shares: the offered ``Tool``, a parsed ``ToolCall``, the
streaming parser (``ToolCallParser``: text deltas in, ``Parsed`` pieces of content and calls
out), the format interface (``ToolFormat``: detection, parser, Lark grammar) and the grammar
pieces the formats build from (argument schemas, inline JSON, free text that never opens a call).

Invariants: a ``ToolCall`` the parser returns names an offered tool and its ``arguments`` is
the JSON text of an object; text that could be the start of a call's opening marker is held
back until the next delta (or ``finish``) settles it; a call the model left malformed or
unfinished comes back as content, never as an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Sequence

# inline %json: no free whitespace (a model could pad forever), separators as json.dumps writes them
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_TEXT = "/(?s:.*)/"


@dataclass(frozen=True)
class Tool:
    """One function the request offers: ``parameters`` its arguments' JSON schema (an object
    schema; absent: no arguments), ``strict`` OpenAI's flag (``arguments_schema``)."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's ``name`` and ``arguments`` as JSON text (an object)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """A piece of output: ``content`` (text for the user) and the ``calls`` completed in it."""

    content: str = ""
    calls: tuple[ToolCall, ...] = ()

    def __add__(self, other: "Parsed") -> "Parsed":
        return Parsed(self.content + other.content, self.calls + other.calls)


class ToolCallParser:
    """One request's parser: ``feed`` each generated text delta (with its token id, for formats
    whose markers are special tokens that decoding drops), then ``finish`` once."""

    def feed(self, text: str, token_id: int = -1) -> Parsed:
        raise NotImplementedError

    def finish(self) -> Parsed:
        raise NotImplementedError


def parse_all(parser: ToolCallParser, pieces: Sequence[tuple[str, int]]) -> Parsed:
    """A whole output's content and calls: every (text, token id) delta fed, then finished."""
    out = Parsed()
    for text, token in pieces:
        out += parser.feed(text, token)
    return out + parser.finish()


class ToolFormat:
    """One family's call syntax (a module beside this one). ``specials``: the artifact's special
    tokens, text -> id: a marker that is one is matched by id in the grammar and re-inserted by
    id in the parser (decoding drops special tokens' text)."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()

    def __init__(self, specials: dict[str, int] | None = None) -> None:
        self.specials = dict(specials or {})

    @classmethod
    def detects(cls, template: str) -> bool:
        """Whether the chat template's text writes this format's calls."""
        raise NotImplementedError

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        raise NotImplementedError

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        """Lark (llguidance's dialect): with ``required``, the whole output is one call (or,
        ``parallel``, several) of ``tools`` with arguments valid against their schemas; without,
        free text that never opens a call, or text up to the opening marker and then the calls,
        constrained from the marker on."""
        raise NotImplementedError

    def literal(self, marker: str) -> str:
        """``marker`` in Lark: the special token by id where the artifact has one (a grammar's
        string never matches a special token), else the text."""
        token = self.specials.get(marker)
        return f"<[{token}]>" if token is not None else json.dumps(marker)

    def marker_ids(self, *markers: str) -> dict[int, str]:
        """id -> text of those ``markers`` that are special tokens (their text is re-inserted)."""
        return {self.specials[m]: m for m in markers if m in self.specials}

    def free_text(self, *markers: str) -> str:
        """A Lark terminal body: any text containing none of the ``markers`` written as text
        (a marker that is a special token can never be text anyway)."""
        texts = [m for m in markers if m not in self.specials]
        if not texts:
            return ANY_TEXT
        banned = "|".join(_regex_escape(m) for m in texts)
        return f"{ANY_TEXT} & ~/(?s:.*)({banned})(?s:.*)/"


def special_tokens(tokenizer) -> dict[str, int]:
    """The added tokens ``tokenizer`` (``tokenizers.Tokenizer``, or None) marks special: text -> id."""
    if tokenizer is None:
        return {}
    return {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}


def _regex_escape(text: str) -> str:
    return "".join("\\" + c if c in r".^$*+?{}[]\|()/" else ("\\n" if c == "\n" else c) for c in text)


# -- schemas --------------------------------------------------------------------------------


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """The schema a call's arguments are generated against: the tool's ``parameters`` (none: an
    empty object). ``strict`` closes every object schema that does not say otherwise
    (``additionalProperties: false``), as OpenAI's strict mode requires of the schema itself;
    without it, JSON Schema's own rule holds (extra properties allowed unless the schema says no)."""
    schema = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
    return _closed(schema) if tool.strict else schema


def _closed(schema: Any) -> Any:
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k not in ("const", "enum", "default", "examples") else v) for k, v in schema.items()}
    if "properties" in out and isinstance(out["properties"], dict):
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    return out


def call_objects(tools: Sequence[Tool], args_key: str = "arguments") -> dict[str, Any]:
    """One schema over all ``tools``' calls as JSON objects ``{"name": N, args_key: {...}}``
    (name first: a streamed call's name comes before its arguments)."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, args_key: arguments_schema(t)},
                "required": ["name", args_key], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def inline_json(schema: dict[str, Any]) -> str:
    """``schema`` as Lark's ``%json {...}`` (compact, with ``JSON_OPTIONS``)."""
    return "%json " + json.dumps(dict(schema, **{"x-guidance": JSON_OPTIONS}), ensure_ascii=False,
                                 separators=(",", ":"))


def repeated(item: str, separator: str, parallel: bool) -> str:
    """Lark for one ``item``, or with ``parallel`` one or more joined by ``separator`` (Lark)."""
    return f"{item} ({separator} {item})*" if parallel else item


# -- parsing ----------------------------------------------------------------------------------


def held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def json_object(text: str) -> dict | None:
    """``text`` as a JSON object, or None (malformed, or not an object)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def call_of(obj: Any, names: set[str], args_keys: tuple[str, ...] = ("arguments",)) -> ToolCall | None:
    """``{"name": N, "arguments": {...}}`` (or another of ``args_keys``) as a ToolCall of an offered
    tool; arguments given as JSON text are read; None for anything else."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        args = json_object(args)
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


@dataclass
class MarkedParser(ToolCallParser):
    """The parser of formats whose calls sit between an ``opening`` marker and a ``closing`` one
    (None: the call runs to the end of the output), each block read by ``read`` (None:
    malformed, given back as content with its markers). ``at_start``: the opening marker counts
    only as the output's first non-space text (Llama 3's bare JSON), where ``openings`` lists
    every text that opens a call there. ``specials``: id -> marker text of markers that are
    special tokens."""

    opening: str
    closing: str | None
    read: Callable[[str], list[ToolCall] | None]
    specials: dict[int, str] = field(default_factory=dict)
    at_start: tuple[str, ...] = ()
    _text: str = ""
    _block: str | None = None  # inside a call: its text so far
    _started: bool = False  # at_start: the first non-space text has been seen
    _after_call: bool = False  # whitespace after a call separates calls: not content

    def _content(self, text: str) -> Parsed:
        if self._after_call:
            if not text.strip():
                return Parsed()
            self._after_call = False
        return Parsed(text)

    def feed(self, text: str, token_id: int = -1) -> Parsed:
        self._text += self.specials.get(token_id, "") + text
        return self._drain(final=False)

    def finish(self) -> Parsed:
        out = self._drain(final=True)
        if self._block is not None:
            block, self._block = self._block + self._text, None
            self._text = ""
            calls = self.read(block) if self.closing is None else None
            out += Parsed(calls=tuple(calls)) if calls else Parsed(self._shown(block, closed=False))
        elif self._text:
            out += self._content(self._text)
            self._text = ""
        return out

    def _shown(self, block: str, closed: bool) -> str:
        return (self.opening if not self.at_start else "") + block + (self.closing or "" if closed else "")

    def _drain(self, final: bool) -> Parsed:
        out = Parsed()
        while True:
            if self._block is None:
                if self.at_start:
                    if self._started:
                        out, self._text = out + Parsed(self._text), ""
                        return out
                    stripped = self._text.lstrip()
                    if not stripped:
                        return out
                    opener = next((o for o in self.at_start if stripped.startswith(o)), None)
                    if opener is None and any(o.startswith(stripped) for o in self.at_start) and not final:
                        return out  # too short to tell yet
                    self._started = True
                    if opener is None:
                        continue
                    self._block, self._text = stripped, ""
                    return out
                at = self._text.find(self.opening)
                if at < 0:
                    keep = 0 if final else held(self._text, self.opening)
                    if self._after_call and not final and not self._text.strip():
                        keep = len(self._text)  # separating whitespace, or the start of content
                    cut = len(self._text) - keep
                    out, self._text = out + self._content(self._text[:cut]), self._text[cut:]
                    return out
                out += self._content(self._text[:at])
                self._block, self._text = "", self._text[at + len(self.opening):]
            if self.closing is None:
                self._block += self._text
                self._text = ""
                return out
            self._block += self._text
            self._text = ""
            end = self._block.find(self.closing)
            if end < 0:
                return out
            block, rest = self._block[:end], self._block[end + len(self.closing):]
            self._block, self._text = None, rest
            calls = self.read(block)
            out += Parsed(calls=tuple(calls)) if calls else Parsed(self._shown(block, closed=True))
            self._after_call = bool(calls)


def free_or_opened(fmt: ToolFormat, marker: str, rest: str) -> str:
    """Lark for ``tool_choice: auto``: free text that never opens a call, or text up to the first
    ``marker`` and then ``rest`` (Lark: the calls after the marker), constrained from the marker
    on. A text marker ends a lazy lexeme (llguidance's tool-calling recipe); a special-token
    marker can never be text, so plain text runs up to it."""
    if marker in fmt.specials:
        return f"start: TEXT | TEXT {fmt.literal(marker)} {rest}\nTEXT: {ANY_TEXT}\n"
    return (f"start: FREE | opened\nFREE: {fmt.free_text(marker)}\nopened: head {rest}\n"
            f"head[lazy]: /(?s:.*){_regex_escape(marker)}/\n")
