"""vLLM's tokenizer routes, at the root as there: ``GET /tokenizer_info``, ``POST /tokenize`` and
``/detokenize``. lm-evaluation-harness's remote tokenizer (tokenizer_backend=remote) reads
/tokenizer_info, then posts to /tokenize and /detokenize. A long text is tokenized in a lane
worker, as a prompt would be."""

from __future__ import annotations

from fastapi import APIRouter, Request

from graphkiln.serve import routes as R
from graphkiln.serve import schemas as S
from graphkiln.serve.body import parse, read_body
from graphkiln.serve.errors import ApiError
from graphkiln.serve.state import RouteFamily, ServerState
from graphkiln.serve.submit import in_lane


def register(api: APIRouter, state: ServerState) -> None:
    @api.get("/tokenizer_info", responses=R.RESPONSES["tokenizer_info"])
    async def tokenizer_info():
        return _tokenizer_info(state).model_dump()

    @api.post("/tokenize", **R.tokenizer_route(S.TokenizeResponse))
    async def tokenize(request: Request):
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        return (await in_lane(state, len(body), _tokenize, state, body)).model_dump()

    @api.post("/detokenize", **R.tokenizer_route(S.DetokenizeResponse))
    async def detokenize(request: Request):
        state.check_open()
        body = await read_body(request, state.options.max_body_bytes)
        return (await in_lane(state, len(body), _detokenize, state, body)).model_dump()


FAMILY = RouteFamily(register, bodies={"/tokenize": S.TokenizeRequest, "/detokenize": S.DetokenizeRequest})


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
    req = parse(S.TokenizeRequest, body)
    if req.model is not None:
        state.resolve_model(req.model)  # every served model has the artifact's tokenizer
    _needs_tokenizer(state)
    ids = state.encode(req.prompt, special=req.add_special_tokens)
    return S.TokenizeResponse(count=len(ids), max_model_len=state.engine.max_seq_len, tokens=ids)


def _detokenize(state: ServerState, body: bytes) -> S.DetokenizeResponse:
    req = parse(S.DetokenizeRequest, body)
    if req.model is not None:
        state.resolve_model(req.model)  # every served model has the artifact's tokenizer
    _needs_tokenizer(state)
    vocab = state.engine.manifest.model.vocab_size
    bad = next((i for i, t in enumerate(req.tokens) if t >= vocab), None)
    if bad is not None:
        raise ApiError(400, f"token id {req.tokens[bad]} is outside the vocabulary [0, {vocab})",
                       param=f"tokens[{bad}]")
    return S.DetokenizeResponse(prompt=state.tokenizer.decode(req.tokens))
