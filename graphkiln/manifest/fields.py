"""The manifest's field types and validators (pydantic, strict), and the error a validator
raises about a field below the object it checks (``FieldError``, made one line by ``manifest.summary``)."""

from __future__ import annotations

import re
import unicodedata
from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, PlainValidator

from graphkiln.manifest.vocabulary import DIM_NAMES, INPUT_ROLES, OUTPUT_ROLES

STRICT = ConfigDict(extra="forbid", strict=True)
_DRIVE = re.compile(r"[A-Za-z]:")
_SHA256 = re.compile(r"[0-9a-f]{64}")



class FieldError(ValueError):
    """Raised by a validator about a field below the object it validates: ``loc`` is relative
    to that object, so the one-line error names the exact field (pydantic reports the object)."""

    def __init__(self, loc: tuple[str | int, ...], problem: str) -> None:
        super().__init__(problem)
        self.loc, self.problem = loc, problem


def _has_control(text: str) -> bool:
    # control, format (bidi overrides, zero-width) and surrogate characters: escapes and spoofing on a terminal
    return any(unicodedata.category(c) in ("Cc", "Cf", "Cs") for c in text)


def plain_relative_path(path: str) -> str:
    """Return ``path`` if it is a plain relative POSIX name of a file inside a directory (no
    ``..``/``.``/empty component, not absolute, no drive letter, backslash or control
    character); else raise ValueError saying why. Lexical only: see ``artifact_file``."""
    if not path:
        raise ValueError("is empty, not a file name")
    if _has_control(path):
        raise ValueError("contains a control character")
    if "\\" in path:
        raise ValueError("contains a backslash (artifact paths use '/')")
    if path.startswith("/") or _DRIVE.match(path):
        raise ValueError("is an absolute path (artifact paths are relative to the artifact)")
    parts = path.split("/")
    for bad in ("..", ".", ""):
        if bad in parts:
            raise ValueError(f"has a{'n empty' if not bad else ' ' + repr(bad)} component (artifact paths are plain names)")
    return path


def _dim(value: object) -> int | str:
    # strict by hand: a PlainValidator sees the raw JSON value (bool is not an int here)
    if (type(value) is int and value >= 0) or (type(value) is str and value in DIM_NAMES):
        return value
    raise ValueError(f"must be an int >= 0 or one of {', '.join(DIM_NAMES)}")


def _printable(text: str) -> str:
    if _has_control(text):
        raise ValueError("contains a control character")  # inspect prints it: no terminal escapes
    return text


def _sha256(text: str) -> str:
    if not _SHA256.fullmatch(text):
        raise ValueError("must be a sha256 digest: 64 lowercase hex digits")
    return text


def module_path(text: str) -> str:
    if text.count("{layer}") != 1 or not re.fullmatch(r"[A-Za-z0-9_.]+", text.replace("{layer}", "0")):
        raise ValueError("must be a dotted module path holding {layer} once (e.g. model.layers.{layer}.self_attn.q_proj)")
    return text


PosInt = Annotated[int, Field(gt=0)]
Count = Annotated[int, Field(ge=0)]
Text = Annotated[str, AfterValidator(_printable)]
Name = Annotated[str, Field(min_length=1), AfterValidator(_printable)]
RelPath = Annotated[str, AfterValidator(plain_relative_path)]
Sha256 = Annotated[str, AfterValidator(_sha256)]
Dim = Annotated[int | str, PlainValidator(_dim)]
TensorDtype = Literal["float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool"]
StateDtype = Literal["float32", "float16", "bfloat16"]
Role = Literal[INPUT_ROLES + OUTPUT_ROLES]  # type: ignore[valid-type]
