"""Structured output through ``graphkiln serve``: OpenAI's ``response_format`` (json_object,
json_schema) and vLLM's ``guided_json``/``guided_regex``/``guided_grammar``/``structured_outputs``,
with the ``openai`` client against the real server (test_serve's ``serving``, one server for the
module) on the tiny random Llama with a byte-level BPE tokenizer: its text is random, but the
constrained text must still parse and validate, streamed or not; refusals are 400s in OpenAI's
shape naming the field.

The artifact has 128 positions, so the JSON schemas bound every string, number and array: a
random model under a schema that allowed unbounded values would run out of positions first.
"""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import test_serve  # noqa: E402

MODEL, serving = test_serve.MODEL, test_serve.serving
artifact = test_serve.artifact  # the module fixture: tok_case's artifact with a chat template

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "hi"}]
REGEX = "[0-9]{3}-[a-z]{2}"
GRAMMAR = 'start: answer\nanswer: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]{1,2}/\n'


@pytest.fixture(scope="module")
def srv(artifact):
    with serving(artifact, max_batch=4) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


def _error(exc: "openai.APIStatusError") -> dict:
    assert exc.status_code == 400, exc
    err = exc.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and "\n" not in err["message"], err
    return err


def test_json_schema_strict_parses_and_validates_with_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100, temperature=0,
                                       response_format=FORMAT, logprobs=True, top_logprobs=2)
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    value = json.loads(choice.message.content)
    jsonschema.validate(value, SCHEMA)
    # logprobs are the model's raw distribution, one entry per generated token
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens > 0
    assert all(e.logprob <= 0 and len(e.top_logprobs) == 2 for e in entries)


def test_json_schema_streamed_deltas_concatenate_to_valid_json(client):
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100, temperature=0,
                                            response_format=FORMAT, stream=True,
                                            stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop" and usage.completion_tokens > 0
    jsonschema.validate(json.loads(text), SCHEMA)
    # the same request whole gives the same text (greedy)
    whole = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=100, temperature=0,
                                           response_format=FORMAT)
    assert whole.choices[0].message.content == text


def test_the_clients_parse_with_a_pydantic_model(client):
    """openai's ``chat.completions.parse``: the model's strict schema as response_format, the reply
    parsed back into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=99)
        color: Literal["red", "green", "blue"]

    r = client.chat.completions.parse(model=MODEL, messages=MSGS, max_tokens=100, temperature=0,
                                      response_format=Person)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Person)


def test_json_object_is_a_json_object(client):
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=100, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.text), dict)


@pytest.mark.parametrize("how", ["guided_regex", "structured_outputs"])
def test_regex_matches_in_full(client, how):
    extra = {"guided_regex": REGEX} if how == "guided_regex" else {"structured_outputs": {"regex": REGEX}}
    r = client.completions.create(model=MODEL, prompt="code:", max_tokens=20, temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(REGEX, r.choices[0].text), r.choices[0]
    # sampled, on chat, streamed: still in full
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=1.0, seed=3,
                                            stream=True, extra_body=extra)
    text = "".join(c.delta.content or "" for chunk in stream for c in chunk.choices)
    assert re.fullmatch(REGEX, text), text


def test_lark_grammar(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0,
                                       extra_body={"guided_grammar": GRAMMAR})
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop" and re.fullmatch(r"yes|no|maybe [0-9]{1,2}", text), text


def test_guided_json_and_a_batch_of_prompts(client):
    """guided_json (a dict, or its JSON text) on completions: every prompt's choice valid."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for value in (small, json.dumps(small)):
        r = client.completions.create(model=MODEL, prompt=["a", "bb", "ccc"], max_tokens=40, temperature=0,
                                      extra_body={"guided_json": value})
        assert [c.index for c in r.choices] == [0, 1, 2]
        for c in r.choices:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), small)


def test_max_tokens_cuts_a_schema_short_with_length(client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, temperature=0,
                                       response_format=FORMAT)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_text_format_is_unconstrained(client):
    plain = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0)
    text = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, temperature=0,
                                     extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == plain.choices[0].text


