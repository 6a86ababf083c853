"""One onnxruntime session for the decoder graph, bound to a ``StatePool`` by tensor role.

Two KV contracts (manifest state ``update``): ``scatter_rows`` graphs return the new rows
(``new_key.i``) and this class stores them; ``in_place`` graphs (the onnxruntime target's
GroupQueryAttention, the tensorrt target's Attention with ``kv_update=1``) return
``present_key.i``, which is bound to the same pool buffer as ``past_key.i`` so the graph writes
its rows there itself. Slot states (conv, recurrent) likewise: ``new_conv_state.i`` /
``new_recurrent_state.i`` is either the rows (``slot_rows``, stored here at ``slot_idx``) or the
whole pool (``in_place``, the tensorrt target's ShortConv / GatedDeltaRule with
``state_update=1``), bound to the ``conv_state.i`` / ``recurrent_state.i`` buffer.

In place on onnxruntime (measured, onnxruntime 1.32 CPU): the tensorrt target's functions end
in ScatterElements / ScatterND, which skip their input-to-output copy when both are one buffer,
so the bound state is updated without copying the cache (a 64 MiB state: 0.2 ms aliased, 32 ms
into a separate buffer). Reads of the state that may run after the scatter are safe: attention
only reads cache positions below each row's start, and the scatter writes only at or above it
(or rewrites a cell with the value it holds); the conv rows written are computed from the
state read at ``slot_idx``, so that read comes first.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.memory import file_mappings, release_file_pages, trim_heap
from graphkiln.threads import check_threads
from graphkiln.batched_int8 import derived_weights
from graphkiln.manifest import (LORA_STACK_ROLES, SLOT_STATE_INPUTS, SLOT_STATE_ROLES, BatchedGraphSpec, GraphSpec,
                                is_pool_output, is_state)
from graphkiln.runtime.prompt_layout import needed_roles, pack
from graphkiln.runtime.backends.state import StatePool


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes  # numpy has no bfloat16; onnxruntime ships ml_dtypes-compatible buffers

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def total_sequence_length(position_ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """GroupQueryAttention's ``total_sequence_length`` input (onnxruntime target): the step's
    longest row, ``max(start + length)`` with ``start = position_ids[:, 0]``, an int32 scalar
    (what the graph computed itself before it became an input: onnxruntime's CUDA kernel reads
    it in host memory, so computing it on the device put a copy inside the step)."""
    return np.array(int((position_ids[:, 0] + lengths).max()), np.int32)


_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(bfloat16)": "bfloat16",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(int8)": "int8", "tensor(uint8)": "uint8",
              "tensor(bool)": "bool"}


def cpu_session(artifact_dir: Path, spec: GraphSpec, threads: int | None = None, spinning: bool = True,
                file: str | None = None, initializers: dict[str, np.ndarray] | None = None):
    """An onnxruntime CPU session over graph ``spec`` (``threads`` intra-op threads, default every
    core); a graph onnxruntime cannot load is one GraphkilnError line, and its inputs and outputs
    are checked against the manifest (``check_io``). ``spinning`` False: the intra-op threads
    sleep once a run ends instead of spinning (sessions that run one after another, such as
    pipeline stages, would otherwise take each other's cores). ``file``: another graph file with
    the same inputs and outputs (a batched-step graph); ``initializers``: arrays onnxruntime
    takes for the graph's external initializers of those names, without copying (the caller
    keeps them alive as long as the session)."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    if initializers:
        opts.add_external_initializers(list(initializers), [ort.OrtValue.ortvalue_from_numpy(a)
                                                            for a in initializers.values()])
    opts.intra_op_num_threads = check_threads(threads)
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if not spinning:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        session = _build_session(ort, artifact_dir, file or spec.file, opts)
    except Exception as exc:
        if any(t.dtype == "bfloat16" for t in spec.inputs + spec.outputs):
            raise GraphkilnError("bf16 artifacts do not run on onnxruntime CPU (it has no bf16 MatMul): "
                                 "re-export with --dtype fp16 or fp32 for CPU") from None
        raise GraphkilnError(
            f"onnxruntime cannot load {file or spec.file} ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
            "re-export the artifact (for CPU use --dtype fp32 or fp16)"
        ) from None
    check_io(session, spec)
    return session


