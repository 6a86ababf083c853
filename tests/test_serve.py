"""``graphkiln serve`` against the real server on loopback (uvicorn in a thread; the SIGTERM test
runs the CLI in a subprocess), with the ``openai`` package as client and httpx for raw cases.

The artifact is the tokenizer case (tiny Llama, byte-level BPE) with a chat template added to a
private copy (``chat_template.jinja``, listed and hashed in its manifest as an export writes it).
References come from a separate ``Engine`` running each request alone.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from conftest import add_chat_template  # noqa: E402
from graphkiln.runtime import Engine, GenerationConfig  # noqa: E402

from cli_contract import assert_one_error, run_cli  # noqa: E402

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{{ raise_exception('tool messages are not supported') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MODEL = "tiny"
KEY = "sekrit-key"


@pytest.fixture(scope="module")
def artifact(tok_case, tmp_path_factory):
    """tok_case's artifact with chat_template.jinja, as the manifest of a checkpoint with one lists it."""
    import shutil

    art = tmp_path_factory.mktemp("serve") / "artifact"
    shutil.copytree(tok_case.artifact, art)
    return add_chat_template(art, CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def reference(artifact):
    return Engine.load(artifact)


class Running:
    def __init__(self, server, scheduler, port: int, key: str | None) -> None:
        self.server, self.scheduler, self.port = server, scheduler, port
        self.url = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    def client(self) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=30)

    def post(self, path: str, body, **kw) -> "httpx.Response":
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers=self.headers, timeout=30, **kw)

    def wait_idle(self, timeout: float = 10.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            s = self.scheduler.stats()
            if s.queued == 0 and s.running == 0:
                return s
            time.sleep(0.02)
        raise AssertionError(f"scheduler not idle after {timeout} s: {self.scheduler.stats()}")


@contextmanager
def serving(artifact, *, key=None, max_queue=32, max_batch=8, step_tokens=64, drain_s=10.0, prefix_cache=True,
            lora=(), **app_options):
    """The server as ``graphkiln serve`` runs it, in a thread; ``lora``: (name, dir) pairs as --lora gives them."""
    from graphkiln.runtime.request.scheduler import Scheduler
    from graphkiln.serve.app import AppOptions
    from graphkiln.serve.server import bind, load_adapters, make_server

    engine = Engine.load(artifact, threads=1, prefix_cache=prefix_cache)
    adapters = load_adapters(engine, lora, MODEL)
    scheduler = Scheduler(engine, max_queue=max_queue, max_batch=max_batch, step_tokens=step_tokens)
    sock = bind("127.0.0.1", 0)
    server = make_server(scheduler, engine, AppOptions(model_name=MODEL, api_key=key, lora_adapters=adapters,
                                                       **app_options), drain_s=drain_s, log_level="warning")
    scheduler.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < end and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield Running(server, scheduler, sock.getsockname()[1], key)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def srv(artifact):
    with serving(artifact) as running:
        yield running


def _alone(reference, prompt, n: int, **kw):
    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, **kw)
    return reference.generate(prompt, cfg)[0]


def test_concurrent_greedy_requests_equal_each_alone(srv, reference, tok_case):
    """16 clients at once (completions and chat, streaming and not, staggered lengths); every
    request's greedy tokens equal the same request run alone on its own Engine."""
    prompts = tok_case.prompts([3 + 5 * (i % 7) for i in range(16)], salt=7)
    client = srv.client()

    def one(i: int):
        n = 6 + i % 5
        extra = {"return_token_ids": True}
        if i % 4 == 3:  # chat: the template's tokens come back as prompt_token_ids
            msgs = [{"role": "user", "content": f"question {i}: why?"}]
            r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=n, temperature=0, extra_body=extra)
            return r.prompt_token_ids, r.choices[0].token_ids, r.choices[0].message.content, n
        if i % 2:
            stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n, temperature=0, stream=True,
                                               stream_options={"include_usage": True}, extra_body=extra)
            ids, text, usage = [], "", None
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    ids += c.token_ids
                    text += c.text
            assert usage.completion_tokens == len(ids) and usage.prompt_tokens == len(prompts[i])
            return prompts[i], ids, text, n
        r = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=n, temperature=0, extra_body=extra)
        assert r.usage.completion_tokens == len(r.choices[0].token_ids)
        return prompts[i], r.choices[0].token_ids, r.choices[0].text, n

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(one, range(16)))
    for prompt_ids, ids, text, n in got:
        want = _alone(reference, prompt_ids, n)
        assert ids == want.token_ids and text == want.text
    srv.wait_idle()


