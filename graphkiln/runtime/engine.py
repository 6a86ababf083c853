"""``Engine``: load an artifact and generate from it (batching, sampling, stops, streaming)."""

from __future__ import annotations

import math
import os
import threading
from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from graphkiln.artifact import check_artifact, is_sha256
from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.threads import check_threads
from graphkiln.runtime.backends import check_choice, open_backend
from graphkiln.runtime.decoder import numpy_dtype
from graphkiln.runtime.prompt_layout import PromptLayout, needed_roles, pack
from graphkiln.runtime.requests import GenerationConfig, GenerationResult, TokenEvent, _is_int
from graphkiln.runtime.sampling import SamplingParams
from graphkiln.runtime.scheduler import NonFiniteLogitsError  # noqa: F401  (raised by generate/stream: importable here)
from graphkiln.runtime.scheduler import StepBatch, RequestState, make_request, result_of
from graphkiln.runtime.state import PAD_ID
from graphkiln.runtime.tokenizer import Tokenizer
from graphkiln.runtime.vision import (DEFAULT_CACHE_BYTES, ImageInput, VisionEncoder, check_placeholder_count,
                                      expand_placeholders)

KNOWN_STATE_KINDS = {"kv", "conv"}
Prompt = str | Sequence[int]
ImageSource = object  # one image as a request gives it: a path, an image file's bytes, a PIL image or a uint8 array
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
    ``runtime.scheduler.Scheduler``, which holds the engine and batches their requests
    continuously; ``generate`` and ``stream`` run the same step (``scheduler.StepBatch``) over one
    call's prompts in the caller's thread.

    Vision-language artifacts (``manifest.vision``): ``generate``, ``stream`` and
    ``prompt_logits`` take ``images=``, per prompt a sequence of images (path, bytes, PIL image or
    uint8 array) or None. Each image token in the prompt (LLaVA's ``<image>``) stands for one
    image, in order, and is expanded to the image's placeholder tokens as the model's processor
    does; the prefill passes each image's embedding rows (``runtime.vision``) to the decoder's
    seam at those positions. Images are checked (and encoded, through the embedding cache)
    before any slot is claimed, so a refused request holds nothing.
    """

    def __init__(self, artifact_dir: Path, manifest: Manifest, threads: int | None = None, *,
                 manifest_digest: str | None = None, backend: str = "onnxruntime", device: str | None = None,
                 target: str | None = None, vision_cache_bytes: int = DEFAULT_CACHE_BYTES, distributed=None) -> None:
        """Trusts ``manifest`` to be validated and checked against ``artifact_dir`` (use ``load``)."""
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
                                               manifest_digest)
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
            seam = next((t for t in self.decoder.spec.inputs if t.role == "vision_embeddings"), None)
            self._seam_dtype = numpy_dtype(seam.dtype) if seam is not None else self.state_dtype
        self._layout_roles = needed_roles({t.role for t in self.decoder.spec.inputs})
        self._busy = threading.Lock()  # held by the running session; see the class docstring

    @classmethod
    def load(cls, artifact_dir: str | Path, threads: int | None = None, check_files: bool = True,
             expected_digest: str | None = None, *, backend: str = "onnxruntime", device: str | None = None,
             target: str | None = None, vision_cache_bytes: int = DEFAULT_CACHE_BYTES,
             distributed=None) -> "Engine":
        """Open an artifact. The manifest is validated and every path in it must stay inside the
        artifact; ``check_files`` verifies every file's sha256 against the manifest;
        ``expected_digest`` (the sha256 of manifest.json, as ``graphkiln inspect`` prints it) pins
        the artifact: any other manifest, hence (files are then always checked) any other file,
        is refused. ``backend``/``device`` choose what runs it (``runtime.backends``; default
        onnxruntime on the CPU), ``target`` which of the artifact's graphs (default: the one the
        backend runs best). ``vision_cache_bytes`` bounds a vision-language artifact's image
        embedding cache (0: no cache). ``distributed`` ("ray" or a ``runtime.distributed.RayOptions``)
        runs a pipeline-staged artifact with each stage in its own Ray actor (``runtime.distributed``)."""
        device = device or ("cuda" if backend == "tensorrt" else "cpu")
        check_choice(backend, device, target)
        if threads is not None and distributed is None:  # before the files are hashed (every session checks
            check_threads(threads)                       # again where it is made: a Ray actor on its own host)
        if distributed is not None:  # refused before any file is read (Ray missing: the extra to install)
            from graphkiln.runtime.distributed import check_distributed, import_ray

            check_distributed(distributed)
            import_ray()
        root = Path(artifact_dir)
        if expected_digest is not None and not is_sha256(expected_digest):
            raise GraphkilnError(f"expected digest {expected_digest!r} is not a sha256 (64 hex digits): "
                                 "copy the digest line of 'graphkiln inspect'")
        if not root.is_dir():
            raise GraphkilnError(f"{root} is not a directory: pass an artifact written by 'graphkiln export'")
        manifest, digest = Manifest.read_with_digest(root, expected_digest)
        check_artifact(root, manifest, hash_files=check_files or expected_digest is not None)
        return cls(root, manifest, threads, manifest_digest=digest, backend=backend, device=device, target=target,
                   vision_cache_bytes=vision_cache_bytes, distributed=distributed)

    # -- inputs ---------------------------------------------------------------------------

    def encode(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (image tokens not expanded), checked against the vocabulary and
        the maximum sequence length."""
        ids = self._token_ids(prompt)
        self._check_length(ids)
        return ids

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, (bytes, bytearray, memoryview)):  # iterable as ints: would be taken as token ids
            raise GraphkilnError(f"a prompt is text (str) or token ids, got {type(prompt).__name__}: decode bytes to str")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise GraphkilnError("this artifact has no tokenizer.json: pass token ids (--prompt-ids) instead of text")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = list(prompt)
            except TypeError:
                raise GraphkilnError(f"a prompt is text or a sequence of token ids, got {prompt!r}") from None
            bad = [t for t in ids if not _is_int(t)]
            if bad:
                raise GraphkilnError(f"prompt token {bad[0]!r} is not an integer id: pass a list of ints (or text)")
            ids = [int(t) for t in ids]
        if not ids:
            raise GraphkilnError("prompt is empty: give at least one token")
        vocab = self.manifest.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise GraphkilnError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}): check the ids")
        return ids

    def _check_length(self, ids: list[int], images: Sequence[ImageInput] = ()) -> None:
        if len(ids) >= self.max_seq_len:
            expanded = (f" with its {len(images)} image(s) expanded to {sum(im.tokens for im in images)} placeholder "
                        "tokens" if images else "")
            raise GraphkilnError(
                f"prompt has {len(ids)} tokens{expanded} but the artifact's maximum sequence length is "
                f"{self.max_seq_len}: shorten the prompt" + (", pass fewer images" if images else "")
                + " or re-export with a larger --max-seq-len"
            )

    # -- images ---------------------------------------------------------------------------

    @property
    def image_token_text(self) -> str:
        """How the image token is written in a text prompt (LLaVA: ``<image>``)."""
        tid = self.manifest.vision.image_token_id if self.manifest.vision is not None else None
        text = None
        if tid is not None and self.tokenizer is not None:
            try:  # the token's own text (special tokens included), not its decoding
                text = self.tokenizer.token_text(tid)
            except Exception:
                text = None
        return text or (f"image token {tid}" if tid is not None else "<image>")

    def _per_prompt_images(self, images, n: int, single: bool) -> list[list[ImageSource]]:
        """``images`` as one list per prompt (see the class docstring); one-line refusals for a
        shape that does not match the prompts and for images given to a text-only artifact."""
        if images is None:
            return [[] for _ in range(n)]
        if _is_image(images):
            if not (single or n == 1):
                raise GraphkilnError(f"images is one image but there are {n} prompts: pass a list with one entry per "
                                     "prompt (a list of that prompt's images, or None)")
            lists = [[images]]
        else:
            try:
                entries = list(images)
            except TypeError:
                raise GraphkilnError(f"images must be a list with one entry per prompt (a list of images or None), got "
                                     f"{type(images).__name__}") from None
            if single and all(_is_image(e) for e in entries):  # generate(prompt, images=[img, ...])
                entries = [entries]
            if len(entries) != n:
                raise GraphkilnError(f"images has {len(entries)} {'entry' if len(entries) == 1 else 'entries'} but "
                                     f"there are {n} prompts: pass one entry per "
                                     "prompt (a list of that prompt's images, or None)")
            lists = []
            for i, e in enumerate(entries):
                if e is None:
                    lists.append([])
                elif _is_image(e):
                    lists.append([e])
                else:
                    try:
                        lists.append(list(e))
                    except TypeError:
                        raise GraphkilnError(f"the images of prompt {i} must be a list of images (path, bytes, PIL image "
                                             f"or uint8 array) or None, got {type(e).__name__}") from None
        given = sum(map(len, lists))
        if given and self.vision is None:
            raise GraphkilnError(f"this artifact ({self.manifest.model.architecture}) is a text-only model and takes no "
                                 f"images, but {given} were given: drop them (--image) or use a vision-language artifact")
        if given and not self._runner_takes_vision():
            raise GraphkilnError(f"images are not supported on the {self.backend} backend on {self.device} yet: load the "
                                 "Engine with backend='onnxruntime', device='cpu' (run --backend onnxruntime --device cpu)")
        return lists

    def _runner_takes_vision(self) -> bool:
        import inspect

        try:
            return "vision" in inspect.signature(self.decoder.run).parameters
        except (TypeError, ValueError):
            return False

    def _prepare(self, prompts: list[Prompt], images, single: bool) -> list[tuple[list[int], list[ImageInput], np.ndarray | None]]:
        """Every prompt's (ids with image tokens expanded, its images decoded and checked, the
        prompt positions of its image rows); every refusal happens here, before anything runs.
        The requests' layouts come from ``_layout``."""
        per_prompt = self._per_prompt_images(images, len(prompts), single)
        out = []
        for i, (prompt, sources) in enumerate(zip(prompts, per_prompt)):
            ids = self._token_ids(prompt)
            if self.vision is None:
                self._check_length(ids)
                out.append((ids, [], None))
                continue
            vision = self.manifest.vision
            text = self.image_token_text
            check_placeholder_count(ids, vision.image_token_id, len(sources), prompt=i, token_text=text)
            loaded = [self.vision.load(src, f"image {j} of prompt {i}") for j, src in enumerate(sources)]
            ids, positions = expand_placeholders(ids, vision.image_token_id, [im.tokens for im in loaded], prompt=i,
                                                 token_text=text, rule=vision.placeholder)
            self._check_length(ids, loaded)
            out.append((ids, loaded, positions))
        return out

    def _layout(self, ids: list[int], images: Sequence[ImageInput], image_positions: np.ndarray | None) -> PromptLayout | None:
        """The request's per-token extras when its decoder takes any (``runtime.prompt_layout``)."""
        if not self._layout_roles:
            return None
        spans, at = [], 0
        for im in images:
            start = int(image_positions[at])
            spans.append((start, start + im.tokens))
            at += im.tokens
        layout = PromptLayout(len(ids), tuple(spans), bidirectional_images="lookahead" in self._layout_roles)
        if "rope_position_ids" in self._layout_roles:
            from graphkiln.runtime.mrope import with_rope_positions

            layout = with_rope_positions(layout, ids, images, self.manifest.vision)
        return layout

    def _extra(self, reqs: Sequence[RequestState], starts: np.ndarray, seq: int) -> dict[str, np.ndarray] | None:
        """The layout inputs of one step over ``reqs`` (row b: request b from ``starts[b]``); None when
        the graph takes none (the GPU runners, which refuse such artifacts, take no ``extra``)."""
        if not self._layout_roles:
            return None
        return pack(self._layout_roles, [r.layout for r in reqs], starts, seq)

    def _encode_images(self, reqs: Sequence[RequestState]) -> None:
        """Each request's image rows (``image_rows``), from the cache or one vision-graph pass
        over every image not cached."""
        todo = [r for r in reqs if r.images]
        if not todo:
            return
        embeds = iter(self.vision.encode([im for r in todo for im in r.images]))
        for r in todo:
            r.image_rows = np.concatenate([next(embeds) for _ in r.images]).astype(self._seam_dtype, copy=False)
            r.images = []  # the decoded pixels are not needed any more (a request may run for long)

    def _resolve(self, config: GenerationConfig | None) -> tuple[GenerationConfig, SamplingParams]:
        d = self.manifest.generation
        c = config or GenerationConfig()
        c = replace(
            c,
            max_new_tokens=d.max_new_tokens if c.max_new_tokens is None else c.max_new_tokens,
            stop_token_ids=d.eos_token_ids if c.stop_token_ids is None else tuple(c.stop_token_ids),
        )
        if not _is_int(c.max_new_tokens) or c.max_new_tokens < 0:
            raise GraphkilnError(f"max_new_tokens must be an integer >= 0, got {c.max_new_tokens!r}: "
                                 "pass GenerationConfig(max_new_tokens=N)")
        params = SamplingParams(
            do_sample=d.do_sample if c.do_sample is None else c.do_sample,
            temperature=d.temperature if c.temperature is None else c.temperature,
            top_k=d.top_k if c.top_k is None else c.top_k,
            top_p=d.top_p if c.top_p is None else c.top_p,
        )
        # Written so that NaN fails every comparison (an artifact's defaults are untrusted too).
        if not (0 < params.top_p <= 1 and _is_int(params.top_k) and params.top_k >= 0
                and 0 <= params.temperature < math.inf):
            raise GraphkilnError(
                f"sampling settings out of range (temperature {params.temperature!r}, top_k {params.top_k!r}, "
                f"top_p {params.top_p!r}, from these settings or the artifact's defaults): need a finite "
                "temperature >= 0, top_k >= 0, 0 < top_p <= 1; pass valid values in GenerationConfig")
        if c.stop_strings and self.tokenizer is None:
            raise GraphkilnError("stop strings need a tokenizer and this artifact has none: use stop token ids")
        if c.return_hidden_states is not None:
            self._check_hidden_states("return_hidden_states")
        return c, params

    def _check_hidden_states(self, what: str) -> None:
        """Refuse (one line) hidden states from an artifact or backend that cannot give them."""
        if getattr(self.decoder, "has_hidden_states", False):
            return
        if any(t.role == "last_hidden_state" for t in self.decoder.spec.outputs):
            raise GraphkilnError(f"{what}: hidden states are returned on the onnxruntime CPU backend only for now, not "
                                 f"{self.backend} on {self.device}: load the Engine with backend='onnxruntime', "
                                 "device='cpu'")
        raise GraphkilnError(f"{what}: this artifact's decoder graph returns no hidden states: re-export it with "
                             "'graphkiln export ... --return-hidden-states'")

    # -- generation -----------------------------------------------------------------------

    def generate(self, prompts: Prompt | Sequence[Prompt], config: GenerationConfig | None = None, *,
                 images=None) -> list[GenerationResult]:
        """Generate for one prompt or a batch; ``images``: per prompt a list of images or None
        (for a single prompt, its list of images or one image). ``prompt_ids`` of each result are
        the ids the model saw (image tokens expanded)."""
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
        with self._exclusive():
            prompts = list(prompt_ids)
            if not prompts:
                raise GraphkilnError("prompt_logits needs at least one prompt")
            reqs = [RequestState(i, ids, 0, None, images=loaded, image_positions=pos, layout=self._layout(ids, loaded, pos))
                    for i, (ids, loaded, pos) in enumerate(self._prepare(prompts, images, single=False))]
            self._encode_images(reqs)
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
        return self._prompt_pass(prompts, images, hidden=True, last_only=False, what="prompt_hidden_states")

    def embed(self, prompts: Prompt | Sequence[Prompt], images=None) -> np.ndarray:
        """Each prompt's last-token final-norm hidden state, [n, hidden] in the model dtype (the
        pooling of decoder embedding models, which put their end-of-text token last), from one
        batched prefill that computes only those rows. ``--return-hidden-states`` artifacts."""
        return np.stack(self._prompt_pass(prompts, images, hidden=True, last_only=True, what="embed"))

    def _prompt_pass(self, prompts, images, *, hidden: bool, last_only: bool, what: str) -> list[np.ndarray]:
        """One prefill of ``prompts`` in fresh slots, released after; per prompt its logits or (``hidden``)
        hidden states at every position, or (``last_only``) at its last one ([1, ...])."""
        with self._exclusive():
            if hidden:
                self._check_hidden_states(what)
            batch = self._as_batch(prompts)
            if not batch:
                raise GraphkilnError(f"{what} needs at least one prompt")
            reqs = [RequestState(i, ids, 0, None, images=loaded, image_positions=pos, layout=self._layout(ids, loaded, pos))
                    for i, (ids, loaded, pos) in enumerate(self._prepare(batch, images, single=_is_single(prompts)))]
            self._encode_images(reqs)
            ids = [r.prompt_ids for r in reqs]
            longest = max(map(len, ids))
            index = (np.array([[len(p) - 1] for p in ids]) if last_only
                     else np.minimum(np.arange(longest), np.array([len(p) - 1 for p in ids])[:, None]))
            self.pool.reserve(len(ids), longest)
            slots = [self.pool.claim() for _ in ids]
            try:
                out = self._prefill(reqs, index, with_hidden=hidden)
            finally:
                for slot in reversed(slots):
                    self.pool.release(slot)
            if hidden:
                out = out[1]
            # the graph reuses its output buffers: copied
            return [out[b, 0].copy() if last_only else out[b, : len(p)].copy() for b, p in enumerate(ids)]

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Hold the engine for one session, or refuse at once if another holds it."""
        if not self._busy.acquire(blocking=False):
            raise GraphkilnError(BUSY)
        try:
            yield
        finally:
            self._busy.release()

    def _prefill(self, reqs: list[RequestState], logits_index: np.ndarray, with_hidden: bool = False):
        """One prefill of ``reqs`` (request b in batch row b), each request's image rows replacing
        the embeddings at its image positions (flat token row ``b * seq + position``); the runner's
        logits, or with ``with_hidden`` (logits, hidden states)."""
        ids = [r.prompt_ids for r in reqs]
        n, longest = len(ids), max(map(len, ids))
        input_ids = np.full((n, longest), PAD_ID, np.int64)
        for b, p in enumerate(ids):
            input_ids[b, : len(p)] = p
        positions = np.tile(np.arange(longest, dtype=np.int64), (n, 1))
        lengths = np.array([len(p) for p in ids], np.int64)
        extra = self._extra(reqs, np.zeros(n, np.int64), longest)
        kwargs = {"extra": extra} if extra else {}
        if with_hidden:  # only then: runners without hidden states have no such keyword
            kwargs["with_hidden"] = True
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
        """One call's prompts as a batch of the scheduler's step (``runtime.scheduler.StepBatch``):
        all admitted at the first step (one batched prefill of whole prompts, no token budget),
        then decoded together, each leaving as it finishes. A request's error (NaN logits) is
        raised at the step that meets it, before that step's events."""
        if not prompts:
            if images is not None:
                self._per_prompt_images(images, 0, False)  # images without prompts: refused as a mismatch
            return
        cfg, params = self._resolve(config)
        for i, (ids, loaded, image_positions) in enumerate(self._prepare(prompts, images, single)):
            reqs.append(make_request(self, i, ids, loaded, image_positions, cfg, params))
        active = [r for r in reqs if r.runs]
        for r in reqs:
            if not r.runs:
                r.finish_reason = "length"
        if not active:
            return
        self._encode_images(active)  # before any slot is claimed: a failure holds nothing
        capacity = max(r.position + r.budget for r in active)
        self.pool.reserve(len(active), capacity)
        batch = StepBatch(self, step_tokens=None, joinable=False)
        waiting = deque(active)
        try:
            while waiting or batch.rows:
                stepped = batch.execute(batch.plan(waiting))
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


def _is_single(prompts) -> bool:
    """Whether ``prompts`` is one prompt (text or token ids) rather than a batch (as ``_as_batch``)."""
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    return isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number)))


def _is_image(x) -> bool:
    """One image as a request gives it (anything else in ``images=`` is a list of them)."""
    from PIL import Image

    return isinstance(x, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Image.Image))


def _known_custom_ops() -> set[tuple[str, str, int]]:
    from graphkiln.ops import specs  # torch-free

    return {(s.domain, s.name, s.version) for s in specs().values()}
