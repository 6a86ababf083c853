"""The artifact's chat template: messages -> prompt token ids.

Where the template comes from, as transformers saves it: ``chat_template.jinja`` (transformers
>= 4.43 writes it beside the tokenizer), else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates of which "default" is used). Both are tokenizer files the
export copies and the manifest hashes (``manifest.tokenizer_files``). The template is untrusted
code: it is compiled and rendered only in jinja2's ``ImmutableSandboxedEnvironment`` (no
attribute access to Python internals, no mutation of the messages), with the globals and
filters transformers gives templates (``raise_exception``, ``strftime_now``, ``tojson``).

Users: ``graphkiln serve``'s chat route (``graphkiln.serve.chat``) and ``graphkiln chat`` /
``graphkiln run --chat`` (``graphkiln.chat``); it lives beside the tokenizer, below both, so the
CLI does not import the serving layer.

Lifecycle: ``ChatTemplate.load`` runs once (at server start, or when the chat command has loaded
its engine) and never raises for a missing or broken template; ``render`` then refuses with
``ChatTemplateError`` (the server's 400), so the completions route keeps working on an artifact
without a usable template. ``problem`` is None exactly when ``template`` is usable.
``ChatTemplate.from_source`` makes one from a template's text (export's check of what it copies).

Bounds: ``render`` is the one way a template runs. It runs in a sandbox worker process
(``graphkiln.runtime.request.template_sandbox``, where the reasons are) and takes at most
``seconds`` (default ``RENDER_SECONDS``), the worker's memory bound and ``max_chars`` of output
(default ``MAX_RENDER_CHARS``); past any of them it is one ``ChatTemplateError`` and the worker
is killed, so a hostile template never pins the calling thread (a server's lane worker, the
chat command) beyond ``seconds``, nor holds up the process's exit. Idle workers are kept for
the next render (at most ``IDLE_WORKERS``) and killed at exit.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.request import template_sandbox
from graphkiln.runtime.request.tokenizer import Tokenizer
from graphkiln.untrusted import show

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are a few KB; this only bounds what an artifact can make us compile
RENDER_SECONDS = 2.0  # real templates render in well under a millisecond of it; 8 MiB messages: TRANSFER_BYTES_PER_S
MAX_RENDER_CHARS = 1 << 24  # twice the largest request body; no artifact's context holds such a prompt
TRANSFER_BYTES_PER_S = 8 << 20  # added to the deadline for the messages' trip through the worker (~0.4 s for 8 MiB)
SPAWN_SECONDS = 30.0  # a worker's start (python and jinja2 imported), outside the render's deadline
IDLE_WORKERS = 4
# the variables render sets itself: a request's chat_template_kwargs may not replace them
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
FIX = "fix or remove the artifact's chat template (chat_template.jinja, or chat_template in tokenizer_config.json)"


class ChatTemplateError(GraphkilnError):
    """No usable chat template, or the template refused the messages (its raise_exception)."""


def _special(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return ""


@dataclass
class ChatTemplate:
    """A compiled chat template with the special tokens it may print, and the tokenizer that
    turns its output into ids (without adding special tokens: the template writes them)."""

    template: Any | None  # jinja2.Template; None when unusable (then ``problem`` says why)
    problem: str | None
    bos_token: str = ""
    eos_token: str = ""
    tokenizer: Tokenizer | None = None
    source: str | None = None  # the template's text, as GET /tokenizer_info hands it to clients

    @classmethod
    def load(cls, artifact_dir: Path, tokenizer_files: tuple[str, ...], tokenizer: Any | None = None) -> "ChatTemplate":
        """``tokenizer``: the artifact's tokenizer.json already loaded (the Engine's; else loaded here)."""
        config: dict = {}
        if CONFIG_FILE in tokenizer_files:
            try:
                loaded = json.loads((artifact_dir / CONFIG_FILE).read_text(encoding="utf-8"))
                config = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError, UnicodeDecodeError):
                config = {}
        source = problem = None
        if TEMPLATE_FILE in tokenizer_files:
            path = artifact_dir / TEMPLATE_FILE
            if path.stat().st_size > MAX_TEMPLATE_BYTES:
                problem = f"its {TEMPLATE_FILE} is over {MAX_TEMPLATE_BYTES} bytes"
            else:
                try:
                    source = path.read_text(encoding="utf-8")
                except (OSError, UnicodeDecodeError) as exc:
                    problem = f"its {TEMPLATE_FILE} cannot be read ({exc})"
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):  # named templates: [{"name": "default", "template": "..."}, ...]
                raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(raw, str):  # its size is from_source's to check
                source = raw
            elif raw is not None:
                problem = f"the chat_template in its {CONFIG_FILE} is not a template string"
        if source is None and problem is None:
            problem = f"it has neither {TEMPLATE_FILE} nor a chat_template in {CONFIG_FILE}"
        if tokenizer is None and "tokenizer.json" in tokenizer_files:
            tokenizer = Tokenizer(artifact_dir / "tokenizer.json")
        if tokenizer is None and problem is None:
            problem = "it has no tokenizer.json to encode the rendered prompt"
        bos, eos = _special(config.get("bos_token")), _special(config.get("eos_token"))
        if problem is not None:
            return cls(None, problem, bos, eos, tokenizer)
        return cls.from_source(source, tokenizer, bos, eos)

    @classmethod
    def from_source(cls, source: str, tokenizer: Tokenizer | None = None, bos_token: str = "",
                    eos_token: str = "") -> "ChatTemplate":
        """The template whose text is ``source``, compiled in the sandbox (``problem`` says why not)."""
        template, problem = None, None
        if len(source.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
            problem = f"its chat template is over {MAX_TEMPLATE_BYTES} bytes"
        else:
            try:
                template = template_sandbox.environment().from_string(source)
            except Exception as exc:  # jinja2.TemplateSyntaxError and anything else a hostile template triggers
                problem = f"its chat template does not compile ({type(exc).__name__}: {_one_line(exc)})"
        return cls(template, problem, bos_token, eos_token, tokenizer, source if template is not None else None)

    def render(self, messages: list[dict[str, Any]], *, seconds: float = RENDER_SECONDS,
               max_chars: int = MAX_RENDER_CHARS, variables: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (JSON-like: dicts, lists, strings, numbers) with the
        assistant's turn opened, rendered in a sandbox worker within ``seconds``, the worker's
        memory bound and ``max_chars`` characters; anything else is one ``ChatTemplateError``.
        ``variables``: more template variables, JSON-like (``tools``, ``enable_thinking``,
        ``reasoning_effort``: a request's ``chat_template_kwargs``); they never replace
        ``messages``, ``add_generation_prompt`` or the special tokens (``RESERVED``)."""
        if self.template is None:
            raise ChatTemplateError(f"this model has no usable chat template ({self.problem}): use /v1/completions "
                                    "with a prompt you format yourself, or export a checkpoint that has one")
        taken = sorted(RESERVED & set(variables or ()))
        if taken:
            raise ChatTemplateError(f"template variable {taken[0]!r} is the server's to set: leave it out of "
                                    "chat_template_kwargs")
        variables = dict(dict(tools=None, documents=None), **(variables or {}), messages=messages,
                         add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token)
        request = template_sandbox.encode_frame(dict(source=self.source, vars=variables, max_chars=max_chars,
                                                     seconds=seconds))
        # a reply is ASCII JSON: at most 12 bytes a character (an escaped surrogate pair), plus the frame
        reply = _Worker.call(request, seconds, 12 * max_chars + 4096)
        if reply == "late":
            raise ChatTemplateError(f"the chat template did not finish rendering these messages in {seconds:g} s "
                                    f"(it loops over too much, or without end): {FIX}")
        if reply == "died" or not isinstance(reply, dict):
            raise ChatTemplateError(f"the chat template's sandbox process ended while rendering these messages "
                                    f"(out of memory or CPU time): {FIX}")
        if isinstance(reply.get("text"), str):
            return reply["text"]
        if isinstance(reply.get("refused"), str):
            raise ChatTemplateError(f"the chat template refused the messages: {_one_line(reply['refused'])}")
        error = _one_line(reply.get("error"))
        if reply.get("bound"):
            raise ChatTemplateError(f"the chat template passed a bound on these messages ({error}): {FIX}")
        raise ChatTemplateError(f"the chat template failed on these messages ({error}): check the roles and their "
                                "order")

    def encode(self, messages: list[dict[str, Any]], variables: dict[str, Any] | None = None) -> list[int]:
        """The prompt's token ids, never none; the template already wrote any BOS, so none is added."""
        text = self.render(messages, variables=variables)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if not ids:  # the engine refuses an empty prompt too, but a batch of none is no refusal
            raise ChatTemplateError(f"the chat template rendered these messages as no tokens ({show(text)}): {FIX}")
        return ids


