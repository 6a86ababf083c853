"""onnxruntime on CUDA: the artifact's onnxruntime graph on onnxruntime-gpu's CUDA execution
provider, decode steps replayed from CUDA graphs, the state pools in device memory.

``open_onnxruntime_cuda`` gives ``backends.open_backend`` the (step runner, state pool) pair
for ``Engine.load(ART, device="cuda")``: an ``OrtDeviceDecoder`` with ``DecoderGraph.run``'s
contract (host numpy logits of the live rows) and a ``DevicePool`` with ``StatePool``'s
(``reserve``/``claim``/``release``, live slots packed ``0..live-1``).

CUDA graphs in onnxruntime (trt-notes §7; onnxruntime's CUDA EP docs, "Using CUDA Graphs"):
the session is created with ``enable_cuda_graph``; every run names a graph with the run option
``gpu_graph_id``: the first run(s) of a new id run plainly, then onnxruntime captures the id
inside a run and replays it at once (so every run returns real outputs); a captured id is
replayed without reading the binding again; ``-1`` runs without capture. A replay reuses the shapes
and device addresses seen at capture, so each id is bound once, to buffers that never move:
one ``_BucketBinding`` per decode bucket (device inputs rewritten in place with
``OrtValue.update_inplace``, a device logits buffer, the pool's state at fixed addresses).
Which id a step uses is ``GraphIds``' bookkeeping over ``cuda_graphs.GraphCache``, keyed by
``GraphKey(bucket, DECODE_PROFILE, addresses)``, so a step bound anywhere else never replays
a stale graph. Decode steps of ``n`` rows are padded to ``bucket_for(n)`` rows
(``cuda_graphs.DecodePadding``); prefill steps and decode batches above the largest bucket run
plainly (``-1``), unpadded. onnxruntime refuses, when the session is created, a graph whose
compute nodes are not all on the CUDA EP (CPU nodes are allowed only for shape work, with no
host/device copy inside the step): that is turned into one line naming the nodes
(``capture_blockers``, read off ``get_provider_graph_assignment_info``). Known from
onnxruntime's source, not yet run: its CUDA GroupQueryAttention has fp16/bf16 kernels only
(an fp32 artifact is refused, naming it) and reads ``total_sequence_length`` in host memory.
The onnxruntime target takes it as a graph input (role ``total_sequence_length``), bound here
as a CPU input: each plain step's own ``max(start + length)``, and for captured decode steps
one value for all of them (``capture_total_sequence_length``, which says why). An artifact
exported before then computes it on the device: onnxruntime copies it to the host inside the
step and refuses capture (refused here naming ``MemcpyToHost``, with re-export as the fix).

State: ``device_state.DevicePool`` with decode buckets (the pool the TensorRT runner uses too):
per layer one buffer ``[physical slots, kv_heads, capacity, head_dim]`` (conv: ``[physical
slots, channels, width]``) in ``device_state.CudaMemory`` (``cudaMalloc``, bound by raw
address through IOBinding; zeroes and row moves on the memory's own stream, which ``run``
synchronises before each onnxruntime run). ``capacity`` is the artifact's ``max_seq_len``
and the physical slots are the requested slots rounded up to their bucket, whatever a session
asks for, so that the buffers (and the graphs bound to them) survive from one session to the
next; they are replaced only when a session needs more slots (``generation`` then changes and
every captured graph is released). Like ``decoder.py`` binds
the CPU pool, ``past_key.i`` and ``present_key.i`` are bound to one buffer (GroupQueryAttention
writes its rows in place), as are an in-place conv pool's ``conv_state.i`` and
``new_conv_state.i``; a conv graph that returns the batch's rows (``slot_rows``) writes them
into a bound scratch buffer and they are copied into slots ``0..n-1`` after the step.

Everything but ``CudaMemory``, the session's creation and its provider options is plain code
that also runs over host memory (``device_state.HostMemory``, an onnxruntime CPU session:
``open_on_host``),
which is how the CPU test suite runs the padding, binding and pool bookkeeping end to end.
"""

