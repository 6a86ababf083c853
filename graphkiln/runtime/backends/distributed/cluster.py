"""The Ray cluster the stages run on: a local one started here and shut down with its last driver
(``end``), or an existing one joined at an address within a timeout (``join_cluster``), and
each stage pinned to the node that holds its files (``resolve_stage_nodes``)."""

from __future__ import annotations

import socket
import threading
import time

from graphkiln.errors import GraphkilnError


# The local cluster open_ray started in this process, and how many drivers still use it: it is
# shut down with the last of them (a cluster this process joined or started itself is left alone).
local_cluster = {"started": False, "drivers": 0}


def end_actors(ray, actors: list, owns_cluster: bool) -> None:
    """Kill the stage actors; with ``owns_cluster``, one driver fewer on the local cluster, shut
    down when it was the last."""
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone, or Ray already shut down: nothing left to end
            pass
    if owns_cluster:
        local_cluster["drivers"] -= 1
        if local_cluster["drivers"] == 0 and local_cluster["started"]:
            local_cluster["started"] = False
            if ray.is_initialized():
                ray.shutdown()


def resolve_stage_nodes(ray, stage_nodes: tuple[str, ...] | None, n: int) -> list[str] | None:
    """``RayOptions.stage_nodes`` as node ids of alive nodes (one per stage), or None; a name that
    is no alive node, or an IP that several nodes share, is one GraphkilnError line."""
    if stage_nodes is None:
        return None
    if len(stage_nodes) != n:
        raise GraphkilnError(f"stage_nodes has {len(stage_nodes)} entries but the artifact has {n} stages: give one "
                             "node per stage")
    alive = [node for node in ray.nodes() if node.get("Alive")]
    out = []
    for k, name in enumerate(stage_nodes):
        name = str(name).strip()
        hits = [node["NodeID"] for node in alive if name in (node["NodeID"], node.get("NodeManagerAddress"))]
        if len(hits) != 1:
            known = ", ".join(f"{node.get('NodeManagerAddress')} ({node['NodeID'][:12]}...)" for node in alive)
            why = "is not an alive node" if not hits else f"is the address of {len(hits)} nodes (give a node id)"
            raise GraphkilnError(f"stage {k}'s node {name!r} {why} of the Ray cluster: use one of {known}")
        out.append(hits[0])
    return out


# A join_cluster attempt that timed out while its ray.init was still running (that call cannot be
# cancelled): a second ray.init beside it would share Ray's process-wide state with it.
_abandoned_connect: dict = {"thread": None, "address": None}


def _dialled(address: str) -> tuple[str, int] | None:
    """The (host, port) ``ray.init(address=...)`` dials first: the GCS for "host:port" or "auto"
    (Ray's own resolution: RAY_ADDRESS, the latest ``ray start`` on this machine), the client
    server for "ray://host:port"; None when that cannot be told here (ray.init then reports)."""
    if "://" in address:
        rest = address.split("://", 1)[1].split("/", 1)[0]
        host, sep, port = rest.rpartition(":")
        return (host.strip("[]"), int(port)) if sep and port.isdigit() else None
    try:
        from ray._private.services import canonicalize_bootstrap_address

        resolved = canonicalize_bootstrap_address(address)
    except Exception:  # no running cluster for "auto", a malformed address: ray.init says which
        return None
    if resolved is None:
        return None
    host, sep, port = resolved.rpartition(":")
    return (host.strip("[]"), int(port)) if sep and port.isdigit() else None


def _wait_for_port(address: str, host: str, port: int, deadline: float, timeout_s: float) -> None:
    """Until ``deadline``, try a TCP connection to (host, port) (a head that is still starting is
    waited for); refused or unanswered until then is one GraphkilnError line. Plain sockets: a
    signal handler runs (SIGTERM ends the wait) as soon as the signal arrives."""
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(left, 2.0))):
                return
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
        if time.monotonic() + 0.2 >= deadline:
            raise GraphkilnError(f"no Ray cluster answered at {address} ({host}:{port}: {why.lower()}) within "
                                 f"{timeout_s:g} s: start one there (ray start --head --port {port}) or fix the "
                                 "address (--ray-address, RayOptions.address); --ray-timeout waits longer")
        time.sleep(0.2)


def join_cluster(ray, address: str, timeout_s: float, init_kwargs: dict) -> None:
    """``ray.init(address=address)`` within ``timeout_s`` seconds, or one GraphkilnError line.

    Why not plain ray.init: against an unreachable address it retries for minutes (20 tries of
    ~40 s, printing Ray's GCS warnings), and each try is one blocking native call, during which
    this thread's Python signal handlers cannot run (SIGTERM took ~25 s to act). So the address's
    port is first tried with plain sockets until the deadline (nothing listening: the error, and
    Ray is never called); then ray.init runs in a daemon thread while this thread waits for it
    with a timed, interruptible join. Lifecycle of that thread: if the deadline passes first it is
    abandoned (it cannot be cancelled); should its ray.init still succeed, it disconnects again at
    once, and until it ends another join in this process is refused. Ray set up from a thread
    that is not the main one installs no SIGTERM handler of its own."""
    pending = _abandoned_connect["thread"]
    if pending is not None and pending.is_alive():
        raise GraphkilnError(f"an earlier attempt to join the Ray cluster at {_abandoned_connect['address']} is still "
                             "running in this process: wait for it to give up, or use a new process")
    deadline = time.monotonic() + timeout_s
    dialled = _dialled(address)
    if dialled is not None:
        _wait_for_port(address, *dialled, deadline, timeout_s)
    lock, state = threading.Lock(), {}

    def connect() -> None:
        try:
            ray.init(address=address, **init_kwargs)
        except BaseException as exc:  # handed to the waiting thread
            with lock:
                state["error"] = exc
                state["done"] = True
            return
        with lock:
            if state.get("given_up"):  # nobody waits for this connection any more
                ray.shutdown()
            state["done"] = True

    worker = threading.Thread(target=connect, name="graphkiln-ray-connect", daemon=True)
    worker.start()
    try:
        worker.join(max(0.0, deadline - time.monotonic()))
    finally:  # a timeout, or a signal (SIGTERM, Ctrl-C) raised in the join
        with lock:
            if not state.get("done"):
                state["given_up"] = True
                _abandoned_connect.update(thread=worker, address=address)
    if not state.get("done"):
        raise GraphkilnError(f"the Ray cluster at {address} did not accept this driver within {timeout_s:g} s (its "
                             "port answers, but not as a Ray head): check the address is the head's GCS port "
                             "(ray start --head prints it) or ray://host:10001; --ray-timeout waits longer")
    error = state.get("error")
    if error is not None:
        if isinstance(error, GraphkilnError):
            raise error
        if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt inside Ray: not a connect failure
            raise error
        cause = error
        while cause.__cause__ is not None:  # ray.init wraps the reason in "Failed to connect to ..."
            cause = cause.__cause__
        if isinstance(cause, ray.exceptions.AuthenticationError):
            raise GraphkilnError(f"the Ray cluster at {address} refused this driver's authentication: it uses token "
                                 "authentication, so set RAY_AUTH_MODE=token and give the cluster's token "
                                 "(RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token)") from None
        line = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        raise GraphkilnError(f"could not join the Ray cluster at {address} ({line[:300]}): check the address "
                             "(--ray-address, RayOptions.address) and that the cluster runs the same Ray version") from None