# Engine.load's memory check counts each session at LOAD_FACTOR x the bytes of the files it reads,
# plus SESSION_OVERHEAD_BYTES. Measured (anonymous memory, the part the OOM killer counts; random
# Llama-3.2-1B shape, 2026-12-06): int4 files 0.72 GiB -> peak 1.03 GiB during load (estimate 1.06),
# fp32 files 4.60 GiB -> peak 5.59 GiB (estimate 5.72; onnxruntime copies fp32 weights, it does not
# run them from the file mapping); the 8B int4 artifact's RSS after load was 1.19x its files
# (scripts/bench_load_scale.py). Artifact pages read through the file mapping are file-backed: the
# kernel reclaims them (and _build_session drops them), so they are not counted.
LOAD_FACTOR = 1.2
SESSION_OVERHEAD_BYTES = 200 << 20  # onnxruntime's session and arena, the graph: measured 0.17 GiB (1B int4)


def session_file_bytes(artifact_dir: Path, specs) -> int:
    """The bytes onnxruntime reads to build CPU sessions over the graphs ``specs``: each graph
    file and every external data file it names, each file once (a multi-target artifact's graphs
    share one data file), by its size on disk; nothing is read but the graph protobufs. A batched
    graph's derived weights are made in memory, not read (``batched_int8.derived_bytes``).
    Paths must already be checked to stay inside the artifact (``artifact.check_artifact``)."""
    import os

    from graphkiln.artifact import graph_external_data
    from graphkiln.batched_int8 import DERIVED_LOCATION
    from graphkiln.manifest import artifact_file

    files = set()
    for spec in specs:
        files.add(spec.file)
        files.update(rel for rel, location in graph_external_data(artifact_dir, spec.file).items()
                     if location != DERIVED_LOCATION)
    total = 0
    for rel in files:
        try:
            total += os.stat(artifact_file(artifact_dir, rel)).st_size
        except OSError:
            pass  # a missing file is reported where it is opened
    return total


_BUILDING = threading.Lock()  # one session built at a time in this process: see _build_session


def _build_session(ort, artifact_dir: Path, graph_file: str, opts):
    """The InferenceSession over ``graph_file``, and then the pages of the artifact's files
    (its external data) that onnxruntime left resident dropped from this process (``memory.release_file_pages``).

    onnxruntime memory-maps each external initializer and reads it while building the session;
    those it keeps afterwards stay mapped, their pages resident, though it runs from its own
    pre-packed copies: MatMulNBits keeps its block scales after packing them into its weights
    (measured on a 1.5B-parameter int4 Llama: 0.14 GiB resident of 0.87 GiB of artifact, 1.26 ->
    1.12 GiB RSS after load; none of it read back by prefill or decode). Only the mappings that
    appeared while this session was built are released: this session holds them for its life,
    so none is unmapped (and its address reused) meanwhile; builds are serialized in this process
    so that another thread's half-built session's mappings, which it may unmap at any moment, are
    never among them. While it builds, the pages it has read are paged out as it goes
    (``_PagingOut``), so they never pile up beside its packed copies."""
    with _BUILDING:
        before = {m["start"] for m in file_mappings(artifact_dir)}
        with _PagingOut(artifact_dir, before):
            session = ort.InferenceSession(str(artifact_dir / graph_file), opts, providers=["CPUExecutionProvider"])
        release_file_pages(m for m in file_mappings(artifact_dir) if m["start"] not in before)
    trim_heap()  # the build's temporaries (and a batched graph's derived weights' ones)
    return session


