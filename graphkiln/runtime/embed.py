"""Embeddings: texts or token ids -> one vector each, from the decoder's final-norm hidden states.

An embedding artifact (``export --task embed``, ``manifest.EmbeddingSpec``) returns
``last_hidden_state`` and no logits; a generation artifact exported with
``--return-hidden-states`` returns it beside its logits, and embeds too (the head then runs
at the pooled positions as well). Nothing is sampled and nothing is kept: each batch claims
fresh slots of the engine's state pool, runs one prefill whose ``logits_index`` picks the rows
the pooling reads (the last position for "last", every position for "mean"), and releases the
slots, last claimed first, so slots other requests hold never move (``backends.state``).

Pooling (in float32, whatever the model dtype): "last" takes the last token's row (decoder
embedding models such as Qwen3-Embedding, whose tokenizer appends an end-of-text token), "mean"
the average of the text's rows. ``dimensions`` keeps the first d values (Matryoshka
truncation); ``normalize`` then scales to unit L2 norm (as sentence-transformers' ``truncate_dim``
with ``normalize_embeddings``). Defaults: the artifact's record; for a ``--return-hidden-states``
artifact, "last" and not normalised (the raw row, as ``Engine.embed`` always returned).

Batches: inputs are taken longest first (less padding), at most ``max_batch`` of them and
``max_tokens`` padded tokens per prefill (an input longer than that runs alone); results come
back in input order. ``Engine.embed`` runs them in the caller's thread; ``Scheduler.embed`` in
its stepping thread between generation steps, in the slots no request holds, at most
``step_tokens`` padded tokens per batch so a decode step waits for one such batch at most.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import EMBEDDING_POOLINGS, Manifest

if TYPE_CHECKING:
    from graphkiln.runtime.engine import Engine

MAX_BATCH = 32  # inputs per prefill (Engine.embed)
MAX_TOKENS = 8192  # padded tokens per prefill (Engine.embed): KV rows written and dropped, bounded
# a --return-hidden-states artifact computes logits wherever it gives hidden states: under mean
# pooling (every position) its prefills are bounded by those logits' bytes too
MAX_LOGITS_BYTES = 256 << 20


@dataclass(frozen=True)
class EmbedSettings:
    """How one call pools (checked by ``embed_settings``)."""

    pooling: str
    normalize: bool
    dimensions: int | None  # None: the model's hidden size


@dataclass
class EmbeddingResult:
    """One call's vectors [n, d] float32 in input order, and each input's token count."""

    vectors: np.ndarray
    token_counts: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


def embed_settings(manifest: Manifest, pooling: str | None = None, normalize: bool | None = None,
                   dimensions: int | None = None) -> EmbedSettings:
    """The call's settings, the artifact's defaults filled in; one GraphkilnError line for a bad one."""
    default = manifest.embedding
    if pooling is None:
        pooling = default.pooling if default is not None else "last"
    if pooling not in EMBEDDING_POOLINGS:
        raise GraphkilnError(f"pooling must be one of {', '.join(EMBEDDING_POOLINGS)}, got {pooling!r}")
    if normalize is None:
        normalize = default.normalize if default is not None else False
    if not isinstance(normalize, (bool, np.bool_)):
        raise GraphkilnError(f"normalize must be true or false, got {normalize!r}")
    hidden = manifest.model.hidden_size
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, (int, np.integer))
                                   or not 1 <= dimensions <= hidden):
        raise GraphkilnError(f"dimensions must be an integer from 1 to the model's {hidden}, got {dimensions!r}")
    return EmbedSettings(pooling, bool(normalize), None if dimensions is None else int(dimensions))


def batch_tokens(manifest: Manifest, settings: EmbedSettings, limit: int) -> int:
    """Padded tokens one prefill may take: ``limit``, less for a generation artifact's mean pooling
    (its float32 logits at every position, ``MAX_LOGITS_BYTES`` at most; one input still runs alone)."""
    if manifest.embedding is None and settings.pooling == "mean":
        return max(1, min(limit, MAX_LOGITS_BYTES // (4 * manifest.model.vocab_size)))
    return limit


def refuse_generation(manifest: Manifest, what: str) -> None:
    """An embedding artifact has no LM head: generating or scoring from it is one line."""
    if manifest.embedding is not None:
        raise GraphkilnError(f"{what}: this is an embedding artifact (exported with --task embed: no LM head): use "
                             "Engine.embed or POST /v1/embeddings, or export the checkpoint without --task embed")


def pool_rows(rows: np.ndarray, settings: EmbedSettings) -> np.ndarray:
    """One input's hidden-state rows [len, hidden] ("last": [1, hidden]) -> its vector (float32)."""
    rows = rows.astype(np.float32, copy=False)
    v = rows[-1] if settings.pooling == "last" else rows.mean(axis=0)
    if settings.dimensions is not None:
        v = v[: settings.dimensions]
    if settings.normalize:
        v = v / max(float(np.linalg.norm(v)), 1e-12)  # sentence-transformers' eps
    return np.ascontiguousarray(v, dtype=np.float32)


