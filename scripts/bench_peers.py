#!/usr/bin/env python
"""Peer benchmark: graphkiln vs onnxruntime-genai, optimum-onnx and transformers on one checkpoint.

One run, one random-init checkpoint per model, the same thread count for every row:

  llama   LlamaForCausalLM, hidden 1024, 16 layers, 16/4 heads, intermediate 2816, vocab 32000,
          untied (~246M; the model of scripts/bench_decode.py)
  qwen3   Qwen3ForCausalLM (dense), same shape, head_dim 64, q/k norm, untied (~246M)
  gpt_oss GptOssForCausalLM, hidden 1024, 12 layers alternating sliding/full attention with sinks,
          8 experts top-2 of intermediate 512 (~248M total)

Rows (each a peer run as it ships, with its own defaults):
  graphkiln fp32           graphkiln export --target onnxruntime (--max-seq-len 1024) +
                           graphkiln.runtime.Engine: the CPU artifact, as the builder's `-e cpu`
  graphkiln int4           same with --quant int4 (symmetric, block 32: the builder's int4 settings);
                           skipped, with the reason printed, when `graphkiln export --help` has no --quant
  graphkiln int4 block 128 same with --quant-block-size 128 (fewer scale bytes per weight)
  graphkiln fp32 portable  graphkiln export --target portable (the TensorRT-parseable graph, custom
                           ops run through their ONNX function bodies) on the same runtime
  onnxruntime-genai fp32   python -m onnxruntime_genai.models.builder -i CKPT -p fp32 -e cpu,
  onnxruntime-genai int4   then og.Model / og.Generator (its default int4: RTN, block 32,
                           accuracy_level 4 on CPU; prefill computes logits for every position)
  optimum-onnx fp32        optimum-cli export onnx --task text-generation-with-past +
                           ORTModelForCausalLM.generate (skipped with --skip-optimum or on failure)
  transformers fp32        AutoModelForCausalLM.generate (the reference for "greedy agree")

Peers are not installed by hand: this script creates its own virtual environments under
--venv-dir (default .bench-venvs/ in the repository root, git-ignored) with `python3 -m venv`:
  ortgenai/  torch==2.13.0 (first, alone: a bare torch pulls a multi-GB CUDA build here), then
             onnxruntime-genai==0.18.0 numpy onnx onnx-ir transformers safetensors (the builder's imports)
  optimum/   torch==2.13.0, then optimum-onnx[onnxruntime]==0.1.0 numpy (needs transformers<4.58,
             hence its own environment)
graphkiln and transformers run from the interpreter that runs this script (the project's .venv).

Figures per row: export/build seconds and peak RSS (one child process per export), artifact
bytes, prefill ms at 128 and 512 prompt tokens (time to the first new token, fresh request),
decode tokens/s over 128 greedy new tokens after a 128-token prompt ((new-1) / (total - time to
first token)), peak RSS of the generation benchmark process (model load included), greedy
tokens agreeing with transformers. Exports run once. Generation runs in --repeats rounds: each
round runs every row once, in a fresh process (load, warm-up, one measured request of each
kind), in alternating order, so a burst of other work lands on different rows in different
rounds; the table shows the median over rounds (and the best decode rate). Every export and
every generation benchmark is its own child process,
started through a tiny wrapper whose resource.getrusage(RUSAGE_CHILDREN) is that child's peak
RSS alone (in one parent, RUSAGE_CHILDREN is the maximum over *all* children so far). The same
wrapper reads /proc/stat around the child, so each row also shows how many CPUs' worth of other
work ran meanwhile ("other work, CPUs"): anything well above 0 means that row's timings are
pessimistic, so rerun on a quiet machine before trusting a comparison.

It also measures this machine's memory bandwidth (numpy sum and max over a 1 GiB array, 1 thread
and --threads threads; before the run, between rounds and after it, the highest counting) and
prints, per row, the weight bytes read per decode token (initializers, with gathered tables --
embeddings, rope caches -- counted as one row) and the GB/s that implies, so each row's distance
from the bandwidth limit shows.

    .venv/bin/python scripts/bench_peers.py [--model llama|qwen3|all] [--threads 2] [--repeats 3]
        [--workdir DIR] [--json out.json] [--skip-optimum] [--venv-dir .bench-venvs] [--paired 8]

--paired N adds N rounds in which graphkiln fp32/int4 and onnxruntime-genai fp32/int4 run back
to back (fresh processes, order alternating) and reports the median of the per-round ratios:
on a VM whose speed drifts by 10-25% within minutes, that is the figure to compare.

--workdir keeps checkpoints and artifacts (and each export's timing in <row>.export.json) so a
later run reuses them; without it everything goes to a temporary directory removed at the end.
Exports take about a minute each; run on a quiet machine: all rows share the same cores.
"""

from __future__ import annotations

