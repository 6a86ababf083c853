"""Publishing an artifact directory without ever destroying what graphkiln did not write.

An artifact is written into a hidden sibling ``.NAME.partial-*`` directory and renamed into
place only when the export succeeded, so a reader never sees a half-written artifact.

Invariants of :func:`atomic_directory`:

* Before anything is created, the destination is checked (:func:`check_output`). It is never
  the checkpoint (or any ``protected`` path), an ancestor of one, a path inside one, the
  working directory or an ancestor of it, the home directory or an ancestor of it, the
  filesystem root, or a mount point; compared by real path, so symlinks do not hide them.
  An existing destination is replaced only with ``overwrite`` and only if it is a real
  directory (not a symlink) that is empty or holds a graphkiln ``manifest.json``: a
  user's file or directory is never replaced.
* On failure (an exception, KeyboardInterrupt, or SIGTERM/SIGHUP turned into
  :class:`Interrupted` by :func:`termination_signals_interrupt`), the temporary directory
  and every parent directory this call created are removed (parents only while empty),
  and a replaced artifact is untouched.
* On success the previous artifact is gone too: no ``.NAME.old-*`` directory is left.
  Signals arriving while the directories are being created, renamed or removed are held
  until that step is complete, so an interrupt cannot strand one of them.
* ``OSError`` from writing the output (disk full, read-only, permission denied, a path
  component that is a file, a name too long, a file over the size limit) becomes a
  one-line :class:`GraphkilnError` naming the path and what to do.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import shutil
import signal
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME

# How a refused destination is fixed, appended to every refusal about an existing path.
_ONLY_ARTIFACTS = "choose another --output (--overwrite replaces only a graphkiln artifact or an empty directory)"

# Signals held (not lost) while a directory is created, renamed or removed; see signals_held.
_HELD_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like Ctrl-C so every ``finally``/``except BaseException``
    cleanup runs; ``signum`` is the signal's number."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


_arrived: list[int] = []  # signals delivered inside termination_signals_interrupt, oldest first


@contextmanager
def termination_signals_interrupt(signums: Sequence[int] = ()) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP (or ``signums``) raise :class:`Interrupted` in the
    main thread; the previous handlers are restored on exit. A signal that is ignored
    (``nohup``) or already handled by someone else keeps its handler; outside the main
    thread nothing is installed (Python only delivers signals there).

    Every signal delivered (Ctrl-C too, still raised as KeyboardInterrupt) is recorded, because
    native code can swallow the exception a handler raises and fail with an error of its own (a
    safetensors read interrupted mid-tensor reports a bad storage): ``interrupt_arrived`` gives
    the interruption back to whoever reports that error."""
    wanted = tuple(signums) or tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))
    previous: dict[int, object] = {}
    _arrived.clear()
    if threading.current_thread() is threading.main_thread():
        def raise_interrupted(signum, frame):
            _arrived.append(signum)
            raise Interrupted(signum)

        def raise_keyboard_interrupt(signum, frame):
            _arrived.append(signum)
            raise KeyboardInterrupt

        for s in wanted:
            if signal.getsignal(s) == signal.SIG_DFL:
                previous[s] = signal.signal(s, raise_interrupted)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, raise_keyboard_interrupt)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def interrupt_arrived() -> BaseException | None:
    """The interruption to raise instead of an error, when a signal arrived inside
    ``termination_signals_interrupt`` (see there); None when none did."""
    if not _arrived:
        return None
    signum = _arrived[0]
    return KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)


def forget_interrupts() -> None:
    """Forget the signals recorded so far: their caller handled them where they arrived
    (``graphkiln chat``'s Ctrl-C cancelling one reply), so an error met later in the same
    command is reported as itself, not as that interruption."""
    _arrived.clear()


@contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP for a short step that must finish (a rename, a removal), then
    deliver them to the handlers they would have reached.

    Python-level, not ``pthread_sigmask``: with torch's worker threads running, a blocked
    main thread does not stop the kernel from handing the signal to another thread, whose C
    handler still schedules the Python handler in the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous: dict[int, object] = {}
    for s in _HELD_SIGNALS:
        handler = signal.getsignal(s)
        if handler is None or handler == signal.SIG_IGN:  # not ours to touch / nothing to deliver
            continue
        previous[s] = signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(pending):
            handler = previous[s]
            if callable(handler):
                handler(s, None)
            else:  # SIG_DFL: let the default action (termination) happen now that the step is done
                signal.raise_signal(s)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _within(path: Path, root: Path) -> bool:
    """``path`` is ``root`` or below it (both already real paths)."""
    return path == root or root in path.parents


