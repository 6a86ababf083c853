"""Structured output (runtime.request.constraint, llguidance): JSON schema, regex and Lark grammars.

The model is tok_case, a tiny random Llama with a byte-level BPE tokenizer: left alone it writes
noise, so every well-formed output here is the constraint's doing. Hypothesis draws JSON schemas
from the subset llguidance supports (objects with typed, bounded properties, enums, arrays,
nesting); every greedy output must parse and validate against its schema (jsonschema), ending
with "stop" before the token budget. A continuous batch mixing constrained and free rows equals
each request alone.
"""

from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.scheduler import Scheduler

GREEDY = GenerationConfig(max_new_tokens=120)  # the artifact holds 128 tokens


@pytest.fixture(scope="module")
def engine(tok_case):
    return Engine.load(tok_case.artifact, threads=1)


def _leaf():
    return st.one_of(
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
        st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                  st.integers(-50, 50), st.integers(0, 500)),
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.builds(lambda vals: {"enum": vals}, st.lists(st.sampled_from(["red", "green", 3, None, True]),
                                                        min_size=1, max_size=3, unique=True)),
    )


def _schema(depth: int = 2):
    children = _leaf() if depth == 0 else st.one_of(_leaf(), _schema(depth - 1))
    array = st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, _leaf(), st.integers(0, 3))
    props = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), st.one_of(children, array), max_size=4)
    return st.builds(lambda p, k: {"type": "object", "properties": p, "required": sorted(p)[:k],
                                   "additionalProperties": False}, props, st.integers(0, 4))


@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schema())
def test_json_schema_outputs_validate(engine, schema):
    r = engine.generate("data:", dataclasses.replace(GREEDY, json_schema=schema))[0]
    assert r.finish_reason == "stop", (schema, r.text)
    jsonschema.validate(json.loads(r.text), schema)


def test_json_object_regex_and_lark(engine):
    r = engine.generate("x", dataclasses.replace(GREEDY, json_schema={"type": "object"}))[0]
    assert isinstance(json.loads(r.text), dict) and r.finish_reason == "stop"
    r = engine.generate("x", dataclasses.replace(GREEDY, regex=r"[0-9]{3}-[a-z]{2}"))[0]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.text) and r.finish_reason == "stop"
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{1,8}/'
    r = engine.generate("x", dataclasses.replace(GREEDY, grammar=lark))[0]
    assert re.fullmatch(r"(yes|no) because [a-z]{1,8}", r.text), r.text


def test_budget_ends_with_length_and_streams(engine):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 50}}, "required": ["a"],
              "additionalProperties": False}
    r = engine.generate("x", GenerationConfig(max_new_tokens=3, json_schema=schema))[0]
    assert r.finish_reason == "length" and len(r.token_ids) == 3
    events = list(engine.stream("x", dataclasses.replace(GREEDY, json_schema=schema, logprobs=2)))
    text = "".join(e.text for e in events)
    assert events[-1].finish_reason == "stop" and json.loads(text)["a"] is not None
    # log-probabilities are the model's own distribution, reported for the token the grammar allowed
    assert all(e.logprob is not None and len(e.logprob.top) == 2 for e in events if e.token_id >= 0)


def test_mixed_batch_equals_each_alone(engine, tok_case):
    prompts = tok_case.prompts([4, 7, 5, 3], salt=11)
    configs = [dataclasses.replace(GREEDY, max_new_tokens=40, json_schema={"type": "object"}),
               GenerationConfig(max_new_tokens=40, stop_token_ids=()),
               dataclasses.replace(GREEDY, max_new_tokens=40, regex=r"[a-z]+( [a-z]+){0,5}"),
               GenerationConfig(max_new_tokens=40, do_sample=True, temperature=0.9, seed=3, stop_token_ids=())]
    alone = [engine.generate(p, c)[0].token_ids for p, c in zip(prompts, configs)]
    sched = Scheduler(engine, max_batch=4)
    handles = [sched.submit(p, c) for p, c in zip(prompts, configs)]  # all admitted at the first step
    sched.start()
    try:
        together = [h.result(timeout=120).token_ids for h in handles]
    finally:
        sched.shutdown(10)
    assert together == alone


def test_refusals_are_one_line(engine, llama_case):
    for config, needle in [(GenerationConfig(json_schema={"type": "no-such-type"}), "json_schema: "),
                           (GenerationConfig(json_schema="{not json"), "json_schema: "),
                           (GenerationConfig(regex="[a-"), "regex: "),
                           (GenerationConfig(grammar="start: undefined_rule"), "grammar: "),
                           (GenerationConfig(grammar="start: start"), "grammar: no text satisfies it"),
                           (GenerationConfig(json_schema=False), "json_schema: false is the schema nothing"),
                           # compiles, and its first mask builds: the grammar engine's limit is met at the
                           # second token, which the probe at submission reaches (it once failed mid-generation)
                           (GenerationConfig(regex="a{1000000}"), "simplify the regular expression")]:
        with pytest.raises(GraphkilnError, match=re.escape(needle)) as err:
            engine.generate("x", config)
        assert "\n" not in str(err.value)
    with pytest.raises(GraphkilnError, match="both set"):
        GenerationConfig(json_schema={"type": "object"}, regex="a")
    with pytest.raises(GraphkilnError, match="needs the artifact's tokenizer.json"):
        Engine.load(llama_case.artifact).generate([5, 6], GenerationConfig(regex="a+"))
