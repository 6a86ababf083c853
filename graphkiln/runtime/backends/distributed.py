"""A pipeline-staged artifact run with each stage in its own Ray actor (``distributed="ray"``).

The unit is the in-process one (``runtime.backends.stages``): a stage is a ``DecoderGraph`` plus a
``StatePool`` over only its own states, addressed by slot. Here each stage lives in a Ray actor
(``StageWorker``) that opens only the manifest and its stage's files (``StageSpec.files``,
checked against their sha256) and allocates only its own pools; the driver in the Engine's
process (``RayStagedDecoder`` + ``RayStagedPool``) makes the same calls through actor handles:

- slot bookkeeping (``reserve``, ``claim``, ``release``, ``release_keeping_tail``, ``scrub``)
  is replayed on every actor and checked to agree with the driver's own mirror of the packed
  slots (``PackedSlots`` without storage), so ``live`` / ``free_slots`` cost no round trip;
- a forward is a chain of actor tasks, stage k+1's task taking stage k's result *object ref*
  as its argument: hidden states go actor to actor through Ray's object store, never through
  the driver; the driver waits only on the last stage's logits (or tokens);
- micro-batches: ``submit`` returns a ``PendingRun`` without waiting, so several slot ranges
  can be in flight at once; each actor runs its tasks in submission order, so while range A is
  in stage 1, range B runs in stage 0 (``run`` is ``submit(...).result()``).

Failure. A stage actor that dies (killed, crashed, its node lost) fails the forward that was in
flight with one ``StageFailed`` line (any Ray error is looked into: which stage restarted or is
gone, ``_Pipeline.failed``). Actors are created with ``max_restarts`` (default 1): Ray
restarts the process, which re-opens the stage's files and comes back with empty pools; the
driver recognises it by its new incarnation id, sizes its pools as the others, and refuses any
forward over the rows that were live at the failure (their state on that stage is gone) until
they are all released — on the survivors only, since the restarted stage never held them. Once
no slot is live the pipeline is whole again and the next request is served. When restarts are
exhausted, or the stage cannot be restarted (its pinned node left the cluster: Ray reports the
actor unschedulable), the stage is gone: the survivors' slots are all released at once (nothing
runs on them again) and every forward is refused with one line: load the artifact again.

Cluster. With no Ray connection in this process, ``open_ray`` starts a local one (``num_cpus``
as given, else at least one per stage; no dashboard; Ray's logs kept out of the terminal); with
``RayOptions.address`` it joins an existing cluster, where each stage's directory
(``stage_dirs``) is a path on the node that runs it, within ``connect_timeout_s`` or with one
``GraphkilnError`` line (``join_cluster``: Ray alone would retry an unreachable address for
minutes). Lifecycle: the actors live as long as the driver (``close``, or garbage collection of
the Engine, ends them); a cluster started here is shut down with the last driver that uses it.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime.backends.state import PackedSlots

INSTALL_HINT = "pip install 'graphkiln[distributed]'"
RESTART_WAIT_S = 120.0  # how long a restarting stage actor may take to answer before it counts as gone
CONNECT_TIMEOUT_S = 30.0  # RayOptions.connect_timeout_s / --ray-timeout: joining a cluster at an address
START_TIMEOUT_S = 600.0  # RayOptions.start_timeout_s: placing the stage actors and opening their files
DISTRIBUTED = ("ray",)
# ray.init's arguments besides where: no dashboard, Ray's logs kept out of the terminal
INIT_KWARGS = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR", "configure_logging": True}


class StageFailed(GraphkilnError):
    """A stage's actor died or restarted under a forward: the requests in it failed."""


class Restarted(RuntimeError):
    """Raised by a stage actor given a call meant for an earlier incarnation of itself (Ray
    restarted it: its pools are new and empty); the driver turns it into ``StageFailed``."""