from __future__ import annotations

import contextlib
import io
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.threads import check_threads
from graphkiln.manifest import GraphSpec, Manifest, is_pool_output
from graphkiln.runtime.backends.cuda_graphs import DecodePadding, GraphCache, GraphKey, bucket_for, decode_buckets
from graphkiln.runtime.backends.ort_cpu import total_sequence_length
from graphkiln.runtime.backends.device_state import CudaMemory, DeviceMemory, DevicePool, HostMemory

CUDA_EP = "CUDAExecutionProvider"
# The cuda extra in pyproject.toml installs exactly this (a test keeps the two equal); it is built
# for CUDA 13 and cuDNN 9, which its [cuda,cudnn] extras bring as NVIDIA's wheels.
ORT_GPU_REQUIREMENT = "onnxruntime-gpu[cuda,cudnn]==1.31.1"
# onnxruntime-gpu installs the same `onnxruntime` package as the CPU wheel graphkiln depends on,
# so the CPU wheel has to go, and onnxruntime-gpu be reinstalled over what its removal deleted.
NEEDS_ORT_GPU = ("device cuda needs onnxruntime-gpu, which replaces the CPU onnxruntime wheel: pip install "
                 f"'graphkiln[cuda]' && pip uninstall -y onnxruntime onnxruntime-gpu && pip install '{ORT_GPU_REQUIREMENT}'")
CUDA_LIBS = f"check the NVIDIA driver (580 or newer for CUDA 13) and CUDA 13 + cuDNN 9 (pip install '{ORT_GPU_REQUIREMENT}')"
DEFAULT_MAX_BATCH = 16  # largest decode bucket captured; larger decode batches run without a graph
DECODE_PROFILE = 1  # GraphKey.profile of decode steps (prefill, profile 0, is never captured)
SKIP_CAPTURE = -1  # gpu_graph_id that runs without capture (onnxruntime: kGraphAnnotationSkip)
MEMCPY_OPS = ("MemcpyToHost", "MemcpyFromHost")

# ONNX element types, for raw-pointer bindings (numpy has no bfloat16)
_ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "bool": 9, "float16": 10, "bfloat16": 16}


# -- refusals (plain) ---------------------------------------------------------------------

def require_cuda_provider(available: Iterable[str]) -> None:
    """Refuse an onnxruntime without the CUDA execution provider (the CPU wheel)."""
    if CUDA_EP not in set(available):
        raise GraphkilnError(NEEDS_ORT_GPU)


def check_graph(spec: GraphSpec) -> None:
    """Refuse a graph this runner cannot keep on the device: one whose KV rows come back to be
    stored by the runtime (``scatter_rows``: the portable graph, or attention that was not
    lowered to GroupQueryAttention, as in bf16 artifacts) rather than written in place."""
    rows = [t.name for t in spec.outputs if t.role in ("new_key", "new_value")]
    if rows:
        bf16 = any(t.dtype == "bfloat16" for t in spec.inputs)
        why = (" (bf16 attention is not lowered to GroupQueryAttention: the onnxruntime target lowers fp32/fp16)"
               if bf16 else "")
        raise GraphkilnError(
            f"device cuda runs graphs that write the KV cache in place, and {spec.file} ({spec.target} target) "
            f"returns its new rows ({rows[0]}){why}: re-export with --target onnxruntime --dtype fp16")


def check_bf16(dtype: str, compute_capability: tuple[int, int] | None) -> None:
    """bf16 state needs a GPU with bf16 arithmetic (compute capability 8.0, Ampere, or newer)."""
    if dtype == "bfloat16" and compute_capability is not None and compute_capability < (8, 0):
        cc = ".".join(map(str, compute_capability))
        raise GraphkilnError(f"this GPU (compute capability {cc}) has no bf16 arithmetic, which this bf16 artifact "
                             "needs: re-export with --dtype fp16")


