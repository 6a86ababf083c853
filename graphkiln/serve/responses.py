"""``POST /v1/responses``: OpenAI's Responses API, stateless, over the chat route's machinery.

A request becomes the chat request it means (``to_chat``): ``instructions`` a system message,
``input`` (a text, or items: messages, ``function_call`` items joined into the assistant message
they follow, ``function_call_output`` items as ``tool`` messages, ``reasoning`` items as the next
assistant message's ``reasoning_content``), ``tools`` (flat function tools) and ``tool_choice``,
``text.format`` as ``response_format``, ``max_output_tokens`` as ``max_tokens``,
``reasoning.effort`` as the template's ``reasoning_effort``. It is then prepared exactly as a chat
request (``chat.prepare``: the template, tool-call grammar, reasoning frame, every check), so
tool calls are constrained and always parse here too; a refusal's ``param`` is renamed to the
Responses field (``messages`` -> ``input``, ``response_format`` -> ``text.format``, ...).

The output (``ResponsesShape``): a ``reasoning`` item when the model thought, a ``message`` item
with one ``output_text`` part (present unless the reply is calls only), one ``function_call``
item per call (``call_id`` is what a ``function_call_output`` answers). ``status`` is
``completed``, or ``incomplete`` with ``incomplete_details.reason: max_output_tokens`` when the
length cut it. Streamed (``stream: true``), the Responses event sequence: ``response.created``,
``response.in_progress``, per item ``response.output_item.added``, its part's
``response.content_part.added``, ``response.output_text.delta`` (or ``reasoning_text.delta``,
``function_call_arguments.delta``), the matching ``.done`` events, ``response.output_item.done``,
then ``response.completed`` (or ``response.incomplete``) with the whole response; each event has
an ``event:`` line and a ``sequence_number``.

Stateless: nothing is stored. ``store`` is accepted and the response says ``store: false`` (there
is no response to retrieve later); ``previous_response_id`` and ``conversation`` are a 400 (send
the whole history as ``input``, as the Agents SDK does by default).
"""

from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request

from graphkiln.serve import chat
from graphkiln.serve import responses_schemas as RS
from graphkiln.serve import routes as R
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import ApiError
from graphkiln.serve.reply import Piece
from graphkiln.serve.respond import Shape, finish, respond, tokens
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import in_lane

STATELESS = ("graphkiln serve keeps no responses (stateless: store is always false), so there is none to continue: "
             "send the whole conversation as input")


def register(api: APIRouter, state: ServerState) -> None:
    @api.post("/v1/responses", **R.generation_route(RS.ResponseObject, RS.ResponseEvent))
    async def responses(request: Request):
        arrived = time.perf_counter()
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        (req, chat_req), group, prepared = await in_lane(state, len(body), prepare, state, body)
        return await respond(request, state, group, arrived, [ResponsesShape(req, chat_req, state.engine, prepared)])


FAMILY = RouteFamily(register, bodies={"/v1/responses": RS.ResponsesRequest}, streamed=(RS.ResponseEvent,))


def prepare(state: ServerState, body: bytes):
    """In a lane worker: ((the request, its chat request), the scheduler handles, what the chat
    route prepared for shaping the reply: tool calling, reasoning)."""
    req = parse(RS.ResponsesRequest, body)
    for name in ("previous_response_id", "conversation"):
        if getattr(req, name) is not None:
            raise ApiError(400, f"{name}: {STATELESS}", param=name, code="unsupported_parameter")
    converted = json.dumps(to_chat(req)).encode()  # ASCII: a lone surrogate stays an escape, as it came
    try:
        chat_req, group, prepared = chat.prepare(state, converted)
    except ApiError as exc:
        exc.param = _param(exc.param)
        exc.message = exc.message.replace("messages", "input").replace("response_format", "text.format")
        raise
    return (req, chat_req), group, prepared


# the chat request's fields as the Responses request names them (a refusal's param)
_RENAMED = (("messages", "input"), ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
            ("max_tokens", "max_output_tokens"), ("tool_choice.function", "tool_choice"))


def _param(param: str | None) -> str | None:
    if param is None:
        return None
    for old, new in _RENAMED:
        if param == old or param.startswith((old + ".", old + "[")):
            return new + param[len(old):]
    if param.startswith("tools[") and ".function" in param:
        return param.replace(".function", "", 1)
    return param


