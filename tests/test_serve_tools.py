"""Tool calling through ``graphkiln serve`` (``graphkiln.runtime.tools``, ``graphkiln.serve.chat``):
the ``openai`` client against the real server on the tiny random Llama (byte-level BPE) with a
Hermes-style tool template (``<tool_call>{json}</tool_call>``, as Qwen2.5/Qwen3 write). Its text is
random, so a call comes only from the grammar: under ``tool_choice`` required or a named function
every returned call must parse and validate against its tool's schema (hypothesis-generated
schemas included), streamed or not; each family's parser on hand-written outputs, malformed ones
included (content, never an error); hostile tool inputs are one 400 each.

The artifact has 128 positions: the template writes each tool's name and description only, and
the schemas bound every string, number and array.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import test_serve  # noqa: E402
from conftest import add_chat_template  # noqa: E402
from graphkiln.runtime import tools as T  # noqa: E402

MODEL, serving = test_serve.MODEL, test_serve.serving

TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>{% for t in tools %}{{ t.function.name }}: "
    "{{ t.function.description or '' }};{% endfor %}{{ eos_token }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|tool|>{{ m.content }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|assistant|>{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}"
    "{% else %}<|{{ m.role }}|>{{ m.content }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9}},
           "required": ["city", "days"], "additionalProperties": False}
COLOR = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"]}
TOOLS = [{"type": "function", "function": {"name": "wx", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "paint", "parameters": COLOR}}]
SCHEMAS = {"wx": WEATHER, "paint": COLOR}
MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def artifact(tok_case, tmp_path_factory):
    import shutil

    art = tmp_path_factory.mktemp("serve_tools") / "artifact"
    shutil.copytree(tok_case.artifact, art)
    return add_chat_template(art, TEMPLATE)


@pytest.fixture(scope="module")
def srv(artifact):
    with serving(artifact, max_batch=4) as running:
        yield running


@pytest.fixture(scope="module")
def client(srv):
    return srv.client()


def _calls_valid(message, schemas) -> list[tuple[str, dict]]:
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, schemas[call.function.name])
        out.append((call.function.name, args))
    return out


def test_required_and_named_calls_parse_and_validate_streamed_alike(client):
    # one call each (parallel_tool_calls false; a named function is one call): a random model would
    # otherwise go on opening calls until max_tokens
    for choice in ("required", {"type": "function", "function": {"name": "paint"}}):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           max_tokens=90, temperature=0, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        whole = _calls_valid(c.message, SCHEMAS)
        assert whole and (choice == "required" or [n for n, _ in whole] == ["paint"])
        # streamed: OpenAI's deltas (id, type and name first with empty arguments, then arguments)
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                                max_tokens=90, temperature=0, stream=True, parallel_tool_calls=False)
        calls, finish = {}, None
        for chunk in stream:
            for ch in chunk.choices:
                finish = ch.finish_reason or finish
                for d in ch.delta.tool_calls or ():
                    if d.index not in calls:
                        assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
                        calls[d.index] = [d.function.name, ""]
                    else:
                        assert d.id is None and d.function.name is None
                        calls[d.index][1] += d.function.arguments
        assert finish == "tool_calls"
        assert [(n, json.loads(a)) for n, a in (calls[i] for i in sorted(calls))] == whole


def test_a_tool_result_turn_continues(client, srv):
    call = {"id": "call_1", "type": "function", "function": {"name": "paint", "arguments": '{"c": "red"}'}}
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "done"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=TOOLS[1:], max_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = httpx.post(srv.url + "/detokenize", json={"tokens": r.prompt_token_ids}).json()["prompt"]
    assert '<tool_call>\n{"name": "paint", "arguments": {"c": "red"}}\n</tool_call>' in prompt
    assert "<|tool|>done" in prompt


_names = st.text("abcdefgh", min_size=1, max_size=3)
_leaf = st.one_of(
    st.integers(0, 5).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-9, 9), st.integers(0, 9)).map(lambda t: {"type": "integer", "minimum": t[0],
                                                                    "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.text("xyz", min_size=1, max_size=3), min_size=1, max_size=3, unique=True).map(
        lambda v: {"enum": v}),
    st.integers(0, 2).map(lambda n: {"type": "array", "items": {"type": "boolean"}, "maxItems": n}))


@st.composite
def _schemas(draw):
    props = draw(st.dictionaries(_names, _leaf, min_size=0, max_size=3))
    required = [k for k in props if draw(st.booleans())]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(schema=_schemas(), strict=st.booleans())
def test_generated_tool_schemas_give_valid_calls(client, schema, strict):
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema, "strict": strict}}]
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=tools, tool_choice="required",
                                       max_tokens=90, temperature=0, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    assert [n for n, _ in _calls_valid(r.choices[0].message, {"f": schema})] == ["f"]


def test_auto_returns_text_or_valid_calls_and_none_never_calls(client):
    for choice in ("auto", "none"):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice,
                                           max_tokens=12, temperature=0)
        c = r.choices[0]
        if c.message.tool_calls:
            assert choice == "auto" and c.finish_reason == "tool_calls"
            _calls_valid(c.message, SCHEMAS)
        else:
            assert c.finish_reason in ("stop", "length") and isinstance(c.message.content, str)


def test_the_auto_grammar_constrains_a_call_once_opened(artifact):
    """Hermes' auto grammar on the artifact's tokenizer: free text and valid calls pass; once
    ``<tool_call>`` is written, only the call syntax with valid arguments does."""
    from graphkiln.runtime.request.constraint import Grammars

    manifest = json.loads((artifact / "manifest.json").read_text())
    grammars = Grammars(artifact / "tokenizer.json", manifest["model"]["vocab_size"],
                        tuple(manifest["generation"]["eos_token_ids"]))
    tools = [T.Tool("wx", WEATHER)]
    grammar = grammars.compile("grammar", T.FORMATS["hermes"]({}).grammar(tools, required=False, parallel=True))
    tok = grammars.tokenizer()

    def ok(text: str) -> bool:
        m = grammar.matcher.deep_copy()
        ids = tok.tokenize_str(text)
        return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) is not False and m.is_accepting()

    call = '<tool_call>\n{"name": "wx", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert ok("just text") and ok("well " + call) and ok(call + "\n" + call)
    for bad in ("x <tool_call>\nnot json", call.replace('"days": 2', '"days": 20'), call.replace("wx", "zz"),
                call + " and more text"):
        assert not ok(bad), bad


GOOD = {
    "hermes": ('sure <tool_call>\n{"name": "wx", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "paint", "arguments": {"c": "red"}}\n</tool_call>', "sure ",
               [("wx", {"city": "Oslo"}), ("paint", {"c": "red"})]),
    "qwen3_coder": ("<tool_call>\n<function=wx>\n<parameter=city>\nNew\nYork\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>", "", [("wx", {"city": "New\nYork", "days": 3})]),
    "llama3_json": ('{"name": "wx", "parameters": {"city": "Oslo"}}; {"name": "paint", "parameters": {"c": "blue"}}',
                    "", [("wx", {"city": "Oslo"}), ("paint", {"c": "blue"})]),
    "mistral": ('ok[TOOL_CALLS][{"name": "wx", "arguments": {"city": "Oslo"}}]', "ok", [("wx", {"city": "Oslo"})]),
    "harmony": ('<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.wx <|constrain|>json<|message|>{"city": "Oslo"}<|call|>', "", [("wx", {"city": "Oslo"})]),
}
BAD = {  # malformed under auto: all of it content (markers included), never an error
    "hermes": ['hi <tool_call>\n{"name": "wx", "arguments": {"city": ', '<tool_call>{"name": "nope"}</tool_call>',
               "<tool_call>not json</tool_call>"],
    "qwen3_coder": ["<tool_call>\n<function=nope>\n</function>\n</tool_call>", "<tool_call>\n<function=wx>\n"],
    "llama3_json": ['{"name": "wx", "parameters": {"city"', '{"name": "nope", "parameters": {}}'],
    "mistral": ['[TOOL_CALLS][{"name": "wx", "arguments": ', "[TOOL_CALLS]not json"],
    "harmony": ["<|channel|>commentary to=functions.wx <|constrain|>json<|message|>{oops<|call|>"],
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_format_parses_hand_written_outputs_whole_and_streamed(name):
    fmt = T.FORMATS[name]({})
    tools = [T.Tool("wx", WEATHER), T.Tool("paint", COLOR)]
    text, content, calls = GOOD[name]
    for step in (len(text), 1, 3):  # whole, character by character, in threes
        parsed = T.parse_all(fmt.parser(tools), [(text[i:i + step], -1) for i in range(0, len(text), step)])
        assert parsed.content == content and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    for bad in BAD[name]:
        parsed = T.parse_all(fmt.parser(tools), [(bad[i:i + 2], -1) for i in range(0, len(bad), 2)])
        assert not parsed.calls and parsed.content.strip(), (name, bad)
    assert T.detect(name_template(name)) is T.FORMATS[name]


def name_template(name: str) -> str:
    """A fragment of each family's real chat template, as detection reads it."""
    return {"hermes": "<tool_call>\\n{\"name\": <function-name>}</tool_call>",
            "qwen3_coder": "<tool_call>\\n<function=example>\\n<parameter=example_parameter_1>",
            "llama3_json": '{"name": function name, "parameters": dictionary of argument name and its value}',
            "mistral": "{{- '[TOOL_CALLS]' + tool_calls|tojson }}",
            "harmony": "<|start|>assistant<|channel|>commentary to=functions."}[name]


