"""Publishing an artifact never destroys what graphkiln did not write (graphkiln.publish).

Every refusal runs the real ``graphkiln export`` (``graphkiln.cli.main``) on a real
checkpoint and compares a byte-level snapshot of the whole test tree before and after:
exit status 2, exactly one ``error:`` line, no traceback, not one byte changed. Write
failures are real (a full tmpfs, a read-only mount, a file-size rlimit) and signals are
real signals sent to a real ``graphkiln export`` process.
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphkiln.cli import main
from graphkiln.manifest import MANIFEST_NAME, Manifest
from graphkiln.publish import Interrupted, signals_held, termination_signals_interrupt


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [l for l in err.splitlines() if l.startswith("error:")]


def assert_one_error(code: int, err: str, *needles: str) -> str:
    """Exit status 2 and stderr's last line is its only ``error:`` line, holding every needle."""
    assert code == 2, (code, err)
    errors = error_lines(err)
    assert len(errors) == 1, err
    assert [l for l in err.splitlines() if l.strip()][-1] == errors[0], err
    for n in needles:
        assert n.lower() in errors[0].lower(), f"{n!r} not in {errors[0]!r}"
    return errors[0]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every entry under root (root included), not following symlinks: kind, mode and content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in ["", *dirnames, *filenames]:
            p = Path(dirpath, name) if name else Path(dirpath)
            st = p.lstat()
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = ("dir", st.st_mode)
            else:
                out[rel] = ("file", st.st_mode, p.read_bytes())
    return out


# -- refusals: the destination is never touched ------------------------------------------

# (case, needle in the error, whether to try it with --overwrite too / only)
REFUSALS = [
    ("checkpoint", "is the checkpoint directory", (False, True)),
    ("checkpoint parent", "contains the checkpoint", (False, True)),
    ("checkpoint grandparent", "contains the checkpoint", (False, True)),
    ("symlink to checkpoint", "is the checkpoint directory", (False, True)),
    ("inside checkpoint", "inside the checkpoint", (False, True)),
    ("inside checkpoint via symlink", "inside the checkpoint", (False, True)),
    ("cwd", "current working directory", (False, True)),
    ("cwd as ''", "current working directory", (False, True)),
    ("cwd as '.'", "current working directory", (False, True)),
    ("ancestor of cwd", "contains the current working directory", (False, True)),
    ("home", "your home directory", (True,)),
    ("ancestor of home", "contains your home directory", (True,)),
    ("filesystem root", "contains", (True,)),
    ("blank '  '", "empty or blank", (False, True)),
    ("blank name 'dir/  '", "blank", (False, True)),
    ("user dir without manifest", "not a graphkiln artifact directory", (False, True)),
    ("user dir with a package manifest.json", "not a graphkiln manifest", (False, True)),
    ("user dir with a JSON-list manifest.json", "not a graphkiln manifest", (True,)),
    ("user dir with a broken manifest.json", "not a graphkiln manifest", (True,)),
    ("user dir with a manifest.json directory", "not a graphkiln artifact directory", (True,)),
    ("regular file", "is a file, not an artifact directory", (False, True)),
    ("symlink to a user dir", "is a symlink, not an artifact directory", (False, True)),
    ("symlink to an artifact", "is a symlink, not an artifact directory", (True,)),
    ("symlink to a file", "is a symlink, not an artifact directory", (True,)),
    ("path under a regular file", "is not a directory", (False, True)),
    ("path deep under a regular file", "is not a directory", (False,)),
    ("name too long", "longer than the filesystem", (False,)),
    ("parent name too long", "longer than the filesystem", (False,)),
]


