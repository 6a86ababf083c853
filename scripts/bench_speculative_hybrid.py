#!/usr/bin/env python
"""What rolling back a hybrid's slot states costs in speculative decoding (``request.step``):
a random-init Qwen3.5-shaped text model (gated delta net layers with 16 x 128 x 128 recurrent
states, one full-attention layer in four), drafted by its own int8 export (round to nearest),
which some steps' drafts get wrong (a random model has no repeats for prompt lookup to find).

Per verification the step copies the row's conv and recurrent states (snapshot) and, when a
draft was rejected, copies them back and runs the accepted tokens again (recompute). Reported:
the state bytes and the copy time, how often a verification needed the recompute run, decode
tok/s with and without speculation (same engine, interleaved), and that the greedy tokens match.
A random model's text is meaningless; only the mechanism's costs are measured here.

    .venv/bin/python scripts/bench_speculative_hybrid.py [--work /tmp/gk-bench-spec-hybrid] [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
              num_attention_heads=8, num_key_value_heads=2, head_dim=256,
              layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
              linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, tie_word_embeddings=True, initializer_range=0.02,
              rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/gk-bench-spec-hybrid"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    import numpy as np

    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.runtime.request.step import StepBatch

    art, draft = _build(args.work)
    engine = Engine.load(art, threads=args.threads, draft=draft)
    cost, engine.draft.cost = engine.draft.cost, 0.0  # drafts whatever they cost: the rollback is measured here
    pool = engine.pool
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 32000, 48).tolist()
    plain = GenerationConfig(max_new_tokens=args.new_tokens, stop_token_ids=())
    engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=4))

    # the mechanism's counts: verifications, and those that restored the states and ran again
    counts = {"verify": 0, "recompute": 0, "copy_s": [], "rerun_s": 0.0, "run_s": 0.0, "after_restore": False}
    snapshot, restore, run = pool.snapshot_slot_states, pool.restore_slot_states, engine.decoder.run

    def timed_snapshot(slot):
        t = time.perf_counter()
        out = snapshot(slot)
        counts["copy_s"].append(time.perf_counter() - t)
        counts["verify"] += 1
        return out

    def timed_restore(slot, saved):
        t = time.perf_counter()
        restore(slot, saved)
        counts["copy_s"][-1] += time.perf_counter() - t
        counts["recompute"] += 1
        counts["after_restore"] = True

    def timed_run(*a, **k):  # the target's runs; the one right after a restore is the re-run
        t = time.perf_counter()
        out = run(*a, **k)
        took = time.perf_counter() - t
        counts["run_s"] += took
        if counts["after_restore"]:
            counts["rerun_s"] += took
            counts["after_restore"] = False
        return out

    pool.snapshot_slot_states, pool.restore_slot_states = timed_snapshot, timed_restore
    rates: dict = {}
    for _ in range(args.repeats):
        t = time.perf_counter()
        engine.generate(prompt, dataclasses.replace(plain, max_new_tokens=1))
        prefill = time.perf_counter() - t
        for spec in (None, "draft:4"):
            t = time.perf_counter()
            out = engine.generate(prompt, dataclasses.replace(plain, speculative=spec))[0]
            rates.setdefault(spec, []).append((len(out.token_ids) - 1) / (time.perf_counter() - t - prefill))
            if spec is None:
                want = out.token_ids
            assert out.token_ids == want, "speculative tokens differ from plain decoding"
    state_bytes = sum(a[0].nbytes for a in pool.slot_states().values())
    seen = {}
    original = StepBatch._speculative_run

    def spy(self, r, proposal):
        seen["s"] = r.speculator
        return original(self, r, proposal)

    StepBatch._speculative_run = spy
    for key in ("verify", "recompute", "rerun_s", "run_s"):
        counts[key] = 0
    counts["copy_s"] = []
    engine.decoder.run = timed_run
    t = time.perf_counter()
    engine.generate(prompt, dataclasses.replace(plain, speculative="draft:4"))
    total = time.perf_counter() - t
    engine.decoder.run = run
    StepBatch._speculative_run = original
    base, fast = statistics.median(rates[None]), statistics.median(rates["draft:4"])
    print(f"random Qwen3.5-shaped hybrid ({CONFIG['num_hidden_layers']} layers, "
          f"{engine.manifest.model.num_parameters / 1e6:.0f}M parameters, fp32), {args.threads} threads, greedy, "
          f"{args.new_tokens} new tokens, median of {args.repeats}; the int8 draft's step costs {cost:.2f} of the "
          "target's (forced to draft anyway)")
    print(f"slot states per row: {state_bytes / 2**20:.1f} MiB; snapshot + restore "
          f"{statistics.median(counts['copy_s']) * 1e3:.2f} ms per verification (median)")
    print(f"one speculative request: verifications {counts['verify']}, of which re-run after a rejection "
          f"{counts['recompute']} ({counts['recompute'] / max(1, counts['verify']):.0%}); drafts accepted "
          f"{seen['s'].acceptance:.0%}; of its {total:.2f} s, target runs {counts['run_s']:.2f} s (re-runs "
          f"{counts['rerun_s']:.2f} s), state copies {sum(counts['copy_s']):.3f} s, the rest (draft model, sampling) "
          f"{total - counts['run_s'] - sum(counts['copy_s']):.2f} s")
    print(f"plain {base:.1f} tok/s, draft:4 {fast:.1f} tok/s ({fast / base:.2f}x), tokens equal")
    return 0


def _build(work: Path) -> tuple[Path, Path]:
    """The random checkpoint's fp32 and int8 (the draft) onnxruntime exports, once."""
    art, draft, ckpt = work / "artifact", work / "int8", work / "checkpoint"
    if not (art / "manifest.json").is_file():
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**CONFIG)).eval()
        model.save_pretrained(ckpt)
    exported(ckpt, art, max_seq_len=512, overwrite=True)
    return art, exported(ckpt, draft, max_seq_len=512, overwrite=True, quant="int8", quant_method="rtn")


if __name__ == "__main__":
    raise SystemExit(main())
