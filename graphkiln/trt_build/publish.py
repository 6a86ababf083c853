"""Writing a built engine into its artifact: the plan and timing cache files and their manifest entry.

Unlike export, which publishes a whole new directory, a build adds files to an artifact that
already exists (its weights may be many GB: it is not copied). What a reader can see at
every instant is a consistent artifact, whatever happens to the build:

* Before anything is built (``check_destinations``): every file the build will write either
  does not exist or is one the manifest lists as an engine file (graphkiln's own, from a
  previous build); its parent directories are real directories or absent. A user's file,
  a symlink, or a file an interrupted build left unlisted is never replaced.
* The new files are written to hidden ``.NAME.partial-*`` siblings and fsynced, and the new
  manifest is validated (``Manifest.validated``) before anything visible changes. A failure
  or interrupt up to there removes those files and any directory this build created: the
  artifact is byte for byte what it was.
* The commit runs with SIGINT/SIGTERM/SIGHUP held (``graphkiln.publish``'s helper): the
  manifest is re-read and must still be the one the build started from; a rebuild first
  writes the manifest without the previous engine entry (renamed into place), then renames
  the new files over the old ones, then renames in the manifest with the new entry. Even a
  SIGKILL between two of those renames leaves an artifact that passes its checks (without
  an engine at worst; the next build then refuses the unlisted files and says to delete them).
* ``manifest.json`` changes, so the artifact's digest (``graphkiln inspect``) does too: the
  caller reports the new one. The old manifest's permission bits are kept.

``lock_artifact`` holds an exclusive ``flock`` on the artifact directory for a build's
duration, so two builds never interleave their commits (nothing is written for the lock).
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, EngineSpec, GraphSpec, Manifest, open_artifact_file
from graphkiln.publish import signals_held

ENGINE_DIR = "engines/tensorrt"
TIMING_CACHE = f"{ENGINE_DIR}/timing.cache"


def engine_paths(graph: GraphSpec) -> tuple[str, str]:
    """(plan, timing cache) artifact paths of ``graph``'s TensorRT engine."""
    return f"{ENGINE_DIR}/{graph.name}.plan", TIMING_CACHE


