"""Run a built TensorRT engine (``graphkiln build ART --backend tensorrt``) as the decoder's
step runner, replaying one captured CUDA graph per decode batch bucket.

``open_tensorrt(artifact_dir, manifest, spec) -> (EngineStepRunner, DevicePool)`` is what
``runtime.backends`` calls for backend ``tensorrt``. It

1. finds the engine built from ``spec`` (``Manifest.engine_for``) and refuses one built with
   another TensorRT version or for another compute capability (rebuild);
2. deserializes it and makes two execution contexts: one pinned to the ``prefill``
   optimization profile (0), one to ``decode`` (1). TensorRT Edge-LLM runs prefill and decode
   on separate contexts the same way (``llmEngineRunner.cpp``): a context's profile then never
   changes, so no profile switch ("layer resource updates on the next enqueueV3", trt-notes §4)
   can happen between capturing a decode graph and replaying it. Each context allocates its
   activation memory for its own profile only (``ON_PROFILE_CHANGE``), so the two together
   cost about what one ``STATIC`` context would;
3. allocates the state pool on the device at the engine's ``max_batch`` x ``max_seq_len``
   (``device_state.DevicePool`` with ``max_slots``, over ``device_state.CudaMemory`` on the
   runner's stream: stable addresses, each KV buffer bound as past_* and present_*), and
   device buffers for each phase's step inputs and logits;
4. warms up (``cuda_graphs.warm_up``): per decode bucket, probe slots claimed, one plain
   enqueue, then one enqueue captured and instantiated; the probe slots are released, so the
   pool is empty when the engine starts serving.

A step (``run``) copies its inputs to the phase's device buffers, then: a decode step (one
token and one logit per row) is padded to its bucket and its graph replayed, or enqueued
plainly when the bucket has no graph (capture failed); any other step (prefill) is enqueued
eagerly on the prefill context. Everything runs on one stream; the logits of the live rows
are copied back and the stream synchronised before ``run`` returns. ``graphkiln build``'s
profiles admit one logit per row (the last position's), so a step asking for more
(``Engine.prompt_logits``, ``graphkiln verify``) is refused with one line.

Everything that decides (profiles, shapes, padding, addresses, graph keys, when to capture,
replay or fall back) is plain code here and in ``cuda_graphs`` / ``device_state``, tested on
CPU. ``EngineStepRunner`` holds that logic and reaches the engine through an ``Executor``. TensorRT
and CUDA are touched only by ``_libraries``, ``_Cuda``, ``device_state.CudaMemory`` and ``TrtExecutor``;
they are imported lazily, and have not run: no GPU with TensorRT was available where this
was written. The CPU tests drive ``EngineStepRunner`` with an executor that runs the same
graph in onnxruntime over host memory bound at the same addresses, with replay re-running the
captured binding, so everything but the TensorRT/CUDA calls runs for real there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import EngineSpec, GraphSpec, Manifest, open_artifact_file
from graphkiln.runtime.backends.cuda_graphs import (CaptureFailed, DecodePadding, GraphCache, GraphKey, WarmupReport,
                                           bucket_for, decode_buckets, probe_inputs, warm_up)
from graphkiln.runtime.backends.device_state import (CudaMemory, DevicePool, StepBinding, StepBuffers, bind_step, check_in_place,
                                            cuda_call, io_roles, step_arrays)

INSTALL = "backend tensorrt needs TensorRT 11 and cuda-python: pip install 'graphkiln[tensorrt]'"
PREFILL, DECODE = "prefill", "decode"
MIN_TENSORRT_MAJOR = 11
MAX_PLAN_BYTES = 64 << 30  # a plan holds the weights; refuse to read something absurd into memory

# TensorRT DataType names -> the manifest's dtype names
_TRT_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT64": "int64", "INT32": "int32",
               "INT8": "int8", "UINT8": "uint8", "BOOL": "bool"}


# -- plain decisions (tested on CPU) ---------------------------------------------------------

def find_engine(manifest: Manifest, spec: GraphSpec) -> EngineSpec:
    engine = manifest.engine_for(spec, "tensorrt")
    if engine is None:
        raise GraphkilnError(f"this artifact has no TensorRT engine for graph {spec.name!r} ({spec.target}): "
                             "run graphkiln build ART --backend tensorrt first")
    return engine


def profile_index(engine: EngineSpec, name: str) -> int:
    """Index of the engine's optimization profile ``name`` (build makes 0 prefill, 1 decode)."""
    for i, p in enumerate(engine.profiles):
        if p.name == name:
            return i
    raise GraphkilnError(f"engine {engine.file} has no {name} optimization profile: rebuild it with "
                         "graphkiln build ART --backend tensorrt")


