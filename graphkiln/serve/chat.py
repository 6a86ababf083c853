"""``POST /v1/chat/completions``: the chat template rendered over the request's messages, then
generation, whole or streamed (the first chunk carries ``role: assistant``).

Tool calling (``graphkiln.runtime.tools``: the artifact's call format): ``tools`` are rendered
through the template's own ``tools`` variable, and the history's assistant ``tool_calls`` (their
``arguments`` as objects, as templates expect) and ``tool`` messages with it; every ``tool``
message must answer a call an earlier assistant message made (``tool_call_id``). Unless
``tool_choice`` is ``none``, the format's grammar over the offered tools (one grammar for all,
``parallel_tool_calls`` allowing several calls) is the request's constraint (``tools``; with
``response_format`` or another constraint: 400 ``conflicting_constraints``), and the output goes
through the format's parser: calls become ``message.tool_calls`` (streamed: OpenAI's
``delta.tool_calls``, the id, type and name first, then the arguments) with ``finish_reason``
``tool_calls``; text that is no call stays content.

Reasoning content (``graphkiln.runtime.reasoning``: the server's format, from the template or
``--reasoning-parser``): the thinking comes back as ``message.reasoning_content`` (streamed:
``delta.reasoning_content``) before the tool-call parser reads what is left (``serve.reply``); a
``response_format`` or tool-call constraint is framed to apply after the thinking
(``GenerationConfig.constraint_frame``), while vLLM's ``guided_*``/``structured_outputs`` keep
constraining the whole output, thinking included. ``chat_template_kwargs`` (``enable_thinking``,
...) and ``reasoning_effort`` are template variables.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

import dataclasses
import json
import uuid
from dataclasses import dataclass

from graphkiln.runtime import tools as T
from graphkiln.runtime.reasoning import ReasoningFormat
from graphkiln.runtime.request.chat_template import RESERVED, ChatTemplateError
from graphkiln.runtime.request.constraint import MAX_CHARS
from graphkiln.runtime.requests import TokenEvent
from graphkiln.serve import request_config
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import ApiError
from graphkiln.serve.reply import Piece, Reply
from graphkiln.serve.respond import Shape, dump, finish, respond, tokens
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import Group, in_lane, submit


def register(api: APIRouter, state: ServerState) -> None:
    @api.post("/v1/chat/completions", **R.generation_route(S.ChatCompletion, S.ChatCompletionChunk))
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        req, group, calls = await in_lane(state, len(body), prepare, state, body)
        return await respond(request, state, group, arrived, [ChatShape(req, req.model, state.engine, calls)])


FAMILY = RouteFamily(register, bodies={"/v1/chat/completions": S.ChatCompletionRequest},
                     streamed=(S.ChatCompletionChunk,))


@dataclass(frozen=True)
class ToolCalling:
    """A request's tool calling as prepared: its constraint (None under tool_choice none) and the
    parser factory of its output (None: no tools, or tool_choice none: all content)."""

    constraint: S.OutputConstraint | None
    fmt: T.ToolFormat | None
    tools: tuple[T.Tool, ...]
    reasoning: ReasoningFormat | None = None  # the server's, once the prompt is rendered
    prompt: str = ""  # the rendered prompt (where the reply starts: inside the thinking or not)

    def parser(self) -> T.ToolCallParser | None:
        return self.fmt.parser(self.tools) if self.fmt is not None else None

    def reply(self) -> Reply:
        """A fresh splitter of this request's reply: reasoning, content, calls (``serve.reply``)."""
        fmt = self.reasoning
        return Reply(fmt.session(self.prompt) if fmt is not None else None, self.parser(),
                     tools_read_raw=fmt is not None and fmt.tools_see_reasoning)


def prepare(state: ServerState, body: bytes):
    """In a lane worker: the parsed request, its one choice's scheduler handle and its tool calling."""
    req = parse(S.ChatCompletionRequest, body)
    adapter = state.resolve_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    calling = tool_calling(req, state)
    constraint = request_config.constraint(req, state, calling.constraint)
    config = request_config.config(req, req.new_tokens, (req.top_logprobs or 0) if req.logprobs else None, adapter,
                                   constraint, request_config.speculation(req, state))
    variables = template_variables(req)
    try:
        text = state.chat.render(history(req.messages), variables=variables)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="chat_template") from None
    state.check_chars(len(text), "messages")
    ids = state.encode(text, special=False)  # the template already wrote any BOS
    state.check_tokens(len(ids), "messages")
    fmt = state.reasoning
    if fmt is not None and constraint is not None and _after_thinking(constraint, fmt):
        config = dataclasses.replace(config, constraint_frame=fmt.frame(text))
    calling = dataclasses.replace(calling, reasoning=fmt, prompt=text)
    return req, Group([submit(state, ids, config, "messages", constraint)]), calling


