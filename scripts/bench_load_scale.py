"""The CPU runtime at a real model's size: load memory and time, prefill, decode against the
memory-bandwidth bound (not a test).

    .venv/bin/python scripts/bench_load_scale.py ARTIFACT [--threads 2] [--prompt-tokens 128]
        [--new-tokens 16] [--repeats 3] [--no-check-files] [--json OUT] [--profile OUT.json]

``Engine.load`` runs in a fresh child process (nothing else loaded there, so its RSS is the
engine's): load time (sha256 of every file included unless ``--no-check-files``), RSS after
load (VmRSS, split into anonymous and file-backed pages), the peak (VmHWM) after load and at
the end, and the peaks of the anonymous and of the file-backed pages during the load, apart
(sampled every 20 ms by a thread: file-backed pages are the artifact's, which the kernel can
reclaim; anonymous ones are what the OOM killer counts); the artifact's bytes (every file in the
directory) and RSS / bytes; then one warm-up
request and ``--repeats`` measured ones, each a fresh random ``--prompt-tokens`` prompt
(prefill: time to the first token) and ``--new-tokens`` greedy tokens (decode tok/s over the
tokens after the first). The prefix cache is on, as ``Engine.load`` leaves it; the prompts
share no prefix.

``--profile OUT.json``: afterwards, onnxruntime's profiler on the decoder session (every session
this process builds is made with profiling on) over one more request of a 4-token prompt and
``--new-tokens`` tokens; the decode steps' node events (sequence length 1) are summed by op type
and, for MatMulNBits, by its N x K, into OUT.json and printed (share of the steps' node time).

Bandwidth, in this process (before the child starts and after it ends, so the child's RSS is
its own; the higher reading is kept, the machine is shared): a copy of a 1 GiB float32 array
into another with ``--threads`` threads (``np.copyto`` on contiguous halves; bytes read + bytes
written over the time, as STREAM counts a copy), and a read-only pass (``np.max`` over the
halves). Weight bytes per decode token are the initializer bytes of the graphs the engine runs
(its decoder graph, or every pipeline stage's), except that tables only ever gathered (the
embedding, through a Reshape or not) count one row; the bound is bandwidth / bytes per token and
decode is reported as a share of it, for both probes. The graphs are read with ``onnx`` (the
export extra) without their external data.

What a quantized artifact's figures come from (onnxruntime 1.32, int4 block 32, fp32 scales):
MatMulNBits pre-packs its weights at load into 1.2x their bytes in the artifact (the blocks, the
scales and an fp32 block sum per block; measured on a graph of MatMulNBits alone), so the packed
copies alone are 1.0-1.1x a whole Llama artifact (whose embedding, gathered, is not packed), and
decode streams those 1.2x bytes, not the artifact's: decode at the full bandwidth would be ~83%
of the bound computed here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


# -- child: the engine ---------------------------------------------------------------------

def _status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process in bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _child(argv: list[str]) -> int:
    artifact, threads, prompt_tokens, new_tokens, repeats, check_files = (
        argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4]), argv[5] == "1")
    sys.path.insert(0, str(REPO))
    profile = argv[6] if len(argv) > 6 else ""
    before_import = _status()
    if profile:
        import onnxruntime as ort

        class ProfiledOptions(ort.SessionOptions):  # bench only: every session made here profiles
            def __init__(self) -> None:
                super().__init__()
                self.enable_profiling = True
                self.profile_file_prefix = profile

        ort.SessionOptions = ProfiledOptions
    from graphkiln.runtime import Engine, GenerationConfig

    imported = _status()
    import threading

    peaks = {"RssAnon": 0, "RssFile": 0}
    loading = threading.Event()

    def sample() -> None:
        while not loading.wait(0.02):
            now = _status()
            for key in peaks:
                peaks[key] = max(peaks[key], now[key])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.perf_counter()
    engine = Engine.load(artifact, threads=threads, check_files=check_files)
    load_s = time.perf_counter() - t
    loading.set()
    sampler.join()
    loaded = _status()
    vocab = engine.manifest.model.vocab_size
    runners = getattr(engine.decoder, "runners", [engine.decoder])  # pipeline stages, or the one graph
    graph_files = [r.spec.file for r in runners]
    rng = np.random.default_rng(0)

    def request(n_prompt: int, n_new: int) -> tuple[float, float, int]:
        prompt = rng.integers(3, vocab, n_prompt).tolist()
        config = GenerationConfig(max_new_tokens=n_new, stop_token_ids=(), do_sample=False)
        t0 = time.perf_counter()
        stamps = [time.perf_counter() for _ in engine.stream(prompt, config)]
        decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
        return stamps[0] - t0, decode, len(stamps)

    request(min(prompt_tokens, 16), min(new_tokens, 4))  # warm-up: first-run allocations, page faults
    runs = [request(prompt_tokens, new_tokens) for _ in range(repeats)]
    end = _status()
    profile_file = ""
    if profile:
        request(4, new_tokens)
        # end_profiling writes the file (opened when the session was made) and returns its name
        made = [Path(r.session.end_profiling()) for r in runners]
        profile_file = str(max(made, key=lambda p: p.stat().st_size).resolve()) if made else ""
    result = {
        "load_s": load_s, "check_files": check_files, "graph_files": graph_files,
        "rss_before_import": before_import["VmRSS"], "rss_after_import": imported["VmRSS"],
        "rss_after_load": loaded["VmRSS"], "anon_after_load": loaded["RssAnon"], "file_after_load": loaded["RssFile"],
        "peak_after_load": loaded["VmHWM"], "rss_end": end["VmRSS"], "peak_end": end["VmHWM"],
        "anon_peak_during_load": peaks["RssAnon"], "file_peak_during_load": peaks["RssFile"], "profile_file": profile_file,
        "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "prefill_s": [r[0] for r in runs], "decode_tok_s": [r[1] for r in runs], "tokens": [r[2] for r in runs],
    }
    print("@@RESULT " + json.dumps(result), flush=True)
    return 0


# -- parent: bandwidth, bytes per token, the report ------------------------------------------

def measure_bandwidth(threads: int, gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """Copy and read bandwidth (GB/s, best of ``repeats``) over a ``gib`` GiB float32 array with
    ``threads`` threads; numpy's copy and reductions release the GIL."""
    src = np.ones(int(gib * 2**30) // 4, np.float32)  # pages touched
    dst = np.zeros_like(src)
    dst += 1  # touch the destination too: a first write's page faults are not bandwidth
    src_parts, dst_parts = np.array_split(src, threads), np.array_split(dst, threads)
    out = {}
    with ThreadPoolExecutor(threads) as pool:
        for name, fn, moved in (("copy", lambda i: np.copyto(dst_parts[i], src_parts[i]), 2 * src.nbytes),
                                ("read", lambda i: src_parts[i].max(), src.nbytes)):
            best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                list(pool.map(fn, range(threads)))
                best = min(best, time.perf_counter() - t)
            out[f"{name}_gb_s"] = moved / best / 1e9
    return out


def weight_bytes(graph: Path) -> dict[str, int]:
    """Initializer bytes of the ONNX graph ``graph``: in total, and read per decode token (tables
    only ever gathered count one row: their data, scales and zero points, directly or through
    Reshape nodes, feed nothing but Gather / GatherBlockQuantized's data side)."""
    import onnx
    from onnx import TensorProto

    model = onnx.load(str(graph), load_external_data=False)
    four_bit = {TensorProto.INT4, TensorProto.UINT4}

    def nbytes(t) -> int:
        ext = {e.key: e.value for e in t.external_data}
        if t.data_location == TensorProto.EXTERNAL and "length" in ext:
            return int(ext["length"])
        if t.raw_data:
            return len(t.raw_data)
        n = int(np.prod(t.dims)) if t.dims else 1
        return (n + 1) // 2 if t.data_type in four_bit else n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize

    consumers: dict[str, list[tuple[str, int, list[str]]]] = {}

    def walk(g) -> None:
        for node in g.node:
            for i, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node.op_type, i, list(node.output)))
            for attr in node.attribute:
                for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else []) + list(attr.graphs):
                    walk(sub)

    walk(model.graph)

    def gathered(name: str, depth: int = 0) -> bool:
        uses = consumers.get(name, [])
        if not uses or depth > 4:
            return False
        for op, i, outputs in uses:
            if op in ("Gather", "GatherBlockQuantized") and i != 1:
                continue
            if op == "Reshape" and i == 0 and all(gathered(o, depth + 1) for o in outputs):
                continue
            return False
        return True

    total = per_token = 0
    for t in model.graph.initializer:
        b = nbytes(t)
        total += b
        per_token += b // max(t.dims[0], 1) if t.dims and gathered(t.name) else b
    return {"initializer_bytes": total, "bytes_per_token": per_token}


