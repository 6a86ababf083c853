"""``POST /v1/embeddings``: OpenAI's embeddings route over ``Scheduler.embed`` (``runtime.embed``).

``input`` is a string, a list of strings, a list of token ids or a list of such lists (at most
``MAX_INPUTS``, none empty); ``encoding_format`` "float" (JSON numbers) or "base64" (each vector's
little-endian float32 bytes, as OpenAI sends them and its Python client asks by default);
``dimensions`` keeps the first d values, renormalised when the artifact normalises (Matryoshka
truncation); ``usage.prompt_tokens`` counts every input's tokens (special tokens included).
Pooling and normalisation are the artifact's (``export --task embed --pooling/--normalize``).

The artifact must give hidden states: an embedding artifact (``export --task embed``) or one
exported with ``--return-hidden-states``; any other answers 400. The inputs are tokenized and
checked in a lane worker (``admission``), queued as one call (429 when the queue is full), and
run by the scheduler's stepping thread between generation steps; a client that leaves does not
cancel them (the call is short and its slots are released as it ends). Every bad input is one
400 naming the field (``input[2]``), nothing queued.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Literal

import numpy as np
from fastapi import APIRouter, Request
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from graphkiln.errors import GraphkilnError
from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import RETRY_AFTER_S, ApiError, shutting_down
from graphkiln.serve.metrics import PREFIX, TTFT_BUCKETS
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import in_lane

MAX_INPUTS = 2048  # OpenAI's bound on inputs per request

_REQUEST = ConfigDict(extra="forbid", strict=True)
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
Text = Annotated[StrictStr, Field(min_length=1)]


class EmbeddingRequest(BaseModel):
    """``POST /v1/embeddings``, as OpenAI takes it."""
    model_config = _REQUEST
    model: Annotated[StrictStr, Field(min_length=1, max_length=256)]
    input: (Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)] | TokenIds
            | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[StrictInt, Field(ge=1)] | None = None
    user: Annotated[StrictStr, Field(max_length=256)] | None = None  # OpenAI's end-user id: accepted, not used

    def inputs(self) -> list[str | list[int]]:
        """One entry per input (a string, or a list of token ids)."""
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]
        return list(x)


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    """The vectors, in input order."""
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def register(api: APIRouter, state: ServerState) -> None:
    requests = Counter(f"{PREFIX}_embedding_requests", "Embedding requests answered", registry=state.metrics.registry)
    tokens = Counter(f"{PREFIX}_embedding_tokens", "Tokens embedded (every input's, special tokens included)",
                     registry=state.metrics.registry)
    latency = Histogram(f"{PREFIX}_embedding_seconds", "From an embedding request's arrival to its vectors",
                        buckets=TTFT_BUCKETS, registry=state.metrics.registry)

    @api.post("/v1/embeddings", responses=_RESPONSES)
    async def embeddings(request: Request):
        arrived = time.perf_counter()
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        req, job = await in_lane(state, len(body), prepare, state, body)
        try:
            result = await job.aresult()
        except GraphkilnError as exc:
            if type(exc).__name__ == "ShuttingDown":
                raise shutting_down() from None
            raise ApiError(500, f"embedding failed: {exc}", "server_error", code="embedding_failed") from None
        requests.inc()
        tokens.inc(result.prompt_tokens)
        latency.observe(time.perf_counter() - arrived)
        data = [Embedding(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(result.vectors)]
        return EmbeddingList(data=data, model=req.model,
                             usage=EmbeddingUsage(prompt_tokens=result.prompt_tokens,
                                                  total_tokens=result.prompt_tokens)).model_dump()


FAMILY = RouteFamily(register, bodies={"/v1/embeddings": EmbeddingRequest})


def _encode(v: np.ndarray, fmt: str) -> list[float] | str:
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return v.astype(np.float32).tolist()


def prepare(state: ServerState, body: bytes):
    """In a lane worker: the parsed request and its queued ``EmbedJob``; every input checked first."""
    from graphkiln.runtime.request.scheduler import QueueFull, ShuttingDown

    req = parse(EmbeddingRequest, body)
    if state.resolve_model(req.model) is not None:
        raise ApiError(400, f"model '{req.model}' is a LoRA adapter: embeddings come from the base model; use "
                            f"'{state.options.model_name}'", param="model")
    hidden = state.engine.manifest.model.hidden_size
    if req.dimensions is not None and req.dimensions > hidden:
        raise ApiError(400, f"dimensions is {req.dimensions}, more than the model's {hidden}: ask for at most {hidden}",
                       param="dimensions")
    inputs = req.inputs()
    many = not (isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)))
    vocab = state.engine.manifest.model.vocab_size
    prompts = []
    for k, x in enumerate(inputs):
        param = f"input[{k}]" if many else "input"
        if isinstance(x, str):
            if state.tokenizer is None:
                raise ApiError(400, "this artifact has no tokenizer.json: send token ids instead of text", param=param,
                               code="no_tokenizer")
            state.check_chars(len(x), param)
            x = state.encode(x, special=True)  # as Engine tokenizes: the post-processor's special tokens
            if not x:
                raise ApiError(400, f"{param} tokenizes to no tokens: send some text", param=param)
        bad = next((i for i, t in enumerate(x) if t >= vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {x[bad]} is outside the vocabulary [0, {vocab})", param=f"{param}[{bad}]")
        state.check_tokens(len(x), param)
        prompts.append(x)
    state.check_open()
    try:
        job = state.scheduler.embed(prompts, dimensions=req.dimensions)
    except QueueFull as exc:
        raise ApiError(429, f"{exc}", "rate_limit_error", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except ShuttingDown:
        raise shutting_down() from None
    except GraphkilnError as exc:  # an artifact without hidden states
        raise ApiError(400, str(exc), param="model", code="model_not_embedding") from None
    return req, job


_ERROR = {"model": S.ErrorBody}
_RESPONSES = {
    200: {"model": EmbeddingList, "description": "one vector per input, in input order"},
    400: {**_ERROR, "description": "malformed JSON, unknown field, ill-typed or out-of-range value, an empty "
                                   "input, too many inputs, an input too long, a token id outside the vocabulary, "
                                   "dimensions over the model's, or an artifact that gives no hidden states"},
    **R.AUTH,
    404: {**_ERROR, "description": "model not served here"},
    413: {**_ERROR, "description": "body over the server's size limit"},
    429: {**_ERROR, "headers": {"Retry-After": {"description": "seconds to wait before retrying",
                                                "schema": {"type": "string"}}},
          "description": "queue full, or too many large bodies being prepared"},
    500: {**_ERROR, "description": "the embedding pass failed (this request only)"},
    503: {**_ERROR, "description": "shutting down"},
}