# Only the standard library at module level: this file is also run, in hidden modes (_gen,
# _build, _rss), by the interpreters of the peer virtual environments.
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent

PROMPT_LENS = (128, 512)
MAX_SEQ_LEN = 1024  # graphkiln export; 512 + 1 and 128 + 128 fit

MODELS = {
    # (transformers config class, kwargs); llama is scripts/bench_decode.py's "llama"
    "llama": ("LlamaConfig", None),
    "qwen3": ("Qwen3Config", dict(head_dim=64, num_hidden_layers=16, intermediate_size=2816,
                                  tie_word_embeddings=False)),
    # gpt-oss-shaped: 12 layers alternating sliding (128) / full attention with sinks, 8 experts top-2
    # of 512 with biases and the clamped SwiGLU (~248M total)
    "gpt_oss": ("GptOssConfig", dict(head_dim=64, num_hidden_layers=12, intermediate_size=512, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=128, tie_word_embeddings=False,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2)),
}

VENVS = {
    "ortgenai": {
        "first": ["torch==2.13.0"],
        "packages": ["onnxruntime-genai==0.18.0", "numpy", "onnx", "onnx-ir", "transformers", "safetensors"],
        "check": "import onnxruntime_genai, onnx_ir, transformers, torch",
    },
    "optimum": {
        "first": ["torch==2.13.0"],
        "packages": ["optimum-onnx[onnxruntime]==0.1.0", "numpy"],
        "check": "from optimum.onnxruntime import ORTModelForCausalLM",
    },
}

ROWS = [
    # name, runner (which generation loop), venv (None: this interpreter), precision
    ("graphkiln fp32", "graphkiln", None, "fp32"),
    ("graphkiln int4", "graphkiln", None, "int4"),
    ("graphkiln int4 block 128", "graphkiln", None, "int4-b128"),
    ("graphkiln fp32 portable", "graphkiln", None, "fp32-portable"),
    ("onnxruntime-genai fp32", "ortgenai", "ortgenai", "fp32"),
    ("onnxruntime-genai int4", "ortgenai", "ortgenai", "int4"),
    ("optimum-onnx fp32", "optimum", "optimum", "fp32"),
    ("transformers fp32", "transformers", None, "fp32"),
]
REFERENCE = "transformers fp32"
# --paired: graphkiln rows measured back to back with the peer row of the same precision
PAIRS = [("graphkiln fp32", "onnxruntime-genai fp32"), ("graphkiln int4", "onnxruntime-genai int4")]


