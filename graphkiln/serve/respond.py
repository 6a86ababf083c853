"""From a request's scheduler handles to the HTTP response, whole or as server-sent events.

``respond`` starts a watcher that waits for the client's ``http.disconnect`` and cancels the
request (its slot is freed at the scheduler's next step); events are read with
``RequestHandle.aevents()``; on every exit path (done, failed, client gone) the handles are
cancelled (idempotent) and the watcher stopped. A route family gives one ``Shape`` per choice:
how its events become OpenAI's JSON.

finish_reason, as OpenAI clients know it: "stop" (an EOS token or a stop string) and "length"
(``max_tokens``, or the artifact's maximum sequence length) pass through; a request that the
shutdown's drain deadline cut short (the scheduler's "cancelled") ends with vLLM's "abort". A
request that reached its stop or length first finishes with that reason, never "abort". A
client that hung up sees nothing; the Python API's ``TokenEvent`` keeps "cancelled", and so does
the ``graphkiln_requests_finished_total{reason}`` metric.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.request.constraint import GrammarFailed
from graphkiln.runtime.requests import TokenEvent
from graphkiln.serve import schemas as S
from graphkiln.serve.errors import ApiError
from graphkiln.serve.request_config import refused_constraint
from graphkiln.serve.state import ServerState
from graphkiln.serve.submit import Group


class Shape:
    """How one route turns a request's events into OpenAI's JSON (whole or as chunks). A family
    subclasses it with ``whole(handle, events)``, ``chunk(event, handle)`` (None: nothing to send
    yet; a dict, or a list of them) and ``usage_chunk(handle, count)``. ``constraint``: the
    request's output constraint, which a grammar failing mid-generation is reported against."""

    prefix = "cmpl"

    def __init__(self, req, model_name: str, engine, constraint: S.OutputConstraint | None = None) -> None:
        self.req, self.model, self.tokenizer = req, model_name, engine.tokenizer
        self.constraint = constraint if constraint is not None else next(iter(req.constraints()), None)
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.text_len = 0  # characters of text emitted so far (completions' text_offset)

    def token_text(self, token_id: int) -> str:
        # vLLM's convention for a token that has no text (artifacts without a tokenizer)
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"token_id:{token_id}"

    def usage(self, handle, completion: int) -> S.Usage:
        prompt = len(handle.prompt_ids)
        return S.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=S.PromptTokensDetails(cached_tokens=handle.cached_tokens))

    def ids(self, events: list[TokenEvent]) -> list[int] | None:
        return [e.token_id for e in tokens(events)] if self.req.return_token_ids else None

    def opening(self) -> list[dict]:
        return []


def finish(reason: str | None) -> str | None:
    """The finish_reason OpenAI clients know (module docstring): the scheduler's "cancelled"
    (cut by the drain deadline) is vLLM's "abort"."""
    return reason if reason in (None, "stop", "length") else "abort"


def tokens(events: list[TokenEvent]) -> list[TokenEvent]:
    """The events that carry a token (a cancellation's last event has token_id -1)."""
    return [e for e in events if e.token_id >= 0]


def dump(model: BaseModel) -> dict:
    """OpenAI's JSON: null fields stay (clients expect ``finish_reason: null``), except the
    token-id extensions, present only when asked for."""
    out = model.model_dump(mode="json")
    for holder in [out, *out.get("choices", [])]:
        for key in ("token_ids", "prompt_token_ids"):
            if holder.get(key, 0) is None:
                del holder[key]
        for said in (holder.get("message"), holder.get("delta")):  # chat: tool calls only when made
            if isinstance(said, dict) and said.get("reasoning_content", "") is None:  # and thinking only when done
                del said["reasoning_content"]
            if isinstance(said, dict) and "tool_calls" in said:
                if said["tool_calls"] is None:
                    del said["tool_calls"]
                elif "delta" in holder:  # a streamed call's pieces carry only what they add (OpenAI's)
                    said["tool_calls"] = [_present(c) for c in said["tool_calls"]]
    return out


def _present(value):
    """``value`` without its null fields, nested ones too."""
    if isinstance(value, dict):
        return {k: _present(v) for k, v in value.items() if v is not None}
    return value


async def _cancel_on_disconnect(request: Request, handle) -> None:
    """Cancel ``handle`` once the client has gone (the body is already read, so the next ASGI
    message is ``http.disconnect``); cancelled by the route when the response is complete."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


async def _tracked(state: ServerState, handle, arrived: float) -> AsyncIterator[TokenEvent]:
    """The request's events, observing time to first token, inter-token latency and the finish."""
    metrics, last, reason = state.metrics, None, "cancelled"
    try:
        async for ev in handle.aevents():
            if ev.token_id >= 0:  # a cancellation's last event carries no token
                now = time.perf_counter()
                (metrics.ttft if last is None else metrics.itl).observe(now - (arrived if last is None else last))
                last = now
            if ev.finish_reason is not None:
                reason = ev.finish_reason
            yield ev
    except GraphkilnError:
        reason = "error"
        raise
    finally:
        metrics.finished.labels(reason).inc()