@pytest.fixture
def world(llama_case, tmp_path, monkeypatch) -> dict[str, str]:
    """A user's tree: a checkpoint two levels down next to the user's files, a working
    directory and a home directory with files in them. Returns case -> the -o argument."""
    models = tmp_path / "models"
    family = models / "family"
    ckpt = family / "checkpoint"
    shutil.copytree(llama_case.checkpoint, ckpt)
    (models / "README.txt").write_text("my model notes")
    (family / "eval.csv").write_text("a,b\n1,2\n")
    cwd = tmp_path / "work" / "project"
    cwd.mkdir(parents=True)
    (cwd / "main.py").write_text("print('mine')\n")
    (tmp_path / "work" / "todo.txt").write_text("todo")
    monkeypatch.chdir(cwd)
    home = tmp_path / "homes" / "me"
    home.mkdir(parents=True)
    (home / ".bashrc").write_text("export X=1\n")
    monkeypatch.setenv("HOME", str(home))

    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("\\documentclass{article}")
    (user / "data").mkdir()
    (user / "data" / "x.bin").write_bytes(os.urandom(64))
    dirs = {}
    for name, manifest in [("pkg", '{"name": "mine", "version": "1.0"}'), ("listy", '[{"format_version": 1}]'),
                           ("broken", '{"format_version": 1,')]:
        d = tmp_path / f"with-{name}-manifest"
        d.mkdir()
        (d / MANIFEST_NAME).write_text(manifest)
        (d / "keep.txt").write_text("keep")
        dirs[name] = d
    dir_manifest = tmp_path / "with-dir-manifest"
    (dir_manifest / MANIFEST_NAME).mkdir(parents=True)
    (dir_manifest / MANIFEST_NAME / "format_version").write_text("1")
    afile = tmp_path / "notes.txt"
    afile.write_text("do not replace me")
    artifact = tmp_path / "artifact"
    shutil.copytree(llama_case.artifact, artifact)
    for link, dest in [("ckpt-link", ckpt), ("user-link", user), ("artifact-link", artifact), ("file-link", afile)]:
        (tmp_path / link).symlink_to(dest)
    long = "n" * 300
    return {
        "checkpoint": str(ckpt),
        "checkpoint parent": str(family),
        "checkpoint grandparent": str(models),
        "symlink to checkpoint": str(tmp_path / "ckpt-link"),
        "inside checkpoint": str(ckpt / "onnx"),
        "inside checkpoint via symlink": str(tmp_path / "ckpt-link" / "sub" / "onnx"),
        "cwd": str(cwd),
        "cwd as ''": "",
        "cwd as '.'": ".",
        "ancestor of cwd": "..",
        "home": str(home),
        "ancestor of home": str(home.parent),
        "filesystem root": "/",
        "blank '  '": "  ",
        "blank name 'dir/  '": str(tmp_path / "new" / "  "),
        "user dir without manifest": str(user),
        "user dir with a package manifest.json": str(dirs["pkg"]),
        "user dir with a JSON-list manifest.json": str(dirs["listy"]),
        "user dir with a broken manifest.json": str(dirs["broken"]),
        "user dir with a manifest.json directory": str(dir_manifest),
        "regular file": str(afile),
        "symlink to a user dir": str(tmp_path / "user-link"),
        "symlink to an artifact": str(tmp_path / "artifact-link"),
        "symlink to a file": str(tmp_path / "file-link"),
        "path under a regular file": str(afile / "out"),
        "path deep under a regular file": str(afile / "a" / "b" / "out"),
        "name too long": str(tmp_path / long),
        "parent name too long": str(tmp_path / long / "out"),
    }


@pytest.mark.parametrize("case,needle,overwrite", [
    pytest.param(c, n, o, id=f"{c}{'-overwrite' if o else ''}") for c, n, modes in REFUSALS for o in modes])
def test_refused_output_changes_nothing(world, case, needle, overwrite, tmp_path, capsys):
    ckpt = world["checkpoint"]
    before = snapshot(tmp_path)
    code, out, err = run_cli(capsys, "export", ckpt, "-o", world[case], *(["--overwrite"] if overwrite else []))
    assert_one_error(code, err, needle)
    assert out == ""
    assert snapshot(tmp_path) == before