@dataclass(frozen=True)
class RayOptions:
    """How ``distributed="ray"`` places the stages.

    ``address``: an existing Ray cluster to join ("auto", "ray://host:10001"); None starts a
    local one unless this process is already connected. ``num_cpus``: the local cluster's CPUs
    (default: the machine's, at least one per stage). ``stage_dirs``: per stage, the artifact
    directory as the node running that stage sees it (default: the driver's directory, for
    every stage); each needs only ``manifest.json`` and that stage's files. ``max_restarts``:
    how often Ray restarts a dead stage actor (0: a dead stage ends the pipeline).
    ``stage_nodes``: per stage, the Ray node that must run it (a node id, or a node's IP address
    when one node has it), e.g. the host holding that stage's directory; default: wherever Ray
    places it. A node that is not alive in the cluster is refused before any actor starts.
    ``cpus_per_stage``: the CPUs Ray reserves for each actor (placement only; its onnxruntime
    threads are the Engine's ``threads``). ``connect_timeout_s``: how long joining the cluster at
    ``address`` may take before it fails with one line (Ray itself would keep retrying an
    unreachable address for minutes). ``start_timeout_s``: how long the stage actors may take to
    be placed and to open (hash) their files before loading fails with one line (None: no limit;
    an actor no node has a free CPU for would otherwise wait for one forever)."""

    address: str | None = None
    num_cpus: int | None = None
    stage_dirs: tuple[str, ...] | None = None
    max_restarts: int = 1
    cpus_per_stage: float = 1.0
    stage_nodes: tuple[str, ...] | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    start_timeout_s: float | None = START_TIMEOUT_S


