"""``graphkiln serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the scheduler.

    app.py      ``create_app(scheduler, engine, AppOptions)``: the route families, /health, error handlers
    info.py, admin.py, completions.py, chat.py, tokenize.py   one module per route family
    state.py    AppOptions, ServerState, RouteFamily (how a family plugs into the app)
    errors.py   ApiError (OpenAI's error body)     body.py  body size limit, strict parsing, 400s
    request_config.py  a request's parameters as the engine's GenerationConfig (one mapping for all)
    submit.py   lanes and scheduler submission     respond.py  whole responses, server-sent events
    schemas.py  request/response models in OpenAI's shapes (strict: requests are untrusted)
    admission.py  what a request may cost before its prompt is tokenized: unseen refusal, lanes
    routes.py   the OpenAPI document (GET /openapi.json): request bodies, responses, security
    (the chat template it renders is graphkiln.runtime.request.chat_template, shared with graphkiln chat)
    metrics.py  Prometheus metrics, one registry per app
    server.py   socket, uvicorn, graceful drain; ``serve(ServeConfig)`` is the CLI's entry

Needs the ``serve`` dependencies (fastapi, uvicorn, prometheus_client, jinja2), imported only here.
"""