def template_variables(req: S.ChatCompletionRequest) -> dict | None:
    """The template's variables beyond the messages: ``tools``, ``chat_template_kwargs`` (none of
    ``chat_template.RESERVED``: a 400) and ``reasoning_effort``."""
    out = dict(req.chat_template_kwargs or {})
    taken = sorted(RESERVED & set(out))
    if taken:
        raise ApiError(400, f"chat_template_kwargs: '{taken[0]}' is the server's to set: leave it out",
                       param="chat_template_kwargs", code="invalid_value")
    if req.reasoning_effort is not None:
        out["reasoning_effort"] = req.reasoning_effort
    if req.tools:
        out["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return out or None


def _after_thinking(constraint: S.OutputConstraint, fmt: ReasoningFormat) -> bool:
    """Whether ``constraint`` applies after the thinking: OpenAI's response_format and tool calls
    (unless the tool grammar writes the thinking itself); vLLM's guided_* and structured_outputs
    constrain the whole output, as they say."""
    if constraint.param == "tools":
        return not fmt.tools_see_reasoning
    return constraint.param.startswith("response_format")


def tool_calling(req: S.ChatCompletionRequest, state: ServerState) -> ToolCalling:
    """The request's tools checked (a 400 each: tool_choice without tools, a name offered twice, a
    named function not offered, parameters that are no object schema, no call format for this
    model, a call grammar over the size a constraint may have) and its call grammar."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools: offer the functions in tools, or leave tool_choice out",
                           param="tool_choice", code="invalid_value")
        return ToolCalling(None, None, ())
    offered: dict[str, T.Tool] = {}
    for i, tool in enumerate(req.tools):
        fn = tool.function
        if fn.name in offered:
            raise ApiError(400, f"tools[{i}]: the function name '{fn.name}' is offered twice: give each tool its own "
                                "name", param=f"tools[{i}].function.name", code="invalid_value")
        params = fn.parameters
        if params is not None and params.get("type", "object") != "object":
            raise ApiError(400, f"tools[{i}].function.parameters must be an object schema (type: object): a call's "
                                f"arguments are a JSON object", param=f"tools[{i}].function.parameters",
                           code="invalid_value")
        offered[fn.name] = T.Tool(fn.name, params, bool(fn.strict))
    if choice == "none":
        return ToolCalling(None, None, tuple(offered.values()))
    fmt = state.tool_format
    if fmt is None:
        raise ApiError(400, "this model's chat template writes no tool calls graphkiln knows, so tools cannot be "
                            "parsed: start the server with --tool-call-parser NAME (" + ", ".join(T.names()) + ")",
                       param="tools", code="tools_not_supported")
    chosen = list(offered.values())
    if isinstance(choice, S.NamedToolChoice):
        if choice.function.name not in offered:
            raise ApiError(400, f"tool_choice names the function '{choice.function.name}', which tools does not "
                                f"offer ({', '.join(map(repr, offered))})", param="tool_choice.function.name",
                           code="invalid_value")
        chosen = [offered[choice.function.name]]
    required = choice == "required" or isinstance(choice, S.NamedToolChoice)
    parallel = req.parallel_tool_calls is not False and not isinstance(choice, S.NamedToolChoice)
    lark = fmt.grammar(chosen, required, parallel)
    if len(lark) > MAX_CHARS["grammar"]:
        raise ApiError(400, f"tools: the offered functions' schemas make a call grammar of {len(lark):,} characters, "
                            f"more than the {MAX_CHARS['grammar']:,} a constraint may have: offer fewer or smaller "
                            "tools", param="tools", code="invalid_response_format")
    return ToolCalling(S.OutputConstraint("grammar", lark, "tools"), fmt, tuple(chosen))


def history(messages: list[S.ChatMessage]) -> list[dict]:
    """The messages as templates read them: an assistant's calls with their ``arguments`` as
    objects (templates write them with ``tojson``); every ``tool`` message answering a call an
    earlier assistant message made (a 400 naming the message otherwise)."""
    out, called = [], set()
    for i, m in enumerate(messages):
        msg = m.for_template()
        if m.tool_calls:
            msg["tool_calls"] = []
            for j, call in enumerate(m.tool_calls):
                try:
                    args = json.loads(call.function.arguments)
                except (ValueError, RecursionError):
                    args = None
                if not isinstance(args, dict):
                    raise ApiError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not the JSON text of "
                                        "an object: send the arguments as the API returned them",
                                   param=f"messages[{i}].tool_calls[{j}].function.arguments", code="invalid_value")
                called.add(call.id)
                msg["tool_calls"].append({"id": call.id, "type": "function",
                                          "function": {"name": call.function.name, "arguments": args}})
        if m.role == "tool" and m.tool_call_id not in called:
            what = "has no tool_call_id" if m.tool_call_id is None else f"answers '{m.tool_call_id}'"
            raise ApiError(400, f"messages[{i}] is a tool result but {what}, and no earlier assistant message made "
                                "that call: give each tool message the id of the call it answers",
                           param=f"messages[{i}].tool_call_id", code="invalid_value")
        out.append(msg)
    return out


class ChatShape(Shape):
    prefix = "chatcmpl"

    def __init__(self, req, model_name: str, engine, calling: ToolCalling | None = None) -> None:
        calling = calling or ToolCalling(None, None, ())
        super().__init__(req, model_name, engine, calling.constraint)
        self.reply = calling.reply()  # reasoning, content, calls
        self.calls = 0  # calls sent so far (streamed: their delta index)

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return dict(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    def _logprobs(self, events: list[TokenEvent]) -> S.ChatLogprobs | None:
        if not self.req.logprobs:
            return None
        return S.ChatLogprobs(content=[
            S.ChatTokenLogprob(**self._entry(ev.token_id, ev.logprob.logprob),
                               top_logprobs=[S.TopLogprob(**self._entry(t, lp)) for t, lp in ev.logprob.top])
            for ev in tokens(events)])

    def _finish(self, reason: str | None) -> str | None:
        reason = finish(reason)
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _parsed(self, events: list[TokenEvent], last: bool) -> Piece:
        out = Piece()
        for ev in events:
            out += self.reply.feed(ev.text, ev.token_id)
        return out + self.reply.finish() if last else out

    @staticmethod
    def _call_id() -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def whole(self, handle, events: list[TokenEvent]) -> dict:
        parsed = self._parsed(events, last=True)
        self.calls = len(parsed.calls)
        calls = [S.ToolCall(id=self._call_id(), function=S.ToolCallFunction(name=c.name, arguments=c.arguments))
                 for c in parsed.calls] or None
        content = parsed.content if parsed.content or not calls else None
        choice = S.ChatChoice(message=S.AssistantMessage(content=content, tool_calls=calls,
                                                         reasoning_content=parsed.reasoning or None),
                              logprobs=self._logprobs(events),
                              finish_reason=self._finish(events[-1].finish_reason if events else "length"),
                              token_ids=self.ids(events))
        return dump(S.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                     usage=self.usage(handle, len(tokens(events))),
                                     prompt_token_ids=list(handle.prompt_ids) if self.req.return_token_ids else None))

    def _chunk(self, choices: list[S.ChatChunkChoice], usage: S.Usage | None = None) -> dict:
        return dump(S.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=usage))

    def opening(self) -> list[dict]:
        return [self._chunk([S.ChatChunkChoice(delta=S.Delta(role="assistant", content=""))])]

    def chunk(self, ev: TokenEvent, handle=None) -> list[dict]:
        """The event's chunks: its content, then each call it completed (OpenAI's two deltas: id,
        type and name with empty arguments, then the arguments), the finish reason, logprobs and
        token ids on the last."""
        parsed = self._parsed([ev], last=ev.finish_reason is not None)
        deltas = [S.Delta(reasoning_content=parsed.reasoning)] if parsed.reasoning else []
        deltas += [S.Delta(content=parsed.content)] if parsed.content else []
        for call in parsed.calls:
            index, self.calls = self.calls, self.calls + 1
            deltas.append(S.Delta(tool_calls=[S.ToolCallDelta(index=index, id=self._call_id(), type="function",
                                                              function=S.ToolCallDeltaFunction(name=call.name,
                                                                                               arguments=""))]))
            deltas.append(S.Delta(tool_calls=[S.ToolCallDelta(index=index, function=S.ToolCallDeltaFunction(
                arguments=call.arguments))]))
        extra = ev.finish_reason is not None or self.req.logprobs or self.req.return_token_ids
        if not deltas and not extra:
            return []
        if not deltas:
            deltas = [S.Delta(content="") if ev.finish_reason is None else S.Delta()]
        out = [self._chunk([S.ChatChunkChoice(delta=d)]) for d in deltas[:-1]]
        return out + [self._chunk([S.ChatChunkChoice(delta=deltas[-1], logprobs=self._logprobs([ev]),
                                                      finish_reason=self._finish(ev.finish_reason),
                                                      token_ids=self.ids([ev]))])]

    def usage_chunk(self, handle, count: int) -> dict:
        return self._chunk([], self.usage(handle, count))