def test_signal_handlers_are_restored_after_main(tmp_path, capsys):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    code, _, err = run_cli(capsys, "export", tmp_path / "missing-checkpoint", "-o", tmp_path / "out")
    assert code == 2 and len(error_lines(err)) == 1
    assert {s: signal.getsignal(s) for s in before} == before


def test_signals_during_a_publication_step_are_delivered_after_it():
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        pytest.skip("the test runner handles SIGTERM itself")
    done = []
    with termination_signals_interrupt():
        with pytest.raises(Interrupted) as info:
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler would have run by now if it were not held
                done.append("step finished")
        assert done == ["step finished"] and info.value.signum == signal.SIGTERM


# -- what --overwrite does replace -------------------------------------------------------

def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_overwrite_replaces_an_empty_directory(llama_case, tmp_path, capsys):
    out = tmp_path / "empty"
    out.mkdir()
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", out, "--overwrite", "--max-seq-len", 64)
    assert code == 0, err
    assert Manifest.read(out).model.architecture == "LlamaForCausalLM"
    assert _siblings(out) == ["empty"]  # no .partial-* or .old-* left


def test_overwrite_replaces_a_previous_artifact(llama_case, checkpoint_copy, artifact_copy, capsys):
    ckpt = checkpoint_copy(llama_case)
    art = artifact_copy(llama_case)
    (art / "stale-file-from-an-older-export.bin").write_bytes(b"old")
    code, _, err = run_cli(capsys, "export", ckpt, "-o", art, "--overwrite", "--max-seq-len", 64)
    assert code == 0, err
    assert not (art / "stale-file-from-an-older-export.bin").exists()
    assert Manifest.read(art).model.architecture == "LlamaForCausalLM"
    assert _siblings(art) == ["artifact", "checkpoint"]  # the old artifact is gone, not hidden


# -- write failures: one line, nothing left, not even the parents it made -----------------

@pytest.fixture
def mount_tmpfs(tmp_path):
    """Factory: mount a tmpfs (``mount -o OPTIONS``) at a new directory; unmounted afterwards.
    Skips where mounting is not allowed (not root, no CAP_SYS_ADMIN)."""
    mounted = []

    def mount(name: str, options: str) -> Path:
        where = tmp_path / name
        where.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True)
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", str(where)], check=True)


def test_disk_full_is_one_line_and_leaves_nothing(llama_case, mount_tmpfs, capsys):
    small = mount_tmpfs("small", "size=64k")  # the artifact needs ~0.5 MB
    out = small / "made" / "by" / "export" / "artifact"
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", out, "--max-seq-len", 64)
    assert_one_error(code, err, "no space left on device", str(small / "made"), "--output")
    assert list(small.iterdir()) == []  # temp dir and the three parents export made: all gone


@pytest.mark.parametrize("sub", ["artifact", "new/parents/artifact"])
def test_read_only_output_is_one_line_and_leaves_nothing(llama_case, mount_tmpfs, sub, capsys):
    ro = mount_tmpfs("ro", "ro,size=64k")
    code, _, err = run_cli(capsys, "export", llama_case.checkpoint, "-o", ro / sub)
    assert_one_error(code, err, "read-only or permission denied", str(ro), "--output")
    assert list(ro.iterdir()) == []


def _export_process(ckpt: Path, out: Path, limit_bytes: int | None = None) -> subprocess.Popen:
    """``graphkiln export`` in a child whose SIGINT/SIGTERM/SIGHUP are at their defaults (a
    test runner in the background may ignore SIGINT, and children would inherit that)."""

    def child_setup():
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_DFL)
        if limit_bytes is not None:  # writes past the limit then fail with EFBIG instead of killing
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    return subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(out),
                             "--max-seq-len", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=child_setup)


