"""The files of a checkpoint directory: every file export reads from a checkpoint (config.json,
generation_config.json, the tokenizer files and chat template, preprocessor_config.json, the
safetensors shards) is opened or parsed through here, so one rule holds for all of them.

- Only regular files inside the checkpoint are read (``graphkiln.untrusted``, ``within`` the
  checkpoint's root): a link to a file elsewhere (``chat_template.jinja`` -> ``~/.ssh/id_rsa``) is
  refused, so export never copies into an artifact, nor parses, a file from outside the
  checkpoint; a FIFO, device, socket or directory in a file's place is one error line, never a
  read that blocks and never silently skipped.
- The root is the checkpoint directory itself (its real path), except for a Hugging Face hub
  cache snapshot (``models--org--name/snapshots/<revision>``, the directory ``snapshot_download``
  returns), whose files are links into the repository's ``blobs`` folder: there the root is the
  repository's cache folder, which holds both. A link to a hub cache blob
  (``models--org--name/blobs/<hash>``) is a downloaded file too, as older ``--local-dir``
  downloads link their large files: it is read.
- A file is absent only when there is no directory entry by its name at all; a dangling link is
  refused like any unreadable file.
- JSON is parsed by ``untrusted.parse_json`` (deep nesting, 5,000-digit integers and bad UTF-8
  are one line, never a traceback).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from graphkiln import untrusted
from graphkiln.errors import GraphkilnError

MAX_JSON_BYTES = 64 << 20  # a checkpoint's JSON files are KB (tokenizer.json tens of MB at most)


def checkpoint_root(src: Path) -> Path:
    """The directory every file read from checkpoint ``src`` must lie in, symlinks resolved (see
    the module docstring)."""
    real = Path(os.path.realpath(src))
    if real.parent.name == "snapshots" and (real.parent.parent / "blobs").is_dir():
        return real.parent.parent
    return real


def _within(path: Path, src: Path) -> Path:
    """The root ``path`` (a file of checkpoint ``src``) must lie in: the checkpoint's, or the hub
    cache repository whose blob it links to."""
    root = checkpoint_root(src)
    real = Path(os.path.realpath(path))
    if (not untrusted.inside(real, root) and real.parent.name == "blobs"
            and real.parent.parent.name.startswith("models--")):
        return real.parent.parent
    return root


def present(src: Path, name: str) -> bool:
    """Whether the checkpoint has an entry ``name`` (of any kind: a FIFO or a dangling link counts,
    so that it is refused when read rather than passed over as absent)."""
    return os.path.lexists(src / name)


def _what(path: Path) -> str:
    return f"the checkpoint's {path.name}"


def open_file(path: Path, src: Path, fix: str) -> BinaryIO:
    """``path`` (a file of checkpoint ``src``) opened for reading, when it is a regular file inside
    the checkpoint; anything else is one error line ending in ``fix``."""
    return untrusted.open_regular(path, _what(path), fix, within=_within(path, src))


def check_file(path: Path, src: Path, fix: str) -> None:
    """Refuse ``path`` unless it is a regular file inside checkpoint ``src`` (for files another
    library opens by name: safetensors, tokenizers, transformers)."""
    open_file(path, src, fix).close()


def read_bytes(src: Path, name: str, fix: str, limit: int) -> bytes | None:
    """The bytes of the checkpoint's file ``name`` (None when absent), at most ``limit`` bytes."""
    if not present(src, name):
        return None
    path = src / name
    return untrusted.read_regular(path, _what(path), fix, limit, within=_within(path, src))


def parse_json(data: bytes, name: str, src: Path, fix: str) -> Any:
    """``data`` (the checkpoint's file ``name``) parsed as untrusted JSON."""
    return untrusted.parse_json(data, f"{name} in {untrusted.show(os.fspath(src), 120)}", fix)


def read_json_object(src: Path, name: str, fix: str, limit: int = MAX_JSON_BYTES) -> dict | None:
    """The checkpoint's JSON file ``name`` (None when absent), which must hold an object."""
    data = read_bytes(src, name, fix, limit)
    if data is None:
        return None
    value = parse_json(data, name, src, fix)
    if not isinstance(value, dict):
        raise GraphkilnError(f"{name} in {untrusted.show(os.fspath(src), 120)} is not a JSON object: {fix}")
    return value
