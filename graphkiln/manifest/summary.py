"""A manifest's validation failure as one ``GraphkilnError`` line: pydantic's report (the first
problem, the exact field, how many more) and the values it quotes, short and on one line."""

from __future__ import annotations

import re

from pydantic import ValidationError

from graphkiln.manifest.fields import FieldError
from graphkiln.untrusted import show_json

_SHOULD = re.compile(r"^(Input|String|Tuple|Dictionary|List|Object) should")


def one_line(text: str) -> str:
    return " ".join(text.split())


def _field_path(loc: tuple) -> str:
    out = ""
    for i, part in enumerate(loc):
        if part == "[key]":
            out += " key"
        elif isinstance(part, int):
            out += f"[{part}]"
        elif i == 1 and loc[0] in ("files", "tool_versions"):
            out += f"[{show_json(part)}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "the manifest"


def summarise(exc: ValidationError, where: str) -> str:
    """pydantic's multi-line report as one line: the first problem, and how many more there are."""
    errors = exc.errors(include_url=False)
    # pydantic also reports a tuple whose bad items were dropped as too short: not a problem of its own
    locs = [tuple(e["loc"]) for e in errors]
    errors = [e for e, loc in zip(errors, locs) if not (
        e["type"] == "too_short" and any(len(other) > len(loc) and other[: len(loc)] == loc for other in locs))]
    e = errors[0]
    if e["type"] == "json_invalid":  # the whole text, not a field
        return f"{where} is not valid JSON ({one_line(e['msg'])}): re-export the artifact"
    loc, problem = tuple(e["loc"]), e["msg"]
    cause = (e.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc, problem = loc + cause.loc, cause.problem
    elif e["type"] == "unexpected_keyword_argument":
        problem = "is not a manifest field"
    elif e["type"] in ("missing_argument", "missing"):
        problem = "is missing"
    else:
        problem = _SHOULD.sub("must", problem.removeprefix("Value error, "))
        problem = f"{problem[:1].lower()}{problem[1:]} (got {show_json(e.get('input'))})"
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{where}: {_field_path(loc)} {one_line(problem)}{more}: re-export the artifact"