def test_chat_template_matches_transformers(srv, artifact):
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_file=str(artifact / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    want = tok.apply_chat_template(msgs, chat_template=CHAT_TEMPLATE, add_generation_prompt=True, tokenize=True,
                                   return_dict=False)
    r = srv.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == list(want)
    # the template's raise_exception is a 400 naming the template's own message
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    r = srv.post("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "x"}]})
    assert r.status_code == 400 and "tool messages are not supported" in r.json()["error"]["message"]


@pytest.mark.parametrize("source,needle", [
    (None, "no usable chat template"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "ChatTemplateError"),
    ("{% for %}", "does not compile"),
])
def test_chat_template_refusals(tmp_path, source, needle):
    from graphkiln.runtime.request.chat_template import ChatTemplate, ChatTemplateError

    files = ("tokenizer.json",)
    if source is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": source}))
        files += ("tokenizer_config.json",)
    (tmp_path / "tokenizer.json").write_text(_tokenizer_json())
    tpl = ChatTemplate.load(tmp_path, files)
    with pytest.raises(ChatTemplateError) as err:
        tpl.render([{"role": "user", "content": "hi"}])
    msg = str(err.value)
    assert "\n" not in msg and (needle in msg or needle == type(err.value).__name__), msg


def test_a_hostile_chat_template_is_a_400_and_never_wedges_the_server(tok_case, artifact_copy):
    """Issue 37: a template that loops for hours (nested range(99999) loops), sent by more clients
    than the server has preparation workers, pinned every worker for good: completions and
    tokenize hung behind it while /health said 200, and the server would not stop. Each render
    is now a 400 after its deadline (RENDER_SECONDS), the other routes answer meanwhile, and the
    server stops at once afterwards (serving() checks that it stopped)."""
    from graphkiln.runtime.request.chat_template import RENDER_SECONDS
    from graphkiln.serve.admission import SMALL_WORKERS

    art = add_chat_template(artifact_copy(tok_case), "{% for i in range(99999) %}{% for j in range(99999) %}"
                                                     "{% endfor %}{% endfor %}")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serving(art) as running, ThreadPoolExecutor(SMALL_WORKERS + 1) as pool:
        start = time.monotonic()
        hostile = [pool.submit(running.post, "/v1/chat/completions", chat) for _ in range(SMALL_WORKERS + 1)]
        time.sleep(0.3)  # the renders have begun
        assert httpx.get(running.url + "/health", timeout=5).status_code == 200
        assert running.post("/tokenize", {"prompt": "hi"}).status_code == 200
        assert running.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
        assert time.monotonic() - start < RENDER_SECONDS + 5  # behind one deadline at most, not forever
        for future in hostile:
            r = future.result()
            assert r.status_code == 400 and r.json()["error"]["code"] == "chat_template", r.text
            assert "did not finish rendering" in r.json()["error"]["message"]
        assert time.monotonic() - start < 2 * RENDER_SECONDS + 10


def _tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()


def test_logprobs_shapes_and_values(srv, reference, tok_case):
    prompt = tok_case.prompts([9], salt=3)[0]
    want = _alone(reference, prompt, 5, logprobs=3)
    client = srv.client()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    for got, w in zip(lp.token_logprobs, want.logprobs):
        assert got == pytest.approx(w.logprob, abs=1e-5)
    assert all(len(top) <= 3 for top in lp.top_logprobs)
    chunks = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                            temperature=0, logprobs=True, top_logprobs=2, stream=True)
    content = [c for ch in chunks for choice in ch.choices if choice.logprobs for c in choice.logprobs.content]
    assert len(content) == 4
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.logprob <= c.top_logprobs[0].logprob + 1e-6 and bytes(c.bytes).decode("utf-8", "replace") == c.token
    # stop strings end the text before the stop (finish_reason "stop")
    full = _alone(reference, prompt, 12).text
    stop = full[3:5]
    if stop and stop.strip():
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
        assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.find(stop)]