def log(msg: str) -> None:
    print(f"[bench_peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _tail(text: str, n: int = 6) -> str:
    lines = [l for l in text.replace("\r", "\n").splitlines() if l.strip() and "is ignored" not in l]
    return " | ".join(lines[-n:])[-800:]


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# ---------------------------------------------------------------------------------------------
# hidden modes, run as child processes


def _proc_stat() -> tuple[float, float] | None:
    """(total, busy) CPU seconds since boot, all CPUs, from /proc/stat; None where there is none."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    return sum(v) / hz, (sum(v) - v[3] - v[4]) / hz  # idle + iowait are not busy


def _mode_rss(argv: list[str]) -> int:
    """_rss OUT.json CMD...: run CMD; write its exit status, wall time, peak RSS (bytes), CPU
    seconds, and how many CPUs' worth of *other* work ran meanwhile (contention) to OUT.json."""
    import resource

    out, cmd = argv[0], argv[1:]
    before = _proc_stat()
    t = time.perf_counter()
    rc = subprocess.run(cmd).returncode
    wall = time.perf_counter() - t
    after = _proc_stat()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = ru.ru_utime + ru.ru_stime
    others = None
    if before and after and wall > 0:
        others = max(0.0, (after[1] - before[1]) - cpu) / wall
    Path(out).write_text(json.dumps({"rc": rc, "wall_s": wall, "peak_rss": ru.ru_maxrss * 1024, "cpu_s": cpu,
                                     "others_cpus": others}))
    return rc


def _mode_build(argv: list[str]) -> int:
    """_build MODEL DIR: random-init checkpoint (seed 0) + a small byte-level BPE tokenizer.

    The tokenizer (graphkiln's demo tokenizer, ids 0-2 = <unk> <s> </s>) is there because
    onnxruntime-genai's builder and optimum's exporter load one; every row is fed token ids.
    """
    model, path = argv[0], Path(argv[1])
    import torch
    import transformers
    from graphkiln.demo.run import train_tokenizer

    sys.path.insert(0, str(SCRIPTS))
    from bench_decode import COMMON, MODELS as DECODE_MODELS

    config_name, kwargs = MODELS[model]
    kwargs = dict(DECODE_MODELS["llama"][1]) if kwargs is None else dict(COMMON, **kwargs)
    kwargs.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    cfg = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(0)
    path.mkdir(parents=True, exist_ok=True)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    train_tokenizer(path)
    return 0


class _Clock:
    """A transformers streamer that only records when each put() happens (first = the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _gen_graphkiln(path: str, threads: int):
    from graphkiln.runtime import Engine, GenerationConfig

    engine = Engine.load(path, threads=threads)

    def run(prompt: list[int], new: int):
        cfg = GenerationConfig(max_new_tokens=new, stop_token_ids=(), do_sample=False)
        t0 = time.perf_counter()
        stamps, tokens = [], []
        for ev in engine.stream(prompt, cfg):
            stamps.append(time.perf_counter())
            tokens.append(ev.token_id)
        return stamps[0] - t0, time.perf_counter() - t0, tokens

    return run, {"graphkiln": _version("graphkiln"), "onnxruntime": _version("onnxruntime")}


def _gen_ortgenai(path: str, threads: int):
    import onnxruntime_genai as og

    config = og.Config(path)
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def run(prompt: list[int], new: int):
        t0 = time.perf_counter()
        params = og.GeneratorParams(model)
        # min_length == max_length: EOS is masked, so random weights cannot stop it early.
        params.set_search_options(max_length=len(prompt) + new, min_length=len(prompt) + new,
                                  do_sample=False, batch_size=1)
        gen = og.Generator(model, params)
        gen.append_tokens([prompt])  # runs the prompt through the model
        gen.generate_next_token()  # picks the first token from the prefill logits
        t_first = time.perf_counter() - t0
        tokens = [int(gen.get_next_tokens()[0])]
        while len(tokens) < new:
            gen.generate_next_token()  # one decode step + pick
            tokens.append(int(gen.get_next_tokens()[0]))
        total = time.perf_counter() - t0
        del gen
        return t_first, total, tokens

    return run, {"onnxruntime-genai": og.__version__, "onnxruntime": _version("onnxruntime")}


def _hf_runner(model, torch, threads: int):
    from transformers.generation.streamers import BaseStreamer

    class Clock(_Clock, BaseStreamer):
        pass

    def run(prompt: list[int], new: int):
        ids = torch.tensor([prompt])
        clock = Clock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, streamer=clock)
        total = time.perf_counter() - t0
        return clock.times[1] - t0, total, out[0, len(prompt):].tolist()

    return run


def _gen_transformers(path: str, threads: int):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _hf_runner(model, torch, threads), {"transformers": transformers.__version__, "torch": torch.__version__}


def _gen_optimum(path: str, threads: int):
    import onnxruntime as ort
    import torch
    import transformers
    from optimum.onnxruntime import ORTModelForCausalLM

    torch.set_num_threads(threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    model = ORTModelForCausalLM.from_pretrained(path, session_options=so, provider="CPUExecutionProvider")
    return _hf_runner(model, torch, threads), {"optimum-onnx": _version("optimum-onnx"), "onnxruntime": ort.__version__,
                                               "transformers": transformers.__version__}


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def _mode_gen(argv: list[str]) -> int:
    """_gen SPEC.json: time one row's generation loop; print one JSON line prefixed with @@RESULT."""
    spec = json.loads(Path(argv[0]).read_text())
    threads, new, repeats = spec["threads"], spec["new_tokens"], spec["repeats"]
    prompts = {int(k): v for k, v in spec["prompts"].items()}
    t = time.perf_counter()
    run, versions = globals()["_gen_" + spec["runner"]](spec["path"], threads)
    load_s = time.perf_counter() - t

    short = prompts[min(prompts)]
    run(short, new)  # warm-up at the measured size: first-run allocations, kernel selection, buffers
    run(prompts[max(prompts)], 1)
    prefill = {n: [] for n in prompts}
    decode, tokens = [], None
    for _ in range(repeats):
        for n, p in prompts.items():
            if n != min(prompts):
                prefill[n].append(run(p, 1)[0] * 1000)
        first, total, tokens = run(short, new)
        assert len(tokens) == new, f"generated {len(tokens)} tokens, expected {new}"
        prefill[min(prompts)].append(first * 1000)
        decode.append((new - 1) / (total - first))
    result = {
        "load_s": load_s,
        "prefill_ms": {str(n): statistics.median(v) for n, v in prefill.items()},
        "prefill_ms_runs": {str(n): v for n, v in prefill.items()},
        "decode_tok_s": statistics.median(decode),
        "decode_tok_s_runs": decode,
        "tokens": tokens,
        "versions": versions,
    }
    print("@@RESULT " + json.dumps(result), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# the parent


def run_measured(cmd: list[str], log_path: Path | None = None, env: dict | None = None,
                 timeout: float | None = None) -> tuple[dict, str]:
    """Run cmd as its own child (through the _rss wrapper); return ({rc, wall_s, peak_rss}, output)."""
    with tempfile.TemporaryDirectory() as td:
        out = Path(td) / "rss.json"
        wrapped = [sys.executable, str(Path(__file__).resolve()), "_rss", str(out), *cmd]
        proc = subprocess.run(wrapped, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, timeout=timeout)
        stats = json.loads(out.read_text()) if out.exists() else {"rc": proc.returncode, "wall_s": None, "peak_rss": None}
    if log_path is not None:
        log_path.write_text(proc.stdout)
    return stats, proc.stdout


def child_env(threads: int, offline: bool = True) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")
    if offline:
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return env


def ensure_venv(name: str, root: Path) -> tuple[Path | None, str | None]:
    """Create/install venv `name` under root; return (python, None) or (None, why it failed)."""
    spec = VENVS[name]
    venv = root / name
    py = venv / "bin" / "python"
    stamp = venv / ".bench-peers-installed"
    want = json.dumps({k: spec[k] for k in ("first", "packages")}, sort_keys=True)
    if py.exists() and stamp.exists() and stamp.read_text() == want:
        return py, None
    log(f"setting up {venv} ({' '.join(spec['first'] + spec['packages'])}); takes a few minutes the first time")
    if not py.exists():
        r = subprocess.run(["python3", "-m", "venv", str(venv)], capture_output=True, text=True)
        if r.returncode:
            return None, f"python3 -m venv {venv} failed: {_tail(r.stderr)}"
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    for pkgs in (spec["first"], spec["packages"]):
        r = subprocess.run(pip + pkgs, capture_output=True, text=True)
        if r.returncode:
            return None, f"pip install {' '.join(pkgs)} failed: {_tail(r.stdout + r.stderr)}"
    r = subprocess.run([str(py), "-c", spec["check"]], capture_output=True, text=True)
    if r.returncode:
        return None, f"installed, but `{spec['check']}` failed: {_tail(r.stderr)}"
    stamp.write_text(want)
    return py, None


def busy_cpus(seconds: float = 3.0) -> float:
    """CPUs' worth of non-idle time over a short sample (/proc/stat), i.e. load from other work."""
    a = _proc_stat()
    time.sleep(seconds)
    b = _proc_stat()
    if not a or not b or b[0] <= a[0]:
        return float("nan")
    return (os.cpu_count() or 1) * (b[1] - a[1]) / (b[0] - a[0])


def measure_bandwidth(threads: int) -> dict:
    """Read bandwidth over a 1 GiB float32 array, best of 5, with 1 thread and with `threads`.

    Two numpy reductions: sum (pairwise summation, partly compute-bound on one core) and max
    (lighter; usually nearer the memory limit). The higher figure is taken as the limit.
    """
    import numpy as np
    from concurrent.futures import ThreadPoolExecutor

    a = np.ones(1 << 28, np.float32)  # 1 GiB, pages touched
    a.sum()
    out = {}
    for kernel in ("sum", "max"):
        fn = getattr(np, kernel)
        for n in sorted({1, threads}):
            parts = np.array_split(a, n)
            best = float("inf")
            with ThreadPoolExecutor(n) as pool:
                for _ in range(5):
                    t = time.perf_counter()
                    list(pool.map(fn, parts))  # ufunc reductions release the GIL
                    best = min(best, time.perf_counter() - t)
            out[f"{kernel}_{n}_thread_gb_s"] = a.nbytes / best / 1e9
    for n in sorted({1, threads}):
        out[f"{n}_thread_gb_s"] = max(out[f"sum_{n}_thread_gb_s"], out[f"max_{n}_thread_gb_s"])
    del a
    return out


def onnx_weight_bytes(model_path: Path) -> dict:
    """Initializer bytes of an ONNX graph: total, and read per decode token.

    Tables only ever indexed by Gather-like ops (embeddings, rope caches) are counted as one
    row per token; everything else (MatMul / MatMulNBits weights, scales, norms) in full.
    """
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(model_path), load_external_data=False)
    bits = {TensorProto.INT4: 4, TensorProto.UINT4: 4}
    if hasattr(TensorProto, "FLOAT4E2M1"):
        bits[TensorProto.FLOAT4E2M1] = 4

    def nbytes(t) -> int:
        if t.data_location == TensorProto.EXTERNAL:
            ext = {e.key: e.value for e in t.external_data}
            if "length" in ext:
                return int(ext["length"])
        if t.raw_data:
            return len(t.raw_data)
        n = 1
        for d in t.dims:
            n *= d
        if t.data_type in bits:
            return (n * bits[t.data_type] + 7) // 8
        return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize

    consumers: dict[str, set[str]] = {}
    gather_data: set[str] = set()

    def walk(graph):
        for node in graph.node:
            for i, name in enumerate(node.input):
                consumers.setdefault(name, set()).add(node.op_type)
                if node.op_type in ("Gather", "GatherBlockQuantized") and i != 1:
                    gather_data.add(name)  # data (and, quantized, its scales / zero points)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    total = per_token = 0
    for t in model.graph.initializer:
        b = nbytes(t)
        total += b
        only_gathered = t.name in gather_data and consumers.get(t.name, set()) <= {"Gather", "GatherBlockQuantized"}
        per_token += b // max(t.dims[0], 1) if only_gathered and t.dims else b
    return {"initializer_bytes": total, "bytes_per_token": per_token}


def safetensors_weight_bytes(ckpt: Path) -> dict:
    """Checkpoint tensor bytes: total, and read per decode token (embedding table as one row)."""
    import struct

    total = per_token = 0
    for f in ckpt.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b = info["data_offsets"][1] - info["data_offsets"][0]
            total += b
            per_token += b // info["shape"][0] if name.endswith("embed_tokens.weight") else b
    return {"initializer_bytes": total, "bytes_per_token": per_token}


def graphkiln_has_quant() -> tuple[bool, str]:
    r = subprocess.run([sys.executable, "-m", "graphkiln.cli", "export", "--help"], capture_output=True, text=True)
    if r.returncode:
        return False, f"`graphkiln export --help` failed: {_tail(r.stderr)}"
    if "--quant" not in r.stdout:
        return False, "this graphkiln's `export --help` has no --quant option (int4 export not built yet)"
    if "int4" not in r.stdout:
        return False, "`graphkiln export --quant` offers no int4"
    return True, ""


def export_row(name: str, runner: str, precision: str, py: Path | None, ckpt: Path, out: Path,
               args, work: Path) -> dict:
    """Export/build one row's artifact (unless already there); return its export figures."""
    record = out.parent / f"{out.name}.export.json"
    done = {"graphkiln": out / "manifest.json", "ortgenai": out / "genai_config.json",
            "optimum": out / "model.onnx"}[runner]
    if done.exists():
        prior = json.loads(record.read_text()) if record.exists() else {}
        return dict(prior, reused=True)
    env = child_env(args.threads)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    if runner == "graphkiln":
        cmd = [sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(out),
               "--max-seq-len", str(MAX_SEQ_LEN), "--overwrite"]
        # the CPU artifacts, as onnxruntime-genai's `-e cpu`: --target onnxruntime (GroupQueryAttention
        # with the cache in place, fused MatMuls); the portable row shows what that lowering buys
        cmd += ["--target", "portable" if precision == "fp32-portable" else "onnxruntime"]
        if precision.startswith("int4"):
            cmd += ["--quant", "int4"] + (["--quant-block-size", "128"] if precision == "int4-b128" else [])
    elif runner == "ortgenai":
        cache = work / f"{out.name}.cache"
        cmd = [str(py), "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(tmp),
               "-p", precision, "-e", "cpu", "-c", str(cache)]
    elif runner == "optimum":
        cmd = [str(py), "-m", "optimum.commands.optimum_cli", "export", "onnx", "--model", str(ckpt),
               "--task", "text-generation-with-past", "--framework", "pt", str(tmp)]
    else:
        raise ValueError(runner)
    log(f"{name}: exporting -> {out}")
    stats, output = run_measured(cmd, out.parent / f"{out.name}.export.log", env)
    if runner == "ortgenai":
        shutil.rmtree(work / f"{out.name}.cache", ignore_errors=True)
    if stats["rc"] != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"export failed (exit {stats['rc']}): {_tail(output)}")
    if runner != "graphkiln":
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    result = {"export_s": stats["wall_s"], "export_peak_rss": stats["peak_rss"],
              "export_others_cpus": stats.get("others_cpus")}
    record.write_text(json.dumps(result))
    return dict(result, reused=False)


