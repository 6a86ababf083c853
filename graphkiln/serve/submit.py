"""From a parsed request to the scheduler: the worker lane a body is prepared in (``in_lane``),
the handles of one request's choices (``Group``) and ``submit`` with its refusals as ApiErrors.

Nothing here runs a request's preparation on the event loop: parsing, the chat template,
tokenizing (the GIL released) and submitting (a constraint's grammar is compiled there) run in a
worker of the body's lane (``graphkiln.serve.admission``: big bodies never delay small ones, and
a full big lane is a 429 with ``Retry-After``).
"""

from __future__ import annotations

import asyncio

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.requests import GenerationConfig
from graphkiln.serve import schemas as S
from graphkiln.serve.admission import LaneFull
from graphkiln.serve.errors import RETRY_AFTER_S, ApiError, shutting_down, unknown_model
from graphkiln.serve.request_config import refused_constraint
from graphkiln.serve.state import ServerState


async def in_lane(state: ServerState, size: int, prepare, *args):
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


class Group:
    """The scheduler handles of one HTTP request's choices (one per prompt), cancelled together."""

    def __init__(self, handles: list) -> None:
        self.handles = handles

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()


def submit(state: ServerState, prompt, config: GenerationConfig, param: str,
           constraint: S.OutputConstraint | None = None, group: object = None):
    """``Scheduler.submit`` (in a lane worker: a constraint's grammar is compiled there; ``group``
    the submission's key, as there) with its refusals as ApiErrors; the engine's refusal of
    ``constraint`` (its line starts with the config's field name) names the request's field."""
    from graphkiln.runtime.request.scheduler import QueueFull, ShuttingDown

    state.check_open()
    try:
        return state.scheduler.submit(prompt, config, group=group)
    except QueueFull as exc:
        raise ApiError(429, f"{exc}", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ShuttingDown:
        raise shutting_down() from None
    except GraphkilnError as exc:  # ids outside the vocabulary, no tokenizer for a text prompt, ...
        adapter = config.adapter
        if adapter is not None and adapter not in state.adapter_names():  # unloaded since the model was checked
            raise unknown_model(adapter, state.options.model_name, True) from None
        if constraint is not None and str(exc).startswith(constraint.field):
            raise refused_constraint(exc, constraint) from None
        raise ApiError(400, str(exc), param=param) from None
