"""The TensorRT engine runner (graphkiln.runtime.backends.trt_runner) and its device state
(graphkiln.runtime.backends.device_state).

What runs here (CPU, no TensorRT): every decision the runner makes. The device pool and step
buffers run over host memory (``device_state.HostMemory``: real bytes, real copies); ``EngineStepRunner``
(padding, buckets, bindings, graph keys, warm-up, replay-or-enqueue) drives an executor that runs
the artifact's tensorrt-target graph in onnxruntime, bound by raw address to exactly the
buffers and shapes the runner binds for TensorRT, where a "graph" replays the binding captured
at warm-up (fixed shapes and addresses, data read at replay: what a CUDA graph holds). Its
generations must equal the CPU runtime's. The refusals (no engine, no TensorRT, another TensorRT
version or GPU, mismatched engine tensors, shapes outside a profile) are checked for real.

What does not run here: TensorRT and CUDA themselves (``TrtExecutor``, ``_Cuda``,
``device_state.CudaMemory``); ``test_tensorrt_engine_generates_like_the_cpu_runtime`` runs them where
TensorRT and a GPU exist.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import EngineSpec, TensorSpec
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.backends.cuda_graphs import CaptureFailed, decode_buckets
from graphkiln.runtime.backends.ort_cpu import numpy_dtype
from graphkiln.runtime.backends.device_state import DevicePool, HostMemory, StepBuffers, bind_step, check_in_place, io_roles
from graphkiln.runtime.backends.state import StatePool
from graphkiln.runtime.backends.trt_runner import (DECODE, INSTALL, PREFILL, EngineStepRunner, StepPlan, check_compatible,
                                          check_engine_io, check_logits, check_profile, find_engine, logits_per_row,
                                          plan_step, profile_index, tensorrt_major)

TRT = "tensorrt"
MAX_BATCH, SEQ = 4, 64  # the engine's sizes in these tests (the artifact's states hold 128)


class OrtHostExecutor:
    """Runs the graph in onnxruntime with every input and output bound by raw address and shape
    exactly as ``StepBinding`` says (outputs' shapes follow from the inputs'); ``capture``
    returns the binding, and ``launch`` re-runs it: a replay reads whatever the captured
    addresses hold at that moment, with the captured shapes, as a CUDA graph does. Buckets in
    ``refuse`` fail their capture (those steps then run eagerly)."""

    def __init__(self, artifact, spec, vocab: int, refuse: tuple[int, ...] = ()) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(artifact / spec.file), opts, providers=["CPUExecutionProvider"])
        self.spec, self.vocab, self.refuse = spec, vocab, refuse
        self.inputs = {(t.role, t.layer): t.name for t in spec.inputs}
        self.calls: list[tuple[str, str, int]] = []  # (what, phase, batch)
        self.destroyed: list = []

    def _output_shape(self, t: TensorSpec, shapes) -> tuple[int, ...]:
        if t.role == "logits":
            return (shapes["input_ids"][0], shapes["logits_index"][1], self.vocab)
        source = {"present_key": "past_key", "present_value": "past_value", "new_conv_state": "conv_state"}[t.role]
        return shapes[self.inputs[source, t.layer]]

    def _run(self, binding) -> None:
        io = self.session.io_binding()
        for t in self.spec.inputs:
            io.bind_input(t.name, "cpu", 0, numpy_dtype(t.dtype), list(binding.shapes[t.name]), binding.addresses[t.name])
        for t in self.spec.outputs:
            io.bind_output(t.name, "cpu", 0, numpy_dtype(t.dtype), list(self._output_shape(t, binding.shapes)),
                           binding.addresses[t.name])
        self.session.run_with_iobinding(io)

    def enqueue(self, phase, binding) -> None:
        self.calls.append(("enqueue", phase, binding.shapes["input_ids"][0]))
        self._run(binding)

    def capture(self, phase, binding):
        batch = binding.shapes["input_ids"][0]
        if batch in self.refuse:
            raise CaptureFailed("refused by the test executor")
        self.calls.append(("capture", phase, batch))
        return (phase, batch, binding)

    def launch(self, handle) -> None:
        phase, batch, binding = handle
        self.calls.append(("replay", phase, batch))
        self._run(binding)

    def destroy(self, handle) -> None:
        self.destroyed.append(handle)

    def synchronize(self) -> None:
        pass


def _hybrid(tiny):
    return tiny("lfm2", TRT)  # conv pools and attention, both written in place


def _engine_spec(case, max_batch: int = MAX_BATCH, max_seq_len: int = SEQ, **kw) -> EngineSpec:
    """What ``graphkiln build`` records, with its own profiles (graphkiln.trt_build.profiles): the
    runner must bind only shapes these admit."""
    from graphkiln.trt_build.profiles import BuildSizes, make_profiles

    manifest = case.manifest
    spec = manifest.graph("decoder", TRT)
    fields = dict(graph="decoder", target=TRT, file="engines/tensorrt/decoder.plan", backend=TRT,
                  profiles=make_profiles(manifest, spec, BuildSizes(max_batch, max_seq_len)),
                  max_batch=max_batch, max_seq_len=max_seq_len, tensorrt_version="11.4.0.106",
                  gpu_name="NVIDIA H200", compute_capability="9.0")
    return EngineSpec(**(fields | kw))


def _runner(case, refuse=(), memory=None):
    spec = case.manifest.graph("decoder", TRT)
    memory = memory or HostMemory()
    pool = DevicePool(case.manifest.states, memory, SEQ, max_slots=MAX_BATCH)
    executor = OrtHostExecutor(case.artifact, spec, case.vocab_size, refuse)
    return EngineStepRunner(spec, _engine_spec(case), pool, case.vocab_size, executor), pool, executor, memory


# -- the device pool ---------------------------------------------------------------------------

def test_device_pool_keeps_the_state_pool_contract(tiny):
    """The same claims, releases and state writes on a DevicePool (host memory) and a StatePool:
    the same slots, the same moves, byte-identical buffers after every operation."""
    case = _hybrid(tiny)
    states = case.manifest.states
    memory = HostMemory()
    dev = DevicePool(states, memory, 12, max_slots=5)
    ref = StatePool(states, np.dtype(np.float32))
    ref.reserve(5, 12)
    dev.reserve(5, 12)
    arrays = {k: memory.view(b) for k, b in dev.buffers.items()}
    refs = {("key", l): a for l, a in ref.keys.items()} | {("value", l): a for l, a in ref.values.items()} | {
        ("conv", l): a for l, a in ref.conv.items()}
    assert arrays.keys() == refs.keys()
    assert all(np.array_equal(arrays[k], refs[k]) for k in refs)  # zeroed on allocation (memory held 0xFF)
    rng = np.random.default_rng(5)
    for step in range(60):
        if dev.live and (dev.live == dev.slots or rng.random() < 0.4):
            slot = int(rng.integers(dev.live))
            assert dev.release(slot) == ref.release(slot)
        else:
            assert dev.claim() == ref.claim()
        for k in refs:  # the graph writes the live slots' state in place
            rows = rng.standard_normal((dev.live,) + refs[k].shape[1:]).astype(np.float32)
            arrays[k][: dev.live] = rows
            refs[k][: ref.live] = rows
        assert dev.live == ref.live and dev.free_slots == ref.free_slots
        for k in refs:
            np.testing.assert_array_equal(arrays[k], refs[k], err_msg=f"{k} after step {step}")
    assert dev.nbytes == ref.nbytes
    dev.close()
    assert memory.blocks == {}


def test_device_pool_refusals(tiny):
    case = _hybrid(tiny)
    states = case.manifest.states
    memory = HostMemory(limit=1000)
    with pytest.raises(GraphkilnError) as e:
        DevicePool(states, memory, 64, max_slots=4)
    assert "\n" not in str(e.value) and "rebuild the engine with a smaller --max-batch" in str(e.value)
    assert memory.blocks == {}  # nothing allocated before the refusal
    memory.limit = None
    pool = DevicePool(states, memory, 64, max_slots=4)
    addresses = {k: b.address for k, b in pool.buffers.items()}
    pool.reserve(4, 64)
    pool.reserve(1, 10)
    assert {k: b.address for k, b in pool.buffers.items()} == addresses and pool.generation == 1
    for slots, capacity in [(5, 10), (2, 65)]:
        with pytest.raises(GraphkilnError) as e:
            pool.reserve(slots, capacity)
        msg = str(e.value)
        assert "\n" not in msg and "built for at most 4 x 64" in msg and "graphkiln build" in msg
    pool.claim()
    with pytest.raises(RuntimeError):
        pool.reserve(1, 10)
    with pytest.raises(RuntimeError):
        pool.release(1)
    for _ in range(3):
        pool.claim()
    with pytest.raises(RuntimeError):
        pool.claim()


# -- bindings and profiles ---------------------------------------------------------------------

def test_bindings_put_state_in_place_and_fit_the_profiles(tiny):
    case = _hybrid(tiny)
    spec = case.manifest.graph("decoder", TRT)
    memory = HostMemory()
    pool = DevicePool(case.manifest.states, memory, SEQ, max_slots=MAX_BATCH)
    bufs = StepBuffers(memory, io_roles(spec), MAX_BATCH, 1, case.vocab_size, 1)
    assert set(bufs.io) == {"input_ids", "position_ids", "logits_index", "seq_lens", "slot_idx"}
    engine = _engine_spec(case)
    names = {t.name: t for t in spec.inputs + spec.outputs}
    for bucket in decode_buckets(MAX_BATCH):
        b = bind_step(spec, pool, bufs.io, bufs.logits, bucket, 1, 1)
        check_profile(engine, profile_index(engine, DECODE), dict(b.shapes))
        assert set(b.shapes) == {t.name for t in spec.inputs}
        assert set(b.addresses) == set(names)
        assert b.shapes["past_key.1"] == (bucket, 2, SEQ, 16) and b.shapes["conv_state.0"] == (MAX_BATCH, 64, 2)
        assert b.addresses["present_key.1"] == b.addresses["past_key.1"] == pool.buffers["key", 1].address
        assert b.addresses["present_value.1"] == b.addresses["past_value.1"] == pool.buffers["value", 1].address
        for layer in (0, 2, 3):
            assert b.addresses[f"new_conv_state.{layer}"] == b.addresses[f"conv_state.{layer}"] \
                == pool.buffers["conv", layer].address
        assert b.addresses["input_ids"] == bufs.io["input_ids"].address and b.addresses["logits"] == bufs.logits.address
    with pytest.raises(ValueError, match="does not fit"):
        bind_step(spec, pool, bufs.io, bufs.logits, MAX_BATCH + 1, 1, 1)
    with pytest.raises(ValueError, match="does not fit"):  # decode buffers hold one token per row
        bind_step(spec, pool, bufs.io, bufs.logits, 2, 3, 1)
    # a prefill-shaped step is outside the decode profile
    pre = StepBuffers(memory, io_roles(spec), MAX_BATCH, SEQ, case.vocab_size, SEQ)
    prefill = bind_step(spec, pool, pre.io, pre.logits, MAX_BATCH, SEQ, 1)
    check_profile(engine, profile_index(engine, PREFILL), dict(prefill.shapes))
    assert prefill.shapes["input_ids"] == (MAX_BATCH, SEQ) and prefill.shapes["logits_index"] == (MAX_BATCH, 1)
    # build's engines return the last position's logits only; more is refused before binding
    assert logits_per_row(engine, spec) == 1
    every = bind_step(spec, pool, pre.io, pre.logits, MAX_BATCH, SEQ, SEQ)
    with pytest.raises(GraphkilnError, match="logits_index"):
        check_profile(engine, profile_index(engine, PREFILL), dict(every.shapes))
    with pytest.raises(GraphkilnError) as e:
        check_logits(SEQ, 1)
    assert "\n" not in str(e.value) and "onnxruntime backend" in str(e.value)
    shapes = dict(prefill.shapes) | {"input_ids": (2, 5), "position_ids": (2, 5)}
    with pytest.raises(GraphkilnError) as e:
        check_profile(engine, 1, shapes)
    assert "\n" not in str(e.value) and "input_ids" in str(e.value) and "decode profile" in str(e.value)
    with pytest.raises(GraphkilnError, match="outside the prefill profile"):
        check_profile(engine, 0, shapes | {"input_ids": (2, SEQ + 1)})


def test_plan_step_replays_only_decode_steps():
    buckets = decode_buckets(6)
    assert plan_step(3, 1, 1, buckets) == StepPlan(DECODE, 4, plan_step(3, 1, 1, buckets).padding)
    p = plan_step(3, 1, 1, buckets).padding
    assert (p.live, p.bucket) == (3, 4)
    assert plan_step(6, 1, 1, buckets).rows == 6 and plan_step(1, 1, 1, buckets).rows == 1
    for n, seq, n_logits in [(3, 7, 1), (2, 5, 5), (1, 1, 2), (7, 1, 1)]:
        plan = plan_step(n, seq, n_logits, buckets)
        assert plan.phase == PREFILL and plan.rows == n and plan.padding is None


# -- the runner, end to end on CPU -----------------------------------------------------------

def _greedy(n, stops=()):
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=stops)


def test_runner_generates_like_the_cpu_runtime(tiny):
    """Warm-up captures every bucket with probe slots and leaves the pool empty at the same
    addresses; then generation through the runner (prefill eager, decode replayed per bucket,
    the batch shrinking through buckets 4, 2, 1 as requests stop) equals the CPU runtime's."""
    case = _hybrid(tiny)
    runner, pool, executor, memory = _runner(case)
    addresses = {k: b.address for k, b in pool.buffers.items()}
    report = runner.warm_up()
    assert report.captured == (1, 2, 4) and report.failed == ()
    assert [c for c in executor.calls if c[0] == "capture"] == [("capture", DECODE, b) for b in (1, 2, 4)]
    assert pool.live == 0 and {k: b.address for k, b in pool.buffers.items()} == addresses
    assert {k: b.shape for k, b in pool.buffers.items()} == {
        k: ((MAX_BATCH,) + b.shape[1:]) for k, b in pool.buffers.items()}

    cpu = Engine.load(case.artifact, threads=1, target=TRT)
    engine = Engine.load(case.artifact, threads=1, target=TRT)
    engine.decoder, engine.pool = runner, pool
    prompts = case.prompts((6, 11, 3), salt=51)
    expected = [r.token_ids for r in cpu.generate(prompts, _greedy(14))]
    assert [r.token_ids for r in engine.generate(prompts, _greedy(14))] == expected
    # stop tokens taken from the expected outputs: requests finish at different steps
    stops = (expected[0][3], expected[1][8])
    want = [r.token_ids for r in cpu.generate(prompts, _greedy(14, stops))]
    executor.calls.clear()
    before = runner.graphs.stats.replays
    assert [r.token_ids for r in engine.generate(prompts, _greedy(14, stops))] == want
    assert len({len(t) for t in want}) > 1
    replays = [c for c in executor.calls if c[0] == "replay"]
    assert replays and not [c for c in executor.calls if c[:2] == ("enqueue", DECODE)]
    assert {c[2] for c in replays} <= {1, 2, 4} and 4 in {c[2] for c in replays}  # 3 live rows padded to 4
    assert runner.graphs.stats.replays - before == len(replays)
    assert pool.live == 0
    # logits at every prompt position: not what the engine computes; one line, slots freed
    with pytest.raises(GraphkilnError, match="onnxruntime backend"):
        engine.prompt_logits(case.prompts((5, 9), salt=52))
    assert pool.live == 0
    # the last position's logits (what generation reads) equal the CPU runtime's
    one = case.prompts((6,), salt=57)
    got = engine.generate(one, GenerationConfig(max_new_tokens=3, do_sample=False, output_logits=True))[0]
    want_one = cpu.generate(one, GenerationConfig(max_new_tokens=3, do_sample=False, output_logits=True))[0]
    np.testing.assert_allclose(got.logits, want_one.logits, rtol=0, atol=1e-5)
    runner.close()
    pool.close()
    assert memory.blocks == {} and len(executor.destroyed) == 3