def test_disconnects_free_every_slot_and_metrics_agree(srv, reference, tok_case):
    """A bounded load run where about half the clients hang up mid-stream: afterwards nothing is
    queued or running, every slot is free, /metrics says so, and greedy results are unchanged."""
    from prometheus_client.parser import text_string_to_metric_families

    rng = random.Random(5)
    prompts = tok_case.prompts([rng.randint(3, 40) for _ in range(24)], salt=11)
    plans = [(p, rng.random() < 0.5, rng.randint(1, 4)) for p in prompts]
    before = srv.scheduler.stats()

    def one(plan):
        prompt, hang_up, after = plan
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for i, line in enumerate(r.iter_lines()):
                if hang_up and i >= after:
                    return "hung up"
        return "done"

    with ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(one, plans))
    assert "hung up" in outcomes and "done" in outcomes
    stats = srv.wait_idle()
    assert stats.free_slots == stats.total_slots and stats.generated_tokens > before.generated_tokens
    metrics = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
               for s in fam.samples}
    assert metrics["graphkiln_free_slots"] == metrics["graphkiln_total_slots"] == stats.total_slots
    assert metrics["graphkiln_running_requests"] == metrics["graphkiln_queue_depth"] == 0
    assert metrics["graphkiln_generated_tokens_total"] == stats.generated_tokens
    assert metrics["graphkiln_prompt_tokens_total"] == stats.prompt_tokens
    assert metrics["graphkiln_kv_bytes_per_token"] == stats.kv_bytes_per_token > 0
    assert metrics["graphkiln_time_to_first_token_seconds_count"] > 0
    # the server still answers exactly as before
    r = srv.client().completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0,
                                        extra_body={"return_token_ids": True})
    assert r.choices[0].token_ids == _alone(reference, prompts[0], 8).token_ids


