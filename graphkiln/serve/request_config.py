"""A request's OpenAI parameters as the engine's ``GenerationConfig``: the one mapping every
generation route uses (``config``), with the output constraint (``constraint``: structured
output) and speculative decoding (``speculation``) it carries.

Structured output: OpenAI's ``response_format`` (text, json_object, json_schema) and vLLM's
``guided_json``/``guided_regex``/``guided_grammar``/``structured_outputs`` become the config's
``json_schema``/``regex``/``grammar`` (at most one: two are a 400 ``conflicting_constraints``);
the engine compiles the grammar when the request is submitted, in the lane worker, and a schema,
regex or grammar it refuses is a 400 ``invalid_response_format`` whose ``param`` is the request's
field (``response_format.json_schema.schema``, ``guided_regex``, ...) and whose message is the
engine's line with that field in front (``refused_constraint``).

Speculative decoding: a request's ``speculative`` (graphkiln's extension: "ngram[:K]",
"draft[:K]", "off"), else the server's ``--speculative`` (``AppOptions.speculative``), becomes
the config's ``speculative``; a value the engine refuses, or "draft" on a server without
``--draft``, is a 400 whose ``param`` is "speculative", before anything is queued.
"""

from __future__ import annotations

import secrets

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.requests import GenerationConfig
from graphkiln.serve import schemas as S
from graphkiln.serve.errors import ApiError, clip
from graphkiln.serve.state import ServerState


def constraint(req: S._Sampling, state: ServerState, tools: S.OutputConstraint | None = None
               ) -> S.OutputConstraint | None:
    """The request's one output constraint (structured output, or ``tools``: the chat route's
    tool-call grammar), or None; two are a 400 naming both, and any on an artifact without
    tokenizer.json a 400 ``no_tokenizer``."""
    found = req.constraints() + ([tools] if tools is not None else [])
    if len(found) > 1:
        names = [c.param.split(".")[0] for c in found]
        also = " (or tool_choice: none)" if tools is not None else ""
        raise ApiError(400, f"{' and '.join(names)} both constrain the output: send only one of response_format, "
                            f"guided_json, guided_regex, guided_grammar, structured_outputs, tools{also}",
                       param=names[1], code="conflicting_constraints")
    if found and state.tokenizer is None:
        raise ApiError(400, f"{found[0].param}: structured output needs the artifact's tokenizer.json, and this "
                            "artifact has none", param=found[0].param, code="no_tokenizer")
    return found[0] if found else None


def speculation(req: S._Sampling, state: ServerState) -> str | None:
    """The request's speculative decoding (None: off): its own ``speculative`` (the schema has
    checked it), else the server's default; draft drafts on a server without a draft model are a
    400 here, as the engine would refuse them only once submitted."""
    value = req.speculative if req.speculative is not None else state.options.speculative
    if value is not None and value.startswith("draft") and state.engine.draft is None:
        raise ApiError(400, f"speculative '{value}' needs a draft model and this server has none: start it with "
                            "--draft DIR, or send 'ngram[:K]' or 'off'", param="speculative", code="no_draft_model")
    return None if value == "off" else value


def config(req: S._Sampling, max_tokens: int | None, logprobs: int | None, adapter: str | None = None,
           constraint: S.OutputConstraint | None = None, speculative: str | None = None) -> GenerationConfig:
    """OpenAI's parameters as a GenerationConfig. Temperature 0 is greedy; any sampling field asks
    for sampling; none leaves the artifact's defaults. Without a seed each request gets a random
    one (OpenAI's behaviour: unseeded requests differ). ``adapter``: the LoRA adapter the request's
    ``model`` named (None: the base model). ``constraint`` (``constraint()``: response_format,
    vLLM's guided_* or structured_outputs) sets the config's json_schema, regex or grammar;
    ``speculative`` (``speculation()``) the config's speculative decoding."""
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
            raise refused_constraint(exc, constraint) from None
        raise ApiError(400, str(exc)) from None


def refused_constraint(exc: GraphkilnError, constraint: S.OutputConstraint) -> ApiError:
    """The engine's one line for a schema, regex or grammar it cannot compile (or an artifact
    without tokenizer.json), as a 400 naming the request's field."""
    message, field = str(exc), constraint.field
    if message.startswith(field + ":"):  # the engine's config field, as the request named it
        message = constraint.param + message[len(field):]
    if constraint.param == "tools":  # the grammar is the server's, built from the tools' schemas
        message = message.replace("pass a valid Lark grammar", "fix the tools' parameters schemas")
        message = message.replace("simplify the Lark grammar", "simplify the tools' parameters schemas")
    return ApiError(400, clip(message, 400), param=constraint.param, code="invalid_response_format")