def import_ray():
    """Ray, or the one-line refusal naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise GraphkilnError(f"--distributed ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def check_distributed(distributed: object) -> RayOptions | None:
    """``distributed`` as given to ``Engine.load``: None, "ray" or a ``RayOptions``."""
    if distributed is None:
        return None
    if isinstance(distributed, RayOptions):
        return distributed
    if distributed in DISTRIBUTED:
        return RayOptions()
    raise GraphkilnError(f"distributed {distributed!r} is not supported: choose one of {', '.join(DISTRIBUTED)} "
                         "(or leave it unset to run in this process)")


# -- the actor ------------------------------------------------------------------------------


class StageWorker:
    """One stage in one process (the body of the Ray actor; plain Python, so it can be read and
    run without Ray). Opens ``manifest.json`` (pinned to the driver's digest) and only its own
    stage's graph and data files, each checked against the manifest's sha256 before onnxruntime
    reads it. Owns the stage's ``StatePool``."""

    def __init__(self, artifact_dir: str, index: int, digest: str, threads: int | None, target: str | None) -> None:
        from graphkiln.artifact import graph_external_data, sha256_file
        from graphkiln.manifest import artifact_file
        from graphkiln.runtime.backends.ort_cpu import numpy_dtype
        from graphkiln.runtime.backends.stages import open_stage_graph
        from graphkiln.runtime.backends.state import StatePool

        root = Path(artifact_dir)
        manifest, _ = Manifest.read_with_digest(root, digest)
        if not 0 <= index < len(manifest.stages):
            raise GraphkilnError(f"{root} has {len(manifest.stages)} stages, no stage {index}: check stage_dirs")
        stage = manifest.stages[index]
        spec = manifest.graph(stage.graph, target) if target else manifest.graph_for(stage.graph, "onnxruntime")
        own = set(stage.files)
        for rel in stage.files:
            try:
                ok = rel in manifest.files and sha256_file(artifact_file(root, rel)) == manifest.files[rel]
            except OSError:
                ok = False
            if not ok:
                raise GraphkilnError(f"stage {index} file {rel} in {root} is missing or fails its sha256 check: "
                                     "copy the stage's files there again")
        for rel in graph_external_data(root, spec.file):
            if rel not in own:  # the stage reads nothing it was not given
                raise GraphkilnError(f"stage {index}'s graph reads {rel}, which is not one of its files: re-export")
        self.index, self.layers = index, stage.layers
        self.runner = open_stage_graph(root, spec, threads)
        self.vision_session = self.vision_output = None
        self.vision_runs = 0
        if index == 0 and manifest.vision is not None:  # the vision graph belongs to the first stage
            from graphkiln.runtime.backends.ort_cpu import cpu_session

            vision = manifest.graph_for("vision", "onnxruntime")
            for rel in graph_external_data(root, vision.file):
                if rel not in own:
                    raise GraphkilnError(f"stage 0's vision graph reads {rel}, which is not one of its files: re-export")
            self.vision_session = cpu_session(root, vision, threads)
            self.vision_output = next(t.name for t in vision.outputs if t.role == "image_embeddings")
        self.pool = StatePool(stage.states, numpy_dtype(manifest.states[0].dtype))
        # this stage's own copies of its layers' LoRA stacks, written by the driver's AdapterPool
        # (write_adapter_slot) and bound once; all zeros (no adapter) until then
        self.lora = _StageStacks(spec)
        if self.lora.arrays:
            self.runner.bind_adapters(self.lora)
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new process with a new id

    def info(self, expect: str | None = None) -> dict:
        """Who this is (``incarnation`` changes when Ray restarts the actor) and its pool; any
        incarnation may ask (``expect`` is not checked: this is how a restart is found out)."""
        return {"incarnation": self.incarnation, "pid": os.getpid(), "node_id": _node_id(), "spec": self.runner.spec,
                "has_next_token": self.runner.has_next_token,
                "has_hidden_states": self.runner.has_hidden_states, "slots": self.pool.slots, "live": self.pool.live,
                "nbytes": self.pool.nbytes, "layers": sorted(set(self.pool.keys) | set(self.pool.conv) | set(self.pool.recurrent)),
                "peak_rss": _peak_rss(), "vision_runs": self.vision_runs}

    # Every call below names the incarnation the driver believes it talks to: a call meant for
    # the process before a restart must not run on the new one's empty pools.

    def _check(self, expect: str) -> None:
        if expect != self.incarnation:
            raise Restarted(f"stage {self.index} was restarted")

    def reserve(self, expect: str, slots: int, capacity: int) -> None:
        self._check(expect)
        self.pool.reserve(slots, capacity)

    def claim(self, expect: str) -> int:
        self._check(expect)
        return self.pool.claim()

    def release_keeping_tail(self, expect: str, slot: int, tail: int) -> list[tuple[int, int]]:
        self._check(expect)
        return self.pool.release_keeping_tail(slot, tail)

    def release_all(self, expect: str) -> None:
        """Free every slot (another stage is gone: none of these rows will run again)."""
        self._check(expect)
        while self.pool.live:
            self.pool.release(self.pool.live - 1)

    def scrub(self, expect: str, slot: int) -> None:
        self._check(expect)
        self.pool.scrub(slot)

    # cached prefix blocks (backends.prefix_store): this stage's layers' rows, under the driver's ids

    def block_bytes(self, expect: str, block_size: int) -> int:
        self._check(expect)
        return self.pool.block_bytes(block_size)

    def attach_store(self, expect: str, blocks: int, block_size: int) -> None:
        self._check(expect)
        self.pool.attach_store(blocks, block_size)

    def save_blocks(self, expect: str, slot: int, blocks, ids, snapshot) -> None:
        self._check(expect)
        self.pool.save_blocks(slot, blocks, ids, snapshot)

    def load_blocks(self, expect: str, slot: int, ids, snapshot) -> None:
        self._check(expect)
        self.pool.load_blocks(slot, ids, snapshot)

    def write_adapter_slot(self, expect: str, slot: int, rows: dict) -> None:
        """Copy the driver's rows of LoRA slot ``slot`` ({(layer, module): (A row, B row)}) into this
        stage's stacks. The driver sends them before the slot is routable, so no step reads them
        half-written."""
        self._check(expect)
        for key, (a, b) in rows.items():
            self.lora.arrays[key][0][slot], self.lora.arrays[key][1][slot] = a, b

    def run_vision(self, expect: str, feeds: dict) -> np.ndarray:
        """The vision graph over preprocessed ``feeds`` (the first stage's, ``runtime.backends.vision``)."""
        self._check(expect)
        if self.vision_session is None:
            raise RuntimeError(f"stage {self.index} has no vision graph")
        self.vision_runs += 1
        return self.vision_session.run([self.vision_output], feeds)[0]

    def run(self, expect: str, first_input, position_ids, logits_index, lengths, vision, extra, first_slot: int,
            tokens_only: bool, with_hidden: bool = False):
        self._check(expect)
        kwargs = {"with_hidden": True} if with_hidden else {}
        out = self.runner.run(self.pool, first_input, position_ids, logits_index, lengths, vision=vision,
                              extra=extra, first_slot=first_slot, tokens_only=tokens_only, **kwargs)
        # bound output buffers are reused by the next call: the object store gets its own copies
        if with_hidden:
            return tuple(np.array(a, copy=True) for a in out)
        return np.array(out, copy=True)


class _StageStacks:
    """A stage actor's LoRA stacks ({(layer, module): (A [slots, in, R], B [slots, R, out])}, zeros),
    shaped by its graph's inputs; what ``DecoderGraph.bind_adapters`` reads."""

    def __init__(self, spec) -> None:
        shapes: dict = {}
        for t in spec.inputs:
            if t.role in ("lora_a", "lora_b"):
                shapes.setdefault((t.layer, t.module), {})[t.role] = t.shape
        self.arrays = {key: (np.zeros(s["lora_a"], np.float32), np.zeros(s["lora_b"], np.float32))
                       for key, s in shapes.items()}


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside a Ray worker)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def _peak_rss() -> int | None:
    """This process's peak resident set in bytes (Linux VmHWM; ``ru_maxrss`` would not do: it is
    carried across exec, so a worker started by a big process reports that one's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# -- the driver -----------------------------------------------------------------------------


class _Mirror(PackedSlots):
    """The packed-slot arithmetic alone: the driver's copy of what every stage pool does."""

    def __init__(self) -> None:
        self.slots, self.live = 0, 0

    def _clear_conv_row(self, slot: int) -> None:
        pass

    def _move_row(self, dst: int, src: int) -> None:
        pass


