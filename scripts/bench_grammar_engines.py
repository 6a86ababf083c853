#!/usr/bin/env python
"""Why structured output uses llguidance: its per-token mask time and compile time beside
xgrammar's, on the real checkpoint's tokenizer (SmolLM2, 49,152 tokens) and
bench_structured.py's JSON schema, along a valid output (each mask built, then its token consumed).

xgrammar is not a graphkiln dependency (it requires torch, transformers and triton, and the
runtime is torch-free); install it apart and point ``--xgrammar-path`` at it:

    pip install --target /tmp/xg --no-deps xgrammar apache-tvm-ffi
    .venv/bin/python scripts/bench_grammar_engines.py --artifact ART --xgrammar-path /tmp/xg
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_structured import SCHEMA  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", type=Path, required=True, help="an artifact with tokenizer.json (the real checkpoint's)")
    ap.add_argument("--xgrammar-path", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from graphkiln.manifest import Manifest
    from graphkiln.runtime.request.constraint import JSON_OPTIONS

    vocab = Manifest.read_with_digest(args.artifact)[0].model.vocab_size
    hf = AutoTokenizer.from_pretrained(str(args.artifact))
    text = json.dumps({"items": [{"name": f"item{i}", "qty": i, "fragile": i % 2 == 0} for i in range(8)]},
                      separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]))
    ids = hf.encode(text, add_special_tokens=False)

    import llguidance
    import llguidance.numpy as lln

    started = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(str(args.artifact / "tokenizer.json"), n_vocab=vocab)
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS),
                                   log_level=0)
    compiled = time.perf_counter() - started
    mask = lln.allocate_token_bitmask(1, vocab)
    _report("llguidance", compiled, _walk(ids, lambda: lln.fill_next_token_bitmask(matcher, mask, 0), matcher.consume_token))

    if args.xgrammar_path is None:
        print("xgrammar: not measured (pass --xgrammar-path)")
        return 0
    sys.path.insert(0, str(args.xgrammar_path))
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=False, separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]))
    compiled = time.perf_counter() - started
    xmatcher = xgr.GrammarMatcher(grammar)
    xmask = xgr.allocate_token_bitmask(1, vocab)
    _report("xgrammar", compiled, _walk(ids, lambda: xmatcher.fill_next_token_bitmask(xmask, 0), xmatcher.accept_token))
    return 0


def _walk(ids, fill, consume) -> list[float]:
    times = []
    for token in ids:
        started = time.perf_counter()
        fill()
        times.append(time.perf_counter() - started)
        assert consume(token), f"the grammar refused token {token} of a valid output"
    return times


def _report(name: str, compiled: float, times: list[float]) -> None:
    print(f"{name:10s} compile {compiled * 1e3:.0f} ms; mask median {statistics.median(times) * 1e6:.0f} us, "
          f"p90 {np.percentile(times, 90) * 1e6:.0f} us, max {max(times) * 1e3:.2f} ms ({len(times)} tokens)")


if __name__ == "__main__":
    raise SystemExit(main())