def test_runner_falls_back_to_enqueue_where_capture_failed(tiny):
    case = _hybrid(tiny)
    runner, pool, executor, _ = _runner(case, refuse=(2,))
    report = runner.warm_up()
    assert report.captured == (1, 4) and [b for b, _ in report.failed] == [2] and pool.live == 0
    cpu = Engine.load(case.artifact, threads=1, target=TRT)
    engine = Engine.load(case.artifact, threads=1, target=TRT)
    engine.decoder, engine.pool = runner, pool
    prompts = case.prompts((4, 7), salt=53)
    executor.calls.clear()
    got = [r.token_ids for r in engine.generate(prompts, _greedy(8))]
    assert got == [r.token_ids for r in cpu.generate(prompts, _greedy(8))]
    decode = [c for c in executor.calls if c[1] == DECODE]
    assert decode and all(c == ("enqueue", DECODE, 2) for c in decode)  # bucket 2 has no graph
    assert runner.graphs.stats.fallbacks == len(decode)


def test_sessions_beyond_the_engine_are_one_line(tiny):
    case = _hybrid(tiny)
    runner, pool, _, _ = _runner(case)
    engine = Engine.load(case.artifact, threads=1, target=TRT)
    engine.decoder, engine.pool = runner, pool
    for prompts, n in [(case.prompts((3,) * (MAX_BATCH + 1), salt=54), 2), (case.prompts((10,), salt=55), SEQ)]:
        with pytest.raises(GraphkilnError) as e:
            engine.generate(prompts, _greedy(n))
        assert "\n" not in str(e.value) and "graphkiln build" in str(e.value)
        assert pool.live == 0


