#!/usr/bin/env python
"""Scheduler benchmark (runtime.request.scheduler), in process, no HTTP.

Model: a small Llama shape (8 layers, hidden 512, 8/2 heads, vocab 32000, ~60M parameters,
random weights), exported for the onnxruntime target (GroupQueryAttention, cache in place)
and the portable target. Three measurements:

1. Aggregate generated tokens/s and time-to-first-token p50/p99 at concurrency 1, 4 and 16
   (all requests submitted at once; --prompt-tokens prompts, --new-tokens greedy tokens),
   onnxruntime target, step_tokens 256.
2. GroupQueryAttention's constraint (no batch > 1 with seq > 1 over a non-empty cache): the
   scheduler's arrangement (decode rows in one run, a prefill chunk in a second, batch-1 run)
   against the one-run alternative the portable graph allows (every row padded to the chunk:
   batch 16 x seq C); step milliseconds, 15 decoding rows + one 128-token chunk.
3. The folded greedy sampler: a decode step's Python-side time with ``tokens_only`` (the
   graph's argmax) against logits out + ``select_token`` per row, batch 1 and 16, and the
   logits bytes not copied.

    .venv/bin/python scripts/bench_scheduler.py [--threads 2] [--new-tokens 64] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

CONFIG = dict(vocab_size=32000, hidden_size=512, num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=8,
              intermediate_size=1408, max_position_embeddings=1024, tie_word_embeddings=False)


def build(root: Path, quick: bool) -> dict[str, Path]:
    import torch
    import transformers

    from graphkiln.export.pipeline import ExportOptions, export_model

    ckpt = root / "checkpoint"
    if not (ckpt / "config.json").exists():
        cfg = transformers.LlamaConfig(**(CONFIG | (dict(num_hidden_layers=2, vocab_size=4000) if quick else {})))
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    arts = {}
    for target in ("onnxruntime", "portable"):
        art = arts[target] = root / target
        if not (art / "manifest.json").exists():
            export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=512, target=target))
    return arts


def serve(art: Path, threads: int, concurrency: int, prompt_tokens: int, new_tokens: int) -> dict:
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime.request.scheduler import Scheduler

    engine = Engine.load(art, threads=threads)
    vocab = engine.manifest.model.vocab_size
    rng = np.random.default_rng(concurrency)
    prompts = [rng.integers(3, vocab, prompt_tokens).tolist() for _ in range(concurrency)]
    cfg = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, stop_token_ids=())
    sched = Scheduler(engine, max_batch=max(concurrency, 1), step_tokens=256)
    sched.start()
    try:
        sched.submit(prompts[0], GenerationConfig(max_new_tokens=2, stop_token_ids=())).result()  # warm-up
        t0 = time.perf_counter()
        handles = [sched.submit(p, cfg) for p in prompts]
        ttft = []
        import threading

        def first(h):
            next(h.events())
            ttft.append(time.perf_counter() - t0)

        waiters = [threading.Thread(target=first, args=(h,)) for h in handles]
        for w in waiters:
            w.start()
        results = [h.result() for h in handles]
        wall = time.perf_counter() - t0
        for w in waiters:
            w.join()
    finally:
        sched.shutdown(60)
    generated = sum(len(r.token_ids) for r in results)
    ttft.sort()
    return dict(concurrency=concurrency, tok_s=generated / wall, ttft_p50=statistics.median(ttft),
                ttft_p99=ttft[min(len(ttft) - 1, int(round(0.99 * (len(ttft) - 1))))], wall=wall)


def step_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def arrangements(art: Path, threads: int, chunk: int, repeats: int) -> dict:
    """15 rows decoding at position 200 + one request's chunk at positions 128..128+chunk."""
    from graphkiln.runtime import Engine

    engine = Engine.load(art, threads=threads)
    dec = engine.decoder
    pool = engine.pool
    pool.reserve(16, 512)
    for _ in range(16):
        pool.claim()
    rng = np.random.default_rng(0)
    vocab = engine.manifest.model.vocab_size
    d = 15
    tok = rng.integers(3, vocab, (d, 1))
    pos = np.full((d, 1), 200, np.int64)
    chunk_ids = rng.integers(3, vocab, (1, chunk))
    chunk_pos = np.arange(128, 128 + chunk, dtype=np.int64)[None]

    def two_runs():
        dec.run(pool, tok, pos, np.zeros((d, 1), np.int64), np.ones(d, np.int64))
        dec.run(pool, chunk_ids, chunk_pos, np.array([[chunk - 1]]), np.array([chunk]), first_slot=d)

    ids = np.zeros((16, chunk), np.int64)
    ids[:d, 0] = tok[:, 0]
    ids[d] = chunk_ids[0]
    positions = np.concatenate([pos + np.arange(chunk)[None], chunk_pos])
    lengths = np.array([1] * d + [chunk], np.int64)
    index = np.array([[0]] * d + [[chunk - 1]], np.int64)

    def one_padded_run():
        dec.run(pool, ids, positions, index, lengths)

    out = {"decode only (15 rows)": step_ms(
        lambda: dec.run(pool, tok, pos, np.zeros((d, 1), np.int64), np.ones(d, np.int64)), repeats),
        "two runs: decode 15x1 + chunk 1x%d" % chunk: step_ms(two_runs, repeats)}
    try:
        out["one run, padded: 16x%d" % chunk] = step_ms(one_padded_run, repeats)
    except Exception as exc:  # GroupQueryAttention refuses it
        out["one run, padded: 16x%d" % chunk] = f"refused ({str(exc).splitlines()[0][:80]})"
    for s in range(15, -1, -1):
        pool.release(s)
    return out


