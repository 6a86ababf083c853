"""Opening the files an artifact's manifest names: only plain relative names, only inside the
artifact (symlinks followed, but not out of it), only regular files."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from graphkiln.errors import GraphkilnError
from graphkiln.manifest.fields import plain_relative_path
from graphkiln.untrusted import show_json


def artifact_file(root: Path, rel: str) -> Path:
    """The real path of artifact member ``rel``; GraphkilnError when ``rel`` is not a plain
    relative name or (through a symlink in any component) resolves outside ``root``.

    Only the link chain is examined (readlink/lstat): nothing outside is opened."""
    try:
        plain_relative_path(rel)
    except ValueError as exc:
        raise GraphkilnError(f"artifact path {show_json(rel)} {exc}: re-export the artifact") from None
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, rel))
    if real == real_root or os.path.commonpath([real_root, real]) != real_root:
        raise GraphkilnError(f"artifact file {rel} resolves outside the artifact through a symlink (to {real}): "
                             "copy the file into the artifact instead of linking it")
    return Path(real)


def open_artifact_file(root: Path, rel: str) -> BinaryIO:
    """Open artifact member ``rel`` for reading: only a regular file inside the artifact (a FIFO
    or device is refused before it is read, so it cannot block or stream forever)."""
    path = artifact_file(root, rel)
    # the resolved path has no symlinks: O_NOFOLLOW refuses one swapped in since it was resolved
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise GraphkilnError(f"artifact file {rel} is missing: re-export or re-copy the artifact") from None
    except OSError as exc:
        raise GraphkilnError(f"cannot read artifact file {rel} ({exc.strerror}): re-export or re-copy the artifact") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise GraphkilnError(f"artifact file {rel} is not a regular file: re-export or re-copy the artifact")
    return os.fdopen(fd, "rb")
