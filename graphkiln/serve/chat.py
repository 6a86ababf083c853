"""``POST /v1/chat/completions``: the chat template rendered over the request's messages, then
generation, whole or streamed (the first chunk carries ``role: assistant``)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from graphkiln.runtime.request.chat_template import ChatTemplateError
from graphkiln.runtime.requests import TokenEvent
from graphkiln.serve import request_config
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import ApiError
from graphkiln.serve.respond import Shape, dump, finish, respond, tokens
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import Group, in_lane, submit


def register(api: APIRouter, state: ServerState) -> None:
    @api.post("/v1/chat/completions", **R.generation_route(S.ChatCompletion, S.ChatCompletionChunk))
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        req, group = await in_lane(state, len(body), prepare, state, body)
        return await respond(request, state, group, arrived, [ChatShape(req, req.model, state.engine)])


FAMILY = RouteFamily(register, bodies={"/v1/chat/completions": S.ChatCompletionRequest},
                     streamed=(S.ChatCompletionChunk,))


def prepare(state: ServerState, body: bytes):
    """In a lane worker: the parsed request and its one choice's scheduler handle."""
    req = parse(S.ChatCompletionRequest, body)
    adapter = state.resolve_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    constraint = request_config.constraint(req, state)
    config = request_config.config(req, req.new_tokens, (req.top_logprobs or 0) if req.logprobs else None, adapter,
                                   constraint, request_config.speculation(req, state))
    try:
        text = state.chat.render([m.for_template() for m in req.messages])
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="chat_template") from None
    state.check_chars(len(text), "messages")
    ids = state.encode(text, special=False)  # the template already wrote any BOS
    state.check_tokens(len(ids), "messages")
    return req, Group([submit(state, ids, config, "messages", constraint)])


class ChatShape(Shape):
    prefix = "chatcmpl"

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

    def whole(self, handle, events: list[TokenEvent]) -> dict:
        choice = S.ChatChoice(message=S.AssistantMessage(content="".join(e.text for e in events)),
                              logprobs=self._logprobs(events),
                              finish_reason=finish(events[-1].finish_reason if events else "length"),
                              token_ids=self.ids(events))
        return dump(S.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                     usage=self.usage(handle, len(tokens(events))),
                                     prompt_token_ids=list(handle.prompt_ids) if self.req.return_token_ids else None))

    def _chunk(self, choices: list[S.ChatChunkChoice], usage: S.Usage | None = None) -> dict:
        return dump(S.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=usage))

    def opening(self) -> list[dict]:
        return [self._chunk([S.ChatChunkChoice(delta=S.Delta(role="assistant", content=""))])]

    def chunk(self, ev: TokenEvent, handle=None) -> dict | None:
        if not ev.text and ev.finish_reason is None and not self.req.logprobs and not self.req.return_token_ids:
            return None
        delta = S.Delta(content=ev.text) if ev.text or ev.finish_reason is None else S.Delta()
        return self._chunk([S.ChatChunkChoice(delta=delta, logprobs=self._logprobs([ev]),
                                              finish_reason=finish(ev.finish_reason), token_ids=self.ids([ev]))])

    def usage_chunk(self, handle, count: int) -> dict:
        return self._chunk([], self.usage(handle, count))
