"""Reading what a user, a checkpoint, an artifact or a request names: every file read from a
user-named path and every JSON text parsed from one goes through here, so the rules hold everywhere.

- A file is opened without blocking (``O_NONBLOCK``) and checked to be a regular file before a byte
  is read: a FIFO, a device, a socket or a directory in a file's place is one error line, never a
  read that blocks forever or streams without end (``/dev/zero``).
- ``within``: the file's real path (symlinks resolved) must lie inside that directory, so a link in a
  checkpoint cannot make export copy a file from elsewhere.
- A read is bounded (``limit`` bytes) before it is made, not after.
- JSON parsing maps what the standard library raises on hostile text (``RecursionError`` for deep
  nesting, ``ValueError`` for a 5,000-digit integer, bad UTF-8) to one ``GraphkilnError`` line.
- ``show`` quotes an untrusted value for a message: control characters escaped, length clipped;
  ``show_json`` quotes it as the JSON document that held it wrote it.

Everything raises ``GraphkilnError`` (one line: the problem, then the fix after a colon).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from typing import Any, BinaryIO

from graphkiln.errors import GraphkilnError

MAX_JSON_DEPTH = 200  # deeper than any real config, tokenizer or schema; far below the recursion limit


def show(value: object, limit: int = 80) -> str:
    """``value`` for a one-line message: a string quoted with control characters and non-ASCII
    escaped (no newline or terminal escape reaches a terminal), anything else as its repr; clipped
    to about ``limit`` characters."""
    if isinstance(value, str):
        return ascii(value if len(value) <= limit else value[:limit] + "...")
    text = repr(value)
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("unicode_escape").decode("ascii")


def show_json(value: object, limit: int = 60) -> str:
    """``value`` as it appeared in a JSON document (a manifest, a preprocessor config), for a
    one-line message: its JSON text with non-ASCII escaped, or its ``ascii()`` when JSON cannot
    write it, so no control character or terminal escape gets through; clipped to ``limit``
    characters, "..." included."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):  # not JSON's, or nested past the recursion limit
        text = ascii(value) if not isinstance(value, (list, dict)) else type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether ``path``'s real path (every symlink resolved) is ``root``'s real path or below it."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    return real == real_root or os.path.commonpath([real_root, real]) == real_root


def open_regular(path: str | os.PathLike, what: str, fix: str, within: str | os.PathLike | None = None) -> BinaryIO:
    """Open ``path`` for binary reading, refusing in one line (``"{what} ...: {fix}"``) a missing or
    unreadable file, an over-long name, a link out of ``within``, and anything but a regular file.
    ``what`` names the file for the user (e.g. "the adapter's adapter_config.json")."""
    shown_path = show(os.fspath(path), 120)
    if within is not None and not inside(path, within):
        raise GraphkilnError(f"{what} {shown_path} is a link to {show(os.path.realpath(path), 120)}, outside "
                             f"{show(os.fspath(within), 120)}: {fix}")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise GraphkilnError(f"{what} {shown_path} does not exist: {fix}") from None
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise GraphkilnError(f"{what} path is too long ({len(os.fspath(path))} characters): {fix}") from None
        if exc.errno == errno.EISDIR:
            raise GraphkilnError(f"{what} {shown_path} is a directory, not a file: {fix}") from None
        raise GraphkilnError(f"cannot read {what} {shown_path} ({exc.strerror or type(exc).__name__}): {fix}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise GraphkilnError(f"{what} {shown_path} is {_kind(mode)}, not a regular file: {fix}")
    os.set_blocking(fd, True)  # a regular file never blocks; plain reads from here on
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike, what: str, fix: str, limit: int,
                 within: str | os.PathLike | None = None) -> bytes:
    """The bytes of the regular file ``path`` (see ``open_regular``), refused when larger than
    ``limit`` bytes before it is read."""
    with open_regular(path, what, fix, within) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise GraphkilnError(f"{what} {show(os.fspath(path), 120)} is {size:,} bytes, more than the "
                                 f"{limit:,} allowed: {fix}")
        data = f.read(limit + 1)
    if len(data) > limit:  # it grew while being read
        raise GraphkilnError(f"{what} {show(os.fspath(path), 120)} is more than {limit:,} bytes: {fix}")
    return data


def _depth(text: str | bytes) -> int:
    """The deepest bracket nesting of a JSON text, ignoring brackets inside strings: a linear scan
    that decides before ``json.loads`` recurses."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(text: str | bytes, what: str, fix: str, max_depth: int = MAX_JSON_DEPTH, **kwargs) -> Any:
    """``json.loads(text, **kwargs)``, with every way hostile text fails as one line: not JSON, not
    UTF-8, nested deeper than ``max_depth`` (decided before parsing, so no ``RecursionError``), an
    integer too long to convert."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise GraphkilnError(f"{what} is not UTF-8 text (byte {exc.start}): {fix}") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    if ("[" in text or "{" in text) and _depth(text) > max_depth:
        raise GraphkilnError(f"{what} nests deeper than {max_depth} levels: {fix}")
    try:
        return json.loads(text, **kwargs)
    except json.JSONDecodeError as exc:
        raise GraphkilnError(f"{what} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
                             f"{fix}") from None
    except RecursionError:
        raise GraphkilnError(f"{what} nests too deeply: {fix}") from None
    except ValueError as exc:  # int too long for int(), or a hook's own refusal
        raise GraphkilnError(f"{what} holds a value that cannot be read ({show(str(exc), 100)}): {fix}") from None


def read_json(path: str | os.PathLike, what: str, fix: str, limit: int = 64 << 20,
              within: str | os.PathLike | None = None, **kwargs) -> Any:
    """``parse_json`` of the regular file ``path`` (``read_regular``'s rules, at most ``limit`` bytes)."""
    return parse_json(read_regular(path, what, fix, limit, within), what, fix, **kwargs)