@dataclass(frozen=True)
class Assigned:
    """One node of the session's graph and the execution provider onnxruntime gave it."""

    ep: str
    op_type: str
    domain: str = ""


def assigned_nodes(session) -> list[Assigned]:
    """The session's node assignment (needs the session config entry
    ``session.record_ep_graph_assignment_info=1``); empty when onnxruntime does not expose it."""
    info = getattr(session, "get_provider_graph_assignment_info", None)
    if info is None:
        return []
    return [Assigned(sub.ep_name, n.op_type, n.domain) for sub in info() for n in sub.get_nodes()]


def capture_blockers(nodes: Iterable[Assigned], ep: str = CUDA_EP) -> Counter:
    """What keeps the graph from being captured whole on ``ep``, by op type (empty: nothing).

    onnxruntime's rule for the CUDA EP (``ALLOW_CPU_FOR_SHAPES``): every compute node on the
    EP; nodes on the CPU are allowed (shape arithmetic) as long as no host/device copy
    (``Memcpy*``) sits inside the step, and at least one node must be on the EP. So: nothing
    when that holds; else every node off the EP, and the copies themselves."""
    nodes = list(nodes)
    on_ep = [n for n in nodes if n.ep == ep and n.op_type not in MEMCPY_OPS]
    copies = [n for n in nodes if n.op_type in MEMCPY_OPS]
    foreign = [n for n in nodes if n.ep not in (ep, "CPUExecutionProvider")]
    if on_ep and not copies and not foreign:
        return Counter()
    return Counter(n.op_type for n in nodes if n.ep != ep or n.op_type in MEMCPY_OPS)


def blockers_refusal(file: str, blockers: Counter, dtype: str, feeds_total: bool = True) -> str:
    """The one-line refusal for a graph with ``blockers`` (``capture_blockers``); ``feeds_total``:
    whether the graph takes GroupQueryAttention's total_sequence_length as an input (artifacts
    exported before it did compute it on the device, and onnxruntime copies it to the host)."""
    shown = ", ".join(f"{op} x{k}" if k > 1 else op for op, k in blockers.most_common(6))
    more = f" and {len(blockers) - 6} more op type(s)" if len(blockers) > 6 else ""
    if "GroupQueryAttention" in blockers and dtype == "float32":
        fix = "re-export with --dtype fp16 (onnxruntime's CUDA GroupQueryAttention has fp16/bf16 kernels only)"
    elif "MemcpyToHost" in blockers and not feeds_total:
        fix = ("re-export the artifact with this graphkiln (its graph then takes GroupQueryAttention's "
               "total_sequence_length from the host)")
    else:
        fix = "run it with device cpu, or build TensorRT engines (graphkiln build --backend tensorrt)"
    return (f"device cuda cannot run {file} under CUDA graphs: onnxruntime's CUDA execution provider leaves "
            f"{shown}{more} to the CPU, with host/device copies inside each step: {fix}")


# -- steps and graph ids (plain) -----------------------------------------------------------

@dataclass(frozen=True)
class StepPlan:
    """How one step runs: ``bucket`` rows (padded from ``rows``) under a graph, or, with
    ``bucket`` None, ``rows`` rows plainly (prefill, or a decode batch above every bucket)."""

    rows: int
    bucket: int | None


def plan_step(n: int, seq: int, n_logits: int, buckets: tuple[int, ...]) -> StepPlan:
    """Only decode steps (one token and one logits row per request) are captured."""
    if seq != 1 or n_logits != 1 or not buckets:
        return StepPlan(n, None)
    return StepPlan(n, bucket_for(n, buckets))


