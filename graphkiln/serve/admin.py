"""vLLM's LoRA adapter routes (``vllm serve --enable-lora``, VLLM_ALLOW_RUNTIME_LORA_UPDATING):
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

An artifact exported with ``--lora-rank`` serves its base model and the loaded adapters; a
request's ``model`` names one (``ServerState.resolve_model``). The body is parsed on the loop (at
most ``ADAPTER_BODY_BYTES``), the adapter is read in a worker thread; loads and unloads run one
at a time and never evict a served adapter (all slots taken: 409); unloading one that queued or
running requests use is a 409 too. Open only with ``serve --allow-lora-updates`` (else 403).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from graphkiln.errors import GraphkilnError
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import ApiError, clip
from graphkiln.serve.state import RouteFamily, ServerState

ADAPTER_BODY_BYTES = 64 << 10  # a load/unload body is a name and a path


def register(api: APIRouter, state: ServerState) -> None:
    @api.post("/v1/load_lora_adapter", **R.adapter_route("load"))
    async def load_lora_adapter(request: Request):
        state.check_open()
        req = parse(S.LoadLoraAdapterRequest, await read_body(request, ADAPTER_BODY_BYTES))
        await asyncio.to_thread(load_adapter, state, req.lora_name, req.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    @api.post("/v1/unload_lora_adapter", **R.adapter_route("unload"))
    async def unload_lora_adapter(request: Request):
        state.check_open()
        req = parse(S.UnloadLoraAdapterRequest, await read_body(request, ADAPTER_BODY_BYTES))
        await asyncio.to_thread(unload_adapter, state, req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
FAMILY = RouteFamily(register, bodies=dict(zip(_PATHS, (S.LoadLoraAdapterRequest, S.UnloadLoraAdapterRequest))),
                     text_ok=_PATHS)


def needs_lora(state: ServerState) -> None:
    if state.lora is None:
        raise ApiError(400, "this artifact was exported without LoRA support, so it serves no adapters: re-export "
                            "it with --lora-rank R (and --max-loras N) to load them", code="lora_not_supported")
    if not state.options.lora_updates:
        raise ApiError(403, "loading and unloading LoRA adapters while serving is off on this server: start it "
                            "with --allow-lora-updates (or serve adapters with --lora NAME=DIR)",
                       "permission_error", code="lora_updates_disabled")


def load_adapter(state: ServerState, name: str, path: str) -> None:
    """In a worker thread: ``Engine.load_adapter`` with its refusals as ApiErrors: a name the
    CLI would refuse is a 400 about ``lora_name``, a refused adapter one about ``lora_path``
    (reading it never blocks: ``runtime.lora.adapter_dir``). Never evicts a served adapter:
    with every slot holding one, a 409 (unload one first)."""
    from graphkiln.runtime.lora import check_adapter_name

    needs_lora(state)
    try:  # the CLI's rule (serve --lora NAME=DIR); checked first, so it is reported as lora_name's
        check_adapter_name(name)
    except GraphkilnError as exc:
        raise ApiError(400, str(exc), param="lora_name", code="invalid_lora_name") from None
    if name == state.options.model_name:
        raise ApiError(400, f"lora_name '{clip(name, 80)}' is the base model's name: choose another",
                       param="lora_name", code="invalid_lora_name")
    with state.adapters_lock:
        loaded = state.adapter_names()
        if name in loaded:
            raise ApiError(400, f"a LoRA adapter named '{clip(name, 80)}' is already loaded: unload it first "
                                "(POST /v1/unload_lora_adapter) or choose another name", param="lora_name",
                           code="lora_adapter_exists")
        if len(loaded) >= state.lora.max_loras:
            raise ApiError(409, f"all {state.lora.max_loras} LoRA slots hold adapters "
                                f"({', '.join(map(repr, loaded))}): unload one first (POST "
                                "/v1/unload_lora_adapter), or re-export with a larger --max-loras",
                           "invalid_request_error", code="lora_slots_full")
        try:
            state.engine.load_adapter(name, path)
        except GraphkilnError as exc:
            raise ApiError(400, str(exc), param="lora_path", code="invalid_lora_adapter") from None
        now = state.adapter_names()
        state.adapter_info = {k: v for k, v in state.adapter_info.items() if k in now}
        state.adapter_info[name] = (path, int(time.time()))


def unload_adapter(state: ServerState, name: str) -> None:
    """In a worker thread: ``Engine.unload_adapter``; unknown name 404, in use by queued or
    running requests 409 (they hold it from submission: unloading it would fail them)."""
    needs_lora(state)
    with state.adapters_lock:
        if name not in state.adapter_names():
            raise _unknown_adapter(name, state.adapter_names())
        try:
            state.engine.unload_adapter(name)
        except GraphkilnError as exc:
            if name not in state.adapter_names():  # unloaded meanwhile, not through the routes
                raise _unknown_adapter(name, state.adapter_names()) from None
            raise ApiError(409, str(exc), param="lora_name", code="lora_adapter_in_use") from None
        state.adapter_info.pop(name, None)


def _unknown_adapter(name: str, loaded: list[str]) -> ApiError:
    return ApiError(404, f"no LoRA adapter named '{clip(name, 80)}' is loaded (loaded: "
                         f"{', '.join(map(repr, loaded)) or 'none'}; GET /v1/models)", param="lora_name",
                    code="lora_adapter_not_found")