def check_compatible(engine: EngineSpec, tensorrt_version: str, compute_capability: str, gpu_name: str) -> None:
    """A plan runs only on the TensorRT version and compute capability it was built with."""
    if engine.tensorrt_version != tensorrt_version:
        raise GraphkilnError(f"engine {engine.file} was built with TensorRT {engine.tensorrt_version}, this is TensorRT "
                             f"{tensorrt_version}: rebuild it with graphkiln build ART --backend tensorrt")
    if engine.compute_capability != compute_capability:
        raise GraphkilnError(f"engine {engine.file} was built for compute capability {engine.compute_capability} "
                             f"({engine.gpu_name}), this GPU ({gpu_name}) is {compute_capability}: rebuild it on "
                             "this machine with graphkiln build ART --backend tensorrt")


def tensorrt_major(version: str) -> int | None:
    m = re.match(r"(\d+)\.", version)
    return int(m.group(1)) if m else None


def check_engine_io(spec: GraphSpec, engine_file: str, io: list[tuple[str, bool, str]]) -> None:
    """The engine's tensors ``(name, is_input, dtype)`` are the graph's, with the graph's dtypes."""
    want = {t.name: (True, t.dtype) for t in spec.inputs} | {t.name: (False, t.dtype) for t in spec.outputs}
    have = {name: (is_input, dtype) for name, is_input, dtype in io}
    for name, (is_input, dtype) in want.items():
        side = "input" if is_input else "output"
        if name not in have:
            raise GraphkilnError(f"engine {engine_file} has no {side} {name!r}, which graph {spec.file} has: rebuild it "
                                 "with graphkiln build ART --backend tensorrt")
        if have[name] != (is_input, dtype):
            got_side = "input" if have[name][0] else "output"
            raise GraphkilnError(f"engine {engine_file} {got_side} {name!r} is {have[name][1]}, graph {spec.file} has "
                                 f"{side} {dtype}: rebuild it with graphkiln build ART --backend tensorrt")
    extra = sorted(set(have) - set(want))
    if extra:
        raise GraphkilnError(f"engine {engine_file} has tensor {extra[0]!r}, which graph {spec.file} does not: rebuild "
                             "it with graphkiln build ART --backend tensorrt")


