"""A PEFT adapter directory named by a user (``run --lora``, ``serve --lora``, the load route)
and the files in it, opened under ``graphkiln.untrusted``'s rules: a stat or open never blocks
(a FIFO in a file's place is refused, not waited on), only regular files are read, reads are
bounded, and every refusal is one ``GraphkilnError`` line that names the adapter, quoted with
``show`` (a path may hold newlines or terminal escapes)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import open_regular, show

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# what every refused file is told to be instead
FILES_FIX = (f"pass the directory PEFT's save_pretrained wrote ({CONFIG} and {WEIGHTS}, both regular files)")
_SHOWN_PATH = 200  # characters of a path echoed in a message


def refuse(path, problem: str) -> GraphkilnError:
    """The error for adapter directory ``path``: "LoRA adapter '<path>': <problem>; <fix>"."""
    return GraphkilnError(f"LoRA adapter {show(os.fspath(path), _SHOWN_PATH)}: {problem}")


def adapter_directory(path) -> Path:
    """``path`` as a Path if it is a directory; else one line saying what it is (missing, a file,
    a FIFO, a name longer than the file system takes...). Only ``stat``: nothing is opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        if exc.errno == errno.ENAMETOOLONG:
            raise GraphkilnError(f"LoRA adapter path {show(os.fspath(path), 60)} is too long "
                                 f"({len(os.fspath(path))} characters, or a name in it over the file system's "
                                 f"limit): pass a shorter path to the adapter directory") from None
        reason = ("it does not exist" if exc.errno in (errno.ENOENT, errno.ENOTDIR)
                  else exc.strerror or type(exc).__name__)
        raise refuse(path, f"not a directory ({reason}); pass a PEFT LoRA adapter directory ({CONFIG} + "
                           f"{WEIGHTS})") from None
    if not stat.S_ISDIR(mode):
        raise refuse(path, f"not a directory; pass a PEFT LoRA adapter directory ({CONFIG} + {WEIGHTS})")
    return Path(path)


def file_exists(directory: Path, name: str) -> bool:
    """Whether anything (a dangling link included) is at ``directory/name``; no error."""
    try:
        os.lstat(directory / name)
    except OSError:
        return False
    return True


def open_file(directory: Path, name: str) -> BinaryIO:
    """``directory/name`` opened for reading: a regular file (links followed) or one line."""
    return open_regular(directory / name, "LoRA adapter file", FILES_FIX)


def read_bounded(f: BinaryIO, directory: Path, name: str, offset: int, nbytes: int) -> bytes:
    """``nbytes`` bytes of the open file ``f`` from ``offset``: exactly that many, or one line
    (the file shrank since its size was read)."""
    try:
        f.seek(offset)
        data = f.read(nbytes)
    except OSError as exc:
        raise refuse(directory, f"cannot read {name} ({exc.strerror or type(exc).__name__}); check the file and "
                                f"its permissions") from None
    if len(data) != nbytes:
        raise refuse(directory, f"{name} is truncated; re-save the adapter")
    return data