def capture_total_sequence_length(capacity: int) -> np.ndarray:
    """GroupQueryAttention's ``total_sequence_length`` (int32 scalar, host memory) for every
    step a captured decode graph replays: the KV buffers' token capacity.

    What onnxruntime does with it (its source: ``contrib_ops/cpu/bert/group_query_attention_helper.h``
    ``CheckInputs`` and ``contrib_ops/cuda/bert/group_query_attention.cc``): the CUDA kernel
    registers input 6 as ``OrtMemTypeCPUInput`` and reads it on the host only, in the kernel's
    host code, which a CUDA-graph replay does not run: a captured graph keeps the value seen at
    capture. It sets the present length to ``max(total, past buffer length)``, so with past
    and present sharing one buffer the present is the whole buffer whatever the value; it
    must not exceed the rotary tables' rows (``cos_cache`` rows >= total; export sizes them to
    ``max_seq_len``). It decides on the host ``is_first_prompt = (sequence_length == total)``
    (the prompt path, which ignores the cache) and the flash-decoding split count and scratch
    sizes; every row's own length comes from ``seqlens_k``, a device input that replays read
    afresh. So the per-step ``max(start + length)`` frozen at capture would be right for
    replayed steps only while those host decisions stay those of the captured step; it is not
    when the captured step is a batch of one-token prompts (a ``seq 1``, ``n_logits 1`` step,
    which plans like decode), whose total is 1: every replay would take the prompt path. A
    value that is the same for every step, the buffer's capacity (as onnxruntime-genai does
    under CUDA graphs: its attention mask is ``[batch, max_length]``), keeps the decode path
    (capacity >= 2) and the split heuristic for the longest row, and a one-token prompt on
    the decode path (past length 0) attends to itself, as the prompt path would. Plain (not
    captured) steps feed their own ``max(start + length)``, as the CPU runtime does."""
    return np.array(capacity, np.int32)


class GraphIds:
    """``gpu_graph_id`` per ``GraphKey``: ids 1, 2, ... in order of first use (0 is
    onnxruntime's default graph, which no run here uses) and never reused; the id of a key
    never changes while the cache holds it. A key whose capture failed (``fail``) runs plainly
    (``SKIP_CAPTURE``) from then on. ``release(id)`` (the session's ``release_captured_graph``)
    is called for each id when the cache is cleared (``clear``: the buffers the graphs were
    bound to are about to be replaced)."""

    def __init__(self, release=None) -> None:
        self.cache: GraphCache[int] = GraphCache(release)
        self.failures: dict[GraphKey, str] = {}  # key -> why its capture failed; still in the cache, so
        # that clear releases their ids
        self._next = 1

    def graph_id(self, key: GraphKey) -> int:
        if key in self.failures:
            self.cache.stats.fallbacks += 1
            return SKIP_CAPTURE
        if key in self.cache:
            return self.cache.get(key)  # type: ignore[return-value]  # counted as a replay
        gid, self._next = self._next, self._next + 1
        self.cache.put(key, gid)
        return gid

    def fail(self, key: GraphKey, reason: str) -> None:
        self.failures[key] = reason
        self.cache.stats.failed += 1

    def clear(self) -> None:
        self.cache.clear()
        self.failures = {}


# -- the step runner -----------------------------------------------------------------------

@dataclass
class _BucketBinding:
    """The fixed binding of one decode bucket: device inputs (rewritten in place each step),
    the device logits buffer, scratch for ``slot_rows`` conv outputs, and the addresses that
    make its ``GraphKey``. Valid for one pool ``generation``."""

    binding: object
    inputs: dict[str, object]  # input name -> device OrtValue
    host_inputs: dict[str, tuple[np.ndarray, object]]  # input name -> (array, CPU OrtValue over it), fixed
    logits: object  # device OrtValue [bucket, 1, vocab]
    conv_rows: dict[int, int]  # layer -> [bucket, channels, width] scratch from the pool's memory (this binding's)
    addresses: dict[str, int]