def folded(art: Path, threads: int, repeats: int) -> list[dict]:
    from graphkiln.runtime import Engine
    from graphkiln.runtime.request.sampling import SamplingParams, select_token

    engine = Engine.load(art, threads=threads)
    dec, pool = engine.decoder, engine.pool
    vocab = engine.manifest.model.vocab_size
    greedy = SamplingParams()
    rows = []
    for batch in (1, 16):
        pool.reserve(batch, 512)
        for _ in range(batch):
            pool.claim()
        tok = np.full((batch, 1), 5, np.int64)
        pos = np.full((batch, 1), 100, np.int64)
        zeros, ones = np.zeros((batch, 1), np.int64), np.ones(batch, np.int64)

        def with_logits():
            logits = dec.run(pool, tok, pos, zeros, ones)
            return [select_token(logits[b, 0], greedy, None) for b in range(batch)]

        def with_tokens():
            out = dec.run(pool, tok, pos, zeros, ones, tokens_only=True)
            return [int(t) for t in out[:, 0]]

        assert with_logits() == with_tokens()
        a, b = step_ms(with_logits, repeats), step_ms(with_tokens, repeats)
        # the Python side alone: the argmax + checks over logits rows that no longer happen
        logits = dec.run(pool, tok, pos, zeros, ones).copy()
        py = step_ms(lambda: [select_token(logits[r, 0], greedy, None) for r in range(batch)], repeats * 10)
        rows.append(dict(batch=batch, logits_ms=a, folded_ms=b, python_argmax_ms=py, bytes=batch * vocab * 4))
        for s in range(batch - 1, -1, -1):
            pool.release(s)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--root", default="/tmp/graphkiln-bench-scheduler")
    ap.add_argument("--quick", action="store_true", help="2 layers, vocab 4000: a smoke run, not the benchmark")
    ap.add_argument("--only", choices=["serve", "arrangements", "folded"], action="append")
    args = ap.parse_args()
    arts = build(Path(args.root) / ("quick" if args.quick else "full"), args.quick)
    only = set(args.only or ["serve", "arrangements", "folded"])
    if "serve" in only:
        print(f"\n| concurrency | tokens/s | TTFT p50 s | TTFT p99 s | (onnxruntime target, {args.prompt_tokens}-token "
              f"prompts, {args.new_tokens} new, {args.threads} threads)")
        print("|---|---|---|---|")
        base = None
        for c in (1, 4, 16):
            r = serve(arts["onnxruntime"], args.threads, c, args.prompt_tokens, args.new_tokens)
            base = base or r["tok_s"]
            print(f"| {c} | {r['tok_s']:.1f} ({r['tok_s'] / base:.2f}x) | {r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} |",
                  flush=True)
    if "arrangements" in only:
        for target in ("onnxruntime", "portable"):
            print(f"\nstep ms, {target} target (median of {args.repeats}):")
            for k, v in arrangements(arts[target], args.threads, 128, args.repeats).items():
                print(f"  {k}: {v if isinstance(v, str) else f'{v:.2f}'}", flush=True)
    if "folded" in only:
        print("\n| target | batch | step ms, logits + select_token | step ms, folded next_token | Python argmax ms "
              "| logits bytes not copied |")
        print("|---|---|---|---|---|---|")
        for target in ("onnxruntime", "portable"):
            for r in folded(arts[target], args.threads, args.repeats):
                print(f"| {target} | {r['batch']} | {r['logits_ms']:.3f} | {r['folded_ms']:.3f} | "
                      f"{r['python_argmax_ms']:.3f} | {r['bytes']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
