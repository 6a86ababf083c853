"""The CLI's second hardening round: bounded thread counts, signals at any moment of a run, a
closed or full standard output, text that is not UTF-8, token-id lists, a reference of another
vocabulary, and commands that need an extra the install lacks (in a real runtime-only venv).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from cli_contract import assert_one_error, run_cli
from conftest import SPECS, build_checkpoint
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import GenerationConfig
from graphkiln.threads import usable_cpus

REPO = Path(__file__).resolve().parents[1]
GRAPHKILN = [sys.executable, "-m", "graphkiln.cli"]


def _cli(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*GRAPHKILN, *map(str, argv)], capture_output=True, text=True, timeout=120, **kw)


# -- thread counts ---------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["run", "serve", "chat"])
@pytest.mark.parametrize("threads", ["cpus+1", "100000"])
def test_every_thread_flag_is_bounded_by_the_usable_cpus(llama_case, capsys, command, threads):
    threads = str(usable_cpus() + 1) if threads == "cpus+1" else threads
    extra = {"run": ["--prompt-ids", "1,2"], "serve": ["--port", "0"], "chat": []}[command]
    code, out, err = run_cli(capsys, command, llama_case.artifact, "--threads", threads, *extra)
    assert_one_error(code, err, f"threads {threads}", f"1..{usable_cpus()}", "omit it")


def test_sigterm_ends_a_run_at_any_moment_within_seconds(llama_case):
    """SIGTERM at points spread over a run's start (imports, manifest and checksums, session
    creation: fractions of the time to the first streamed token) and once generation has
    streamed its first token: each time the process is gone within 3 s, by the one line (or, before
    Python's handlers exist, by the signal's default action), never with a traceback."""
    argv = [*GRAPHKILN, "run", str(llama_case.artifact), "--show-ids", "--ignore-eos", "--max-new-tokens", "100",
            "--stream", "--threads", "1"] + [a for i in range(48) for a in ("--prompt-ids", f"{i + 3},{i + 4}")]

    def start() -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(proc: subprocess.Popen, when: str) -> int:
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running 3 s after SIGTERM ({when})")
        assert time.monotonic() - sent < 3 and "Traceback" not in err, err
        if proc.returncode == 128 + signal.SIGTERM:
            assert err.splitlines()[-1] == "error: interrupted (SIGTERM)", err
        else:
            assert proc.returncode in (0, -signal.SIGTERM), (when, proc.returncode, err)
        return proc.returncode

    proc, began = start(), time.monotonic()
    proc.stdout.read(1)  # the first streamed token: generation is running
    first = time.monotonic() - began
    assert stop(proc, "after the first token") == 128 + signal.SIGTERM
    codes = []
    # (the last fractions: on a fast start-up, imports are nearly all of it and Python's handlers
    # exist only in its last few percent; a fresh-clone run once had all of 0.1..0.9 land before them)
    for f in (0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99):
        proc = start()
        time.sleep(first * f)
        codes.append(stop(proc, f"{first * f:.2f} s after start"))
    assert 128 + signal.SIGTERM in codes, f"no signal landed inside the start-up ({first:.2f} s): {codes}"


# -- standard output closed or full ------------------------------------------------------------

@pytest.mark.parametrize("argv", [["inspect", "{art}"], ["inspect", "{art}", "--json"], ["--help"],
                                  ["run", "{art}", "--prompt-ids", "3,4", "--max-new-tokens", "60", "--show-ids"],
                                  ["run", "{art}", "--prompt-ids", "3,4", "--max-new-tokens", "60", "--stream",
                                   "--show-ids"],
                                  ["run", "{art}", "--prompt-ids", "3,4", "--max-new-tokens", "8", "--logprobs", "3"]],
                         ids=["inspect", "inspect-json", "help", "run", "run-stream", "run-logprobs"])
def test_a_closed_pipe_ends_quietly_and_a_full_disk_is_one_line(llama_case, argv):
    argv = [a.format(art=llama_case.artifact) for a in argv]
    # the reader is gone before the first write (as `| head -1` is after its line): no message,
    # SIGPIPE's status, as `yes | head` ends
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([*GRAPHKILN, *argv], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write_end)
    assert done.returncode == 128 + 13, done.stderr
    assert done.stderr == "", done.stderr
    with open("/dev/full", "w") as full:
        done = subprocess.run([*GRAPHKILN, *argv], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert_one_error(done.returncode, done.stderr, "cannot write to standard output", "no space left", alone=True)


def test_a_closed_stdout_is_not_an_error(llama_case):
    done = subprocess.run([*GRAPHKILN, "inspect", str(llama_case.artifact)], stdout=None, stderr=subprocess.PIPE,
                          text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert done.returncode == 0 and done.stderr == "", done.stderr


# -- text and token ids --------------------------------------------------------------------------

@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", "١,٢", "１,２", "1;2", "0x1", "-1", "1.0", "", " ", "1_000"])
def test_prompt_ids_are_ascii_integers_with_single_separators(llama_case, capsys, ids):
    code, _, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", ids, "--max-new-tokens", "1")
    assert_one_error(code, err, "--prompt-ids", "e.g. '1,2,3'", alone=True)


@pytest.mark.parametrize("ids, expected", [("3,4", [3, 4]), ("3, 4", [3, 4]), ("3 4", [3, 4]), (" 3 ,4 ", [3, 4])])
def test_prompt_ids_separators_that_are_taken(llama_case, capsys, ids, expected):
    code, out, err = run_cli(capsys, "run", llama_case.artifact, "--prompt-ids", ids, "--max-new-tokens", "2",
                             "--show-ids")
    assert code == 0, err
    want = llama_case.engine.generate(expected, GenerationConfig(max_new_tokens=2, do_sample=False))[0].token_ids
    assert out.split() == [str(t) for t in want]


@pytest.mark.parametrize("text", ["caf\udce9", "\udc80", "ok \ud800 no", "\udfff"])
def test_text_that_is_not_utf8_is_one_error_everywhere(tiny, capsys, text):
    """argv bytes that are not UTF-8 arrive as lone surrogates (as does a JSON \\udce9 escape):
    the CLI names the byte, the API raises GraphkilnError, not the tokenizer's TypeError."""
    case = tiny("llama_tok")
    code, _, err = run_cli(capsys, "run", case.artifact, "--prompt", "fine", "--prompt", text)
    assert_one_error(code, err, "--prompt 2 is not UTF-8", "iconv", alone=True)
    cfg = GenerationConfig(max_new_tokens=2)
    for call in (lambda: case.engine.generate(text, cfg), lambda: case.engine.generate(["fine", text], cfg),
                 lambda: list(case.engine.stream(text, cfg)), lambda: case.engine.prompt_logits([text])):
        with pytest.raises(GraphkilnError, match="lone surrogate") as e:
            call()
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("prompt", [b"abc", bytearray(b"ab"), memoryview(b"ab")])
def test_bytes_are_not_taken_as_token_ids(llama_case, prompt):
    with pytest.raises(GraphkilnError, match="decode bytes"):
        llama_case.engine.generate(prompt, GenerationConfig(max_new_tokens=1))