class _Pipeline:
    """The stage actors and what the driver knows of them: each one's incarnation, the pool size
    every stage must have, and the stages restarted since the rows now live were claimed."""

    def __init__(self, ray, actors: list, layers: list[tuple[int, int]], owns_cluster: bool,
                 start_timeout_s: float | None = None) -> None:
        self.ray, self.actors, self.layers = ray, actors, layers
        self.mirror = _Mirror()
        self.capacity = 0
        refs = [a.info.remote() for a in actors]
        # an actor Ray cannot place yet (no free CPU on its node) is pending, not failed: Ray
        # would wait for the resources forever
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=start_timeout_s)
        if pending:
            waiting = ", ".join(f"stage {refs.index(r)}" for r in pending)
            raise GraphkilnError(f"pipeline {waiting} did not start within {start_timeout_s:g} s: its Ray actor "
                                 "reserves cpus_per_stage CPUs on its node, and none may be free there (other "
                                 "drivers' stage actors hold them; `ray status` shows them), or its files take "
                                 "longer to read (RayOptions.start_timeout_s)")
        self.infos = ray.get(refs)
        self.stale: set[int] = set()  # restarted stages: they lack the state of the rows live now
        self.store_args: tuple[int, int] | None = None  # (blocks, block size) of the stages' prefix stores
        self.store_epoch = 0  # bumped when a restarted stage comes back with an empty store
        self.gone: str | None = None  # why the pipeline can no longer run (a stage is lost)
        self.lost: set[int] = set()  # stages gone for good (restarts exhausted, pinned node gone)
        self.adapters = None  # the driver's runtime.lora.AdapterPool, once bound (RayStagedDecoder.bind_adapters)
        self._finalizer = weakref.finalize(self, _end, ray, list(actors), owns_cluster)

    def close(self) -> None:
        self._finalizer()

    def adapter_rows(self, k: int, slot: int) -> dict:
        """Stage k's rows of LoRA slot ``slot`` from the driver's AdapterPool."""
        arrays = self.adapters.arrays
        keys = {(t.layer, t.module) for t in self.infos[k]["spec"].inputs if t.role == "lora_a"}
        return {key: (arrays[key][0][slot], arrays[key][1][slot]) for key in keys}

    def push_adapter_slot(self, slot: int) -> None:
        """Send every stage its rows of LoRA slot ``slot`` and wait for all of them."""
        self.get([self.actors[k].write_adapter_slot.remote(self.expect(k), slot, self.adapter_rows(k, slot))
                  for k in range(len(self.actors))])

    def stage_name(self, k: int) -> str:
        return f"stage {k} (layers {self.layers[k][0]}:{self.layers[k][1]})"

    def check_usable(self) -> None:
        if self.gone is not None:
            raise StageFailed(self.gone)
        if self.stale and self.mirror.live:
            names = ", ".join(self.stage_name(k) for k in sorted(self.stale))
            raise StageFailed(f"pipeline {names} restarted after its Ray actor died and lost the state of the "
                              "requests running then: they failed; resubmit them once they are released")

    def expect(self, k: int) -> str:
        return self.infos[k]["incarnation"]

    def call(self, method: str, *args, stages=None) -> list:
        """``method`` on every stage (or ``stages``), in parallel; a dead stage is found out."""
        ks = list(range(len(self.actors))) if stages is None else list(stages)
        refs = [getattr(self.actors[k], method).remote(self.expect(k), *args) for k in ks]
        return self.get(refs)

    def get(self, refs):
        """``ray.get``; an actor that died or restarted becomes ``StageFailed`` (``failed``), a
        ``GraphkilnError`` raised in a stage its own line again. Every Ray error is looked into,
        not only ``RayActorError``: a stage whose pinned node left the cluster fails its calls
        with ``ActorUnschedulableError``, a lost node's objects with ``ObjectLostError``."""
        ray = self.ray
        try:
            return ray.get(refs)
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, GraphkilnError):
                raise GraphkilnError(str(cause).splitlines()[0]) from None
            failure = self.failed(exc)
            if failure is None:
                raise
            raise failure from None

    def failed(self, exc: BaseException) -> StageFailed | None:
        """After an error from Ray: find which stages restarted (new incarnation) or are gone,
        size the restarted ones' pools as the others, and return the one-line error for the
        caller (None: every stage is the one it was, the error is not a stage failure)."""
        ray = self.ray
        restarted, lost, unplaceable = [], [], False
        for k, actor in enumerate(self.actors):
            if k in self.lost:
                lost.append(k)
                continue
            info, error = self._info_after_restart(actor)
            if info is None:
                lost.append(k)
                unplaceable |= isinstance(error, ray.exceptions.ActorUnschedulableError)
                continue
            if info["incarnation"] != self.infos[k]["incarnation"]:
                self.infos[k] = info
                restarted.append(k)
                if self.mirror.slots:
                    ray.get(actor.reserve.remote(info["incarnation"], self.mirror.slots, self.capacity))
                if self.store_args is not None:  # its cached blocks are gone: the driver's index forgets all
                    ray.get(actor.attach_store.remote(info["incarnation"], *self.store_args))
                    self.store_epoch += 1
                if self.adapters is not None:  # its LoRA stacks are zeros again: every slot sent anew
                    ray.get([actor.write_adapter_slot.remote(info["incarnation"], slot, self.adapter_rows(k, slot))
                             for slot in range(1, self.adapters.max_loras + 1)])
        if lost:
            fresh = [k for k in lost if k not in self.lost]
            self.lost.update(lost)
            why = ("cannot be restarted: the node it is pinned to left the Ray cluster" if unplaceable
                   else "was not restarted")
            self.gone = (f"pipeline {', '.join(self.stage_name(k) for k in lost)} is gone (its Ray actor died and "
                         f"{why}): the requests running failed; load the artifact again")
            if fresh:  # even with the driver's mirror empty: this may be a release's own call
                self._release_all_on_survivors()
            return StageFailed(self.gone)
        if not restarted:
            return None
        if self.mirror.live:
            self.stale.update(restarted)
        which = ", ".join(self.stage_name(k) for k in restarted)
        return StageFailed(f"pipeline {which} stopped mid-generation (its Ray actor died and was restarted): the "
                           "request failed and its slots are released on the other stages; the next request will be "
                           "served")

    def _info_after_restart(self, actor, wait_s: float = RESTART_WAIT_S) -> tuple[dict | None, Exception | None]:
        """(the actor's ``info``, None) once it answers (a restarting actor is "unavailable" for
        a while: asked again until ``wait_s`` passes); (None, Ray's error) when it is dead for
        good, or cannot be placed again (its pinned node is gone)."""
        ray = self.ray
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return ray.get(actor.info.remote()), None
            except ray.exceptions.ActorUnavailableError as exc:
                if time.monotonic() >= deadline:
                    return None, exc
                time.sleep(0.1)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as exc:
                return None, exc

    def _release_all_on_survivors(self) -> None:
        """A stage is gone for good: free every slot on the others (their rows will never run
        again), so that from now on the slot calls stay in the driver's mirror."""
        ray = self.ray
        keep = [k for k in range(len(self.actors)) if k not in self.lost]
        try:
            ray.get([self.actors[k].release_all.remote(self.expect(k)) for k in keep])
        except ray.exceptions.RayError:
            pass  # another stage died meanwhile: it holds nothing any more either

    def survivors(self) -> list[int]:
        return [k for k in range(len(self.actors)) if k not in self.stale and k not in self.lost]

    def settle(self) -> None:
        """Once no row is live, the restarted stages are as whole as the others again."""
        if not self.mirror.live:
            self.stale.clear()


