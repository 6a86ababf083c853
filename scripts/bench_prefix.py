#!/usr/bin/env python
"""Prefix reuse on the real checkpoint (SmolLM2-135M-Instruct, scripts/real_checkpoint.py), ours
with the cache beside the same run without it (``prefix_cache=False``), in process, no HTTP.

1. Multi-turn chat: a system prompt holding a ~6,000-character document (~1.3k tokens), 4 user
   turns, each rendered whole with the chat template (as ``graphkiln chat`` and a chat client do),
   greedy replies of --new-tokens; time to first token per turn. Then the same last prompt again:
   a turn whose prompt is entirely cached.
2. Shared-prefix serving: 16 requests over 2 system prompts (~700 tokens each) with short distinct
   questions, at most 8 in flight, through the continuous-batching Scheduler: aggregate
   generated tokens/s, TTFT p50/p99, and the store's bytes afterwards.
3. No shared prefix: 16 requests of distinct random text, same shape: the cost of keeping blocks
   that are never reused (tokens/s with the cache over without), with a fresh store (its pages
   faulted in as blocks are first written) and (3b) with a store already filled once.
4. The copy: milliseconds to restore a cached prefix into a slot, per 1,000 tokens.

    .venv/bin/python scripts/bench_prefix.py [--work /tmp/gk-bench-prefix] [--threads 2] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint  # noqa: E402

QUESTIONS = ["Summarize the document in one sentence.", "What is the main idea of the second paragraph?",
             "List three facts the document states.", "Who would find this document useful, and why?"]


def document(chars: int) -> str:
    corpus = (Path(__file__).resolve().parents[1] / "graphkiln" / "demo" / "corpus.txt").read_text()
    paragraphs = [p.strip() for p in corpus.split("\n\n") if p.strip()]
    out, i = [], 0
    while sum(map(len, out)) < chars:
        out.append(f"Section {i + 1}. " + paragraphs[i % len(paragraphs)])
        i += 1
    return "\n\n".join(out)


def artifact(work: Path) -> Path:
    return exported(real_checkpoint(work, "smollm2-135m-instruct"), work / "artifact-2048", max_seq_len=2048)


def _hits(engine) -> int:
    return engine.prefix.stats().hit_tokens if engine.prefix is not None else 0


def turn(engine, prompt: list[int], cfg) -> tuple[float, str, int, int]:
    """(TTFT s, reply text, prompt tokens, prompt tokens taken from the cache) of one streamed turn."""
    before = _hits(engine)
    t0 = time.perf_counter()
    first, reply = None, []
    for ev in engine.stream(prompt, cfg):
        if first is None:
            first = time.perf_counter() - t0
        reply.append(ev.text)
    return first, "".join(reply), len(prompt), _hits(engine) - before


def chat(engine, template, cfg, turns: int) -> list[tuple[float, int, int]]:
    """(TTFT, prompt tokens, cached tokens) per turn, then for the last prompt sent again."""
    messages = [{"role": "system", "content": "Answer questions about this document.\n\n" + document(6000)}]
    out = []
    for q in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": q})
        prompt = template.encode(messages)
        first, reply, n, cached = turn(engine, prompt, cfg)
        out.append((first, n, cached))
        messages.append({"role": "assistant", "content": reply})
    first, _, n, cached = turn(engine, prompt, cfg)
    out.append((first, n, cached))
    return out


def serving(engine, prompts: list, cfg, concurrency: int) -> dict:
    from graphkiln.runtime.request.scheduler import Scheduler

    hits_before = _hits(engine)
    sched = Scheduler(engine, max_batch=concurrency, step_tokens=256)
    sched.start()
    gate = threading.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = [0]
    lock = threading.Lock()

    def one(p) -> None:
        with gate:
            t0 = time.perf_counter()
            h = sched.submit(p, cfg)
            first = None
            n = 0
            for ev in h.events(timeout=600):
                if first is None:
                    first = time.perf_counter() - t0
                n += ev.token_id >= 0
            with lock:
                ttfts.append(first)
                tokens[0] += n

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    stats = sched.stats()
    sched.shutdown(5)
    q = sorted(ttfts)
    return {"tok_s": tokens[0] / wall, "ttft_p50": statistics.median(q), "ttft_p99": q[min(len(q) - 1, int(0.99 * len(q)))],
            "wall": wall, "store_mib": (stats.prefix.bytes / 2**20) if stats.prefix else 0.0,
            "hit": _hits(engine) - hits_before, "miss": stats.prompt_tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-prefix"))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime.request.chat_template import ChatTemplate

    art = artifact(args.work)
    cfg = GenerationConfig(max_new_tokens=args.new_tokens, temperature=0)
    engines = {"reuse": Engine.load(art, threads=args.threads),
               "no reuse": Engine.load(art, threads=args.threads, prefix_cache=False)}
    template = ChatTemplate.load(art, engines["reuse"].manifest.tokenizer_files, engines["reuse"].tokenizer)

    print("1. multi-turn chat (TTFT s per turn; prompt tokens; cached tokens)")
    rows = {name: chat(e, template, cfg, 4) for name, e in engines.items()}
    for k in range(5):
        label = f"turn {k + 1}" if k < 4 else "turn 4 again (all cached)"
        r, n = rows["reuse"][k], rows["no reuse"][k]
        print(f"   {label:26s} reuse {r[0]:6.3f} s ({r[1]} tok, {r[2]} cached)   no reuse {n[0]:6.3f} s   "
              f"ratio to turn 1: {r[0] / rows['reuse'][0][0]:.3f} vs {n[0] / rows['no reuse'][0][0]:.3f}")

    rng = np.random.default_rng(0)
    systems = [{"role": "system", "content": document(3000 + 7 * i)} for i in range(2)]
    shared = [template.encode([systems[i % 2], {"role": "user", "content": f"Question {i}: " + QUESTIONS[i % 4]}])
              for i in range(16)]
    words = document(12000).split()
    distinct = [" ".join(rng.choice(words, 450)) for _ in range(16)]
    for title, prompts in (("2. shared prefix: 16 requests over 2 system prompts, concurrency 8", shared),
                           ("3. no shared prefix: 16 distinct prompts, concurrency 8", distinct)):
        print(title)
        got = {}
        for name, e in engines.items():
            got[name] = m = serving(e, prompts, cfg, 8)
            print(f"   {name:9s} {m['tok_s']:7.1f} tok/s  TTFT p50 {m['ttft_p50']:6.2f} s  p99 {m['ttft_p99']:6.2f} s  "
                  f"wall {m['wall']:6.1f} s  prompt tokens computed {m['miss']}  from cache {m['hit']}  "
                  f"store {m['store_mib']:.0f} MiB")
        print(f"   tokens/s with reuse / without: {got['reuse']['tok_s'] / got['no reuse']['tok_s']:.3f}")
    # the same without a cold store: a 256 MiB store filled once first, so keeping blocks faults in no
    # fresh pages (a long-running server's state once its store has cycled)
    warm = Engine.load(art, threads=args.threads, prefix_cache_bytes=256 << 20)
    serving(warm, [" ".join(rng.choice(words, 450)) for _ in range(16)], cfg, 8)
    print("3b. no shared prefix, the store full already (256 MiB budget, filled once)")
    got = {}
    for name, e in (("reuse", warm), ("no reuse", engines["no reuse"])):
        got[name] = m = serving(e, [" ".join(rng.choice(words, 450)) for _ in range(16)], cfg, 8)
        print(f"   {name:9s} {m['tok_s']:7.1f} tok/s  TTFT p50 {m['ttft_p50']:6.2f} s  p99 {m['ttft_p99']:6.2f} s")
    print(f"   tokens/s with reuse / without: {got['reuse']['tok_s'] / got['no reuse']['tok_s']:.3f}")

    e = engines["reuse"]
    pool, store = e.pool, e.pool.store
    k = min(store.blocks, 1024 // store.block_size)
    pool.reserve(1, 2048)
    slot = pool.claim()
    t0 = time.perf_counter()
    for _ in range(20):
        pool.load_blocks(slot, list(range(k)), None)
    per = (time.perf_counter() - t0) / 20
    pool.release(slot)
    print(f"4. restoring {k * store.block_size} cached tokens into a slot: {per * 1e3:.2f} ms "
          f"({per * 1e3 / (k * store.block_size / 1000):.2f} ms per 1,000 tokens, all {len(store.keys)} layers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