class _PagingOut:
    """While a session is built (a ``with`` block): every ``period`` seconds a thread pages out
    (``madvise(MADV_PAGEOUT)``) this process's mappings of the artifact's files that were not
    there at the start (``before``: start addresses). onnxruntime maps every external
    initializer and reads it to pre-pack it; the pages it read stayed resident until the build
    ended (then ``release_file_pages`` drops them), beside the packed copies: a Llama-3.1-8B int4
    artifact's load peaked at 5.36 GiB anonymous + 1.16 GiB of its files resident
    (scripts/bench_load_scale.py). MADV_PAGEOUT, unlike MADV_DONTNEED, never loses data, so
    it is safe on an address onnxruntime unmapped meanwhile and reused for other memory: clean
    file pages are dropped (a later read faults them back), anonymous ones stay without swap.
    /proc/self/maps is read, not smaps (no page-table walk). Linux only; elsewhere a no-op."""

    def __init__(self, directory: Path, before: set[int], period: float = 0.1) -> None:
        import mmap
        import sys

        self.prefix = str(Path(directory).resolve()) + "/"
        self.before, self.period = before, period
        # MADV_PAGEOUT is 21 on every Linux architecture (uapi mman-common.h); older Pythons lack the name
        self.advice = getattr(mmap, "MADV_PAGEOUT", 21) if sys.platform.startswith("linux") else None
        self.stop = threading.Event()
        self.thread = None

    def __enter__(self) -> "_PagingOut":
        if self.advice is not None:
            import ctypes

            self.madvise = ctypes.CDLL(None, use_errno=True).madvise
            self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            self.thread = threading.Thread(target=self._run, name="graphkiln-page-out", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()

    def _run(self) -> None:
        while not self.stop.wait(self.period):
            try:
                lines = Path("/proc/self/maps").read_text().splitlines()
            except OSError:
                return
            for line in lines:
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(self.prefix):
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    if start not in self.before:
                        self.madvise(start, end - start, self.advice)


def check_io(session, spec: GraphSpec) -> None:
    """The graph's inputs and outputs are the ones its manifest declares (names, dtypes, fixed
    dimensions): the runtime feeds and allocates by the manifest, so a manifest that disagrees
    with its graph is refused here rather than failing inside onnxruntime at the first step."""
    declared = {t.name for t in spec.inputs}
    for arg in session.get_inputs():
        if arg.name not in declared:
            raise GraphkilnError(f"graph {spec.file} needs input {arg.name!r}, which its manifest does not declare: "
                                 "re-export the artifact")
    for side, tensors, args in (("input", spec.inputs, session.get_inputs()), ("output", spec.outputs, session.get_outputs())):
        actual = {a.name: a for a in args}
        for t in tensors:
            a = actual.get(t.name)
            if a is None:
                raise GraphkilnError(f"graph {spec.file} has no {side} {t.name!r}, which its manifest declares: "
                                     "re-export the artifact")
            dtype = _ORT_TYPES.get(a.type, a.type)
            shape = list(a.shape or ())  # [] when onnxruntime does not know the rank: nothing to compare
            if dtype != t.dtype or (shape and len(shape) != len(t.shape)) or any(
                    isinstance(x, int) and isinstance(y, int) and x != y for x, y in zip(shape, t.shape)):
                raise GraphkilnError(f"graph {spec.file} {side} {t.name!r} is {dtype} {shape}, but its manifest says "
                                     f"{t.dtype} {list(t.shape)}: re-export the artifact")


def slot_pool(pool: StatePool, role: str, layer: int) -> np.ndarray:
    """The pool a slot-state input (``conv_state``, ``recurrent_state``) of ``layer`` reads."""
    return pool.conv[layer] if role == "conv_state" else pool.recurrent[layer]


class DecoderGraph:
    """Runs prefill and decode steps of one decoder graph: the whole model, or one pipeline stage
    (export.stages: its first input is ``input_ids`` or the previous stage's ``hidden_states``,
    its result the ``logits`` or its own ``hidden_states``). Reads the cache prefix ``[:n]`` of
    its pool and writes new rows into it; holds no state between calls but kept IOBindings."""

    def __init__(self, artifact_dir: Path, spec: GraphSpec, threads: int | None = None, spinning: bool = True,
                 batched: BatchedGraphSpec | None = None) -> None:
        """``spinning`` False for graphs run one after another in this process (pipeline stages):
        each has its own intra-op pool, and one spinning through the next stage's run takes that
        stage's cores (measured on this shared 2-core machine: a 2-stage 28M-parameter Llama
        decoded at 0.55-0.7x the single graph with spinning threads, 0.92-0.97x without).
        ``batched``: a batched-step graph for ``spec`` (``graphkiln.batched_int8``), run instead of
        it for steps of at least ``batched.min_rows`` token rows; its int8 weights are derived
        here and live as long as this object."""
        roles = {t.role for t in spec.inputs}
        first = "input_ids" if "input_ids" in roles else "hidden_states"
        outs = {t.role for t in spec.outputs}
        # logits; a stage before the last: its hidden_states; an embedding graph (manifest.EmbeddingSpec):
        # last_hidden_state alone, returned as the result and as the hidden states
        result = next((r for r in ("logits", "hidden_states", "last_hidden_state") if r in outs), "logits")
        required = {first, "position_ids"} | ({"logits_index"} if result != "hidden_states" else set())
        if not required <= roles or not any(t.role == result for t in spec.outputs):
            raise GraphkilnError(f"graph '{spec.name}' lacks inputs {sorted(required - roles)} or its {result} output: "
                                 "re-export the artifact")
        self.first_role = first
        self.spec = spec
        self.session = cpu_session(artifact_dir, spec, threads, spinning)
        self.batched_session, self.batched_min_rows = None, 0
        if batched is not None:
            self._derived = derived_weights(artifact_dir, batched)  # onnxruntime reads these arrays, not copies
            self.batched_session = cpu_session(artifact_dir, spec, threads, spinning, batched.file, self._derived)
            self.batched_min_rows = batched.min_rows
        self.names = {t.role: t.name for t in spec.inputs if t.layer is None}
        self.layout_roles = needed_roles(self.names)
        seam = next((t for t in spec.inputs if t.role == "vision_embeddings"), None)
        if seam is not None:  # zero rows: a step without images
            self._no_vision_rows = np.zeros((0, seam.shape[1]), numpy_dtype(seam.dtype))
        self.states = [(t.role, t.layer, t.name) for t in spec.inputs if is_state(t)]
        # LoRA stacks (manifest.LoraSpec): input name -> ((layer, module), 0 for A / 1 for B); their
        # arrays come from ``bind_adapters`` (the engine's AdapterPool, never reallocated)
        self.lora_stacks = {t.name: ((t.layer, t.module), LORA_STACK_ROLES.index(t.role)) for t in spec.inputs
                            if t.role in LORA_STACK_ROLES}
        self._lora_feeds: dict[str, np.ndarray] = {}
        self._lora_values: dict[str, object] = {}  # name -> OrtValue over the pool's array (in-place graphs)
        self.outputs = [t.name for t in spec.outputs]
        self.new = [(t.role, t.layer) for t in spec.outputs]
        self.present = {(t.role.replace("present_", "past_"), t.layer): t.name for t in spec.outputs
                        if t.role in ("present_key", "present_value")}
        # slot states (conv, recurrent) whose output is the whole pool, bound to the input's buffer:
        # (input role, layer) -> output name
        self.pool_outputs = {(SLOT_STATE_INPUTS[t.role], t.layer): t.name for t in spec.outputs if is_pool_output(t)}
        # in-place graphs: IOBindings by (batch, first slot, pool, pool generation, tokens only), a
        # few kept (a scheduler alternates a decode range and a prefill range); see _binding
        self._bindings: dict[tuple, _Bound] = {}
        # the outputs an in-place graph returns into its own buffers: all but present_*
        self._returned = [(i, t.name, t.shape, numpy_dtype(t.dtype)) for i, t in enumerate(spec.outputs)
                          if t.role not in ("present_key", "present_value") and not is_pool_output(t)]
        # Per-step loops cover only what needs work (a decode step's Python runs with cold caches).
        self._slot_inputs = [(role, layer, name) for role, layer, name in self.states
                             if role in SLOT_STATE_ROLES and (role, layer) not in self.pool_outputs]
        self._logits_at = next(i for i, t in enumerate(spec.outputs) if t.role == result)  # logits, or a stage's hidden states
        # the folded greedy sampler: argmax per logits row, -1 for a row with NaN/+Inf or no finite value
        self._next_token_at = next((i for i, t in enumerate(spec.outputs) if t.role == "next_token"), None)
        self.has_next_token = self._next_token_at is not None
        # export --return-hidden-states: final-norm hidden states at the logits positions
        self._hidden_at = next((i for i, t in enumerate(spec.outputs) if t.role == "last_hidden_state"), None)
        self.has_hidden_states = self._hidden_at is not None
        self._state_rows = [(i, t.role, t.layer) for i, t in enumerate(spec.outputs)
                            if t.role in ("new_key", "new_value", *SLOT_STATE_ROLES.values()) and not is_pool_output(t)]

    def bind_adapters(self, pool) -> None:
        """Feed the LoRA stack inputs from ``pool.arrays`` ({(layer, module): (A, B)}: the engine's
        ``runtime.lora.AdapterPool``, or a stage actor's copies), which the caller keeps alive and
        never reallocates for this object's life; ``lora_rows`` / ``lora_slots`` pick the rows and their slots. Until then a graph with
        LoRA inputs cannot run."""
        import onnxruntime as ort

        arrays = pool.arrays
        self._lora_feeds = {name: arrays[key][which] for name, (key, which) in self.lora_stacks.items()}
        self._lora_values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in self._lora_feeds.items()}
        self._bindings.clear()

    def run(self, pool: StatePool, first_input: np.ndarray, position_ids: np.ndarray,
            logits_index: np.ndarray, lengths: np.ndarray,
            vision: tuple[np.ndarray, np.ndarray] | None = None,
            extra: dict[str, np.ndarray] | None = None, first_slot: int = 0,
            tokens_only: bool = False, with_hidden: bool = False):
        """One forward over the live slots first_slot..first_slot+n-1 (n = len(first_input):
        input_ids [n, seq], or a later stage's hidden_states [n, seq, hidden]); returns logits
        [n, n_logits, vocab] (a stage before the last: its hidden_states [n, seq, hidden]), or
        with ``tokens_only`` (graphs with a ``next_token`` output, ``has_next_token``) the argmax
        token ids [n, n_logits] int64 (-1: a row with NaN/+Inf or no finite logit) and no logits
        are copied out of the graph. ``with_hidden`` (graphs with a
        ``last_hidden_state`` output, ``has_hidden_states``): returns (that, hidden states
        [n, n_logits, hidden]) instead; without it a graph's hidden states are not fetched.

        Row b is slot first_slot + b and holds ``lengths[b]`` real tokens starting at position
        ``position_ids[b, 0]``; its new state rows are written into the pool before returning.
        ``vision`` = (embeddings [rows, hidden], flat token-row indices [rows]) for a
        vision-language decoder (the seam, models.decoder); None passes zero rows.
        ``extra``: the layout inputs this graph takes (``runtime.prompt_layout``: M-RoPE positions,
        lookahead) by role; a role not given gets plain positions / causal zeros.
        The logits array may be a buffer this object reuses: valid until the next ``run``
        (copy what must outlive it).
        """
        n, seq = position_ids.shape
        if tokens_only and not self.has_next_token:
            raise RuntimeError("tokens_only on a graph without a next_token output")
        if with_hidden and not self.has_hidden_states:
            raise RuntimeError("with_hidden on a graph without a last_hidden_state output")
        slot_idx = np.arange(first_slot, first_slot + n, dtype=np.int64)
        given = {self.first_role: first_input, "position_ids": position_ids, "logits_index": logits_index,
                 "seq_lens": lengths.astype(np.int64), "slot_idx": slot_idx}
        if "total_sequence_length" in self.names:  # artifacts exported before it was an input lack it
            given["total_sequence_length"] = total_sequence_length(position_ids, lengths)
        if "window_offset" in self.names:  # sliding layers over window-sized caches (state.StatePool.window_offsets)
            given["window_offset"], given["window_total_sequence_length"] = pool.window_offsets(
                position_ids[:, 0], lengths, seq, first_slot)
        if "vision_embeddings" in self.names:
            rows, indices = vision if vision is not None else (self._no_vision_rows, np.zeros(0, np.int64))
            given["vision_embeddings"], given["vision_scatter_indices"] = rows, indices.astype(np.int64)
        for role in self.layout_roles:
            given[role] = (extra or {}).get(role)
            if given[role] is None:
                given[role] = pack((role,), [None] * n, position_ids[:, 0], seq)[role]
        if "lora_rows" in self.names:  # the rows with an adapter and their slots; none given: no row has one
            for role in ("lora_rows", "lora_slots"):
                given[role] = (extra or {}).get(role, _NO_ROWS)
            if len(self._lora_feeds) != len(self.lora_stacks):
                raise RuntimeError("a LoRA graph run before bind_adapters")
        session = self._session_for(n * seq)
        if self.present or self.pool_outputs:
            outs = self._run_bound(session, pool, n, first_slot, tokens_only, given,
                                   {"batch": n, "seq": seq, "n_logits": logits_index.shape[1]})
        else:
            feeds = {name: given[role] for role, name in self.names.items()}
            keys, values = pool.kv_views(n, first_slot)
            for role, layer, name in self.states:
                feeds[name] = (keys[layer] if role == "past_key" else values[layer] if role == "past_value"
                               else slot_pool(pool, role, layer))
            feeds.update(self._lora_feeds)
            skip = {self._logits_at if tokens_only else self._next_token_at}
            if not with_hidden and self._hidden_at != self._logits_at:  # an embedding graph's are its result
                skip.add(self._hidden_at)
            names = [name for i, name in enumerate(self.outputs) if i not in skip]
            fetched = iter(session.run(names, feeds))
            outs = [None if i in skip else next(fetched) for i in range(len(self.outputs))]
        new: dict[int, dict[str, np.ndarray]] = {}
        for i, role, layer in self._state_rows:
            new.setdefault(layer, {})[role] = outs[i]
        for layer, rows in new.items():
            if "new_key" in rows:
                pool.write_kv(layer, rows["new_key"], rows["new_value"], position_ids[:, 0], lengths, first_slot)
            if "new_conv_state" in rows:
                pool.write_conv(layer, rows["new_conv_state"], slot_idx)
            if "new_recurrent_state" in rows:
                pool.write_recurrent(layer, rows["new_recurrent_state"], slot_idx)
        result = outs[self._next_token_at if tokens_only else self._logits_at]
        return (result, outs[self._hidden_at]) if with_hidden else result

    def _session_for(self, rows: int):
        """The batched-step graph's session for a step of ``rows`` token rows when it has one and
        the step is big enough, else the graph's own."""
        if self.batched_session is not None and rows >= self.batched_min_rows:
            return self.batched_session
        return self.session

    def _run_bound(self, session, pool: StatePool, n: int, first: int, tokens_only: bool, given: dict[str, np.ndarray],
                   dims: dict[str, int]) -> list:
        """Run an in-place graph: each KV view is bound as both past_* input and present_* output
        (and each in-place conv pool as both conv_state input and new_conv_state output).

        Inputs and the other outputs live in arrays the binding owns, bound once and rewritten
        in place while their shapes stay the same (every decode step of a batch): a step then
        costs a few small copies instead of a fresh binding. Returns the outputs in spec order,
        with None for the present_* and in-place new_conv_state ones (they are the pool) and for
        the logits (``tokens_only``: not bound, so onnxruntime keeps them) or the next_token.
        """
        bound = self._binding(session, pool, n, first, tokens_only)
        binding = bound.binding
        for role, name in self.names.items():
            bound.feed(name, given[role])
        for role, layer, name in self._slot_inputs:  # rebound each step: cheap, and never a stale copy
            binding.bind_cpu_input(name, slot_pool(pool, role, layer))
        skip = self._logits_at if tokens_only else self._next_token_at
        outs: list = [None] * len(self.new)
        for i, name, spec_shape, dtype in self._returned:
            if i == skip:
                continue
            shape = tuple(dims[d] if isinstance(d, str) else d for d in spec_shape)
            buf = bound.buffers.get(name)
            if buf is None or buf.shape != shape:
                buf = bound.buffers[name] = np.empty(shape, dtype)
                binding.bind_output(name, "cpu", 0, dtype, list(shape), buf.ctypes.data)
            outs[i] = buf
        session.run_with_iobinding(binding)
        return outs

    def _binding(self, session, pool: StatePool, n: int, first: int, tokens_only: bool) -> "_Bound":
        """The IOBinding for slots first..first+n-1 over the pool's current buffers, built when
        none is kept for them (the last few are kept: a scheduler's decode and prefill ranges).

        The KV OrtValues wrap the pool's arrays without copying (CPU), so a kept binding stays
        valid as long as ``reserve`` has not replaced the buffers (tracked by ``pool.generation``).
        """
        import onnxruntime as ort

        # another pool (generations start alike) is another binding; so is the other session's
        key = (n, first, id(pool), pool.generation, tokens_only, session is self.session)
        bound = self._bindings.pop(key, None)
        if bound is not None:
            self._bindings[key] = bound  # most recently used last
            return bound
        if any(k[2:4] != key[2:4] for k in self._bindings):
            self._bindings.clear()  # bindings over replaced buffers are never valid again
        while len(self._bindings) >= _KEPT_BINDINGS:
            del self._bindings[next(iter(self._bindings))]
        binding = session.io_binding()
        for name, value in self._lora_values.items():  # the adapter pool's arrays: bound once, written in place
            binding.bind_ortvalue_input(name, value)
        keys, values = pool.kv_views(n, first)
        kv_values = {}
        for role, layer, name in self.states:
            if role in ("past_key", "past_value"):
                view = keys[layer] if role == "past_key" else values[layer]
                kv_values[(role, layer)] = ort.OrtValue.ortvalue_from_numpy(view)
                binding.bind_ortvalue_input(name, kv_values[(role, layer)])
        for (role, layer), name in zip(self.new, self.outputs):
            if role in ("present_key", "present_value"):
                binding.bind_ortvalue_output(name, kv_values[(role.replace("present_", "past_"), layer)])
        for role, layer, name in self.states:  # the whole pool in and out: one buffer, written in place
            if (role, layer) in self.pool_outputs:
                kv_values[(role, layer)] = ort.OrtValue.ortvalue_from_numpy(slot_pool(pool, role, layer))
                binding.bind_ortvalue_input(name, kv_values[(role, layer)])
                binding.bind_ortvalue_output(self.pool_outputs[role, layer], kv_values[(role, layer)])
        bound = self._bindings[key] = _Bound(binding, kv_values)
        return bound


_NO_ROWS = np.zeros(0, np.int64)
_KEPT_BINDINGS = 6  # decode and prefill ranges, on either session


class _Bound:
    """One IOBinding and what must outlive it: the state OrtValues, and the input and output
    arrays bound to it (rewritten in place while their shapes stay)."""

    def __init__(self, binding, kv_values: dict) -> None:
        self.binding = binding
        self.kv_values = kv_values
        self.inputs: dict[str, tuple] = {}  # input name -> (array, OrtValue over it)
        self.buffers: dict[str, np.ndarray] = {}  # output name -> array bound as that output

    def feed(self, name: str, value: np.ndarray) -> None:
        """Bind ``value`` to input ``name`` through an array kept for it: copied into when the
        shape is unchanged (the binding already points there), else replaced and rebound."""
        import onnxruntime as ort

        held = self.inputs.get(name)
        if held is not None and held[0].shape == value.shape:
            np.copyto(held[0], value)
            return
        buf = np.array(value, copy=True, order="C")
        value_ort = ort.OrtValue.ortvalue_from_numpy(buf)  # wraps buf's memory
        self.binding.bind_ortvalue_input(name, value_ort)
        self.inputs[name] = (buf, value_ort)