# The local cluster open_ray started in this process, and how many drivers still use it: it is
# shut down with the last of them (a cluster this process joined or started itself is left alone).
_local_cluster = {"started": False, "drivers": 0}


def _end(ray, actors: list, owns_cluster: bool) -> None:
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # already gone, or Ray already shut down: nothing left to end
            pass
    if owns_cluster:
        _local_cluster["drivers"] -= 1
        if _local_cluster["drivers"] == 0 and _local_cluster["started"]:
            _local_cluster["started"] = False
            if ray.is_initialized():
                ray.shutdown()


class RayStagedPool:
    """``StatePool``'s slot API over the stage actors' pools (see the module docstring)."""

    def __init__(self, pipeline: _Pipeline) -> None:
        self.pipeline = pipeline

    @property
    def slots(self) -> int:
        return self.pipeline.mirror.slots

    @property
    def live(self) -> int:
        return self.pipeline.mirror.live

    @property
    def free_slots(self) -> int:
        return self.pipeline.mirror.free_slots

    @property
    def nbytes(self) -> int:
        return sum(info["nbytes"] for info in self.pipeline.call("info"))

    def reserve(self, slots: int, capacity: int) -> None:
        p = self.pipeline
        if p.mirror.live:
            raise RuntimeError("RayStagedPool.reserve while slots are live")
        if p.gone is not None:
            raise StageFailed(p.gone)
        p.stale.clear()
        p.call("reserve", slots, capacity)
        p.mirror.slots, p.capacity = slots, capacity

    def claim(self) -> int:
        p = self.pipeline
        if p.gone is not None:
            # nothing to replay on; the forward refuses, so a scheduler fails this request with
            # the one line rather than its stepping loop with an exception at admission
            return p.mirror.claim()
        p.check_usable()
        slot = p.mirror.claim()
        try:
            got = p.call("claim")
        except StageFailed:
            self.release(slot)  # on the stages that did claim it (a restarted one never held it)
            raise
        if set(got) != {slot}:  # lockstep broken: a bug, not user input
            raise RuntimeError(f"stage pools claimed slots {got}, the driver expected {slot}")
        return slot

    def release(self, slot: int) -> int | None:
        moves = self.release_keeping_tail(slot, 0)
        return moves[0][0] if moves else None

    def release_keeping_tail(self, slot: int, tail: int = 0) -> list[tuple[int, int]]:
        """Replayed on every surviving stage (a restarted one never held the slot); never
        raises for a stage that died meanwhile: releasing is what a failure's cleanup does."""
        p = self.pipeline
        moves = p.mirror.release_keeping_tail(slot, tail)
        if p.gone is None:
            try:
                got = p.call("release_keeping_tail", slot, tail, stages=p.survivors())
            except StageFailed:
                got = None  # the failure is recorded in the pipeline; the next forward reports it
            if got is not None and any(list(map(tuple, m)) != moves for m in got):
                raise RuntimeError("stage pools moved slots differently from the driver")
        p.settle()
        return moves

    def scrub(self, slot: int) -> None:
        p = self.pipeline
        if p.gone is None:
            try:
                p.call("scrub", slot, stages=p.survivors())
            except StageFailed:
                pass  # as release_keeping_tail

    # cached prefix blocks: each actor keeps its own layers' rows (StagedPool's calls, made remotely)

    @property
    def store_epoch(self) -> int:
        """Changes when a stage restarted with an empty store (``request.prefix`` then forgets its index)."""
        return self.pipeline.store_epoch

    def block_bytes(self, block_size: int) -> int:
        return sum(self.pipeline.call("block_bytes", block_size))

    def attach_store(self, blocks: int, block_size: int) -> None:
        self.pipeline.call("attach_store", blocks, block_size)
        self.pipeline.store_args = (blocks, block_size)

    def save_blocks(self, slot: int, blocks, ids, snapshot: int | None = None) -> None:
        p = self.pipeline
        p.check_usable()
        p.call("save_blocks", slot, list(blocks), list(ids), snapshot)

    def load_blocks(self, slot: int, ids, snapshot: int | None = None) -> None:
        p = self.pipeline
        p.check_usable()
        p.call("load_blocks", slot, list(ids), snapshot)