def _busy_cpus(seconds: float = 2.0) -> float:
    """CPUs' worth of non-idle time over a short sample (/proc/stat): other work on the machine."""
    def sample():
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]
    a = sample()
    time.sleep(seconds)
    b = sample()
    return (os.cpu_count() or 1) * (1 - (b[1] - a[1]) / max(1, b[0] - a[0]))


def decode_profile(path: Path, steps: int) -> dict:
    """onnxruntime's profile ``path`` (chrome trace JSON): the node events of its last ``steps``
    runs (``model_run``), summed by op type and, for MatMulNBits, by its weight's N x K."""
    events = json.loads(path.read_text())
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "model_run")[-steps:]
    by_op: dict[str, float] = {}
    by_matmul: dict[str, float] = {}
    total = 0.0
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        if not any(a <= e["ts"] <= b for a, b in runs):
            continue
        args = e.get("args", {})
        op = args.get("op_name", "?")
        by_op[op] = by_op.get(op, 0.0) + e["dur"]
        total += e["dur"]
        if op == "MatMulNBits":
            shapes = args.get("input_type_shape", [])
            b = list(shapes[1].values())[0] if len(shapes) > 1 else []
            key = f"B {b}"
            by_matmul[key] = by_matmul.get(key, 0.0) + e["dur"]
    wall = sum(b - a for a, b in runs)
    return {"steps": len(runs), "step_ms": wall / max(len(runs), 1) / 1e3, "node_ms_per_step": total / max(len(runs), 1) / 1e3,
            "by_op_ms_per_step": {k: v / len(runs) / 1e3 for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])},
            "matmulnbits_by_weight_ms_per_step": {k: v / len(runs) / 1e3 for k, v in sorted(by_matmul.items(), key=lambda kv: -kv[1])}}


