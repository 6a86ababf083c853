"""Artifact directories on disk: checksums and atomic publication.

An artifact is published by writing everything into a sibling temporary directory and
renaming it into place, so a reader never sees a half-written artifact and a failed
export leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, Manifest


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def checksum_tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root except the manifest itself, keyed by relative path."""
    return {
        p.relative_to(root).as_posix(): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


def verify_checksums(root: Path, manifest: Manifest) -> None:
    for rel, expected in manifest.files.items():
        path = root / rel
        if not path.is_file():
            raise GraphkilnError(f"artifact file {rel} is missing: re-export or re-copy the artifact")
        if sha256_file(path) != expected:
            raise GraphkilnError(
                f"artifact file {rel} fails its sha256 check (modified or corrupt): re-export or re-copy the artifact"
            )


@contextmanager
def atomic_directory(target: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``target`` only if the block succeeds."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise GraphkilnError(f"{target} already exists: choose another output directory or pass --overwrite")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a published artifact follows the umask
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
