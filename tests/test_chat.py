"""``graphkiln chat`` and ``graphkiln run --chat`` (graphkiln/chat.py).

The artifact is the tokenizer case (tiny Llama, byte-level BPE, bos <s>, eos </s>) with a chat
template added to a private copy, listed and hashed in its manifest as an export writes it (as
tests/test_serve.py does). References are greedy generations through the Python API from the
same conversations rendered with the same template (``ChatTemplate.encode``: the rendering's ids,
no BOS added). Piped sessions run the CLI in-process with stdin replaced; Ctrl-C runs it in a
subprocess on a pseudo-terminal (Linux: it reads the child's /proc entry).
"""

from __future__ import annotations

import io
import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphkiln.chat import Conversation, stream_reply
from graphkiln.publish import Interrupted, interrupt_arrived, termination_signals_interrupt
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.chat_template import ChatTemplate

from cli_contract import assert_one_error, run_cli
from conftest import add_chat_template

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
NEW = 8  # tokens per reply: two turns and their replies stay inside the artifact's 128 positions
GREEDY = ("--max-new-tokens", str(NEW), "--temperature", "0")


def _add_template(art: Path) -> Path:
    return add_chat_template(art, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def artifact(tok_case, tmp_path_factory) -> Path:
    art = tmp_path_factory.mktemp("chat") / "artifact"
    shutil.copytree(tok_case.artifact, art)
    return _add_template(art)


@pytest.fixture(scope="module")
def engine(artifact) -> Engine:
    return Engine.load(artifact)


@pytest.fixture(scope="module")
def template(artifact, engine) -> ChatTemplate:
    tpl = ChatTemplate.load(artifact, tuple(engine.manifest.tokenizer_files), tokenizer=engine.tokenizer)
    assert tpl.problem is None, tpl.problem
    return tpl


def _greedy(engine, template, messages, config: GenerationConfig | None = None) -> str:
    config = config or GenerationConfig(max_new_tokens=NEW, do_sample=False)
    (result,) = engine.generate(template.encode(messages), config)
    return result.text


def _user(text):
    return {"role": "user", "content": text}


def _assistant(text):
    return {"role": "assistant", "content": text}


def _chat(capsys, monkeypatch, art, stdin: bytes, *flags):
    """``graphkiln chat ART --max-new-tokens NEW --temperature 0 FLAGS`` with ``stdin`` piped in."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    return run_cli(capsys, "chat", art, *GREEDY, *flags)


@pytest.mark.parametrize("system", [None, "be brief"])
def test_piped_turns_equal_greedy_generation_of_the_rendered_conversation(capsys, monkeypatch, artifact, engine,
                                                                          template, system):
    head = [{"role": "system", "content": system}] if system else []
    first = _greedy(engine, template, head + [_user("hi")])
    second = _greedy(engine, template, head + [_user("hi"), _assistant(first), _user("who are you")])
    # the second turn must depend on the first, or this test could not tell a carried conversation from none
    assert second != _greedy(engine, template, head + [_user("who are you")])
    code, out, err = _chat(capsys, monkeypatch, artifact, b"hi\nwho are you\n",
                           *(("--system", system) if system else ()))
    assert (code, err) == (0, "")
    assert out == f"{first}\n{second}\n"


def test_reset_makes_the_next_turn_a_fresh_first_turn(capsys, monkeypatch, artifact, engine, template):
    first = _greedy(engine, template, [_user("hi")])
    assert _greedy(engine, template, [_user("hi"), _assistant(first), _user("hi")]) != first  # reset is visible
    code, out, err = _chat(capsys, monkeypatch, artifact, b"hi\n/reset\nhi\n")
    assert (code, out, err) == (0, f"{first}\n{first}\n", "")


def test_reset_keeps_the_system_message(capsys, monkeypatch, artifact, engine, template):
    system = [{"role": "system", "content": "be brief"}]
    first = _greedy(engine, template, system + [_user("hi")])
    assert first != _greedy(engine, template, [_user("hi")])
    code, out, _ = _chat(capsys, monkeypatch, artifact, b"hi\n/reset\nhi\n", "--system", "be brief")
    assert (code, out) == (0, f"{first}\n{first}\n")


@pytest.mark.parametrize("stdin,turns", [(b"hi\n/exit\nwho are you\n", 1), (b"hi", 1), (b"", 0), (b"\n  \n", 0)])
def test_exit_and_end_of_input_leave_with_status_0(capsys, monkeypatch, artifact, engine, template, stdin, turns):
    first = _greedy(engine, template, [_user("hi")])
    code, out, err = _chat(capsys, monkeypatch, artifact, stdin)
    assert (code, out, err) == (0, f"{first}\n" * turns, "")


def test_double_slash_sends_a_slash_and_unknown_commands_are_refused(capsys, monkeypatch, artifact, engine,
                                                                    template):
    code, out, _ = _chat(capsys, monkeypatch, artifact, b"//hi\n")
    assert (code, out) == (0, _greedy(engine, template, [_user("/hi")]) + "\n")
    first = _greedy(engine, template, [_user("hi")])
    code, out, err = _chat(capsys, monkeypatch, artifact, b"hi\n/rset\nwho\n")
    assert out == f"{first}\n"  # the turn before the bad line was answered, nothing after it
    assert_one_error(code, err, "line 2", "unknown command '/rset'", "/reset", alone=True)


def test_bad_lines_and_overlong_conversations_are_one_error(capsys, monkeypatch, artifact):
    code, out, err = _chat(capsys, monkeypatch, artifact, b"caf\xe9\n")
    assert out == ""
    assert_one_error(code, err, "line 1 of standard input is not UTF-8", "iconv", alone=True)
    code, out, err = _chat(capsys, monkeypatch, artifact, b"word " * 200 + b"\n")
    assert out == ""
    assert_one_error(code, err, "the conversation is", "at most 128", "/reset", alone=True)


@pytest.mark.parametrize("stdin,needle", [
    (b"a" * (10 << 20) + b"\n", "line 1 of standard input is over"),  # a 10 MB line
    (b"hi\n" + b"a" * (10 << 20), "line 2 of standard input is over"),  # no newline at all
    (b"\xff\xfe" * (5 << 20) + b"\n", "line 1 of standard input is over"),  # binary: bounded before decoding
    (b"a" * (1 << 20) + b"\xe9\n", "line 1 of standard input is over"),  # one byte past the bound
])
def test_a_long_input_line_is_refused_after_reading_the_bound(capsys, monkeypatch, artifact, engine, template, stdin,
                                                              needle):
    """Piped input is read a bounded line at a time: a line over MAX_LINE_BYTES (1 MiB), however
    it ends, is one error, and no more than the bound and a byte of it was read (a 10 MB line
    was read whole, then rendered and tokenized at ~2 GB, before the conversation's length
    refused it)."""
    from graphkiln.chat import MAX_LINE_BYTES

    first = _greedy(engine, template, [_user("hi")]) + "\n" if stdin.startswith(b"hi\n") else ""
    raw = io.BytesIO(stdin)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(raw, encoding="utf-8"))
    code, out, err = run_cli(capsys, "chat", artifact, *GREEDY)
    assert out == first
    assert_one_error(code, err, needle, f"{MAX_LINE_BYTES} bytes", alone=True)
    assert raw.tell() <= len(b"hi\n") + MAX_LINE_BYTES + 1 + io.DEFAULT_BUFFER_SIZE


@pytest.mark.parametrize("line,needles", [
    (b"/reset extra", ("/reset takes no arguments (got 'extra')", "type /reset alone")),
    (b"/exit now", ("/exit takes no arguments (got 'now')", "type /exit alone")),
    (b"  /reset\tall of it ", ("/reset takes no arguments (got 'all of it')",)),
    (b"/exit /reset", ("/exit takes no arguments (got '/reset')",)),
    (b"/rset now", ("unknown command '/rset':", "the commands are /reset, /exit")),  # unknown, named alone
])
def test_a_command_given_arguments_is_refused_by_its_name(capsys, monkeypatch, artifact, engine, template, line,
                                                          needles):
    """Each command takes no arguments: one given some is refused as that command with those
    arguments (it was "unknown command '/reset'"), the turn before it answered, nothing after."""
    first = _greedy(engine, template, [_user("hi")])
    code, out, err = _chat(capsys, monkeypatch, artifact, b"hi\n" + line + b"\nwho\n")
    assert out == f"{first}\n"
    assert_one_error(code, err, "line 2", *needles, alone=True)


@pytest.mark.parametrize("source,command", [("", "chat"), ("{% if false %}x{% endif %}", "chat"),
                                            ("{% for m in messages %}{% endfor %}", "run")])
def test_a_template_rendering_no_tokens_is_one_error(capsys, monkeypatch, tok_case, artifact_copy, source, command):
    """A template that renders these messages as nothing: chat refused it as run --chat and serve do
    (it printed an empty reply for every line, status 0)."""
    art = add_chat_template(artifact_copy(tok_case), source)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\nagain\n")))
    extra = ("--prompt", "hi", "--chat") if command == "run" else ()
    code, out, err = run_cli(capsys, command, art, *extra, *GREEDY)
    assert out == ""
    assert_one_error(code, err, "rendered these messages as no tokens", "chat_template.jinja", alone=True)


# -- the chat template's bounds (graphkiln/runtime/request/template_sandbox.py) ---------------------

HOSTILE_TEMPLATES = [  # each either renders gigabytes, or takes minutes to hours, outside a bound
    "{{ 'x' * 100000000 }}",
    "{{ [0] * 1000000000 }}",
    "{{ 10 ** 100000000 }}",
    "{{ messages|tojson(indent=100000000) }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 'x'|indent(1000000000, true) }}",
    "{{ '%9999999999d'|format(1) }}",
    "{{ ('%(a)9999s' * 99999) % {'a': 1} }}",
    "{{ '{:>1000000000}'.format(1) }}",
    "{{ (range(99999)|batch(1)|list)|sum(start=[]) }}",
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set r = range(99999) %}{% for i in r %}{% for j in r %}{{ '' }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for c in m['content'] %}{% for d in m['content'] %}{% endfor %}{% endfor %}{% endfor %}",
    "{% for i in range(99999) %}{% for j in range(999) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}{% endfor %}",
    "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "{% macro f(n) %}{% if n < 6 %}{% for i in range(99) %}{{ f(n + 1) }}{% endfor %}{% endif %}{% endmacro %}{{ f(0) }}",
]


@pytest.mark.parametrize("source", HOSTILE_TEMPLATES)
def test_a_hostile_template_is_one_error_within_its_bounds(template, source):
    """The sweep of issue 37's resource bombs (multiplication, **, widths of tojson/center/indent/
    format/%/str.format, sum over lists, nested loops over ranges and over a long message,
    doubling, recursion, many small pieces): each is one ChatTemplateError within the deadline
    (plus a worker's start), the parent process grows by no more than a few MB, and the next
    render works. Before, each either allocated gigabytes in the caller or never returned."""
    import resource

    from graphkiln.runtime.request.chat_template import ChatTemplateError

    hostile = ChatTemplate.from_source(source, template.tokenizer)
    assert hostile.problem is None, hostile.problem  # compiling evaluates nothing
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as err:
        hostile.render([_user("x" * 100_000)], seconds=0.5)
    took = time.monotonic() - start
    message = str(err.value)
    assert "\n" not in message and "chat_template.jinja" in message, message
    assert took < 0.5 + 5, (took, message)  # the deadline, and a new worker's start on a busy machine
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 << 10, message  # KiB
    assert template.render([_user("hi")]) == "<s><|user|>hi</s><|assistant|>"


def test_an_ordinary_render_is_exact_and_its_refusals_are_the_templates(template):
    """What a template may do within its bounds is unchanged: a long message renders whole, the
    template's raise_exception is its own message, a sandbox violation names itself."""
    from graphkiln.runtime.request.chat_template import ChatTemplateError

    long = "é\ud800" + "w" * (4 << 20)  # a lone surrogate, as a request's JSON may hold, survives
    assert template.render([_user(long)]) == f"<s><|user|>{long}</s><|assistant|>"
    refusing = ChatTemplate.from_source("{{ raise_exception('roles must alternate\n\\x1b[31m') }}")
    with pytest.raises(ChatTemplateError, match=r"refused the messages: 'roles must alternate \\x1b\[31m'"):
        refusing.render([_user("hi")])
    with pytest.raises(ChatTemplateError, match="SecurityError"):
        ChatTemplate.from_source("{{ messages.append(1) }}").render([_user("hi")])


def _without_tokenizer(art: Path) -> Path:
    """``art`` as an export of a checkpoint without tokenizer files writes it."""
    manifest = json.loads((art / "manifest.json").read_text())
    for name in manifest["tokenizer_files"]:
        (art / name).unlink()
        del manifest["files"][name]
    manifest["tokenizer_files"] = []
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


@pytest.mark.parametrize("command", ["chat", "run"])
def test_an_artifact_without_a_template_or_a_tokenizer_is_one_error(capsys, monkeypatch, tok_case, artifact_copy,
                                                                    command):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"hi\n")))
    extra = ("--prompt", "hi", "--chat") if command == "run" else ()
    code, out, err = run_cli(capsys, command, tok_case.artifact, *extra)  # tokenizer_config.json has no template
    assert out == ""
    assert_one_error(code, err, "no usable chat template", "chat_template.jinja", alone=True)
    code, out, err = run_cli(capsys, command, _without_tokenizer(artifact_copy(tok_case)), *extra)
    assert out == ""
    assert_one_error(code, err, "no tokenizer (tokenizer.json)", "--prompt-ids", alone=True)


