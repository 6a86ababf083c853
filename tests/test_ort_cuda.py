"""onnxruntime on CUDA (graphkiln.runtime.backends.ort_cuda): refusals, step plans and graph ids, the
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
from graphkiln.runtime.backends.cuda_graphs import GraphKey
from graphkiln.runtime.backends.device_state import DevicePool, HostMemory
from graphkiln.runtime.backends.ort_cuda import (CUDA_EP, NEEDS_ORT_GPU, ORT_GPU_REQUIREMENT, SKIP_CAPTURE, Assigned, GraphIds,
                                        StepPlan, assigned_nodes, blockers_refusal, capture_blockers, check_bf16,
                                        check_graph, open_on_host, plan_step)
from graphkiln.runtime.backends.state import StatePool

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
    return {key: pool.memory.view(buf) for key, buf in pool.buffers.items()}


def test_device_pool_sizes_and_addresses():
    pool = DevicePool((KV, CONV), HostMemory(), 16, buckets=(1, 2, 4, 8))
    pool.reserve(3, 10)
    assert (pool.slots, pool.physical_slots, pool.generation) == (3, 4, 1)  # rounded up to the bucket
    # the artifact's full max_seq_len
    assert pool.buffers["key", 0].shape == (4, 2, 16, 4) and pool.buffers["conv", 1].shape == (4, 3, 2)
    ptrs = [b.address for b in pool.buffers.values()]
    pool.reserve(2, 16)
    assert (pool.slots, pool.generation) == (2, 1)
    assert [b.address for b in pool.buffers.values()] == ptrs  # nothing moves
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
    dev = DevicePool((KV, CONV), HostMemory(), 16, buckets=(1, 2, 4))
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
    pool = DevicePool((KV, CONV), HostMemory(limit=4096), 16, buckets=(1, 2, 4))
    with pytest.raises(GraphkilnError, match=r"state pools for 4 slot\(s\) x 16 tokens") as info:
        pool.reserve(3, 8)
    assert "\n" not in str(info.value)
    assert (pool.slots, pool.physical_slots, pool.generation, pool.buffers) == (0, 0, 0, {})


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


# -- total_sequence_length from the host ------------------------------------------------------

def _onnx(case):
    import onnx

    spec = case.engine.decoder.spec
    return spec, onnx.load(str(case.artifact / spec.file), load_external_data=False)


@pytest.mark.parametrize("which", ["llama_ort", "lfm2_ort"])
def test_total_sequence_length_is_a_host_input_of_every_gqa(request, which):
    """onnxruntime's CUDA GroupQueryAttention reads input 6 in host memory: the graph takes it
    as its own int32 scalar input, recorded in the manifest, and computes it nowhere (a value
    computed on the device would be copied to the host inside the step: no capture)."""
    spec, model = _onnx(request.getfixturevalue(which))
    total = [t for t in spec.inputs if t.role == "total_sequence_length"]
    assert [(t.name, t.dtype, t.shape, t.layer) for t in total] == [("total_sequence_length", "int32", (), None)]
    graph_input = next(i for i in model.graph.input if i.name == "total_sequence_length")
    assert graph_input.type.tensor_type.elem_type == 6 and len(graph_input.type.tensor_type.shape.dim) == 0
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert gqa and all(n.input[6] == "total_sequence_length" for n in gqa)
    # nothing feeding attention reduces the positions to a length on the device (the folded
    # argmax's ReduceMax over the logits is downstream of every GroupQueryAttention)
    producer = {o: n for n in model.graph.node for o in n.output}
    seen, todo = set(), [i for n in gqa for i in n.input]
    while todo:
        name = todo.pop()
        node = producer.get(name)
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        assert node.op_type != "ReduceMax", node.name
        todo.extend(node.input)
    assert not [o for n in model.graph.node for o in n.output if o.endswith("total_sequence_length")]


def _older_artifact(case, art):
    """``art`` rewritten as artifacts were exported before total_sequence_length was an input:
    the graph computes it (max(position_ids[:, 0] + seq_lens), int32) and the manifest lacks it."""
    import json

    import onnx
    from onnx import TensorProto, helper

    spec, model = _onnx(case)
    g = model.graph
    pos = next(t.name for t in spec.inputs if t.role == "position_ids")
    lens = next(t.name for t in spec.inputs if t.role == "seq_lens")
    keep = [i for i in g.input if i.name != "total_sequence_length"]
    del g.input[:]
    g.input.extend(keep)
    one = helper.make_tensor("", TensorProto.INT64, [1], [1])
    zero = helper.make_tensor("", TensorProto.INT64, [1], [0])
    computed = [helper.make_node("Constant", [], ["old.zero"], value=zero),
                helper.make_node("Constant", [], ["old.one"], value=one),
                helper.make_node("Slice", [pos, "old.zero", "old.one", "old.one"], ["old.start2d"]),
                helper.make_node("Squeeze", ["old.start2d", "old.one"], ["old.start"]),
                helper.make_node("Add", ["old.start", lens], ["old.total"]),
                helper.make_node("ReduceMax", ["old.total"], ["old.max"], keepdims=0),
                helper.make_node("Cast", ["old.max"], ["total_sequence_length"], to=TensorProto.INT32)]
    nodes = computed + list(g.node)
    del g.node[:]
    g.node.extend(nodes)
    onnx.save(model, str(art / spec.file))  # the weights stay in the data file beside it
    manifest = json.loads((art / "manifest.json").read_text())
    for graph in manifest["graphs"]:
        graph["inputs"] = [t for t in graph["inputs"] if t["role"] != "total_sequence_length"]
    (art / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("which", ["llama_ort", "lfm2_ort"])
def test_cpu_runtime_feeds_it_and_older_graphs_still_run(request, which, artifact_copy):
    """The CPU runtime's host-computed value gives exactly the logits the graph's own
    computation gave (prefill of unequal prompts, then decode as rows stop), and an artifact
    without the input runs, fed nothing."""
    case = request.getfixturevalue(which)
    old = artifact_copy(case)
    _older_artifact(case, old)
    older = Engine.load(old, check_files=False)
    assert not [t for t in older.decoder.spec.inputs if t.role == "total_sequence_length"]
    prompts = case.prompts((11, 3, 6), salt=61)
    cfg = GenerationConfig(max_new_tokens=8, do_sample=False, output_logits=True, stop_token_ids=())
    want, got = older.generate(prompts, cfg), case.engine.generate(prompts, cfg)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_array_equal(g.logits, w.logits)
    for w, g in zip(older.prompt_logits(prompts), case.engine.prompt_logits(prompts)):
        np.testing.assert_array_equal(g, w)


def test_total_sequence_length_of_a_step():
    from graphkiln.runtime.backends.ort_cpu import total_sequence_length

    for starts, lengths, want in [([0, 0], [5, 3], 5), ([7, 2, 9], [1, 1, 1], 10), ([0], [1], 1), ([4, 0], [2, 6], 6)]:
        pos = np.array(starts, np.int64)[:, None] + np.arange(3)
        got = total_sequence_length(pos, np.array(lengths, np.int64))
        assert got.dtype == np.int32 and got.shape == () and int(got) == want


def test_one_token_prompts_on_the_decode_graph(llama_ort):
    """A batch of one-token prompts plans like decode (one token, one logit per row), so it runs
    on a bucket's binding, whose total_sequence_length is the buffers' capacity, not the step's
    1 (capture_total_sequence_length): GroupQueryAttention then takes its decode path with an
    empty past, which must give the prompt path's logits."""
    engine = _host_engine(llama_ort, 4)
    prompts = [[5], [9], [17]]
    cfg = GenerationConfig(max_new_tokens=6, do_sample=False, output_logits=True, stop_token_ids=())
    want, got = llama_ort.engine.generate(prompts, cfg), engine.generate(prompts, cfg)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids
        np.testing.assert_allclose(g.logits, w.logits, rtol=0, atol=1e-5)
    assert engine.decoder.graphs.cache.stats.replays == 6 - 1  # the prompts' step is bucket 4's first run


def test_older_graph_refusal_says_re_export():
    blockers = Counter({"MemcpyToHost": 1, "ReduceMax": 1})
    old = blockers_refusal("decoder.onnx", blockers, "float16", feeds_total=False)
    assert "\n" not in old and "MemcpyToHost" in old and "re-export the artifact" in old
    assert "re-export the artifact" not in blockers_refusal("decoder.onnx", blockers, "float16", feeds_total=True)


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