def to_chat(req: RS.ResponsesRequest) -> dict:
    """The chat completions request that ``req`` means (module docstring)."""
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
    else:
        _text_only(req.input)
        thought = None  # a reasoning item's text, for the assistant message that follows it
        for item in req.input:
            if isinstance(item, RS.ReasoningItem):
                thought = item.text()
            elif isinstance(item, RS.MessageItem):
                role = "system" if item.role == "developer" else item.role  # templates know system
                messages.append({"role": role, "content": item.text()})
                if role == "assistant" and thought:
                    messages[-1]["reasoning_content"], thought = thought, None
            elif isinstance(item, RS.FunctionCallItem):
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                    if thought:
                        last["reasoning_content"], thought = thought, None
                last.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}})
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    out: dict = {"model": req.model, "messages": messages, "stream": req.stream}
    if req.tools:
        out["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                        for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        out["tool_choice"] = choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, RS.TextFormatJsonSchema):
        out["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            by_alias=True, exclude_none=True, exclude={"type"})}
    elif fmt is not None:
        out["response_format"] = {"type": fmt.type}
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning is not None and req.reasoning.effort is not None:
        kwargs.setdefault("reasoning_effort", req.reasoning.effort)
    if kwargs:
        out["chat_template_kwargs"] = kwargs
    for ours, theirs in (("max_output_tokens", "max_tokens"), ("parallel_tool_calls", "parallel_tool_calls"),
                         ("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("seed", "seed"),
                         ("stop", "stop")):
        if getattr(req, ours) is not None:
            out[theirs] = getattr(req, ours)
    return out


def _text_only(items: list) -> None:
    """Refuse a part that is not text (an image, a file, audio): one 400 naming it."""
    for i, item in enumerate(items):
        parts = getattr(item, "content", None) or getattr(item, "output", None) or getattr(item, "summary", None)
        for j, part in enumerate(parts if isinstance(parts, list) else ()):
            if part.type not in RS.TEXT_PARTS and part.type != "refusal":
                where = "output" if isinstance(item, RS.FunctionCallOutputItem) else "content"
                raise ApiError(400, f"input[{i}].{where}[{j}] is an {part.type} part, and /v1/responses takes text "
                                    "only here: send text parts (input_text)", param=f"input[{i}].{where}[{j}].type",
                               code="invalid_value")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShape(Shape):
    """The reply as a Response object, or as the Responses stream's events (module docstring)."""

    prefix = "resp"

    def __init__(self, req: RS.ResponsesRequest, chat_req, engine, prepared) -> None:
        super().__init__(chat_req, req.model, engine, prepared.constraint)
        self.request = req
        self.reply = prepared.reply()
        self.id = _id("resp")
        self.seq = 0
        self.items: list[dict] = []  # finished output items, in order
        self.open: dict | None = None  # the item being streamed (reasoning or message), text so far
        # tokens generated; of them, those before the answer began (the thinking's, when there was one)
        self.count = self.thinking = 0
        self.answered = self.thought = False

    # -- the response object ----------------------------------------------------------------

    def _response(self, status: str, output: list[dict], handle=None, reason: str | None = None) -> dict:
        req = self.request
        usage = None
        if handle is not None:
            prompt = len(handle.prompt_ids)
            usage = RS.ResponseUsage(input_tokens=prompt, output_tokens=self.count, total_tokens=prompt + self.count,
                                     input_tokens_details=RS.InputTokensDetails(cached_tokens=handle.cached_tokens),
                                     output_tokens_details=RS.OutputTokensDetails(
                                         reasoning_tokens=self._reasoning_tokens()))
        tool_choice = req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None \
            else req.tool_choice.model_dump()
        fmt = req.text.format if req.text is not None and req.text.format is not None else None
        body = RS.ResponseObject(
            id=self.id, created_at=self.created, status=status, model=self.model, output=output,
            incomplete_details=RS.IncompleteDetails(reason="max_output_tokens") if reason == "length" else None,
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            parallel_tool_calls=req.parallel_tool_calls is not False,
            reasoning=req.reasoning.model_dump() if req.reasoning is not None else None,
            temperature=req.temperature, top_p=req.top_p,
            text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}},
            tool_choice=tool_choice or "auto", tools=[t.model_dump(exclude_none=True) for t in req.tools or ()],
            usage=usage, user=req.user)
        return body.model_dump(mode="json")

    def _said(self, ev, piece: Piece) -> Piece:
        """``piece`` (what ``ev`` made of the reply), counting the thinking's tokens: those generated
        before any content or call (none when the reply never thought)."""
        self.thought = self.thought or bool(piece.reasoning)
        self.answered = self.answered or bool(piece.content or piece.calls)
        self.thinking += not self.answered and ev.token_id >= 0
        return piece

    def _reasoning_tokens(self) -> int:
        return self.thinking if self.thought else 0

    @staticmethod
    def _status(reason: str | None) -> str:
        return "completed" if finish(reason) == "stop" else "incomplete"

    def _count(self, events) -> None:
        self.count += len(tokens(events))

    def whole(self, handle, events) -> dict:
        self._count(events)
        reason = events[-1].finish_reason if events else "length"
        piece = Piece()
        for ev in events:
            piece += self._said(ev, self.reply.feed(ev.text, ev.token_id))
        piece += self.reply.finish()
        status = self._status(reason)
        output = []
        if piece.reasoning:
            output.append(RS.OutputReasoning(id=_id("rs"), content=[RS.ReasoningText(text=piece.reasoning)],
                                             status="completed").model_dump(mode="json"))
        if piece.content or not piece.calls:
            output.append(RS.OutputMessage(id=_id("msg"), status=status, content=[RS.OutputText(text=piece.content)])
                          .model_dump(mode="json"))
        for call in piece.calls:
            output.append(RS.OutputFunctionCall(id=_id("fc"), call_id=_id("call"), name=call.name,
                                                arguments=call.arguments, status="completed").model_dump(mode="json"))
        return self._response(status, output, handle, reason)

    # -- the stream ----------------------------------------------------------------------------

    def _event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return out

    def opening(self) -> list[dict]:
        started = self._response("in_progress", [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def _start(self, kind: str) -> list[dict]:
        """Open a reasoning or message item (closing the open one first)."""
        out = self._close()
        index = len(self.items)
        if kind == "reasoning":
            item = RS.OutputReasoning(id=_id("rs"), content=[], status="in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = RS.OutputMessage(id=_id("msg"), status="in_progress", content=[])
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.open = {"kind": kind, "id": item.id, "text": ""}
        return out + [self._event("response.output_item.added", output_index=index, item=item.model_dump(mode="json")),
                      self._event("response.content_part.added", item_id=item.id, output_index=index,
                                  content_index=0, part=part)]

    def _delta(self, kind: str, text: str) -> list[dict]:
        out = self._start(kind) if self.open is None or self.open["kind"] != kind else []
        self.open["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        return out + [self._event(name, item_id=self.open["id"], output_index=len(self.items), content_index=0,
                                  delta=text, **extra)]

    def _close(self, status: str = "completed") -> list[dict]:
        if self.open is None:
            return []
        kind, item_id, text, index = self.open["kind"], self.open["id"], self.open["text"], len(self.items)
        self.open = None
        if kind == "reasoning":
            part = RS.ReasoningText(text=text)
            item = RS.OutputReasoning(id=item_id, content=[part], status="completed")
            done = self._event("response.reasoning_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text)
        else:
            part = RS.OutputText(text=text)
            item = RS.OutputMessage(id=item_id, status=status, content=[part])
            done = self._event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                               text=text, logprobs=[])
        item = item.model_dump(mode="json")
        self.items.append(item)
        return [done, self._event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                                  part=part.model_dump(mode="json")),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call) -> list[dict]:
        out = self._close()
        index = len(self.items)
        item = RS.OutputFunctionCall(id=_id("fc"), call_id=_id("call"), name=call.name, arguments="",
                                     status="in_progress")
        added = self._event("response.output_item.added", output_index=index, item=item.model_dump(mode="json"))
        item.arguments, item.status = call.arguments, "completed"
        done = item.model_dump(mode="json")
        self.items.append(done)
        return out + [added,
                      self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                  delta=call.arguments),
                      self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                  arguments=call.arguments),
                      self._event("response.output_item.done", output_index=index, item=done)]

    def chunk(self, ev, handle=None) -> list[dict]:
        self._count([ev])
        last = ev.finish_reason is not None
        piece = self._said(ev, self.reply.feed(ev.text, ev.token_id))
        if last:
            piece = piece + self.reply.finish()
        out = []
        if piece.reasoning:
            out += self._delta("reasoning", piece.reasoning)
        if piece.content:
            out += self._delta("message", piece.content)
        for call in piece.calls:
            out += self._call(call)
        if not last:
            return out
        status = self._status(ev.finish_reason)
        if not self.items and self.open is None:  # nothing said: one empty message, as OpenAI's
            out += self._start("message")
        out += self._close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self._response(status, self.items, handle, ev.finish_reason))]

    def usage_chunk(self, handle, count: int) -> dict:  # never asked for: the usage is in response.completed
        return {}
