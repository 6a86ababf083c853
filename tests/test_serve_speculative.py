"""Speculative decoding through ``graphkiln serve``: ``--speculative`` (requests' default),
``--draft DIR`` (a draft model; alone, it makes "draft" the default) and a request's own
``speculative`` field, with the ``openai`` client, on llama_tok exported for onnxruntime (its
CPU runner speculates) with its own int4 export as the draft.

Two servers for the module: test_serve's in-process ``serving`` with the default "ngram:4" and no
draft, whose decoder runs are counted (speculation verifies several tokens in one run, so a
request needs fewer runs than tokens), and ``graphkiln serve TARGET --draft DRAFT`` in a
subprocess, as an operator starts it. Greedy output must equal the same request with "off"
token for token. Where runs cannot be counted, seeded sampled output must differ from "off" (the
rejection rule draws other random numbers than plain sampling). A draft model's draft lengths
follow measured times, so its sampled output is compared with nothing but "off".
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from cli_contract import assert_one_error, run_cli  # noqa: E402
from conftest import MAX_SEQ_LEN, add_chat_template  # noqa: E402
import test_serve  # noqa: E402
import test_serve_lora  # noqa: E402

MODEL, serving = test_serve.MODEL, test_serve.serving
no_serving = test_serve_lora.no_serving  # graphkiln serve in process, failing the test if it starts serving
OFF = {"speculative": "off"}
IDS = {"return_token_ids": True, "ignore_eos": True}  # every request runs its full length


@pytest.fixture(scope="module")
def case(tiny):
    return tiny("llama_tok", "onnxruntime")


@pytest.fixture(scope="module")
def target(case, tmp_path_factory):
    """The onnxruntime export with test_serve's chat template (a private copy)."""
    art = tmp_path_factory.mktemp("serve_spec") / "target"
    shutil.copytree(case.artifact, art)
    return add_chat_template(art, test_serve.CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def draft(case, tmp_path_factory):
    """The same checkpoint exported with int4 weights: its drafts are mostly, not always, right."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    out = tmp_path_factory.mktemp("serve_spec_draft") / "draft"
    export_model(str(case.checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN,
                                                          target="onnxruntime", quant="int4"))
    return out


@pytest.fixture(scope="module")
def srv(target):
    with serving(target, max_batch=4, speculative="ngram:4") as running:
        yield running


@pytest.fixture(scope="module")
def drafting(target, draft):
    """``graphkiln serve TARGET --draft DRAFT`` (no --speculative): (client, its startup line)."""
    env = dict(os.environ)
    env.pop("GRAPHKILN_API_KEY", None)
    # --draft-cost 0: a tiny draft's step costs about the target's, which the engine would decline
    proc = subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "serve", str(target), "--draft", str(draft),
                             "--draft-cost", "0", "--port", "0", "--model-name", MODEL, "--threads", "1", "--max-batch", "2",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen = []
        while not seen or not re.search(r"http://127\.0\.0\.1:\d+/v1", seen[-1]):
            line = proc.stderr.readline()
            assert line, f"graphkiln serve exited before listening: {''.join(seen)}"
            seen.append(line)
        url = re.search(r"http://127\.0\.0\.1:\d+/v1", seen[-1]).group(0)
        yield openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60), seen[-1]
    finally:
        proc.terminate()
        proc.wait(30)


def _prompt(case, salt: int) -> list[int]:
    # a prompt that repeats itself: prompt lookup has drafts from the first step on
    return case.prompts([9], salt=salt)[0] * 3


def _counted(srv, call):
    """``call()``'s result and the sequence length of each decoder run it caused (the server
    runs one request at a time here)."""
    decoder = srv.scheduler.engine.decoder
    run, runs = decoder.run, []

    def counting(*args, **kwargs):
        runs.append(args[1].shape[1])
        return run(*args, **kwargs)

    decoder.run = counting
    try:
        return call(), runs
    finally:
        decoder.run = run


def _complete(client, prompt, n: int, extra: dict, **kw):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body=IDS | extra, **kw)
    return r.choices[0].token_ids, r.choices[0].text


def _chat(client, text: str, n: int, extra: dict, stream: bool = False, **kw) -> str:
    msgs, extra = [{"role": "user", "content": text}], {"ignore_eos": True} | extra
    if not stream:
        return client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, extra_body=extra,
                                              **kw).choices[0].message.content
    chunks = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, extra_body=extra, stream=True,
                                            **kw)
    return "".join(c.delta.content or "" for chunk in chunks for c in chunk.choices)


def _refused(call, code: str) -> str:
    """``call()`` is a 400 in OpenAI's shape naming the field "speculative"; its message."""
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    err = caught.value.response.json()["error"]
    assert (err["param"], err["code"], err["type"]) == ("speculative", code, "invalid_request_error"), err
    assert err["message"] and "\n" not in err["message"], err
    return err["message"]


# -- the server's default, and a request's own ----------------------------------------------