def check_profile(engine: EngineSpec, index: int, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every input shape a step binds lies within profile ``index``'s min..max."""
    profile = engine.profiles[index]
    for name, shape in shapes.items():
        ranges = profile.shapes.get(name)
        if ranges is None:
            continue  # a static input: the engine fixed its shape, and bind_step sized it from the graph
        lo, _, hi = ranges
        if len(lo) != len(shape) or any(not a <= s <= b for a, s, b in zip(lo, shape, hi)):
            raise GraphkilnError(f"input {name} of shape {list(shape)} is outside the {profile.name} profile of engine "
                                 f"{engine.file} ({list(lo)} to {list(hi)}): rebuild it with graphkiln build ART "
                                 "--backend tensorrt and a larger --max-batch / --max-seq-len")


def logits_per_row(engine: EngineSpec, spec: GraphSpec) -> int:
    """The most logits per row any profile of ``engine`` admits (``graphkiln build`` makes it 1:
    only the last position's, as TensorRT-LLM and Edge-LLM do)."""
    name = next(t.name for t in spec.inputs if t.role == "logits_index")
    highs = [p.shapes[name][2][1] for p in engine.profiles if name in p.shapes]
    fixed = next(t.shape[1] for t in spec.inputs if t.role == "logits_index")
    return max(highs) if highs else (fixed if isinstance(fixed, int) else 1)


def check_logits(n_logits: int, limit: int) -> None:
    if n_logits > limit:
        raise GraphkilnError(f"this step asks for logits at {n_logits} positions per row but the TensorRT engine "
                             f"returns at most {limit} (the last position's): logits at every prompt position "
                             "(prompt_logits, graphkiln verify) need the onnxruntime backend")


@dataclass(frozen=True)
class StepPlan:
    """How ``run`` executes a step: the phase (which context and profile) and, for a decode
    step, the padding to its bucket; ``rows`` is the batch bound (the bucket for decode)."""

    phase: str
    rows: int
    padding: DecodePadding | None


def plan_step(n: int, seq: int, n_logits: int, buckets: tuple[int, ...]) -> StepPlan:
    """Decode (padded, replayable) for one token and one logit per row within the largest
    bucket; prefill (eager) otherwise, e.g. prompts, ``prompt_logits``."""
    bucket = bucket_for(n, buckets) if seq == 1 and n_logits == 1 else None
    if bucket is None:
        return StepPlan(PREFILL, n, None)
    return StepPlan(DECODE, bucket, DecodePadding(n, bucket))


class Executor(Protocol):
    """What ``EngineStepRunner`` needs from an engine: run a step bound as ``binding`` on the
    ``phase``'s context, capture one as a graph (``CaptureFailed`` when it cannot), replay a
    graph, all in one stream's order. ``TrtExecutor`` is TensorRT's."""

    def enqueue(self, phase: str, binding: StepBinding) -> None: ...

    def capture(self, phase: str, binding: StepBinding): ...  # after an eager enqueue of the same binding

    def launch(self, handle) -> None: ...

    def destroy(self, handle) -> None: ...

    def synchronize(self) -> None: ...


class EngineStepRunner:
    """The step runner (``runtime.backends``' contract) over an engine: padding, buckets,
    bindings, graph keys, warm-up and the replay-or-enqueue rule; the engine calls go through
    ``executor``. Owns its step buffers and captured graphs (``close``); the pool belongs to
    the Engine, and must be the one it was opened with: the graphs hold its addresses."""

    def __init__(self, spec: GraphSpec, engine_spec: EngineSpec, pool: DevicePool, vocab: int,
                 executor: Executor) -> None:
        self.spec, self.engine_spec, self.pool, self.executor = spec, engine_spec, pool, executor
        self.buckets = decode_buckets(engine_spec.max_batch)
        self.profiles = {PREFILL: profile_index(engine_spec, PREFILL), DECODE: profile_index(engine_spec, DECODE)}
        self.graphs: GraphCache = GraphCache(executor.destroy)
        self.max_logits = logits_per_row(engine_spec, spec)
        self._bindings: dict[int, tuple[StepBinding, GraphKey]] = {}  # decode bucket -> fixed binding, its key
        self.io: dict[str, StepBuffers] = {}
        roles, mem, b = io_roles(spec), pool.memory, engine_spec.max_batch
        try:
            # decode's buffers never move (captured graphs hold them); prefill's logits grow on demand
            self.io[DECODE] = StepBuffers(mem, roles, b, 1, vocab, 1)
            self.io[PREFILL] = StepBuffers(mem, roles, b, engine_spec.max_seq_len, vocab, self.max_logits)
        except BaseException:
            self.close()
            raise

    def binding(self, plan: StepPlan, seq: int, n_logits: int) -> tuple[StepBinding, GraphKey | None]:
        """The step's shapes and addresses (checked against its profile), and for decode its graph key."""
        if plan.phase == DECODE and plan.rows in self._bindings:
            return self._bindings[plan.rows]
        bufs = self.io[plan.phase]
        logits = bufs.ensure_logits(plan.rows * n_logits) if plan.phase == PREFILL else bufs.logits
        b = bind_step(self.spec, self.pool, bufs.io, logits, plan.rows, seq, n_logits)
        check_profile(self.engine_spec, self.profiles[plan.phase], dict(b.shapes))
        if plan.phase == PREFILL:
            return b, None
        self._bindings[plan.rows] = b, GraphKey.of(plan.rows, self.profiles[DECODE], b.addresses)
        return self._bindings[plan.rows]

    def graph_key(self, bucket: int) -> GraphKey:
        return self.binding(StepPlan(DECODE, bucket, DecodePadding(0, bucket)), 1, 1)[1]

    def warm_up(self) -> WarmupReport:
        """Capture every decode bucket's graph; the pool must be empty, and is empty after."""
        return warm_up(self.pool, self.buckets, self.graph_key, self.graphs, self._capture)

    def run(self, pool: DevicePool, input_ids: np.ndarray, position_ids: np.ndarray, logits_index: np.ndarray,
            lengths: np.ndarray) -> np.ndarray:
        """One step over the live slots 0..n-1; returns host logits [n, n_logits, vocab] (a new array)."""
        if pool is not self.pool:
            raise RuntimeError("EngineStepRunner.run with a pool it was not opened with")
        n, seq = input_ids.shape
        n_logits = logits_index.shape[1]
        check_logits(n_logits, self.max_logits)
        plan = plan_step(n, seq, n_logits, self.buckets)
        arrays = (input_ids, position_ids, logits_index, lengths)
        if plan.padding is not None:
            arrays = plan.padding.pad(*arrays)
        binding, key = self.binding(plan, seq, n_logits)
        bufs = self.io[plan.phase]
        bufs.upload(step_arrays(*arrays))
        handle = self.graphs.get(key) if key is not None else None
        if handle is not None:
            self.executor.launch(handle)
        else:
            self.executor.enqueue(plan.phase, binding)
        out = np.empty((n, n_logits, bufs.vocab), np.float32)
        pool.memory.download(out, bufs.logits.address)  # the live rows are the front of the buffer
        return out

    def _capture(self, bucket: int):
        """The probe step for ``bucket``: once eagerly (initialisation stays out of the graph),
        then captured."""
        binding, _ = self.binding(StepPlan(DECODE, bucket, DecodePadding(0, bucket)), 1, 1)
        self.io[DECODE].upload(step_arrays(*probe_inputs(bucket)))
        self.executor.enqueue(DECODE, binding)
        self.executor.synchronize()
        return self.executor.capture(DECODE, binding)

    def close(self) -> None:
        """Free the graphs, the step buffers and the executor's engine (not the pool)."""
        self.graphs.clear()
        for bufs in self.io.values():
            bufs.close()
        self.io = {}
        close = getattr(self.executor, "close", None)
        if close is not None:
            close()


# -- TensorRT and CUDA (GPU only; not run where this was written) ----------------------------

def _libraries():
    """(tensorrt, cuda.bindings.runtime), or the one-line install error."""
    try:
        import tensorrt as trt
        from cuda.bindings import runtime as cudart
    except ImportError:
        raise GraphkilnError(INSTALL) from None
    major = tensorrt_major(trt.__version__)
    if major is None or major < MIN_TENSORRT_MAJOR:
        raise GraphkilnError(f"{INSTALL} (found TensorRT {trt.__version__})")
    return trt, cudart


class _Cuda:
    """The CUDA runtime calls the runner makes, each checked; ``stream`` is the one stream."""

    def __init__(self, cudart) -> None:
        self.rt = cudart
        err, count = cudart.cudaGetDeviceCount()
        if err != cudart.cudaError_t.cudaSuccess or count < 1:
            seen = count if err == cudart.cudaError_t.cudaSuccess else err
            raise GraphkilnError(f"backend tensorrt needs an NVIDIA GPU and none is visible (cudaGetDeviceCount: "
                                 f"{seen}): run on a machine with one, or use the CPU runtime")
        self.stream = self.call("cudaStreamCreate")[0]

    def call(self, name: str, *args):
        return cuda_call(self.rt, name, *args)

    def device(self) -> tuple[str, str]:
        """(GPU name, compute capability "major.minor") of the current device."""
        dev = self.call("cudaGetDevice")[0]
        prop = self.call("cudaGetDeviceProperties", dev)[0]
        name = prop.name.split(b"\0", 1)[0].decode() if isinstance(prop.name, bytes) else str(prop.name)
        return name, f"{prop.major}.{prop.minor}"

    @property
    def handle(self) -> int:
        return int(self.stream)

    def synchronize(self) -> None:
        self.call("cudaStreamSynchronize", self.stream)

    def begin_capture(self) -> None:
        # thread-local mode, as trtexec: other threads' CUDA calls do not break the capture
        self.call("cudaStreamBeginCapture", self.stream,
                  self.rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal)

    def end_capture(self):
        """The instantiated graph of what was captured; the captured graph itself is destroyed."""
        graph = self.call("cudaStreamEndCapture", self.stream)[0]
        try:
            return self.call("cudaGraphInstantiate", graph, 0)[0]
        finally:
            self.call("cudaGraphDestroy", graph)

    def abort_capture(self) -> None:
        """End a failed capture (trtexec's endCaptureOnError) and clear the sticky error."""
        err, graph = self.rt.cudaStreamEndCapture(self.stream)
        if err == self.rt.cudaError_t.cudaSuccess and graph is not None and int(graph):
            self.rt.cudaGraphDestroy(graph)
        self.rt.cudaGetLastError()

    def launch(self, graph_exec) -> None:
        self.call("cudaGraphLaunch", graph_exec, self.stream)

    def destroy_graph(self, graph_exec) -> None:
        self.call("cudaGraphExecDestroy", graph_exec)

    def close(self) -> None:
        self.call("cudaStreamDestroy", self.stream)


class TrtExecutor:
    """TensorRT's ``Executor``: the deserialized engine and two execution contexts, prefill on
    profile 0 and decode on profile 1 (see the module docstring), on ``cuda``'s stream. GPU only."""

    def __init__(self, trt, cuda: _Cuda, plan: bytes, spec: GraphSpec, engine_spec: EngineSpec) -> None:
        self.cuda = cuda
        self.contexts: dict = {}
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = self._runtime.deserialize_cuda_engine(plan)
        if self.engine is None:
            raise GraphkilnError(f"TensorRT could not load engine {engine_spec.file}: rebuild it with "
                                 "graphkiln build ART --backend tensorrt")
        check_engine_io(spec, engine_spec.file, self._engine_io(trt))
        for phase in (PREFILL, DECODE):
            index = profile_index(engine_spec, phase)
            ctx = self.engine.create_execution_context(trt.ExecutionContextAllocationStrategy.ON_PROFILE_CHANGE)
            if ctx is None or not ctx.set_optimization_profile_async(index, cuda.handle):
                raise GraphkilnError(f"TensorRT could not make a {phase} execution context for engine "
                                     f"{engine_spec.file}: free GPU memory or rebuild with a smaller --max-batch")
            self.contexts[phase] = ctx
        cuda.synchronize()

    def _engine_io(self, trt) -> list[tuple[str, bool, str]]:
        out = []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            dtype = self.engine.get_tensor_dtype(name)
            out.append((name, self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT,
                        _TRT_DTYPES.get(dtype.name, dtype.name)))
        return out

    def enqueue(self, phase: str, binding: StepBinding) -> None:
        ctx = self.contexts[phase]
        for name, shape in binding.shapes.items():
            if not ctx.set_input_shape(name, shape):
                raise RuntimeError(f"TensorRT refused shape {list(shape)} for {name}")
        for name, address in binding.addresses.items():
            if not ctx.set_tensor_address(name, address):
                raise RuntimeError(f"TensorRT refused the address of {name}")
        if not ctx.execute_async_v3(self.cuda.handle):
            raise RuntimeError(f"TensorRT failed to enqueue a {phase} step")

    def capture(self, phase: str, binding: StepBinding):
        """One enqueue of the context as bound by the eager ``enqueue`` just before, captured and
        instantiated (trtexec's pattern); CaptureFailed when TensorRT or CUDA refuse it."""
        self.cuda.begin_capture()
        try:
            ok = self.contexts[phase].execute_async_v3(self.cuda.handle)
        except Exception as exc:
            self.cuda.abort_capture()
            raise CaptureFailed(f"enqueue under capture raised {exc}") from None
        if not ok:
            self.cuda.abort_capture()
            raise CaptureFailed("enqueue under capture failed (work CUDA graphs cannot hold)")
        try:
            return self.cuda.end_capture()
        except RuntimeError as exc:
            self.cuda.rt.cudaGetLastError()
            raise CaptureFailed(str(exc)) from None

    def launch(self, handle) -> None:
        self.cuda.launch(handle)

    def destroy(self, handle) -> None:
        self.cuda.destroy_graph(handle)

    def synchronize(self) -> None:
        self.cuda.synchronize()

    def close(self) -> None:
        self.contexts = {}
        self.engine = None


def _read_plan(artifact_dir: Path, engine: EngineSpec) -> bytes:
    with open_artifact_file(artifact_dir, engine.file) as f:
        data = f.read(MAX_PLAN_BYTES + 1)
    if len(data) > MAX_PLAN_BYTES:
        raise GraphkilnError(f"engine {engine.file} is larger than {MAX_PLAN_BYTES >> 30} GiB: rebuild it")
    return data


def open_tensorrt(artifact_dir: Path, manifest: Manifest, spec: GraphSpec) -> tuple[EngineStepRunner, DevicePool]:
    """The step runner and the device state pool for ``spec``'s engine, warmed up (see the module
    docstring). The pool is sized to the engine (``max_batch`` x ``max_seq_len``); the Engine
    owns both for its life."""
    engine = find_engine(manifest, spec)
    check_in_place(spec)
    trt, cudart = _libraries()
    cuda = _Cuda(cudart)
    gpu_name, cc = cuda.device()
    check_compatible(engine, trt.__version__, cc, gpu_name)
    plan = _read_plan(artifact_dir, engine)
    pool = DevicePool(manifest.states, CudaMemory(cudart, cuda.stream), engine.max_seq_len, max_slots=engine.max_batch)
    runner = None
    try:
        executor = TrtExecutor(trt, cuda, plan, spec, engine)
        runner = EngineStepRunner(spec, engine, pool, manifest.model.vocab_size, executor)
        runner.warm_up()
    except BaseException:
        if runner is not None:
            runner.close()
        pool.close()
        raise
    return runner, pool
