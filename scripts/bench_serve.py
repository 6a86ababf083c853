#!/usr/bin/env python
"""Serving benchmark: ``graphkiln serve`` over HTTP at concurrency 1, 4 and 16.

The ~250M Llama-shaped model of ``bench_decode.py`` (16 layers, hidden 1024, vocab 32000, random
weights), exported fp32 and with each ``--quant``; each artifact served by ``graphkiln serve`` in a
subprocess (``--max-batch 16``). Each of C concurrent clients sends ``--requests`` streaming
completions one after another (``--prompt-len`` random token ids, exactly ``--new-tokens`` greedy
new tokens: ``ignore_eos``). Reported per (artifact, C): aggregate generated tokens/s over the
level's wall time, time-to-first-token p50/p99 (from sending the request to the first token's
chunk) and mean inter-token latency. Targets (issue 14): fp32 tokens/s at C=16 >= 4x C=1, TTFT
p99 at C=16 <= 2 s.

    .venv/bin/python scripts/bench_serve.py [--quant int4] [--threads 2] [--workdir DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode import build_checkpoint, export  # noqa: E402  (same model, same export)


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def start_server(art: Path, threads: int, max_batch: int, extra: tuple = ()) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "graphkiln.cli", "serve", str(art), "--port", "0", "--threads",
                             str(threads), "--max-batch", str(max_batch), "--model-name", "bench", "--log-level",
                             "warning", *extra], stderr=subprocess.PIPE, text=True)
    for _ in range(100):
        line = proc.stderr.readline()
        found = re.search(r"(http://[\d.]+:\d+)/v1", line)
        if found:
            # keep draining stderr so the server never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("graphkiln serve did not start")


def one_request(url: str, prompt: list[int], new: int) -> dict:
    import httpx

    # return_token_ids: a chunk per token even when its text is empty (this model has no tokenizer,
    # so every text is; the server otherwise holds back empty deltas and TTFT would be the whole run)
    body = {"model": "bench", "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                now = time.perf_counter()
                first = first or now
                last = now
    return {"ttft": first - sent, "tokens": tokens, "decode_s": last - first}


def level(url: str, concurrency: int, requests: int, prompt_len: int, new: int, seed: int, vocab: int = 32000) -> dict:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(concurrency * requests)]

    def client(c: int) -> list[dict]:
        return [one_request(url, prompts[c * requests + k], new) for k in range(requests)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = [r for rs in pool.map(client, range(concurrency)) for r in rs]
    wall = time.perf_counter() - start
    ttft = [d["ttft"] for d in done]
    itl = [d["decode_s"] / (d["tokens"] - 1) for d in done if d["tokens"] > 1]
    assert all(d["tokens"] == new for d in done), [d["tokens"] for d in done]
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall,
            "tok_s": sum(d["tokens"] for d in done) / wall, "ttft_p50": percentile(ttft, 50),
            "ttft_p99": percentile(ttft, 99), "itl_ms": 1000 * statistics.mean(itl)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--concurrency", type=int, action="append", help="default: 1, 4, 16")
    p.add_argument("--requests", type=int, default=2, help="sequential requests per client (default 2)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--quant", action="append", choices=["int4", "int8"], help="also serve a quantized artifact")
    p.add_argument("--workdir", default=None, help="reuse the checkpoint and artifacts here across runs")
    p.add_argument("--batched-int8", action="store_true",
                   help="serve each quantized artifact a second time with --batched-int8")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    levels = args.concurrency or [1, 4, 16]

    work = Path(args.workdir or tempfile.mkdtemp(prefix="gk-bench-serve-"))
    ckpt = work / "llama" / "checkpoint"
    if not (ckpt / "config.json").exists():
        ckpt.mkdir(parents=True, exist_ok=True)
        build_checkpoint(ckpt, "llama")
    rows = []
    runs = [(None, False)] + [(q, b) for q in args.quant or [] for b in ((False, True) if args.batched_int8 else (False,))]
    for quant, batched in runs:
        # the onnxruntime target (GroupQueryAttention, in-place cache) is what serving runs
        art = work / "llama" / ("artifact-ort" if quant is None else f"artifact-{quant}")
        export(ckpt, art, "onnxruntime", quant)
        proc, url = start_server(art, args.threads, max(levels), ("--batched-int8",) if batched else ())
        try:
            one_request(url, list(range(3, 3 + args.prompt_len)), 4)  # warm-up
            for c in levels:
                weights = (quant or "fp32") + (" --batched-int8" if batched else "")
                row = {"weights": weights, **level(url, c, args.requests, args.prompt_len, args.new_tokens, c)}
                rows.append(row)
                print(f"{row['weights']} c={c}: {row['tok_s']:.1f} tok/s, TTFT p50 {row['ttft_p50']:.2f}s "
                      f"p99 {row['ttft_p99']:.2f}s, ITL {row['itl_ms']:.0f} ms", flush=True)
        finally:
            proc.terminate()
            proc.wait(120)
    print(f"\nprompt {args.prompt_len}, {args.new_tokens} greedy new tokens, {args.threads} threads, "
          f"{args.requests} requests per client, streaming over HTTP\n")
    print("| weights | concurrency | tokens/s | vs c=1 | TTFT p50 | TTFT p99 | inter-token |\n|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["weights"] == row["weights"])
        print(f"| {row['weights']} | {row['concurrency']} | {row['tok_s']:.1f} | {row['tok_s'] / base['tok_s']:.2f}x | "
              f"{row['ttft_p50']:.2f} s | {row['ttft_p99']:.2f} s | {row['itl_ms']:.0f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
