"""Pipeline stages in Ray actors (issue 15): ``Engine.load(ART, distributed="ray")``.

The reference is the same staged artifact chained in this process (``runtime.backends.stages``; itself
at parity with the single-graph artifact in test_stages): the Ray-run engine must give the same
greedy tokens and logits (within 1e-5), through ``generate`` and through the continuous-batching
scheduler (slot ranges from first_slot > 0, releases that move rows). Each stage's actor is
given a directory holding only ``manifest.json`` and that stage's files, so a stage process that
opened any other stage's file would fail to load. One local Ray cluster for the module.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                               reason="Ray is not installed (pip install 'graphkiln[distributed]')")

# (checkpoint, stages): the conv/attention hybrid and the gated-delta-net one (conv and recurrent
# state rows are cleared on claim and moved on release: the slot replay matters most for them; the
# dense model runs in the kill test)
CASES = [("lfm2", 2), ("qwen3_5", 2)]


@pytest.fixture(scope="module")
def cluster():
    import signal

    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'graphkiln[distributed]')")
    sigterm = signal.getsignal(signal.SIGTERM)  # ray.init installs sys.exit for SIGTERM, for good
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=True)
    signal.signal(signal.SIGTERM, sigterm)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def staged(tiny, tmp_path_factory):
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    made = {}

    def get(name: str, stages: int):
        if (name, stages) not in made:
            case = tiny(name, "onnxruntime")
            out = tmp_path_factory.mktemp("raystaged") / f"{name}-{stages}"
            manifest = export_model(str(case.checkpoint), out,
                                    ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, stages=stages))
            made[name, stages] = (case, out, manifest)
        return made[name, stages]

    return get


def _stage_dirs(art, manifest, root) -> tuple[str, ...]:
    """Per stage a directory with manifest.json and that stage's files only."""
    dirs = []
    for k, st in enumerate(manifest.stages):
        d = root / f"stage{k}"
        d.mkdir()
        for rel in ("manifest.json", *st.files):
            shutil.copy2(art / rel, d / rel)
        dirs.append(str(d))
    return tuple(dirs)


def _greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, stop_token_ids=(), **kw)