def test_file_size_limit_is_one_line_and_leaves_nothing(llama_case, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "mine.txt").write_text("mine")
    before = snapshot(base)
    proc = _export_process(llama_case.checkpoint, base / "made" / "artifact", limit_bytes=64 * 1024)
    _, err = proc.communicate(timeout=300)
    assert_one_error(proc.returncode, err, "file too large writing", str(base / "made" / "artifact"), "ulimit -f")
    assert snapshot(base) == before


@pytest.mark.parametrize("signum,line", [
    (signal.SIGTERM, "error: interrupted (SIGTERM)"),  # SIGHUP takes the same handler
    (signal.SIGINT, "error: interrupted"),
], ids=["SIGTERM", "SIGINT"])
def test_signal_cleans_up_like_ctrl_c(llama_case, tmp_path, signum, line):
    base = tmp_path / "base"
    base.mkdir()
    (base / "mine.txt").write_text("mine")
    before = snapshot(base)
    made = base / "made"  # a parent export creates, so must remove again
    proc = _export_process(llama_case.checkpoint, made / "artifact")
    try:
        deadline = time.monotonic() + 240
        while not (made.is_dir() and any(p.name.startswith(".artifact.partial-") for p in made.iterdir())):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "export never created its .partial- directory"
            time.sleep(0.02)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # After Ctrl-C, CPython may end the process by re-raising SIGINT on itself (it does when the
    # KeyboardInterrupt passed through code run with PyRun_String, as pybind11's eval does):
    # a shell sees status 130 either way.
    expected = {128 + signum} | ({-signal.SIGINT} if signum == signal.SIGINT else set())
    assert proc.returncode in expected, err
    assert error_lines(err) == [line], err
    assert snapshot(base) == before


# -- the demo deletes only what it made ---------------------------------------------------

def test_demo_workdir_touches_nothing_it_did_not_make(tmp_path, capsys):
    work = tmp_path / "work"
    for name in ("checkpoint", "artifact"):  # the names the demo uses inside its own directory
        (work / name).mkdir(parents=True)
        (work / name / "mine.txt").write_text(f"user's {name}")
    (work / "notes.txt").write_text("notes")
    before = snapshot(work)
    code, out, err = run_cli(capsys, "demo", "--workdir", work)
    assert code == 0, err
    after = snapshot(work)
    made = sorted({k.split("/")[0] for k in after} - {k.split("/")[0] for k in before})
    assert len(made) == 1 and made[0].startswith("graphkiln-demo-"), made
    assert {k: v for k, v in after.items() if not k.startswith(made[0])} == before
    assert (work / made[0] / "artifact" / MANIFEST_NAME).is_file()  # --workdir keeps the demo's files
    assert str(work / made[0]) in out


@pytest.mark.parametrize("signame, kind, status", [("SIGINT", KeyboardInterrupt, 130), ("SIGTERM", Interrupted, 143)])
def test_an_interrupt_swallowed_by_native_code_is_still_an_interrupt(monkeypatch, capsys, signame, kind, status):
    """A signal whose exception native code swallows (safetensors reporting a bad storage instead)
    is recorded; the CLI reports the interruption, not the error it caused."""
    import graphkiln.cli as cli
    from graphkiln.cli import commands
    from graphkiln.errors import GraphkilnError
    from graphkiln.publish import interrupt_arrived

    def swallowing(args):
        try:
            signal.raise_signal(getattr(signal, signame))
        except KeyboardInterrupt:
            pass  # what the native reader did with it
        assert isinstance(interrupt_arrived(), kind)
        raise GraphkilnError("model.safetensors is truncated or corrupt reading 'w'")

    monkeypatch.setattr(commands, "do_inspect", swallowing)
    # Python's own Ctrl-C handler, which a runner started in the background (SIGINT ignored) lacks
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert cli.main(["inspect", "anything"]) == status
    finally:
        signal.signal(signal.SIGINT, previous)
    err = capsys.readouterr().err
    assert err.startswith("error: interrupted") and "truncated" not in err
    with termination_signals_interrupt():
        assert interrupt_arrived() is None  # a new block starts with nothing recorded
