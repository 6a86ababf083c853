"""A pipeline-staged artifact (``manifest.stages``, export.stages) run as one decoder.

``open_staged`` gives the ``Engine`` what ``runtime.backends.open_backend`` gives it for a
single-graph artifact: a step runner (``StagedDecoder``: same ``run`` signature and outputs as
``runtime.decoder.DecoderGraph``) and a pool (``StagedPool``: same slot API as ``StatePool``).
Each step runs the stages in order in this process, the hidden states of stage k feeding
stage k+1.

Unit of distribution. A stage is a ``StageRunner`` (its graph's session, reading only that
stage's files) plus a ``StatePool`` over only that stage's states (``StageSpec.states``), and
every operation on it is addressed by slot: ``reserve``, ``claim`` / ``release`` (or
``release_keeping_tail``) and ``run(pool, first_input, ...)``. The chained runner and pool only
fan those calls out to every stage in order and check they agree (every stage's slots move the
same way, because every stage sees the same claims and releases). A stage in another process
(a Ray actor owning one ``StageRunner`` and its ``StatePool``) is the same calls made remotely:
the slot bookkeeping replays identically on each actor, and only ``hidden_states`` [batch,
seq, hidden] (and the last stage's logits or tokens) cross between them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, Manifest, StageSpec, is_pool_output
from graphkiln.runtime.decoder import cpu_session, numpy_dtype, total_sequence_length
from graphkiln.runtime.prompt_layout import needed_roles, pack
from graphkiln.runtime.state import StatePool


def _stage_session(artifact_dir: Path, spec: GraphSpec, threads: int | None):
    """``runtime.decoder.cpu_session`` with the intra-op threads not spinning once a run ends: the
    stages' sessions run one after the other, each with its own thread pool, and a pool spinning
    through the next stage's run takes that stage's cores (measured on this shared 2-core
    machine: a 2-stage 28M-parameter Llama decoded at 0.55-0.7x the single graph with 2
    spinning threads, 0.92-0.97x with 1 thread)."""
    return cpu_session(artifact_dir, spec, threads, spinning=False)


class StageRunner:
    """One stage's graph on onnxruntime CPU. Stateless between calls: every state it reads and
    writes is in the ``StatePool`` passed to ``run`` (the stage's own, see the module docstring)."""

    def __init__(self, artifact_dir: Path, spec: GraphSpec, stage: StageSpec, threads: int | None = None) -> None:
        self.spec, self.stage = spec, stage
        self.session = _stage_session(artifact_dir, spec, threads)
        self.names = {t.role: t.name for t in spec.inputs if t.layer is None}
        self.first_role = "input_ids" if "input_ids" in self.names else "hidden_states"
        self.layout_roles = needed_roles(self.names)
        seam = next((t for t in spec.inputs if t.role == "vision_embeddings"), None)
        self._no_vision_rows = None if seam is None else np.zeros((0, seam.shape[1]), numpy_dtype(seam.dtype))
        self.states = [(t.role, t.layer, t.name) for t in spec.inputs if t.layer is not None]
        self.outputs = list(spec.outputs)
        self.in_place = any(t.role in ("present_key", "present_value") or is_pool_output(t) for t in spec.outputs)
        self.result_role = next(t.role for t in spec.outputs if t.role in ("logits", "hidden_states"))
        self.has_next_token = any(t.role == "next_token" for t in spec.outputs)
        self.has_hidden_states = any(t.role == "last_hidden_state" for t in spec.outputs)  # the last stage's
        self._bindings: dict[tuple, tuple] = {}  # see _run_bound

    def run(self, pool: StatePool, first_input: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
            lengths: np.ndarray, vision=None, extra: dict | None = None, first_slot: int = 0,
            tokens_only: bool = False, with_hidden: bool = False):
        """One forward of this stage over slots first_slot.. of ``pool``; ``first_input`` is
        input_ids (first stage) or the previous stage's hidden_states. Returns hidden_states
        [n, seq, hidden], or for the last stage logits (or, ``tokens_only``, next_token), and
        with ``with_hidden`` (the last stage, ``has_hidden_states``) a pair of that and its
        last_hidden_state [n, n_logits, hidden]."""
        n, seq = position_ids.shape
        slot_idx = np.arange(first_slot, first_slot + n, dtype=np.int64)
        given = {self.first_role: first_input, "position_ids": position_ids, "logits_index": logits_index,
                 "seq_lens": lengths.astype(np.int64), "slot_idx": slot_idx,
                 "total_sequence_length": total_sequence_length(position_ids, lengths)}
        if self._no_vision_rows is not None:
            rows, indices = vision if vision is not None else (self._no_vision_rows, np.zeros(0, np.int64))
            given["vision_embeddings"], given["vision_scatter_indices"] = rows, indices.astype(np.int64)
        for role in self.layout_roles:
            given[role] = (extra or {}).get(role)
            if given[role] is None:
                given[role] = pack((role,), [None] * n, position_ids[:, 0], seq)[role]
        feeds = {name: np.ascontiguousarray(given[role]) for role, name in self.names.items()}
        dims = {"batch": n, "seq": seq, "n_logits": logits_index.shape[1]}
        if self.in_place:
            outs = self._run_bound(pool, first_slot, feeds, dims)
        else:
            keys, values = pool.kv_views(n, first_slot)
            for role, layer, name in self.states:
                feeds[name] = keys[layer] if role == "past_key" else values[layer] if role == "past_value" else pool.conv[layer]
            outs = self.session.run([t.name for t in self.outputs], feeds)
        new: dict[int, dict[str, np.ndarray]] = {}
        for t, value in zip(self.outputs, outs):
            if t.role in ("new_key", "new_value", "new_conv_state") and not is_pool_output(t):
                new.setdefault(t.layer, {})[t.role] = value
        for layer, rows in new.items():
            if "new_conv_state" in rows:
                pool.write_conv(layer, rows["new_conv_state"], slot_idx)
            else:
                pool.write_kv(layer, rows["new_key"], rows["new_value"], position_ids[:, 0], lengths, first_slot)
        want = "next_token" if tokens_only else self.result_role
        result = next(value for t, value in zip(self.outputs, outs) if t.role == want)
        if with_hidden:
            return result, next(value for t, value in zip(self.outputs, outs) if t.role == "last_hidden_state")
        return result

    def _run_bound(self, pool: StatePool, first: int, feeds: dict[str, np.ndarray], dims: dict[str, int]) -> list:
        """An in-place graph: each state buffer bound as both its input and its present_* /
        whole-pool output (written in place, no copy). The binding for these slots and shapes is
        kept (a decode step then only copies its small inputs into the arrays bound to it) until
        the pool replaces its buffers (``pool.generation``). Returns the outputs in spec order,
        None for the state ones."""
        key = (id(pool), pool.generation, first, tuple(sorted(dims.items())), tuple(f.shape for f in feeds.values()))
        bound = self._bindings.get(key)
        if bound is None:
            if any(k[:2] != key[:2] for k in self._bindings) or len(self._bindings) >= 4:
                self._bindings.clear()  # bindings over replaced buffers are never valid again
            bound = self._bindings[key] = self._bind(pool, first, feeds, dims)
        binding, inputs, outs = bound
        for name, value in feeds.items():
            np.copyto(inputs[name], value)
        self.session.run_with_iobinding(binding)
        return outs

    def _bind(self, pool: StatePool, first: int, feeds: dict[str, np.ndarray], dims: dict[str, int]):
        import onnxruntime as ort

        n = dims["batch"]
        binding = self.session.io_binding()
        held, inputs = {}, {}
        keys, values = pool.kv_views(n, first)
        for name, value in feeds.items():
            inputs[name] = np.array(value, copy=True, order="C")
            held[name] = ort.OrtValue.ortvalue_from_numpy(inputs[name])
            binding.bind_ortvalue_input(name, held[name])
        for role, layer, name in self.states:
            view = keys[layer] if role == "past_key" else values[layer] if role == "past_value" else pool.conv[layer]
            held[name] = ort.OrtValue.ortvalue_from_numpy(view)  # wraps the pool's memory: no copy
            binding.bind_ortvalue_input(name, held[name])
        state_input = {(role, layer): name for role, layer, name in self.states}
        outs = []
        for t in self.outputs:
            if t.role in ("present_key", "present_value"):
                binding.bind_ortvalue_output(t.name, held[state_input[t.role.replace("present_", "past_"), t.layer]])
                outs.append(None)
            elif is_pool_output(t):
                binding.bind_ortvalue_output(t.name, held[state_input["conv_state", t.layer]])
                outs.append(None)
            else:
                shape = tuple(dims[d] if isinstance(d, str) else d for d in t.shape)
                buf = np.empty(shape, numpy_dtype(t.dtype))
                binding.bind_output(t.name, "cpu", 0, buf.dtype, list(shape), buf.ctypes.data)
                outs.append(buf)
        # the OrtValues must outlive the binding: kept with it
        return binding, inputs, _Outputs(outs, held)


class _Outputs(list):
    """A binding's output arrays (a list), holding the OrtValues the binding points into."""

    def __init__(self, outs: list, held: dict) -> None:
        super().__init__(outs)
        self.held = held


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


def merged_spec(specs: list[GraphSpec]) -> GraphSpec:
    """The stages' graphs seen as one decoder graph (what the Engine reads from ``spec``): the
    first stage's inputs plus any later stage's own non-state inputs, every stage's state
    tensors, the last stage's outputs. Shared by the chained runner and the Ray driver
    (runtime.distributed)."""
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

    def __init__(self, runners: list[StageRunner]) -> None:
        self.runners = runners
        self.spec = merged_spec([r.spec for r in runners])
        self.has_next_token = runners[-1].has_next_token
        self.has_hidden_states = runners[-1].has_hidden_states

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
        runners.append(StageRunner(artifact_dir, spec, stage, threads))
        pools.append(StatePool(stage.states, dtype))
    return StagedDecoder(runners), StagedPool(pools)
