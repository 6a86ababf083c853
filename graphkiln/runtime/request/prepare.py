"""Request preparation: everything a request needs before it may be admitted.

A prompt (text or token ids) and its images become a ``Prepared`` prompt (ids with image tokens
expanded, the decoded images, their positions, the per-token layout), and a ``GenerationConfig``
is resolved against the artifact's defaults into settings and sampling parameters. Every refusal
of a request happens here, before any slot is claimed or anything runs, so a refused request
holds nothing. Shared by the two drivers of the step (``Engine``: one call's prompts;
``request.scheduler.Scheduler``: many callers), neither of which prepares anything itself.
"""

from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime.backends.vision import ImageInput, VisionEncoder, check_placeholder_count, expand_placeholders
from graphkiln.runtime.prompt_layout import PromptLayout, needed_roles, pack
from graphkiln.runtime.request.sampling import SamplingParams
from graphkiln.runtime.request.tokenizer import Tokenizer
from graphkiln.runtime.requests import GenerationConfig, _is_int

Prompt = str | Sequence[int]
ImageSource = object  # one image as a request gives it: a path, an image file's bytes, a PIL image or a uint8 array


@dataclass(eq=False)
class Prepared:
    """One prompt, checked and ready: ``ids`` as the model sees them (image tokens expanded),
    ``images`` decoded (in prompt order), ``image_positions`` the prompt position of each image
    embedding row (None: no images), ``layout`` its per-token extras (None: plain text)."""

    ids: list[int]
    images: list[ImageInput]
    image_positions: np.ndarray | None
    layout: PromptLayout | None

    @property
    def image_spans(self) -> tuple[tuple[int, int, str], ...]:
        """(start, end, content hash) of each image's placeholder positions, in prompt order."""
        spans, at = [], 0
        for im in self.images:
            start = int(self.image_positions[at])
            spans.append((start, start + im.tokens, im.key))
            at += im.tokens
        return tuple(spans)


