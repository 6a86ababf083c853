"""onnxruntime on CUDA (graphkiln.runtime.ort_cuda): refusals, step plans and graph ids, the
device pool's bookkeeping over real host memory, and the whole runner (padding to buckets,
raw-pointer bindings, in-place state, slot moves) run end to end over host memory on an
onnxruntime CPU session against the CPU runtime.

What needs a GPU (onnxruntime-gpu's CUDA EP, CUDA graphs, cuda-python's device memory) is in
the tests at the end, skipped here with the reason.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from collections import Counter
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from cli_contract import assert_one_error, run_cli
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import StateSpec
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.cuda_graphs import GraphKey
from graphkiln.runtime.ort_cuda import (CUDA_EP, NEEDS_ORT_GPU, ORT_GPU_REQUIREMENT, SKIP_CAPTURE, Assigned,
                                        DevicePool, GraphIds, HostMemory, StepPlan, assigned_nodes,
                                        blockers_refusal, capture_blockers, check_bf16, check_graph, open_on_host,
                                        plan_step)
from graphkiln.runtime.state import StatePool

HAS_CUDA_EP = CUDA_EP in ort.get_available_providers()
NO_GPU = pytest.mark.skipif(not HAS_CUDA_EP, reason="needs onnxruntime-gpu with CUDAExecutionProvider and an NVIDIA "
                                                    "GPU (pip install 'graphkiln[cuda]', see README)")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def llama_ort(tiny):
    return tiny("llama_gqa_bias", "onnxruntime")  # GroupQueryAttention, KV written in place


@pytest.fixture(scope="module")
def lfm2_ort(tiny):
    return tiny("lfm2", "onnxruntime")  # conv state returned as the batch's rows (slot_rows) + attention in place


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


# -- refusals -------------------------------------------------------------------------------

@pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has the CUDA EP: the refusal is for the CPU wheel")
def test_engine_load_device_cuda_refuses_cpu_onnxruntime(llama_ort):
    before = _tree(llama_ort.artifact)
    with pytest.raises(GraphkilnError) as info:
        Engine.load(llama_ort.artifact, device="cuda")
    message = str(info.value)
    assert message == NEEDS_ORT_GPU and "\n" not in message
    assert "onnxruntime-gpu" in message and "graphkiln[cuda]" in message and "pip uninstall -y onnxruntime" in message
    assert _tree(llama_ort.artifact) == before  # nothing written into the artifact


@pytest.mark.skipif(HAS_CUDA_EP, reason="this onnxruntime has the CUDA EP: the refusal is for the CPU wheel")
def test_cli_run_device_cuda_refuses_cpu_onnxruntime(capsys, llama_ort):
    before = _tree(llama_ort.artifact)
    code, out, err = run_cli(capsys, "run", llama_ort.artifact, "--prompt-ids", "1,2,3", "--device", "cuda")
    assert_one_error(code, err, "onnxruntime-gpu", "graphkiln[cuda]", alone=True)
    assert out == ""
    assert _tree(llama_ort.artifact) == before


def test_cuda_extra_installs_what_the_refusal_names():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert ORT_GPU_REQUIREMENT in extras["cuda"]
    assert any(r.startswith("cuda-python") for r in extras["cuda"])  # cuda.bindings.runtime, for the device pools
    assert ORT_GPU_REQUIREMENT in NEEDS_ORT_GPU


def test_graph_that_returns_kv_rows_is_refused(llama_ort):
    spec = llama_ort.engine.decoder.spec
    check_graph(spec)  # the onnxruntime target writes its KV cache in place
    rows = tuple(dataclasses.replace(t, role=t.role.replace("present_", "new_"), name=t.name.replace("present_", "new_"))
                 for t in spec.outputs)
    portable = dataclasses.replace(spec, outputs=rows, target="portable")
    with pytest.raises(GraphkilnError, match=r"in place.*--target onnxruntime") as info:
        check_graph(portable)
    assert "\n" not in str(info.value) and "bf16" not in str(info.value)
    bf16 = dataclasses.replace(portable, inputs=tuple(dataclasses.replace(t, dtype="bfloat16") if t.layer is not None
                                                      else t for t in spec.inputs))
    with pytest.raises(GraphkilnError, match="bf16 attention is not lowered"):
        check_graph(bf16)


def test_bf16_needs_ampere():
    with pytest.raises(GraphkilnError, match=r"compute capability 7\.5.*--dtype fp16"):
        check_bf16("bfloat16", (7, 5))
    check_bf16("bfloat16", (8, 0))
    check_bf16("float16", (7, 5))


def test_capture_blockers_follow_onnxruntimes_rule():
    cuda = [Assigned(CUDA_EP, "MatMul"), Assigned(CUDA_EP, "GroupQueryAttention", "com.microsoft")]
    assert capture_blockers(cuda) == Counter()
    shapes = cuda + [Assigned("CPUExecutionProvider", "Shape"), Assigned("CPUExecutionProvider", "Gather")]
    assert capture_blockers(shapes) == Counter()  # CPU shape arithmetic without copies is allowed
    copies = [Assigned(CUDA_EP, "MatMul"), Assigned("CPUExecutionProvider", "GroupQueryAttention"),
              Assigned("CPUExecutionProvider", "GroupQueryAttention"), Assigned(CUDA_EP, "MemcpyToHost")]
    assert capture_blockers(copies) == Counter({"GroupQueryAttention": 2, "MemcpyToHost": 1})
    other = cuda + [Assigned("TensorrtExecutionProvider", "TRTKernel")]
    assert capture_blockers(other) == Counter({"TRTKernel": 1})
    cpu_only = [Assigned("CPUExecutionProvider", "MatMul"), Assigned("CPUExecutionProvider", "Add")]
    assert capture_blockers(cpu_only) == Counter({"MatMul": 1, "Add": 1})  # at least one node must be on the EP


def test_blockers_read_off_a_real_session(llama_ort):
    """The assignment onnxruntime records for a session (here the CPU EP's: every node off CUDA)."""
    spec = llama_ort.engine.decoder.spec
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    session = ort.InferenceSession(str(llama_ort.artifact / spec.file), opts, providers=["CPUExecutionProvider"])
    nodes = assigned_nodes(session)
    assert nodes and {n.ep for n in nodes} == {"CPUExecutionProvider"}
    blockers = capture_blockers(nodes)
    assert blockers["GroupQueryAttention"] == 2 and sum(blockers.values()) == len(nodes)
    line = blockers_refusal(spec.file, blockers, "float32")
    assert "\n" not in line and spec.file in line and "--dtype fp16" in line
    assert "GroupQueryAttention x2" in line
    assert "--dtype fp16" not in blockers_refusal(spec.file, Counter({"ScatterND": 1}), "float16")


# -- plain bookkeeping ----------------------------------------------------------------------

def test_plan_step_captures_decode_only():
    buckets = (1, 2, 4, 8)
    assert plan_step(3, 1, 1, buckets) == StepPlan(3, 4)
    assert plan_step(1, 1, 1, buckets) == StepPlan(1, 1)
    assert plan_step(8, 1, 1, buckets) == StepPlan(8, 8)
    assert plan_step(9, 1, 1, buckets) == StepPlan(9, None)  # above every bucket: plain
    assert plan_step(3, 7, 1, buckets) == StepPlan(3, None)  # prefill
    assert plan_step(3, 7, 7, buckets) == StepPlan(3, None)  # prompt logits
    assert plan_step(2, 1, 1, ()) == StepPlan(2, None)


def test_graph_ids_per_key():
    released: list[int] = []
    ids = GraphIds(released.append)
    a, b = GraphKey(4, 1, (100, 200)), GraphKey(2, 1, (100, 200))
    assert ids.graph_id(a) == 1 and ids.graph_id(b) == 2 and ids.graph_id(a) == 1
    moved = GraphKey(4, 1, (300, 200))  # same bucket, a buffer elsewhere: never the old graph
    assert ids.graph_id(moved) == 3
    ids.fail(moved, "capture failed")
    assert ids.graph_id(moved) == SKIP_CAPTURE
    assert ids.cache.stats.failed == 1 and ids.cache.stats.fallbacks == 1
    ids.clear()
    assert sorted(released) == [1, 2, 3]
    assert ids.graph_id(a) == 4  # ids are never reused: onnxruntime may still hold a released one's memory


KV = StateSpec("kv", (0, 2), 2, 4, 16, "float32")
CONV = StateSpec("conv", (1,), 0, 0, 16, "float32", layout="slots,channels,width", channels=3, width=2)


def _views(pool: DevicePool) -> dict[tuple[str, int], np.ndarray]:
    m = pool.memory
    return {**{("key", l): m.view(r.ptr, r.shape, r.dtype) for l, r in pool.keys.items()},
            **{("value", l): m.view(r.ptr, r.shape, r.dtype) for l, r in pool.values.items()},
            **{("conv", l): m.view(r.ptr, r.shape, r.dtype) for l, r in pool.conv.items()}}


def test_device_pool_sizes_and_addresses():
    pool = DevicePool((KV, CONV), "float32", HostMemory(), (1, 2, 4, 8))
    pool.reserve(3, 10)
    assert (pool.slots, pool.physical_slots, pool.generation) == (3, 4, 1)  # rounded up to the bucket
    assert pool.keys[0].shape == (4, 2, 16, 4) and pool.conv[1].shape == (4, 3, 2)  # full max_seq_len
    ptrs = [r.ptr for r in pool.regions()]
    pool.reserve(2, 16)
    assert (pool.slots, pool.generation) == (2, 1) and [r.ptr for r in pool.regions()] == ptrs  # nothing moves
    pool.reserve(5, 4)
    assert (pool.physical_slots, pool.generation) == (8, 2)
    pool.reserve(9, 4)  # above every bucket: exactly what was asked
    assert pool.physical_slots == 9
    with pytest.raises(RuntimeError, match="16"):
        pool.reserve(1, 17)
    pool.claim()
    with pytest.raises(RuntimeError, match="live"):
        pool.reserve(1, 4)


def test_device_pool_moves_rows_like_state_pool():
    """Claims and releases over host memory leave every live slot's rows where StatePool does."""
    rng = np.random.default_rng(0)
    dev = DevicePool((KV, CONV), "float32", HostMemory(), (1, 2, 4))
    ref = StatePool((KV, CONV), np.dtype(np.float32))
    dev.reserve(4, 16)
    ref.reserve(4, 16)
    views = _views(dev)
    refs = {**{("key", l): a for l, a in ref.keys.items()}, **{("value", l): a for l, a in ref.values.items()},
            **{("conv", l): a for l, a in ref.conv.items()}}
    for _ in range(4):
        slot = dev.claim()
        assert slot == ref.claim()
        for k in views:
            views[k][slot] = refs[k][slot] = rng.standard_normal(views[k][slot].shape)
    for slot in (1, 0, 1, 0):
        assert dev.release(slot) == ref.release(slot)
        for k in views:
            np.testing.assert_array_equal(views[k][: dev.live], refs[k][: ref.live])
    assert dev.live == 0
    assert views["conv", 1][0].any() and views["key", 0][0].any()
    assert dev.claim() == 0
    assert not views["conv", 1][0].any()  # conv rows are read from the first step: zeroed on claim
    assert views["key", 0][0].any()  # KV rows are written before they are read: left as they were


def test_device_pool_refuses_what_memory_cannot_hold():
    class Small(HostMemory):
        def available(self):
            return 4096

    pool = DevicePool((KV, CONV), "float32", Small(), (1, 2, 4))
    with pytest.raises(GraphkilnError, match=r"state pools for 4 slot\(s\) x 16 tokens") as info:
        pool.reserve(3, 8)
    assert "\n" not in str(info.value)
    assert (pool.slots, pool.physical_slots, pool.generation, pool.regions()) == (0, 0, 0, [])


def test_host_memory_refuses_out_of_block_access():
    m = HostMemory()
    p = m.alloc(64)
    m.zero(p, 64)
    with pytest.raises(RuntimeError, match="outside every block"):
        m.copy(p + 32, p, 33)
    m.free(p)
    with pytest.raises(RuntimeError, match="outside every block"):
        m.zero(p, 1)


# -- the runner end to end over host memory ---------------------------------------------------

def _host_engine(case, max_batch: int) -> Engine:
    engine = Engine.load(case.artifact, check_files=False)
    engine.decoder, engine.pool = open_on_host(case.artifact, engine.manifest, engine.decoder.spec, max_batch=max_batch)
    return engine


@pytest.mark.parametrize("which, max_batch", [("llama_ort", 4), ("lfm2_ort", 4), ("lfm2_ort", 2)])
def test_runner_matches_cpu_runtime(request, which, max_batch):
    """Three requests that finish at different steps (slot moves), decode padded 3 -> 4 then 2
    -> 2 (or, with max_batch 2, three rows run plainly): tokens and logits as the CPU runtime's."""
    case = request.getfixturevalue(which)
    engine = _host_engine(case, max_batch)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, case.vocab_size, size=n).tolist() for n in (case.max_seq_len - 6, 9, 4)]
    cfg = GenerationConfig(max_new_tokens=10, do_sample=False, output_logits=True, stop_token_ids=())
    want = case.engine.generate(prompts, cfg)
    got = engine.generate(prompts, cfg)
    assert [len(r.token_ids) for r in got] == [6, 10, 10]
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logits, w.logits, rtol=0, atol=1e-5)
    stats = engine.decoder.graphs.cache.stats
    generation = engine.pool.generation
    if max_batch == 4:
        assert len(engine.decoder.graphs.cache) == 2 and stats.replays == 5 + 4 - 2  # buckets 4 and 2
    else:
        assert len(engine.decoder.graphs.cache) == 1 and stats.replays == 4 - 1  # bucket 2 only
    assert engine.pool.live == 0
    again = engine.generate(prompts[1:], cfg)  # fewer slots: same buffers, same graphs
    assert [r.token_ids for r in again] == [w.token_ids for w in want[1:]]
    assert engine.pool.generation == generation and engine.decoder.graphs.cache.stats.captured == stats.captured