@pytest.mark.parametrize("system", [None, "be brief"])
def test_run_chat_equals_generating_from_the_rendered_prompt(capsys, artifact, engine, template, system):
    head = [{"role": "system", "content": system}] if system else []
    want = _greedy(engine, template, head + [_user("hi")])
    assert want != _greedy(engine, template, [_user("hi")]) or not system
    code, out, err = run_cli(capsys, "run", artifact, "--prompt", "hi", "--chat", *GREEDY,
                             *(("--system", system) if system else ()))
    assert (code, out, err) == (0, want + "\n", "")
    # without --chat the same text is a plain prompt (with the tokenizer's BOS): another reply
    code, out, _ = run_cli(capsys, "run", artifact, "--prompt", "hi", *GREEDY)
    assert code == 0 and out != want + "\n"


def test_run_chat_flag_combinations_are_refused(capsys, artifact):
    code, _, err = run_cli(capsys, "run", artifact, "--prompt", "hi", "--system", "be brief")
    assert_one_error(code, err, "--system", "--chat", alone=True)
    code, _, err = run_cli(capsys, "run", artifact, "--prompt-ids", "5,6", "--chat")
    assert_one_error(code, err, "--prompt-ids", "--chat", alone=True)


# -- Ctrl-C while a reply streams --------------------------------------------------------------


