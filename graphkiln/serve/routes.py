"""The OpenAPI description of the routes (``GET /openapi.json``): what FastAPI cannot infer.

The generation routes read their bodies themselves (size limit, strict parsing in a worker lane,
errors in OpenAI's shape), so FastAPI sees no body parameter: ``openapi_document`` adds the request
schemas (``schemas.CompletionRequest``, ``schemas.ChatCompletionRequest``, the tokenizer and LoRA
adapter routes') as the routes parse them, narrows ``model`` to the served names (the base model and
the LoRA adapters loaded when the document is asked for; any other is a 404), and declares the API
key's bearer scheme when one is set (every operation but ``/health``; without a key, no 401 is documented). Responses,
errors included, are declared on the routes with ``generation_route`` and ``RESPONSES``.
"""

from __future__ import annotations

from typing import Any

from graphkiln.serve import schemas as S

_ERROR = {"model": S.ErrorBody}
_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
AUTH = {401: {**_ERROR, "description": "missing or wrong API key (only when the server has one)"}}


def generation_route(body: type, chunk: type) -> dict[str, Any]:
    """FastAPI route arguments for a generation route whose whole response is ``body`` and whose
    stream is ``chunk`` events (each event's ``data`` described as OpenAPI 3.1 describes one
    event of a stream: its JSON in ``contentSchema``; a failure mid-stream is an ``ErrorBody``)."""
    data = {"anyOf": [{"const": "[DONE]"}, {"type": "string", "contentMediaType": "application/json",
                                             "contentSchema": {"anyOf": [_ref(chunk), _ref(S.ErrorBody)]}}]}
    event = {"type": "object", "required": ["data"], "properties": {"data": data}}
    return dict(responses={
        200: {"model": body, "description": f"the completion; with stream: true, server-sent events, each `data: <JSON "
                                            f"{chunk.__name__}>`, then `data: [DONE]`",
              "content": {"text/event-stream": {"schema": event}}},
        400: {**_ERROR, "description": "malformed JSON, unknown field, ill-typed or out-of-range value, "
                                       "prompt too long, a response_format/guided_*/structured_outputs "
                                       "constraint or tools' schemas the engine cannot compile "
                                       "(invalid_response_format) or two of them (conflicting_constraints), "
                                       "tools the model has no call format for (tools_not_supported), a tool "
                                       "message answering no earlier call"},
        **AUTH,
        404: {**_ERROR, "description": "model not served here (neither the base model nor a loaded LoRA adapter)"},
        413: {**_ERROR, "description": "body over the server's size limit"},
        429: {**_ERROR, "headers": _RETRY, "description": "queue full, or too many large bodies being prepared"},
        500: {**_ERROR, "description": "generation failed (this request only)"},
        503: {**_ERROR, "description": "shutting down"},
    })


def tokenizer_route(body: type) -> dict[str, Any]:
    """FastAPI route arguments for /tokenize and /detokenize (whole JSON responses)."""
    return dict(responses={
        200: {"model": body, "description": body.__doc__ or body.__name__},
        400: {**_ERROR, "description": "malformed JSON, unknown field, ill-typed value, token id outside "
                                       "the vocabulary, or an artifact without a tokenizer"},
        **AUTH,
        404: {**_ERROR, "description": "model not served here"},
        413: {**_ERROR, "description": "body over the server's size limit"},
        429: {**_ERROR, "headers": _RETRY, "description": "too many large bodies being prepared"},
        503: {**_ERROR, "description": "shutting down"},
    })


def adapter_route(kind: str) -> dict[str, Any]:
    """FastAPI route arguments for /v1/load_lora_adapter (``kind`` "load") and
    /v1/unload_lora_adapter ("unload"): a short text on success, OpenAI's error body otherwise."""
    if kind == "load":
        ok, bad = "loaded and served under lora_name", ("malformed JSON or field, a refused adapter directory (one "
                                                         "line: why, and the fix), a name already served, or an "
                                                         "artifact exported without LoRA")
        conflict = "every LoRA slot holds an adapter: unload one first"
        missing = {}
    else:
        ok, bad = "unloaded", "malformed JSON or field, or an artifact exported without LoRA"
        conflict = "the adapter is in use by running requests"
        missing = {404: {**_ERROR, "description": "no adapter of that name is loaded"}}
    # not response_class=PlainTextResponse: FastAPI would then describe the error bodies as text too
    return dict(responses={
        200: {"description": f"the adapter was {ok}", "content": {"text/plain": {"schema": {"type": "string"}}}},
        400: {**_ERROR, "description": bad},
        **AUTH,
        403: {**_ERROR, "description": "the server was started without --allow-lora-updates"},
        **missing,
        409: {**_ERROR, "description": conflict},
        413: {**_ERROR, "description": "body over 64 KiB"},
        503: {**_ERROR, "description": "shutting down"},
    })


RESPONSES = {
    "tokenizer_info": {200: {"model": S.TokenizerInfo, "description": "special tokens, chat template, limits"},
                       **AUTH},
    "models": {200: {"model": S.ModelList, "description": "the base model, then each loaded LoRA adapter"}, **AUTH},
    "metrics": {200: {"description": "Prometheus text format",
                      "content": {"text/plain": {"schema": {"type": "string"}}}}, **AUTH},
    "health": {200: {"model": S.Health, "description": "serving"},
               503: {"model": S.Health, "description": "shutting down"}},
}

def _ref(model: type) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def openapi_document(app, model_names: tuple[str, ...], api_key: bool, families) -> dict[str, Any]:
    """``app``'s document; ``families`` (``state.RouteFamily``) name the request bodies their routes
    parse, the models of their streams' events and their text-only 200s."""
    from fastapi.openapi.utils import get_openapi

    from graphkiln import __version__

    doc = get_openapi(title=app.title, version=__version__, routes=app.routes,
                      description="OpenAI-compatible completions over a graphkiln artifact")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    bodies = {path: model for f in families for path, model in f.bodies.items()}
    streamed = dict.fromkeys([m for f in families for m in f.streamed] + [S.ErrorBody])
    for model in streamed:
        if model.__name__ not in schemas:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
            for name, sub in schema.pop("$defs", {}).items():
                schemas.setdefault(name, sub)
            schemas[model.__name__] = schema
    for path, model in bodies.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        if "model" in schema["properties"]:
            optional = "model" not in schema.get("required", ())  # the tokenizer routes: model may be left out
            schema["properties"]["model"] = {"type": "string", "enum": list(model_names), "title": "Model"}
            if optional:
                schema["properties"]["model"] = {"anyOf": [schema["properties"]["model"], {"type": "null"}]}
        schemas[model.__name__] = schema
        doc["paths"][path]["post"]["requestBody"] = {"required": True,
                                                     "content": {"application/json": {"schema": _ref(model)}}}
    for path in (p for f in families for p in f.text_ok):
        doc["paths"][path]["post"]["responses"]["200"]["content"].pop("application/json", None)
    for path, ops in doc["paths"].items():
        for op in ops.values():
            if not api_key:
                op["responses"].pop("401", None)
            elif path != "/health":
                op["security"] = [{"bearer": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc
