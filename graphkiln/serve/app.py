"""The FastAPI app: OpenAI-compatible routes over a running ``Scheduler``.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events or not), ``GET /v1/models``, ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(vLLM's), ``GET /health`` (never needs the API key; 503 while draining), ``GET /metrics``
(Prometheus text), ``GET /openapi.json`` (below). Every error is OpenAI's body
``{"error": {"message", "type", "param", "code"}}`` with one line of message: 400 for anything
the request got wrong (malformed JSON, unknown field, ill-typed or out-of-range value,
prompt too long: code ``context_length_exceeded``), 404 for a ``model`` not served (code
``model_not_found``), 401 without the API key, 413 for a body over
``max_body_bytes``, 429 with ``Retry-After`` when the scheduler's queue is full (``queue_full``) or
the big-body lane is (``server_busy``), 503 while shutting down, 500 when generation itself failed
(that request only: the others keep running).

Lifecycle of a generation request: read the body (at most ``max_body_bytes``) -> in a worker thread
of its lane (``graphkiln.serve.admission``: big bodies never delay small ones, and a full big lane
is a 429 with ``Retry-After``), parse and validate it, refuse a text prompt too long for the
artifact by its character count alone, render the chat template, tokenize (the GIL released) and
submit to the scheduler; nothing of this runs on the event loop -> a watcher task waits for the client's
``http.disconnect`` and cancels the request (its slot is freed at the scheduler's next step) ->
events are read with ``RequestHandle.aevents()`` -> on every exit path (done, failed, client gone)
the handle is cancelled (idempotent) and the watcher stopped. The app never starts or stops the
scheduler: ``graphkiln.serve.server`` owns both lifecycles.

Structured output: OpenAI's ``response_format`` (text, json_object, json_schema) and vLLM's
``guided_json``/``guided_regex``/``guided_grammar``/``structured_outputs`` become the config's
``json_schema``/``regex``/``grammar`` (at most one: two are a 400 ``conflicting_constraints``);
the engine compiles the grammar when the request is submitted, in the lane worker, and a schema,
regex or grammar it refuses is a 400 ``invalid_response_format`` whose ``param`` is the request's
field (``response_format.json_schema.schema``, ``guided_regex``, ...) and whose message is the
engine's line with that field in front.

``param`` of a 400 names the field as OpenAI writes it (``messages[0].content``, ``stop``), never
pydantic's internal location (which adds union members' type names such as ``str``).

finish_reason, as OpenAI clients know it: "stop" (an EOS token or a stop string) and "length"
(``max_tokens``, or the artifact's maximum sequence length) pass through; a request that the
shutdown's drain deadline cut short (the scheduler's "cancelled") ends with vLLM's "abort". A
request that reached its stop or length first finishes with that reason, never "abort". A
client that hung up sees nothing; the Python API's ``TokenEvent`` keeps "cancelled", and so does
the ``graphkiln_requests_finished_total{reason}`` metric.

Speculative decoding: a request's ``speculative`` (graphkiln's extension: "ngram[:K]",
"draft[:K]", "off"), else the server's ``--speculative`` (``AppOptions.speculative``), becomes
the config's ``speculative``; a value the engine refuses, or "draft" on a server without
``--draft``, is a 400 whose ``param`` is "speculative", before anything is queued. Greedy
output is the same with it or without; sampled output keeps its distribution.

LoRA adapters (an artifact exported with ``--lora-rank``): a request's ``model`` is the base
model's name or a loaded adapter's, which becomes ``GenerationConfig(adapter=...)``; the engine's
``adapter_names()`` is what is served. Loads and unloads through the routes run in a worker
thread, one at a time, and never evict a served adapter (all slots taken: 409); unloading one that
queued or running requests use is a 409 too.

``GET /openapi.json`` is FastAPI's OpenAPI document of these routes, with the request bodies as
the routes parse them (strict, no unknown fields, the served names as the only ``model`` values)
and every response, errors included. With an API key it needs the key like every route but
``/health``: it describes this deployment (the model's name) and the key keeps that private.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import secrets
import threading
import time
import typing
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.requests import GenerationConfig, TokenEvent
from graphkiln.runtime.request.tokenizer import IncrementalDetokenizer
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.admission import DEFAULT_BIG_LANE_BYTES, LaneFull, Lanes, chars_per_token_bound, min_tokens
from graphkiln.runtime.request.chat_template import ChatTemplate, ChatTemplateError
from graphkiln.runtime.request.constraint import GrammarFailed
from graphkiln.serve.metrics import ServerMetrics

log = logging.getLogger("graphkiln.serve")

DEFAULT_MAX_BODY_BYTES = 8 << 20
ADAPTER_BODY_BYTES = 64 << 10  # a load/unload body is a name and a path
RETRY_AFTER_S = 1  # a full queue drains in about one request's time; clients back off from there


@dataclass(frozen=True)
class AppOptions:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    big_lane_bytes: int = DEFAULT_BIG_LANE_BYTES  # bodies over 64 KiB being prepared at once (admission)
    # LoRA adapters already loaded into the engine at startup, (name, path as given): their
    # /v1/models root (server.load_adapters loads them)
    lora_adapters: tuple[tuple[str, str], ...] = ()
    # the load/unload routes read a directory on this machine that the client names: open only when
    # the operator says so (serve --allow-lora-updates), as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
    lora_updates: bool = False
    # requests' default speculative decoding, already checked (serve --speculative/--draft:
    # server.default_speculation); None: off unless a request asks
    speculative: str | None = None


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; ``message`` is one line."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = S.ErrorBody(error=S.ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


class ServerState:
    """What the routes share. ``draining`` turns on when shutdown begins (new requests: 503)."""

    def __init__(self, scheduler, engine, options: AppOptions) -> None:
        self.scheduler, self.engine, self.options = scheduler, engine, options
        self.metrics = ServerMetrics(scheduler.stats)
        files = tuple(engine.manifest.tokenizer_files)
        self.tokenizer = engine.tokenizer  # encodes with the GIL released (runtime.request.tokenizer)
        self.chars_per_token = chars_per_token_bound(self.tokenizer.backend) if self.tokenizer is not None else None
        self.chat = ChatTemplate.load(engine.artifact_dir, files, tokenizer=self.tokenizer)
        self.lanes = Lanes(options.big_lane_bytes)
        self.created = int(time.time())
        self.draining = False
        self.lora = engine.manifest.lora  # LoraSpec, or None: exported without LoRA
        # adapter name -> (path as given, when loaded): /v1/models' root and created. The engine's
        # adapter_names() is what is served; loads and unloads through the routes are serialized
        # by _adapters_lock (the slot check and the load are one step, so a load never evicts)
        self._adapter_info = {name: (path, self.created) for name, path in options.lora_adapters}
        self._adapters_lock = threading.Lock()

    # -- models and LoRA adapters ----------------------------------------------------------

    def adapter_names(self) -> list[str]:
        return list(self.engine.adapter_names()) if self.lora is not None else []

    def model_names(self) -> tuple[str, ...]:
        """Every model id a request may name: the base model's, then the loaded adapters'."""
        return (self.options.model_name, *self.adapter_names())

    def model_cards(self) -> list[S.ModelCard]:
        base = self.options.model_name
        cards = [S.ModelCard(id=base, created=self.created, root=base, max_model_len=self.engine.max_seq_len)]
        for name in self.adapter_names():
            root, created = self._adapter_info.get(name, (None, self.created))
            cards.append(S.ModelCard(id=name, created=created, root=root, parent=base,
                                     max_model_len=self.engine.max_seq_len))
        return cards

    def resolve_model(self, name: str) -> str | None:
        """The adapter a request's ``model`` selects (None: the base model); any other name is a 404."""
        if name == self.options.model_name:
            return None
        if name in self.adapter_names():
            return name
        raise _unknown_model(name, self.options.model_name, self.lora is not None)

    def needs_lora(self) -> None:
        if self.lora is None:
            raise ApiError(400, "this artifact was exported without LoRA support, so it serves no adapters: re-export "
                                "it with --lora-rank R (and --max-loras N) to load them", code="lora_not_supported")
        if not self.options.lora_updates:
            raise ApiError(403, "loading and unloading LoRA adapters while serving is off on this server: start it "
                                "with --allow-lora-updates (or serve adapters with --lora NAME=DIR)",
                           "permission_error", code="lora_updates_disabled")

    def load_adapter(self, name: str, path: str) -> None:
        """In a worker thread: ``Engine.load_adapter`` with its refusals as ApiErrors: a name the
        CLI would refuse is a 400 about ``lora_name``, a refused adapter one about ``lora_path``
        (reading it never blocks: ``runtime.lora.adapter_dir``). Never evicts a served adapter:
        with every slot holding one, a 409 (unload one first)."""
        from graphkiln.runtime.lora import check_adapter_name

        self.needs_lora()
        try:  # the CLI's rule (serve --lora NAME=DIR); checked first, so it is reported as lora_name's
            check_adapter_name(name)
        except GraphkilnError as exc:
            raise ApiError(400, str(exc), param="lora_name", code="invalid_lora_name") from None
        if name == self.options.model_name:
            raise ApiError(400, f"lora_name '{_clip(name, 80)}' is the base model's name: choose another",
                           param="lora_name", code="invalid_lora_name")
        with self._adapters_lock:
            loaded = self.adapter_names()
            if name in loaded:
                raise ApiError(400, f"a LoRA adapter named '{_clip(name, 80)}' is already loaded: unload it first "
                                    "(POST /v1/unload_lora_adapter) or choose another name", param="lora_name",
                               code="lora_adapter_exists")
            if len(loaded) >= self.lora.max_loras:
                raise ApiError(409, f"all {self.lora.max_loras} LoRA slots hold adapters "
                                    f"({', '.join(map(repr, loaded))}): unload one first (POST "
                                    "/v1/unload_lora_adapter), or re-export with a larger --max-loras",
                               "invalid_request_error", code="lora_slots_full")
            try:
                self.engine.load_adapter(name, path)
            except GraphkilnError as exc:
                raise ApiError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
            now = self.adapter_names()
            self._adapter_info = {k: v for k, v in self._adapter_info.items() if k in now}
            self._adapter_info[name] = (path, int(time.time()))

    def unload_adapter(self, name: str) -> None:
        """In a worker thread: ``Engine.unload_adapter``; unknown name 404, in use by queued or
        running requests 409 (they hold it from submission: unloading it would fail them)."""
        self.needs_lora()
        with self._adapters_lock:
            if name not in self.adapter_names():
                raise _unknown_adapter(name, self.adapter_names())
            try:
                self.engine.unload_adapter(name)
            except GraphkilnError as exc:
                if name not in self.adapter_names():  # unloaded meanwhile, not through the routes
                    raise _unknown_adapter(name, self.adapter_names()) from None
                raise ApiError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
            self._adapter_info.pop(name, None)

    def check_chars(self, chars: int, param: str) -> None:
        """Refuse a text that provably has more tokens than the artifact takes, before tokenizing."""
        m, limit = self.chars_per_token, self.engine.max_seq_len
        if m is not None and chars > (limit - 1) * m:
            raise ApiError(400, f"{param} has {chars} characters, so at least {min_tokens(chars, m)} tokens, but the "
                                f"artifact's maximum sequence length is {limit}: shorten it or re-export with a larger "
                                "--max-seq-len", param=param, code="context_length_exceeded")

    def check_tokens(self, count: int, param: str) -> None:
        limit = self.engine.max_seq_len
        if count >= limit:
            raise ApiError(400, f"{param} has {count} tokens but the artifact's maximum sequence length is {limit}: "
                                "shorten it or re-export with a larger --max-seq-len", param=param,
                           code="context_length_exceeded")

    def encode(self, text: str, *, special: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=special)


