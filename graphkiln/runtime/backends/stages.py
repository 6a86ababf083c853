"""A pipeline-staged artifact (``manifest.stages``, export.stages) run as one decoder.

``open_staged`` gives the ``Engine`` what ``runtime.backends.open_backend`` gives it for a
single-graph artifact: a step runner (``StagedDecoder``: same ``run`` signature and outputs as
``runtime.backends.ort_cpu.DecoderGraph``) and a pool (``StagedPool``: same slot API as ``StatePool``).
Each step runs the stages in order in this process, the hidden states of stage k feeding
stage k+1.

Unit of distribution. A stage is a ``DecoderGraph`` over its stage graph (reading only that
stage's files; its first input is input_ids or hidden_states, its result logits or hidden_states) plus a ``StatePool`` over only that stage's states (``StageSpec.states``), and
every operation on it is addressed by slot: ``reserve``, ``claim`` / ``release`` (or
``release_keeping_tail``) and ``run(pool, first_input, ...)``. The chained runner and pool only
fan those calls out to every stage in order and check they agree (every stage's slots move the
same way, because every stage sees the same claims and releases). A stage in another process
(a Ray actor owning one stage's ``DecoderGraph`` and its ``StatePool``) is the same calls made remotely:
the slot bookkeeping replays identically on each actor, and only ``hidden_states`` [batch,
seq, hidden] (and the last stage's logits or tokens) cross between them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, Manifest
from graphkiln.runtime.backends.ort_cpu import DecoderGraph, numpy_dtype
from graphkiln.runtime.backends.state import StatePool, takes_window_offset


def open_stage_graph(artifact_dir: Path, spec: GraphSpec, threads: int | None) -> DecoderGraph:
    """One stage's runner: the stages run one after another, so its threads do not spin once a run
    ends (see ``DecoderGraph``)."""
    return DecoderGraph(artifact_dir, spec, threads, spinning=False)


class StagedPool:
    """Every stage's own ``StatePool``, moved in lockstep: one slot number means the same request
    in each (see the module docstring). The slot API of ``StatePool``/``PackedSlots``."""

    def __init__(self, pools: list[StatePool]) -> None:
        self.pools = pools

    @property
    def slots(self) -> int:
        return self.pools[0].slots

    @property
    def live(self) -> int:
        return self.pools[0].live

    @property
    def free_slots(self) -> int:
        return self.pools[0].free_slots

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pools)

    @property
    def windowed(self) -> bool:
        return any(p.windowed for p in self.pools)

    def kv_bytes_per_token(self, context: int) -> float:
        return sum(p.kv_bytes_per_token(context) for p in self.pools)

    def reserve(self, slots: int, capacity: int) -> None:
        for p in self.pools:
            p.reserve(slots, capacity)

    def claim(self) -> int:
        got = {p.claim() for p in self.pools}
        if len(got) != 1:  # lockstep broken: a bug, not user input
            raise RuntimeError(f"stage pools claimed different slots {sorted(got)}")
        return got.pop()

    def release(self, slot: int) -> int | None:
        moved = {p.release(slot) for p in self.pools}
        if len(moved) != 1:
            raise RuntimeError(f"stage pools moved different slots {sorted(moved, key=str)}")
        return moved.pop()

    def release_keeping_tail(self, slot: int, tail: int = 0) -> list[tuple[int, int]]:
        moves = [p.release_keeping_tail(slot, tail) for p in self.pools]
        if any(m != moves[0] for m in moves):
            raise RuntimeError("stage pools moved slots differently")
        return moves[0]

    # cached prefix blocks: each stage's pool keeps its own layers' rows under the same block ids

    def block_bytes(self, block_size: int) -> int:
        return sum(p.block_bytes(block_size) for p in self.pools)

    def attach_store(self, blocks: int, block_size: int) -> None:
        for p in self.pools:
            p.attach_store(blocks, block_size)

    def save_blocks(self, slot: int, blocks, ids, snapshot: int | None = None) -> None:
        for p in self.pools:
            p.save_blocks(slot, blocks, ids, snapshot)

    def load_blocks(self, slot: int, ids, snapshot: int | None = None) -> None:
        for p in self.pools:
            p.load_blocks(slot, ids, snapshot)


def merged_spec(specs: list[GraphSpec]) -> GraphSpec:
    """The stages' graphs seen as one decoder graph (what the Engine reads from ``spec``): the
    first stage's inputs plus any later stage's own non-state inputs, every stage's state
    tensors, the last stage's outputs. Shared by the chained runner and the Ray driver
    (runtime.backends.distributed)."""
    first, last = specs[0], specs[-1]
    inputs = [t for t in first.inputs if t.layer is None]
    for spec in specs[1:]:
        inputs += [t for t in spec.inputs if t.layer is None and t.role != "hidden_states"
                   and t.role not in {u.role for u in inputs}]
    inputs += [t for spec in specs for t in spec.inputs if t.layer is not None]
    outputs = [t for t in last.outputs if t.layer is None]
    outputs += [t for spec in specs for t in spec.outputs if t.layer is not None]
    return dataclasses.replace(last, name="decoder", file=first.file, inputs=tuple(inputs), outputs=tuple(outputs))


class StagedDecoder:
    """The stages chained in this process, with ``DecoderGraph``'s ``spec`` (a merged view: the
    first stage's inputs, every stage's state tensors, the last stage's outputs) and ``run``."""

    def __init__(self, runners: list[DecoderGraph]) -> None:
        self.runners = runners
        self.spec = merged_spec([r.spec for r in runners])
        self.has_next_token = runners[-1].has_next_token
        self.has_hidden_states = runners[-1].has_hidden_states

    def bind_adapters(self, pool) -> None:
        """``DecoderGraph.bind_adapters`` for every stage (each feeds its own layers' stacks)."""
        for runner in self.runners:
            runner.bind_adapters(pool)

    def run(self, pool: StagedPool, input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
            lengths: np.ndarray, vision=None, extra: dict | None = None, first_slot: int = 0,
            tokens_only: bool = False, with_hidden: bool = False):
        """``DecoderGraph.run`` over every stage in order (see there for the arguments)."""
        if tokens_only and not self.has_next_token:
            raise RuntimeError("tokens_only on a graph without a next_token output")
        if with_hidden and not self.has_hidden_states:
            raise RuntimeError("with_hidden on a graph without a last_hidden_state output")
        x = input_ids
        last = len(self.runners) - 1
        for k, (runner, stage_pool) in enumerate(zip(self.runners, pool.pools)):
            x = runner.run(stage_pool, x, position_ids, logits_index, lengths, vision=vision if k == 0 else None,
                           extra=extra, first_slot=first_slot, tokens_only=tokens_only and k == last,
                           with_hidden=with_hidden and k == last)
        return x


def open_staged(artifact_dir: Path, manifest: Manifest, backend: str, device: str, threads: int | None,
                target: str | None = None) -> tuple[StagedDecoder, StagedPool]:
    """(runner, pool) for a staged artifact; onnxruntime on the CPU only for now."""
    if (backend, device) != ("onnxruntime", "cpu"):
        raise GraphkilnError(f"pipeline-staged artifacts run on onnxruntime on the CPU only for now, not {backend} on "
                             f"{device}: load it without backend/device")
    dtype = numpy_dtype(manifest.states[0].dtype)
    runners, pools = [], []
    for stage in manifest.stages:
        spec = manifest.graph(stage.graph, target) if target else manifest.graph_for(stage.graph, backend)
        runners.append(open_stage_graph(artifact_dir, spec, threads))
        pools.append(StatePool(stage.states, dtype, windowed=takes_window_offset(spec)))
    return StagedDecoder(runners), StagedPool(pools)