def _one_line(exc) -> str:
    """An untrusted text (a template's message, an error about it) as one quoted, clipped line."""
    return show(" ".join(str(exc).split()), 300)


class _Worker:
    """One sandbox worker process (``template_sandbox`` run as a script), serving one render at a
    time. Invariant: a worker in ``_idle`` is between requests (its last reply read in full);
    one that was late, died, or passed a bound is killed, never reused."""

    _idle: list["_Worker"] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        # a session of its own: the terminal's Ctrl-C is the parent's (it cancels a reply), and
        # the parent kills this process whenever it is not wanted
        self.proc = subprocess.Popen([sys.executable, "-I", template_sandbox.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        if self._read(time.monotonic() + SPAWN_SECONDS, 64) != {"ready": True}:
            self.kill()
            raise ChatTemplateError(f"the chat template's sandbox process ({sys.executable} -I "
                                    f"{template_sandbox.__file__}) did not start: check that this Python can run it "
                                    "(jinja2 installed)")

    @classmethod
    def call(cls, request: bytes, seconds: float, limit: int) -> dict | str:
        """The reply to ``request`` from an idle worker (or a new one), or "late" (no full reply
        within ``seconds`` and the request's transfer time) or "died" (it ended, or its reply
        frame is over ``limit`` bytes)."""
        with cls._lock:
            worker = cls._idle.pop() if cls._idle else None
        if worker is None or worker.proc.poll() is not None:
            worker = cls()
        # the messages go to the worker and come back rendered: time in proportion to their size,
        # which no template controls, is added so a long legitimate message is never "late"
        deadline = time.monotonic() + seconds + len(request) / TRANSFER_BYTES_PER_S
        reply = "died"
        try:
            worker._write(request)
            reply = worker._read(deadline, limit)
        except (BrokenPipeError, ValueError):
            reply = "died"
        finally:
            if isinstance(reply, dict) and not reply.get("bound"):
                with cls._lock:
                    if len(cls._idle) < IDLE_WORKERS:
                        cls._idle.append(worker)
                        worker = None
            if worker is not None:
                worker.kill()
        return reply

    def _write(self, data: bytes) -> None:
        view, fd = memoryview(data), self.proc.stdin.fileno()
        while view:
            view = view[os.write(fd, view):]

    def _read(self, deadline: float, limit: int) -> dict | str:
        fd = self.proc.stdout.fileno()
        poll = select.poll()  # not select(): a server's descriptors may be numbered past FD_SETSIZE
        poll.register(fd, select.POLLIN)
        buf, need = bytearray(), template_sandbox.HEADER.size
        while len(buf) < need:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not poll.poll(remaining * 1000):
                return "late"
            chunk = os.read(fd, min(need - len(buf), 1 << 20))
            if not chunk:
                return "died"
            buf += chunk
            if need == template_sandbox.HEADER.size and len(buf) == need:
                (size,) = template_sandbox.HEADER.unpack(buf)
                if size > limit:
                    return "died"
                need += size
        try:
            return json.loads(bytes(buf[template_sandbox.HEADER.size:]))
        except ValueError:
            return "died"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    @classmethod
    def close_all(cls) -> None:
        with cls._lock:
            idle, cls._idle = cls._idle, []
        for worker in idle:
            worker.kill()


atexit.register(_Worker.close_all)
# a forked child must not share its parent's workers (two processes on one pipe); it starts its own
os.register_at_fork(after_in_child=lambda: setattr(_Worker, "_idle", []))