# -- refusals --------------------------------------------------------------------------------

def test_no_engine_is_one_line(tiny, artifact_copy):
    art = artifact_copy(_hybrid(tiny))
    with pytest.raises(GraphkilnError) as e:
        Engine.load(art, backend="tensorrt")
    msg = str(e.value)
    assert "\n" not in msg and "run graphkiln build ART --backend tensorrt first" in msg
    spec = _hybrid(tiny).manifest.graph("decoder", TRT)
    with pytest.raises(GraphkilnError, match="no TensorRT engine"):
        find_engine(_hybrid(tiny).manifest, spec)


@pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None, reason="TensorRT is installed here")
def test_missing_tensorrt_is_one_line(tiny):
    case = _hybrid(tiny)
    manifest = dataclasses.replace(case.manifest, engines=(_engine_spec(case),))
    with pytest.raises(GraphkilnError) as e:
        Engine(case.artifact, manifest, backend="tensorrt")
    assert str(e.value) == INSTALL


def test_engine_from_elsewhere_is_refused(tiny):
    engine = _engine_spec(_hybrid(tiny))
    check_compatible(engine, "11.4.0.106", "9.0", "NVIDIA H200")
    for version, cc, needle in [("11.5.0.1", "9.0", "TensorRT 11.4.0.106"), ("11.4.0.106", "8.9", "compute capability")]:
        with pytest.raises(GraphkilnError) as e:
            check_compatible(engine, version, cc, "NVIDIA L4")
        assert "\n" not in str(e.value) and needle in str(e.value) and "rebuild" in str(e.value)
    assert [tensorrt_major(v) for v in ("11.4.0.106", "10.15.1", "x")] == [11, 10, None]
    with pytest.raises(GraphkilnError, match="no decode optimization profile"):
        profile_index(dataclasses.replace(engine, profiles=engine.profiles[:1]), DECODE)


