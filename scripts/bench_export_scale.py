#!/usr/bin/env python
"""Real-size export benchmark (issue 36): graphkiln export beside its peers on real model shapes.

Checkpoints (random bf16 weights, real shapes, written by scripts/scale_checkpoints.py with numpy
alone, ~2 GB shards + index, a small tokenizer with a chat template, generation_config.json):

  1b   Llama-3.2-1B   hidden 2048, 16 layers, 32/8 heads, head_dim 64, intermediate 8192, vocab 128256,
                      tied, llama3 rope scaling                                         1.24B, 2.5 GB
  3b   Llama-3.2-3B   hidden 3072, 28 layers, 24/8 heads, intermediate 8192, tied     3.21B, 6.4 GB
  8b   Llama-3.1-8B   hidden 4096, 32 layers, 32/8 heads, intermediate 14336, untied  8.03B, 16.1 GB
  moe  Qwen3-MoE      hidden 2048, 20 layers, 64 experts top-8 of 768, 32/4 heads, head_dim 128,
                      vocab 151936, untied, per-expert tensors as the Hub stores them   7.04B, 14.1 GB

Rows, per checkpoint (every export its own child process, one at a time):

  graphkiln  fp32 | fp16 | int4 | int8   graphkiln export CKPT -o OUT --max-seq-len 4096
                                         [--dtype fp16] [--quant int4|int8] (int4/int8: the default,
                                         calibrated block search; the default onnxruntime target)
  ortgenai   fp32 | int4 | int8          python -m onnxruntime_genai.models.builder -i CKPT -o OUT
                                         -p PREC -e cpu -c CACHE (0.18; its CPU takes no fp16; int4 is
                                         its default RTN, block 32). venv .bench-venvs/ortgenai, made by
                                         scripts/bench_peers.py's helper.
  edgellm    fp16 | int4                 tensorrt-edgellm-export CKPT OUT [--quantization int4_awq]
                                         (TensorRT Edge-LLM's ONNX exporter, run on CPU; fp16 is its
                                         default and runs whatever --variants says, int4 = its on-the-fly
                                         INT4 RTN of a bf16 checkpoint, when int4 is asked for); venv
                                         .bench-venvs/edgellm: torch==2.13.0 first, then
                                         tensorrt-edgellm[export] (0.11).

Figures per row, measured by a small wrapper process (this file's hidden `_measure` mode) that
runs the command as its child:

  exit       the child's exit status; a signal N shows as 128+N (137 = SIGKILL); "oom" in the note
             when /proc/vmstat's oom_kill counter rose meanwhile (the kernel's OOM killer ran), "guard"
             when the wrapper killed the tree because MemAvailable fell below --min-available-gib
  peak RSS   the larger of getrusage(RUSAGE_CHILDREN).ru_maxrss (the kernel's high-water mark of the
             largest single process of the tree, exact) and the largest sum of RSS over the live
             process tree, sampled every 0.2 s (catches several big processes at once)
  wall s     the child's wall time
  written    bytes the process tree caused to be written to storage: the wrapper's own
             /proc/self/io write_bytes after reaping minus before (the kernel adds a reaped child's
             I/O counters, its own reaped children's included, into its parent's), so it is exact for
             every process reaped inside the tree; files written then deleted (temporaries) count
  artifact   total size of the files left in OUT

A peer's failure is a row like any other: its exit status and last stderr line are in the table.
Disk: before writing a checkpoint the script checks shutil.disk_usage for its size + 1 GiB, and
before each export for 2.2x the checkpoint's weight bytes (an fp32 artifact is 2x a bf16 checkpoint);
a row that does not fit is reported as skipped. Without --keep each artifact is deleted once measured,
and each checkpoint this run wrote once its rows are done (a checkpoint found complete from an earlier
run, with a matching stamp, is reused and left in place; --write-only keeps what it writes).

    .venv/bin/python scripts/bench_export_scale.py --checkpoints 1b --variants fp16,int4 \
        --peers ortgenai,edgellm [--root /tmp/scale] [--json out.json] [--keep] [--write-only]
        [--skip-graphkiln] [--shard-gb 2] [--threads N] [--min-available-gib 1]

Memory: the machine has no swap. Run nothing else heavy meanwhile; --min-available-gib (default 1)
kills an export before the kernel's OOM killer would pick some other process.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent
MAX_SEQ_LEN = 4096
DISK_FACTOR = 2.2  # free disk wanted per checkpoint weight byte before an export
VARIANTS = ("fp32", "fp16", "int4", "int8")
PEER_VARIANTS = {"ortgenai": ("fp32", "int4", "int8"), "edgellm": ("fp16", "int4")}
EDGELLM_VENV = {"first": ["torch==2.13.0"], "packages": ["tensorrt-edgellm[export]"],
                "check": "import tensorrt_edgellm"}


def log(msg: str) -> None:
    print(f"[bench_export_scale {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# the measuring wrapper (hidden mode: _measure OUT.json MIN_AVAILABLE_GIB CMD...)


def _read_kv(path: str) -> dict[str, int]:
    out = {}
    try:
        with open(path) as f:
            for line in f:
                k, _, v = line.partition(":") if ":" in line else line.partition(" ")
                parts = v.split()
                if parts and parts[0].isdigit():
                    out[k.strip()] = int(parts[0])
    except OSError:
        pass
    return out


def _tree_rss(root: int) -> int:
    """Sum of RSS over root and its live descendants (one /proc scan)."""
    page = os.sysconf("SC_PAGE_SIZE")
    children: dict[int, list[int]] = {}
    rss: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            with open(f"/proc/{d}/statm") as f:
                rss[int(d)] = int(f.read().split()[1]) * page
        except (OSError, ValueError, IndexError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(d))
    total, todo = 0, [root]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        todo += children.get(p, [])
    return total


def _kill_tree(root: int) -> None:
    try:
        os.killpg(root, signal.SIGKILL)
    except OSError:
        pass


def _mode_measure(argv: list[str]) -> int:
    import resource

    out, min_avail, cmd = argv[0], float(argv[1]), argv[2:]
    io0 = _read_kv("/proc/self/io").get("write_bytes")
    oom0 = _read_kv("/proc/vmstat").get("oom_kill")
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, start_new_session=True)  # its own process group: the guard kills it all
    tree_peak, guard = 0, None
    while proc.poll() is None:
        tree_peak = max(tree_peak, _tree_rss(proc.pid))
        avail = _read_kv("/proc/meminfo").get("MemAvailable", 1 << 40) * 1024
        if min_avail > 0 and avail < min_avail * 2**30:
            guard = f"killed by the guard: MemAvailable {avail / 2**30:.2f} GiB < {min_avail} GiB"
            _kill_tree(proc.pid)
            proc.wait()
            break
        time.sleep(0.2)
    wall = time.perf_counter() - t
    rc = proc.returncode
    io1 = _read_kv("/proc/self/io").get("write_bytes")
    oom1 = _read_kv("/proc/vmstat").get("oom_kill")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    Path(out).write_text(json.dumps({
        "rc": 128 - rc if rc < 0 else rc, "signal": -rc if rc < 0 else None, "wall_s": wall,
        "maxrss_bytes": ru.ru_maxrss * 1024, "tree_rss_peak_bytes": tree_peak,
        "peak_rss_bytes": max(ru.ru_maxrss * 1024, tree_peak),
        "written_bytes": None if io0 is None or io1 is None else io1 - io0,
        "cpu_s": ru.ru_utime + ru.ru_stime,
        "oom_kills": None if oom0 is None or oom1 is None else oom1 - oom0, "guard": guard}))
    return 0


def measure(cmd: list[str], log_dir: Path, tag: str, env: dict, min_avail: float) -> dict:
    """Run cmd under the wrapper; stdout/stderr to log_dir/tag.{out,err}; return the figures + last lines."""
    fd, stats = tempfile.mkstemp(suffix=".json", prefix="gk-scale-")
    os.close(fd)
    out_log, err_log = log_dir / f"{tag}.out", log_dir / f"{tag}.err"
    try:
        with open(out_log, "wb") as o, open(err_log, "wb") as e:
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "_measure", stats, str(min_avail), *cmd],
                           stdout=o, stderr=e, env=env)
        text = Path(stats).read_text()
        r = json.loads(text) if text else {"rc": None, "note": "the measuring wrapper wrote nothing"}
    finally:
        os.unlink(stats)
    r["last_stderr"] = _last_line(err_log) or _last_line(out_log)
    r["logs"] = [str(out_log), str(err_log)]
    return r


def _last_line(p: Path) -> str:
    try:
        lines = [l.strip() for l in p.read_text(errors="replace").replace("\r", "\n").splitlines() if l.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


# ---------------------------------------------------------------------------------------------
# rows


def child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    return env


def command(tool: str, variant: str, ckpt: Path, out: Path, pythons: dict, work: Path) -> list[str]:
    if tool == "graphkiln":
        cmd = [sys.executable, "-m", "graphkiln.cli", "export", str(ckpt), "-o", str(out),
               "--max-seq-len", str(MAX_SEQ_LEN)]
        if variant == "fp16":
            cmd += ["--dtype", "fp16"]
        elif variant in ("int4", "int8"):
            cmd += ["--quant", variant]
        return cmd
    if tool == "ortgenai":
        return [str(pythons["ortgenai"]), "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
                "-p", variant, "-e", "cpu", "-c", str(work / "ortgenai-cache")]
    if tool == "edgellm":
        cmd = [str(Path(pythons["edgellm"]).parent / "tensorrt-edgellm-export"), str(ckpt), str(out)]
        return cmd + (["--quantization", "int4_awq"] if variant == "int4" else [])
    raise ValueError(tool)


def dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink()) if p.exists() else 0


def setup_peers(peers: list[str], venv_dir: Path) -> tuple[dict, dict]:
    """(python per peer, why a peer's environment is unavailable)."""
    sys.path.insert(0, str(SCRIPTS))
    import bench_peers  # its venv helper; only the standard library at import

    bench_peers.VENVS.setdefault("edgellm", EDGELLM_VENV)
    pythons, errors = {}, {}
    for p in peers:
        py, why = bench_peers.ensure_venv(p, venv_dir)
        if py is None:
            errors[p] = why
        else:
            pythons[p] = py
    return pythons, errors


def rows_for(variants: list[str], peers: list[str], graphkiln: bool = True) -> list[tuple[str, str]]:
    rows = [("graphkiln", v) for v in variants] if graphkiln else []
    for p in peers:
        # edgellm: its default fp16 always (its CPU has no fp32 to compare), int4 when asked
        vs = [v for v in variants if v in PEER_VARIANTS[p] or (p == "edgellm" and v == "fp16")]
        if p == "edgellm" and "fp16" not in vs:
            vs.insert(0, "fp16")
        rows += [(p, v) for v in vs]
    return rows


def run_checkpoint(name: str, args, pythons: dict, peer_errors: dict, results: list) -> None:
    sys.path.insert(0, str(SCRIPTS))
    import scale_checkpoints as sc

    root = Path(args.root)
    ckpt = root / f"ckpt-{name}"
    log(f"{name}: checkpoint {ckpt} ({sc.n_params(sc.CONFIGS[name]) / 1e9:.2f}B params)")
    try:
        w = sc.write_checkpoint(ckpt, sc.CONFIGS[name], args.shard_gb, log=log)
    except OSError as e:
        results.append(dict(checkpoint=name, tool="write", variant="bf16", status="failed", note=str(e)))
        log(f"{name}: {e}")
        return
    verb = "reused" if w.reused else f"written in {w.seconds:.1f} s ({w.bytes / w.seconds / 1e6:.0f} MB/s)"
    log(f"{name}: {w.bytes / 1e9:.2f} GB, {w.shards} shards, {verb}")
    results.append(dict(checkpoint=name, tool="write", variant="bf16", status="ok", rc=0, wall_s=w.seconds,
                        written_bytes=None if w.reused else w.bytes, artifact_bytes=w.bytes, params=w.params,
                        shards=w.shards, reused=w.reused, note="reused" if w.reused else ""))
    weights = w.params * 2
    try:
        if args.write_only:
            return
        logs = root / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for tool, variant in rows_for(args.variants, args.peers, not args.skip_graphkiln):
            row = dict(checkpoint=name, tool=tool, variant=variant)
            results.append(row)
            if tool in peer_errors:
                row.update(status="skipped", note=f"environment unavailable: {peer_errors[tool]}")
                log(f"{name} {tool} {variant}: skipped: {row['note']}")
                continue
            out = root / f"out-{name}-{tool}-{variant}"
            shutil.rmtree(out, ignore_errors=True)
            free = shutil.disk_usage(root).free
            if free < DISK_FACTOR * weights:
                row.update(status="skipped", note=f"disk: {free / 1e9:.1f} GB free, want {DISK_FACTOR * weights / 1e9:.1f}")
                log(f"{name} {tool} {variant}: skipped: {row['note']}")
                continue
            avail = _read_kv("/proc/meminfo").get("MemAvailable", 0) / 2**20
            cmd = command(tool, variant, ckpt, out, pythons, root)
            log(f"{name} {tool} {variant}: {' '.join(cmd)} (MemAvailable {avail:.1f} GiB)")
            m = measure(cmd, logs, f"{name}-{tool}-{variant}", child_env(args.threads), args.min_available_gib)
            shutil.rmtree(root / "ortgenai-cache", ignore_errors=True)
            ok = m.get("rc") == 0
            note = "" if ok else m.get("last_stderr", "")
            if m.get("guard"):
                note = m["guard"] + (f"; {note}" if note else "")
            elif m.get("oom_kills"):
                note = f"OOM-killed ({m['oom_kills']} oom_kill in /proc/vmstat); {note}"
            elif m.get("signal"):
                note = f"killed by signal {m['signal']}" + (f"; {note}" if note else "")
            row.update(m, status="ok" if ok else "failed", note=note, artifact_bytes=dir_bytes(out),
                       mem_available_before_gib=avail, command=cmd)
            log(f"{name} {tool} {variant}: exit {m.get('rc')}, peak RSS {(m.get('peak_rss_bytes') or 0) / 2**30:.2f} GiB, "
                f"{(m.get('wall_s') or 0):.1f} s, wrote {(m.get('written_bytes') or 0) / 1e9:.2f} GB, "
                f"artifact {row['artifact_bytes'] / 1e9:.2f} GB{'; ' + note if note else ''}")
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not args.keep and not args.write_only and not w.reused:
            log(f"{name}: deleting {ckpt}")
            shutil.rmtree(ckpt, ignore_errors=True)


def table(results: list[dict]) -> str:
    def gb(v, unit=1e9):
        return "–" if v is None else f"{v / unit:.2f}"

    lines = ["| checkpoint | tool | variant | exit | peak RSS GiB | wall s | bytes written GB | artifact GB | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rc = r.get("rc")
        exit_ = r["status"] if r["status"] == "skipped" else ("–" if rc is None else str(rc))
        wall = r.get("wall_s")
        lines.append(f"| {r['checkpoint']} | {r['tool']} | {r['variant']} | {exit_} | {gb(r.get('peak_rss_bytes'), 2**30)} "
                     f"| {'–' if wall is None else f'{wall:.1f}'} | {gb(r.get('written_bytes'))} "
                     f"| {gb(r.get('artifact_bytes'))} | {(r.get('note') or '').replace('|', '/')} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_measure":
        return _mode_measure(sys.argv[2:])

    def csv(choices):
        def parse(s: str) -> list[str]:
            items = [] if s in ("", "none") else [x.strip() for x in s.split(",") if x.strip()]
            bad = [x for x in items if x not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {', '.join(bad)}; choose from {', '.join(choices)}")
            return items
        return parse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoints", type=csv(("1b", "3b", "8b", "moe")), default=["1b"],
                   help="comma-separated: 1b,3b,8b,moe (default 1b)")
    p.add_argument("--variants", type=csv(VARIANTS), default=list(VARIANTS),
                   help="graphkiln export variants: fp32,fp16,int4,int8 (default all); peers take those they have")
    p.add_argument("--peers", type=csv(tuple(PEER_VARIANTS)), default=[], help="ortgenai,edgellm or none (default none)")
    p.add_argument("--skip-graphkiln", action="store_true", help="peer rows only (e.g. to rerun a peer)")
    p.add_argument("--root", default="/tmp/scale", help="checkpoints (ckpt-NAME), artifacts and logs (default /tmp/scale)")
    p.add_argument("--json", default=None, help="write every row's figures here")
    p.add_argument("--keep", action="store_true", help="keep artifacts and the checkpoints this run wrote")
    p.add_argument("--write-only", action="store_true", help="only write the checkpoints")
    p.add_argument("--shard-gb", type=float, default=2.0, help="checkpoint shard size (default 2 GB)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="OMP/MKL threads for the exports")
    p.add_argument("--min-available-gib", type=float, default=1.0,
                   help="kill an export when MemAvailable falls below this (0: never; default 1)")
    p.add_argument("--venv-dir", default=str(REPO / ".bench-venvs"), help="the peers' virtual environments")
    args = p.parse_args()

    Path(args.root).mkdir(parents=True, exist_ok=True)
    pythons, peer_errors = ({}, {})
    if args.peers and not args.write_only:
        pythons, peer_errors = setup_peers(args.peers, Path(args.venv_dir))
    results: list[dict] = []
    try:
        for name in args.checkpoints:
            run_checkpoint(name, args, pythons, peer_errors, results)
    finally:
        print(table(results), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"max_seq_len": MAX_SEQ_LEN, "threads": args.threads,
                                                   "rows": results}, indent=2, default=str))
    return 0 if all(r["status"] != "failed" or r["tool"] not in ("graphkiln", "write") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