def create_app(scheduler, engine, options: AppOptions) -> FastAPI:
    """The app for one model. ``scheduler`` must be started before requests arrive."""
    state = ServerState(scheduler, engine, options)
    app = FastAPI(title="graphkiln", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.graphkiln = state
    # served by a route of its own (below), so that it needs the API key like the others
    app.openapi = lambda: _cache_openapi(app, state)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        if exc.status < 500:
            state.metrics.rejected.labels(str(exc.status)).inc()
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code).response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception):
        log.exception("unexpected error serving %s", request.url.path)
        return ApiError(500, f"internal error ({type(exc).__name__}); see the server log", "server_error").response()

    def authorize(request: Request) -> None:
        key = options.api_key
        if key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @app.get("/health", responses=R.RESPONSES["health"])
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    api = APIRouter(dependencies=[Depends(authorize)])

    @api.get("/metrics", responses=R.RESPONSES["metrics"], response_class=PlainTextResponse)
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models", responses=R.RESPONSES["models"])
    async def models():
        return S.ModelList(data=state.model_cards()).model_dump()

    # vLLM's adapter routes (vllm serve --enable-lora, VLLM_ALLOW_RUNTIME_LORA_UPDATING): the body
    # is parsed on the loop (at most ADAPTER_BODY_BYTES), the adapter is read in a worker thread
    @api.post("/v1/load_lora_adapter", **R.adapter_route("load"))
    async def load_lora_adapter(request: Request):
        _check_open(state)
        req = _parse(S.LoadLoraAdapterRequest, await _read_body(request, ADAPTER_BODY_BYTES))
        await asyncio.to_thread(state.load_adapter, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter", **R.adapter_route("unload"))
    async def unload_lora_adapter(request: Request):
        _check_open(state)
        req = _parse(S.UnloadLoraAdapterRequest, await _read_body(request, ADAPTER_BODY_BYTES))
        await asyncio.to_thread(state.unload_adapter, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    @api.post("/v1/completions", **R.generation_route(S.Completion, S.Completion))
    async def completions(request: Request):
        arrived = time.perf_counter()
        _check_open(state)
        body = await _read_body(request, options.max_body_bytes)
        req, group = await _in_lane(state, len(body), _prepare_completion, state, body)
        shapes = [_CompletionShape(req, req.model, engine, p) for p in req.prompts]  # model: checked
        return await _respond(request, state, group, arrived, shapes)

    @api.post("/v1/chat/completions", **R.generation_route(S.ChatCompletion, S.ChatCompletionChunk))
    async def chat_completions(request: Request):
        arrived = time.perf_counter()
        _check_open(state)
        body = await _read_body(request, options.max_body_bytes)
        req, group = await _in_lane(state, len(body), _prepare_chat, state, body)
        return await _respond(request, state, group, arrived, [_ChatShape(req, req.model, engine)])

    # vLLM's tokenizer routes, at the root as there: lm-evaluation-harness's remote tokenizer
    # (tokenizer_backend=remote) reads /tokenizer_info, then posts to /tokenize and /detokenize
    @api.get("/tokenizer_info", responses=R.RESPONSES["tokenizer_info"])
    async def tokenizer_info():
        return _tokenizer_info(state).model_dump()

    @api.post("/tokenize", **R.tokenizer_route(S.TokenizeResponse))
    async def tokenize(request: Request):
        _check_open(state)
        body = await _read_body(request, options.max_body_bytes)
        return (await _in_lane(state, len(body), _tokenize, state, body)).model_dump()

    @api.post("/detokenize", **R.tokenizer_route(S.DetokenizeResponse))
    async def detokenize(request: Request):
        _check_open(state)
        body = await _read_body(request, options.max_body_bytes)
        return (await _in_lane(state, len(body), _detokenize, state, body)).model_dump()

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_document():
        return JSONResponse(app.openapi())

    app.include_router(api)
    return app


def _cache_openapi(app: FastAPI, state: ServerState) -> dict:
    """The OpenAPI document, rebuilt when the served models (loaded adapters) have changed."""
    names = state.model_names()
    if app.openapi_schema is None or app.state.openapi_models != names:
        app.openapi_schema = R.openapi_document(app, names, state.options.api_key is not None)
        app.state.openapi_models = names
    return app.openapi_schema


# -- request handling ---------------------------------------------------------------------


def _check_open(state: ServerState) -> None:
    if state.draining:
        raise ApiError(503, "the server is shutting down: retry on another instance", "server_error",
                       code="shutting_down")


async def _in_lane(state: ServerState, size: int, prepare, *args):
    """``prepare(*args)`` in the worker lane for a body of ``size`` bytes (``admission``)."""
    try:
        future = state.lanes.submit(size, prepare, *args)
    except LaneFull as exc:
        raise ApiError(429, f"the server is busy preparing other large requests ({exc.in_flight} bytes): retry "
                            "shortly, or send a shorter prompt", "rate_limit_error", code="server_busy",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        # the route was abandoned while its request was prepared: nobody will read that request
        future.add_done_callback(lambda f: f.cancelled() or f.exception() is not None or f.result()[1].cancel())
        raise


class _Group:
    """The scheduler handles of one HTTP request's choices (one per prompt), cancelled together."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()


def _prepare_completion(state: ServerState, body: bytes):
    """In a lane worker: the parsed request and its choices' scheduler handles. Every prompt is
    checked before any is submitted; a refusal of a later one (queue full) cancels the earlier.
    The prompts are submitted as one group, served as one submission beside others
    (``Scheduler.submit``): a request with many prompts delays a later one as one prompt would."""
    req = _parse(S.CompletionRequest, body)
    adapter = state.resolve_model(req.model)
    constraint = _constraint(req, state)
    config = _config(req, req.max_tokens, req.logprobs, adapter, constraint, _speculation(req, state))
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
    group = _Group([])
    try:
        for prompt, param in ready:
            group.handles.append(_submit(state, prompt, config, param, constraint, group=group))
    except BaseException:
        group.cancel()
        raise
    return req, group


def _prepare_chat(state: ServerState, body: bytes):
    req = _parse(S.ChatCompletionRequest, body)
    adapter = state.resolve_model(req.model)
    if req.top_logprobs is not None and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    constraint = _constraint(req, state)
    config = _config(req, req.new_tokens, (req.top_logprobs or 0) if req.logprobs else None, adapter, constraint,
                     _speculation(req, state))
    try:
        text = state.chat.render([m.for_template() for m in req.messages])
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="chat_template") from None
    state.check_chars(len(text), "messages")
    ids = state.encode(text, special=False)  # the template already wrote any BOS
    state.check_tokens(len(ids), "messages")
    return req, _Group([_submit(state, ids, config, "messages", constraint)])


def _tokenizer_info(state: ServerState) -> S.TokenizerInfo:
    engine, tok = state.engine, state.tokenizer
    gen = engine.manifest.generation

    def text(token_id: int | None) -> str | None:
        return tok.token_text(token_id) if tok is not None and token_id is not None else None

    return S.TokenizerInfo(bos_token=text(gen.bos_token_id), eos_token=text(next(iter(gen.eos_token_ids), None)),
                           pad_token=text(gen.pad_token_id), chat_template=state.chat.source,
                           model_max_length=engine.max_seq_len, vocab_size=engine.manifest.model.vocab_size)


def _needs_tokenizer(state: ServerState) -> None:
    if state.tokenizer is None:
        raise ApiError(400, "this artifact has no tokenizer.json: send and read token ids instead",
                       code="no_tokenizer")


def _tokenize(state: ServerState, body: bytes) -> S.TokenizeResponse:
    """In a lane worker (a long text is tokenized there, as a prompt would be)."""
    req = _parse(S.TokenizeRequest, body)
    if req.model is not None:
        state.resolve_model(req.model)  # every served model has the artifact's tokenizer
    _needs_tokenizer(state)
    ids = state.encode(req.prompt, special=req.add_special_tokens)
    return S.TokenizeResponse(count=len(ids), max_model_len=state.engine.max_seq_len, tokens=ids)


def _detokenize(state: ServerState, body: bytes) -> S.DetokenizeResponse:
    req = _parse(S.DetokenizeRequest, body)
    if req.model is not None:
        state.resolve_model(req.model)  # every served model has the artifact's tokenizer
    _needs_tokenizer(state)
    vocab = state.engine.manifest.model.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]")
    return S.DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the {limit}-byte limit: send a shorter prompt",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the {limit}-byte limit: send a shorter prompt",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc, model) from None


def _validation_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"request body is not valid JSON ({_clip(first.get('ctx', {}).get('error', ''))}): "
                             "send one JSON object", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "request body must be a JSON object", code="invalid_json")
    param = _param(model, first["loc"], first["type"] == "extra_forbidden")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}': graphkiln serve does not support it; leave it out",
                        param=param, code="unknown_field")
    if first["type"] == "missing":
        return ApiError(400, f"'{param}' is required", param=param, code="missing_field")
    # a field failing every member of a union gives one error per member: name them together
    inside = [e for e in errors if _within(_param(model, e["loc"], e["type"] == "extra_forbidden"), param)]
    msgs = list(dict.fromkeys(_clip(e["msg"]) for e in inside))[:3]
    return ApiError(400, f"invalid '{param}': {'; or '.join(msgs)}", param=param, code="invalid_value")


def _param(model: type[BaseModel], loc: tuple, unknown: bool) -> str | None:
    """The field an error's location names, as OpenAI writes it (``messages[0].content``).
    pydantic's location also holds the tags of union members (``str``, ``list[int]``, a model's
    name) and dict keys: only the field names of the models along the path and list indices are
    kept, and, for an unknown field (``unknown``), its own name at the end."""
    out, models = "", [model]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        owner = next((m for m in models if _field(m, part) is not None), None)
        if owner is None and not (unknown and i == len(loc) - 1):
            continue
        out += f".{part}" if out else part
        models = _models_in(_field(owner, part).annotation) if owner is not None else []
    return out or None


def _field(model: type[BaseModel], name: str):
    """``model``'s field that JSON names ``name`` (its alias, else its own name), or None."""
    for key, info in model.model_fields.items():
        if (info.alias or key) == name:
            return info
    return None


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _within(param: str | None, field: str | None) -> bool:
    return param == field or (param is not None and field is not None and param.startswith((field + ".", field + "[")))


def _clip(text: str, n: int = 200) -> str:
    return " ".join(str(text).split())[:n]


def _unknown_model(name: str, served: str, lora: bool) -> ApiError:
    """OpenAI's (and vLLM's) answer to a model it does not serve: 404, code model_not_found."""
    also = " or a loaded LoRA adapter" if lora else ""
    return ApiError(404, f"model '{_clip(name, 80)}' is not served here: use '{served}'{also} (GET /v1/models)",
                    param="model", code="model_not_found")


def _unknown_adapter(name: str, loaded: list[str]) -> ApiError:
    return ApiError(404, f"no LoRA adapter named '{_clip(name, 80)}' is loaded (loaded: "
                         f"{', '.join(map(repr, loaded)) or 'none'}; GET /v1/models)", param="lora_name",
                    code="lora_adapter_not_found")


def _constraint(req: S._Sampling, state: ServerState) -> S.OutputConstraint | None:
    """The request's one output constraint (structured output), or None; two are a 400 naming
    both, and any on an artifact without tokenizer.json a 400 ``no_tokenizer``."""
    found = req.constraints()
    if len(found) > 1:
        names = [c.param.split(".")[0] for c in found]
        raise ApiError(400, f"{' and '.join(names)} both constrain the output: send only one of response_format, "
                            "guided_json, guided_regex, guided_grammar, structured_outputs", param=names[1],
                       code="conflicting_constraints")
    if found and state.tokenizer is None:
        raise ApiError(400, f"{found[0].param}: structured output needs the artifact's tokenizer.json, and this "
                            "artifact has none", param=found[0].param, code="no_tokenizer")
    return found[0] if found else None


def _speculation(req: S._Sampling, state: ServerState) -> str | None:
    """The request's speculative decoding (None: off): its own ``speculative`` (the schema has
    checked it), else the server's default; draft drafts on a server without a draft model are a
    400 here, as the engine would refuse them only once submitted."""
    value = req.speculative if req.speculative is not None else state.options.speculative
    if value is not None and value.startswith("draft") and state.engine.draft is None:
        raise ApiError(400, f"speculative '{value}' needs a draft model and this server has none: start it with "
                            "--draft DIR, or send 'ngram[:K]' or 'off'", param="speculative", code="no_draft_model")
    return None if value == "off" else value


def _config(req: S._Sampling, max_tokens: int | None, logprobs: int | None, adapter: str | None = None,
            constraint: S.OutputConstraint | None = None, speculative: str | None = None) -> GenerationConfig:
    """OpenAI's parameters as a GenerationConfig. Temperature 0 is greedy; any sampling field asks
    for sampling; none leaves the artifact's defaults. Without a seed each request gets a random
    one (OpenAI's behaviour: unseeded requests differ). ``adapter``: the LoRA adapter the request's
    ``model`` named (None: the base model). ``constraint`` (``_constraint``: response_format,
    vLLM's guided_* or structured_outputs) sets the config's json_schema, regex or grammar;
    ``speculative`` (``_speculation``) the config's speculative decoding."""
    sampling = (req.temperature is not None and req.temperature > 0) or (
        req.temperature is None and (req.top_p is not None or req.top_k is not None))
    extra = {constraint.field: constraint.value} if constraint is not None else {}
    try:
        return GenerationConfig(
            max_new_tokens=max_tokens, do_sample=True if sampling else (False if req.temperature == 0 else None),
            temperature=req.temperature if sampling else None, top_p=req.top_p, top_k=req.top_k,
            seed=req.seed if req.seed is not None else secrets.randbits(63), stop_strings=req.stop_strings,
            logprobs=logprobs, stop_token_ids=() if req.ignore_eos else None,
            adapter=adapter, speculative=speculative, **extra)
    except GraphkilnError as exc:
        if constraint is not None and str(exc).startswith(constraint.field):
            raise _refused_constraint(exc, constraint) from None
        raise ApiError(400, str(exc)) from None


def _refused_constraint(exc: GraphkilnError, constraint: S.OutputConstraint) -> ApiError:
    """The engine's one line for a schema, regex or grammar it cannot compile (or an artifact
    without tokenizer.json), as a 400 naming the request's field."""
    message, field = str(exc), constraint.field
    if message.startswith(field + ":"):  # the engine's config field, as the request named it
        message = constraint.param + message[len(field):]
    return ApiError(400, _clip(message, 400), param=constraint.param, code="invalid_response_format")


def _submit(state: ServerState, prompt, config: GenerationConfig, param: str,
            constraint: S.OutputConstraint | None = None, group: object = None):
    """``Scheduler.submit`` (in a lane worker: a constraint's grammar is compiled there; ``group``
    the submission's key, as there) with its
    refusals as ApiErrors; the engine's refusal of ``constraint`` (its line starts with the
    config's field name) names the request's field."""
    from graphkiln.runtime.request.scheduler import QueueFull, ShuttingDown

    _check_open(state)
    try:
        return state.scheduler.submit(prompt, config, group=group)
    except QueueFull as exc:
        raise ApiError(429, f"{exc}", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ShuttingDown:
        raise ApiError(503, "the server is shutting down: retry on another instance", "server_error",
                       code="shutting_down") from None
    except GraphkilnError as exc:  # ids outside the vocabulary, no tokenizer for a text prompt, ...
        adapter = config.adapter
        if adapter is not None and adapter not in state.adapter_names():  # unloaded since the model was checked
            raise _unknown_model(adapter, state.options.model_name, True) from None
        if constraint is not None and str(exc).startswith(constraint.field):
            raise _refused_constraint(exc, constraint) from None
        raise ApiError(400, str(exc), param=param) from None


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


async def _respond(request: Request, state: ServerState, group: _Group, arrived: float, shapes: list["_Shape"]):
    """The response for a request's choices: ``shapes[i]`` shapes ``group.handles[i]``'s events."""
    watcher = asyncio.ensure_future(_cancel_on_disconnect(request, group))
    if shapes[0].req.stream:
        return StreamingResponse(_sse(state, group, arrived, shapes, watcher), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    return await _whole(state, group, arrived, shapes, watcher)


async def _whole(state, group: _Group, arrived, shapes: list["_Shape"], watcher) -> JSONResponse:
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
            raise _refused_constraint(exc, shapes[0].req.constraints()[0]) from None
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


async def _sse(state, group: _Group, arrived, shapes: list["_Shape"], watcher) -> AsyncIterator[str]:
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
            yield _data(chunk)
        counts, running = [0] * len(pumps), len(pumps)
        while running:
            i, ev, error = await events.get()
            if error is not None:
                raise error
            if ev is None:
                running -= 1
                continue
            counts[i] += ev.token_id >= 0
            chunk = shapes[i].chunk(ev, group.handles[i])
            if chunk is not None:
                for choice in chunk["choices"]:
                    choice["index"] = i
                yield _data(chunk)
        if shapes[0].req.include_usage:
            yield _data(_merged([s.usage_chunk(h, n) for s, h, n in zip(shapes, group.handles, counts)]))
    except GrammarFailed as exc:  # the request's grammar failed: its 400 as the error event
        refused = _refused_constraint(exc, shapes[0].req.constraints()[0])
        yield _data(S.ErrorBody(error=S.ErrorDetail(message=refused.message, type=refused.type, param=refused.param,
                                                    code=refused.code)).model_dump())
    except GraphkilnError as exc:
        # the 200 and earlier chunks are already sent: the failure is an error event, then the end
        yield _data(S.ErrorBody(error=S.ErrorDetail(message=f"generation failed: {exc}", type="server_error",
                                                    code="generation_failed")).model_dump())
    finally:
        for p in pumps:
            p.cancel()
        watcher.cancel()
        group.cancel()
    yield "data: [DONE]\n\n"


def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _dump(model: BaseModel) -> dict:
    """OpenAI's JSON: null fields stay (clients expect ``finish_reason: null``), except the
    token-id extensions, present only when asked for."""
    out = model.model_dump(mode="json")
    for holder in [out, *out.get("choices", [])]:
        for key in ("token_ids", "prompt_token_ids"):
            if holder.get(key, 0) is None:
                del holder[key]
    return out


# -- response shapes ------------------------------------------------------------------------


def _finish(reason: str | None) -> str | None:
    """The finish_reason OpenAI clients know (module docstring): the scheduler's "cancelled"
    (cut by the drain deadline) is vLLM's "abort"."""
    return reason if reason in (None, "stop", "length") else "abort"


def _tokens(events: list[TokenEvent]) -> list[TokenEvent]:
    """The events that carry a token (a cancellation's last event has token_id -1)."""
    return [e for e in events if e.token_id >= 0]


class _Shape:
    """How one route turns a request's events into OpenAI's JSON (whole or as chunks)."""

    prefix = "cmpl"

    def __init__(self, req, model_name: str, engine) -> None:
        self.req, self.model, self.tokenizer = req, model_name, engine.tokenizer
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
        return [e.token_id for e in _tokens(events)] if self.req.return_token_ids else None

    def opening(self) -> list[dict]:
        return []


class _CompletionShape(_Shape):
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
        for ev in _tokens(events):
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
                                    finish_reason=_finish(events[-1].finish_reason if events else "length"),
                                    token_ids=self.ids(events))
        return _dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                  usage=self.usage(handle, len(_tokens(events))),
                                  prompt_token_ids=list(handle.prompt_ids) if self.req.return_token_ids else None))

    def chunk(self, ev: TokenEvent, handle=None) -> dict | None:
        if (self.echoed and not ev.text and ev.finish_reason is None and self.req.logprobs is None
                and not self.req.return_token_ids):
            return None  # nothing to say yet (a pending stop string or a partial character)
        text, logprobs = self._text_and_logprobs(handle, [ev])
        choice = S.CompletionChoice(text=text, logprobs=logprobs, finish_reason=_finish(ev.finish_reason),
                                    token_ids=self.ids([ev]))
        return _dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def usage_chunk(self, handle, count: int) -> dict:
        return _dump(S.Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                  usage=self.usage(handle, count)))


