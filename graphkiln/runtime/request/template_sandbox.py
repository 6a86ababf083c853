"""Where an artifact's chat template runs: jinja2's sandbox, in a worker process the OS bounds.

A chat template is code from the artifact. jinja2's ``ImmutableSandboxedEnvironment`` keeps it
away from Python's internals and from mutating the messages, but not from spending: ``'x' *
10**9``, ``tojson(indent=10**8)``, ``'%(a)s' * 9999 % d``, nested ``range`` loops, loops over a
long message's characters, recursive macros. Catching every operation that can grow or spin is
a list that is never complete, so the template is rendered in a separate process instead, and
the bounds are the operating system's, whatever the template does:

- time: the parent (``graphkiln.runtime.request.chat_template``) waits at most its deadline for
  the reply, then kills the worker; the worker also lowers its own CPU limit before each render
  (``RLIMIT_CPU``), so one orphaned mid-render (its parent killed) still ends;
- memory: the worker's address space is its size after start-up plus ``MEMORY_BYTES``
  (``RLIMIT_AS``): an allocation beyond it is a ``MemoryError`` here, never the parent's;
- output: the render is streamed (``Template.generate``) and stops once it exceeds the request's
  ``max_chars``; the parent refuses a reply frame longer than that allows.

Protocol: frames of an 8-byte big-endian length and that many bytes of ASCII JSON (``\\uXXXX``
escapes keep lone surrogates, which a request's JSON may hold, intact). The worker writes
``{"ready": true}`` once, then answers each request ``{"source", "vars", "max_chars", "seconds"}``
with ``{"text"}``, ``{"refused"}`` (the template's ``raise_exception``) or ``{"error", "bound"}``
(``bound``: the render passed a bound, memory, output or recursion depth, and the worker exits
after replying: such a process is not worth reusing). End of input ends it.

This file is also the worker's main, run as ``python -I <this file>``: it imports the standard
library and jinja2 only, never graphkiln (whose imports load onnxruntime). ``environment`` is
the one definition of the sandbox: the parent compiles with it too, to report a template that
does not compile when the artifact is loaded.
"""

from __future__ import annotations

import json
import struct
from datetime import datetime

MEMORY_BYTES = 1 << 30  # beyond the worker's start-up size: 60x the largest prompt the output budget allows
HEADER = struct.Struct(">Q")
CACHED_TEMPLATES = 4  # compiled templates kept by a worker (a process serves one artifact, or a few in tests)


class TemplateRefused(Exception):
    """The template's ``raise_exception``: it refused the messages (a user error, not a failure)."""


def _raise_exception(message):
    raise TemplateRefused(str(message))


def _tojson(value, indent=None, ensure_ascii=False, sort_keys=False):
    # transformers' tojson (jinja2's escapes HTML, which would change the prompt)
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _nothing_folded():
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator

    class NothingFolded(CodeGenerator):
        """Writes every expression of an output as code, run when rendered: only the template's
        own text is written as a constant."""

        def _output_child_to_const(self, node, frame, finalize):
            if not isinstance(node, nodes.TemplateData):
                raise nodes.Impossible()
            return super()._output_child_to_const(node, frame, finalize)

    return NothingFolded


def environment():
    """The sandbox every chat template is compiled and rendered in: jinja2's immutable sandbox with
    the options, globals and filters transformers renders chat templates with, so prompts match
    its ``apply_chat_template``. Compiling evaluates nothing of the template (no constant folding),
    so the parent may compile an untrusted template; only the worker renders one."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Sandbox(ImmutableSandboxedEnvironment):
        code_generator_class = _nothing_folded()

    # optimized=False and _NothingFolded: jinja2 folds constant expressions while compiling
    # ('x' * 10**10, 'x'|center(10**9) included), which would spend time and memory in whichever
    # process compiles, outside the worker's bounds
    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], optimized=False)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def encode_frame(obj) -> bytes:
    body = json.dumps(obj, ensure_ascii=True).encode("ascii")
    return HEADER.pack(len(body)) + body


def _read_frame(stream):
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (size,) = HEADER.unpack(head)
    body = stream.read(size)
    return json.loads(body) if len(body) == size else None


class _OverBudget(Exception):
    pass


def _render(template, variables: dict, max_chars: int) -> str:
    parts, total = [], 0
    for piece in template.generate(**variables):
        total += len(piece)
        if total > max_chars:
            raise _OverBudget(f"its output passed {max_chars} characters")
        parts.append(piece)
    return "".join(parts)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _serve(stdin, stdout) -> None:
    import resource
    import signal

    # Ctrl-C in a terminal is for the parent (it cancels a reply there); the parent ends this process
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    env = environment()
    with open("/proc/self/statm") as f:
        size = int(f.read().split()[0]) * resource.getpagesize()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = size + MEMORY_BYTES
    if hard == resource.RLIM_INFINITY or hard > limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    cache: dict[str, object] = {}
    stdout.write(encode_frame({"ready": True}))
    stdout.flush()
    while True:
        request = _read_frame(stdin)
        if request is None:
            return
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu_soft, cpu_hard = resource.getrlimit(resource.RLIMIT_CPU)
        budget = int(usage.ru_utime + usage.ru_stime + request["seconds"]) + 2
        if cpu_hard == resource.RLIM_INFINITY or budget < cpu_hard:
            resource.setrlimit(resource.RLIMIT_CPU, (budget, cpu_hard))
        retire, template = False, None
        try:
            source = request["source"]
            template = cache.pop(source, None) or env.from_string(source)
            cache[source] = template  # most recently used last
            while len(cache) > CACHED_TEMPLATES:
                cache.pop(next(iter(cache)))
            reply = {"text": _render(template, request["vars"], request["max_chars"])}
        except TemplateRefused as exc:
            reply = {"refused": _one_line(str(exc))}
        except _OverBudget as exc:
            retire, reply = True, {"error": str(exc), "bound": True}
        except MemoryError:
            retire, reply = True, {"error": f"it needed more than {MEMORY_BYTES >> 20} MiB of memory", "bound": True}
        except RecursionError:
            retire, reply = True, {"error": "it recursed too deep", "bound": True}
        except Exception as exc:  # a sandbox SecurityError, a TypeError inside the template, ...
            reply = {"error": _one_line(f"{type(exc).__name__}: {exc}"), "bound": False}
        del template
        try:
            frame = encode_frame(reply)
        except MemoryError:
            retire, frame = True, encode_frame({"error": "its output needed more than the memory bound", "bound": True})
        stdout.write(frame)
        stdout.flush()
        if retire:
            return


if __name__ == "__main__":
    import sys

    _serve(sys.stdin.buffer, sys.stdout.buffer)
