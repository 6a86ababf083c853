"""``graphkiln``'s entry point: parse, run the command, and hold the error contract: a
``GraphkilnError`` is one ``error:`` line and exit status 2, an interrupt 128 + its signal, a
failed standard output one line (a closed pipe quietly), a module of a missing extra names the
extra to install.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys

from graphkiln.cli.flags import refuse_flags_without_their_parent
from graphkiln.cli.parser import build_parser
from graphkiln.errors import GraphkilnError


# Top-level modules graphkiln imports that an extra of pyproject.toml brings, not the base install
# (which is all `pip install graphkiln` gives): a command needing one names the extra to install.
_EXTRA_OF = {"torch": "export", "transformers": "export", "safetensors": "export", "onnx": "export",
             "onnxscript": "export", "regex": "export", "triton": "tensorrt", "tensorrt": "tensorrt",
             "tensorrt_bindings": "tensorrt", "cuda": "cuda", "ray": "distributed"}


class StdoutFailed(Exception):
    """Standard output refused a write (closed pipe, full disk): ``errno`` says why."""

    def __init__(self, errno_: int) -> None:
        super().__init__(errno_)
        self.errno = errno_


class _Stdout:
    """sys.stdout whose failed writes raise ``StdoutFailed``, so an OSError of the output is
    told apart from one of the artifact or checkpoint being read."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            raise StdoutFailed(exc.errno or errno.EIO) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            raise StdoutFailed(exc.errno or errno.EIO) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def _guarded_stdout():
    if sys.stdout is None or isinstance(sys.stdout, _Stdout):  # no stdout at all (>&-): print writes nothing
        yield
        return
    real, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    try:
        yield
    finally:
        sys.stdout = real


def _flush_stdout() -> None:
    if sys.stdout is not None:
        sys.stdout.flush()


def _silence_stdout() -> None:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.__stdout__.fileno())
        os.close(devnull)
    except (OSError, AttributeError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    from graphkiln.publish import Interrupted, interrupt_arrived, termination_signals_interrupt

    # SIGTERM and SIGHUP unwind like Ctrl-C, so the cleanup that removes a half-written
    # artifact runs for them too; the previous handlers are back once main returns.
    with termination_signals_interrupt(), _guarded_stdout():
        try:
            try:
                args = build_parser().parse_args(argv)
            except SystemExit as exc:  # --help, or a usage error already printed as one line
                _flush_stdout()
                return exc.code if isinstance(exc.code, int) else 2
            try:
                refuse_flags_without_their_parent(args)
                code = args.fn(args)
                _flush_stdout()  # what is still buffered fails here, not at the interpreter's exit
                return code
            except GraphkilnError as exc:
                interrupted = interrupt_arrived()  # native code swallowed the interrupt and failed instead
                if interrupted is not None:
                    raise interrupted from None
                print(f"error: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:
                # a signal's exception caught by library code and turned into its own (onnxruntime's
                # import makes an Interrupted in its native module an ImportError) is still the signal
                interrupted = interrupt_arrived()
                if interrupted is not None:
                    raise interrupted from None
                extra = _EXTRA_OF.get((exc.name or "").partition(".")[0]) if isinstance(exc, ModuleNotFoundError) else None
                if extra is None:  # a bug, or a module of the base install missing (a broken install)
                    raise
                print(f"error: graphkiln {args.command} needs {exc.name}, which graphkiln's '{extra}' extra "
                      f"installs: pip install 'graphkiln[{extra}]'", file=sys.stderr)
                return 2
        except Interrupted as exc:
            print(f"error: interrupted ({exc.signal_name})", file=sys.stderr)
            return 128 + exc.signum
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except StdoutFailed as exc:
            _silence_stdout()  # the interpreter's last flush would fail (and print) again
            if exc.errno == errno.EPIPE:  # the reader left (`| head`): quiet, as Unix tools end on SIGPIPE
                return 128 + 13
            print(f"error: cannot write to standard output ({os.strerror(exc.errno)}): free space or "
                  "redirect the output elsewhere", file=sys.stderr)
            return 2
