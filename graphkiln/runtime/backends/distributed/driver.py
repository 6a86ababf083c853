"""The driver's side, in the Engine's process: the stage actors and what it knows of them
(``Pipeline``: incarnations, pool size, restarted stages), the slot API over their pools
(``RayStagedPool``) and the forward as a chain of actor tasks (``RayStagedDecoder``, ``PendingRun``)."""

from __future__ import annotations

import time
import weakref

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime.backends.distributed.cluster import end_actors
from graphkiln.runtime.backends.distributed.options import RESTART_WAIT_S, StageFailed
from graphkiln.runtime.backends.state import PackedSlots


class _Mirror(PackedSlots):
    """The packed-slot arithmetic alone: the driver's copy of what every stage pool does."""

    def __init__(self) -> None:
        self.slots, self.live = 0, 0

    def _clear_conv_row(self, slot: int) -> None:
        pass

    def _move_row(self, dst: int, src: int) -> None:
        pass


class Pipeline:
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
        self._finalizer = weakref.finalize(self, end_actors, ray, list(actors), owns_cluster)

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


class RayStagedPool:
    """``StatePool``'s slot API over the stage actors' pools (see the module docstring)."""

    def __init__(self, pipeline: Pipeline) -> None:
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

    def __init__(self, pipeline: Pipeline, ref) -> None:
        self.pipeline, self.ref = pipeline, ref

    def ready(self) -> bool:
        done, _ = self.pipeline.ray.wait([self.ref], timeout=0)
        return bool(done)

    def result(self) -> np.ndarray:
        return self.pipeline.get(self.ref)


class RayStagedDecoder:
    """``DecoderGraph``'s ``spec`` and ``run`` over the stage actors (see the module docstring)."""

    def __init__(self, pipeline: Pipeline) -> None:
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
