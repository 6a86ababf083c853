"""Ray across two hosts, for real: two network stacks on this machine (``ip netns``).

The head node runs in this process's network namespace, bound to one end of a veth pair
(10.200.N.1); a worker node runs in a network namespace of its own, whose only link is the other
end (10.200.N.2): everything between the two nodes crosses that link, and cutting it is losing
the host. The driver (this process) joins the cluster at the head's address (``join_cluster``:
the threaded connect); a 2-stage artifact's stage 0 is pinned to the head, stage 1 to the worker
(``RayOptions.stage_nodes`` by IP), each stage directory holding only its own files.

Cases: tokens equal the single graph's; the worker node's stage process killed mid-request; the
link cut mid-request. Both fail the requests in flight with one ``StageFailed`` line and release
their slots on the surviving stage. The head's GCS checks node health every second and gives a
node up after 3 missed checks of 1 s (``RAY_health_check_*``; Ray's defaults take ~30 s or
more), so the lost host is noticed in seconds.

Lifecycle: one cluster for the module (``two_hosts``). Every process of it carries a token in
its environment; teardown (also after a failure) stops both ``ray start --block`` process
groups, kills whatever still carries the token and whatever is left in the namespace, deletes
the namespace and the veth, and then fails if any process with the token is still alive.
Skipped with the reason where Ray, ``ip`` or the right to create a namespace (root) is missing:
the probe really creates one. Measurements are printed (``pytest -s``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from graphkiln.runtime import Engine, GenerationConfig

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="network namespaces are Linux's")

HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
          "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"}
NODE_MEMORY = str(100 * 1024 * 1024)  # each node's object store: hidden states of a tiny model


@dataclass
class TwoHosts:
    ray: object
    address: str  # the head's GCS, 10.200.N.1:PORT
    head_ip: str
    worker_ip: str
    netns: str
    veth: str  # this namespace's end of the link
    head_node: str  # node ids
    worker_node: str
    start_s: float  # from `ray start --head` to the driver connected with both nodes alive


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _free_subnet() -> int:
    """N with no address in 10.200.N.0/24 here (so no route of this machine's is shadowed)."""
    used = _ip("-o", "-4", "addr", "show").stdout
    for n in range(os.getpid() % 200, 256):
        if f"10.200.{n}." not in used:
            return n
    pytest.skip("no free 10.200.N.0/24 subnet for the veth pair")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return s.getsockname()[1]


def _with_token(token: str) -> list[int]:
    """Live (not zombie) processes whose environment carries ``token``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"GRAPHKILN_TEST_CLUSTER={token}".encode() not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:  # exited meanwhile
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_gone(pids, within: float) -> list[int]:
    deadline = time.monotonic() + within
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group of a ``ray start --block`` (it stops its node's processes),
    SIGKILL what is left after a few seconds."""
    for sig, wait in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        return


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'graphkiln[distributed]')")
    from graphkiln.runtime.backends.distributed import INIT_KWARGS, join_cluster

    if shutil.which("ip") is None:
        pytest.skip("the ip command (iproute2) is not installed: apt-get install iproute2")
    tag = f"{os.getpid() % 100000}"
    netns, veth, peer = f"gk-hosts-{tag}", f"gkh{tag}", f"gkw{tag}"
    probe = _ip("netns", "add", netns, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a network namespace here (needs root): {probe.stderr.strip()}")
    token = uuid.uuid4().hex
    procs: list[subprocess.Popen] = []
    temp = None
    root = tmp_path_factory.mktemp("two-hosts")
    try:
        n = _free_subnet()
        head_ip, worker_ip = f"10.200.{n}.1", f"10.200.{n}.2"
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", netns)
        _ip("addr", "add", f"{head_ip}/24", "dev", veth)
        _ip("link", "set", veth, "up")
        for cmd in (("addr", "add", f"{worker_ip}/24", "dev", peer), ("link", "set", peer, "up"),
                    ("link", "set", "lo", "up")):
            _ip("netns", "exec", netns, "ip", *cmd)

        ray_cli = str(Path(sys.executable).with_name("ray"))
        # its own temp dir: the address file a `ray start` writes there would otherwise make any
        # other ray.init() on this machine (another test's local cluster) join this cluster. A short
        # path: Ray's socket paths under it must fit AF_UNIX's 107 bytes (pytest's do not always).
        temp = tempfile.mkdtemp(prefix="gkr-", dir="/tmp")
        # Ray's token authentication: `ray start` turns it on by default, a driver joining by
        # address follows RAY_AUTH_MODE only (this process is in "token" mode, with the token in
        # ~/.ray/auth_token, once a local ray.init() ran in it). The cluster follows this process.
        env = {**os.environ, "GRAPHKILN_TEST_CLUSTER": token,
               "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE") or "disabled"}
        env.pop("RAY_ADDRESS", None)
        common = ["--block", "--num-cpus", "1", "--object-store-memory", NODE_MEMORY, "--temp-dir", temp,
                  "--disable-usage-stats", "--include-log-monitor=false"]
        port = _free_port()
        # the head is in this namespace, beside the machine's other Ray clusters: its fixed-default
        # ports are free ones (a Ray Client server, 10001, only runs where ray[client] is installed,
        # and naming its port elsewhere is refused)
        ports = [f"--{flag}={_free_port()}" for flag in (
            "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
            "metrics-export-port", "node-manager-port", "object-manager-port")]
        start = time.monotonic()
        with open(root / "head.log", "w") as log:
            procs.append(subprocess.Popen(
                [ray_cli, "start", "--head", "--node-ip-address", head_ip, "--port", str(port),
                 "--include-dashboard=false", *ports, *common], env={**env, **HEALTH}, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True))
        address = f"{head_ip}:{port}"
        deadline = time.monotonic() + 90
        while True:  # the head's GCS port; the worker node needs it to register
            try:
                socket.create_connection((head_ip, port), timeout=1).close()
                break
            except OSError:
                assert procs[0].poll() is None, (root / "head.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the head did not start within 90 s"
                time.sleep(0.2)
        with open(root / "worker.log", "w") as log:
            procs.append(subprocess.Popen(
                ["ip", "netns", "exec", netns, ray_cli, "start", "--address", address, "--node-ip-address",
                 worker_ip, *common], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        sigterm = signal.getsignal(signal.SIGTERM)
        join_cluster(ray, address, 60.0, dict(INIT_KWARGS))
        assert signal.getsignal(signal.SIGTERM) is sigterm  # joined from a thread: Ray installed no handler
        while len(alive := [n for n in ray.nodes() if n["Alive"]]) < 2:
            assert procs[1].poll() is None, (root / "worker.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the worker node did not join within 90 s"
            time.sleep(0.2)
        by_ip = {node["NodeManagerAddress"]: node["NodeID"] for node in alive}
        hosts = TwoHosts(ray, address, head_ip, worker_ip, netns, veth, by_ip[head_ip], by_ip[worker_ip],
                         time.monotonic() - start)
        print(f"\ntwo-host cluster up in {hosts.start_s:.1f} s")
        yield hosts
    finally:
        if ray.is_initialized():
            ray.shutdown()
        for proc in procs:
            _stop_group(proc)
        for pid in _with_token(token):  # a process that left its group: still one of this cluster's
            os.kill(pid, signal.SIGKILL)
        for pid in _ip("netns", "pids", netns, check=False).stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        _ip("netns", "del", netns, check=False)
        _ip("link", "del", veth, check=False)  # gone with the namespace, unless that failed
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
        left = _wait_gone(_with_token(token), 10)
        assert not left, f"processes of the test cluster left behind: {left}"


@pytest.fixture(scope="module")
def two_stage(tiny, tmp_path_factory):
    """(case, single-graph artifact, 2-stage artifact, manifest, per-stage dirs) of the dense
    model with mixed sliding layers."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    case = tiny("qwen3_mixed_sliding", "onnxruntime")
    root = tmp_path_factory.mktemp("hosts-staged")
    art = root / "art"
    manifest = export_model(str(case.checkpoint), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, stages=2))
    dirs = []
    for k, st in enumerate(manifest.stages):  # what each host holds: the manifest and its stage's files
        d = root / f"host{k}"
        d.mkdir()
        for rel in ("manifest.json", *st.files):
            shutil.copy2(art / rel, d / rel)
        dirs.append(str(d))
    return case, art, manifest, tuple(dirs)


def _greedy(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, stop_token_ids=(), **kw)


def _across(hosts: TwoHosts, art: Path, dirs, **options) -> Engine:
    from graphkiln.runtime.backends.distributed import RayOptions

    engine = Engine.load(art, threads=1, distributed=RayOptions(
        address=hosts.address, stage_dirs=dirs, stage_nodes=(hosts.head_ip, hosts.worker_ip), **options))
    infos = engine.decoder.pipeline.call("info")
    assert [i["node_id"] for i in infos] == [hosts.head_node, hosts.worker_node]
    # stage 1's process really is on the other network stack
    assert _ip("netns", "identify", str(infos[1]["pid"])).stdout.strip() == hosts.netns
    assert _ip("netns", "identify", str(infos[0]["pid"])).stdout.strip() == ""
    return engine


def _tokens_per_s(engine: Engine, prompts, n: int) -> float:
    start = time.monotonic()
    engine.generate(prompts, _greedy(n))
    return len(prompts) * n / (time.monotonic() - start)


def test_stages_on_two_hosts_match_the_single_graph(two_hosts, two_stage):
    case, art, _, dirs = two_stage
    prompts = case.prompts([7, 3, 12], salt=11)
    single = Engine.load(case.artifact, threads=1)
    want = single.generate(prompts, _greedy(32, output_logits=True))
    # the command line a user types on the head host (another driver, in a fresh interpreter;
    # first: each node has one CPU, which a stage actor holds while its engine is open)
    prompt = prompts[0]
    proc = subprocess.run(
        [sys.executable, "-m", "graphkiln.cli", "run", str(art), "--prompt-ids", ",".join(map(str, prompt)),
         "--max-new-tokens", "12", "--greedy", "--ignore-eos", "--threads", "1", "--distributed", "ray",
         "--ray-address", two_hosts.address, "--ray-timeout", "60", "--stage-dirs", ",".join(dirs),
         "--stage-nodes", f"{two_hosts.head_ip},{two_hosts.worker_ip}"],
        capture_output=True, text=True, timeout=90, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [str(t) for t in want[0].token_ids[:12]]
    assert proc.stderr == f"connecting to Ray at {two_hosts.address} (up to 60 s) ...\n"  # and nothing of Ray's

    dist = _across(two_hosts, art, dirs)
    try:
        for a, b in zip(want, dist.generate(prompts, _greedy(32, output_logits=True))):
            assert b.token_ids == a.token_ids and len(b.token_ids) == 32
            np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
        assert [r.token_ids for r in dist.generate(prompts, _greedy(32))] == [r.token_ids for r in want]
        assert [i["live"] for i in dist.decoder.pipeline.call("info")] == [0, 0]

        batch = case.prompts([6, 6], salt=12)
        rates = {"single graph": _tokens_per_s(single, batch, 64),
                 "2 stages in process": _tokens_per_s(Engine.load(art, threads=1), batch, 64),
                 "2 stages on 2 hosts": _tokens_per_s(dist, batch, 64)}
        print("decode tokens/s, 2 rows x 64 greedy tokens: "
              + ", ".join(f"{k} {v:.0f}" for k, v in rates.items()))
    finally:
        dist.decoder.close()


def test_stage_actors_no_node_has_room_for_are_one_line_within_the_start_timeout(two_hosts, two_stage):
    """Each node has one CPU and an open engine's stage actors hold both: a second engine's
    actors cannot be placed (Ray would keep them pending forever). They are ended with the
    error: once the first engine closes, a new one gets the CPUs."""
    from graphkiln.errors import GraphkilnError

    case, art, _, dirs = two_stage
    first = _across(two_hosts, art, dirs)
    try:
        start = time.monotonic()
        with pytest.raises(GraphkilnError, match=r"^pipeline stage 0, stage 1 did not start within 3 s: its Ray "
                                                 r"actor reserves cpus_per_stage CPUs") as info:
            _across(two_hosts, art, dirs, start_timeout_s=3)
        assert "\n" not in str(info.value) and time.monotonic() - start < 3 + 10
    finally:
        first.decoder.close()
    again = _across(two_hosts, art, dirs, start_timeout_s=60)  # the refused actors hold nothing
    try:
        prompt = case.prompts([5], salt=15)
        assert again.generate(prompt, _greedy(8))[0].token_ids == Engine.load(case.artifact, threads=1).generate(
            prompt, _greedy(8))[0].token_ids
    finally:
        again.decoder.close()


def test_a_killed_stage_process_on_the_worker_host_fails_the_requests_in_flight(two_hosts, two_stage):
    from graphkiln.runtime.backends.distributed import StageFailed

    case, art, manifest, dirs = two_stage
    prompts = case.prompts([5, 9], salt=13)
    want = [r.token_ids for r in Engine.load(case.artifact, threads=1).generate(prompts, _greedy(16))]
    dist = _across(two_hosts, art, dirs)
    pids = []
    try:
        pipeline = dist.decoder.pipeline
        before = pipeline.call("info")
        pids = [i["pid"] for i in before]
        stream = dist.stream(prompts, _greedy(64))
        for _ in range(4):
            next(stream)
        assert dist.pool.live == 2 and [i["live"] for i in pipeline.call("info")] == [2, 2]
        os.kill(pids[1], signal.SIGKILL)  # the stage's process on the worker host, as a crash would
        assert not _wait_gone([pids[1]], 10)
        lo, hi = manifest.stages[1].layers
        with pytest.raises(StageFailed, match=rf"^pipeline stage 1 \(layers {lo}:{hi}\) stopped mid-generation") as info:
            for _ in stream:
                pass
        assert "\n" not in str(info.value)
        after = pipeline.call("info")
        assert dist.pool.live == 0 and [i["live"] for i in after] == [0, 0]  # released on the survivor
        assert after[0]["pid"] == pids[0] and after[1]["pid"] != pids[1]
        pids.append(after[1]["pid"])
        # Ray restarted it on the same (pinned) host; the next request is served there
        assert after[1]["node_id"] == two_hosts.worker_node
        assert _ip("netns", "identify", str(after[1]["pid"])).stdout.strip() == two_hosts.netns
        assert [r.token_ids for r in dist.generate(prompts, _greedy(16))] == want
    finally:
        dist.decoder.close()
    assert not _wait_gone(pids, 15), "stage processes left behind after close"


def test_a_cut_link_fails_the_requests_in_flight_within_seconds(two_hosts, two_stage):
    """Last in the module: the worker host is lost for good (its node is marked dead)."""
    from graphkiln.runtime.backends.distributed import StageFailed

    case, art, manifest, dirs = two_stage
    prompts = case.prompts([5, 9], salt=14)
    dist = _across(two_hosts, art, dirs)
    try:
        pipeline = dist.decoder.pipeline
        head_pid = pipeline.call("info")[0]["pid"]
        stream = dist.stream(prompts, _greedy(64))
        for _ in range(4):
            next(stream)
        assert dist.pool.live == 2
        _ip("link", "set", two_hosts.veth, "down")
        cut = time.monotonic()
        lo, hi = manifest.stages[1].layers
        with pytest.raises(StageFailed, match=rf"^pipeline stage 1 \(layers {lo}:{hi}\) is gone .*node it is pinned "
                                              "to left the Ray cluster") as info:
            for _ in stream:
                pass
        took = time.monotonic() - cut
        print(f"link cut to the requests' error: {took:.1f} s")
        assert "\n" not in str(info.value)
        assert took < 30, took  # 3 missed health checks (1 s apart, 1 s timeout each), plus scheduling
        assert dist.pool.live == 0 and pipeline.call("info", stages=[0])[0]["live"] == 0  # the survivor's slots
        start = time.monotonic()
        with pytest.raises(StageFailed, match=r"is gone .*load the artifact again"):
            dist.generate(prompts, _greedy(4))
        assert time.monotonic() - start < 1  # refused at once, nothing waits on the lost host
    finally:
        dist.decoder.close()
    assert not _wait_gone([head_pid], 15), "the surviving stage's process was left behind after close"