class OrtDeviceDecoder:
    """Runs prefill and decode steps of ``spec`` on a device session over a ``DevicePool``.

    ``run`` has ``DecoderGraph.run``'s contract. The session, its bucket bindings and its
    captured graphs belong to this object; the bindings follow the pool's ``generation`` (a
    new generation releases every graph and rebinds)."""

    def __init__(self, session, spec: GraphSpec, memory: DeviceMemory, buckets: tuple[int, ...]) -> None:
        check_graph(spec)
        self.session, self.spec, self.memory, self.buckets = session, spec, memory, buckets
        self.device, self._device_id = memory.device, memory.device_id
        self.names = {t.role: t.name for t in spec.inputs if t.layer is None}  # int64 inputs, on the device
        # GroupQueryAttention reads it in host memory (absent from artifacts exported before it was an input)
        self.total_name = self.names.pop("total_sequence_length", None)
        # sliding layers addressed by window (export.lowering.ort_attention): this runner keeps full-length
        # KV, so every offset is 0 and the window total is the total (same host value, bound beside it)
        self.window_total_name = self.names.pop("window_total_sequence_length", None)
        self.kv_inputs = [(t.role, t.layer, t.name) for t in spec.inputs if t.role in ("past_key", "past_value")]
        self.conv_inputs = {t.layer: t.name for t in spec.inputs if t.role == "conv_state"}
        self.present = {(t.role.replace("present_", "past_"), t.layer): t.name for t in spec.outputs
                        if t.role in ("present_key", "present_value")}
        self.pool_outputs = {t.layer: t.name for t in spec.outputs if is_pool_output(t)}
        self.row_outputs = {t.layer: t for t in spec.outputs if t.role == "new_conv_state" and not is_pool_output(t)}
        self.logits = next(t for t in spec.outputs if t.role == "logits")
        release = getattr(session, "release_captured_graph", None)
        self.graphs = GraphIds(release)
        self._run_options: dict[int, object] = {}
        self._buckets: dict[int, _BucketBinding] = {}
        self._generation = -1

    # -- public ---------------------------------------------------------------------------

    def run(self, pool: DevicePool, input_ids: np.ndarray, position_ids: np.ndarray,
            logits_index: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One forward over the live slots 0..n-1; returns host logits [n, n_logits, vocab]."""
        self.memory.sync()  # the pool's claims, releases and row copies, on the memory's stream
        if pool.generation != self._generation:  # buffers replaced: every binding and graph is stale
            self._drop_bindings()
            self._generation = pool.generation
        n = input_ids.shape[0]
        plan = plan_step(n, input_ids.shape[1], logits_index.shape[1], self.buckets)
        if plan.bucket is None or plan.bucket > pool.physical_slots:
            return self._run_plain(pool, input_ids, position_ids, logits_index, lengths)
        return self._run_bucket(pool, plan.bucket, input_ids, position_ids, logits_index, lengths)

    def close(self) -> None:
        """Release the captured graphs (the session keeps them until then) and the bindings."""
        self._drop_bindings()

    def _drop_bindings(self) -> None:
        self.graphs.clear()  # before the scratch the graphs write into is freed
        for b in self._buckets.values():
            for ptr in b.conv_rows.values():
                self.memory.free(ptr)
        self._buckets = {}

    # -- steps ----------------------------------------------------------------------------

    def _feeds(self, n: int, input_ids, position_ids, logits_index, lengths) -> dict[str, np.ndarray]:
        given = {"input_ids": input_ids, "position_ids": position_ids, "logits_index": logits_index,
                 "seq_lens": lengths, "slot_idx": np.arange(n, dtype=np.int64), "window_offset": np.zeros(n, np.int64)}
        return {name: np.ascontiguousarray(given[role], dtype=np.int64) for role, name in self.names.items()}

    def _run_bucket(self, pool: DevicePool, bucket: int, input_ids, position_ids, logits_index, lengths) -> np.ndarray:
        n = input_ids.shape[0]
        padding = DecodePadding(n, bucket)
        feeds = self._feeds(bucket, *padding.pad(input_ids, position_ids, logits_index, lengths))
        b = self._buckets.get(bucket) or self._bind_bucket(pool, bucket)
        for name, value in feeds.items():
            b.inputs[name].update_inplace(value)
        key = GraphKey.of(bucket, DECODE_PROFILE, b.addresses)
        gid = self.graphs.graph_id(key)
        try:
            self.session.run_with_iobinding(b.binding, self._options(gid))
        except Exception as exc:
            if gid == SKIP_CAPTURE:
                raise
            # Recorded so the key is never captured again, then the step is run plainly.
            self.graphs.fail(key, (str(exc).splitlines() or [type(exc).__name__])[0][:200])
            self.session.run_with_iobinding(b.binding, self._options(SKIP_CAPTURE))
        logits = b.logits.numpy()
        self._store_rows(pool, n, b.conv_rows)
        return padding.unpad(logits)

    def _run_plain(self, pool: DevicePool, input_ids, position_ids, logits_index, lengths) -> np.ndarray:
        n = input_ids.shape[0]
        binding = self.session.io_binding()
        for name, value in self._feeds(n, input_ids, position_ids, logits_index, lengths).items():
            binding.bind_cpu_input(name, value)
        if self.total_name is not None:  # the step's own value: this run is not captured
            for name in filter(None, (self.total_name, self.window_total_name)):
                binding.bind_cpu_input(name, total_sequence_length(position_ids, lengths))
        _, state_outputs = self._bind_state(binding, pool, n)
        scratch: dict[int, int] = {}  # layer -> rows buffer for this step, freed below
        try:
            for layer, t in self.row_outputs.items():
                buf = pool.buffers["conv", layer]
                scratch[layer] = self.memory.alloc(n * buf.row_bytes)
                binding.bind_output(t.name, self.device, self._device_id, _ONNX_TYPES[pool.dtype],
                                    [n, *buf.shape[1:]], scratch[layer])
            binding.bind_output(self.logits.name, "cpu")
            self.session.run_with_iobinding(binding, self._options(SKIP_CAPTURE))
            self._store_rows(pool, n, scratch)
        finally:
            for ptr in scratch.values():
                self.memory.free(ptr)
        # get_outputs lists the outputs in the order they were bound: the state, the rows, the logits
        return binding.get_outputs()[len(state_outputs) + len(scratch)].numpy()

    def _options(self, gid: int):
        ro = self._run_options.get(gid)
        if ro is None:
            import onnxruntime as ort

            ro = self._run_options[gid] = ort.RunOptions()
            ro.add_run_config_entry("gpu_graph_id", str(gid))
        return ro

    def _store_rows(self, pool: DevicePool, n: int, rows: dict[int, int]) -> None:
        """Copy ``slot_rows`` conv outputs (the rows of slots 0..n-1, slot_idx = arange) into the pool."""
        for layer, src in rows.items():  # on the memory's stream: the next run syncs before it starts
            buf = pool.buffers["conv", layer]
            self.memory.copy(buf.address, src, n * buf.row_bytes)

    # -- binding --------------------------------------------------------------------------

    def _bind_state(self, binding, pool: DevicePool, n: int) -> tuple[dict[str, int], list[str]]:
        """Bind the KV rows of slots 0..n-1 as past_* and present_* (one buffer each), and each
        conv pool whole (as new_conv_state too when the graph writes it in place). Returns the
        bound input addresses by name and the outputs bound, in order."""
        bound: dict[str, int] = {}
        outputs: list[str] = []
        dev, did, dtype = self.device, self._device_id, _ONNX_TYPES[pool.dtype]
        for role, layer, name in self.kv_inputs:
            ptr, shape = pool.buffers["key" if role == "past_key" else "value", layer].rows(n)
            binding.bind_input(name, dev, did, dtype, list(shape), ptr)
            binding.bind_output(self.present[role, layer], dev, did, dtype, list(shape), ptr)
            outputs.append(self.present[role, layer])
            bound[name] = ptr
        for layer, name in self.conv_inputs.items():
            buf = pool.buffers["conv", layer]
            binding.bind_input(name, dev, did, dtype, list(buf.shape), buf.address)
            if layer in self.pool_outputs:
                binding.bind_output(self.pool_outputs[layer], dev, did, dtype, list(buf.shape), buf.address)
                outputs.append(self.pool_outputs[layer])
            bound[name] = buf.address
        return bound, outputs

    def _bind_bucket(self, pool: DevicePool, bucket: int) -> _BucketBinding:
        import onnxruntime as ort

        binding = self.session.io_binding()
        zeros = self._feeds(bucket, *DecodePadding(0, bucket).pad(*(np.zeros((0, 1), np.int64),) * 3,
                                                                  np.zeros(0, np.int64)))
        inputs = {name: ort.OrtValue.ortvalue_from_numpy(v, self.device, self._device_id) for name, v in zeros.items()}
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        addresses = {name: v.data_ptr() for name, v in inputs.items()}
        host_inputs = {}
        if self.total_name is not None:
            # onnxruntime reads it on the host when it captures the graph and never again, so it is
            # one value for every step this binding replays: the KV buffers' token capacity, which
            # is right for all of them (see capture_total_sequence_length)
            total = capture_total_sequence_length(pool.max_capacity)
            for name in filter(None, (self.total_name, self.window_total_name)):
                host_inputs[name] = (total, ort.OrtValue.ortvalue_from_numpy(total))
                binding.bind_ortvalue_input(name, host_inputs[name][1])
        addresses.update(self._bind_state(binding, pool, bucket)[0])
        dims = {"batch": bucket, "n_logits": 1, "seq": 1}
        conv_rows = {}
        for layer, t in self.row_outputs.items():
            buf = pool.buffers["conv", layer]
            conv_rows[layer] = self.memory.alloc(bucket * buf.row_bytes)
            binding.bind_output(t.name, self.device, self._device_id, _ONNX_TYPES[pool.dtype],
                                [bucket, *buf.shape[1:]], conv_rows[layer])
            addresses[t.name] = conv_rows[layer]
        shape = [dims.get(d, d) if isinstance(d, str) else d for d in self.logits.shape]
        logits = self._device_value(shape, self.logits.dtype)
        binding.bind_ortvalue_output(self.logits.name, logits)
        addresses[self.logits.name] = logits.data_ptr()
        b = self._buckets[bucket] = _BucketBinding(binding, inputs, host_inputs, logits, conv_rows, addresses)
        return b

    def _device_value(self, shape: list, dtype: str):
        import onnxruntime as ort

        return ort.OrtValue.ortvalue_from_shape_and_type(shape, _ONNX_TYPES[dtype], self.device, self._device_id)


# -- opening ------------------------------------------------------------------------------

def _session_options(ort, threads: int | None, record: bool = True):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = check_threads(threads)
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    if record:
        opts.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    return opts


def _preload_cuda_libraries(ort) -> None:
    """Load CUDA and cuDNN from NVIDIA's wheels (onnxruntime-gpu's documented ``preload_dlls``).
    It reports a library it cannot find by printing, which would mix with generated text on
    stdout: that is dropped, and a missing library fails the session, which says so."""
    preload = getattr(ort, "preload_dlls", None)
    if preload is None:
        return
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            preload()
        except Exception:
            pass  # the session's creation reports what is missing


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0][:200]


def _cuda_session(ort, path: Path, spec: GraphSpec, dtype: str, threads: int | None, device_id: int):
    """The CUDA session with CUDA graphs, or one refusal line saying why there is none."""
    _preload_cuda_libraries(ort)
    cuda = {"device_id": str(device_id), "enable_cuda_graph": "1"}
    try:
        session = ort.InferenceSession(str(path), _session_options(ort, threads), enable_fallback=0,
                                       providers=[(CUDA_EP, cuda), "CPUExecutionProvider"])
    except Exception as exc:
        message = str(exc)
        if "graph capture" not in message.lower() and "cuda graph" not in message.lower():
            raise GraphkilnError(f"onnxruntime-gpu cannot open {spec.file} on CUDA ({_first_line(exc)}): {CUDA_LIBS}") from None
        # onnxruntime refused capture: open the graph without it only to name the nodes that block it
        probe = ort.InferenceSession(str(path), _session_options(ort, threads), enable_fallback=0,
                                     providers=[(CUDA_EP, {"device_id": str(device_id)}), "CPUExecutionProvider"])
        blockers = capture_blockers(assigned_nodes(probe))
        if not blockers:
            raise GraphkilnError(f"device cuda cannot run {spec.file} under CUDA graphs ({_first_line(exc)}): run it "
                                 "with device cpu, or build TensorRT engines (graphkiln build --backend tensorrt)") from None
        feeds_total = any(t.role == "total_sequence_length" for t in spec.inputs)
        raise GraphkilnError(blockers_refusal(spec.file, blockers, dtype, feeds_total)) from None
    if not session.get_providers() or session.get_providers()[0] != CUDA_EP:
        raise GraphkilnError(f"onnxruntime-gpu did not start its CUDA execution provider for {spec.file} (it runs "
                             f"{session.get_providers()}): {CUDA_LIBS}")
    return session


def open_onnxruntime_cuda(artifact_dir: Path, manifest: Manifest, spec: GraphSpec, threads: int | None):
    """(OrtDeviceDecoder, DevicePool) for ``spec`` on GPU ``CUDA_VISIBLE_DEVICES``'s first device.

    Refuses, one line each: an onnxruntime without the CUDA EP, a graph that does not write its
    KV cache in place, bf16 on a GPU without it, a graph onnxruntime will not capture whole on
    the CUDA EP (naming the nodes), a manifest that disagrees with its graph."""
    import onnxruntime as ort

    from graphkiln.runtime.backends.ort_cpu import check_io

    require_cuda_provider(ort.get_available_providers())
    check_graph(spec)
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise GraphkilnError("device cuda needs cuda-python for its state pools: "
                             "pip install 'graphkiln[cuda]'") from None
    dtype = manifest.states[0].dtype
    try:
        memory = CudaMemory.open(cudart)
        check_bf16(dtype, memory.compute_capability())
    except RuntimeError as exc:
        raise GraphkilnError(f"CUDA could not start ({exc}): {CUDA_LIBS}") from None
    session = _cuda_session(ort, artifact_dir / spec.file, spec, dtype, threads, memory.device_id)
    check_io(session, spec)
    return _runner_and_pool(session, spec, manifest, memory, decode_buckets(DEFAULT_MAX_BATCH))


def _runner_and_pool(session, spec: GraphSpec, manifest: Manifest, memory: DeviceMemory,
                     buckets: tuple[int, ...]) -> tuple[OrtDeviceDecoder, DevicePool]:
    capacity = min(s.max_seq_len for s in manifest.states)  # the artifact's: buffers never resized by it
    pool = DevicePool(manifest.states, memory, capacity, buckets=buckets)
    return OrtDeviceDecoder(session, spec, memory, buckets), pool


def open_on_host(artifact_dir: Path, manifest: Manifest, spec: GraphSpec, threads: int | None = None,
                 max_batch: int = DEFAULT_MAX_BATCH):
    """The same runner and pool over host memory and an onnxruntime CPU session (no CUDA
    graphs: ``gpu_graph_id`` means nothing to the CPU EP): what the CPU test suite runs to check
    the padding, binding and pool bookkeeping against ``DecoderGraph`` + ``StatePool``."""
    import onnxruntime as ort

    from graphkiln.runtime.backends.ort_cpu import check_io

    check_graph(spec)
    session = ort.InferenceSession(str(artifact_dir / spec.file), _session_options(ort, threads, record=False),
                                   providers=["CPUExecutionProvider"])
    check_io(session, spec)
    return _runner_and_pool(session, spec, manifest, HostMemory(), decode_buckets(max_batch))
