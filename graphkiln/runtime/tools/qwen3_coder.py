"""Qwen3-Coder's XML calls: ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>``, a string parameter's value written as plain text, any other as JSON
(vLLM's ``qwen3_coder`` parser, llama.cpp's ``QWEN3_CODER_XML``). Detected by ``<function=`` and
``<parameter=`` in the template.

The grammar writes the tool's parameters in its schema's order (``required`` ones always, the
others optionally), a string's text bounded by its ``maxLength`` and restricted to its ``enum``;
a string's ``pattern`` or ``format`` is not enforced on this plain-text spelling."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from graphkiln.runtime.tools.base import (MarkedParser, Tool, ToolCall, ToolCallParser, ToolFormat, arguments_schema,
                                          free_or_opened, inline_json)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.S)
_END = "\n</parameter>\n"


class Qwen3Coder(ToolFormat):
    name = "qwen3_coder"
    aliases = ("qwen3_xml",)

    @classmethod
    def detects(cls, template: str) -> bool:
        return "<function=" in template and "<parameter=" in template

    def parser(self, tools: Sequence[Tool]) -> ToolCallParser:
        schemas = {t.name: arguments_schema(t) for t in tools}

        def read(block: str) -> list[ToolCall] | None:
            found = _FUNCTION.match(block)
            if found is None or found.group(1).strip() not in schemas:
                return None
            name, body = found.group(1).strip(), found.group(2)
            props = _properties(schemas[name])
            args: dict[str, Any] = {}
            pos = 0
            for m in _PARAMETER.finditer(body):
                if body[pos:m.start()].strip():
                    return None
                pos = m.end()
                key = m.group(1).strip()
                args[key] = _value(m.group(2), props.get(key))
            if body[pos:].strip():
                return None
            return [ToolCall(name, json.dumps(args, ensure_ascii=False))]

        return MarkedParser(OPEN, CLOSE, read, self.marker_ids(OPEN, CLOSE))

    def grammar(self, tools: Sequence[Tool], required: bool, parallel: bool) -> str:
        rules, calls = [], []
        for i, tool in enumerate(tools):
            schema = arguments_schema(tool)
            if not _valid(schema):
                # the schema alone, which the grammar engine refuses with its own line when the
                # request is submitted (a 400 naming tools): the XML spelling reads schemas leniently
                return f"start: {inline_json(schema)}\n"
            props, needed = _properties(schema), _required(schema)
            parts = []
            for j, (key, sub) in enumerate(props.items()):
                value, extra = _value_lark(f"v{i}_{j}", sub)
                rules += [f"p{i}_{j}: {json.dumps(f'<parameter={key}>' + chr(10))} {value}", *extra]
                parts.append(f"p{i}_{j}" + ("" if key in needed else "?"))
            head = json.dumps(f"\n<function={tool.name}>\n")
            rules.append(f"call{i}: {head} {' '.join(parts)} {json.dumps('</function>' + chr(10))} {self.literal(CLOSE)}")
            calls.append(f"call{i}")
        rules.append(f"body: {' | '.join(calls)}")
        more = f' ("\\n" {self.literal(OPEN)} body)*' if parallel else ""
        lark = "\n".join(rules) + "\n"
        if required:
            return f"start: {self.literal(OPEN)} body{more}\n" + lark
        return free_or_opened(self, OPEN, "body" + more) + lark


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    if "enum" in schema:
        return all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


def _value(text: str, schema: Any) -> Any:
    """A parameter's value: a string parameter's text as it is, any other's JSON (its text if that
    is not JSON: an unconstrained model's loose spelling)."""
    if _is_string(schema):
        return text
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


def _value_lark(name: str, schema: Any) -> tuple[str, list[str]]:
    """A parameter's value and its closing line in Lark, and the rules that takes."""
    end = json.dumps(_END)
    if not _is_string(schema):
        return f"{inline_json(schema if isinstance(schema, dict) else {})} {end}", []
    if "enum" in schema:
        return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + f") {end}", []
    lo, hi = _count(schema.get("minLength")) or 0, _count(schema.get("maxLength"))
    count = f"{{{lo},{'' if hi is None else max(hi, lo)}}}"
    # lazy up to the closing line (a suffix): the text never holds it, and the suffix is the end
    return name, [f"{name}[suffix={end}]: /(?s:.){count}/"]


# an untrusted schema's pieces, read leniently: what is not the JSON Schema type it should be counts
# as absent (the whole schema is still checked by the grammar engine where it is inlined)


def _properties(schema: Any) -> dict[str, Any]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _required(schema: Any) -> set[str]:
    req = schema.get("required") if isinstance(schema, dict) else None
    return {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _valid(schema: Any) -> bool:
    """Whether the grammar engine takes ``schema`` (checked without a tokenizer: no tokens built)."""
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError, RecursionError):
        return False
    return not LLMatcher.validate_grammar(grammar)