def bench_row(runner: str, py: Path | None, path: Path, prompts: dict, args, tmp: Path, tag: str) -> dict:
    spec = tmp / f"{tag}.json"
    spec.write_text(json.dumps({"runner": runner, "path": str(path), "threads": args.threads,
                                "new_tokens": args.new_tokens, "repeats": 1,
                                "prompts": {str(n): p for n, p in prompts.items()}}))
    cmd = [str(py or sys.executable), str(Path(__file__).resolve()), "_gen", str(spec)]
    stats, output = run_measured(cmd, tmp / f"{tag}.log", child_env(args.threads), timeout=args.row_timeout)
    lines = [l for l in output.splitlines() if l.startswith("@@RESULT ")]
    if stats["rc"] != 0 or not lines:
        raise RuntimeError(f"generation benchmark failed (exit {stats['rc']}): {_tail(output)}")
    return dict(json.loads(lines[-1][len("@@RESULT "):]), gen_peak_rss=stats["peak_rss"], gen_wall_s=stats["wall_s"],
                gen_cpu_s=stats.get("cpu_s"), others_cpus=stats.get("others_cpus"))


def run_model(model: str, args, work: Path, pythons: dict, venv_errors: dict, quant: tuple[bool, str],
              bw_samples: list) -> dict:
    import numpy as np

    mdir = work / model
    mdir.mkdir(parents=True, exist_ok=True)
    ckpt = mdir / "checkpoint"
    if not (ckpt / "tokenizer.json").exists():
        log(f"{model}: building the random-init checkpoint")
        shutil.rmtree(ckpt, ignore_errors=True)
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "_build", model, str(ckpt)], check=True,
                       env=child_env(args.threads))
    rng_ids = np.random.default_rng(0).integers(3, 32000, max(PROMPT_LENS)).tolist()
    prompts = {n: rng_ids[:n] for n in PROMPT_LENS}
    ckpt_weights = safetensors_weight_bytes(ckpt)
    rows, live = [], []  # live: (row, runner, python, path) still to be benchmarked
    for name, runner, venv, precision in ROWS:
        row = {"row": name, "status": "ok"}
        rows.append(row)
        why = None
        if venv == "optimum" and args.skip_optimum:
            why = "--skip-optimum"
        elif venv is not None and venv_errors.get(venv):
            why = f"environment {venv} unavailable: {venv_errors[venv]}"
        elif name.startswith("graphkiln int4") and not quant[0]:
            why = quant[1]
        if why:
            row.update(status="skipped", reason=why)
            log(f"{model} / {name}: skipped: {why}")
            continue
        py = pythons.get(venv)
        try:
            if runner == "transformers":
                path = ckpt
                row.update(export_s=None, export_peak_rss=None, artifact_bytes=_dir_bytes(ckpt))
                row.update(ckpt_weights)
            else:
                path = mdir / name.replace(" ", "-")
                row.update(export_row(name, runner, precision, py, ckpt, path, args, mdir))
                row["artifact_bytes"] = _dir_bytes(path)
                graph = next(p for p in (path / "decoder.onnx", path / "model.onnx") if p.exists())
                row.update(onnx_weight_bytes(graph))
            live.append((row, runner, py, path))
        except Exception as e:  # one failing peer must not sink the others
            row.update(status="failed", reason=f"{type(e).__name__}: {e}")
            log(f"{model} / {name}: FAILED: {row['reason']}")

    # Generation benchmarks in rounds: each round runs every row once (a fresh process: load,
    # warm-up, one measured repeat), alternating the order, so a burst of other work on a shared
    # machine lands on different rows in different rounds and the median across rounds absorbs it.
    rounds: dict[str, list[dict]] = {row["row"]: [] for row, *_ in live}
    tmp = Path(tempfile.mkdtemp(prefix="gk-peers-run-"))
    try:
        for k in range(args.repeats):
            for row, runner, py, path in (live if k % 2 == 0 else live[::-1]):
                if row["status"] != "ok":
                    continue
                log(f"{model} / {row['row']}: generation benchmark, round {k + 1}/{args.repeats}")
                try:
                    rounds[row["row"]].append(bench_row(runner, py, path, prompts, args, tmp,
                                                        f"{model}-{row['row'].replace(' ', '-')}-{k}"))
                except Exception as e:
                    row.update(status="failed", reason=f"{type(e).__name__}: {e}")
                    log(f"{model} / {row['row']}: FAILED: {row['reason']}")
            bw_samples.append(measure_bandwidth(args.threads))  # between rounds: a chance at a quiet moment
        if args.paired:
            run_pairs(model, live, {PROMPT_LENS[0]: prompts[PROMPT_LENS[0]]}, args, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for row, *_ in live:
        runs = rounds[row["row"]]
        if row["status"] != "ok":
            continue
        prefill_runs = {n: [x for r in runs for x in r["prefill_ms_runs"][n]] for n in runs[0]["prefill_ms_runs"]}
        decode_runs = [x for r in runs for x in r["decode_tok_s_runs"]]
        others = [r["others_cpus"] for r in runs if r.get("others_cpus") is not None]
        row.update(
            prefill_ms={n: statistics.median(v) for n, v in prefill_runs.items()}, prefill_ms_runs=prefill_runs,
            decode_tok_s=statistics.median(decode_runs), decode_tok_s_runs=decode_runs,
            load_s=statistics.median(r["load_s"] for r in runs),
            gen_peak_rss=max(r["gen_peak_rss"] for r in runs),
            others_cpus=statistics.mean(others) if others else None, others_cpus_runs=others,
            tokens=runs[-1]["tokens"], deterministic=all(r["tokens"] == runs[-1]["tokens"] for r in runs),
            versions=runs[-1]["versions"],
        )
    ref = next((r for r in rows if r["row"] == REFERENCE and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and ref is not None:
            a, b = r["tokens"], ref["tokens"]
            r["agree"] = sum(x == y for x, y in zip(a, b))
            r["first_divergence"] = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return {"model": model, "checkpoint_bytes": _dir_bytes(ckpt), "rows": rows}


def run_pairs(model: str, live: list, prompts: dict, args, tmp: Path) -> None:
    """--paired N: N more rounds of each PAIRS entry alone, graphkiln and the peer in fresh
    processes back to back (order alternating), stored as per-round ratios on the graphkiln
    row. On a machine whose speed drifts within minutes, the ratio of two runs seconds apart
    varies far less than the ratio of medians taken across a whole round of rows."""
    by_name = {row["row"]: (row, runner, py, path) for row, runner, py, path in live}
    for ours, peer in PAIRS:
        if ours not in by_name or peer not in by_name:
            continue
        pair = [by_name[ours], by_name[peer]]
        decode, prefill = [], []
        for k in range(args.paired):
            got = {}
            for row, runner, py, path in (pair if k % 2 == 0 else pair[::-1]):
                log(f"{model} / {row['row']}: paired round {k + 1}/{args.paired}")
                try:
                    got[row["row"]] = bench_row(runner, py, path, prompts, args, tmp,
                                                f"{model}-{row['row'].replace(' ', '-')}-pair-{k}")
                except Exception as e:
                    log(f"{model} / {row['row']}: paired round FAILED: {type(e).__name__}: {e}")
            if len(got) == 2:
                a, b = got[ours], got[peer]
                decode.append(a["decode_tok_s"] / b["decode_tok_s"])
                n = str(min(prompts))
                prefill.append(a["prefill_ms"][n] / b["prefill_ms"][n])
        if decode:
            by_name[ours][0]["paired"] = {"vs": peer, "decode_ratios": decode, "prefill_ratios": prefill,
                                          "prefill_tokens": min(prompts)}


def _gb(x) -> str:
    return "—" if x is None else f"{x / 1e9:.2f}"


def _num(x, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def report(results: list[dict], machine: dict, args) -> None:
    bw = machine["bandwidth"]
    print(f"\n{args.threads} threads, prompts {'/'.join(map(str, PROMPT_LENS))} tokens, {args.new_tokens} greedy new "
          f"tokens after the 128-token prompt, median of {args.repeats} interleaved rounds (exports: one run). "
          f"Load average at start / end: {machine['loadavg_start']} / {machine['loadavg_end']}; CPUs kept busy by "
          f"other processes (3 s sample) before / after: {machine['others_busy_cpus_start']:.1f} / "
          f"{machine['others_busy_cpus_end']:.1f} of {machine['cpus']}.\n")
    print("| model | runtime | export s | export peak RSS GB | artifact GB | prefill 128 ms | prefill 512 ms "
          "| decode tok/s median (best) | vs transformers | gen peak RSS GB | greedy tokens = transformers "
          "| other work, CPUs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for res in results:
        ref = next((r for r in res["rows"] if r["row"] == REFERENCE and r["status"] == "ok"), None)
        for r in res["rows"]:
            if r["status"] != "ok":
                print(f"| {res['model']} | {r['row']} | {r['status']}: {r['reason'][:120]} ||||||||||")
                continue
            exp = _num(r.get("export_s"), ".1f") + (" (reused)" if r.get("reused") and r.get("export_s") else "")
            if r.get("reused") and r.get("export_s") is None:
                exp = "reused"
            speed = f"{r['decode_tok_s'] / ref['decode_tok_s']:.2f}x" if ref else "—"
            agree = "—"
            if "agree" in r:
                lead = r["first_divergence"] if r["first_divergence"] is not None else len(r["tokens"])
                agree = f"{r['agree']}/{len(r['tokens'])} (first {lead} same)"
            print(f"| {res['model']} | {r['row']} | {exp} | {_gb(r.get('export_peak_rss'))} | {_gb(r['artifact_bytes'])} "
                  f"| {r['prefill_ms']['128']:.0f} | {r['prefill_ms']['512']:.0f} "
                  f"| {r['decode_tok_s']:.1f} ({max(r['decode_tok_s_runs']):.1f}) | {speed} "
                  f"| {_gb(r['gen_peak_rss'])} | {agree} | {_num(r.get('others_cpus'), '.2f')} |")
    contended = [f"{res['model']} / {r['row']} ({r['others_cpus']:.2f})" for res in results for r in res["rows"]
                 if r["status"] == "ok" and (r.get("others_cpus") or 0) > 0.1]
    if contended:
        print(f"\nNote: other work shared the {machine['cpus']} CPUs during: {', '.join(contended)}. Those rows' timings "
              "are pessimistic; rerun (with --workdir to reuse the exports) on a quiet machine before comparing them.")
    n = args.threads
    limit = bw.get(f"{n}_thread_gb_s")
    print(f"\nMemory bandwidth, numpy reductions over 1 GiB, best of 5, highest of {len(machine['bandwidth_samples'])} "
          f"samples (before, between rounds, after): sum {bw['sum_1_thread_gb_s']:.1f} GB/s on 1 thread, "
          f"{bw[f'sum_{n}_thread_gb_s']:.1f} GB/s on {n}; max {bw['max_1_thread_gb_s']:.1f} / {bw[f'max_{n}_thread_gb_s']:.1f} GB/s. "
          f"Limit taken as {limit:.1f} GB/s ({n} threads, the higher of the two).\n")
    print(f"| model | runtime | weights read per decode token GB | implied GB/s | of the {n}-thread bandwidth |")
    print("|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            if r["status"] != "ok":
                continue
            gbs = r["bytes_per_token"] * r["decode_tok_s"] / 1e9
            r["implied_gb_s"] = gbs
            print(f"| {res['model']} | {r['row']} | {r['bytes_per_token'] / 1e9:.3f} | {gbs:.1f} | {gbs / limit:.0%} |")
    print("\nOther work, CPUs: CPU time of every other process on the machine while this row's generation "
          f"benchmarks ran, divided by their wall time, mean over rounds (0 = quiet; {machine['cpus']} = every core taken by something else).")
    print("Greedy agreement: random weights give near-flat logits, so int4 rounding flips argmaxes early; "
          "fp32 rows should match all tokens.")
    print("Weights per token: every initializer, except tables only indexed by Gather (embeddings, rope "
          "caches), counted as one row; KV-cache reads (~2-4 MB/token here) not included.")
    paired = [(res["model"], r) for res in results for r in res["rows"] if r.get("paired")]
    if paired:
        print(f"\nPaired rounds (--paired {args.paired}): each round runs the two rows back to back in fresh "
              "processes; median of the per-round ratios (range).\n")
        print("| model | graphkiln row | vs | decode tok/s ratio | prefill time ratio |")
        print("|---|---|---|---|---|")
        for model, r in paired:
            d, f = r["paired"]["decode_ratios"], r["paired"]["prefill_ratios"]
            print(f"| {model} | {r['row']} | {r['paired']['vs']} | {statistics.median(d):.2f}x "
                  f"({min(d):.2f}–{max(d):.2f}, n={len(d)}) | {statistics.median(f):.2f}x ({min(f):.2f}–{max(f):.2f}) |")
    skipped = [(res["model"], r) for res in results for r in res["rows"] if r["status"] != "ok"]
    if skipped:
        print()
        for model, r in skipped:
            print(f"{model} / {r['row']}: {r['status']}: {r['reason']}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("_rss", "_build", "_gen"):
        return {"_rss": _mode_rss, "_build": _mode_build, "_gen": _mode_gen}[sys.argv[1]](sys.argv[2:])

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=[*MODELS, "all"], default="all")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="rounds of generation benchmarks; the median is shown")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--workdir", default=None, help="keep and reuse checkpoints/artifacts here (default: a temporary "
                                                  "directory, removed at the end)")
    p.add_argument("--venv-dir", default=str(REPO / ".bench-venvs"), help="where the peers' virtual environments live")
    p.add_argument("--skip-optimum", action="store_true", help="no optimum-onnx row (and no optimum environment)")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="then N rounds of graphkiln vs onnxruntime-genai (fp32, int4) back to back; per-round ratios")
    p.add_argument("--row-timeout", type=float, default=1800, help="seconds before one generation benchmark is given up")
    p.add_argument("--json", default=None, help="write every figure (and per-run timings, versions) here")
    args = p.parse_args()

    machine = {"loadavg_start": " ".join(f"{x:.2f}" for x in os.getloadavg()), "cpus": os.cpu_count(),
               "platform": platform.platform(), "python": platform.python_version()}
    venv_root = Path(args.venv_dir)
    venv_root.mkdir(parents=True, exist_ok=True)
    pythons: dict = {None: None}
    venv_errors: dict = {}
    for name in VENVS:
        if name == "optimum" and args.skip_optimum:
            continue
        py, err = ensure_venv(name, venv_root)
        pythons[name] = py
        if err:
            venv_errors[name] = err
            log(f"environment {name}: {err}")
    quant = graphkiln_has_quant()
    machine["others_busy_cpus_start"] = busy_cpus()

    log("measuring memory bandwidth")
    bw_samples = [measure_bandwidth(args.threads)]

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="gk-peers-"))
    work.mkdir(parents=True, exist_ok=True)
    log(f"work directory: {work}")
    try:
        results = [run_model(m, args, work, pythons, venv_errors, quant, bw_samples)
                   for m in (MODELS if args.model == "all" else [args.model])]
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    machine["loadavg_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    machine["others_busy_cpus_end"] = busy_cpus()
    # Measured before, between rounds and after; the highest of each figure counts (other work
    # only lowers it).
    bw_samples.append(measure_bandwidth(args.threads))
    machine["bandwidth_samples"] = bw_samples
    machine["bandwidth"] = {k: max(b[k] for b in bw_samples) for k in bw_samples[0]}
    report(results, machine, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "threads": args.threads, "repeats": args.repeats,
                                               "new_tokens": args.new_tokens, "prompt_lens": PROMPT_LENS,
                                               "models": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