def test_prompt_logits_run_plain(llama_ort):
    engine = _host_engine(llama_ort, 4)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    for w, g in zip(llama_ort.engine.prompt_logits(prompts), engine.prompt_logits(prompts)):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)
    assert len(engine.decoder.graphs.cache) == 0


# -- on a GPU ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama_fp16(tiny, tmp_path_factory):
    from graphkiln.export.pipeline import ExportOptions, export_model

    case = tiny("llama_gqa_bias", "onnxruntime")
    out = tmp_path_factory.mktemp("ort_cuda") / "fp16"
    export_model(str(case.checkpoint), out, ExportOptions(progress=False, max_seq_len=128, dtype="fp16"))
    return case, out


@NO_GPU
def test_cuda_greedy_matches_cpu_and_replays(llama_fp16):
    case, art = llama_fp16
    cpu, gpu = Engine.load(art), Engine.load(art, device="cuda")
    prompts = case.prompts([20, 9, 4])
    cfg = GenerationConfig(max_new_tokens=12, do_sample=False, output_logits=True, stop_token_ids=())
    want, got = cpu.generate(prompts, cfg), gpu.generate(prompts, cfg)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g.logits[:3], w.logits[:3], rtol=0, atol=5e-2)
        assert g.token_ids[:3] == w.token_ids[:3]
    stats = gpu.decoder.graphs.cache.stats
    assert stats.failed == 0 and stats.replays > 0, stats
    print(f"cuda graphs: {stats}", file=sys.stderr)


@NO_GPU
def test_cuda_fp32_gqa_is_refused_with_its_nodes(llama_ort):
    with pytest.raises(GraphkilnError, match="GroupQueryAttention.*--dtype fp16"):
        Engine.load(llama_ort.artifact, device="cuda")
