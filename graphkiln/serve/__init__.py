"""``graphkiln serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the scheduler.

    app.py      routes, error bodies, streaming; ``create_app(scheduler, engine, AppOptions)``
    schemas.py  request/response models in OpenAI's shapes (strict: requests are untrusted)
    admission.py  what a request may cost before its prompt is tokenized: unseen refusal, lanes
    routes.py   the OpenAPI document (GET /openapi.json): request bodies, responses, security
    (the chat template it renders is graphkiln.runtime.request.chat_template, shared with graphkiln chat)
    metrics.py  Prometheus metrics, one registry per app
    server.py   socket, uvicorn, graceful drain; ``serve(ServeConfig)`` is the CLI's entry

Needs the ``serve`` dependencies (fastapi, uvicorn, prometheus_client, jinja2), imported only here.
"""
