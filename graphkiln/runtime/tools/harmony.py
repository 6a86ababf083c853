"""gpt-oss's harmony calls: a message on the ``commentary`` channel addressed to the function,
``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`` (the
recipient may also stand before ``<|channel|>``); the ``final`` channel's message is the content
(vLLM's ``openai`` tool parser over openai-harmony, llama.cpp's ``GPT_OSS``). The ``analysis``
channel is the reasoning parser's (``graphkiln.runtime.reasoning.harmony``), never content here.
Detected by ``<|channel|>`` in the template. The markers are special tokens, which decoding drops:
the parser puts their text back from the token ids."""

from __future__ import annotations

import json
import re
from typing import Sequence

from graphkiln.runtime.tools.base import (Parsed, Tool, ToolCall, ToolCallParser, ToolFormat, arguments_schema,
                                          inline_json, json_object)

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *ENDS)
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


class Harmony(ToolFormat):
    name = "harmony"
    aliases = ("openai", "gpt_oss")

    @classmethod
    def detects(cls, template: str) -> bool:
        return CHANNEL in template

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        return _HarmonyParser({t.name for t in tools}, self.marker_ids(*MARKERS))

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        c, m, k = self.literal(CHANNEL), self.literal(MESSAGE), self.literal(CONSTRAIN)
        end, start = self.literal("<|end|>"), self.literal(START)
        rules = [f"call{i}: {c} {json.dumps(f'commentary to=functions.{t.name} ')} {k} \"json\" {m} "
                 f"{inline_json(arguments_schema(t))}" for i, t in enumerate(tools)]
        calls = " | ".join(f"call{i}" for i in range(len(tools)))
        # the thinking first, as the model writes it (analysis channel, then a new assistant message)
        head = f'analysis: {c} "analysis" {m} TEXT {end} {start} "assistant"\nTEXT: /(?s:.*)/\n'
        if required:
            return f"start: analysis? call\ncall: {calls}\n" + head + "\n".join(rules) + "\n"
        final = f'final: {c} "final" {m} TEXT'
        return f"start: analysis? (final | call)\ncall: {calls}\n{final}\n" + head + "\n".join(rules) + "\n"


class _HarmonyParser(ToolCallParser):
    """Messages, each a header then ``<|message|>`` and a body up to an end marker; a body
    streams as content on the final channel, is one call when addressed to a function, and is
    dropped otherwise (analysis: the reasoning parser's)."""

    def __init__(self, names: set[str], specials: dict[int, str]) -> None:
        self.names, self.specials = names, specials
        self.header, self.body, self.in_body = "", "", False
        self.pending = ""  # text that may be the start of a marker written as text

    def feed(self, text: str, token_id: int = -1) -> Parsed:
        marker = self.specials.get(token_id)
        out = Parsed()
        if marker is not None:
            out += self._step(self.pending, False) + self._step(marker, True)
            self.pending = ""
        self.pending += text
        cut = self.pending.rfind("<|")
        if cut < 0 or "|>" in self.pending[cut:]:
            cut = len(self.pending) - self.pending.endswith("<")
        out += self._step(self.pending[:cut], False)
        self.pending = self.pending[cut:]
        return out

    def _step(self, piece: str, is_marker: bool) -> Parsed:
        if not piece:
            return Parsed()
        if not is_marker:  # text written as text (no tokenizer specials): split it on the markers
            parts = re.split("(" + "|".join(re.escape(m) for m in MARKERS) + ")", piece)
            if len(parts) > 1:
                out = Parsed()
                for i, part in enumerate(parts):
                    out += self._step(part, i % 2 == 1)
                return out
        if not self.in_body:
            if is_marker and piece == MESSAGE:
                self.in_body = True
            elif is_marker and piece == START:
                self.header = ""
            else:
                self.header += piece
            return Parsed()
        if is_marker and piece in ENDS + (START, CHANNEL):
            return self._end_message()
        self.body += piece
        return Parsed(piece) if self._final() else Parsed()

    def _final(self) -> bool:
        return "final" in self.header.split("to=")[0] and _RECIPIENT.search(self.header) is None

    def _end_message(self) -> Parsed:
        out = Parsed()
        found = _RECIPIENT.search(self.header)
        if found is not None:
            name, args = found.group(1), json_object(self.body.strip())
            if name in self.names and args is not None:
                out = Parsed(calls=(ToolCall(name, json.dumps(args, ensure_ascii=False)),))
            else:  # a malformed call: its text as content
                out = Parsed(self.body)
        self.header, self.body, self.in_body = "", "", False
        return out

    def finish(self) -> Parsed:
        out = self._step(self.pending, False)
        self.pending = ""
        return out + (self._end_message() if self.in_body else Parsed())
