"""LoRA adapters through ``graphkiln serve`` and ``graphkiln run --lora``, on the ``lora_case``
fixture (a tiny Llama exported with ``--lora-rank 8 --max-loras 2``, PEFT adapters "alpha" and
"beta"). One server per module, with an API key, started as ``serve --lora alpha=DIR --lora
beta=DIR`` starts it (``server.load_adapters``); the ``openai`` client for what it covers, httpx
for the adapter routes. References come from a separate ``Engine`` (no prefix cache, so a server
that reused the base model's cached rows for an adapter's request would differ from it).
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from cli_contract import assert_one_error, run_cli  # noqa: E402
from graphkiln.runtime import Engine, GenerationConfig  # noqa: E402
from conftest import add_chat_template  # noqa: E402
from test_serve import CHAT_TEMPLATE, KEY, MODEL, serving  # noqa: E402

N = 8  # new tokens per request (greedy, EOS ignored: every request runs its full length)
# the last is over one prefix-cache block (32 tokens): the server keeps the base model's rows of it,
# which an adapter's request must never reuse
PROMPTS = [[5, 17, 42, 9, 33], [7, 7, 101, 64], [12, 3, 250, 18, 90, 4], [(7 * i + 3) % 300 + 5 for i in range(40)]]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def adapters(lora_case):
    return {name: lora_case.adapters[name] for name in ("alpha", "beta")}


@pytest.fixture(scope="module")
def artifact(lora_case, tmp_path_factory):
    """lora_case's artifact, with test_serve's chat template added when it has a tokenizer."""
    art = tmp_path_factory.mktemp("serve_lora") / "artifact"
    shutil.copytree(lora_case.artifact, art)
    if (art / "tokenizer.json").exists() and not (art / "chat_template.jinja").exists():
        add_chat_template(art, CHAT_TEMPLATE)
    return art


@pytest.fixture(scope="module")
def srv(artifact, adapters):
    with serving(artifact, key=KEY, max_batch=4, lora=tuple((n, str(p)) for n, p in adapters.items()),
                 lora_updates=True) as s:
        yield s


@pytest.fixture(scope="module")
def reference(artifact, adapters):
    engine = Engine.load(artifact, threads=1, prefix_cache=False)
    for name, path in adapters.items():
        engine.load_adapter(name, path)
    return engine


def _want(reference, prompt, adapter: str | None) -> list[int]:
    cfg = GenerationConfig(max_new_tokens=N, do_sample=False, stop_token_ids=(), adapter=adapter)
    return reference.generate(prompt, cfg)[0].token_ids


def _complete(client, model: str, prompt, stream: bool = False) -> tuple[list[int], str]:
    """(generated ids, response model) of one greedy completion."""
    extra = {"return_token_ids": True, "ignore_eos": True}
    if not stream:
        r = client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, extra_body=extra)
        return r.choices[0].token_ids, r.model
    ids, seen = [], set()
    for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=N, temperature=0, stream=True,
                                           extra_body=extra):
        seen.add(chunk.model)
        for c in chunk.choices:
            ids += c.token_ids
    assert len(seen) == 1, seen
    return ids, seen.pop()


def test_model_selects_the_adapter(srv, reference):
    """Requests for the base model and both adapters, all at once (so one step holds rows of
    different adapters), streaming and not: each equals the Engine with that adapter, and the
    adapters' tokens differ from the base model's."""
    client = srv.client()
    plans = [(model, prompt, stream) for prompt in PROMPTS for model in (MODEL, "alpha", "beta")
             for stream in (False, True)]
    with ThreadPoolExecutor(len(plans)) as pool:
        got = list(pool.map(lambda p: _complete(client, *p), plans))
    for (model, prompt, _), (ids, answered) in zip(plans, got):
        assert answered == model
        assert ids == _want(reference, prompt, None if model == MODEL else model), (model, prompt)
    for prompt in (PROMPTS[0], PROMPTS[-1]):
        base = _want(reference, prompt, None)
        assert _want(reference, prompt, "alpha") != base and _want(reference, prompt, "beta") != base
    # the long prompt's first block is cached by now (the base model's request reuses it); each
    # adapter's request still gets its own rows (keys salted by the adapter)
    r = srv.post("/v1/completions", {"model": MODEL, "prompt": PROMPTS[-1], "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32, r.text
    for model in ("alpha", "beta"):
        assert _complete(client, model, PROMPTS[-1])[0] == _want(reference, PROMPTS[-1], model)
    srv.wait_idle()


def test_chat_with_an_adapter(srv, reference, artifact):
    """The chat route takes the adapter too, streaming or not: the same tokens as the Engine with
    that adapter gives from the prompt ids the template rendered."""
    if not (artifact / "tokenizer.json").exists():
        pytest.skip("the lora_case artifact has no tokenizer: chat needs one")
    client = srv.client()
    msgs = [{"role": "user", "content": "hello there"}]
    prompt_ids = None
    for stream in (False, True):
        extra = {"return_token_ids": True, "ignore_eos": True}
        if stream:
            chunks = list(client.chat.completions.create(model="beta", messages=msgs, max_tokens=N, temperature=0,
                                                         stream=True, extra_body=extra))
            ids = [t for c in chunks for ch in c.choices for t in (getattr(ch, "token_ids", None) or [])]
            assert {c.model for c in chunks} == {"beta"}
        else:
            r = client.chat.completions.create(model="beta", messages=msgs, max_tokens=N, temperature=0,
                                               extra_body=extra)
            ids, prompt_ids = r.choices[0].token_ids, r.prompt_token_ids
            assert r.model == "beta"
        assert ids == _want(reference, prompt_ids, "beta")


def test_unknown_model_is_a_404(srv):
    client = srv.client()
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as err:
            r = client.completions.create(model="gamma", prompt=PROMPTS[0], max_tokens=2, stream=stream)
            if stream:
                list(r)
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
        assert "'gamma' is not served here" in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="gamma", messages=[{"role": "user", "content": "hi"}], stream=stream)
    srv.wait_idle()


def test_models_lists_the_adapters(srv, adapters):
    listed = srv.client().models.list().data
    assert [m.id for m in listed] == [MODEL, "alpha", "beta"]
    body = httpx.get(srv.url + "/v1/models", headers=srv.headers).json()
    base, *loras = body["data"]
    assert base["parent"] is None and base["object"] == "model"
    for card, (name, path) in zip(loras, adapters.items()):
        assert card["id"] == name and card["object"] == "model"
        assert card["root"] == str(path) and card["parent"] == MODEL
        assert card["max_model_len"] == base["max_model_len"]
    # /openapi.json's model is every served name
    doc = httpx.get(srv.url + "/openapi.json", headers=srv.headers).json()
    assert doc["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"] == [MODEL, "alpha", "beta"]


def _error(r: "httpx.Response", status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code, err
    assert err["message"] and "\n" not in err["message"]
    return err["message"]


def test_load_use_unload_a_third_adapter(srv, reference, adapters, tmp_path):
    """"gamma" (beta's weights under another name) through the routes: refused while both slots
    hold adapters, loaded once beta is unloaded, served (as beta's tokens), listed, unloaded, then
    unknown; beta is loaded back at the end."""
    gamma = tmp_path / "gamma"
    shutil.copytree(adapters["beta"], gamma)
    client = srv.client()
    _error(srv.post(LOAD, {"lora_name": "gamma", "lora_path": str(gamma)}), 409, "lora_slots_full")
    r = srv.post(UNLOAD, {"lora_name": "beta"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'beta' removed successfully."
    r = srv.post(LOAD, {"lora_name": "gamma", "lora_path": str(gamma)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'gamma' added successfully."
    try:
        assert [m.id for m in client.models.list().data] == [MODEL, "alpha", "gamma"]
        assert next(m for m in httpx.get(srv.url + "/v1/models", headers=srv.headers).json()["data"]
                    if m["id"] == "gamma")["root"] == str(gamma)
        for stream in (False, True):
            ids, model = _complete(client, "gamma", PROMPTS[1], stream)
            assert model == "gamma" and ids == _want(reference, PROMPTS[1], "beta")
        with pytest.raises(openai.NotFoundError):
            _complete(client, "beta", PROMPTS[1])
        _error(srv.post(LOAD, {"lora_name": "gamma", "lora_path": str(gamma)}), 400, "lora_adapter_exists")
        _error(srv.post(LOAD, {"lora_name": MODEL, "lora_path": str(gamma)}), 400, "invalid_lora_name")
    finally:
        assert srv.post(UNLOAD, {"lora_name": "gamma"}).status_code == 200
        assert srv.post(LOAD, {"lora_name": "beta", "lora_path": str(adapters["beta"])}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "gamma", PROMPTS[1])
    assert [m.id for m in client.models.list().data] == [MODEL, "alpha", "beta"]
    assert _complete(client, "beta", PROMPTS[2])[0] == _want(reference, PROMPTS[2], "beta")
    srv.wait_idle()


def test_adapter_route_refusals(srv):
    # unloading a name not loaded: 404 (twice over: never loaded, and the base model)
    assert "'gamma'" in _error(srv.post(UNLOAD, {"lora_name": "gamma"}), 404, "lora_adapter_not_found")
    _error(srv.post(UNLOAD, {"lora_name": MODEL}), 404, "lora_adapter_not_found")
    # the bodies are strict, as every request body
    _error(srv.post(LOAD, {"lora_name": "delta"}), 400, "missing_field")
    _error(srv.post(LOAD, {"lora_name": "", "lora_path": "x"}), 400, "invalid_value")
    _error(srv.post(LOAD, {"lora_name": "d", "lora_path": "a\x00b"}), 400, "invalid_value")
    _error(srv.post(UNLOAD, {"lora_name": "alpha", "lora_int_id": 1}), 400, "unknown_field")
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


def test_bad_adapter_is_a_400_with_one_line(srv, adapters, tmp_path):
    """With a free slot, a refused adapter is the engine's one line as a 400."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    assert srv.post(UNLOAD, {"lora_name": "beta"}).status_code == 200
    try:
        for path in (broken, tmp_path / "missing"):
            message = _error(srv.post(LOAD, {"lora_name": "delta", "lora_path": str(path)}), 400,
                             "invalid_lora_adapter")
            assert str(path) in message
    finally:
        assert srv.post(LOAD, {"lora_name": "beta", "lora_path": str(adapters["beta"])}).status_code == 200
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


@pytest.mark.parametrize("name", [" gamma", "gamma ", "\tgamma", "gam\nma", "gamma\x1b[2J", "\u2028", "\u00a0gamma"])
def test_load_refuses_an_unusable_name_as_lora_name(srv, adapters, name):
    """The route applies the CLI's name rule (runtime.lora.check_adapter_name): a padded name or
    one with a control character is a 400 about lora_name, whatever lora_path holds."""
    assert srv.post(UNLOAD, {"lora_name": "beta"}).status_code == 200
    try:
        r = srv.post(LOAD, {"lora_name": name, "lora_path": str(adapters["beta"])})
        message = _error(r, 400, "invalid_lora_name")
        assert r.json()["error"]["param"] == "lora_name" and "not a usable name" in message
        assert "\x1b" not in message and "\u2028" not in message
        assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha"]
    finally:
        assert srv.post(LOAD, {"lora_name": "beta", "lora_path": str(adapters["beta"])}).status_code == 200


def test_load_of_hostile_paths_is_a_400_and_frees_the_route(srv, adapters, tmp_path):
    """A FIFO or /dev/zero in an adapter file's place, or a path too long for the file system, is a
    400 at once: the read never blocks while the adapter lock is held, so the next load goes on."""
    fifo_config = tmp_path / "fifo_config"
    shutil.copytree(adapters["beta"], fifo_config)
    (fifo_config / "adapter_config.json").unlink()
    os.mkfifo(fifo_config / "adapter_config.json")
    zero_weights = tmp_path / "zero_weights"
    shutil.copytree(adapters["beta"], zero_weights)
    (zero_weights / "adapter_model.safetensors").unlink()
    (zero_weights / "adapter_model.safetensors").symlink_to("/dev/zero")
    cases = [(fifo_config, "a FIFO"), (zero_weights, "a device"), (tmp_path / ("x" * 300), "too long"),
             (tmp_path / ("x" * 300) / "adapter", "too long")]
    assert srv.post(UNLOAD, {"lora_name": "beta"}).status_code == 200
    try:
        for path, needle in cases:
            try:
                r = httpx.post(srv.url + LOAD, json={"lora_name": "delta", "lora_path": str(path)},
                               headers=srv.headers, timeout=10)
            finally:  # a reader stuck opening the FIFO (the bug) gets EOF
                try:
                    os.close(os.open(fifo_config / "adapter_config.json", os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
            message = _error(r, 400, "invalid_lora_adapter")
            assert needle in message and r.json()["error"]["param"] == "lora_path", message
    finally:
        r = httpx.post(srv.url + LOAD, json={"lora_name": "beta", "lora_path": str(adapters["beta"])},
                       headers=srv.headers, timeout=10)
        assert r.status_code == 200, r.text
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


def test_adapter_routes_need_the_key(srv, adapters):
    body = {"lora_name": "delta", "lora_path": str(adapters["alpha"])}
    for path, headers in ((LOAD, {}), (LOAD, {"Authorization": "Bearer wrong"}), (UNLOAD, {})):
        r = httpx.post(srv.url + path, json=body if path == LOAD else {"lora_name": "alpha"}, headers=headers)
        _error(r, 401, "invalid_api_key")
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


def test_adapter_routes_are_off_unless_allowed(artifact, adapters):
    """The load route reads a directory the client names: without --allow-lora-updates both routes
    are a 403 naming the flag, and the served adapters stay as they are."""
    with serving(artifact, key=KEY, lora=(("alpha", str(adapters["alpha"])),)) as s:
        for path, body in ((LOAD, {"lora_name": "beta", "lora_path": str(adapters["beta"])}),
                           (UNLOAD, {"lora_name": "alpha"})):
            assert "--allow-lora-updates" in _error(s.post(path, body), 403, "lora_updates_disabled")
        assert [m.id for m in s.client().models.list().data] == [MODEL, "alpha"]


def test_unload_while_in_use_is_a_409(srv):
    """An adapter a running request holds (its slot counted, as the scheduler counts a request's)
    cannot be unloaded: 409; once released, it can."""
    engine = srv.server.config.app.state.graphkiln.engine
    slot = engine.adapters.acquire("alpha")
    try:
        assert "in use" in _error(srv.post(UNLOAD, {"lora_name": "alpha"}), 409, "lora_adapter_in_use")
    finally:
        engine.adapters.release(slot)
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


def test_unload_while_queued_is_a_409(srv, reference):
    """Requests for beta queued behind a full batch (as the completion route submits them) hold it:
    unloading it is a 409 naming the queued requests, and they then finish with beta's tokens."""
    scheduler = srv.server.config.app.state.graphkiln.scheduler
    long = GenerationConfig(max_new_tokens=100, do_sample=False, stop_token_ids=())
    busy = [scheduler.submit(PROMPTS[i % 3], long) for i in range(4)]  # max_batch 4: every slot
    queued = [scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=N, do_sample=False, stop_token_ids=(),
                                                            adapter="beta")) for _ in range(2)]
    try:
        # the stepping thread pauses at its next step while the test holds the scheduler's lock, so the
        # two stay queued (the busy four need 100 steps) while the route is asked to unload beta
        with scheduler._lock:
            assert sum(r.cfg.adapter == "beta" for r in scheduler._waiting) == 2
            message = _error(srv.post(UNLOAD, {"lora_name": "beta"}), 409, "lora_adapter_in_use")
        assert "in use by 2 queued or running request(s)" in message
        for h in queued:
            assert h.result(timeout=60).token_ids == _want(reference, PROMPTS[0], "beta")
    finally:
        for h in busy + queued:
            h.cancel()
        srv.wait_idle()
    assert [m.id for m in srv.client().models.list().data] == [MODEL, "alpha", "beta"]


# -- the CLI ----------------------------------------------------------------------------------


def test_run_with_lora(capsys, lora_case, reference, tmp_path):
    prompt = PROMPTS[0]
    code, out, err = run_cli(capsys, "run", lora_case.artifact, "--lora", lora_case.adapters["alpha"], "--prompt-ids",
                             ",".join(map(str, prompt)), "--max-new-tokens", N, "--greedy", "--ignore-eos",
                             "--show-ids", "--threads", 1)
    assert code == 0, err
    assert [int(t) for t in out.split()] == _want(reference, prompt, "alpha")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    for bad in (broken, tmp_path / "missing"):
        code, out, err = run_cli(capsys, "run", lora_case.artifact, "--lora", bad, "--prompt-ids", "1,2",
                                 "--threads", 1)
        assert_one_error(code, err, str(bad))
        assert out == ""


def hostile_adapters(adapters, root):
    """(adapter path, words of its one error line): FIFOs, a /dev/zero link, a directory in a file's
    place, over-long paths: each refused at once, none read or waited on."""
    def copy(name, file, kind):
        d = shutil.copytree(adapters["alpha"], root / name)
        (d / file).unlink()
        if kind == "fifo":
            os.mkfifo(d / file)
        elif kind == "zero":
            (d / file).symlink_to("/dev/zero")
        else:
            (d / file).mkdir()
        return d

    fifo_dir = root / "fifo_dir"
    os.mkfifo(fifo_dir)
    return [(copy("fifo_config", "adapter_config.json", "fifo"), "a FIFO, not a regular file"),
            (copy("fifo_weights", "adapter_model.safetensors", "fifo"), "a FIFO, not a regular file"),
            (copy("zero_config", "adapter_config.json", "zero"), "a device, not a regular file"),
            (copy("zero_weights", "adapter_model.safetensors", "zero"), "a device, not a regular file"),
            (copy("dir_weights", "adapter_model.safetensors", "dir"), "a directory, not a regular file"),
            (fifo_dir, "not a directory"),
            (root / ("x" * 300), "too long"),
            (root.joinpath(*["d" * 200] * 25), "too long")]


def unblock_fifos(root):
    """Open every FIFO under ``root`` for writing: a reader stuck opening one (the bug) gets EOF."""
    for fifo in [p for p in root.rglob("*") if p.is_fifo()]:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass


def run_cli_within(capsys, seconds, root, *argv):
    """``run_cli``, failing (and unblocking any FIFO under ``root``) if it has not returned in ``seconds``."""
    box = {}
    worker = threading.Thread(target=lambda: box.update(result=run_cli(capsys, *argv)), daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        unblock_fifos(root)
        worker.join(10)
        pytest.fail(f"graphkiln {argv[0]} was still running after {seconds} s (blocked reading the adapter)")
    return box["result"]


def test_run_and_serve_refuse_hostile_adapters_at_once(capsys, no_serving, lora_case, tmp_path):
    """``run --lora DIR`` and ``serve --lora NAME=DIR``: every hostile adapter path is one error line
    naming what is wrong, promptly (the reads never block)."""
    for i, (path, words) in enumerate(hostile_adapters(lora_case.adapters, tmp_path)):  # each command every other one
        argv = (["run", lora_case.artifact, "--lora", path, "--prompt-ids", "1,2", "--threads", 1] if i % 2 else
                ["serve", lora_case.artifact, "--port", 0, "--threads", 1, "--lora", f"a={path}"])
        code, out, err = run_cli_within(capsys, 20, tmp_path, *argv)
        assert_one_error(code, err, words)
        assert out == ""


@pytest.fixture
def no_serving(monkeypatch):
    """``graphkiln serve`` in process, failing the test instead of serving if it got that far."""
    import graphkiln.serve.server as server

    def refuse(*a, **k):
        raise AssertionError("graphkiln serve started serving")

    monkeypatch.setattr(server, "make_server", refuse)


def test_serve_lora_flag_refusals(capsys, no_serving, lora_case, tmp_path):
    art, alpha, beta = lora_case.artifact, lora_case.adapters["alpha"], lora_case.adapters["beta"]
    cases = [
        (["--lora", "alpha"], "NAME=DIR"),
        (["--lora", f"={alpha}"], "NAME=DIR"),
        (["--lora", "alpha="], "NAME=DIR"),
        (["--lora", f"a={alpha}", "--lora", f"a={beta}"], "given twice"),
        (["--model-name", "a", "--lora", f"a={alpha}"], "base model"),
        (["--lora", f"a={alpha}", "--lora", f"b={beta}", "--lora", f"c={beta}"], "--max-loras"),
        (["--lora", f"a={tmp_path / 'missing'}"], str(tmp_path / "missing")),
    ]
    for flags, needle in cases:
        code, out, err = run_cli(capsys, "serve", art, "--port", 0, "--threads", 1, *flags)
        assert_one_error(code, err, needle)
