"""``Engine``: load an artifact and generate from it (batching, sampling, stops, streaming)."""

from __future__ import annotations

import threading
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from graphkiln.artifact import check_artifact, is_sha256, verify_checksums
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.threads import check_threads
from graphkiln.runtime.backends import check_choice, open_backend
from graphkiln.runtime.backends.ort_cpu import numpy_dtype
from graphkiln.runtime.backends.state import PAD_ID
from graphkiln.runtime.backends.vision import DEFAULT_CACHE_BYTES, VisionEncoder
from graphkiln.runtime.embed import refuse_generation
from graphkiln.runtime.request.prefix import DEFAULT_BLOCK_SIZE, open_prefix_cache
from graphkiln.runtime.request.prepare import Prepared, Preparer, Prompt, takes
from graphkiln.runtime.request.request_state import NonFiniteLogitsError  # noqa: F401  (raised by generate/stream: importable here)
from graphkiln.runtime.request.request_state import RequestState, make_request, result_of
from graphkiln.runtime.request.step import StepBatch
from graphkiln.runtime.request.tokenizer import Tokenizer
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent

KNOWN_STATE_KINDS = {"kv", "conv", "recurrent"}
BUSY = "this Engine is already generating: use one Engine per concurrent caller"


class Engine:
    """A loaded artifact and the state pools it generates with.

    One generation session at a time: ``generate``, ``prompt_logits`` and a ``stream`` from its
    first item until it is exhausted, closed (``close()``) or garbage-collected hold the engine,
    and any other call made meanwhile, from this or another thread, raises GraphkilnError
    "this Engine is already generating" at once instead of waiting (waiting would deadlock a
    thread that holds an open stream, and would hide that calls are being serialized). The
    guard is a lock taken without blocking before any work, so it is atomic. Concurrent
    callers should each load their own Engine (engines share nothing), or share one through a
    ``runtime.request.scheduler.Scheduler``, which holds the engine and batches their requests
    continuously; ``generate`` and ``stream`` run the same step (``scheduler.StepBatch``) over one
    call's prompts in the caller's thread.

    Vision-language artifacts (``manifest.vision``): ``generate``, ``stream`` and
    ``prompt_logits`` take ``images=``, per prompt a sequence of images (path, bytes, PIL image or
    uint8 array) or None. Each image token in the prompt (LLaVA's ``<image>``) stands for one
    image, in order, and is expanded to the image's placeholder tokens as the model's processor
    does; the prefill passes each image's embedding rows (``runtime.backends.vision``) to the decoder's
    seam at those positions. Images are checked (and encoded, through the embedding cache)
    before any slot is claimed, so a refused request holds nothing.
    """

    def __init__(self, artifact_dir: Path, manifest: Manifest, threads: int | None = None, *,
                 manifest_digest: str | None = None, backend: str = "onnxruntime", device: str | None = None,
                 target: str | None = None, vision_cache_bytes: int = DEFAULT_CACHE_BYTES, distributed=None,
                 prefix_cache: bool = True, prefix_cache_bytes: int | None = None,
                 prefix_block_size: int = DEFAULT_BLOCK_SIZE, batched_int8: bool = False, draft=None) -> None:
        """Trusts ``manifest`` to be validated and checked against ``artifact_dir`` (use ``load``);
        ``draft`` a ``runtime.draft_model.DraftModel`` opened for it."""
        device = device or ("cuda" if backend == "tensorrt" else "cpu")
        check_choice(backend, device, target)
        self.artifact_dir = artifact_dir
        self.manifest = manifest
        self.manifest_digest = manifest_digest  # sha256 of manifest.json, when loaded from disk
        unknown = {s.kind for s in manifest.states} - KNOWN_STATE_KINDS
        if unknown:
            raise GraphkilnError(f"artifact needs state kind(s) {sorted(unknown)} this runtime does not support: upgrade graphkiln")
        known_ops = _known_custom_ops()
        for op in manifest.custom_ops:
            if (op.domain, op.name, op.version) not in known_ops:
                raise GraphkilnError(
                    f"artifact uses custom op {op.domain}.{op.name} v{op.version}, which this graphkiln does not know: "
                    "upgrade graphkiln or re-export the artifact with this version"
                )
        self.backend, self.device = backend, device
        self.decoder, self.pool = open_backend(artifact_dir, manifest, backend, device, threads, target, distributed,
                                               manifest_digest, batched_int8)
        self.state_dtype = numpy_dtype(manifest.states[0].dtype)
        # an engine built for fewer tokens than the states allow caps requests at its capacity
        self.max_seq_len = min([s.max_seq_len for s in manifest.states] + [getattr(self.pool, "max_capacity", 10**18)])
        tok = artifact_dir / "tokenizer.json"
        self.tokenizer = Tokenizer(tok) if "tokenizer.json" in manifest.tokenizer_files and tok.is_file() else None
        self.vision: VisionEncoder | None = None  # the vision graph and its embedding cache (VLM artifacts)
        if manifest.vision is not None:
            # a runner whose first stage runs elsewhere (Ray) runs the vision graph there too
            self.vision = VisionEncoder(artifact_dir, manifest.vision, manifest.graph_for("vision", "onnxruntime"),
                                        threads, vision_cache_bytes, getattr(self.decoder, "run_vision", None))
        seam_dtype = self.state_dtype
        if manifest.vision is not None:
            seam = next((t for t in self.decoder.spec.inputs if t.role == "vision_embeddings"), None)
            seam_dtype = numpy_dtype(seam.dtype) if seam is not None else self.state_dtype
        # cached prefix blocks beside the pool (request.prefix); None: off, or a pool that keeps none
        self.prefix = (open_prefix_cache(self.pool, manifest.states, prefix_cache_bytes, prefix_block_size)
                       if prefix_cache else None)
        self.prep = Preparer(manifest, self.tokenizer, self.vision, self.decoder, self.max_seq_len, seam_dtype, backend,
                             device)
        # LoRA slots (runtime.lora) the decoder graph reads its adapter stacks from; None: no LoRA inputs
        self.adapters = self.prep.adapters = _adapter_pool(manifest, self.decoder)
        # the draft model of speculative decoding with drafts of another artifact (runtime.draft_model)
        if draft is not None and not self.prep.speculates:
            raise GraphkilnError(f"this artifact cannot speculate on {backend} on {device} (M-RoPE positions, a GPU "
                                 "or Ray runner): load it without a draft")
        self.draft = self.prep.draft = draft
        if draft is not None and draft.cost is None:
            draft.calibrate(self.decoder, self.pool)
        self._busy = threading.Lock()  # held by the running session; see the class docstring

    @classmethod
    def load(cls, artifact_dir: str | Path, threads: int | None = None, check_files: bool = True,
             expected_digest: str | None = None, *, backend: str = "onnxruntime", device: str | None = None,
             target: str | None = None, vision_cache_bytes: int = DEFAULT_CACHE_BYTES,
             distributed=None, prefix_cache: bool = True, prefix_cache_bytes: int | None = None,
             prefix_block_size: int = DEFAULT_BLOCK_SIZE, batched_int8: bool = False,
             draft: str | Path | None = None, draft_cost: float | None = None,
             slots: int | None = None) -> "Engine":
        """Open an artifact. The manifest is validated and every path in it must stay inside the
        artifact; ``check_files`` verifies every file's sha256 against the manifest;
        ``expected_digest`` (the sha256 of manifest.json, as ``graphkiln inspect`` prints it) pins
        the artifact: any other manifest, hence (files are then always checked) any other file,
        is refused. ``backend``/``device`` choose what runs it (``runtime.backends``; default
        onnxruntime on the CPU), ``target`` which of the artifact's graphs (default: the one the
        backend runs best). ``vision_cache_bytes`` bounds a vision-language artifact's image
        embedding cache (0: no cache). ``distributed`` ("ray" or a ``runtime.backends.distributed.RayOptions``)
        runs a pipeline-staged artifact with each stage in its own Ray actor (``runtime.backends.distributed``).
        ``prefix_cache`` keeps the KV rows (and conv state snapshots) of prompts and generated text
        in blocks of ``prefix_block_size`` tokens, at most ``prefix_cache_bytes`` of them (default:
        2 GiB, at most a quarter of the memory available), so a request whose prompt starts with a
        cached prefix prefills only the rest (``runtime.request.prefix``; CPU pools only for now).
        ``batched_int8`` runs steps of many token rows (batched decode, prefill) through a
        quantized artifact's batched-step graph: int8 weights derived from its blocks at load, faster
        with many rows, with slightly different numerics (``graphkiln.batched_int8``). ``draft``: an
        artifact of the same tokenizer (a smaller or quantized model) whose drafts requests with
        ``GenerationConfig(speculative="draft[:K]")`` verify (``runtime.draft_model``); ``draft_cost``
        a draft step's cost relative to the target's (default: measured at load; 0 drafts whatever
        it costs), which decides whether and how far drafting pays (``request.speculate``).
        ``slots``: how many requests of the artifact's full length the caller will hold at once (a
        ``Scheduler``'s ``max_batch``; ``graphkiln serve`` passes its --max-batch, else 1), counted
        in the memory check.

        Memory: before any file is hashed or any session built, what the load will allocate (the
        sessions' weights, the state pools of ``slots``, an explicit ``prefix_cache_bytes``, the
        batched-step graph's derived weights, the draft's weights and pools) is compared with the
        memory available (``check_load_memory``); more is one GraphkilnError line naming the figures
        and the flags that lower them, never the OOM killer."""
        device = device or ("cuda" if backend == "tensorrt" else "cpu")
        check_choice(backend, device, target)
        if threads is not None and distributed is None:  # before the files are hashed (every session checks
            check_threads(threads)                       # again where it is made: a Ray actor on its own host)
        if distributed is not None:  # refused before any file is read (Ray missing: the extra to install)
            from graphkiln.runtime.backends.distributed import check_distributed, import_ray

            check_distributed(distributed)
            import_ray()
        root = Path(artifact_dir)
        if expected_digest is not None and not is_sha256(expected_digest):
            raise GraphkilnError(f"expected digest {expected_digest!r} is not a sha256 (64 hex digits): "
                                 "copy the digest line of 'graphkiln inspect'")
        if not root.is_dir():
            raise GraphkilnError(f"{root} is not a directory: pass an artifact written by 'graphkiln export'")
        manifest, digest = Manifest.read_with_digest(root, expected_digest)
        # paths and the data files graphs name now; the hashes, which read every byte, once the memory fits
        check_artifact(root, manifest, hash_files=False)
        drafted = None
        if draft is not None:
            from graphkiln.runtime.draft_model import DraftModel

            drafted = DraftModel.read(draft, manifest)
        if draft is not None and draft_cost is not None:  # refused before anything is hashed or built
            draft_cost = _draft_cost(draft_cost)
        check_load_memory(root, manifest, backend=backend, device=device, target=target, distributed=distributed,
                          prefix_cache_bytes=prefix_cache_bytes if prefix_cache else None,
                          batched_int8=batched_int8, slots=slots, draft=drafted)
        if check_files or expected_digest is not None:
            verify_checksums(root, manifest)
        drafter = None
        if drafted is not None:
            drafter = DraftModel.open(*drafted, threads, check_files)
            if draft_cost is not None:
                drafter.cost = draft_cost
        return cls(root, manifest, threads, manifest_digest=digest, backend=backend, device=device, target=target,
                   vision_cache_bytes=vision_cache_bytes, distributed=distributed, prefix_cache=prefix_cache,
                   prefix_cache_bytes=prefix_cache_bytes, prefix_block_size=prefix_block_size, batched_int8=batched_int8,
                   draft=drafter)

    # -- inputs ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (image tokens not expanded), checked against the vocabulary and
        the maximum sequence length."""
        ids = self.prep.token_ids(prompt)
        self.prep.check_length(ids)
        return ids

    @property
    def image_token_text(self) -> str:
        """How the image token is written in a text prompt (LLaVA: ``<image>``)."""
        return self.prep.image_token_text

    def hold(self) -> None:
        """Hold the engine for a driver that keeps it (``Scheduler``), or refuse at once
        (GraphkilnError) if another holds it; ``unhold`` ends it."""
        if not self._busy.acquire(blocking=False):
            raise GraphkilnError(BUSY)

    def unhold(self) -> None:
        self._busy.release()

    # -- LoRA adapters --------------------------------------------------------------------
    # Thread-safe and never blocking a running session: a Scheduler may hold the engine meanwhile.

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load the PEFT LoRA adapter directory ``path`` under ``name`` into a free slot (or the least
        recently used one no request holds); requests choose it with ``GenerationConfig(adapter=name)``.
        A bad adapter, a name already loaded or every slot in use: one GraphkilnError line."""
        self._lora_pool(f"load adapter {name!r}").load(name, path)

    def unload_adapter(self, name: str) -> None:
        """Unload adapter ``name``; refused (GraphkilnError) while running requests use it."""
        self._lora_pool(f"unload adapter {name!r}").unload(name)

    def adapter_names(self) -> list[str]:
        """The loaded adapters' names (none for an artifact without LoRA inputs)."""
        return self.adapters.names() if self.adapters is not None else []

    def _lora_pool(self, what: str):
        if self.adapters is None:
            raise GraphkilnError(f"{what}: this artifact takes no LoRA adapters: re-export it with "
                                 "'graphkiln export ... --lora-rank R'")
        return self.adapters

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], config: GenerationConfig | None = None, *,
                 images=None) -> list[GenerationResult]:
        """Generate for one prompt or a batch; ``images``: per prompt a list of images or None
        (for a single prompt, its list of images or one image). ``prompt_ids`` of each result are
        the ids the model saw (image tokens expanded)."""
        refuse_generation(self.manifest, "generate")
        reqs: list[RequestState] = []
        for _ in self._run(self._as_batch(prompts), config, reqs, images, _is_single(prompts)):
            pass
        return [result_of(r) for r in reqs]

    def stream(self, prompts: Prompt | Sequence[Prompt], config: GenerationConfig | None = None, *,
               images=None) -> Iterator[TokenEvent]:
        """Yield tokens as they are produced; closing the iterator cancels the remaining work.
        ``images`` as for ``generate``.

        From its first item until it is exhausted, closed or garbage-collected the stream holds
        the engine (see the class docstring): close an abandoned stream before the next call."""
        refuse_generation(self.manifest, "stream")
        return self._run(self._as_batch(prompts), config, [], images, _is_single(prompts))

    @staticmethod
    def _as_batch(prompts) -> list[Prompt]:
        if isinstance(prompts, np.ndarray):
            return [prompts] if prompts.ndim == 1 else list(prompts)
        # a sequence of numbers is one prompt (encode refuses the ones that are not token ids)
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, float, np.number))):
            return [prompts]
        return list(prompts)

    def prompt_logits(self, prompt_ids: Sequence[Sequence[int]], images=None) -> list[np.ndarray]:
        """Logits at every prompt position, [len_i, vocab] per prompt, from one batched prefill
        (``images`` per prompt as for ``generate``; len_i counts the expanded image tokens).

        Raw logits: NaN/Inf are returned as they are (``graphkiln verify`` reports them)."""
        refuse_generation(self.manifest, "prompt_logits")
        with self._exclusive():
            prompts = list(prompt_ids)
            if not prompts:
                raise GraphkilnError("prompt_logits needs at least one prompt")
            reqs = _passes(self.prep.prepare(prompts, images, single=False))
            self.prep.encode_images(reqs)
            ids = [r.prompt_ids for r in reqs]
            longest = max(map(len, ids))
            self.pool.reserve(len(ids), longest)
            slots = [self.pool.claim() for _ in ids]
            try:
                logits = self._prefill(reqs, np.tile(np.arange(longest), (len(ids), 1)))
            finally:
                for slot in reversed(slots):
                    self.pool.release(slot)
            return [logits[b, : len(p)].copy() for b, p in enumerate(ids)]  # the graph reuses its logits buffer

    def prompt_hidden_states(self, prompts: Prompt | Sequence[Prompt], images=None) -> list[np.ndarray]:
        """The last layer's hidden states after the final norm (transformers' ``last_hidden_state``)
        at every prompt position, [len_i, hidden] in the model dtype per prompt, from one batched
        prefill (prompts as for ``generate``: text or token ids; ``images`` likewise). Needs an
        artifact exported with ``--return-hidden-states``. Logits are computed at every position
        too (the graph gives hidden states where it gives logits)."""
        return self._prompt_pass(prompts, images, what="prompt_hidden_states")

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None, *, images=None) -> np.ndarray:
        """One vector per prompt (text or token ids; one prompt gives [1, d]), [n, d] float32, pooled
        from the final-norm hidden states (``runtime.embed``): ``pooling`` "last" or "mean",
        ``normalize`` to unit length, ``dimensions`` the first d values (Matryoshka truncation, then
        normalised when ``normalize``). Defaults: the artifact's (``export --task embed``); a
        ``--return-hidden-states`` artifact's are "last", not normalised (its raw last-token row).
        Batched prefills in fresh slots, released after; nothing is sampled."""
        return self.embed_with_usage(prompts, pooling, normalize, dimensions, images=images).vectors

    def embed_with_usage(self, prompts: Prompt | Sequence[Prompt], pooling: str | None = None,
                         normalize: bool | None = None, dimensions: int | None = None, *, images=None):
        """``embed``'s vectors and each prompt's token count (``runtime.embed.EmbeddingResult``)."""
        from graphkiln.runtime.embed import (MAX_BATCH, MAX_TOKENS, EmbeddingResult, batch_tokens, batches,
                                             embed_settings, run_batch)

        settings = embed_settings(self.manifest, pooling, normalize, dimensions)
        with self._exclusive():
            self.prep.check_hidden_states("embed")
            batch = self._as_batch(prompts)
            if not batch:
                raise GraphkilnError("embed needs at least one prompt")
            reqs = _passes(self.prep.prepare(batch, images, single=_is_single(prompts)))
            self.prep.encode_images(reqs)
            lengths = [len(r.prompt_ids) for r in reqs]
            groups = batches(lengths, MAX_BATCH, batch_tokens(self.manifest, settings, MAX_TOKENS))
            self.pool.reserve(max(map(len, groups)), max(lengths))
            vectors: list = [None] * len(reqs)
            for group in groups:
                for i, v in zip(group, run_batch(self, [reqs[i] for i in group], settings)):
                    vectors[i] = v
            return EmbeddingResult(np.stack(vectors), lengths)

    def _prompt_pass(self, prompts, images, *, what: str) -> list[np.ndarray]:
        """One prefill of ``prompts`` in fresh slots, released after; per prompt its final-norm
        hidden states at every position."""
        with self._exclusive():
            self.prep.check_hidden_states(what)
            batch = self._as_batch(prompts)
            if not batch:
                raise GraphkilnError(f"{what} needs at least one prompt")
            reqs = _passes(self.prep.prepare(batch, images, single=_is_single(prompts)))
            self.prep.encode_images(reqs)
            ids = [r.prompt_ids for r in reqs]
            longest = max(map(len, ids))
            index = np.minimum(np.arange(longest), np.array([len(p) - 1 for p in ids])[:, None])
            self.pool.reserve(len(ids), longest)
            slots = [self.pool.claim() for _ in ids]
            try:
                _, out = self._prefill(reqs, index, with_hidden=True)
            finally:
                for slot in reversed(slots):
                    self.pool.release(slot)
            # the graph reuses its output buffers: copied
            return [out[b, : len(p)].copy() for b, p in enumerate(ids)]

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the engine for one session, or refuse at once if another holds it."""
        if not self._busy.acquire(blocking=False):
            raise GraphkilnError(BUSY)
        try:
            yield
        finally:
            self._busy.release()

    def _prefill(self, reqs: list[RequestState], logits_index: np.ndarray, with_hidden: bool = False,
                 first_slot: int = 0):
        """One prefill of ``reqs`` (request b in batch row b, slot ``first_slot + b``), each request's
        image rows replacing the embeddings at its image positions (flat token row ``b * seq + position``);
        the runner's logits, or with ``with_hidden`` (logits, hidden states)."""
        ids = [r.prompt_ids for r in reqs]
        n, longest = len(ids), max(map(len, ids))
        input_ids = np.full((n, longest), PAD_ID, np.int64)
        for b, p in enumerate(ids):
            input_ids[b, : len(p)] = p
        positions = np.tile(np.arange(longest, dtype=np.int64), (n, 1))
        lengths = np.array([len(p) for p in ids], np.int64)
        extra = self.prep.extra(reqs, np.zeros(n, np.int64), longest)
        kwargs = {"extra": extra} if extra else {}
        if with_hidden:  # only then: runners without hidden states have no such keyword
            kwargs["with_hidden"] = True
        if first_slot:  # likewise: the runners that cannot run a sub-range of slots have none
            kwargs["first_slot"] = first_slot
        with_images = [(b, r) for b, r in enumerate(reqs) if r.image_rows is not None]
        if not with_images:
            return self.decoder.run(self.pool, input_ids, positions, logits_index.astype(np.int64), lengths, **kwargs)
        rows = np.concatenate([r.image_rows for _, r in with_images])
        indices = np.concatenate([b * longest + r.image_positions for b, r in with_images]).astype(np.int64)
        return self.decoder.run(self.pool, input_ids, positions, logits_index.astype(np.int64), lengths,
                                vision=(rows, indices), **kwargs)

    def _run(self, prompts: list[Prompt], config: GenerationConfig | None, reqs: list[RequestState], images=None,
             single: bool = False) -> Iterator[TokenEvent]:
        """The events of one session; holds the engine from the first item until the generator
        finishes, fails or is closed (``yield from`` passes a close on to ``_steps``, whose
        ``finally`` frees the slots before the engine is released)."""
        with self._exclusive():
            yield from self._steps(prompts, config, reqs, images, single)

    def _steps(self, prompts: list[Prompt], config: GenerationConfig | None, reqs: list[RequestState], images=None,
               single: bool = False) -> Iterator[TokenEvent]:
        """One call's prompts as a batch of the scheduler's step (``runtime.request.step.StepBatch``):
        all admitted at the first step (one batched prefill of whole prompts, no token budget),
        then decoded together, each leaving as it finishes. A request's error (NaN logits) is
        raised at the step that meets it, before that step's events."""
        if not prompts:
            if images is not None:
                self.prep.per_prompt_images(images, 0, False)  # images without prompts: refused as a mismatch
            return
        cfg, params = self.prep.resolve(config)
        for i, prepared in enumerate(self.prep.prepare(prompts, images, single)):
            reqs.append(make_request(self.prep, i, prepared, cfg, params))
        active = [r for r in reqs if r.runs]
        for r in reqs:
            if not r.runs:
                r.finish_reason = "length"
        if not active:
            return
        self.prep.encode_images(active)  # before any slot is claimed: a failure holds nothing
        capacity = max(r.position + r.budget for r in active)
        self.pool.reserve(len(active), capacity)
        if self.draft is not None:
            self.draft.reserve(len(active), capacity)
        batch = StepBatch(self.prep, self.decoder, self.pool, step_tokens=None, joinable=takes(self.decoder.run, "first_slot"),
                          prefix=self.prefix)
        waiting = deque(active)
        try:
            while waiting or batch.rows:
                plan = batch.plan(waiting)
                failed = next((r for r in plan.cancelled if r.error is not None), None)
                if failed is not None:  # its adapter was unloaded meanwhile
                    raise failed.error
                stepped = batch.execute(plan)
                failed = next((r for r in stepped if r.error is not None), None)
                if failed is not None:
                    raise failed.error
                batch.retire()
                for r in stepped:
                    events, r.events = r.events, []
                    yield from events
        finally:
            # Failure or cancellation (the caller closed the stream): free what is still held.
            batch.release_all()