# -- flags that only mean something with another ------------------------------------------------------

_WRONG_DIGEST = ("--expect-digest", "0" * 64)  # the old code refused this at load: every case ends fast either way
DEPENDENT_FLAGS = {
    "run-draft-cost": (["run", "{art}", "--prompt-ids", "3,4", "--draft-cost", "0.5"], ("--draft-cost", "--draft")),
    "chat-draft-cost": (["chat", "{art}", "--draft-cost", "0"], ("--draft-cost", "--draft")),
    "serve-draft-cost": (["serve", "{art}", "--port", "0", "--draft-cost", "2"], ("--draft-cost", "--draft")),
    "export-max-loras": (["export", "{ckpt}", "-o", "{out}", "--max-loras", "2", "--quant", "int4",
                          "--quant-block-size", "24"], ("--max-loras", "--lora-rank")),
    "run-speculative-draft": (["run", "{art}", "--prompt-ids", "3,4", "--speculative", "draft:3"],
                              ("--speculative 'draft:3'", "--draft")),
    "serve-speculative-draft": (["serve", "{art}", "--port", "0", "--speculative", "draft"],
                                ("--speculative 'draft'", "--draft")),
    "run-draft-with-ngram": (["run", "{art}", "--prompt-ids", "3,4", "--draft", "{art}", "--speculative", "ngram"],
                             ("--draft", "--speculative 'ngram'")),
    "chat-draft-with-off": (["chat", "{art}", "--draft", "{art}", "--speculative", "off"],
                            ("--draft", "--speculative 'off'")),
    "run-greedy-top-k": (["run", "{art}", "--prompt-ids", "3,4", "--greedy", "--top-k", "5"], ("--top-k", "--greedy")),
    "chat-greedy-temperature": (["chat", "{art}", "--greedy", "--temperature", "0.7"], ("--temperature", "--greedy")),
    "run-temperature-0-top-p": (["run", "{art}", "--prompt-ids", "3,4", "--temperature", "0", "--top-p", "0.9"],
                                ("--top-p", "--temperature 0")),
    "run-stream-logprobs": (["run", "{art}", "--prompt-ids", "3,4", "--stream", "--logprobs", "2"],
                            ("--logprobs", "--stream")),
}