@pytest.mark.parametrize("route,extra,param", [
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "bad", "schema": {"type": "no-such-type"}}}},
     "response_format.json_schema.schema"),
    ("completions", {"guided_json": {"type": "no-such-type"}}, "guided_json"),
    ("completions", {"guided_regex": "[0-9"}, "guided_regex"),
    ("chat", {"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ("chat", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_constraint_the_engine_refuses_is_a_400_naming_the_field(client, route, extra, param, stream):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, stream=stream, extra_body=extra)
        else:
            client.completions.create(model=MODEL, prompt="a", max_tokens=4, stream=stream, extra_body=extra)
    err = _error(info.value)
    assert err["param"] == param and err["code"] == "invalid_response_format", err
    assert err["message"].startswith(param + ":"), err


@pytest.mark.parametrize("extra,param,code", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "conflicting_constraints"),
    ({"guided_json": {"type": "object"}, "structured_outputs": {"grammar": 'start: "a"'}}, "structured_outputs",
     "conflicting_constraints"),
    ({"structured_outputs": {"regex": "a", "grammar": 'start: "a"'}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {}}, "structured_outputs", "invalid_value"),
    ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs.choice", "unknown_field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing_field"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "extra": 1}}},
     "response_format.json_schema.extra", "unknown_field"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema", "unknown_field"),
    ({"response_format": {"type": "xml"}}, "response_format", "invalid_value"),
    ({"guided_regex": ""}, "guided_regex", "invalid_value"),
    ({"guided_json": 5}, "guided_json", "invalid_value"),
])
def test_malformed_or_conflicting_constraints_are_400s(srv, client, extra, param, code):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=4, extra_body=extra)
    err = _error(info.value)
    assert (err["param"], err["code"]) == (param, code), err
    if code == "conflicting_constraints":
        first = next(iter(extra))
        assert first in err["message"] and param in err["message"], err
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": 4, **extra})  # the other route
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)
    srv.wait_idle()


def test_hostile_constraints_are_400s_and_the_server_lives(srv, client):
    """Constraints past the bounds (constraint.MAX_CHARS: the issue's 5,000-$ref schema of 178 KB, a
    huge enum, regex or Lark text, JSON nested past 200) are 400s naming the field; a chain within
    them (the issue's 3,000-rule Lark chain, which once killed the server with SIGSEGV) is built and
    served, and the server goes on answering."""
    refs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)} | {"d5000": {"type": "integer"}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": {"$ref": "#/$defs/d0", "$defs": refs}}}
    refused = [({"response_format": fmt}, "response_format.json_schema.schema", "is more than the 131,072"),
               ({"guided_json": {"enum": [f"v{i}" for i in range(30000)]}}, "guided_json", "is more than the"),
               ({"guided_json": '{"items":' * 300 + "{}" + "}" * 300}, "guided_json", "nests deeper than 200"),
               ({"guided_regex": "|".join(f"w{i}" for i in range(20000))}, "guided_regex", "is more than the 65,536"),
               ({"guided_grammar": 'start: "a"\n' + "// padding\n" * 7000}, "guided_grammar", "is more than the")]
    for extra, param, words in refused:
        r = srv.post("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 4, **extra})
        err = r.json()["error"]
        assert r.status_code == 400 and (err["param"], err["code"]) == (param, "invalid_response_format"), err
        assert err["message"].startswith(param + ":") and words in err["message"], err
    lark = "start: r0\n" + "".join(f'r{i}: "(" r{i + 1} ")"\n' for i in range(3000)) + 'r3000: "x"\n'
    r = client.completions.create(model=MODEL, prompt="a", max_tokens=3, temperature=0,
                                  extra_body={"guided_grammar": lark})
    assert r.choices[0].text == "(((" and r.choices[0].finish_reason == "length", r.choices[0]
    test_lark_grammar(client)


def test_special_token_text_is_written_as_text(client):
    """A constraint whose text holds the end-of-sequence text (this tokenizer's "</s>") once failed
    at its first token (a 500, or 200 and an error event streamed): it is written as text."""
    for extra, want in (({"guided_regex": "</s>"}, "</s>"),
                        ({"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "end", "schema": {"const": "</s>"}}}}, '"</s>"')):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0, extra_body=extra)
        assert (r.choices[0].message.content, r.choices[0].finish_reason) == (want, "stop"), r.choices[0]
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=20, temperature=0, stream=True,
                                                extra_body=extra)
        assert "".join(c.delta.content or "" for chunk in stream for c in chunk.choices) == want


def test_a_grammar_failing_mid_generation_is_a_400_not_a_500(srv):
    """A regex that passes compilation but meets the grammar engine's limit a token or two in
    (test_structured_output's) is the request's error: a 400 ``invalid_response_format`` naming the
    field, or, once a stream has begun, that error as its event (not a 500 "server_error")."""
    body = {"model": MODEL, "prompt": "data:", "max_tokens": 40, "temperature": 0,
            "guided_regex": "[a-z]{1,3}a{1000000}"}
    r = srv.post("/v1/completions", body)
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"], err["type"]) == (
        "guided_regex", "invalid_response_format", "invalid_request_error"), (r.status_code, err)
    assert err["message"].startswith("guided_regex: the grammar engine failed at generated token"), err
    r = srv.post("/v1/completions", body | {"stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert events[-1]["error"]["code"] == "invalid_response_format", events[-1]
    assert events[-1]["error"]["type"] == "invalid_request_error" and events[-1]["error"]["param"] == "guided_regex"
    srv.wait_idle()