def _pieces(engine, ids, config) -> list[str]:
    return [e.text for e in engine.stream(ids, config) if e.text]


@pytest.fixture
def terminal_sigint():
    """SIGINT at Python's default handler, as in a `graphkiln chat` started from a terminal (and
    inherited by the child the pty test starts: an ignored signal stays ignored across exec). A
    full test run's worker has been seen holding SIGINT ignored by the time these tests ran, which
    made Ctrl-C a no-op here; which earlier test leaves it so is not known yet."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("at", [1, 3])
def test_ctrl_c_while_writing_a_reply_cancels_it_and_frees_the_engine(engine, template, at, terminal_sigint):
    """Ctrl-C reaching the loop while it prints a reply (where a terminal's Ctrl-C lands): the reply
    ends there, the stream is closed (the engine takes the next call at once: an open stream would
    hold it, BUSY) and the interruption is forgotten (a later error stays that error)."""
    ids = template.encode([_user("hi")])
    config = GenerationConfig(max_new_tokens=16, do_sample=False, stop_token_ids=())
    pieces = _pieces(engine, ids, config)
    assert len(pieces) > at
    written: list[str] = []

    def write(text: str) -> None:
        written.append(text)
        if len(written) == at:
            signal.raise_signal(signal.SIGINT)  # through the CLI's handler, which records it

    with termination_signals_interrupt():
        try:
            reply = stream_reply(engine, ids, config, write)
        except KeyboardInterrupt:  # reported as this test's failure, not as pytest's own Ctrl-C
            pytest.fail("Ctrl-C while the reply was written escaped stream_reply")
        assert interrupt_arrived() is None
    assert reply.cancelled and reply.finish_reason is None
    assert reply.text == "".join(pieces[:at]) and written == pieces[:at]
    assert _pieces(engine, ids, config) == pieces  # free, and nothing of the cancelled reply left behind


def test_sigterm_while_a_reply_streams_is_no_cancel(engine, template):
    """SIGTERM/SIGHUP raise Interrupted, a KeyboardInterrupt too: they end the command, after the
    stream is closed."""
    ids = template.encode([_user("hi")])
    config = GenerationConfig(max_new_tokens=16, do_sample=False, stop_token_ids=())

    def write(text: str) -> None:
        raise Interrupted(signal.SIGTERM)

    with pytest.raises(Interrupted):
        stream_reply(engine, ids, config, write)
    assert _pieces(engine, ids, config)  # the engine was released


def test_conversation_keeps_system_and_alternation():
    c = Conversation("sys")
    c.add("a", "b")
    assert c.messages("c") == [{"role": "system", "content": "sys"}, _user("a"), _assistant("b"), _user("c")]
    c.reset()
    assert c.messages() == [{"role": "system", "content": "sys"}]
    assert Conversation("").messages("x") == [_user("x")]


_WRITE_SYSCALL = {"x86_64": 1, "aarch64": 64}.get(platform.machine())


def _main_thread_syscall(pid: int) -> int | None:
    try:
        first = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(first) if first.lstrip("-").isdigit() else None


@pytest.mark.skipif(not sys.platform.startswith("linux") or _WRITE_SYSCALL is None,
                    reason="reads the child's system call from Linux's /proc/PID/syscall (x86_64, aarch64)")
def test_ctrl_c_on_a_terminal_cancels_the_reply_and_keeps_it_in_the_conversation(artifact, engine, template,
                                                                                terminal_sigint):
    """The real thing on a pseudo-terminal, made deterministic by the terminal's flow control:
    Ctrl-S (XOFF) stops the terminal's output before the message is typed, so the child blocks in
    its first write of the reply; once /proc shows it there, Ctrl-C is typed. The line discipline
    turns it into SIGINT for the foreground group and restarts the output. The session must then
    print the cancel notice, come back to the prompt, and answer the next message from a
    conversation that holds the cut reply (some non-empty prefix of the full one): not the full
    reply, not a dropped one. readline is kept out of the child (sys.modules) because readline
    echoes typed keys itself, which would block on the stopped terminal before the reply."""
    import fcntl
    import pty
    import termios

    if _main_thread_syscall(os.getpid()) is None:
        pytest.skip("/proc/PID/syscall is not readable here")
    config = GenerationConfig(max_new_tokens=16, do_sample=False, stop_token_ids=())
    pieces = _pieces(engine, template.encode([_user("hello")]), config)
    assert len(pieces) > 2
    prefixes = ["".join(pieces[:k]) for k in range(1, len(pieces))]
    kept = {_greedy(engine, template, [_user("hello"), _assistant(p), _user("again")], config) for p in prefixes}
    others = {_greedy(engine, template, [_user("hello"), _assistant("".join(pieces)), _user("again")], config),
              _greedy(engine, template, [_user("hello"), _user("again")], config)}
    assert not kept & others, "the cut, full and dropped replies must lead to different next replies"

    master, slave = pty.openpty()
    attrs = termios.tcgetattr(slave)
    attrs[0] |= termios.IXON
    attrs[3] |= termios.ISIG | termios.ICANON | termios.ECHO
    termios.tcsetattr(slave, termios.TCSANOW, attrs)

    def controlling_terminal():
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    code = ("import sys; sys.modules['readline'] = None; from graphkiln.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    child = subprocess.Popen([sys.executable, "-c", code, "chat", str(artifact), "--max-new-tokens", "16",
                              "--temperature", "0", "--ignore-eos"], stdin=slave, stdout=slave, stderr=slave,
                             preexec_fn=controlling_terminal, close_fds=True)
    os.close(slave)
    seen = bytearray()

    def read_until(needle: bytes, start: int, timeout: float = 120.0) -> int:
        deadline = time.monotonic() + timeout
        while (at := seen.find(needle, start)) < 0:
            assert time.monotonic() < deadline, f"no {needle!r} after {bytes(seen[start:])!r}"
            if select.select([master], [], [], 0.2)[0]:
                try:
                    seen.extend(os.read(master, 4096))
                except OSError:  # EIO: the child closed the terminal
                    if seen.find(needle, start) < 0:
                        pytest.fail(f"the child left (status {child.wait()}) before {needle!r}: {bytes(seen)!r}")
        return at + len(needle)

    try:
        at = read_until(b"> ", 0)
        os.write(master, b"\x13")  # XOFF: output stops; the echo of the line below waits with it
        os.write(master, b"hello\n")
        deadline = time.monotonic() + 120
        while _main_thread_syscall(child.pid) != _WRITE_SYSCALL:
            assert child.poll() is None and time.monotonic() < deadline, bytes(seen)
            time.sleep(0.02)
        os.write(master, b"\x03")
        at = read_until(b"[reply cancelled]", at)
        at = read_until(b"> ", at)
        os.write(master, b"again\n")
        at = read_until(b"again\r\n", at)
        end = read_until(b"\r\n> ", at)
        reply = bytes(seen[at:end - len(b"\r\n> ")]).decode().replace("\r\n", "\n")
        os.write(master, b"/exit\n")
        assert child.wait(timeout=60) == 0, bytes(seen)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        os.close(master)
    assert b"error:" not in seen, bytes(seen)
    assert reply in kept, (reply, kept)