def test_a_special_token_marker_is_put_back_from_its_id():
    fmt = T.FORMATS["mistral"]({"[TOOL_CALLS]": 5})
    parsed = T.parse_all(fmt.parser([T.Tool("wx", WEATHER)]),
                         [("ok", 9), ("", 5), ('[{"name": "wx", "arguments": {"city": "Oslo"}}]', 11)])
    assert parsed.content == "ok" and [c.name for c in parsed.calls] == ["wx"]
    assert "<[5]>" in fmt.grammar([T.Tool("wx", WEATHER)], required=True, parallel=False)


def _refused(srv, body, param: str) -> dict:
    r = srv.post("/v1/chat/completions", dict({"model": MODEL, "messages": MSGS, "max_tokens": 4}, **body))
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "\n" not in err["message"], err
    return err


def test_hostile_tool_inputs_are_one_400_each(srv, client):
    tool = TOOLS[0]
    err = _refused(srv, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}], "tool_choice": "required"}, "tools")
    assert err["message"].startswith("tools: ") and "no-such-type" in err["message"] and "Lark" not in err["message"]
    _refused(srv, {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(1000)]}, "tools")
    _refused(srv, {"tools": [{"type": "function", "function": {"name": "f", "description": "d" * (1 << 20)}}]},
             "messages")
    _refused(srv, {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
             "tool_choice.function.name")
    _refused(srv, {"tools": [tool], "tool_choice": "sometimes"}, "tool_choice")
    _refused(srv, {"tool_choice": "required"}, "tool_choice")
    _refused(srv, {"tools": [tool, tool]}, "tools[1].function.name")
    _refused(srv, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
             "tools[0].function.parameters")
    _refused(srv, {"tools": [tool], "response_format": {"type": "json_object"}}, "tools")
    _refused(srv, {"messages": MSGS + [{"role": "tool", "tool_call_id": "call_x", "content": "42"}]},
             "messages[1].tool_call_id")
    bad_args = {"id": "c1", "type": "function", "function": {"name": "wx", "arguments": "{not json"}}
    _refused(srv, {"messages": MSGS + [{"role": "assistant", "tool_calls": [bad_args]}]},
             "messages[1].tool_calls[0].function.arguments")
    # the server is unaffected
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length") and r.choices[0].message.tool_calls is None


def test_langchain_bind_tools(srv):
    """LangChain's ``ChatOpenAI(...).bind_tools(...)``: the call comes back as its ``tool_calls``."""
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(base_url=srv.url + "/v1", api_key=test_serve.KEY, model=MODEL, temperature=0, max_tokens=90,
                        max_retries=0)
    reply = llm.bind_tools([TOOLS[1]], tool_choice="paint").invoke("hi")
    assert [c["name"] for c in reply.tool_calls] == ["paint"]
    jsonschema.validate(reply.tool_calls[0]["args"], COLOR)


def test_the_tool_call_parser_option_overrides_the_template(artifact):
    """``--tool-call-parser`` (AppOptions.tool_call_parser): mistral's syntax on a Hermes template;
    none refuses tools (tool_choice none still renders them)."""
    with serving(artifact, max_batch=2, tool_call_parser="mistral") as running:
        r = running.client().chat.completions.create(
            model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "paint"}}, extra_body={"return_token_ids": True})
        assert r.choices[0].finish_reason == "tool_calls" and _calls_valid(r.choices[0].message, SCHEMAS)
        text = httpx.post(running.url + "/detokenize", json={"tokens": r.choices[0].token_ids}).json()["prompt"]
        assert text.startswith('[TOOL_CALLS][{"name": "paint", "arguments": ')
    with serving(artifact, max_batch=2, tool_call_parser="none") as running:
        assert _refused(running, {"tools": TOOLS}, "tools")["code"] == "tools_not_supported"
        assert running.post("/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2, "tools": TOOLS,
                                                     "tool_choice": "none"}).status_code == 200