def _not_replaceable(path: Path) -> str | None:
    """Why the existing ``path`` must not be replaced, or None if it is graphkiln's to replace:
    a real directory that is empty or holds a graphkiln manifest (a JSON object with a
    ``format_version``). Parsing the manifest is enough: this decides ownership, not validity."""
    if path.is_symlink():
        return "is a symlink, not an artifact directory"
    if not path.is_dir():
        return "is a file, not an artifact directory"
    try:
        with os.scandir(path) as entries:
            if next(entries, None) is None:
                return None
        manifest = path / MANIFEST_NAME
        if manifest.is_symlink() or not manifest.is_file():
            return f"is not a graphkiln artifact directory (no {MANIFEST_NAME})"
        data = json.loads(manifest.read_bytes())
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: not provably ours
        return f"is not a graphkiln artifact directory (its {MANIFEST_NAME} is not a graphkiln manifest)"
    if not isinstance(data, dict) or "format_version" not in data:
        return f"is not a graphkiln artifact directory (its {MANIFEST_NAME} is not a graphkiln manifest)"
    return None


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_output(output: str | os.PathLike, *, overwrite: bool = False, protected: Sequence[str | os.PathLike] = ()) -> Path:
    """Refuse every destination an export must not write (see the module docstring) and
    return the absolute path to publish at, its parent directory resolved. Writes nothing."""
    if not str(output).strip():
        raise GraphkilnError(f"--output {str(output)!r} is empty or blank: give the directory to create for the artifact")
    given = Path(output).absolute()
    if given.name.strip() == "" and given.name != "":
        raise GraphkilnError(f"--output {str(output)!r} is a blank name: give the directory to create for the artifact")
    if given.name in ("", ".", ".."):
        target = _real(given)
    else:
        target = _real(given.parent) / given.name
    real = _real(target)  # follows target itself too when it is a symlink: where writes would land

    for p in protected:
        root = _real(Path(p))
        if real == root:
            raise GraphkilnError(f"--output {target} is the checkpoint directory: choose a new directory for the artifact")
        if _within(root, real):
            raise GraphkilnError(f"--output {target} contains the checkpoint {root}: choose a new directory for the artifact")
        if _within(real, root):
            raise GraphkilnError(f"--output {target} is inside the checkpoint {root}: "
                                 "choose a directory outside the checkpoint")
    if real.parent == real:
        raise GraphkilnError(f"--output {target} is the filesystem root: choose a new directory for the artifact")
    places = [("your home directory", Path(os.path.expanduser("~")), "")]
    try:
        places.insert(0, ("the current working directory", Path(os.getcwd()), " (an empty -o means '.')"))
    except OSError:  # the working directory was deleted: nothing left there to protect
        pass
    for what, root, hint in places:
        root = _real(root)
        if real == root:
            raise GraphkilnError(f"--output {target} is {what}{hint}: choose a new directory for the artifact")
        if _within(root, real):
            raise GraphkilnError(f"--output {target} contains {what} {root}: choose a new directory for the artifact")

    if os.path.lexists(target):
        reason = _not_replaceable(target)
        if reason is not None:
            raise GraphkilnError(f"--output {target} already exists and {reason}: {_ONLY_ARTIFACTS}")
        if os.path.ismount(target):
            raise GraphkilnError(f"--output {target} is a mount point, which cannot be replaced: "
                                 f"write the artifact into a new directory inside it, e.g. {target / 'artifact'}")
        if not overwrite:
            raise GraphkilnError(f"{target} already exists: choose another output directory or pass --overwrite")
        return target

    existing = target.parent
    missing = [target.name]
    while not os.path.lexists(existing):
        missing.append(existing.name)
        existing = existing.parent
    if not existing.is_dir():
        raise GraphkilnError(f"cannot create {target}: {existing} is not a directory: choose another --output")
    limit = _name_max(existing)
    for name in missing:
        if len(os.fsencode(name)) > limit:
            raise GraphkilnError(f"cannot create {target}: the name {name[:32]!r}... is longer than the "
                                 f"filesystem's {limit} bytes: choose a shorter --output")
    return target


def _hidden_prefix(target: Path, kind: str) -> str:
    """``.NAME.kind-`` for a sibling of target, NAME shortened so the sibling's name fits even
    when target's own name is close to the filesystem's limit."""
    return f".{target.name[:64]}.{kind}-"