class _ChatShape(_Shape):
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
            for ev in _tokens(events)])

    def whole(self, handle, events: list[TokenEvent]) -> dict:
        choice = S.ChatChoice(message=S.AssistantMessage(content="".join(e.text for e in events)),
                              logprobs=self._logprobs(events),
                              finish_reason=_finish(events[-1].finish_reason if events else "length"),
                              token_ids=self.ids(events))
        return _dump(S.ChatCompletion(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self.usage(handle, len(_tokens(events))),
                                      prompt_token_ids=list(handle.prompt_ids) if self.req.return_token_ids else None))

    def _chunk(self, choices: list[S.ChatChunkChoice], usage: S.Usage | None = None) -> dict:
        return _dump(S.ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices,
                                           usage=usage))

    def opening(self) -> list[dict]:
        return [self._chunk([S.ChatChunkChoice(delta=S.Delta(role="assistant", content=""))])]

    def chunk(self, ev: TokenEvent, handle=None) -> dict | None:
        if not ev.text and ev.finish_reason is None and not self.req.logprobs and not self.req.return_token_ids:
            return None
        delta = S.Delta(content=ev.text) if ev.text or ev.finish_reason is None else S.Delta()
        return self._chunk([S.ChatChunkChoice(delta=delta, logprobs=self._logprobs([ev]),
                                              finish_reason=_finish(ev.finish_reason), token_ids=self.ids([ev]))])

    def usage_chunk(self, handle, count: int) -> dict:
        return self._chunk([], self.usage(handle, count))