class Preparer:
    """Prepares requests for one loaded artifact (module docstring). ``runner`` is the step
    runner (its graph spec says which layout inputs it takes, its ``run`` whether it takes image
    rows); ``vision`` the vision graph and its embedding cache (VLM artifacts), else None."""

    def __init__(self, manifest: Manifest, tokenizer: Tokenizer | None, vision: VisionEncoder | None, runner,
                 max_seq_len: int, seam_dtype: np.dtype, backend: str, device: str) -> None:
        self.manifest = manifest
        self.tokenizer = tokenizer
        self.vision = vision
        self.max_seq_len = max_seq_len
        self.seam_dtype = seam_dtype  # the decoder's vision_embeddings dtype
        self.backend, self.device = backend, device  # named in refusals
        self.runner = runner
        self.layout_roles = needed_roles({t.role for t in runner.spec.inputs})
        # the engine's LoRA slots (runtime.lora.AdapterPool) when the graph takes LoRA inputs
        self.adapters = None
        # structured output (request.constraint): the tokenizer for grammars, built on first use,
        # and the grammars compiled lately (resolve compiles, make_request reads them back)
        from graphkiln.runtime.request.constraint import Grammars

        self.grammars = Grammars(tokenizer.path if tokenizer is not None else None, manifest.model.vocab_size,
                                 manifest.generation.eos_token_ids)
        self._compiled: dict[tuple[str, str], object] = {}  # request.constraint.Grammar
        # speculative decoding (request.speculate): plain positions, and the CPU runner in this
        # process (whose rows may take several tokens onto a filled cache); slot states (conv,
        # recurrent) are snapshotted around a verification; drafts of a draft model need ``draft``
        # (``runtime.draft_model.DraftModel``, set by the engine)
        self.speculates = (not self.layout_roles and (backend, device) == ("onnxruntime", "cpu")
                           and not hasattr(runner, "submit"))
        self.slot_states = any(s.kind != "kv" for s in manifest.states)
        self.draft = None

    # -- prompts --------------------------------------------------------------------------

    def token_ids(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (image tokens not expanded), checked against the vocabulary."""
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

    def check_length(self, ids: list[int], images: Sequence[ImageInput] = ()) -> None:
        if len(ids) >= self.max_seq_len:
            expanded = (f" with its {len(images)} image(s) expanded to {sum(im.tokens for im in images)} placeholder "
                        "tokens" if images else "")
            raise GraphkilnError(
                f"prompt has {len(ids)} tokens{expanded} but the artifact's maximum sequence length is "
                f"{self.max_seq_len}: shorten the prompt" + (", pass fewer images" if images else "")
                + " or re-export with a larger --max-seq-len"
            )

    def prepare(self, prompts: list[Prompt], images, single: bool) -> list[Prepared]:
        """Every prompt prepared (``images``: per prompt a list of images or None, or for a
        ``single`` prompt its list or one image); every refusal happens here."""
        per_prompt = self.per_prompt_images(images, len(prompts), single)
        out = []
        for i, (prompt, sources) in enumerate(zip(prompts, per_prompt)):
            ids = self.token_ids(prompt)
            if self.vision is None:
                self.check_length(ids)
                out.append(Prepared(ids, [], None, self.layout(ids, [], None)))
                continue
            vision = self.manifest.vision
            text = self.image_token_text
            check_placeholder_count(ids, vision.image_token_id, len(sources), prompt=i, token_text=text)
            loaded = [self.vision.load(src, f"image {j} of prompt {i}") for j, src in enumerate(sources)]
            ids, positions = expand_placeholders(ids, vision.image_token_id, [im.tokens for im in loaded], prompt=i,
                                                 token_text=text, rule=vision.placeholder)
            self.check_length(ids, loaded)
            out.append(Prepared(ids, loaded, positions, self.layout(ids, loaded, positions)))
        return out

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

    def per_prompt_images(self, images, n: int, single: bool) -> list[list[ImageSource]]:
        """``images`` as one list per prompt; one-line refusals for a shape that does not match
        the prompts and for images given to a text-only artifact."""
        if images is None:
            return [[] for _ in range(n)]
        if is_image(images):
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
            if single and all(is_image(e) for e in entries):  # generate(prompt, images=[img, ...])
                entries = [entries]
            if len(entries) != n:
                raise GraphkilnError(f"images has {len(entries)} {'entry' if len(entries) == 1 else 'entries'} but "
                                     f"there are {n} prompts: pass one entry per "
                                     "prompt (a list of that prompt's images, or None)")
            lists = []
            for i, e in enumerate(entries):
                if e is None:
                    lists.append([])
                elif is_image(e):
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
        if given and not takes(self.runner.run, "vision"):
            raise GraphkilnError(f"images are not supported on the {self.backend} backend on {self.device} yet: load the "
                                 "Engine with backend='onnxruntime', device='cpu' (run --backend onnxruntime --device cpu)")
        return lists

    def encode_images(self, reqs: Sequence) -> None:
        """Each request's image rows (``image_rows``), from the cache or one vision-graph pass
        over every image not cached; the decoded pixels are dropped once encoded."""
        todo = [r for r in reqs if r.images]
        if not todo:
            return
        # an image wholly inside a reused prefix (request.prefix) is in the cache already: zero rows
        # hold its place (no run reads them) instead of a vision-graph pass
        wanted = {id(r): [not (len(r.image_spans) == len(r.images) and end <= r.done) for _, end, _ in r.image_spans]
                  or [True] * len(r.images) for r in todo}
        embeds = iter(self.vision.encode([im for r in todo for im, w in zip(r.images, wanted[id(r)]) if w]))
        hidden = self.manifest.model.hidden_size
        for r in todo:
            rows = [next(embeds) if w else np.zeros((im.tokens, hidden), self.seam_dtype)
                    for im, w in zip(r.images, wanted[id(r)])]
            r.image_rows = np.concatenate(rows).astype(self.seam_dtype, copy=False)
            r.images = []  # a request may run for long

    # -- layout ---------------------------------------------------------------------------

    def layout(self, ids: list[int], images: Sequence[ImageInput], image_positions: np.ndarray | None) -> PromptLayout | None:
        """The request's per-token extras when its decoder takes any (``runtime.prompt_layout``)."""
        if not self.layout_roles:
            return None
        spans, at = [], 0
        for im in images:
            start = int(image_positions[at])
            spans.append((start, start + im.tokens))
            at += im.tokens
        layout = PromptLayout(len(ids), tuple(spans), bidirectional_images="lookahead" in self.layout_roles)
        if "rope_position_ids" in self.layout_roles:
            from graphkiln.runtime.request.mrope import with_rope_positions

            layout = with_rope_positions(layout, ids, images, self.manifest.vision)
        return layout

    def extra(self, reqs: Sequence, starts: np.ndarray, seq: int) -> dict[str, np.ndarray] | None:
        """The layout inputs of one step over ``reqs`` (row b: request b from ``starts[b]``); None when
        the graph takes none (the GPU runners, which refuse such artifacts, take no ``extra``)."""
        extra = pack(self.layout_roles, [r.layout for r in reqs], starts, seq) if self.layout_roles else None
        if self.adapters is not None:
            extra = extra or {}
            slots = np.array([r.adapter_slot or 0 for r in reqs], np.int64)
            extra["lora_rows"] = np.flatnonzero(slots).astype(np.int64)
            extra["lora_slots"] = slots[extra["lora_rows"]]
        return extra

    # -- settings -------------------------------------------------------------------------

    def resolve(self, config: GenerationConfig | None) -> tuple[GenerationConfig, SamplingParams]:
        """``config`` with the artifact's defaults filled in, and its sampling parameters."""
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
            self.check_hidden_states("return_hidden_states")
        if c.adapter is not None:
            self.check_adapter(c.adapter)
        if c.speculative is not None and c.speculative.startswith("draft") and self.draft is None:
            raise GraphkilnError(f"speculative {c.speculative!r} needs a draft model and none is loaded: load one "
                                 "(Engine.load(..., draft=DIR); graphkiln run/serve --draft DIR) or use 'ngram'")
        self._grammar(c)  # compiled here, before the request is queued: a bad schema is refused at once
        return c, params

    def _grammar(self, cfg: GenerationConfig) -> str | None:
        """The compiled grammar of ``cfg``'s constraint (None: unconstrained), from a small cache."""
        from graphkiln.runtime.request.constraint import constraint_field

        found = constraint_field(cfg)
        if found is None:
            return None
        field, value = found
        # bounded, and a schema's key order kept (it is the output's)
        key = (field, self.grammars.text(field, value), cfg.constraint_frame)
        grammar = self._compiled.get(key)
        if grammar is None:
            if self.tokenizer is None:
                raise GraphkilnError(f"{field}: structured output needs the artifact's tokenizer.json, and this "
                                     "artifact has none")
            grammar = self.grammars.compile(field, value, cfg.constraint_frame)
            if len(self._compiled) >= 64:
                self._compiled.pop(next(iter(self._compiled)))
            self._compiled[key] = grammar
        return grammar

    def constraint(self, cfg: GenerationConfig):
        """A started ``request.constraint.Constraint`` for a resolved ``cfg``, or None."""
        grammar = self._grammar(cfg)
        return None if grammar is None else self.grammars.constraint(grammar)

    def check_adapter(self, name: str) -> None:
        """Refuse (one line) an adapter this engine does not have loaded, or any adapter on an
        artifact without LoRA inputs."""
        if self.adapters is None:
            raise GraphkilnError(f"adapter {name!r}: this artifact takes no LoRA adapters: re-export it with "
                                 "'graphkiln export ... --lora-rank R'")
        if name not in self.adapters:
            loaded = ", ".join(repr(n) for n in self.adapters.names()) or "none"
            raise GraphkilnError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded}): load it first "
                                 "(Engine.load_adapter, serve --lora NAME=DIR)")

    def check_hidden_states(self, what: str) -> None:
        """Refuse (one line) hidden states from an artifact or backend that cannot give them."""
        if getattr(self.runner, "has_hidden_states", False):
            return
        if any(t.role == "last_hidden_state" for t in self.runner.spec.outputs):
            raise GraphkilnError(f"{what}: hidden states are returned on the onnxruntime CPU backend only for now, not "
                                 f"{self.backend} on {self.device}: load the Engine with backend='onnxruntime', device='cpu'")
        raise GraphkilnError(f"{what}: this artifact's decoder graph returns no hidden states: re-export it with "
                             "'graphkiln export ... --return-hidden-states'")


def is_image(x) -> bool:
    """One image as a request gives it (anything else in ``images=`` is a list of them)."""
    from PIL import Image

    return isinstance(x, (str, os.PathLike, bytes, bytearray, memoryview, np.ndarray, Image.Image))


def takes(fn, name: str) -> bool:
    """Whether ``fn`` has a parameter ``name`` (what a step runner supports)."""
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
