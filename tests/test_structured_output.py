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
import functools
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


# -- hostile constraints ----------------------------------------------------------------------------


def _names():
    """Distinct short rule/definition names: a, b, ..., z, ba, ..."""
    i = 0
    while True:
        n, name = i, ""
        while True:
            name, n = name + "abcdefghijklmnopqrstuvwxyz"[n % 26], n // 26
            if not n:
                break
        yield name
        i += 1


def _lark_chain(limit: int) -> str:
    """The deepest chain of bare Lark rules (``a:b``) in ``limit`` characters: the most native stack
    per character of all shapes measured (constraint's module docstring)."""
    names, first = _names(), None
    lines, size = [], 0
    name = first = next(names)
    while True:
        following = next(names)
        line = f"{name}:{following}\n"
        if size + len(line) + len(f'{following}:"x"\n') + len(f"start:{first}\n") > limit:
            return f"start:{first}\n" + "".join(lines) + f'{name}:"x"\n'
        lines.append(line)
        size += len(line)
        name = following


def _fitting(limit: int, body) -> dict:
    """The longest chain of ``$defs`` (each ``body(a $ref to the next)``, the last an integer) whose
    compact JSON fits ``limit`` characters."""
    compact = functools.partial(json.dumps, separators=(",", ":"))
    names = _names()
    name = first = next(names)
    defs, size = {}, len(compact({"$ref": f"#/$defs/{first}", "$defs": {}}))
    while True:
        following = next(names)
        entry = body({"$ref": f"#/$defs/{following}"})
        cost = len(compact({name: entry})) - 1  # '"name":{...}' and its comma
        if size + cost + len(compact({following: {"type": "integer"}})) > limit:
            defs[name] = {"type": "integer"}
            return {"$ref": f"#/$defs/{first}", "$defs": defs}
        defs[name], size, name = entry, size + cost, following


_HOSTILE = r"""
import json, sys
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
engine = Engine.load(sys.argv[1], threads=1)
cases = json.load(open(sys.argv[2]))
nested = {"type": "integer"}
for _ in range(5000):
    nested = {"type": "object", "properties": {"a": nested}, "required": ["a"]}
cases.append(["a 5,000-deep schema as a dict", "json_schema", nested])
for name, field, value in cases:
    try:
        engine.generate("x", GenerationConfig(max_new_tokens=2, **{field: value}))
        print(json.dumps([name, "built"]), flush=True)
    except GraphkilnError as exc:
        print(json.dumps([name, str(exc)]), flush=True)
"""


def test_hostile_constraints_are_bounded_and_never_crash(tok_case, tmp_path):
    """A grammar chain or $ref chain deeper than the native stack once killed the process inside
    llguidance (SIGSEGV: the issue's 3,000-rule Lark chain). Now every constraint is bounded
    (constraint.MAX_CHARS) and built on a stack sized against the bound: the deepest chains that
    fit the bounds build, and anything longer, a schema too deep to serialize, or a huge enum or
    regex is one GraphkilnError line. Run in a child process, so a crash is a failed test."""
    import subprocess
    import sys

    from graphkiln.runtime.request.constraint import MAX_CHARS

    lark = "start: r0\n" + "".join(f'r{i}: "(" r{i + 1} ")"\n' for i in range(3000)) + 'r3000: "x"\n'
    refs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)} | {"d5000": {"type": "integer"}}
    too_long = "is more than the"
    cases = {  # name: (field, value, expected: "built" or a refusal's words)
        "the issue's Lark chain of 3,000 rules": ("grammar", lark, "built"),
        "bare Lark rules at the bound": ("grammar", _lark_chain(MAX_CHARS["grammar"]), "built"),
        "bare Lark rules past the bound": ("grammar", _lark_chain(MAX_CHARS["grammar"] + 100), too_long),
        "the issue's 5,000-$ref chain": ("json_schema", {"$ref": "#/$defs/d0", "$defs": refs}, too_long),
        "an allOf $ref chain at the bound": ("json_schema", _fitting(MAX_CHARS["json_schema"],
                                                                     lambda ref: {"allOf": [ref]}), "built"),
        "a properties $ref chain at the bound": ("json_schema", _fitting(MAX_CHARS["json_schema"], lambda ref: {
            "type": "object", "properties": {"a": ref}, "required": ["a"]}), "built"),
        "a 5,000-deep schema as text": ("json_schema", '{"items":' * 5000 + "{}" + "}" * 5000, "nests deeper"),
        "an enum of 20,000 values": ("json_schema", {"enum": [f"value{i}" for i in range(20000)]}, too_long),
        "a regex of 20,000 alternatives": ("regex", "|".join(f"w{i}" for i in range(20000)), too_long),
    }
    (tmp_path / "cases.json").write_text(json.dumps([[n, f, v] for n, (f, v, _) in cases.items()]))
    run = subprocess.run([sys.executable, "-c", _HOSTILE, str(tok_case.artifact), str(tmp_path / "cases.json")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    outcomes = dict(json.loads(line) for line in run.stdout.splitlines())
    expected = {n: e for n, (_, _, e) in cases.items()} | {"a 5,000-deep schema as a dict": "json_schema: not JSON"}
    for name, want in expected.items():
        got = outcomes[name]
        assert (got == "built") if want == "built" else (want in got and "\n" not in got), (name, got)


def test_special_token_text_is_written_as_text(engine):
    """A constraint that forces the text of a special token (tok_case's end of sequence is "</s>",
    its start "<s>") once made llguidance allow only that special token, which the grammar then
    refused ("the grammar failed at token 2"). The text is written with ordinary tokens, as asked,
    the special tokens never appear inside it, and the request stops as usual."""
    cases = [(dict(regex="</s>"), "</s>"),
             (dict(regex="[0-9]</s>"), None),
             (dict(json_schema={"const": "</s>"}), '"</s>"'),
             (dict(json_schema={"type": "object", "properties": {"end": {"const": "<s>x</s>"}}, "required": ["end"],
                                "additionalProperties": False}), '{"end": "<s>x</s>"}'),
             (dict(grammar='start: "<s>" NAME "</s>"\nNAME: /[a-z]{1,4}/'), None)]
    for kwargs, want in cases:
        r = engine.generate("x", dataclasses.replace(GREEDY, **kwargs))[0]
        assert r.finish_reason == "stop", (kwargs, r)
        assert r.text == want if want is not None else re.fullmatch(
            kwargs.get("regex") or r"<s>[a-z]{1,4}</s>", r.text), (kwargs, r.text)
        assert not set(r.token_ids[:-1]) & {0, 1, 2}, (kwargs, r.token_ids)  # special ids, bar the final EOS


def test_a_grammar_that_fails_mid_generation_is_the_requests_error(engine):
    """A regex can compile and pass the probe at submission yet meet the grammar engine's limit a
    few tokens in (here after the first letters, on this model's path): it ends that request only,
    with one line naming the request's field, as a refusal at submission does (the server then
    answers 400 invalid_response_format, not 500)."""
    for regex in ("[a-z]{1,3}a{1000000}", "x{0,30}y{70000}"):
        with pytest.raises(GraphkilnError, match=r"^regex: the grammar engine failed at generated token \d+ "
                                                r"\(.*\): simplify the regular expression$") as err:
            engine.generate("data:", dataclasses.replace(GREEDY, regex=regex))
        assert "\n" not in str(err.value) and type(err.value).__name__ == "GrammarFailed"  # the server's 400
    assert engine.generate("x", dataclasses.replace(GREEDY, regex="[0-9]{3}"))[0].finish_reason == "stop"