class PendingRun:
    """One forward in flight (``RayStagedDecoder.submit``); ``result`` waits for the last stage."""

    def __init__(self, pipeline: _Pipeline, ref) -> None:
        self.pipeline, self.ref = pipeline, ref

    def ready(self) -> bool:
        done, _ = self.pipeline.ray.wait([self.ref], timeout=0)
        return bool(done)

    def result(self) -> np.ndarray:
        return self.pipeline.get(self.ref)


class RayStagedDecoder:
    """``DecoderGraph``'s ``spec`` and ``run`` over the stage actors (see the module docstring)."""

    def __init__(self, pipeline: _Pipeline) -> None:
        from graphkiln.runtime.backends.stages import merged_spec

        self.pipeline = pipeline
        self.spec = merged_spec([info["spec"] for info in pipeline.infos])
        self.has_next_token = pipeline.infos[-1]["has_next_token"]
        self.has_hidden_states = pipeline.infos[-1]["has_hidden_states"]

    def bind_adapters(self, pool) -> None:
        """Mirror the driver's LoRA slots (``runtime.lora.AdapterPool``) into the stage actors: each
        slot written (load, unload) is sent to every stage before it becomes routable."""
        self.pipeline.adapters = pool
        pool.add_listener(self.pipeline.push_adapter_slot)

    def submit(self, pool: RayStagedPool, input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
               lengths: np.ndarray, vision=None, extra: dict | None = None, first_slot: int = 0,
               tokens_only: bool = False, with_hidden: bool = False) -> PendingRun:
        """Start one forward over slots first_slot.. without waiting (``DecoderGraph.run``'s
        arguments). Stage k+1's task takes stage k's result ref: the hidden states never reach
        the driver."""
        p = self.pipeline
        p.check_usable()
        if tokens_only and not self.has_next_token:
            raise RuntimeError("tokens_only on a graph without a next_token output")
        if with_hidden and not self.has_hidden_states:
            raise RuntimeError("with_hidden on a graph without a last_hidden_state output")
        ref = input_ids
        last = len(p.actors) - 1
        for k, actor in enumerate(p.actors):
            ref = actor.run.remote(p.expect(k), ref, position_ids, logits_index, lengths, vision if k == 0 else None, extra,
                                   first_slot, tokens_only and k == last, with_hidden and k == last)
        return PendingRun(p, ref)

    def run(self, pool: RayStagedPool, input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
            lengths: np.ndarray, vision=None, extra: dict | None = None, first_slot: int = 0,
            tokens_only: bool = False, with_hidden: bool = False):
        """``submit(...).result()``: what the Engine and the scheduler call."""
        return self.submit(pool, input_ids, position_ids, logits_index, lengths, vision, extra, first_slot,
                           tokens_only, with_hidden).result()

    def run_vision(self, feeds: dict) -> np.ndarray:
        """The vision graph, run by the first stage's actor (which owns its files); ``VisionEncoder``
        preprocesses and caches in the driver."""
        p = self.pipeline
        p.check_usable()
        return p.get(p.actors[0].run_vision.remote(p.expect(0), feeds))

    def close(self) -> None:
        """End the stage actors (and a local cluster this driver started)."""
        self.pipeline.close()


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