@needs_ray
@pytest.mark.parametrize("name,stages", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_ray_stages_match_in_process(cluster, staged, tmp_path, name, stages):
    from graphkiln.runtime.backends.distributed import RayOptions
    from graphkiln.runtime.request.scheduler import Scheduler

    case, art, manifest = staged(name, stages)
    local = Engine.load(art, prefix_cache=False)
    # prefix blocks of 4 tokens: the repeated prompts below start from cached blocks on every stage
    dist = Engine.load(art, threads=1, distributed=RayOptions(stage_dirs=_stage_dirs(art, manifest, tmp_path)),
                       prefix_block_size=4)
    try:
        # each stage in its own process, holding only its own layers' state
        infos = dist.decoder.pipeline.call("info")
        assert len({i["pid"] for i in infos} | {os.getpid()}) == stages + 1

        prompts = case.prompts([7, 3, 12], salt=5)
        config = _greedy(32, output_logits=True)
        for a, b in zip(local.generate(prompts, config), dist.generate(prompts, config)):
            assert b.token_ids == a.token_ids and len(a.token_ids) == 32
            np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
        want = [r.token_ids for r in local.generate(prompts, _greedy(32))]  # the folded next_token path
        assert [r.token_ids for r in dist.generate(prompts, _greedy(32))] == want
        for st, info in zip(manifest.stages, dist.decoder.pipeline.call("info")):
            assert set(info["layers"]) == {l for s in st.states for l in s.layers} and info["live"] == 0

        # continuous batching: decode rows and a prefill range (first_slot > 0) run as separate
        # forwards, releases move rows; every stage replays the same slot moves
        more = case.prompts([9, 4, 15, 6], salt=6)
        alone = [local.generate(p, _greedy(12))[0].token_ids for p in more]
        sched = Scheduler(dist, max_batch=3, step_tokens=8)
        sched.start()
        try:
            handles = [sched.submit(p, _greedy(12)) for p in more]
            got = [h.result(timeout=60).token_ids for h in handles]
        finally:
            sched.shutdown(30)
        assert got == alone
        assert [i["live"] for i in dist.decoder.pipeline.call("info")] == [0] * stages

        # prefix reuse across the stages: a second turn starts from the first turn's blocks, each
        # stage restoring its own layers' rows (and conv snapshots) under the driver's block ids
        first = case.prompts([14], salt=8)[0]
        reply = dist.generate(first, _greedy(12))[0]
        second = first + reply.token_ids + [5, 6, 7]
        got = dist.generate(second, _greedy(12, output_logits=True))[0]
        want = local.generate(second, _greedy(12, output_logits=True))[0]
        assert got.token_ids == want.token_ids and got.cached_tokens >= 16, got.cached_tokens
        np.testing.assert_allclose(got.logits, want.logits, rtol=0, atol=1e-5)
    finally:
        dist.decoder.close()


@needs_ray
def test_killed_stage_fails_the_request_and_the_next_is_served(cluster, staged):
    from graphkiln.runtime.backends.distributed import StageFailed

    case, art, manifest = staged("qwen3_mixed_sliding", 2)
    prompts = case.prompts([5, 9], salt=7)
    want = [r.token_ids for r in Engine.load(art).generate(prompts, _greedy(16))]
    dist = Engine.load(art, threads=1, distributed="ray")
    try:
        pipeline = dist.decoder.pipeline
        before = pipeline.call("info")
        stream = dist.stream(prompts, _greedy(32))
        for _ in range(4):
            next(stream)
        assert dist.pool.live == 2
        cluster.kill(pipeline.actors[1], no_restart=False)
        deadline = time.monotonic() + 30
        while _alive(before[1]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        lo, hi = manifest.stages[1].layers
        with pytest.raises(StageFailed, match=rf"^pipeline stage 1 \(layers {lo}:{hi}\) stopped mid-generation") as info:
            for _ in stream:
                pass
        assert "\n" not in str(info.value)
        # the request's slots are released on the survivor; the restarted stage holds none
        after = pipeline.call("info")
        assert after[0]["incarnation"] == before[0]["incarnation"] and after[0]["live"] == 0
        assert after[1]["incarnation"] != before[1]["incarnation"] and after[1]["live"] == 0
        assert after[1]["pid"] != before[1]["pid"] and dist.pool.live == 0
        # the next request is served by the restarted stage, with the same tokens
        assert [r.token_ids for r in dist.generate(prompts, _greedy(16))] == want
    finally:
        dist.decoder.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_distributed_without_ray_is_one_line_and_writes_nothing(staged, tmp_path):
    """Ray made unimportable in a fresh interpreter (``sys.modules["ray"] = None``: ``import
    ray`` raises ImportError, as when it is not installed), through the CLI and the API."""
    _, art, _ = staged("qwen3_mixed_sliding", 2)
    before = sorted((p.relative_to(art), p.stat().st_mtime_ns) for p in art.rglob("*"))
    work = tmp_path / "cwd"
    work.mkdir()
    code = ("import sys; sys.modules['ray'] = None\n"
            "from graphkiln.cli import main\n"
            f"code = main(['run', {str(art)!r}, '--prompt-ids', '3,4,5', '--distributed', 'ray'])\n"
            "from graphkiln.runtime import Engine\n"
            "try:\n"
            f"    Engine.load({str(art)!r}, distributed='ray')\n"
            "except Exception as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))\n"
            "sys.exit(code)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=work, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 2, proc.stderr
    line = "--distributed ray needs Ray, which is not installed: pip install 'graphkiln[distributed]'"
    assert proc.stderr == f"error: {line}\n"
    assert proc.stdout == f"GraphkilnError: {line}\n"
    assert sorted((p.relative_to(art), p.stat().st_mtime_ns) for p in art.rglob("*")) == before
    assert list(work.iterdir()) == []


@needs_ray
def test_a_local_cluster_leaves_the_sigterm_handler_in_place(staged):
    """ray.init replaces the process's SIGTERM handler with sys.exit (and keeps it after
    shutdown); an Engine that starts a local cluster puts the caller's handler back, so
    ``serve --distributed ray`` still drains on SIGTERM. In a fresh interpreter: no cluster yet."""
    case, art, _ = staged("qwen3_mixed_sliding", 2)
    code = ("import signal, sys\n"
            "mine = lambda *a: None\n"
            "signal.signal(signal.SIGTERM, mine)\n"
            "from graphkiln.runtime import Engine\n"
            f"engine = Engine.load({str(art)!r}, threads=1, distributed='ray')\n"
            "sys.exit(0 if signal.getsignal(signal.SIGTERM) is mine else 3)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_distributed_choice_is_checked(staged):
    _, art, _ = staged("qwen3_mixed_sliding", 2)
    with pytest.raises(GraphkilnError, match="distributed 'mpi' is not supported: choose one of ray"):
        Engine.load(art, distributed="mpi")


@needs_ray
def test_stage_directory_without_its_file_is_one_line(cluster, staged, tmp_path):
    from graphkiln.runtime.backends.distributed import RayOptions

    _, art, manifest = staged("qwen3_mixed_sliding", 2)
    dirs = _stage_dirs(art, manifest, tmp_path)
    data = next(f for f in manifest.stages[1].files if f.endswith(".data"))
    os.remove(os.path.join(dirs[1], data))
    with pytest.raises(GraphkilnError, match=rf"^stage 1 file {data} in .* is missing or fails its sha256 check") as info:
        Engine.load(art, threads=1, distributed=RayOptions(stage_dirs=dirs))
    assert "\n" not in str(info.value)


@needs_ray
def test_ray_stages_encode_images_in_the_first_stage_actor(cluster, staged, tmp_path):
    """A staged VLM: the driver preprocesses and caches, the first stage's actor (which alone holds
    the vision graph's files) encodes; tokens and logits equal the in-process chain's."""
    from graphkiln.runtime.backends.distributed import RayOptions

    case, art, manifest = staged("llava_clip", 2)
    local = Engine.load(art)
    node = next(n for n in cluster.nodes() if n["Alive"])  # pinned: stage 0 by address, stage 1 by id
    dist = Engine.load(art, threads=1, distributed=RayOptions(stage_dirs=_stage_dirs(art, manifest, tmp_path),
                                                              stage_nodes=(node["NodeManagerAddress"], node["NodeID"])))
    try:
        assert [i["node_id"] for i in dist.decoder.pipeline.call("info")] == [node["NodeID"]] * 2
        t = manifest.vision.image_token_id
        rng = np.random.default_rng(3)
        text = [int(i) for i in rng.integers(3, t, 9)]
        prompts, images = [text[:3] + [t] + text[3:], text[2:]], [[rng.integers(0, 256, (40, 52, 3), np.uint8)], None]
        config = _greedy(16, output_logits=True)
        for a, b in zip(local.generate(prompts, config, images=images), dist.generate(prompts, config, images=images)):
            assert b.token_ids == a.token_ids and len(b.token_ids) == 16
            np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
        assert [i["vision_runs"] for i in dist.decoder.pipeline.call("info")] == [1, 0]
    finally:
        dist.decoder.close()


@needs_ray
def test_stage_placement_refusals_are_one_line(cluster, staged, capsys):
    from cli_contract import assert_one_error, run_cli
    from graphkiln.runtime.backends.distributed import RayOptions

    case, art, manifest = staged("llava_clip", 2)
    node = next(n for n in cluster.nodes() if n["Alive"])["NodeID"]
    for nodes, needle in [(("10.255.0.9", node), "not an alive node"), ((node,), "one node per stage")]:
        with pytest.raises(GraphkilnError, match=needle) as exc:
            Engine.load(art, distributed=RayOptions(stage_nodes=nodes))
        assert "\n" not in str(exc.value)
    code, _, err = run_cli(capsys, "run", art, "--prompt-ids", "5,6", "--stage-nodes", f"{node},{node}")
    assert_one_error(code, err, "--stage-nodes", "--distributed ray")


# -- joining a cluster at an address (--ray-address / RayOptions.address) ------------------------


def _free_port() -> int:
    """A TCP port nothing listens on, on every interface (Ray dials 127.0.0.1 as this host's IP)."""
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _run_cli(art, address: str, timeout: float) -> subprocess.Popen:
    """``graphkiln run ART --distributed ray --ray-address ADDRESS --ray-timeout TIMEOUT`` in a
    fresh interpreter (no Ray connection yet), stderr piped."""
    return subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "run", str(art), "--prompt-ids", "3,4,5",
                             "--distributed", "ray", "--ray-address", address, "--ray-timeout", f"{timeout:g}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})


@pytest.fixture
def not_ray():
    """A port that accepts TCP connections and never answers (nothing a Ray head would say):
    ray.init itself is reached, and blocks in native code."""
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(64)
        yield s.getsockname()[1]


@needs_ray
@pytest.mark.parametrize("kind", ["refused", "not_ray"])
def test_an_unreachable_ray_address_is_one_line_within_the_timeout(staged, not_ray, kind):
    """Ray alone retried such an address for minutes, printing only its own GCS warnings."""
    _, art, _ = staged("qwen3_mixed_sliding", 2)
    address = f"127.0.0.1:{_free_port() if kind == 'refused' else not_ray}"
    start = time.monotonic()
    proc = _run_cli(art, address, 2)
    _, err = proc.communicate(timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    lines = [l for l in err.splitlines() if l.strip()]
    assert lines[0] == f"connecting to Ray at {address} (up to 2 s) ..."  # before any line of Ray's
    assert [l for l in lines if l.startswith("error:")] == [lines[-1]], err
    want = (f"error: no Ray cluster answered at {address}" if kind == "refused"
            else f"error: the Ray cluster at {address} did not accept this driver within 2 s")
    assert lines[-1].startswith(want) and "--ray-timeout" in lines[-1], err
    if kind == "refused":  # Ray is never called: its warnings cannot appear
        assert len(lines) == 2 and "ray start --head" in lines[-1], err
    assert 2 <= took < 2 + 20, took  # the deadline, plus a fresh interpreter's imports on a busy machine


@needs_ray
@pytest.mark.parametrize("kind", ["refused", "not_ray"])
def test_sigterm_while_joining_a_cluster_ends_the_run_at_once(staged, not_ray, kind):
    """Waiting on the port (refused) and inside ray.init's native call (not_ray: before, SIGTERM
    waited ~25 s for that call to return)."""
    import signal

    _, art, _ = staged("qwen3_mixed_sliding", 2)
    address = f"127.0.0.1:{_free_port() if kind == 'refused' else not_ray}"
    proc = _run_cli(art, address, 120)
    assert proc.stderr.readline().startswith("connecting to Ray at")
    time.sleep(1.5)  # well into the connect: the port tried (not_ray: ray.init running in its thread)
    proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        proc.wait(timeout=20)
    finally:
        proc.kill()
    took = time.monotonic() - sent
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.splitlines()[-1] == "error: interrupted (SIGTERM)" and "Traceback" not in err, err
    assert took < 5, took


@needs_ray
def test_an_unreachable_ray_address_through_the_api_is_one_line(staged):
    """``RayOptions(address=, connect_timeout_s=)``, in a fresh interpreter (no Ray connection)."""
    from graphkiln.runtime.backends.distributed import RayOptions

    _, art, _ = staged("qwen3_mixed_sliding", 2)
    address = f"127.0.0.1:{_free_port()}"
    code = ("import sys, time\n"
            "from graphkiln.runtime import Engine\n"
            "from graphkiln.runtime.backends.distributed import RayOptions\n"
            "start = time.monotonic()\n"
            "try:\n"
            f"    Engine.load({str(art)!r}, distributed=RayOptions(address={address!r}, connect_timeout_s=1.5))\n"
            "except Exception as e:\n"
            "    print(type(e).__name__ + ': ' + str(e))\n"
            "import ray\n"
            "print(time.monotonic() - start, ray.is_initialized())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    error, timing = proc.stdout.splitlines()
    assert error.startswith(f"GraphkilnError: no Ray cluster answered at {address}") and "within 1.5 s" in error
    took, initialized = timing.split()
    assert 1.5 <= float(took) < 10 and initialized == "False"
    for bad in (0, -1.0, float("nan"), float("inf"), True):  # refused before Ray is imported or dialled
        with pytest.raises(GraphkilnError, match=r"^RayOptions.connect_timeout_s must be a finite number"):
            Engine.load(art, distributed=RayOptions(address=address, connect_timeout_s=bad))
        with pytest.raises(GraphkilnError, match=r"^RayOptions.start_timeout_s must be a finite number"):
            Engine.load(art, distributed=RayOptions(address=address, start_timeout_s=bad))


@needs_ray
def test_a_timed_out_join_refuses_a_second_one_while_it_runs(staged, not_ray):
    """ray.init cannot be cancelled: after the deadline its thread runs on, and a second join in
    the same process (which would share Ray's process-wide state with it) is refused."""
    _, art, _ = staged("qwen3_mixed_sliding", 2)
    code = ("import time\n"
            "from graphkiln.runtime import Engine\n"
            "from graphkiln.runtime.backends.distributed import RayOptions\n"
            "for _ in range(2):\n"
            "    start = time.monotonic()\n"
            "    try:\n"
            f"        Engine.load({str(art)!r}, distributed=RayOptions(address='127.0.0.1:{not_ray}', "
            "connect_timeout_s=1.5))\n"
            "    except Exception as e:\n"
            "        print(f'{time.monotonic() - start:.2f}', type(e).__name__ + ': ' + str(e))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.splitlines()
    assert first.split(" ", 1)[1].startswith(f"GraphkilnError: the Ray cluster at 127.0.0.1:{not_ray} did not accept")
    assert 1.5 <= float(first.split()[0]) < 10
    assert second.split(" ", 1)[1].startswith(f"GraphkilnError: an earlier attempt to join the Ray cluster at "
                                              f"127.0.0.1:{not_ray} is still running in this process")
    assert float(second.split()[0]) < 1


@pytest.mark.parametrize("argv,needles", [
    (["--stage-dirs", ","], ["--stage-dirs ','", "empty entry"]),
    (["--stage-dirs", ""], ["--stage-dirs ''", "empty entry"]),
    (["--stage-dirs", "a,,b"], ["--stage-dirs 'a,,b'", "empty entry"]),
    (["--stage-nodes", "10.0.0.1, "], ["--stage-nodes '10.0.0.1, '", "empty entry"]),
    (["--stage-nodes", ""], ["--stage-nodes ''", "empty entry"]),
    (["--ray-timeout", "5"], ["--ray-timeout", "--ray-address"]),
    (["--ray-address", " "], ["--ray-address is empty"]),
], ids=["dirs-comma", "dirs-empty", "dirs-gap", "nodes-blank", "nodes-empty", "timeout-alone", "address-blank"])
def test_ray_flags_with_empty_entries_are_one_line(staged, capsys, argv, needles):
    """An empty --stage-dirs entry was taken as '.' (the current directory), an empty
    --stage-nodes one as a node named ''. Refused before any artifact or Ray is opened."""
    from cli_contract import assert_one_error, run_cli

    _, art, _ = staged("qwen3_mixed_sliding", 2)
    code, _, err = run_cli(capsys, "run", art, "--prompt-ids", "5,6", "--distributed", "ray", *argv)
    assert_one_error(code, err, *needles, alone=True)


def test_ray_timeout_must_be_a_positive_number(staged, capsys):
    from cli_contract import assert_one_error, run_cli

    _, art, _ = staged("qwen3_mixed_sliding", 2)
    for value in ("0", "-3", "nan", "soon"):
        code, _, err = run_cli(capsys, "run", art, "--prompt-ids", "5,6", "--distributed", "ray",
                               "--ray-address", "auto", "--ray-timeout", value)
        assert_one_error(code, err, "--ray-timeout", alone=True)


@needs_ray
def test_stage_actors_hold_their_layers_lora_stacks(cluster, lora_case, tmp_path):
    """Each stage actor binds its own layers' adapter stacks, filled from the driver's slots as adapters
    load; a restarted actor gets every loaded slot again."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    art = tmp_path / "lora-staged"
    export_model(str(lora_case.checkpoint), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, stages=2,
                                                                lora_rank=8, max_loras=2))
    local, dist = Engine.load(art), Engine.load(art, threads=1, distributed="ray")
    try:
        for engine in (local, dist):
            for name, path in lora_case.adapters.items():
                engine.load_adapter(name, path)
        prompt = [5, 9, 3, 7, 11]
        want = {n: local.generate(prompt, _greedy(12, adapter=n))[0].token_ids for n in ("alpha", "beta", None)}
        assert len(set(map(tuple, want.values()))) == 3  # the adapters change the tokens
        for n, tokens in want.items():
            assert dist.generate(prompt, _greedy(12, adapter=n))[0].token_ids == tokens, n
        pipeline = dist.decoder.pipeline
        pid = pipeline.call("info")[1]["pid"]
        cluster.kill(pipeline.actors[1], no_restart=False)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(GraphkilnError):  # the first call meets the restart
            dist.generate(prompt, _greedy(4, adapter="beta"))
        assert dist.generate(prompt, _greedy(12, adapter="beta"))[0].token_ids == want["beta"]
    finally:
        dist.decoder.close()