def test_greedy_with_the_servers_ngram_default_equals_off(srv, case):
    client, prompt, n = srv.client(), _prompt(case, 1), 40
    (spec, spec_text), spec_runs = _counted(srv, lambda: _complete(client, prompt, n, {}, temperature=0))
    (plain, plain_text), plain_runs = _counted(srv, lambda: _complete(client, prompt, n, OFF, temperature=0))
    assert spec == plain and spec_text == plain_text and len(plain) == n
    # one run per token without speculation; verified drafts save runs with it
    assert len(plain_runs) == n and len(spec_runs) < n and max(spec_runs[1:]) > 1, (spec_runs, plain_runs)
    # and /metrics counts them: verified drafts, the accepted ones among them
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
               for s in fam.samples}
    assert 0 < metrics["graphkiln_accepted_draft_tokens_total"] <= metrics["graphkiln_draft_tokens_total"]


def test_a_requests_own_speculative(srv, case):
    """ "ngram:K" on chat, and "off" over the server's default, both greedy-equal to plain decoding."""
    client = srv.client()
    text = "la di da, la di da, la di da, la di da"
    spec, spec_runs = _counted(srv, lambda: _chat(client, text, 40, {"speculative": "ngram:8"}, temperature=0))
    plain, plain_runs = _counted(srv, lambda: _chat(client, text, 40, OFF, temperature=0))
    assert spec == plain and len(spec_runs) < len(plain_runs), (spec_runs, plain_runs)
    assert max(plain_runs[1:]) == 1  # "off" is off, though the server's default speculates


def test_streaming_with_speculation(srv, case):
    client, prompt, n = srv.client(), _prompt(case, 2), 40

    def streamed():
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body=IDS)
        ids, text, usage = [], "", None
        for chunk in chunks:
            usage = chunk.usage or usage
            for c in chunk.choices:
                ids += c.token_ids or []
                text += c.text
        return ids, text, usage

    (ids, text, usage), runs = _counted(srv, streamed)
    assert (ids, text) == _complete(client, prompt, n, OFF, temperature=0) and usage.completion_tokens == n
    assert len(runs) < n  # several tokens a step, each streamed
    stream = _chat(client, "la di da, la di da, la di da", 30, {"speculative": "ngram:2"}, stream=True, temperature=0)
    assert stream == _chat(client, "la di da, la di da, la di da", 30, OFF, temperature=0)


def test_bad_values_are_400s_and_queue_nothing(srv):
    client, before = srv.client(), srv.scheduler.stats()
    for value in ("ngram:0", "ngram:17", "draft:x", "beam", "", "NGRAM", 4, ["ngram"]):
        extra = {"speculative": value}
        message = _refused(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra),
                           "invalid_value")
        assert "speculative" in message
        _refused(lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                        max_tokens=4, extra_body=extra), "invalid_value")
    # this server has no draft model: refused at once, not when the engine sees the request
    for value in ("draft", "draft:2"):
        message = _refused(lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=4,
                                                             extra_body={"speculative": value}), "no_draft_model")
        assert "--draft" in message
    after = srv.scheduler.stats()
    assert (after.prompt_tokens, after.generated_tokens) == (before.prompt_tokens, before.generated_tokens)


# -- a draft model ------------------------------------------------------------------------------


def test_draft_is_the_default_with_draft(drafting, case):
    client, line = drafting
    assert "speculative draft" in line, line
    prompt, n = case.prompts([12], salt=3)[0], 40
    greedy = _complete(client, prompt, n, {}, temperature=0)
    assert greedy == _complete(client, prompt, n, OFF, temperature=0) and len(greedy[0]) == n
    assert greedy == _complete(client, prompt, n, {"speculative": "ngram:4"}, temperature=0)
    # sampled with one seed: speculation draws other random numbers than plain sampling, so the
    # default's samples differ from "off"'s; prompt lookup finds nothing to propose in this random
    # text (the same samples as "off"), so the default's drafts are the draft model's
    plain = _complete(client, prompt, 24, OFF, temperature=1.0, seed=11)
    assert _complete(client, prompt, 24, {"speculative": "ngram:4"}, temperature=1.0, seed=11) == plain
    assert _complete(client, prompt, 24, {}, temperature=1.0, seed=11)[0] != plain[0]
    # chat, streamed
    assert _chat(client, "hello there", 30, {}, stream=True, temperature=0) == _chat(client, "hello there", 30, OFF,
                                                                                       temperature=0)


def test_bad_speculation_at_startup_is_one_line(capsys, no_serving, target, tmp_path):
    cases = [
        (["--speculative", "ngram:0"], "--speculative 'ngram:0'"),
        (["--speculative", "draft:4"], "--draft DIR"),
        (["--draft", tmp_path / "missing"], str(tmp_path / "missing")),
    ]
    for flags, needle in cases:
        code, out, err = run_cli(capsys, "serve", target, "--port", 0, "--threads", 1, *flags)
        assert_one_error(code, err, needle)