def test_engine_tensors_must_be_the_graphs(tiny):
    spec = _hybrid(tiny).manifest.graph("decoder", TRT)
    io = [(t.name, True, t.dtype) for t in spec.inputs] + [(t.name, False, t.dtype) for t in spec.outputs]
    check_engine_io(spec, "e.plan", io)
    for bad, needle in [(io[1:], "no input 'input_ids'"),
                        ([(n, i, "float16" if n == "logits" else d) for n, i, d in io], "'logits' is float16"),
                        (io + [("extra", True, "int64")], "'extra'")]:
        with pytest.raises(GraphkilnError) as e:
            check_engine_io(spec, "e.plan", bad)
        assert "\n" not in str(e.value) and needle in str(e.value) and "rebuild" in str(e.value)


def test_graph_returning_state_rows_is_refused(tiny):
    spec = _hybrid(tiny).manifest.graph("decoder", TRT)
    check_in_place(spec)
    rows = TensorSpec("new_key.1", "float32", ("batch", 2, "seq", 16), "new_key", 1)
    bad = dataclasses.replace(spec, outputs=tuple(rows if t.name == "present_key.1" else t for t in spec.outputs))
    with pytest.raises(GraphkilnError, match="--target tensorrt"):
        check_in_place(bad)


# -- on a GPU with TensorRT ------------------------------------------------------------------