def batches(lengths: Sequence[int], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Input indices grouped into prefills, longest first: at most ``max_batch`` inputs and
    ``max_tokens`` padded tokens each (an input longer than ``max_tokens`` alone)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    out: list[list[int]] = []
    for i in order:
        if out and len(out[-1]) < max_batch and lengths[out[-1][0]] * (len(out[-1]) + 1) <= max_tokens:
            out[-1].append(i)  # the group's first is its longest: it sets the padded width
        else:
            out.append([i])
    return out


def run_batch(engine: "Engine", reqs: list, settings: EmbedSettings) -> list[np.ndarray]:
    """One prefill of ``reqs`` (``RequestState``s of a single pass) in fresh slots (the pool's next
    free ones: live slots stay where they are), released after, last first; their vectors."""
    pool = engine.pool
    first_slot = pool.live
    ids = [r.prompt_ids for r in reqs]
    longest = max(map(len, ids))
    if settings.pooling == "last":
        index = np.array([[len(p) - 1] for p in ids])
    else:  # every position; a shorter row repeats its last (not pooled)
        index = np.minimum(np.arange(longest), np.array([len(p) - 1 for p in ids])[:, None])
    slots = [pool.claim() for _ in ids]  # first_slot, first_slot + 1, ... (backends.state: packed slots)
    try:
        _, hidden = engine._prefill(reqs, index, with_hidden=True, first_slot=first_slot)
        return [pool_rows(hidden[b, : 1 if settings.pooling == "last" else len(p)], settings)
                for b, p in enumerate(ids)]
    finally:
        for slot in reversed(slots):
            pool.release(slot)


class EmbedJob:
    """One ``Scheduler.embed`` call: its inputs (prepared, checked), run a batch at a time by the
    stepping thread (``step``), and its outcome for the submitter (``result`` / ``aresult``)."""

    def __init__(self, reqs: list, settings: EmbedSettings) -> None:
        self.reqs, self.settings = reqs, settings
        self.lengths = [len(r.prompt_ids) for r in reqs]
        self.todo = sorted(range(len(reqs)), key=lambda i: -self.lengths[i])  # longest first: less padding
        self.vectors: list = [None] * len(reqs)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._waiters: list = []  # (event loop, future) of aresult callers

    def step(self, engine: "Engine", free_slots: int, max_tokens: int) -> bool:
        """Run the next batch (at most ``free_slots`` inputs and ``max_tokens`` padded tokens, at
        least one input) in the stepping thread; True once every input is done or the job failed."""
        width = self.lengths[self.todo[0]]
        n = max(1, min(free_slots, max_tokens // width, len(self.todo)))
        group, self.todo = self.todo[:n], self.todo[n:]
        try:
            for i, v in zip(group, run_batch(engine, [self.reqs[i] for i in group], self.settings)):
                self.vectors[i] = v
        except Exception as exc:  # the runner failed: this job fails alone
            self.fail(exc if isinstance(exc, GraphkilnError) else GraphkilnError(
                f"the decoder failed embedding ({(str(exc).splitlines() or [type(exc).__name__])[0][:200]}): "
                "if this repeats, re-export the artifact"))
            return True
        if not self.todo:
            self._finish()
            return True
        return False

    def fail(self, error: BaseException) -> None:
        self.error = error
        self._finish()

    def _finish(self) -> None:
        with self._lock:
            self._done.set()
            waiters, self._waiters = self._waiters, []
        for loop, fut in waiters:
            loop.call_soon_threadsafe(lambda f=fut: f.done() or f.set_result(None))

    def result(self, timeout: float | None = None) -> EmbeddingResult:
        """The vectors once every input ran (GraphkilnError: it failed; TimeoutError: not yet)."""
        if not self._done.wait(timeout):
            raise TimeoutError("the embeddings are not done yet")
        if self.error is not None:
            raise self.error
        return EmbeddingResult(np.stack(self.vectors), self.lengths)

    async def aresult(self) -> EmbeddingResult:
        """``result`` awaited without a thread (the server's route)."""
        import asyncio

        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if not self._done.is_set():
                self._waiters.append((loop, fut))
            else:
                fut.set_result(None)
        await fut
        return self.result(0)