def _gib(x: float) -> str:
    return f"{x / 2**30:.3f}"


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        return _child(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="measured requests (median reported, best in brackets)")
    ap.add_argument("--no-check-files", action="store_true", help="skip the sha256 of every file at load")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--profile", type=Path, help="onnxruntime profile of one request's decode steps, summed, written here")
    args = ap.parse_args()
    art = args.artifact.resolve()
    manifest = json.loads((art / "manifest.json").read_text())
    artifact_bytes = sum(p.stat().st_size for p in art.rglob("*") if p.is_file())

    others = _busy_cpus()
    bw = [measure_bandwidth(args.threads)]
    cmd = [sys.executable, str(Path(__file__).resolve()), "_child", str(art), str(args.threads), str(args.prompt_tokens),
           str(args.new_tokens), str(args.repeats), "0" if args.no_check_files else "1"]
    if args.profile:
        cmd.append(str(args.profile.resolve().with_suffix("")) + "-ort")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("@@RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-3000:])
        return 1
    child = json.loads(lines[-1][len("@@RESULT "):])
    profile = None
    if args.profile and child.get("profile_file"):
        profile = decode_profile(Path(child["profile_file"]), args.new_tokens - 1)
        args.profile.write_text(json.dumps(profile, indent=2))
        Path(child["profile_file"]).unlink()
    per_graph = [weight_bytes(art / f) for f in child["graph_files"]]  # the graphs the engine runs
    weights = {k: sum(w[k] for w in per_graph) for k in ("initializer_bytes", "bytes_per_token")}
    bw.append(measure_bandwidth(args.threads))
    copy_bw = max(b["copy_gb_s"] for b in bw) * 1e9
    read_bw = max(b["read_gb_s"] for b in bw) * 1e9
    decode = statistics.median(child["decode_tok_s"])
    per_token = weights["bytes_per_token"]
    result = dict(
        artifact=str(art), threads=args.threads, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
        artifact_bytes=artifact_bytes, **weights, others_cpus_before=others, bandwidth_samples=bw,
        copy_bw_gb_s=copy_bw / 1e9, read_bw_gb_s=read_bw / 1e9, **child,
        rss_ratio=child["rss_after_load"] / artifact_bytes, peak_ratio=child["peak_end"] / artifact_bytes,
        prefill_ms=1e3 * statistics.median(child["prefill_s"]), decode_median=decode, decode_best=max(child["decode_tok_s"]),
        bound_copy_tok_s=copy_bw / per_token, bound_read_tok_s=read_bw / per_token,
        of_copy_bound=decode * per_token / copy_bw, of_read_bound=decode * per_token / read_bw,
    )
    r = result
    print(f"artifact {art} ({manifest['model'].get('architecture')}, {manifest['model'].get('quant') or manifest['model'].get('dtype')}), "
          f"{args.threads} threads, other work on the machine before the run: {others:.2f} CPUs\n")
    print("| figure | value |\n|---|---|")
    rows = [
        ("artifact bytes (all files)", f"{_gib(artifact_bytes)} GiB"),
        ("load (Engine.load" + (", sha256 of every file)" if child["check_files"] else ", no sha256)"), f"{r['load_s']:.2f} s"),
        ("RSS after import", f"{_gib(r['rss_after_import'])} GiB"),
        ("RSS after load (anonymous + file-backed)", f"{_gib(r['rss_after_load'])} GiB ({_gib(r['anon_after_load'])} + "
                                                      f"{_gib(r['file_after_load'])})"),
        ("RSS after load / artifact bytes", f"{r['rss_ratio']:.3f}x"),
        ("peak RSS during load", f"{_gib(r['peak_after_load'])} GiB"),
        ("peaks during load: anonymous / file-backed (apart)", f"{_gib(r['anon_peak_during_load'])} / {_gib(r['file_peak_during_load'])} GiB"),
        ("peak RSS at the end / artifact bytes", f"{_gib(r['peak_end'])} GiB, {r['peak_ratio']:.3f}x"),
        (f"prefill {args.prompt_tokens} tokens (median)", f"{r['prefill_ms']:.0f} ms"),
        (f"decode tok/s over {args.new_tokens} tokens, median (best) of {args.repeats}", f"{decode:.2f} ({r['decode_best']:.2f})"),
        ("bandwidth, copy (read + write) / read-only", f"{r['copy_bw_gb_s']:.1f} / {r['read_bw_gb_s']:.1f} GB/s"),
        ("weight bytes per decode token (gathered tables: one row)", f"{per_token / 1e9:.3f} GB"),
        ("bound tok/s, copy / read bandwidth", f"{r['bound_copy_tok_s']:.1f} / {r['bound_read_tok_s']:.1f}"),
        ("decode as a share of the bound, copy / read", f"{100 * r['of_copy_bound']:.0f}% / {100 * r['of_read_bound']:.0f}%"),
    ]
    for name, value in rows:
        print(f"| {name} | {value} |")
    if profile:
        print(f"\nprofile: {profile['steps']} decode steps, {profile['step_ms']:.1f} ms a step, "
              f"{profile['node_ms_per_step']:.1f} ms of it in nodes (ms a step):")
        for op, ms in list(profile["by_op_ms_per_step"].items())[:12]:
            print(f"  {op:32s} {ms:8.2f}  {100 * ms / profile['node_ms_per_step']:5.1f}%")
        for w, ms in list(profile["matmulnbits_by_weight_ms_per_step"].items())[:8]:
            print(f"  MatMulNBits {w:40s} {ms:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
