"""``POST /v1/completions``: OpenAI's text completions (one choice per prompt, echo, logprobs
with ``text_offset``, token ids in or out), whole or streamed."""

from __future__ import annotations

import dataclasses
import time

from fastapi import APIRouter, Request

from graphkiln.runtime.request.tokenizer import IncrementalDetokenizer
from graphkiln.runtime.requests import TokenEvent
from graphkiln.serve import request_config
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.respond import Shape, dump, finish, respond, tokens
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import Group, in_lane, submit


def register(api: APIRouter, state: ServerState) -> None:
    @api.post("/v1/completions", **R.generation_route(S.Completion, S.Completion))
    async def completions(request: Request):
        arrived = time.perf_counter()
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        req, group = await in_lane(state, len(body), prepare, state, body)
        shapes = [CompletionShape(req, req.model, state.engine, p) for p in req.prompts]  # model: checked
        return await respond(request, state, group, arrived, shapes)


FAMILY = RouteFamily(register, bodies={"/v1/completions": S.CompletionRequest}, streamed=(S.Completion,))


def prepare(state: ServerState, body: bytes):
    """In a lane worker: the parsed request and its choices' scheduler handles. Every prompt is
    checked before any is submitted; a refusal of a later one (queue full) cancels the earlier.
    The prompts are submitted as one group, served as one submission beside others
    (``Scheduler.submit``): a request with many prompts delays a later one as one prompt would."""
    req = parse(S.CompletionRequest, body)
    adapter = state.resolve_model(req.model)
    constraint = request_config.constraint(req, state)
    config = request_config.config(req, req.max_tokens, req.logprobs, adapter, constraint,
                                   request_config.speculation(req, state))
    if req.echo and req.logprobs is not None:  # the prompt's own, from the prefill that runs it
        config = dataclasses.replace(config, prompt_logprobs=req.logprobs)
    ready = []
    for k, prompt in enumerate(req.prompts):
        param = "prompt" if len(req.prompts) == 1 else f"prompt[{k}]"
        if isinstance(prompt, str) and state.tokenizer is not None:  # without one, submit refuses text
            state.check_chars(len(prompt), param)
            prompt = state.encode(prompt, special=True)  # as Engine tokenizes: the post-processor's BOS
        if not isinstance(prompt, str):
            state.check_tokens(len(prompt), param)
        ready.append((prompt, param))
    group = Group([])
    try:
        for prompt, param in ready:
            group.handles.append(submit(state, prompt, config, param, constraint, group=group))
    except BaseException:
        group.cancel()
        raise
    return req, group


class CompletionShape(Shape):
    prefix = "cmpl"

    def __init__(self, req, model_name: str, engine, prompt) -> None:
        super().__init__(req, model_name, engine)
        self.prompt = prompt  # this choice's, as the request gave it
        self.echoed = not req.echo  # the prompt goes before the first text there is to send

    def _echo(self, handle) -> tuple[str, S.CompletionLogprobs | None]:
        """The prompt as text (as given, or decoded from ids) and, with logprobs, its tokens'."""
        self.echoed = True
        given = self.prompt
        text = given if isinstance(given, str) else (self.tokenizer.decode(given) if self.tokenizer is not None else "")
        if self.req.logprobs is None:
            self.text_len += len(text)
            return text, None
        out = S.CompletionLogprobs()
        detok = IncrementalDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        ids = handle.prompt_ids
        for i, lp in enumerate(handle.prompt_logprobs):
            out.tokens.append(self.token_text(ids[i]))
            out.token_logprobs.append(None if lp is None else lp.logprob)
            out.top_logprobs.append(None if lp is None else {self.token_text(t): v for t, v in lp.top})
            out.text_offset.append(self.text_len)
            if detok is not None:
                self.text_len += len(detok.step(ids[: i + 1], final=i + 1 == len(ids)))
        return text, out

    def _logprobs(self, events: list[TokenEvent], into: S.CompletionLogprobs | None = None) -> S.CompletionLogprobs | None:
        if self.req.logprobs is None:
            return None
        out = into or S.CompletionLogprobs()
        for ev in tokens(events):
            out.tokens.append(self.token_text(ev.token_id))
            out.token_logprobs.append(ev.logprob.logprob)
            out.top_logprobs.append({self.token_text(t): lp for t, lp in ev.logprob.top})
            out.text_offset.append(self.text_len)
            self.text_len += len(ev.text)
        return out

    def _text_and_logprobs(self, handle, events: list[TokenEvent]) -> tuple[str, S.CompletionLogprobs | None]:
        head, echoed = self._echo(handle) if not self.echoed else ("", None)
        return head + "".join(e.text for e in events), self._logprobs(events, echoed)

    def whole(self, handle, events: list[TokenEvent]) -> dict:
        text, logprobs = self._text_and_logprobs(handle, events)
        choice = S.CompletionChoice(text=text, logprobs=logprobs,
                                    finish_reason=finish(events[-1].finish_reason if events else "length"),
                                    token_ids=self.ids(events))
        return dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                 usage=self.usage(handle, len(tokens(events))),
                                 prompt_token_ids=list(handle.prompt_ids) if self.req.return_token_ids else None))

    def chunk(self, ev: TokenEvent, handle=None) -> dict | None:
        if (self.echoed and not ev.text and ev.finish_reason is None and self.req.logprobs is None
                and not self.req.return_token_ids):
            return None  # nothing to say yet (a pending stop string or a partial character)
        text, logprobs = self._text_and_logprobs(handle, [ev])
        choice = S.CompletionChoice(text=text, logprobs=logprobs, finish_reason=finish(ev.finish_reason),
                                    token_ids=self.ids([ev]))
        return dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def usage_chunk(self, handle, count: int) -> dict:
        return dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                 usage=self.usage(handle, count)))
