"""Hermes-style calls (NousResearch Hermes 2 Pro/3, Qwen2.5, Qwen3, QwQ and the many templates
that copied them): each call is ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``,
after any text; several calls follow one another, one per line (vLLM's ``hermes`` parser, llama.cpp's
``COMMON_CHAT_FORMAT_HERMES_2_PRO``). Detected by ``<tool_call>`` in the template (not Qwen3-Coder's
XML body: ``qwen3_coder``)."""

from __future__ import annotations

import json
from typing import Sequence

from graphkiln.runtime.tools.base import (MarkedParser, Tool, ToolCall, ToolCallParser, ToolFormat, call_objects,
                                          call_of, free_or_opened, inline_json, json_object, repeated)

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class Hermes(ToolFormat):
    name = "hermes"
    aliases = ("qwen", "qwen2_5", "qwen3")

    @classmethod
    def detects(cls, template: str) -> bool:
        return OPEN in template

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        names = {t.name for t in tools}

        def read(block: str) -> list[ToolCall] | None:
            call = call_of(json_object(block.strip()), names)
            return [call] if call is not None else None

        return MarkedParser(OPEN, CLOSE, read, self.marker_ids(OPEN, CLOSE))

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        open_, close = self.literal(OPEN), self.literal(CLOSE)
        body = f'"\\n" {inline_json(call_objects(tools))} "\\n" {close}'
        if required:
            return f'start: {repeated("call", json.dumps(chr(10)), parallel)}\ncall: {open_} {body}\n'
        more = f' ("\\n" {open_} {body})*' if parallel else ""
        return free_or_opened(self, OPEN, body + more)
