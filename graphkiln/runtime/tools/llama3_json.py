"""Llama 3.1/3.2/3.3 JSON calls: the output is ``{"name": N, "parameters": {...}}`` (several
joined by ``; ``), optionally after the ``<|python_tag|>`` token; an output that starts with
anything else is content (vLLM's ``llama3_json`` parser, llama.cpp's ``LLAMA_3_X``). Detected by
the template's instruction to answer with ``"parameters": dictionary of argument name...`` or its
``<|python_tag|>``."""

from __future__ import annotations

import json
from typing import Sequence

from graphkiln.runtime.tools.base import (MarkedParser, Tool, ToolCall, ToolCallParser, ToolFormat, call_objects,
                                          call_of, inline_json, repeated)

TAG = "<|python_tag|>"
SEPARATOR = "; "


class Llama3Json(ToolFormat):
    name = "llama3_json"
    aliases = ("llama3", "llama", "llama4_json")

    @classmethod
    def detects(cls, template: str) -> bool:
        return '"parameters": dictionary of argument name' in template or TAG in template

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        names = {t.name for t in tools}

        def read(block: str) -> list[ToolCall] | None:
            text, calls, decoder = block.removeprefix(TAG).strip(), [], json.JSONDecoder()
            while text:
                try:
                    obj, end = decoder.raw_decode(text)
                except (ValueError, RecursionError):
                    return None
                call = call_of(obj, names, ("parameters", "arguments"))
                if call is None:
                    return None
                calls.append(call)
                text = text[end:].lstrip().removeprefix(";").lstrip()
            return calls or None

        return MarkedParser(TAG, None, read, self.marker_ids(TAG), at_start=(TAG, "{"))

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        calls = repeated(inline_json(call_objects(tools, "parameters")), json.dumps(SEPARATOR), parallel)
        tag = f"{self.literal(TAG)}?"
        if required:
            return f"start: {tag} calls\ncalls: {calls}\n"
        # content never starts with "{" (or the tag): that is how a call is told from text
        return f"start: FREE? | {tag} calls\nFREE: /([^{{<\\s]|<[^|]|\\s+[^{{\\s])(?s:.*)/\ncalls: {calls}\n"