@contextmanager
def lock_artifact(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on the artifact directory (refused at once if another build holds it)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock; the commit's digest check still catches a concurrent change
        yield
        return
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise GraphkilnError(f"cannot open {root} ({exc.strerror}): pass an artifact directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise GraphkilnError(f"another graphkiln build is writing {root}: wait for it to finish") from None
        yield
    finally:
        os.close(fd)  # releases the lock


def _engine_owned(manifest: Manifest) -> set[str]:
    return {p for e in manifest.engines for p in (e.file, e.timing_cache) if p is not None}


def check_destinations(root: Path, manifest: Manifest, rels: list[str]) -> None:
    """Refuse (one line) unless every ``rels`` file may be written: see the module docstring."""
    owned = _engine_owned(manifest)
    for rel in rels:
        parts = rel.split("/")
        for i in range(1, len(parts)):
            d = root.joinpath(*parts[:i])
            if os.path.islink(d) or (os.path.lexists(d) and not d.is_dir()):
                raise GraphkilnError(f"{d} is a {'symlink' if os.path.islink(d) else 'file'}, not a directory graphkiln "
                                     "build writes engines into: move it out of the artifact and build again")
        path = root / rel
        if os.path.lexists(path) and rel not in owned:
            raise GraphkilnError(f"{path} exists but {MANIFEST_NAME} does not list it as an engine file (not "
                                 "graphkiln's, or left by an interrupted build): move or delete it and build again")
        if os.path.islink(path) or (os.path.lexists(path) and not path.is_file()):
            raise GraphkilnError(f"{path} is not a regular file: move it out of the artifact and build again")


def with_engine(manifest: Manifest, engine: EngineSpec, digests: Mapping[str, str]) -> Manifest:
    """``manifest`` with ``engine`` in place of any previous engine of the same graph and
    backend (whose files leave ``files``), and ``digests`` (path -> sha256) added to ``files``."""
    key = (engine.graph, engine.target, engine.backend)
    previous = [e for e in manifest.engines if (e.graph, e.target, e.backend) == key]
    gone = {p for e in previous for p in (e.file, e.timing_cache) if p is not None}
    files = {k: v for k, v in manifest.files.items() if k not in gone}
    files.update(digests)
    others = tuple(e for e in manifest.engines if (e.graph, e.target, e.backend) != key)
    return dataclasses.replace(manifest, engines=others + (engine,), files=files)


def without_engine(manifest: Manifest, engine: EngineSpec) -> Manifest:
    """``manifest`` without the engine of ``engine``'s graph and backend, nor its files."""
    key = (engine.graph, engine.target, engine.backend)
    gone = {p for e in manifest.engines if (e.graph, e.target, e.backend) == key
            for p in (e.file, e.timing_cache) if p is not None}
    return dataclasses.replace(manifest, engines=tuple(e for e in manifest.engines
                                                       if (e.graph, e.target, e.backend) != key),
                               files={k: v for k, v in manifest.files.items() if k not in gone})


def publish_engine(root: Path, manifest: Manifest, digest: str, engine: EngineSpec,
                   contents: Mapping[str, bytes | memoryview]) -> tuple[Manifest, str]:
    """Write ``contents`` (artifact path -> bytes: the engine's plan and timing cache) into the
    artifact ``root`` whose manifest, as read when the build started, is ``manifest`` with
    sha256 ``digest``, and record ``engine`` in it. Returns the new manifest and its digest.
    See the module docstring for what is refused and what a failure leaves."""
    root = Path(root)
    rels = [engine.file] + ([engine.timing_cache] if engine.timing_cache else [])
    if sorted(contents) != sorted(rels):
        raise ValueError(f"publish_engine: contents {sorted(contents)} are not the engine's files {sorted(rels)}")
    check_destinations(root, manifest, rels)
    previous = [e for e in manifest.engines if (e.graph, e.target, e.backend) == (engine.graph, engine.target,
                                                                                    engine.backend)]
    created: list[Path] = []
    staged: dict[str, Path] = {}  # artifact path -> its hidden temporary file (until renamed)
    try:
        digests = {}
        for rel in rels:
            _make_dirs(root, rel, created)
            staged[rel], digests[rel] = _write_temp(root / rel, contents[rel])
        new = with_engine(manifest, engine, digests).validated()
        text = new.to_json().encode()
        mode = stat.S_IMODE(os.stat(root / MANIFEST_NAME).st_mode)
        staged[MANIFEST_NAME] = _write_temp(root / MANIFEST_NAME, text, mode)[0]
        if previous:
            cleared = without_engine(manifest, engine).validated().to_json().encode()
            cleared_tmp = _write_temp(root / MANIFEST_NAME, cleared, mode)[0]
            staged[f"{MANIFEST_NAME} (cleared)"] = cleared_tmp
        with signals_held():
            _check_unchanged(root, digest)
            if previous:  # the old entry leaves before its files are replaced
                os.replace(staged.pop(f"{MANIFEST_NAME} (cleared)"), root / MANIFEST_NAME)
            for rel in rels:
                os.replace(staged.pop(rel), root / rel)
            _fsync_dirs(root, rels)
            os.replace(staged.pop(MANIFEST_NAME), root / MANIFEST_NAME)
            _fsync_dirs(root, [MANIFEST_NAME])
        for rel in {p for e in previous for p in (e.file, e.timing_cache) if p is not None} - set(rels):
            try:  # a previous engine's file at another path: ours, now unlisted
                os.unlink(root / rel)
            except OSError:
                pass
        return new, hashlib.sha256(text).hexdigest()
    except BaseException as exc:
        with signals_held():
            for tmp in staged.values():
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            for d in reversed(created):
                try:
                    d.rmdir()  # only while empty
                except OSError:
                    break
        if isinstance(exc, OSError):
            raise _write_error(exc, root) from None
        raise


def _make_dirs(root: Path, rel: str, created: list[Path]) -> None:
    """Create ``rel``'s parent directories inside root (checked not to be links or files)."""
    d = root
    for part in rel.split("/")[:-1]:
        d = d / part
        try:
            d.mkdir()
        except FileExistsError:
            if os.path.islink(d) or not d.is_dir():
                raise GraphkilnError(f"{d} is not a directory graphkiln build writes engines into: move it out of "
                                     "the artifact and build again") from None
            continue
        created.append(d)


def _write_temp(path: Path, data: bytes | memoryview, mode: int | None = None) -> tuple[Path, str]:
    """Write ``data`` to a new hidden sibling of ``path`` and fsync it; returns (its path, sha256 of data)."""
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tmp, hashlib.sha256(data).hexdigest()


def _check_unchanged(root: Path, digest: str) -> None:
    with open_artifact_file(root, MANIFEST_NAME) as f:
        now = hashlib.file_digest(f, "sha256").hexdigest()
    if now != digest:
        raise GraphkilnError(f"{root / MANIFEST_NAME} changed while the engine was built (re-exported or built by "
                             "someone else): run graphkiln build again")


def _fsync_dirs(root: Path, rels: list[str]) -> None:
    """Make the renames durable: fsync each directory that received one."""
    for d in sorted({(root / rel).parent for rel in rels}):
        try:
            fd = os.open(d, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            continue
        try:
            os.fsync(fd)
        except OSError:  # some filesystems cannot fsync a directory; the rename itself is done
            pass
        finally:
            os.close(fd)


_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on device writing into {root}: free space and build again",
    errno.EFBIG: "file too large writing into {root} (see 'ulimit -f'): raise the limit and build again",
    errno.EROFS: "cannot write into {root} (read-only or permission denied): build a writable copy of the artifact",
    errno.EACCES: "cannot write into {root} (read-only or permission denied): build a writable copy of the artifact",
    errno.EPERM: "cannot write into {root} (read-only or permission denied): build a writable copy of the artifact",
}
if hasattr(errno, "EDQUOT"):
    _WRITE_ERRORS[errno.EDQUOT] = "no space left on device writing into {root} (disk quota exceeded): free space " \
                                  "and build again"


def _write_error(exc: OSError, root: Path) -> GraphkilnError:
    template = _WRITE_ERRORS.get(exc.errno)
    if template is not None:
        return GraphkilnError(template.format(root=root))
    return GraphkilnError(f"cannot write the engine into {root} ({exc.strerror or type(exc).__name__}): "
                          "check the directory and build again")