@pytest.mark.parametrize("case", DEPENDENT_FLAGS)
def test_a_flag_that_would_do_nothing_is_refused(llama_case, capsys, tmp_path, case):
    """A flag given without the flag it only means something with, or beside one that overrides it,
    was accepted and silently did nothing (``--draft-cost`` without ``--draft``): it is one line
    naming both flags, before anything is loaded."""
    argv, needles = DEPENDENT_FLAGS[case]
    argv = [a.format(art=llama_case.artifact, ckpt=llama_case.checkpoint, out=tmp_path / "out") for a in argv]
    code, out, err = run_cli(capsys, *argv, *(_WRONG_DIGEST if argv[0] != "export" else ()))
    assert_one_error(code, err, *needles, alone=True)
    assert out == "" and not (tmp_path / "out").exists()


# -- verify against another checkpoint ----------------------------------------------------------------

@pytest.mark.parametrize("vocab", [300, 321])
def test_verify_against_a_reference_of_another_vocabulary_is_one_line(llama_case, capsys, tmp_path, vocab):
    spec = SPECS["llama_gqa_bias"]
    other = build_checkpoint(dataclasses.replace(spec, config={**spec.config, "vocab_size": vocab}), tmp_path / "o")
    code, _, err = run_cli(capsys, "verify", llama_case.artifact, "--reference", other, "--steps", "2")
    assert_one_error(code, err, f"vocabulary of {vocab} tokens", f"the artifact {llama_case.vocab_size}",
                     "exported from")


# -- a runtime-only install ----------------------------------------------------------------------------

def test_every_module_mapped_to_an_extra_names_a_real_extra():
    from graphkiln.cli.entry import _EXTRA_OF

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(_EXTRA_OF.values()) <= set(extras), set(_EXTRA_OF.values()) - set(extras)


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory):
    """A real ``pip install graphkiln`` (no extras) in a fresh venv: what README's API section
    suggests. Its packages come from the local pip cache after ``make``."""
    venv = tmp_path_factory.mktemp("runtime-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(REPO)],
                         capture_output=True, text=True, timeout=600)
    if pip.returncode != 0:
        pytest.fail(f"pip install graphkiln failed: {pip.stderr[-2000:]}")
    probe = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; "
                            "print([m for m in ('torch', 'transformers', 'onnx', 'ray') if u.find_spec(m)])"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "[]", f"not a runtime-only install: {probe.stdout}"
    return venv


@pytest.mark.parametrize("argv, extra", [
    (["export", "{ckpt}", "-o", "{out}"], "export"),
    (["verify", "{art}", "--reference", "{ckpt}", "--steps", "2"], "export"),
    (["check", "{art}", "--backend", "tensorrt"], "export"),
    (["demo"], "export"),
    (["run", "{art}", "--prompt-ids", "3,4", "--distributed", "ray"], "distributed"),
])
def test_a_runtime_only_install_names_the_extra_a_command_needs(runtime_venv, llama_case, tmp_path, argv, extra):
    argv = [a.format(ckpt=llama_case.checkpoint, art=llama_case.artifact, out=tmp_path / "out") for a in argv]
    done = subprocess.run([str(runtime_venv / "bin" / "graphkiln"), *argv], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert_one_error(done.returncode, done.stderr, f"pip install 'graphkiln[{extra}]'")
    assert not (tmp_path / "out").exists()


def test_a_runtime_only_install_runs_and_inspects(runtime_venv, llama_case):
    done = subprocess.run([str(runtime_venv / "bin" / "graphkiln"), "run", str(llama_case.artifact), "--prompt-ids",
                           "3,4", "--max-new-tokens", "3", "--show-ids"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    want = llama_case.engine.generate([3, 4], GenerationConfig(max_new_tokens=3, do_sample=False))[0].token_ids
    assert done.stdout.split() == [str(t) for t in want]
