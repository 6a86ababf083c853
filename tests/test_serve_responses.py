"""``POST /v1/responses`` (``graphkiln.serve.responses``) and reasoning content through the server,
with the ``openai`` client and the OpenAI Agents SDK against the real server on the tiny random
Llama (byte-level BPE) with test_serve_tools' Hermes-style tool template. The model's text is
random: a call comes from the constrained ``tool_choice``; the Agents SDK's loop then resets the
choice to auto (its default ``reset_tool_choice``) and the tool result turn ends in text.

Reasoning: a template that writes ``<think>`` selects the ``think`` parser; a ``guided_grammar``
(the whole output, never framed) forces a reply with thinking, which must come back split into
``reasoning_content`` and ``content``, streamed or not, and as a Responses ``reasoning`` item.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import test_serve  # noqa: E402
import test_serve_tools  # noqa: E402
from conftest import add_chat_template  # noqa: E402

MODEL, serving = test_serve.MODEL, test_serve.serving
artifact = test_serve_tools.artifact  # the module fixture: tok_case's artifact with the Hermes-style template
WEATHER = test_serve_tools.WEATHER
# small arguments: the call and its result must fit the artifact's 128 positions in the next turn
COLOR = {"type": "object", "properties": {"c": {"enum": ["red", "blue"]}}, "required": ["c"], "additionalProperties": False}
TOOL = {"type": "function", "name": "paint", "parameters": COLOR, "strict": True}
FORCED = 'start: "<think>" "sunny?" "</think>" "\\n\\n" "It is sunny."\n'


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
    assert err["message"] and "\n" not in err["message"], err
    return err


def test_text_input_whole_and_streamed_events(client):
    kw = dict(model=MODEL, input="hi", instructions="Be brief.", max_output_tokens=8, temperature=0,
              metadata={"k": "v"}, store=True)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.store is False and whole.metadata == {"k": "v"}
    assert [item.type for item in whole.output] == ["message"]
    assert whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", f"response.{whole.status}"]
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text  # greedy: the same text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_required_call_streamed_then_the_tool_result_turn(client):
    kw = dict(model=MODEL, input="paint?", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
              temperature=0, max_output_tokens=90)
    whole = client.responses.create(**kw)
    call = whole.output[-1]
    assert whole.status == "completed" and call.type == "function_call" and call.name == "paint"
    jsonschema.validate(json.loads(call.arguments), COLOR)
    events = list(client.responses.create(stream=True, **kw))
    added = [e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(added) == len(done) == 1 and done[0].arguments == call.arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].call_id == added[0].item.call_id
    # the result turn: the call and its output given back as items; under auto, text
    history = [{"role": "user", "content": "paint?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    turn = client.responses.create(model=MODEL, input=history, tools=[TOOL], temperature=0, max_output_tokens=8)
    assert turn.output[0].type == "message"


def test_text_format_json_schema(client):
    r = client.responses.create(model=MODEL, input="hi", temperature=0, max_output_tokens=60,
                                text={"format": {"type": "json_schema", "name": "wx", "schema": WEATHER, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), WEATHER)


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input[0].tool_call_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format.schema"),
    ({"tools": [TOOL], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tools"),
])
def test_hostile_inputs_are_one_400_each(srv, client, extra, param):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    r = srv.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"] and "\n" not in err["message"] and (err["param"] or "").startswith(param), err
    assert client.responses.create(model=MODEL, input="hi", max_output_tokens=2).status  # the server unaffected


def test_agents_sdk_loop_responses_and_chat_completions(srv):
    """The OpenAI Agents SDK runs an agent that calls a local function tool (tool_choice required
    makes the call) and returns a final answer, over the Responses API (the SDK's default) and,
    set explicitly, Chat Completions. Over Chat Completions the tool result turn writes the final
    text (the SDK resets tool_choice to auto after a call). Over Responses the SDK takes a
    length-cut reply (status incomplete) as a failure, and this random model never ends a text by
    itself, so that agent stops at its tool's result (``tool_use_behavior``); the Responses result
    turn itself is test_required_call_streamed_then_the_tool_result_turn's."""
    agents = pytest.importorskip("agents")
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    seen = []

    @function_tool
    def p(c: Literal["r", "b"]) -> str:  # short: the result turn must fit the artifact's 128 positions
        """P."""
        seen.append(c)
        return "ok"

    async_client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    settings = ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80)
    for model, behavior in ((OpenAIResponsesModel(MODEL, async_client), "stop_on_first_tool"),
                            (OpenAIChatCompletionsModel(MODEL, async_client), "run_llm_again")):
        seen.clear()
        agent = Agent(name="a", tools=[p], model=model, model_settings=settings, tool_use_behavior=behavior)
        result = Runner.run_sync(agent, "?", max_turns=3)
        assert seen == ["r"] or seen == ["b"], (model, seen)
        assert isinstance(result.final_output, str), model
        if behavior == "stop_on_first_tool":
            assert result.final_output == "ok"
        else:  # the model's own text after the tool's result
            assert [item.type for item in result.new_items] == ["tool_call_item", "tool_call_output_item",
                                                                "message_output_item"]


THINK_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is false %}<think></think>"
                  "{% elif enable_thinking is true %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking(tok_case, tmp_path_factory):
    import shutil

    art = tmp_path_factory.mktemp("serve_think") / "artifact"
    shutil.copytree(tok_case.artifact, art)
    with serving(add_chat_template(art, THINK_TEMPLATE), max_batch=2) as running:
        yield running


def test_reasoning_content_split_whole_streamed_and_as_responses_items(thinking):
    client = thinking.client()
    msgs = [{"role": "user", "content": "weather?"}]
    forced = {"guided_grammar": FORCED}
    whole = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40, extra_body=forced)
    message = whole.choices[0].message
    assert (message.reasoning_content, message.content) == ("sunny?", "It is sunny.")
    stream = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=40, stream=True,
                                            extra_body=forced)
    reasoning = content = ""
    for chunk in stream:
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == ("sunny?", "It is sunny.")
    # chat_template_kwargs reach the template: thinking off writes the empty <think></think> itself
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                   "return_token_ids": True})
    tok = thinking.post("/detokenize", {"tokens": r.prompt_token_ids}).json()["prompt"]
    assert tok.endswith("<|assistant|><think></think>")
    bad = thinking.post("/v1/chat/completions", {"model": MODEL, "messages": msgs,
                                                 "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    # a generation prompt that opens <think> (enable_thinking true here): the reply starts inside the
    # thinking, which the length cuts: a reasoning item, streamed as reasoning_text deltas
    kw = dict(model=MODEL, input="weather?", temperature=0, max_output_tokens=6,
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = client.responses.create(**kw)
    assert [item.type for item in whole.output] == ["reasoning", "message"] and whole.status == "incomplete"
    assert whole.output[0].content[0].text and whole.output_text == ""
    assert whole.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens == 6
    events = list(client.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == whole.output[0].content[0].text
    assert events[-1].response.output[0].type == "reasoning"


def test_constraint_applies_after_the_thinking_through_the_server(thinking):
    """response_format on a thinking model: the JSON is the content, whatever the thinking."""
    client = thinking.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "wx", "schema": WEATHER}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       max_tokens=60, response_format=fmt)
    if r.choices[0].finish_reason == "stop":  # the random model may think until the length cuts it
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    else:
        assert r.choices[0].message.content in (None, "") and r.choices[0].message.reasoning_content