def open_ray(artifact_dir: Path, manifest: Manifest, manifest_digest: str | None, threads: int | None,
             target: str | None = None, options: RayOptions | None = None) -> tuple[RayStagedDecoder, RayStagedPool]:
    """(runner, pool) for a staged artifact with one Ray actor per stage."""
    options = options or RayOptions()
    for name in ("connect_timeout_s", "start_timeout_s"):
        timeout = getattr(options, name)
        if name == "start_timeout_s" and timeout is None:
            continue
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and math.isfinite(timeout)
                                             and timeout > 0):
            raise GraphkilnError(f"RayOptions.{name} must be a finite number of seconds > 0, got {timeout!r}")
    if not manifest.stages:
        raise GraphkilnError("--distributed ray runs a pipeline-staged artifact, and this one has a single graph: "
                             "re-export with --stages N or --stage-layers, or run it without --distributed")
    n = len(manifest.stages)
    dirs = options.stage_dirs or tuple(str(Path(artifact_dir).resolve()) for _ in range(n))
    if len(dirs) != n:
        raise GraphkilnError(f"stage_dirs has {len(dirs)} entries but the artifact has {n} stages: give one per stage")
    if manifest_digest is None:
        from graphkiln.manifest import MANIFEST_NAME
        import hashlib

        manifest_digest = hashlib.sha256((Path(artifact_dir) / MANIFEST_NAME).read_bytes()).hexdigest()
    ray = import_ray()
    if not ray.is_initialized():
        _local_cluster.update(started=False, drivers=0)
        kwargs = dict(INIT_KWARGS)
        # ray.init replaces this process's SIGTERM handler with sys.exit, and it stays after
        # ray.shutdown: the CLI's own handling (serve's draining, cleanup on interruption) must
        # keep working, so the handler in place before is put back.
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            if options.address is not None:
                join_cluster(ray, options.address, options.connect_timeout_s, kwargs)
            else:
                cpus = options.num_cpus or max(math.ceil(n * options.cpus_per_stage), os.cpu_count() or 1)
                ray.init(num_cpus=cpus, **kwargs)
                _local_cluster["started"] = True
        finally:
            if threading.current_thread() is threading.main_thread() and sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
    owns_cluster = _local_cluster["started"]
    if owns_cluster:
        _local_cluster["drivers"] += 1
    actor_class = ray.remote(StageWorker)
    placement = {"num_cpus": options.cpus_per_stage, "max_restarts": options.max_restarts, "max_task_retries": 0}
    try:
        nodes = resolve_stage_nodes(ray, options.stage_nodes, n)
    except BaseException:
        if owns_cluster:
            _end(ray, [], owns_cluster)
        raise
    actors = []
    for k in range(n):
        where = {}
        if nodes is not None:  # hard affinity: a stage never runs where its files are not
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            where["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[k], soft=False)
        actors.append(actor_class.options(**placement, **where).remote(dirs[k], k, manifest_digest, threads, target))
    try:
        pipeline = _Pipeline(ray, actors, [st.layers for st in manifest.stages], owns_cluster,
                             options.start_timeout_s)
    except ray.exceptions.RayActorError as exc:
        _end(ray, actors, owns_cluster)
        # Ray keeps only the text of a failed __init__: its own one-line error is the last line
        text = str(getattr(exc, "error_msg", None) or exc)
        ours = [l.split("GraphkilnError: ", 1)[1] for l in text.splitlines() if "GraphkilnError: " in l]
        if ours:
            raise GraphkilnError(ours[-1]) from None
        line = (text.splitlines() or [type(exc).__name__])[-1].strip()
        raise GraphkilnError(f"a pipeline stage's Ray actor could not start ({line[:300]}): check the stage's files "
                             "and that graphkiln is installed on every node") from None
    except BaseException:
        _end(ray, actors, owns_cluster)
        raise
    return RayStagedDecoder(pipeline), RayStagedPool(pipeline)
