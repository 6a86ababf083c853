"""Embeddings throughput: graphkiln (``export --task embed``, ``Engine.embed``) against
sentence-transformers' ``encode`` on the same checkpoint, in the same run.

The checkpoint is the real SmolLM2-135M-Instruct (scripts/real_checkpoint.py; a Llama decoder, so
an embedding model's shape if not its training) unless ``--checkpoint`` names another (a
Qwen3-Embedding directory, say). Texts are consecutive pieces of graphkiln/data/prose.txt of
``--tokens`` tokens each, the same strings for both; both tokenize them with the checkpoint's
tokenizer (the counts are checked equal) and pool the same way (``--pooling``, then L2
normalisation). sentence-transformers runs torch on ``--threads`` threads; graphkiln onnxruntime on
as many. Batch 1 embeds one text per call; batch 32 hands 32 texts to one call (sentence-
transformers' ``batch_size=32``; graphkiln's ``Engine.embed`` prefills them together). The two
alternate, ``--rounds`` times, and the median of each is reported with the spread, as tokens/s of
text embedded, with the machine's load average (other work shares these CPUs).

    python scripts/bench_embeddings.py [--work /work/bench-tmp/embeddings] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchlib import exported, real_checkpoint  # noqa: E402


def texts_of(tokenizer, n: int, tokens: int) -> list[str]:
    """``n`` pieces of the prose corpus, each decoded from ``tokens`` consecutive token ids (so each
    re-tokenizes to about that many)."""
    prose = (Path(__file__).resolve().parents[1] / "graphkiln" / "data" / "prose.txt").read_text()
    ids = tokenizer(prose, add_special_tokens=False)["input_ids"]
    while len(ids) < n * tokens:
        ids = ids + ids
    return [tokenizer.decode(ids[k * tokens:(k + 1) * tokens]) for k in range(n)]


def timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", default="/work/bench-tmp/embeddings")
    ap.add_argument("--checkpoint", default=None, help="default: SmolLM2-135M-Instruct under --work")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per text")
    ap.add_argument("--texts", type=int, default=64, help="texts per timed batch-32 run (batch 1: a quarter)")
    ap.add_argument("--pooling", default="last", choices=["last", "mean"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    from graphkiln.runtime import Engine

    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.checkpoint) if args.checkpoint else real_checkpoint(work)
    art = exported(ckpt, work / f"artifact-embed-{args.pooling}", task="embed", pooling=args.pooling, normalize=True,
                   max_seq_len=max(512, 2 * args.tokens))
    engine = Engine.load(art, threads=args.threads)
    hidden = engine.manifest.model.hidden_size
    # the plain text modality: sentence-transformers 6 otherwise renders each text through the chat
    # template of a tokenizer that has one (SmolLM2's), which graphkiln's embed does not
    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    st = SentenceTransformer(modules=[Transformer(str(ckpt), modality_config=text_only,
                                                  module_output_name="token_embeddings"),
                                      Pooling(hidden, "lasttoken" if args.pooling == "last" else "mean"), Normalize()],
                             device="cpu")
    tok = st.tokenizer
    if tok.pad_token is None:  # a decoder's tokenizer often has none; padding is masked either way
        tok.pad_token = tok.eos_token
    texts = texts_of(tok, args.texts, args.tokens)
    ours_ids = [engine.encode(t) for t in texts]
    theirs_ids = tok(texts)["input_ids"]
    assert [len(i) for i in ours_ids] == [len(i) for i in theirs_ids], "the two tokenizations differ"
    total = sum(map(len, ours_ids))
    ours, theirs = engine.embed(texts), st.encode(texts, batch_size=32)
    cos = float(((ours * theirs).sum(1)).min())
    assert cos > 0.9999, f"graphkiln and sentence-transformers disagree (min cosine {cos:.6f}): not the same model"
    print(f"checkpoint {ckpt.name}: hidden {hidden}, {engine.manifest.model.num_layers} layers; {len(texts)} texts of "
          f"{total / len(texts):.0f} tokens; {args.pooling} pooling; min cosine graphkiln vs sentence-transformers "
          f"{cos:.6f}; threads {args.threads}")

    one = texts[: max(1, len(texts) // 4)]
    one_total = sum(len(i) for i in ours_ids[: len(one)])
    runs = {
        ("graphkiln", 1): lambda: [engine.embed(t) for t in one],
        ("sentence-transformers", 1): lambda: [st.encode([t], batch_size=1) for t in one],
        ("graphkiln", 32): lambda: engine.embed(texts),
        ("sentence-transformers", 32): lambda: st.encode(texts, batch_size=32),
    }
    for fn in runs.values():  # warm-up: sessions, bindings, torch's first-call costs
        fn()
    rates: dict = {k: [] for k in runs}
    for _ in range(args.rounds):
        for (who, batch), fn in runs.items():
            rates[who, batch].append((one_total if batch == 1 else total) / timed(fn))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("| batch | graphkiln tokens/s | sentence-transformers tokens/s | ratio |")
    print("|---|---|---|---|")
    for batch in (1, 32):
        g, s = rates["graphkiln", batch], rates["sentence-transformers", batch]
        print(f"| {batch} | {statistics.median(g):,.0f} ({min(g):,.0f}-{max(g):,.0f}) | {statistics.median(s):,.0f} "
              f"({min(s):,.0f}-{max(s):,.0f}) | {statistics.median(g) / statistics.median(s):.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
