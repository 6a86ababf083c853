"""The FastAPI app: OpenAI-compatible routes over a running ``Scheduler``.

``create_app`` builds the app from route families (``FAMILIES``), each a module with a
``FAMILY = RouteFamily(register, bodies, ...)`` (``state.RouteFamily``); a new family is one line
there:

    info.py         GET /v1/models, GET /metrics
    admin.py        POST /v1/load_lora_adapter, /v1/unload_lora_adapter (vLLM's)
    completions.py  POST /v1/completions
    chat.py         POST /v1/chat/completions
    tokenize.py     GET /tokenizer_info, POST /tokenize, /detokenize (vLLM's)
    embeddings.py   POST /v1/embeddings
    responses.py    POST /v1/responses (stateless, prepared as the chat request it means)

and the shared machinery: ``state`` (AppOptions, ServerState), ``errors`` (ApiError),
``body`` (reading and parsing a body, validation errors as 400s), ``request_config`` (a
request's parameters as the engine's GenerationConfig: sampling, structured output, speculative
decoding; every generation route uses it), ``submit`` (lanes, scheduler submission) and
``respond`` (whole responses and server-sent events, finish reasons). This module adds
``GET /health`` (never needs the API key; 503 while draining), ``GET /openapi.json`` and the
error handlers.

Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}`` with one line of
message: 400 for anything the request got wrong (malformed JSON, unknown field, ill-typed or
out-of-range value, prompt too long: code ``context_length_exceeded``), 404 for a ``model`` not
served (code ``model_not_found``), 401 without the API key, 413 for a body over
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

``GET /openapi.json`` is FastAPI's OpenAPI document of these routes, with the request bodies as
the routes parse them (strict, no unknown fields, the served names as the only ``model`` values)
and every response, errors included. With an API key it needs the key like every route but
``/health``: it describes this deployment (the model's name) and the key keeps that private.
"""
from __future__ import annotations

import hmac
import logging

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from graphkiln.serve import admin, chat, completions, embeddings, info, responses, tokenize
from graphkiln.serve import routes as R
from graphkiln.serve.errors import ApiError
from graphkiln.serve.state import DEFAULT_MAX_BODY_BYTES, AppOptions, RouteFamily, ServerState

__all__ = ["AppOptions", "DEFAULT_MAX_BODY_BYTES", "FAMILIES", "ServerState", "create_app"]

log = logging.getLogger("graphkiln.serve")

# the route families, in the order their routes are listed (and documented)
FAMILIES: tuple[RouteFamily, ...] = (info.FAMILY, admin.FAMILY, completions.FAMILY, chat.FAMILY, tokenize.FAMILY,
                                     embeddings.FAMILY, responses.FAMILY)


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
    for family in FAMILIES:
        family.register(api, state)

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi_document():
        return JSONResponse(app.openapi())

    app.include_router(api)
    return app


def _cache_openapi(app: FastAPI, state: ServerState) -> dict:
    """The OpenAPI document, rebuilt when the served models (loaded adapters) have changed."""
    names = state.model_names()
    if app.openapi_schema is None or app.state.openapi_models != names:
        app.openapi_schema = R.openapi_document(app, names, state.options.api_key is not None, FAMILIES)
        app.state.openapi_models = names
    return app.openapi_schema
