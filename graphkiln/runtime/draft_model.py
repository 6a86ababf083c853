"""``DraftModel``: a smaller artifact of the target's tokenizer that proposes speculative drafts.

Speculative decoding with ``GenerationConfig(speculative="draft[:K]")`` (``request.speculate``)
asks it for k tokens per step of a request. It has its own state pool beside the target's, one
slot per request that speculates: claimed at the request's first proposal, released with the
request (``release``), never while the target's pool is resized (``reserve`` follows it).

Its cache of a request lags the target's: each proposal first feeds the tokens it has not seen
(the whole prompt the first time, in chunks; later the previous step's last accepted draft and
the token chosen after it), then its own drafts one at a time. After verification the caller
sets how many of those tokens stay valid (``Speculator.draft_done``): rows past it are
overwritten by the next proposal, never read (KV rows are read below the row's start only). A
draft with conv or recurrent state (a hybrid) has its slot states copied after catching up, before
its own drafts; when verification keeps fewer than it fed, the next proposal restores that copy
and feeds the accepted tokens again.

Drafts are greedy for a greedy request, else sampled from the request's own sampling settings
with its own generator, and returned with the distributions they were drawn from (the q of the
rejection rule).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime.backends.state import StatePool
from graphkiln.runtime.request.sampling import SamplingParams, probabilities
from graphkiln.runtime.request.speculate import Proposal, Speculator

CATCH_UP_CHUNK = 512  # tokens of a request fed to the draft in one run (bounds its activations)


class DraftModel:
    def __init__(self, artifact_dir: Path, manifest: Manifest, runner, pool: StatePool) -> None:
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.runner = runner
        self.pool = pool
        self.max_seq_len = min(s.max_seq_len for s in manifest.states)
        self.slot_states = any(s.kind != "kv" for s in manifest.states)
        self.folded = bool(getattr(runner, "has_next_token", False))
        self.owners: list[Speculator | None] = []  # by draft slot: whose cache it holds
        # a draft token's cost in target runs (``Speculator.size``): measured once (``calibrate``) or
        # given (Engine.load's draft_cost), then fixed, so draft lengths, hence a seeded sampled
        # request's tokens, depend on nothing that runs meanwhile
        self.cost: float | None = None

    @classmethod
    def load(cls, artifact_dir: str | Path, target: Manifest, threads: int | None = None,
             check_files: bool = True) -> "DraftModel":
        """Open ``artifact_dir`` as a draft for an artifact whose manifest is ``target``: the same
        tokenizer and vocabulary, one text decoder graph (not staged, vision-language or LoRA), run
        by onnxruntime on the CPU.
        Anything else is one GraphkilnError line naming the difference."""
        return cls.open(*cls.read(artifact_dir, target), threads, check_files)

    @staticmethod
    def read(artifact_dir: str | Path, target: Manifest) -> tuple[Path, Manifest, str]:
        """(root, manifest, its digest) of ``artifact_dir`` checked as a draft for ``target`` (see
        ``load``) with nothing hashed or opened but the manifest and the graph protobufs: what
        ``Engine.load`` needs to count the draft's memory before anything is built."""
        from graphkiln.artifact import check_artifact

        root = Path(artifact_dir)
        if not root.is_dir():
            raise GraphkilnError(f"draft {root} is not a directory: pass an artifact written by 'graphkiln export'")
        manifest, digest = Manifest.read_with_digest(root)
        check_artifact(root, manifest, hash_files=False)
        problem = _mismatch(manifest, target)
        if problem:
            raise GraphkilnError(f"draft {root} cannot draft for this artifact: {problem}")
        return root, manifest, digest

    @classmethod
    def open(cls, root: Path, manifest: Manifest, digest: str, threads: int | None = None,
             check_files: bool = True) -> "DraftModel":
        """The draft ``read`` checked: its files hashed (``check_files``), its session built."""
        from graphkiln.artifact import verify_checksums
        from graphkiln.runtime.backends import open_backend

        if check_files:
            verify_checksums(root, manifest)
        # its threads sleep between runs: spinning, they took the target's cores (measured on 2 cores: a
        # draft step 2.6x slower); the target's spin, which is what keeps its decode fast (sleeping: 0.7x)
        runner, pool = open_backend(root, manifest, "onnxruntime", "cpu", threads, manifest_digest=digest, spinning=False)
        return cls(root, manifest, runner, pool)

    def calibrate(self, target_runner, target_pool, runs: int = 12) -> None:
        """Set ``cost``: the median one-token step of this draft over the target's, each run in
        turn with the other as during speculation (caches and thread pools then serve both; timed
        back to back, an int4 SmolLM2-135M draft step cost 0.4 of the fp32 one, in turn 0.59),
        rounded to 0.05 so that a reload on the same machine keeps it."""
        import statistics
        import time

        pools = [(self.runner, self.pool), (target_runner, target_pool)]
        for _, pool in pools:
            if pool.slots < 1 or pool.capacity < 2:
                pool.reserve(1, 2)
        args = (np.array([[0]], np.int64), np.array([[1]], np.int64), np.zeros((1, 1), np.int64), np.ones(1, np.int64))
        times: list[list[float]] = [[], []]
        for i in range(runs + 1):
            for which, (runner, pool) in enumerate(pools):
                started = time.perf_counter()
                runner.run(pool, *args)
                if i:  # the first of each is a warm-up
                    times[which].append(time.perf_counter() - started)
        ratio = statistics.median(times[0]) / max(statistics.median(times[1]), 1e-9)
        self.cost = round(round(ratio / 0.05) * 0.05, 2)

    # -- slots ----------------------------------------------------------------------------

    def reserve(self, slots: int, capacity: int) -> None:
        """Size the draft's pool with the target's (no draft slot is live between sessions)."""
        self.pool.reserve(slots, min(capacity, self.max_seq_len))
        self.owners = [None] * slots

    def release(self, spec: Speculator) -> None:
        """Free the request's draft slot, if it holds one (live slots stay packed: the last
        one's rows move into the hole, and its owner is told)."""
        if spec.draft_slot is None:
            return
        for src, dst in self.pool.release_keeping_tail(spec.draft_slot):
            self.owners[dst] = self.owners[src]
            self.owners[dst].draft_slot = dst
        self.owners[self.pool.live] = None
        spec.draft_slot, spec.draft_done, spec.draft_saved = None, 0, None

    # -- proposals ------------------------------------------------------------------------

    def room(self, position: int) -> int:
        """How many drafts the draft's capacity leaves at sequence length ``position``."""
        return self.pool.capacity - position

    def propose(self, spec: Speculator, sequence: list[int], k: int, params: SamplingParams,
                rng: np.random.Generator, most: int | None = None) -> Proposal:
        """k drafts continuing ``sequence`` (the request's prompt and tokens so far); after it the
        draft's cache holds ``sequence`` and the first k-1 drafts (``spec.draft_done`` is set to
        that; the caller lowers it to what verification kept). ``most``: the most tokens it may
        feed to catch up (the scheduler's step budget: a long prompt's catch-up must not stall
        the step); further behind, it feeds that many and proposes nothing this time."""
        if spec.draft_slot is None:
            if not self.pool.free_slots:
                return Proposal([])
            spec.draft_slot, spec.draft_done, spec.draft_saved = self.pool.claim(), 0, None
            self.owners[spec.draft_slot] = spec
        greedy = params.greedy
        drafts: list[int] = []
        qs: list[np.ndarray] = []
        if spec.draft_saved is not None and spec.draft_done < spec.draft_fed:
            # its slot states consumed drafts that were rejected: back to where it had caught up
            spec.draft_done = spec.draft_saved[0]
            self.pool.restore_slot_states(spec.draft_slot, spec.draft_saved[1])
        feed = sequence[spec.draft_done:]
        pos = spec.draft_done
        if most is not None and len(feed) > most:
            for at in range(0, most, CATCH_UP_CHUNK):
                part = feed[at: min(at + CATCH_UP_CHUNK, most)]
                self._run(spec.draft_slot, part, pos, greedy)
                pos += len(part)
            spec.draft_done = spec.draft_fed = pos
            return Proposal([])
        while True:
            for at in range(0, len(feed), CATCH_UP_CHUNK):
                part = feed[at: at + CATCH_UP_CHUNK]
                out = self._run(spec.draft_slot, part, pos, greedy)
                pos += len(part)
            if self.slot_states and not drafts:
                spec.draft_saved = (pos, self.pool.snapshot_slot_states(spec.draft_slot))
            if greedy:
                token = int(out[0, 0]) if self.folded else int(np.argmax(out[0, 0]))
                if token < 0 or (not self.folded and not np.isfinite(out[0, 0, token])):
                    break  # a broken draft proposes nothing more; the target decides alone
            else:
                q = probabilities(out[0, 0], params)
                token = int(rng.choice(len(q), p=q))
                qs.append(q)
            drafts.append(token)
            if len(drafts) == k:
                break
            feed = [token]
        spec.draft_done = spec.draft_fed = pos
        return Proposal(drafts, np.stack(qs)[: len(drafts)] if qs else None)

    def _run(self, slot: int, tokens: list[int], start: int, greedy: bool) -> np.ndarray:
        n = len(tokens)
        kwargs = {"first_slot": slot} if slot else {}
        if greedy and self.folded:
            kwargs["tokens_only"] = True
        return self.runner.run(self.pool, np.array([tokens], np.int64),
                               np.arange(start, start + n, dtype=np.int64)[None, :],
                               np.array([[n - 1]], np.int64), np.array([n], np.int64), **kwargs)


def _mismatch(draft: Manifest, target: Manifest) -> str | None:
    """What keeps ``draft`` from drafting for ``target`` (None: nothing)."""
    if draft.model.vocab_size != target.model.vocab_size:
        return (f"its vocabulary has {draft.model.vocab_size} tokens, the target's {target.model.vocab_size}: "
                "export a draft of the same model family and tokenizer")
    ours, theirs = draft.files.get("tokenizer.json"), target.files.get("tokenizer.json")
    if (ours is None) != (theirs is None) or ours != theirs:
        return "its tokenizer.json differs from the target's: a draft must use the very same tokenizer"
    if draft.stages or draft.vision is not None or draft.lora is not None:
        return "it is pipeline-staged, vision-language or LoRA: use a plain text decoder artifact"
    return None