_C, _CHAT = "/v1/completions", "/v1/chat/completions"
_OK = {"model": MODEL, "prompt": [5, 6, 7]}
_MSG = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
BAD = {  # name: (route, body, code, param)
    "malformed json": (_C, b'{"model": "tiny", "prompt": [1,', "invalid_json", None),
    "not an object": (_C, b"[1, 2]", "invalid_json", None),
    "unknown field": (_C, dict(_OK, max_token=3), "unknown_field", "max_token"),
    "missing prompt": (_C, {"model": MODEL}, "missing_field", "prompt"),
    "max_tokens a string": (_C, dict(_OK, max_tokens="8"), "invalid_value", "max_tokens"),
    "max_tokens negative": (_C, dict(_OK, max_tokens=-1), "invalid_value", "max_tokens"),
    "max_tokens bool": (_C, dict(_OK, max_tokens=True), "invalid_value", "max_tokens"),
    "temperature too high": (_C, dict(_OK, temperature=3), "invalid_value", "temperature"),
    "temperature a string": (_C, dict(_OK, temperature="hot"), "invalid_value", "temperature"),
    "top_p zero": (_C, dict(_OK, top_p=0), "invalid_value", "top_p"),
    "n 2": (_C, dict(_OK, n=2), "invalid_value", "n"),
    "five stops": (_C, dict(_OK, stop=["a", "b", "c", "d", "e"]), "invalid_value", "stop"),
    "empty stop": (_C, dict(_OK, stop=""), "invalid_value", "stop"),
    "stop an int": (_C, dict(_OK, stop=["a", 5]), "invalid_value", "stop"),
    "logprobs 21": (_C, dict(_OK, logprobs=21), "invalid_value", "logprobs"),
    "negative seed": (_C, dict(_OK, seed=-1), "invalid_value", "seed"),
    "penalty": (_C, dict(_OK, presence_penalty=0.5), "invalid_value", "presence_penalty"),
    "logit_bias": (_C, dict(_OK, logit_bias={"5": "x"}), "invalid_value", "logit_bias"),
    "echo a string": (_C, dict(_OK, echo="yes"), "invalid_value", "echo"),
    "prompt a number": (_C, dict(_OK, prompt=5), "invalid_value", "prompt"),
    "prompt mixed": (_C, dict(_OK, prompt=["a", 5]), "invalid_value", "prompt"),
    "65 prompts": (_C, dict(_OK, prompt=[[5]] * 65), "invalid_value", "prompt"),
    "prompts of two kinds": (_C, dict(_OK, prompt=["a", [5]]), "invalid_value", "prompt"),
    "a batch's prompt too long": (_C, dict(_OK, prompt=[[5], [5] * 200]), "context_length_exceeded", "prompt[1]"),
    "prompt too long": (_C, dict(_OK, prompt=[5] * 200), "context_length_exceeded", "prompt"),
    "text prompt too long": (_C, dict(_OK, prompt="ab " * 2000), "context_length_exceeded", "prompt"),
    "id outside vocab": (_C, dict(_OK, prompt=[5, 10**6]), None, "prompt"),
    "empty prompt": (_C, dict(_OK, prompt=[]), "invalid_value", "prompt"),
    "lone surrogate": (_C, b'{"model": "tiny", "prompt": "a\\udce9"}', "invalid_json", None),
    "lone surrogate in chat": (_CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800x"}]}',
                               "invalid_json", None),
    "stream_options not an object": (_C, dict(_OK, stream_options=5), "invalid_value", "stream_options"),
    "stream_options typo": (_CHAT, dict(_MSG, stream=True, stream_options={"include_usag": True}), "unknown_field",
                            "stream_options.include_usag"),
    "no messages": (_CHAT, dict(_MSG, messages=[]), "invalid_value", "messages"),
    "messages an object": (_CHAT, dict(_MSG, messages={"role": "user"}), "invalid_value", "messages"),
    "bad role": (_CHAT, dict(_MSG, messages=[{"role": "wizard", "content": "hi"}]), "invalid_value",
                 "messages[0].role"),
    "missing role": (_CHAT, dict(_MSG, messages=[{"content": "hi"}]), "missing_field", "messages[0].role"),
    "content a number": (_CHAT, dict(_MSG, messages=[{"role": "user", "content": 5}]), "invalid_value",
                         "messages[0].content"),
    "second content a bool": (_CHAT, dict(_MSG, messages=[{"role": "user", "content": "a"},
                                                          {"role": "user", "content": True}]),
                              "invalid_value", "messages[1].content"),
    "image part": (_CHAT, dict(_MSG, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
                   "invalid_value", "messages[0].content"),
    "text part without text": (_CHAT, dict(_MSG, messages=[{"role": "user", "content": [{"type": "text"}]}]),
                               "invalid_value", "messages[0].content"),
    "max_completion_tokens negative": (_CHAT, dict(_MSG, max_completion_tokens=-1), "invalid_value",
                                       "max_completion_tokens"),
    "chat logprobs an int": (_CHAT, dict(_MSG, logprobs=3), "invalid_value", "logprobs"),
    "top_logprobs alone": (_CHAT, dict(_MSG, top_logprobs=2), None, "top_logprobs"),
    "chat temperature a list": (_CHAT, dict(_MSG, temperature=[1]), "invalid_value", "temperature"),
}
# pydantic's union member tags, never part of a field's name
_TAGS = re.compile(r"(^|\.)(str|int|float|bool|none)(\.|\[|$)|list\[|dict\[|literal\[|constrained|TextPart|function")


@pytest.mark.parametrize("name", list(BAD))
def test_bad_input_is_a_400_in_openai_shape(srv, name):
    """Every malformed field of both routes is a 400 whose param names the field as OpenAI
    writes it (messages[0].content), never pydantic's location (prompt.str)."""
    path, body, code, param = BAD[name]
    r = srv.post(path, body)
    assert r.status_code == 400, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["message"] and "\n" not in err["message"]
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    assert param is None or not _TAGS.search(param)


def test_routes_unknown_and_health(srv):
    assert httpx.get(srv.url + "/nope").status_code == 404
    assert httpx.get(srv.url + "/v1/completions").json()["error"]["code"] == "method_not_allowed"
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    # a model not served is OpenAI's 404 (model_not_found), on every route that names one
    for path, body in ((_C, dict(_OK, model="gpt-4")), (_CHAT, dict(_MSG, model="gpt-4")),
                       ("/tokenize", {"model": "gpt-4", "prompt": "a"})):
        r = srv.post(path, body)
        assert r.status_code == 404, (path, r.text)
        assert r.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error", "param": "model",
                                                       "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        srv.client().completions.create(model="gpt-4", prompt="a", max_tokens=1)
    srv.wait_idle()  # refusals hold nothing


def test_artifact_without_lora_refuses_adapters(srv, artifact, capsys, tmp_path):
    """An artifact exported without --lora-rank: vLLM's adapter routes are a 400 naming the fix
    (tests/test_serve_lora.py has them on an artifact with LoRA), and so is run --lora."""
    for path, body in (("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(tmp_path)}),
                       ("/v1/unload_lora_adapter", {"lora_name": "a"})):
        r = srv.post(path, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "lora_not_supported", r.text
        assert "--lora-rank" in r.json()["error"]["message"]
    assert [m.id for m in srv.client().models.list().data] == [MODEL]
    code, out, err = run_cli(capsys, "run", artifact, "--lora", tmp_path, "--prompt-ids", "1,2", "--threads", 1)
    assert_one_error(code, err, "--lora-rank")


def test_auth_and_queue_full(artifact, tok_case):
    """With an API key every route but /health needs it; past max_queue waiting requests, 429
    with Retry-After (one slot, one place in the queue)."""
    with serving(artifact, key=KEY, max_queue=1, max_batch=1, step_tokens=64) as s:
        assert httpx.get(s.url + "/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            r = httpx.get(s.url + path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(s.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(s.url + path, headers=s.headers).status_code == 200
        assert s.post(_C, _OK | {"max_tokens": 2}).status_code == 200  # s.post sends the key
        assert httpx.post(s.url + _C, json=_OK).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=s.url + "/v1", api_key="wrong", max_retries=0).models.list()

        # one slot and one queue place: of 8 requests arriving together (each ~120 decode steps),
        # the first runs, the next waits, the others are refused
        prompt = tok_case.prompts([4], salt=1)[0]
        barrier = threading.Barrier(8)

        def one(_):
            barrier.wait()
            return s.post(_C, {"model": MODEL, "prompt": prompt, "max_tokens": 120, "temperature": 0})

        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(one, range(8)))
        refused = [r for r in responses if r.status_code == 429]
        assert refused and all(r.status_code == 200 for r in responses if r.status_code != 429)
        assert all(r.headers["Retry-After"].isdigit() and r.json()["error"]["code"] == "queue_full" for r in refused)
        s.wait_idle()


def test_sigterm_drains_in_flight_requests(artifact, tok_case):
    """The CLI under SIGTERM: in-flight streams run to their end, new connections are refused,
    exit status 0."""
    env = dict(os.environ, GRAPHKILN_API_KEY="")
    env.pop("GRAPHKILN_API_KEY")
    proc = subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "serve", str(artifact), "--port", "0",
                             "--model-name", MODEL, "--threads", "1", "--max-batch", "4", "--drain-timeout", "20",
                             "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env)
    try:
        for _ in range(50):  # the startup line, after anything a library printed first
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", proc.stderr.readline())
            if found:
                break
        port = int(found.group(1))
        url = f"http://127.0.0.1:{port}"
        prompts = tok_case.prompts([5, 9, 13], salt=4)
        results: dict[int, list[str]] = {}
        started = [threading.Event() for _ in range(3)]

        def one(i):
            body = {"model": MODEL, "prompt": prompts[i], "max_tokens": 100, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + _C, json=body, timeout=60) as r:
                lines = []
                for line in r.iter_lines():
                    started[i].set()
                    lines.append(line)
                results[i] = [l for l in lines if l]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for e in started:
            assert e.wait(30)
        proc.terminate()  # while the three stream
        for t in threads:
            t.join(60)
        assert proc.wait(60) == 0
        err = proc.stderr.read()
        assert "stopped (drained)" in err and "Traceback" not in err, err
        for i in range(3):
            lines = results[i]
            assert lines[-1] == "data: [DONE]"
            usage = json.loads(lines[-2][6:])["usage"]
            last = json.loads(lines[-3][6:])["choices"][0]
            assert last["finish_reason"] == "length" and usage["completion_tokens"] == 100
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("argv,needle", [
    (["--port", "70000"], "0..65535"),
    (["--max-queue", "0"], ">= 1"),
    (["--api-key", " "], "--api-key is empty"),
    (["--drain-timeout", "nan"], "finite"),
    (["--max-batch", "1000000", "--port", "0", "--threads", "1"], "--max-batch/max_batch 1000000 needs --step-tokens"),
    (["--max-batch", "300", "--step-tokens", "300", "--port", "0", "--threads", "1"], "--step-tokens 301 or more"),
])
def test_cli_bad_flags_are_one_line(capsys, artifact, argv, needle):
    code, out, err = run_cli(capsys, "serve", artifact, *argv)
    assert_one_error(code, err, needle)


def test_cli_port_in_use_is_one_line(capsys, artifact):
    from graphkiln.serve.server import bind

    taken = bind("127.0.0.1", 0)
    try:
        code, out, err = run_cli(capsys, "serve", artifact, "--port", taken.getsockname()[1], "--threads", "1")
        assert_one_error(code, err, "cannot listen on 127.0.0.1", "--port")
    finally:
        taken.close()


OPENAI_FINISH = {"stop", "length", "tool_calls", "content_filter", "function_call"}


def _finish_reasons(resp: "httpx.Response", stream: bool) -> list:
    if not stream:
        return [c["finish_reason"] for c in resp.json()["choices"]]
    reasons = []
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            reasons += [c["finish_reason"] for c in json.loads(line[6:]).get("choices", []) if c["finish_reason"]]
    return reasons


def test_finish_reasons_are_openai_ones_even_at_the_drain_deadline(artifact, tok_case, reference):
    """Over both routes, streamed and not: requests ending by length (max_tokens, 0 included),
    by a stop string, and cut by a drain deadline; every finish_reason is OpenAI's or vLLM's
    "abort", and the cut requests end with "abort" (the scheduler's "cancelled" never leaks)."""
    prompt = tok_case.prompts([6], salt=9)[0]
    text = _alone(reference, prompt, 12).text
    plans = [dict(max_tokens=0), dict(max_tokens=3), dict(max_tokens=12, stop=[text[4:6]] if text[4:6].strip() else [])]
    seen: set = set()
    with serving(artifact, drain_s=0.0) as s:
        for plan in plans:
            for path, body in ((_C, {"prompt": prompt}), (_CHAT, {"messages": [{"role": "user", "content": "hi"}]})):
                for stream in (False, True):
                    r = s.post(path, {"model": MODEL, "temperature": 0, "stream": stream, **body, **plan})
                    assert r.status_code == 200, r.text
                    seen.update(_finish_reasons(r, stream))
        # four long requests, two per route, one of each streamed: cut by the deadline
        long = {"model": MODEL, "temperature": 0, "max_tokens": 120, "ignore_eos": True}
        cut = [(_C, dict(long, prompt=prompt[:3]), False), (_C, dict(long, prompt=prompt[:3], stream=True), True),
               (_CHAT, dict(long, messages=[{"role": "user", "content": "a"}]), False),
               (_CHAT, dict(long, messages=[{"role": "user", "content": "a"}], stream=True), True)]
        slow = threading.Event()

        def throttle():  # long enough a generation that the deadline falls inside it
            while not slow.is_set():
                with s.scheduler._lock:
                    time.sleep(0.01)
                time.sleep(0.001)

        throttler = threading.Thread(target=throttle)
        throttler.start()
        try:
            with ThreadPoolExecutor(4) as pool:
                futures = [pool.submit(s.post, path, body) for path, body, _ in cut]
                end = time.monotonic() + 10
                while s.scheduler.stats().running < 4 and time.monotonic() < end:
                    time.sleep(0.01)
                s.server.should_exit = True  # shutdown: no time to drain, the next step cancels them
                responses = [f.result() for f in futures]
        finally:
            slow.set()
            throttler.join()
    for (path, body, stream), r in zip(cut, responses):
        assert r.status_code == 200, r.text
        reasons = _finish_reasons(r, stream)
        assert reasons[-1:] == ["abort"], (path, stream, reasons, r.text[-300:])
        seen.update(reasons)
    assert seen <= OPENAI_FINISH | {"abort"} and {"length", "abort"} <= seen, seen


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host,key,url,warned", [
    ("127.0.0.1", None, "http://127.0.0.1:{port}/v1", None),
    ("::1", None, "http://[::1]:{port}/v1", None),
    ("::", None, "http://[::]:{port}/v1", "serving on [::] without an API key"),
    ("0.0.0.0", None, "http://0.0.0.0:{port}/v1", "serving on 0.0.0.0 without an API key"),
    ("::", KEY, "http://[::]:{port}/v1", None),
])
def test_startup_lines_bracket_ipv6(capsys, host, key, url, warned):
    """The announced URL is one a client can use: IPv6 literals in brackets, also in the warning."""
    from graphkiln.serve.server import ServeConfig, announce, bind

    if ":" in host and not _ipv6_loopback():
        pytest.skip("no IPv6 on this machine")
    sock = bind(host, 0)
    try:
        port = sock.getsockname()[1]
        announce(ServeConfig(artifact="x", host=host, api_key=key), MODEL, sock, 4)
    finally:
        sock.close()
    lines = capsys.readouterr().err.splitlines()
    assert url.format(port=port) in lines[-1], lines
    assert (warned is None and len(lines) == 1) or (len(lines) == 2 and warned in lines[0]), lines


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 on this machine")
def test_cli_serves_ipv6_loopback_at_the_url_it_prints(artifact):
    proc = subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "serve", str(artifact), "--host", "::1", "--port",
                             "0", "--threads", "1", "--log-level", "warning"], stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(50):
            line = proc.stderr.readline()
            found = re.search(r"(http://\S+/v1)", line)
            if found or not line:
                break
        assert found and found.group(1).startswith("http://[::1]:"), line
        assert httpx.get(found.group(1)[: -len("/v1")] + "/health", timeout=10).json() == {"status": "ok"}
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("kwargs,names", [
    (dict(max_queue=0), "--max-queue/max_queue"),
    (dict(max_queue=2.5), "--max-queue/max_queue"),
    (dict(max_queue=True), "--max-queue/max_queue"),
    (dict(max_batch=0), "--max-batch/max_batch"),
    (dict(max_batch="8"), "--max-batch/max_batch"),
    (dict(max_batch=False), "--max-batch/max_batch"),
    (dict(step_tokens=1), "--step-tokens/step_tokens"),
    (dict(step_tokens=64.0), "--step-tokens/step_tokens"),
    (dict(step_tokens=None), "--step-tokens/step_tokens"),
    (dict(max_batch=1000000), "--max-batch/max_batch 1000000 needs --step-tokens/step_tokens above it"),
    (dict(max_batch=8, step_tokens=8), "--step-tokens 9 or more"),
])
def test_scheduler_refusals_name_the_flag_and_the_argument(reference, kwargs, names):
    """Every argument refusal is one line naming what the caller set, as the CLI flag and as the
    Python argument, with the value given."""
    from graphkiln.errors import GraphkilnError
    from graphkiln.runtime.request.scheduler import Scheduler

    with pytest.raises(GraphkilnError) as err:
        Scheduler(reference, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg and names in msg and repr(next(iter(kwargs.values())))[:8] in msg, msg
    assert reference.generate([5, 6], GenerationConfig(max_new_tokens=1)).__len__() == 1  # the engine stays free


def test_scheduler_max_batch_that_does_not_fit_names_it(reference):
    from graphkiln.errors import GraphkilnError
    from graphkiln.runtime.request.scheduler import Scheduler

    sched = Scheduler(reference, max_batch=10**12, step_tokens=10**12 + 1)
    try:
        with pytest.raises(GraphkilnError) as err:
            sched.start()
    finally:
        sched.shutdown(0)
    msg = str(err.value)
    assert "\n" not in msg and f"--max-batch/max_batch {10**12} does not fit in memory" in msg, msg


# -- tokenizer routes (vLLM's; lm-evaluation-harness's remote tokenizer) -----------------------

TOKENIZE_TEXTS = ["The capital of France is", "", "  two  spaces\n\ttab", "caf\u00e9 \u4e2d\u6587 \U0001f600"]


def test_tokenizer_info_has_what_a_remote_tokenizer_reads(srv, reference, artifact):
    """lm-eval's RemoteTokenizer takes eos/bos/pad tokens and the chat template from here."""
    info = httpx.get(srv.url + "/tokenizer_info", timeout=30).json()
    gen, tok = reference.manifest.generation, reference.tokenizer
    assert info == {"bos_token": tok.token_text(gen.bos_token_id), "eos_token": tok.token_text(gen.eos_token_ids[0]),
                    "pad_token": None if gen.pad_token_id is None else tok.token_text(gen.pad_token_id),
                    "chat_template": (artifact / "chat_template.jinja").read_text(),
                    "model_max_length": reference.max_seq_len, "vocab_size": reference.manifest.model.vocab_size}
    assert info["eos_token"] and info["bos_token"]


@pytest.mark.parametrize("special", [True, False, None])
def test_tokenize_and_detokenize_agree_with_the_engine(srv, reference, special):
    tok = reference.tokenizer
    for text in TOKENIZE_TEXTS:
        body = {"prompt": text} | ({} if special is None else {"add_special_tokens": special})
        if special is not None:
            body["model"] = MODEL
        r = srv.post("/tokenize", body)
        assert r.status_code == 200, r.text
        want = tok.encode(text, add_special_tokens=special is not False)
        assert r.json() == {"count": len(want), "max_model_len": reference.max_seq_len, "tokens": want}
        back = srv.post("/detokenize", {"tokens": want})
        assert back.status_code == 200 and back.json() == {"prompt": tok.decode(want)}, back.text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": ["a"]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": [-1]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, "2"]}, "tokens[1]"),
    ("/detokenize", {"tokens": 3}, "tokens"),
    ("/detokenize", {"tokens": [1.0]}, "tokens[0]"),
])
def test_tokenizer_routes_refuse_bad_bodies_naming_the_field(srv, path, body, param):
    r = srv.post(path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error


# -- echo: the prompt's log-probabilities (lm-evaluation-harness's loglikelihood requests) -----------

def _engine_prompt_logprobs(reference, ids, top):
    res = reference.generate(ids, GenerationConfig(max_new_tokens=1, prompt_logprobs=top, logprobs=top,
                                                   do_sample=False, stop_token_ids=()))[0]
    return res.prompt_logprobs + res.logprobs, res


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_gives_the_prompts_logprobs_then_the_completions(srv, reference, max_tokens):
    """The request lm-eval's local-completions sends for a loglikelihood: the prompt as token ids,
    echo, logprobs 1, temperature 0; the score is sum(token_logprobs[ctxlen:len(prompt)])."""
    ids = [5, 17, 33, 4, 90, 12, 61]
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                     "max_tokens": max_tokens, "temperature": 0, "seed": 1234})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    tok = reference.tokenizer
    want, res = _engine_prompt_logprobs(reference, ids, 1)
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(ids) + min(max_tokens, 1)):
        assert lp["token_logprobs"][i] == pytest.approx(want[i].logprob, abs=1e-5)
        assert lp["top_logprobs"][i] == {tok.decode([t]): pytest.approx(v, abs=1e-5) for t, v in want[i].top}
    assert lp["tokens"][: len(ids)] == [tok.decode([t]) for t in ids]
    assert choice["text"].startswith(tok.decode(ids)) and lp["text_offset"][0] == 0
    assert lp["text_offset"] == sorted(lp["text_offset"])
    if max_tokens:
        assert lp["tokens"][len(ids)] == tok.decode([res.token_ids[0]])
    assert r.json()["usage"]["completion_tokens"] == max_tokens


