"""``graphkiln chat``: a multi-turn conversation in the terminal over an artifact's chat template.

The CLI's front end for chat: ``graphkiln.cli`` parses the arguments, loads the engine and calls
``run_chat``; ``graphkiln run --chat`` uses ``load_template`` and ``Conversation`` for its one
message. The template itself is ``graphkiln.runtime.request.chat_template`` (shared with the
server's chat route).

Every turn renders the WHOLE conversation so far (system, user and assistant turns, the
assistant's turn opened) and sends it to the one ``Engine`` as a single prompt; the engine's
prefix reuse makes the turns it has already seen cost a copy, not a prefill. The prompt is the
rendering's token ids, encoded without special tokens (as the server's chat route does): the
template writes any BOS itself, and a text prompt would get the tokenizer's BOS a second time.

Input, one line a user turn:

- standard input a terminal: a ``> `` prompt (line editing by ``readline`` where Python has it),
  a one-line hint on stderr at the start, notices on stderr. Ctrl-C while a reply streams
  cancels the reply and returns to the prompt; Ctrl-C at the prompt leaves as any command
  interrupted does (status 130). An error in one turn (the conversation outgrew the artifact,
  the template refused it) is printed as an ``error:`` line and the turn is dropped.
- anything else (a pipe, a file): no prompt, no hints; each reply on stdout followed by a
  newline. An error ends the command (one ``error:`` line, status 2), as for any command.
  SIGINT while a reply streams cancels it here too; while a line is read it ends the command.

``/reset`` forgets the conversation (``--system`` stays), ``/exit`` or end of input leaves with
status 0, ``//text`` sends ``/text``; any other line starting with ``/`` is refused (a notice on
a terminal, an error otherwise): a command given arguments (it takes none) or an unknown
command, so a mistyped command never reaches the model. A line is at most ``MAX_LINE_BYTES``:
a longer one (with or without its newline) is refused after reading that much of it, never
read whole; and a turn whose template renders no tokens is refused, never sent as a prompt of
none.

A cancelled reply is kept in the conversation, cut where it was cancelled: what the user saw is
what the model said (as chat front ends that stop a reply keep it), the next turn's prompt still
starts with the blocks the engine has cached, and the roles keep alternating, which many
templates insist on (a dropped reply would put two user turns in a row). On a terminal it is
marked ``[reply cancelled]`` on stderr.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, TextIO

from graphkiln.errors import GraphkilnError
from graphkiln.publish import Interrupted, forget_interrupts
from graphkiln.runtime.request.chat_template import ChatTemplate
from graphkiln.untrusted import show

if TYPE_CHECKING:
    from graphkiln.runtime import Engine, GenerationConfig

PROMPT = "> "
HINT = "/reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops a reply"
COMMANDS = ("/reset", "/exit")
MAX_LINE_BYTES = 1 << 20  # a message; tokenizing costs ~100x its size in memory, and 1 MiB outgrows most contexts


def load_template(engine: Engine) -> ChatTemplate:
    """The chat template of ``engine``'s artifact, usable (``problem`` None) and with a tokenizer;
    otherwise a GraphkilnError naming what is missing and the way out. Read after ``Engine.load``,
    so every file it reads has been checked against the manifest."""
    art = engine.artifact_dir
    if engine.tokenizer is None:
        raise GraphkilnError(f"{art} has no tokenizer (tokenizer.json), which chat needs to encode the conversation "
                             "and decode replies: export a checkpoint directory that has its tokenizer files, or "
                             "use 'graphkiln run --prompt-ids' without --chat")
    template = ChatTemplate.load(art, tuple(engine.manifest.tokenizer_files), tokenizer=engine.tokenizer)
    if template.problem is not None:
        raise GraphkilnError(f"{art} has no usable chat template ({template.problem}): export a checkpoint whose "
                             "tokenizer has one (chat_template.jinja or a chat_template in tokenizer_config.json), "
                             "or use 'graphkiln run --prompt' without --chat and format the prompt yourself")
    return template


@dataclass
class Conversation:
    """The messages rendered each turn.

    Invariant: ``turns`` alternate user and assistant messages, starting with a user one, and
    between turns end with an assistant one (possibly a reply cut short by Ctrl-C) or are
    empty. ``system`` (empty or None: no system message) survives ``reset``."""

    system: str | None = None
    turns: list[dict[str, str]] = field(default_factory=list)

    def messages(self, user: str | None = None) -> list[dict[str, str]]:
        """The conversation so far as the template takes it, with ``user`` as the next turn."""
        head = [{"role": "system", "content": self.system}] if self.system else []
        tail = [{"role": "user", "content": user}] if user is not None else []
        return head + self.turns + tail

    def add(self, user: str, reply: str) -> None:
        self.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]

    def reset(self) -> None:
        self.turns.clear()


@dataclass(frozen=True)
class Reply:
    """One streamed reply: its text (as far as it streamed), its token count, how it ended
    (the engine's finish reason, or None when ``cancelled``)."""

    text: str
    tokens: int
    finish_reason: str | None
    cancelled: bool


def stream_reply(engine: Engine, prompt_ids: list[int], config: GenerationConfig,
                 write: Callable[[str], None]) -> Reply:
    """Stream the reply to ``prompt_ids``, handing each event's non-empty text to ``write`` as it
    comes. Ctrl-C (a plain KeyboardInterrupt) while it streams cancels it and returns what came
    before, ``cancelled``. Whatever happens the stream is closed before this returns or raises,
    so the engine holds no slot and is free for the next turn. SIGTERM/SIGHUP (``Interrupted``,
    a KeyboardInterrupt too) and every other exception propagate: they end the command."""
    stream = engine.stream(prompt_ids, config)
    parts: list[str] = []
    tokens, finish = 0, None
    try:
        for event in stream:
            if event.token_id >= 0:  # -1: an event that carries no token
                tokens += 1
            finish = event.finish_reason or finish
            if event.text:
                parts.append(event.text)  # before writing: a Ctrl-C inside the write keeps the piece
                write(event.text)
    except Interrupted:
        raise
    except KeyboardInterrupt:
        forget_interrupts()  # handled here: a later error of this session is not reported as an interruption
        return Reply("".join(parts), tokens, None, cancelled=True)
    finally:
        # a Ctrl-C inside the engine has already ended the generator; one inside write (or any
        # other exception there) leaves it suspended, holding its slot and the engine, until closed
        stream.close()
    return Reply("".join(parts), tokens, finish, cancelled=False)


def run_chat(engine: Engine, template: ChatTemplate, config: GenerationConfig, system: str | None = None,
             stdin: TextIO | None = None, interactive: bool | None = None) -> int:
    """The chat session over ``engine`` (loaded once, kept for every turn) until /exit or end of
    input; returns the exit status (0). ``stdin`` defaults to ``sys.stdin``; ``interactive`` to
    whether it is a terminal. Replies go to ``sys.stdout`` as looked up at each write (the CLI's
    guarded stdout: a closed pipe ends the session as for any command)."""
    stdin = sys.stdin if stdin is None else stdin
    if stdin is None:  # started with stdin closed (<&-): no input, nothing to do
        return 0
    interactive = _isatty(stdin) if interactive is None else interactive
    conversation = Conversation(system or None)
    if interactive:
        _use_readline()
        _notice(f"chat with {engine.artifact_dir.name}: {HINT}")
    lines = _terminal_lines() if interactive else _piped_lines(stdin)
    for number, line in lines:
        text = line.strip()
        if not text:
            continue
        if text.startswith("/") and not text.startswith("//"):
            command, *arguments = text.split(maxsplit=1)
            refusal = _command_refusal(command, arguments)
            if refusal is not None:
                if not interactive:
                    raise GraphkilnError(f"line {number} of standard input: {refusal}")
                _notice(refusal)
                continue
            if command == "/exit":
                return 0
            conversation.reset()
            if interactive:
                _notice("(conversation reset)")
            continue
        if text.startswith("//"):
            text = text[1:]
        try:
            _turn(engine, template, config, conversation, text, interactive)
        except GraphkilnError as exc:
            if not interactive:
                raise
            print(f"error: {exc}", file=sys.stderr, flush=True)  # the turn is dropped; the session goes on
    if interactive:
        print(flush=True)  # Ctrl-D leaves the cursor after the prompt: the shell's starts on a fresh line
    return 0


def _command_refusal(command: str, arguments: list[str]) -> str | None:
    """Why a line starting with one ``/`` (``command`` its first word) is no command, or None."""
    if command not in COMMANDS:
        return (f"unknown command {show(command)}: the commands are {', '.join(COMMANDS)}; start a message with // "
                "to send one beginning with /")
    if arguments:
        return f"{command} takes no arguments (got {show(arguments[0])}): type {command} alone"
    return None


def _turn(engine: Engine, template: ChatTemplate, config: GenerationConfig, conversation: Conversation, text: str,
          interactive: bool) -> None:
    """One user turn: the whole conversation rendered and streamed; the exchange is added to
    ``conversation`` only once its reply ended (completed or cancelled), so a refused turn
    leaves the conversation as it was."""
    ids = template.encode(conversation.messages(text))
    if len(ids) >= engine.max_seq_len:
        raise GraphkilnError(f"the conversation is {len(ids)} tokens with this message, and the artifact holds at "
                             f"most {engine.max_seq_len}: /reset to start a new one (or re-export with a larger "
                             "--max-seq-len)")
    reply = stream_reply(engine, ids, config, _write)
    _write("\n")
    conversation.add(text, reply.text)
    if not interactive:
        return
    if reply.cancelled:
        _notice("[reply cancelled]")
    elif reply.finish_reason == "length" and len(ids) + reply.tokens >= engine.max_seq_len:
        _notice(f"[reply cut: the conversation reached the artifact's {engine.max_seq_len} tokens; /reset to start "
                "a new one]")


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()  # each piece shows as it comes, on a terminal or a pipe


def _notice(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _isatty(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):  # a closed or file-less stream is no terminal
        return False


def _use_readline() -> None:
    """Line editing and history for ``input()`` where Python has readline (not on every build)."""
    try:
        import readline  # noqa: F401  (importing it is what makes input() use it)
    except ImportError:
        pass


def _terminal_lines() -> Iterator[tuple[int, str]]:
    """Lines typed at the prompt, numbered from 1, until Ctrl-D. Ctrl-C at the prompt propagates
    (the command ends as interrupted), after ending the prompt's line."""
    number = 0
    while True:
        try:
            line = input(PROMPT)
        except EOFError:
            return
        except KeyboardInterrupt:
            print(file=sys.stderr, flush=True)  # "> ^C" stays on its own line, before "error: interrupted"
            raise
        except UnicodeDecodeError:
            _notice("that line is not UTF-8 text: type it again (check the terminal's encoding)")
            continue
        if len(line.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
            _notice(f"that line is over {MAX_LINE_BYTES} bytes: send a shorter message")
            continue
        number += 1
        yield number, line


def _piped_lines(stdin: TextIO) -> Iterator[tuple[int, str]]:
    """Lines of a non-terminal stdin, numbered from 1, decoded as UTF-8 whatever the locale (a line
    that is not, or is over ``MAX_LINE_BYTES``: GraphkilnError naming it, at most that much of it
    read). Read one at a time: a reply is printed before the next line is read, so a program on
    the other end of two pipes can converse."""
    raw = getattr(stdin, "buffer", None)
    number = 0
    while True:
        # one byte over the bound tells a line at the bound (its newline read) from a longer one
        line = raw.readline(MAX_LINE_BYTES + 1) if raw is not None else stdin.readline(MAX_LINE_BYTES + 1)
        if not line:
            return
        number += 1
        body = line[:-1] if line[-1:] in (b"\n", "\n") else line
        if len(body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
            raise GraphkilnError(f"line {number} of standard input is over {MAX_LINE_BYTES} bytes: send shorter "
                                 "messages (chat takes one message a line)")
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise GraphkilnError(f"line {number} of standard input is not UTF-8 text (byte 0x{line[exc.start]:02x} "
                                     f"at byte {exc.start}): convert it, e.g. with iconv -t UTF-8") from None
        yield number, line.rstrip("\r\n")

