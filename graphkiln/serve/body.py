"""Reading and parsing a request body: the size limit (413), strict parsing into a schema, and
pydantic's validation errors as one 400 whose ``param`` names the field as OpenAI writes it
(``messages[0].content``, ``stop``), never pydantic's internal location (which adds union
members' type names such as ``str``)."""

from __future__ import annotations

import typing

from fastapi import Request
from pydantic import BaseModel, ValidationError

from graphkiln.serve.errors import ApiError, clip


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"request body is {declared} bytes, over the {limit}-byte limit: send a shorter prompt",
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is over the {limit}-byte limit: send a shorter prompt",
                           code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def parse(model: type[BaseModel], body: bytes):
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error(exc, model) from None


def validation_error(exc: ValidationError, model: type[BaseModel]) -> ApiError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"request body is not valid JSON ({clip(first.get('ctx', {}).get('error', ''))}): "
                             "send one JSON object", code="invalid_json")
    if first["type"] == "model_type" and not first["loc"]:
        return ApiError(400, "request body must be a JSON object", code="invalid_json")
    param = _param(model, first["loc"], first["type"] == "extra_forbidden")
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"unknown field '{param}': graphkiln serve does not support it; leave it out",
                        param=param, code="unknown_field")
    if first["type"] == "missing":
        return ApiError(400, f"'{param}' is required", param=param, code="missing_field")
    # a field failing every member of a union gives one error per member: name them together
    inside = [e for e in errors if _within(_param(model, e["loc"], e["type"] == "extra_forbidden"), param)]
    msgs = list(dict.fromkeys(clip(e["msg"]) for e in inside))[:3]
    return ApiError(400, f"invalid '{param}': {'; or '.join(msgs)}", param=param, code="invalid_value")


def _param(model: type[BaseModel], loc: tuple, unknown: bool) -> str | None:
    """The field an error's location names, as OpenAI writes it (``messages[0].content``).
    pydantic's location also holds the tags of union members (``str``, ``list[int]``, a model's
    name) and dict keys: only the field names of the models along the path and list indices are
    kept, and, for an unknown field (``unknown``), its own name at the end."""
    out, models = "", [model]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        owner = next((m for m in models if _field(m, part) is not None), None)
        if owner is None and not (unknown and i == len(loc) - 1):
            continue
        out += f".{part}" if out else part
        models = _models_in(_field(owner, part).annotation) if owner is not None else []
    return out or None


def _field(model: type[BaseModel], name: str):
    """``model``'s field that JSON names ``name`` (its alias, else its own name), or None."""
    for key, info in model.model_fields.items():
        if (info.alias or key) == name:
            return info
    return None


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _within(param: str | None, field: str | None) -> bool:
    return param == field or (param is not None and field is not None and param.startswith((field + ".", field + "[")))