def test_echo_streamed_and_through_the_openai_client(srv, reference):
    client = srv.client()
    ids = [9, 40, 22, 71, 3]
    whole = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=2, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=2, max_tokens=2,
                                            temperature=0, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert text == whole.choices[0].text
    assert streamed == whole.choices[0].logprobs.token_logprobs and streamed[0] is None
    want, _ = _engine_prompt_logprobs(reference, ids, 2)
    assert streamed[1:len(ids)] == pytest.approx([w.logprob for w in want[1:len(ids)]], abs=1e-5)
    # echo without logprobs: the prompt's text before the completion's, nothing scored
    plain = client.completions.create(model=MODEL, prompt="Hello there", echo=True, max_tokens=2, temperature=0)
    assert plain.choices[0].text.startswith("Hello there") and plain.choices[0].logprobs is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_batch_of_prompts_is_one_choice_each_as_if_sent_alone(srv, stream):
    """prompt: [[ids], [ids], ...] (and lists of texts), as lm-eval batches loglikelihood requests:
    choice i is prompt i's, equal to that prompt sent alone; usage is the sum."""
    batches = [[[5, 17, 33], [9, 40, 22, 71, 3], [61]], ["Hello", "Once upon a time"]]
    for prompts in batches:
        common = {"model": MODEL, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
        alone = [srv.post("/v1/completions", dict(common, prompt=p)).json() for p in prompts]
        if not stream:
            r = srv.post("/v1/completions", dict(common, prompt=prompts))
            assert r.status_code == 200, r.text
            body = r.json()
            choices = body["choices"]
        else:
            chunks = list(srv.client().completions.create(prompt=prompts, stream=True,
                                                          stream_options={"include_usage": True}, **common))
            body = {"usage": chunks[-1].usage.model_dump()}
            choices = [{"index": i, "text": "", "logprobs": {"token_logprobs": []}, "finish_reason": None}
                       for i in range(len(prompts))]
            for c in chunks[:-1]:
                for ch in c.choices:
                    choices[ch.index]["text"] += ch.text
                    choices[ch.index]["logprobs"]["token_logprobs"] += ch.logprobs.token_logprobs
                    choices[ch.index]["finish_reason"] = ch.finish_reason or choices[ch.index]["finish_reason"]
        assert [c["index"] for c in choices] == list(range(len(prompts)))
        for c, a in zip(choices, alone):
            assert c["text"] == a["choices"][0]["text"] and c["finish_reason"] == a["choices"][0]["finish_reason"]
            assert c["logprobs"]["token_logprobs"] == pytest.approx(a["choices"][0]["logprobs"]["token_logprobs"],
                                                                    abs=1e-5)
        for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
            assert body["usage"][key] == sum(a["usage"][key] for a in alone)
    srv.wait_idle()


def test_a_repeated_chat_reports_its_cached_tokens(srv, reference):
    """The same conversation twice: the second time its prompt comes from the prefix cache
    (usage.prompt_tokens_details.cached_tokens, whole and in the streamed usage chunk, and the
    Prometheus counters say so) and the reply is unchanged."""
    from prometheus_client.parser import text_string_to_metric_families

    def metrics():
        return {s.name: s.value for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)
                for s in fam.samples}

    client = srv.client()
    msgs = [{"role": "system", "content": "You answer briefly. " * 4}, {"role": "user", "content": "why is the sky blue?"}]
    first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    before = metrics()
    again = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0)
    after = metrics()
    prompt = first.usage.prompt_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert prompt > 64 and first.usage.prompt_tokens_details.cached_tokens == 0
    assert prompt - 32 <= cached < prompt and cached % 32 == 0 or cached == prompt - 1, (cached, prompt)
    assert again.choices[0].message.content == first.choices[0].message.content
    assert after["graphkiln_prefix_cache_hit_tokens_total"] - before["graphkiln_prefix_cache_hit_tokens_total"] == cached
    assert after["graphkiln_prefix_cache_bytes"] > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == cached
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == first.choices[0].message.content


def test_without_the_prefix_cache_nothing_is_cached_or_counted(artifact):
    msgs = [{"role": "system", "content": "You answer briefly. " * 4}, {"role": "user", "content": "why?"}]
    with serving(artifact, prefix_cache=False) as s:
        client = s.client()
        replies = [client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
                   for _ in range(2)]
        assert [r.usage.prompt_tokens_details.cached_tokens for r in replies] == [0, 0]
        assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
        assert "graphkiln_prefix_cache" not in httpx.get(s.url + "/metrics").text
