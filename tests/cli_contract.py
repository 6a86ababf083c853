"""The CLI's bad-input contract, as assertions every bad-input test file shares.

A failing command exits with status 2 and ends stderr with exactly one ``error:`` line (after
any progress lines), with no traceback and no terminal escape codes; a failed export leaves
nothing behind.
"""

from __future__ import annotations

from pathlib import Path

from graphkiln.cli import main


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """Run ``graphkiln ARGV`` in-process; returns (exit status, stdout, stderr)."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_error(code: int, err: str, *needles: str, alone: bool = False) -> str:
    """Status 2, one ``error:`` line that is stderr's last (its only line with ``alone``) and
    contains every needle (case-insensitive); returns that line."""
    assert code == 2, (code, err)
    assert "Traceback" not in err, err
    assert "\x1b[" not in err, f"ANSI escape codes in {err!r}"
    lines = [l for l in err.splitlines() if l.strip()]
    errors = [l for l in lines if l.startswith("error:")]
    assert len(errors) == 1, err
    assert lines[-1] == errors[0], f"the error is not stderr's last line: {err!r}"
    if alone:
        assert len(lines) == 1, f"more than the error line on stderr: {err!r}"
    for n in needles:
        assert n.lower() in errors[0].lower(), f"{n!r} not in {errors[0]!r}"
    return errors[0]


def assert_nothing_written(out: Path) -> None:
    """A failed export created neither ``out`` nor anything else in its parent directory."""
    assert not out.exists(), f"{out} was created by a failed export"
    parent = out.parent
    if parent.exists():
        leftovers = [p.name for p in parent.iterdir()]
        assert not leftovers, f"failed export left {leftovers} in {parent}"


def export_fails(capsys, ckpt: Path, out: Path, *needles: str, extra=()) -> str:
    """``graphkiln export CKPT -o OUT EXTRA`` fails by the contract and writes nothing."""
    code, _, err = run_cli(capsys, "export", ckpt, "-o", out, *extra)
    line = assert_one_error(code, err, *needles)
    assert_nothing_written(out)
    return line
