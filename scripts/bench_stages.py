#!/usr/bin/env python
"""Pipeline-stage benchmark (issue 15): one graph vs 2 stages in one process vs 2 Ray actors.

One random-init checkpoint (--model llama: the ~246M Llama shape of scripts/bench_decode.py;
--model small: hidden 512, 8 layers, ~45M, for a quick look), exported twice with the
onnxruntime target: a single graph and ``--stages 2``. 2 threads in all: the in-process runs
use 2 onnxruntime threads (the stages run one after the other), each Ray actor 1 (a local
cluster of 2 CPUs). Every measurement runs in a fresh process (peak RSS is the process's own
``ru_maxrss``; an actor reports its own). Rows:

- single / staged in-process: ``Engine.generate`` of one --prompt-len prompt, --new greedy
  tokens, decode tokens/s (after the prefill), median of --repeats;
- ray, 1 in flight: one request; each decode step goes stage 0 -> stage 1 -> driver;
- ray, 2 in flight: two requests in their own slots, each submitted as its own 1-row
  forward (``RayStagedDecoder.submit``, first_slot = its slot) as soon as its previous token
  is back, so while one is in stage 1 the other runs in stage 0; aggregate tokens/s.

Greedy tokens of every row are checked equal to the single graph's.

    .venv/bin/python scripts/bench_stages.py [--model llama|small] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMALL = ("LlamaConfig", dict(vocab_size=32000, hidden_size=512, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=2048, num_hidden_layers=8, intermediate_size=1408,
                             tie_word_embeddings=False))


def build(path: Path, model: str) -> None:
    import torch
    import transformers

    if model == "llama":
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_decode import MODELS

        config_name, kwargs, _ = MODELS["llama"]
    else:
        config_name, kwargs = SMALL
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(getattr(transformers, config_name)(**kwargs)).save_pretrained(path)


def _peak_rss() -> int:
    """Peak RSS from /proc (VmHWM): ru_maxrss is carried across exec, so these workers, started
    by the exporting parent, would report its peak."""
    from graphkiln.runtime.backends.distributed import peak_rss as vm_hwm

    return vm_hwm()


def worker_inprocess(art: str, prompt: list[int], new: int, repeats: int) -> dict:
    from graphkiln.runtime import Engine, GenerationConfig

    engine = Engine.load(art, threads=2)
    engine.generate(prompt, GenerationConfig(max_new_tokens=4, stop_token_ids=()))  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        engine.generate(prompt, GenerationConfig(max_new_tokens=1, stop_token_ids=()))
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        out = engine.generate(prompt, GenerationConfig(max_new_tokens=new, stop_token_ids=()))[0]
        rates.append((new - 1) / (time.perf_counter() - t - prefill))
    return {"tok_s": statistics.median(rates), "all": rates, "tokens": [out.token_ids], "peak_rss": [_peak_rss()]}


def _decode_in_flight(engine, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    """Each prompt in its own slot, prefilled alone, then decoded with each request's next
    forward submitted as soon as its token is back. Returns (aggregate decode tokens/s, tokens)."""
    import numpy as np
    import ray

    dec, pool = engine.decoder, engine.pool
    k = len(prompts)
    pool.reserve(k, max(map(len, prompts)) + new)
    slots = [pool.claim() for _ in prompts]
    tokens: list[list[int]] = []
    try:
        for s, p in zip(slots, prompts):
            n = len(p)
            out = dec.run(pool, np.array([p], np.int64), np.arange(n, dtype=np.int64)[None],
                          np.array([[n - 1]], np.int64), np.array([n], np.int64), first_slot=s, tokens_only=True)
            tokens.append([int(out[0, 0])])

        def submit(s: int):
            pos = len(prompts[s]) + len(tokens[s]) - 1
            return dec.submit(pool, np.array([[tokens[s][-1]]], np.int64), np.array([[pos]], np.int64),
                              np.zeros((1, 1), np.int64), np.ones(1, np.int64), first_slot=s, tokens_only=True)

        t = time.perf_counter()
        pending = {s: submit(s) for s in slots}
        while pending:
            refs = {pending[s].ref: s for s in pending}
            done, _ = ray.wait(list(refs), num_returns=1)
            s = refs[done[0]]
            tokens[s].append(int(pending.pop(s).result()[0, 0]))
            if len(tokens[s]) < new:
                pending[s] = submit(s)
        elapsed = time.perf_counter() - t
    finally:
        for s in reversed(slots):
            pool.release(s)
    return k * (new - 1) / elapsed, tokens


def worker_ray(art: str, prompt: list[int], new: int, repeats: int) -> dict:
    import ray

    from graphkiln.runtime import Engine
    from graphkiln.runtime.backends.distributed import RayOptions

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR", configure_logging=True)
    engine = Engine.load(art, threads=1, distributed=RayOptions())
    prompts = [prompt, prompt]
    _decode_in_flight(engine, prompts[:1], 8)  # warm-up
    _decode_in_flight(engine, prompts, 8)
    one, two = [], []
    for _ in range(repeats):  # interleaved: the machine's speed drifts
        rate, tok1 = _decode_in_flight(engine, prompts[:1], new)
        one.append(rate)
        rate, tok2 = _decode_in_flight(engine, prompts, new)
        two.append(rate)
    infos = engine.decoder.pipeline.call("info")
    engine.decoder.close()
    return {"one": statistics.median(one), "two": statistics.median(two), "one_all": one, "two_all": two,
            "tokens": tok1 + tok2, "peak_rss": [i["peak_rss"] for i in infos], "driver_rss": _peak_rss()}


def run_worker(mode: str, art: Path, prompt: list[int], new: int, repeats: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", mode, str(art), "--prompt", ",".join(map(str, prompt)),
                           "--new", str(new), "--repeats", str(repeats)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} worker failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama", "small"], default="llama")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("MODE", "ART"), help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        mode, art = args.worker
        prompt = [int(t) for t in args.prompt.split(",")]
        fn = worker_ray if mode == "ray" else worker_inprocess
        print(json.dumps(fn(art, prompt, args.new, args.repeats)))
        return 0

    from graphkiln.export.pipeline import ExportOptions, export_model

    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-stages-"))
    ckpt, single, staged = root / "checkpoint", root / "single", root / "staged2"
    if not ckpt.exists():
        build(ckpt, args.model)
    for out, kw in ((single, {}), (staged, {"stages": 2})):
        if not out.exists():
            t = time.perf_counter()
            export_model(str(ckpt), out, ExportOptions(progress=False, target="onnxruntime", **kw))
            print(f"exported {out.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    import numpy as np

    prompt = np.random.default_rng(0).integers(3, 32000, args.prompt_len).tolist()
    load = os.getloadavg()
    r_single = run_worker("single", single, prompt, args.new, args.repeats)
    r_staged = run_worker("staged", staged, prompt, args.new, args.repeats)
    r_ray = run_worker("ray", staged, prompt, args.new, args.repeats)
    load_after = os.getloadavg()
    ref = r_single["tokens"][0]
    same = {"staged": r_staged["tokens"][0] == ref, "ray": all(t == ref for t in r_ray["tokens"])}

    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    print(f"\nmodel {args.model}, prompt {args.prompt_len}, {args.new} greedy tokens, 2 threads in all, median of "
          f"{args.repeats}; load average before/after {load[0]:.2f}/{load_after[0]:.2f} (1 min)\n")
    print("| run | processes | peak RSS | decode tok/s | ratio |")
    print("|---|---|---|---|---|")
    print(f"| single graph, in-process | 1 | {gb(r_single['peak_rss'][0])} | {r_single['tok_s']:.1f} | 1.00x |")
    print(f"| 2 stages, in-process | 1 | {gb(r_staged['peak_rss'][0])} | {r_staged['tok_s']:.1f} | "
          f"{r_staged['tok_s'] / r_single['tok_s']:.2f}x of single |")
    rss = " / ".join(gb(b) for b in r_ray["peak_rss"])
    print(f"| 2 stages, Ray, 1 request in flight | driver + 2 actors | {rss} (driver {gb(r_ray['driver_rss'])}) | "
          f"{r_ray['one']:.1f} | 1.00x |")
    print(f"| 2 stages, Ray, 2 requests in flight | driver + 2 actors | (same actors) | {r_ray['two']:.1f} aggregate | "
          f"{r_ray['two'] / r_ray['one']:.2f}x of 1 in flight |")
    print(f"\ngreedy tokens equal to the single graph's: staged {same['staged']}, ray {same['ray']}")
    print(f"runs: single {[round(x, 1) for x in r_single['all']]}, staged {[round(x, 1) for x in r_staged['all']]}, "
          f"ray 1 {[round(x, 1) for x in r_ray['one_all']]}, ray 2 {[round(x, 1) for x in r_ray['two_all']]}")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": r_single, "staged": r_staged, "ray": r_ray, "load": load,
                                               "load_after": load_after, "same_tokens": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