def _adapter_pool(manifest: Manifest, runner):
    """The LoRA slots for ``runner``'s adapter stacks (``runtime.lora.AdapterPool``), bound to it; None
    for an artifact without LoRA inputs."""
    if manifest.lora is None:
        return None
    from graphkiln.runtime.lora import AdapterPool, LoraTarget

    shapes: dict = {}
    for t in runner.spec.inputs:
        if t.role in ("lora_a", "lora_b"):
            shapes.setdefault((t.layer, t.module), {})[t.role] = t.shape
    targets = [LoraTarget(layer, module, s["lora_a"][1], s["lora_b"][2]) for (layer, module), s in sorted(shapes.items())]
    pool = AdapterPool(targets, manifest.lora.rank, manifest.lora.max_loras, num_layers=manifest.model.num_layers,
                       module_paths=manifest.lora.module_paths or None)
    runner.bind_adapters(pool)
    return pool


def check_load_memory(root: Path, manifest: Manifest, *, backend: str = "onnxruntime", device: str = "cpu",
                      target: str | None = None, distributed=None, prefix_cache_bytes: int | None = None,
                      batched_int8: bool = False, slots: int | None = None, draft=None) -> None:
    """Refuse in one line (``memory.require_memory``) a load whose allocations would not fit in the
    memory available now: the CPU sessions (``ort_cpu.session_file_bytes`` x ``ort_cpu.LOAD_FACTOR``
    plus ``ort_cpu.SESSION_OVERHEAD_BYTES`` each), ``slots`` state-pool slots of the artifact's full length, an explicit
    prefix-cache budget, the batched-step graph's derived weights (``batched_int8.derived_bytes``)
    and a draft (``DraftModel.read``'s triple: its weights and its pools beside the slots). The
    message names each figure and the flag that lowers it, largest first. Called before any file
    is hashed or any session built, with the artifact's paths already checked. Only onnxruntime on
    this machine's CPU is counted: a GPU's weights live in its own memory, and a Ray stage checks
    its own host (its pools when they are sized)."""
    from graphkiln.memory import require_memory
    from graphkiln.runtime.backends import ort_cpu
    from graphkiln.runtime.backends.state import StatePool
    from graphkiln.untrusted import show

    if (backend, device) != ("onnxruntime", "cpu") or distributed is not None:
        return
    names = [s.graph for s in manifest.stages] if manifest.stages else ["decoder"]
    specs = [manifest.graph(n, target) if target else manifest.graph_for(n, backend) for n in names]
    if manifest.vision is not None:
        specs.append(manifest.graph_for("vision", "onnxruntime"))
    weights = ort_cpu.session_file_bytes(root, specs)
    quantized = manifest.model.quant is not None
    need = int(weights * ort_cpu.LOAD_FACTOR) + len(specs) * ort_cpu.SESSION_OVERHEAD_BYTES
    parts = [(need, f"the sessions {_gib(need)} ({ort_cpu.LOAD_FACTOR} x {_gib(weights)} of graph files, "
                    f"{len(specs)} x {_gib(ort_cpu.SESSION_OVERHEAD_BYTES)})",
              "use a machine with more memory" if quantized else "re-export with --quant int4 (or --dtype fp16)")]
    capacity = min(s.max_seq_len for s in manifest.states)
    if _is_count(slots):
        pools = StatePool(manifest.states, ort_cpu.numpy_dtype(manifest.states[0].dtype)).bytes_for(slots, capacity)
        parts.append((pools, f"state pools for {slots} request(s) x {capacity} tokens {_gib(pools)}",
                      f"pass a smaller --max-batch (now {slots})" if slots > 1 else
                      "re-export with a smaller --max-seq-len"))
    if _is_count(prefix_cache_bytes, 0):
        parts.append((prefix_cache_bytes, f"the prefix cache budget {_gib(prefix_cache_bytes)}", "pass a smaller --prefix-cache-bytes"))
    if batched_int8:  # its own session over the same files' blocks, and the int8 weights derived for it
        batched = next((b for b in manifest.batched if (b.graph, b.target) == (specs[0].name, specs[0].target)), None)
        if batched is not None:
            from graphkiln.batched_int8 import derived_bytes

            derived = derived_bytes(batched)
            derived += ort_cpu.SESSION_OVERHEAD_BYTES
            parts.append((derived, f"the --batched-int8 derived weights {_gib(derived)}", "drop --batched-int8"))
    if draft is not None:
        draft_root, draft_manifest, _ = draft
        draft_weights = ort_cpu.session_file_bytes(draft_root, [draft_manifest.graph_for("decoder", "onnxruntime")])
        need = int(draft_weights * ort_cpu.LOAD_FACTOR) + ort_cpu.SESSION_OVERHEAD_BYTES
        if _is_count(slots):
            dtype = ort_cpu.numpy_dtype(draft_manifest.states[0].dtype)
            need += StatePool(draft_manifest.states, dtype).bytes_for(
                slots, min([capacity] + [s.max_seq_len for s in draft_manifest.states]))
        parts.append((need, f"the --draft model {show(str(draft_root))} {_gib(need)}", "drop --draft or pass a smaller draft"))
    parts.sort(key=lambda p: -p[0])
    what = f"loading the artifact {show(str(root))} ({', '.join(label for _, label, _ in parts)})"
    require_memory(sum(n for n, _, _ in parts), what, "; ".join(dict.fromkeys(r for n, _, r in parts if n)))


def _is_count(value, least: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _draft_cost(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise GraphkilnError(f"draft_cost must be a finite number >= 0 (a draft step's cost relative to the "
                             f"target's; 0 drafts whatever it costs), got {value!r}")
    return float(value)


def _is_single(prompts) -> bool:
    """Whether ``prompts`` is one prompt (text or token ids) rather than a batch (as ``_as_batch``)."""
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number)))


def _passes(prepared: list[Prepared]) -> list[RequestState]:
    """Requests for a single pass over their prompts (nothing generated, nothing sampled)."""
    return [RequestState(i, p.ids, 0, None, images=p.images, image_positions=p.image_positions, layout=p.layout)
            for i, p in enumerate(prepared)]


def _known_custom_ops() -> set[tuple[str, str, int]]:
    from graphkiln.ops import specs  # torch-free

    return {(s.domain, s.name, s.version) for s in specs().values()}
