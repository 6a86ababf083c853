"""Mistral calls: the ``[TOOL_CALLS]`` token, then a JSON array of ``{"name": N, "arguments": {...}}``
(Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo/Small: vLLM's ``mistral`` parser, llama.cpp's
``MISTRAL_NEMO``); text before it is content. The newer ``[TOOL_CALLS]name[ARGS]{...}`` spelling
(tokenizer v11+) is parsed too. Detected by ``[TOOL_CALLS]`` in the template."""

from __future__ import annotations

import json
from typing import Sequence

from graphkiln.runtime.tools.base import (MarkedParser, Tool, ToolCall, ToolCallParser, ToolFormat, call_objects,
                                          call_of, free_or_opened, inline_json)

TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"


class Mistral(ToolFormat):
    name = "mistral"

    @classmethod
    def detects(cls, template: str) -> bool:
        return TAG in template

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        names = {t.name for t in tools}

        def read(block: str) -> list[ToolCall] | None:
            block = block.strip()
            if block.startswith("["):
                try:
                    items = json.loads(block)
                except (ValueError, RecursionError):
                    return None
                calls = [call_of(item, names) for item in items] if isinstance(items, list) else [None]
            else:  # name[ARGS]{...}, one per [TOOL_CALLS]
                name, sep, args = block.partition(ARGS)
                calls = [call_of({"name": name.strip(), "arguments": args}, names)] if sep else [None]
            return calls if calls and None not in calls else None

        return MarkedParser(TAG, None, read, self.marker_ids(TAG, ARGS))

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        array = {"type": "array", "items": call_objects(tools), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        if required:
            return f"start: {self.literal(TAG)} {inline_json(array)}\n"
        return free_or_opened(self, TAG, inline_json(array))