def _gpu_with_tensorrt() -> bool:
    if importlib.util.find_spec("tensorrt") is None or importlib.util.find_spec("cuda") is None:
        return False
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False
    err, count = cudart.cudaGetDeviceCount()
    return err == cudart.cudaError_t.cudaSuccess and count > 0


def _cuda_device() -> bool:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False
    err, count = cudart.cudaGetDeviceCount()
    return err == cudart.cudaError_t.cudaSuccess and count > 0


@pytest.mark.skipif(not _cuda_device(), reason="needs cuda-python and an NVIDIA GPU")
def test_cuda_memory_moves_bytes_like_host_memory(tiny):
    """The device pool's claims and releases over CudaMemory leave the bytes HostMemory does."""
    from cuda.bindings import runtime as cudart

    from graphkiln.runtime.backends.device_state import CudaMemory

    states = _hybrid(tiny).manifest.states
    cuda = CudaMemory.open(cudart)
    pools = [DevicePool(states, m, 12, max_slots=4) for m in (HostMemory(), cuda)]
    rng = np.random.default_rng(9)
    for key in pools[0].buffers:
        rows = rng.standard_normal(pools[0].buffers[key].shape).astype(np.float32)
        for pool in pools:
            pool.memory.upload(pool.buffers[key].address, rows)
    for op in ("claim", "claim", "claim", 0, "claim", 2, 1):
        for pool in pools:
            pool.claim() if op == "claim" else pool.release(op)
    for key, host in pools[0].buffers.items():
        got = np.empty(host.shape, np.float32)
        cuda.download(got, pools[1].buffers[key].address)
        np.testing.assert_array_equal(got, pools[0].memory.view(host), err_msg=str(key))
    for pool in pools:
        pool.close()
    cuda.close()


@pytest.mark.skipif(not _gpu_with_tensorrt(), reason="needs TensorRT 11, cuda-python and an NVIDIA GPU")
def test_tensorrt_engine_generates_like_the_cpu_runtime(tiny, tmp_path, capsys):
    from cli_contract import run_cli

    case = tiny("llama_gqa_bias", TRT)
    art = tmp_path / "art"
    shutil.copytree(case.artifact, art)
    code, out, err = run_cli(capsys, "build", art, "--backend", "tensorrt", "--max-batch", 4, "--max-seq-len", 64)
    assert code == 0, err
    gpu = Engine.load(art, backend="tensorrt")
    assert gpu.pool.live == 0 and gpu.decoder.graphs.stats.captured == len(decode_buckets(4))
    cpu = Engine.load(art, target=TRT)
    prompts = case.prompts((5, 9, 3), salt=56)
    assert [r.token_ids for r in gpu.generate(prompts, _greedy(12))] == \
        [r.token_ids for r in cpu.generate(prompts, _greedy(12))]
    assert gpu.decoder.graphs.stats.replays > 0
