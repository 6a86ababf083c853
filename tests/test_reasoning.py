"""Reasoning content (``graphkiln.runtime.reasoning``): the ``think`` and ``harmony`` splitters on
hand-written outputs, fed whole and in every split into deltas, and a constraint that applies after
the thinking (``GenerationConfig.constraint_frame``), on the tiny Llama with a byte-level BPE
tokenizer: the frame's grammar takes free thinking then the schema, the schema alone refuses the
thinking. (A random model rarely closes its thinking, so the grammar is checked on hand-written
outputs, token by token, through the engine's own compiled matcher.)"""

from __future__ import annotations

import json

import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import reasoning
from graphkiln.runtime.reasoning.harmony import MARKERS

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["a"], "additionalProperties": False}


def _chunked(text: str, size: int) -> list[tuple[str, int]]:
    return [(text[i:i + size], -1) for i in range(0, len(text), size)] or [("", -1)]


THINK_CASES = [
    # (prompt tail, output, reasoning, content)
    ("<|assistant|>", "<think>\nLet me see: 2+2.</think>\n\nIt is 4.", "\nLet me see: 2+2.", "It is 4."),
    ("<|assistant|>", "  <think>a</th</think>b</think>", "a</th", "b</think>"),
    ("<|assistant|>", "It is 4, no <think> here.", "", "It is 4, no <think> here."),
    ("<|assistant|>", "<thin", "", "<thin"),  # cut off in what could have opened the thinking
    ("<|assistant|><think>\n", "so 4</think>4", "so 4", "4"),  # the template opened it (DeepSeek-R1)
    ("<|assistant|><think>\n", "cut off while thinking </thi", "cut off while thinking </thi", ""),
    ("<think>\n\n</think>\n\n", "Plain answer.", "", "Plain answer."),  # Qwen3, enable_thinking false
]


@pytest.mark.parametrize("prompt,output,want_reasoning,want_content", THINK_CASES)
def test_think_split_whole_and_in_every_delta_size(prompt, output, want_reasoning, want_content):
    fmt = reasoning.Think({})
    for size in range(1, len(output) + 1):
        got = reasoning.split_all(fmt.session(prompt), _chunked(output, size))
        assert (got.reasoning, got.content) == (want_reasoning, want_content), size


def test_harmony_split_by_marker_tokens_tool_calls_kept_raw():
    ids = {m: 1000 + i for i, m in enumerate(MARKERS)}
    fmt = reasoning.Harmony(dict(ids, **{"<|endoftext|>": 999}))
    prompt = "<|start|>user<|message|>hi<|end|><|start|>assistant"

    def run(parts):  # a marker is its token (decoding drops its text); text comes in pieces
        pieces = [("", ids[p]) if p in ids else (p, 7) for p in parts]
        return reasoning.split_all(fmt.session(prompt), pieces)

    got = run(["<|channel|>", "analysis", "<|message|>", "Think", "ing.", "<|end|>", "<|start|>", "assistant",
               "<|channel|>", "final", "<|message|>", "Ans", "wer.", "<|return|>"])
    assert (got.reasoning, got.content) == ("Thinking.", "Answer.")
    call = run(["<|channel|>", "analysis", "<|message|>", "need a tool", "<|end|>", "<|start|>", "assistant",
                "<|channel|>", "commentary to=functions.get", " ", "<|constrain|>", "json", "<|message|>",
                '{"x": 1}', "<|call|>"])
    assert call.reasoning == "need a tool"
    assert call.content == '<|start|>assistant<|channel|>commentary to=functions.get <|constrain|>json<|message|>{"x": 1}<|call|>'
    assert run(["no format at all"]) == reasoning.Split(content="no format at all")
    # the template opened the final channel itself
    opened = reasoning.split_all(fmt.session(prompt + "<|channel|>final<|message|>"), [("done", 7)])
    assert opened == reasoning.Split(content="done")


def test_detection_and_names():
    assert reasoning.detect("{% if x %}<think>{% endif %}</think>") is reasoning.Think
    assert reasoning.detect("<|start|>assistant<|channel|>final<|message|>") is reasoning.Harmony
    assert reasoning.detect("<|user|>{{ m.content }}") is None and reasoning.detect(None) is None
    assert reasoning.by_name("qwen3") is reasoning.Think and reasoning.by_name("openai_gptoss") is reasoning.Harmony
    assert reasoning.by_name("none") is None
    with pytest.raises(GraphkilnError, match="unknown reasoning parser 'r1': use one of"):
        reasoning.by_name("r1")


def _accepts(grammars, grammar, tokenizer, text: str) -> bool:
    """Whether the compiled grammar takes ``text`` (its tokens one by one) and is then complete."""
    matcher = grammar.matcher.deep_copy()
    return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


@pytest.fixture(scope="module")
def engine(tok_case):
    pytest.importorskip("llguidance")
    from graphkiln.runtime import Engine

    return Engine.load(tok_case.artifact, threads=1)


def test_constraint_applies_after_the_thinking(engine):
    from graphkiln.runtime.request.constraint import Grammars

    tok = engine.tokenizer
    grammars = Grammars(tok.path, engine.manifest.model.vocab_size, tuple(engine.manifest.generation.eos_token_ids))
    fmt = reasoning.Think({})
    thinking = '<think>a {"a": 1 </thi not yet</think>\n\n{"a": 42}'
    plain = grammars.compile("json_schema", SCHEMA)
    free = grammars.compile("json_schema", SCHEMA, fmt.frame("<|assistant|>"))  # may open <think>
    inside = grammars.compile("json_schema", SCHEMA, fmt.frame("<|assistant|><think>\n"))  # opened by the template
    assert not _accepts(grammars, plain, tok, thinking)  # the schema alone refuses the thinking
    assert _accepts(grammars, free, tok, thinking) and _accepts(grammars, free, tok, '{"a": 7}')
    assert _accepts(grammars, inside, tok, thinking[len("<think>"):])
    for bad in ('<think>x</think>{"a": 100}', "<think>x</think>no json", '<think>x</think>{"a": 1}</think>'):
        assert not _accepts(grammars, free, tok, bad), bad
    # a Lark grammar and a regex inside the frame keep their own rules
    lark = grammars.compile("grammar", 'start: answer\nanswer: "yes" | "no"\n', fmt.frame("x<think>"))
    assert _accepts(grammars, lark, tok, "hm</think> yes") and not _accepts(grammars, lark, tok, "hm</think> maybe")
    regex = grammars.compile("regex", "[0-9]{2}/x", fmt.frame("x"))
    assert _accepts(grammars, regex, tok, "<think></think>12/x")
    with pytest.raises(GraphkilnError, match="constraint_frame must be Lark text placing @constraint"):
        from graphkiln.runtime import GenerationConfig

        GenerationConfig(constraint_frame="start: @constraint")  # without a constraint

