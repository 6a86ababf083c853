"""What the server serves and how it runs: ``GET /v1/models`` (the base model, then each loaded
LoRA adapter) and ``GET /metrics`` (Prometheus text). ``/health`` is the app's own (no API key)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.state import RouteFamily, ServerState


def register(api: APIRouter, state: ServerState) -> None:
    @api.get("/metrics", responses=R.RESPONSES["metrics"], response_class=PlainTextResponse)
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @api.get("/v1/models", responses=R.RESPONSES["models"])
    async def models():
        return S.ModelList(data=state.model_cards()).model_dump()


FAMILY = RouteFamily(register)