async def respond(request: Request, state: ServerState, group: Group, arrived: float, shapes: list[Shape]):
    """The response for a request's choices: ``shapes[i]`` shapes ``group.handles[i]``'s events."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, group))
    if shapes[0].req.stream:
        return StreamingResponse(_sse(state, group, arrived, shapes, watcher), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(state, group, arrived, shapes, watcher)


async def _whole(state, group: Group, arrived, shapes: list[Shape], watcher) -> JSONResponse:
    async def collect(handle) -> list[TokenEvent]:
        return [ev async for ev in _tracked(state, handle, arrived)]

    try:
        per_choice = await asyncio.gather(*(collect(h) for h in group.handles))
    except GraphkilnError as exc:
        model = shapes[0].model
        if model != state.options.model_name and model not in state.adapter_names():
            # its LoRA adapter was unloaded while the request waited for a slot: as if never served
            raise ApiError(404, f"{exc}", param="model", code="model_not_found") from None
        if isinstance(exc, GrammarFailed):  # the request's grammar failed, not the server
            raise refused_constraint(exc, shapes[0].constraint) from None
        raise ApiError(500, f"generation failed: {exc}", "server_error", code="generation_failed") from None
    finally:
        watcher.cancel()
        group.cancel()
    return JSONResponse(_merged([s.whole(h, evs) for s, h, evs in zip(shapes, group.handles, per_choice)]))


def _merged(bodies: list[dict]) -> dict:
    """One response of several choices' (index in order, usage summed); the prompt ids, asked for
    with return_token_ids, are then each choice's own ``prompt_token_ids``."""
    if len(bodies) == 1:
        return bodies[0]
    out = dict(bodies[0], choices=[])
    for i, body in enumerate(bodies):
        for choice in body["choices"]:
            out["choices"].append(dict(choice, index=i) | (
                {"prompt_token_ids": body["prompt_token_ids"]} if "prompt_token_ids" in body else {}))
    out.pop("prompt_token_ids", None)
    if out.get("usage") is not None:
        out["usage"] = {k: _summed([b["usage"][k] for b in bodies]) for k in out["usage"]}
    return out


def _summed(values: list):
    """Usage fields of several choices summed, nested ones (``prompt_tokens_details``) key by key."""
    if isinstance(values[0], dict):
        return {k: _summed([v[k] for v in values]) for k in values[0]}
    return sum(values)


async def _sse(state, group: Group, arrived, shapes: list[Shape], watcher) -> AsyncIterator[str]:
    """Server-sent events of every choice, interleaved as their tokens come (each chunk one
    choice's, its ``index`` set), then one usage chunk when asked for."""
    events: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle) -> None:
        try:
            async for ev in _tracked(state, handle, arrived):
                events.put_nowait((i, ev, None))
        except GraphkilnError as exc:
            events.put_nowait((i, None, exc))
        else:
            events.put_nowait((i, None, None))

    pumps = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(group.handles)]
    try:
        for chunk in shapes[0].opening():
            yield data(chunk)
        counts, running = [0] * len(pumps), len(pumps)
        while running:
            i, ev, error = await events.get()
            if error is not None:
                raise error
            if ev is None:
                running -= 1
                continue
            counts[i] += ev.token_id >= 0
            chunks = shapes[i].chunk(ev, group.handles[i])
            for chunk in [chunks] if isinstance(chunks, dict) else chunks or ():
                for choice in chunk.get("choices", ()):  # a Responses event has none
                    choice["index"] = i
                yield data(chunk)
        if shapes[0].req.include_usage:
            yield data(_merged([s.usage_chunk(h, n) for s, h, n in zip(shapes, group.handles, counts)]))
    except GrammarFailed as exc:  # the request's grammar failed: its 400 as the error event
        yield data(refused_constraint(exc, shapes[0].constraint).body())
    except GraphkilnError as exc:
        # the 200 and earlier chunks are already sent: the failure is an error event, then the end
        yield data(S.ErrorBody(error=S.ErrorDetail(message=f"generation failed: {exc}", type="server_error",
                                                   code="generation_failed")).model_dump())
    finally:
        for p in pumps:
            p.cancel()
        watcher.cancel()
        group.cancel()
    yield "data: [DONE]\n\n"


def data(payload: dict) -> str:
    """One server-sent event of ``payload``'s JSON; a Responses event (its ``type`` a string) is
    named by an ``event:`` line too, as OpenAI's server writes it."""
    kind = payload.get("type")
    head = f"event: {kind}\n" if isinstance(kind, str) else ""
    return f"{head}data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