def _remove_tree(path: Path, attempts: int = 3) -> bool:
    """Remove path; retried because a concurrent writer can refill a directory under rmtree."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return True
    return False


_WRITE_ERRORS = {
    errno.ENOSPC: "no space left on device writing {p}: free space or choose another --output",
    errno.EFBIG: "file too large writing {p} (over the file-size limit, see 'ulimit -f', or the filesystem's "
                 "maximum file size): raise the limit or choose another --output",
    errno.EROFS: "cannot write {p} (read-only or permission denied): choose another --output",
    errno.EACCES: "cannot write {p} (read-only or permission denied): choose another --output",
    errno.EPERM: "cannot write {p} (read-only or permission denied): choose another --output",
    errno.ENOTDIR: "cannot create {p}: a component of the path is a file, not a directory: choose another --output",
    errno.ENAMETOOLONG: "cannot create {p}: a name in the path is too long for the filesystem: "
                        "choose a shorter --output",
}
if hasattr(errno, "EDQUOT"):
    _WRITE_ERRORS[errno.EDQUOT] = "no space left on device writing {p} (disk quota exceeded): free space or " \
                                  "choose another --output"
# Errors a bare write()/flush() raises without a file name: unambiguously about the output.
_NAMELESS_WRITE_ERRORS = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}


def _write_error(exc: OSError, target: Path, tmp: Path | None) -> GraphkilnError | None:
    """The one-line error for an OSError about the output, or None if it is about something
    else (a checkpoint file the export was reading: not ours to reword)."""
    template = _WRITE_ERRORS.get(exc.errno)
    if template is None:
        return None
    if exc.filename is None:
        return GraphkilnError(template.format(p=target)) if exc.errno in _NAMELESS_WRITE_ERRORS else None
    path = Path(os.path.abspath(os.fsdecode(exc.filename)))
    if tmp is not None and _within(path, tmp):
        shown = target / path.relative_to(tmp)  # the name the file would have had once published
    elif path.parent == target.parent and path.name.startswith(f".{target.name[:64]}."):
        shown = target  # our hidden sibling (temp or replaced artifact): the user knows it as target
    elif _within(path, target) or path in target.parents:  # the output or a parent being created
        shown = path
    else:
        return None
    return GraphkilnError(template.format(p=shown))


def _make_parents(directory: Path, created: list[Path]) -> None:
    """mkdir -p, recording (outermost first) each directory this call created."""
    missing = []
    while not os.path.lexists(directory):
        missing.append(directory)
        directory = directory.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # made concurrently by someone else: theirs, not ours to remove
            continue
        created.append(d)


def _publish(tmp: Path, target: Path, overwrite: bool) -> None:
    """Rename tmp to target, replacing target if it is (still) graphkiln's to replace."""
    if not os.path.lexists(target):
        tmp.rename(target)
        return
    # Re-checked here: the destination may have changed during the export.
    reason = _not_replaceable(target)
    if reason is not None:
        raise GraphkilnError(f"--output {target} {reason} (it changed during the export): {_ONLY_ARTIFACTS}")
    if not overwrite:
        raise GraphkilnError(f"{target} already exists (it appeared during the export): choose another output "
                             "directory or pass --overwrite")
    old = target.with_name(f"{_hidden_prefix(target, 'old')}{os.getpid()}-{secrets.token_hex(4)}")
    target.rename(old)
    try:
        tmp.rename(target)
    except BaseException:
        old.rename(target)
        raise
    if not _remove_tree(old):
        raise GraphkilnError(f"published {target}, but could not remove the previous artifact, moved to {old}: "
                             "delete that directory by hand")


@contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False,
                     protected: Sequence[str | os.PathLike] = ()) -> Iterator[Path]:
    """Yield a temporary directory that becomes ``target`` only if the block succeeds.

    ``protected``: paths (the checkpoint) the output must not be, contain, or lie inside.
    See the module docstring for what is refused and what is cleaned up.
    """
    target = check_output(target, overwrite=overwrite, protected=protected)
    created: list[Path] = []
    tmp: Path | None = None
    try:
        with signals_held():
            _make_parents(target.parent, created)
            tmp = Path(tempfile.mkdtemp(prefix=_hidden_prefix(target, "partial"), dir=target.parent))
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700; a published artifact follows the umask
        yield tmp
        with signals_held():
            _publish(tmp, target, overwrite)
    except BaseException as exc:
        with signals_held():
            if tmp is not None and os.path.lexists(tmp):
                _remove_tree(tmp)
            for d in reversed(created):
                try:
                    d.rmdir()  # only while empty: a published artifact or someone's file keeps it
                except OSError:
                    break
        if isinstance(exc, OSError):
            err = _write_error(exc, target, tmp)
            if err is not None:
                raise err from None
        raise
