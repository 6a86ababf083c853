"""Parity between an artifact and its transformers reference on random prompts.

Compares logits at every prompt position (one batched prefill, rows of different
lengths) and greedy generation over ``steps`` tokens, step logits included. Needs the
``export`` extra because the reference is transformers.

Quantized artifacts (``export --quant``) are compared with the same fp32 reference, so the
difference is the quantization's, and they get their own defaults: perplexity on a text
(``graphkiln.perplexity``; the built-in prose or ``--text FILE``) within a bound of the
reference's on the same token windows, when the artifact has a tokenizer; a bound on the RMS
logits error relative to the reference logits' spread (RMS about each row's mean), and
top-1 agreement at every compared position (same context: all prompt positions, and
generation steps up to each row's first divergence). The largest error is reported but not
bounded: one token whose MoE routing flips, or a near-tie, dominates it. The greedy run is
reported too, but a quantized model may legitimately take another path at the first
near-tie, so it is only required for int8, and loosely.

Vision-language artifacts are also checked on the vision path: deterministic random RGB
images of two sizes, one image in a prompt, two images of different sizes in one prompt, and a
batch of two prompts where one has no image; the reference
(``AutoModelForImageTextToText``) gets the very pixel values the runtime computed
(``imaging.preprocess``), so the comparison covers the vision graph, the placeholder expansion
and the decoder seam, not the preprocessing (tested against transformers' processors on its
own). A case whose expanded prompt would not fit the maximum sequence length is skipped and
reported. Random text prompts avoid the image token.

A checkpoint whose transformers reference would not fit in the memory available (its parameters x 4
bytes x 1.2, from the safetensors headers, against ``memory.available_memory()``), or any checkpoint
with ``streamed=True`` (``verify --streamed-reference``), is compared with the streamed reference
instead (``export.streamed_reference``: graphkiln's torch decoder run one layer at a time from the
checkpoint, never whole in fp32). The report is the same; the greedy run is checked by teacher
forcing (the reference run once over each prompt and the tokens the artifact generated: up to each
row's first divergence, the very contexts the step-by-step reference would see) and the perplexity
is scored on the same windows. Vision-language artifacts always use transformers' reference: one
error line naming the memory it needs when it would not fit.

Non-finite logits (NaN/Inf), ours or the reference's, fail verification outright and the
report says where the first one is: an error measure cannot be trusted to carry a NaN (Python's
``max(0.0, nan)`` is 0.0). The reference is loaded with ``trust_remote_code=False``, and a
checkpoint whose config.json has ``auto_map`` (its own Python code) is refused before
transformers sees it, so nothing ever prompts or runs the checkpoint's code.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.engine import NonFiniteLogitsError

DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 2.5e-1}
# Half-precision artifacts legitimately flip near-tied greedy choices; fp32 must not.
DEFAULT_MIN_AGREEMENT = {"fp32": 1.0, "fp16": 0.75, "bf16": 0.5}
# Quantized artifacts vs the fp32 reference (RTN, block 32), measured with random weights,
# where quantization noise is at its worst (weights are noise, logits near-tied), on the
# demo model, the tests' tiny Llama and Qwen3-MoE and the 246M benchmark Llama:
#   int8: RMS error / spread 0.017-0.044, top-1 92.6-96.9%, greedy 30-70%
#   int4: RMS error / spread 0.23-0.34,   top-1 38-66%,     greedy 0-7%
# A broken int4 artifact (scales transposed, zero points dropped, nibbles swapped, rows or
# blocks permuted) measured 0.78-1.5 and top-1 <= 10%; scales off by 25%: 0.64.
DEFAULT_QUANT_RTOL = {"int8": 0.1, "int4": 0.5}  # bound on rms_rel_error
DEFAULT_QUANT_MIN_TOP1 = {"int8": 0.8, "int4": 0.2}
DEFAULT_QUANT_MIN_AGREEMENT = {"int8": 0.1, "int4": 0.0}  # greedy: random weights diverge early
# Perplexity on a text (graphkiln.perplexity) vs the reference's on the same token windows: the bound on
# the ratio. Measured on the real checkpoint (SmolLM2-135M, built-in text): int8 1.01, int4 1.11 (the
# default calibrated search; round-to-nearest 1.30); random tiny models move less. A broken int4
# artifact (every scale 25% too large) measured 2.98 on the real checkpoint.
DEFAULT_QUANT_MAX_PPL_RATIO = {"int8": 1.05, "int4": 1.25}


@dataclass(frozen=True)
class VerifyReport:
    batch_shapes: tuple[tuple[int, ...], ...]  # prompt lengths per batch checked
    steps: int
    max_abs_error: float
    max_rel_error: float
    tokens_compared: int
    tokens_agreed: int  # greedy tokens equal to the reference before each row's first divergence
    atol: float
    min_agreement: float
    quant: str | None = None  # the artifact's weight quantization ("int4", "int8"), if any
    rms_rel_error: float = 0.0  # RMS logits error / RMS of the reference logits about each row's mean
    rtol: float | None = None  # bound on rms_rel_error (quantized artifacts)
    positions_compared: int = 0  # logit rows compared (prompt positions + steps before divergence)
    positions_top1_agreed: int = 0  # ... whose argmax equals the reference's
    min_top1: float | None = None  # bound on top1_agreement (quantized artifacts)
    nonfinite: str | None = None  # where the first NaN/Inf logits were ("ours at ..."); verification stopped there
    vision_checked: tuple[str, ...] = ()  # vision-path cases compared (vision-language artifacts)
    vision_skipped: tuple[str, ...] = ()  # ... and the ones that did not fit, with why
    vision_max_abs_error: float = 0.0  # largest logits error over the vision cases (included in max_abs_error)
    # quantized artifacts with a tokenizer: perplexity on a text, ours and the reference's (same windows)
    perplexity: float | None = None
    reference_perplexity: float | None = None
    perplexity_tokens: int = 0
    max_perplexity_ratio: float | None = None  # bound on perplexity / reference_perplexity
    # "transformers" (the whole model in fp32) or "streamed" (export.streamed_reference, layer by layer)
    reference_kind: str = "transformers"

    @property
    def perplexity_ratio(self) -> float | None:
        if self.perplexity is None or not self.reference_perplexity:
            return None
        return self.perplexity / self.reference_perplexity

    @property
    def agreement(self) -> float:
        return self.tokens_agreed / max(1, self.tokens_compared)

    @property
    def top1_agreement(self) -> float:
        return self.positions_top1_agreed / max(1, self.positions_compared)

    @property
    def passed(self) -> bool:
        # with a perplexity measured on real text, it replaces the RMS bound, which was set on random
        # weights and random prompts (a real model's logits on random prompts spread differently)
        rms_applies = self.rtol is not None and self.perplexity_ratio is None
        return (self.nonfinite is None and self.max_abs_error <= self.atol and self.agreement >= self.min_agreement
                and (not rms_applies or self.rms_rel_error <= self.rtol)
                and (self.min_top1 is None or self.top1_agreement >= self.min_top1)
                and (self.max_perplexity_ratio is None or self.perplexity_ratio is None
                     or self.perplexity_ratio <= self.max_perplexity_ratio))

    def summary(self) -> str:
        text = self._summary()
        return "streamed reference (layer by layer): " + text if self.reference_kind == "streamed" else text

    def _summary(self) -> str:
        shapes = ", ".join("batch %d (lengths %s)" % (len(s), "/".join(map(str, s))) for s in self.batch_shapes)
        if self.vision_checked or self.vision_skipped:
            shapes += "; with images: " + (", ".join(self.vision_checked) or "nothing")
            if self.vision_checked and self.nonfinite is None:
                shapes += f" (max abs error {self.vision_max_abs_error:.3g})"
            if self.vision_skipped:
                shapes += "; skipped " + ", ".join(self.vision_skipped)
        greedy = (f"greedy tokens identical {self.tokens_agreed}/{self.tokens_compared} "
                  f"({100 * self.agreement:.1f}%, need {100 * self.min_agreement:.0f}%) over {self.steps} steps -> ")
        verdict = "PASS" if self.passed else "FAIL"
        if self.nonfinite is not None:
            return f"checked {shapes}; logits contain NaN/Inf ({self.nonfinite}) -> FAIL"
        if self.quant is None:
            return (f"checked {shapes}; logits max abs error {self.max_abs_error:.3g} (tolerance {self.atol:g}), "
                    f"max rel error {self.max_rel_error:.3g}; " + greedy + verdict)
        atol = f" (tolerance {self.atol:g})" if self.atol != float("inf") else ""
        rtol = f" (tolerance {self.rtol:g})" if self.rtol is not None else ""
        if self.rtol is not None and self.perplexity_ratio is not None:
            rtol = f" (tolerance {self.rtol:g} for random weights; perplexity decides)"
        top1 = f", need {100 * self.min_top1:.0f}%" if self.min_top1 is not None else ""
        ppl = ""
        if self.perplexity_ratio is not None:
            bound = f", need <= {self.max_perplexity_ratio:g}x" if self.max_perplexity_ratio is not None else ""
            ppl = (f"perplexity {self.perplexity:.3f} vs reference {self.reference_perplexity:.3f} "
                   f"({self.perplexity_ratio:.3f}x{bound}, {self.perplexity_tokens} tokens); ")
        return (f"{self.quant} weights vs fp32 reference (quantization error, not a parity check): checked {shapes}; "
                + ppl +
                f"logits RMS error / RMS spread {self.rms_rel_error:.3g}{rtol}, max abs error {self.max_abs_error:.3g}{atol}; "
                f"top-1 identical at {self.positions_top1_agreed}/{self.positions_compared} positions "
                f"({100 * self.top1_agreement:.1f}%{top1}); " + greedy + verdict)


class _NonFinite(Exception):
    """Ends a verification at the first NaN/Inf logits; the message says whose and where."""


def _load_reference(reference: str, path, vision: bool):
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.utils import logging as hf_logging

    _refuse_auto_map(reference, path)
    hf_logging.disable_progress_bar()
    try:
        auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
        given = _converted_weights(path)
        if given:  # transformers' own class for the config (``auto`` reads a name or path only)
            auto = auto._model_mapping[type(given["config"])]
        model = auto.from_pretrained(None if given else str(path), dtype=torch.float32, trust_remote_code=False,
                                     **given).eval()
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot load the reference {reference} ({str(exc).splitlines()[0][:160]})") from None
    return model


def _converted_weights(path) -> dict:
    """For a converted quantized checkpoint (a GGUF, GPTQ/AWQ...: ``models.derived``), whose
    directory holds no weight file: transformers' ``from_pretrained`` arguments giving it the
    weights, dequantized as they are read, in fp32 (this reference is whole in fp32 anyway); {}
    for an ordinary checkpoint, which transformers reads itself."""
    from graphkiln.models.derived import derived_weights

    if derived_weights(path) is None:
        return {}
    from transformers import AutoConfig

    from graphkiln.models.weights import read_tensors, tensor_headers

    state = read_tensors(path, list(tensor_headers(path)), "fp32")
    return {"config": AutoConfig.from_pretrained(str(path)), "state_dict": state}


def _refuse_auto_map(reference: str, path) -> None:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = None  # transformers (or the streamed reference) reports a missing or malformed config
    if isinstance(config, dict) and "auto_map" in config:
        raise GraphkilnError(
            f"the reference {reference} ships its own Python code (config.json has 'auto_map'), which graphkiln never "
            "runs: verify against a checkpoint of a built-in transformers architecture (drop 'auto_map' if it is one)")


def _use_streamed(streamed: bool | None, reference: str, path, vision: bool, perplexity: bool = False) -> bool:
    """Whether to verify against the streamed reference: always with ``streamed=True``, never with
    False, else when transformers' fp32 reference would not fit in the memory available. When it is
    chosen and even it would not fit (its largest layer in fp32, ``streamed_reference_bytes``), one
    GraphkilnError line naming the figure, before anything of the checkpoint is read."""
    use = _choose_streamed(streamed, reference, path, vision)
    if use:
        from graphkiln.export.streamed_reference import streamed_reference_bytes
        from graphkiln.memory import require_memory
        from graphkiln.untrusted import show

        need = streamed_reference_bytes(path, perplexity)
        require_memory(need, f"the streamed reference of {show(reference)} (one layer at a time, in fp32)",
                       "verify on a machine with more memory")
    return use


def _choose_streamed(streamed: bool | None, reference: str, path, vision: bool) -> bool:
    from graphkiln import memory
    from graphkiln.export.streamed_reference import transformers_reference_bytes

    if streamed is False:
        return False
    if vision:
        if streamed:
            raise GraphkilnError("--streamed-reference: a vision-language artifact is verified against transformers' "
                                 "whole reference model (the streamed reference has no vision tower); drop the flag")
        try:
            need = transformers_reference_bytes(path)
        except GraphkilnError:
            return False  # transformers reports the unreadable checkpoint
        available = memory.available_memory()
        if available is not None and need > available:
            raise GraphkilnError(
                f"the transformers reference {reference} needs about {need / 2**30:.1f} GiB in fp32 and "
                f"{available / 2**30:.1f} GiB of memory are available: vision-language artifacts have no streamed "
                "reference; verify on a machine with more memory")
        return False
    if streamed:
        return True
    try:
        need = transformers_reference_bytes(path)
    except GraphkilnError:
        return False  # transformers reports the unreadable checkpoint, as it always has
    available = memory.available_memory()
    return available is not None and need > available


def _check_same_vocabulary(model, vocab: int, reference: str) -> None:
    """The reference's logits must have the artifact's width to be compared at all: another
    checkpoint's head is one error line, not a numpy broadcast failure mid-comparison. ``model``:
    the transformers model, or the streamed reference."""
    from graphkiln.export.streamed_reference import StreamedReference

    if isinstance(model, StreamedReference):
        theirs = model.vocab_size
    else:
        head = model.get_output_embeddings()
        theirs = head.weight.shape[0] if head is not None else getattr(model.config.get_text_config(), "vocab_size", None)
    if theirs != vocab:
        raise GraphkilnError(f"the reference {reference} has a vocabulary of {theirs} tokens, the artifact {vocab}: "
                             "verify against the checkpoint the artifact was exported from")


def reference_perplexity(model, parts: list[list[int]]):
    """The transformers model's perplexity on the same token windows ``graphkiln.perplexity`` scores."""
    import torch

    from graphkiln.perplexity import Perplexity

    nll, count = 0.0, 0
    for part in parts:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([part])).logits[0].float()
        logp = torch.log_softmax(logits[:-1].double(), dim=-1)
        nll -= float(logp.gather(1, torch.tensor(part[1:]).unsqueeze(1)).sum())
        count += len(part) - 1
    return Perplexity(nll / count, count)


def _perplexities(engine: Engine, model, text: str | None):
    """(ours, the reference's) perplexity on ``text`` (None: the built-in prose), or None without a
    tokenizer. ``model``: the transformers model, or the streamed reference."""
    from graphkiln.export.streamed_reference import StreamedReference
    from graphkiln.perplexity import DEFAULT_WINDOW, artifact_perplexity, read_text, windows

    if engine.tokenizer is None:
        return None
    text = read_text(text)
    ours = artifact_perplexity(engine, text)
    parts = windows(engine.tokenizer.encode(text), DEFAULT_WINDOW, engine.max_seq_len)
    ref = model.perplexity(parts) if isinstance(model, StreamedReference) else reference_perplexity(model, parts)
    return ours, ref


def verify_artifact(artifact: str | Path, reference: str, steps: int = 32, seed: int = 0,
                    batch_shapes: tuple[tuple[int, ...], ...] | None = None, atol: float | None = None,
                    min_agreement: float | None = None, engine: Engine | None = None,
                    text: str | Path | None = None, streamed: bool | None = None) -> VerifyReport:
    """Compare ``artifact`` with ``reference`` (see the module docstring). A quantized artifact with a
    tokenizer is also scored on ``text`` (a file; None: the built-in prose) beside the reference.
    ``streamed``: True compares with the streamed reference (``export.streamed_reference``), False
    with transformers', None (default) with transformers' unless it would not fit in memory. An embedding
    artifact (no logits) is checked by ``export.verify_embeddings`` instead (its report has the same
    ``passed`` and ``summary``)."""

    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise GraphkilnError(f"steps must be an integer >= 1, got {steps!r}: pass e.g. --steps 32")
    if not (isinstance(seed, int) and not isinstance(seed, bool) and seed >= 0):
        raise GraphkilnError(f"seed must be an integer >= 0, got {seed!r}: pass e.g. --seed 0")
    if atol is not None and not (isinstance(atol, (int, float)) and 0 <= atol < math.inf):
        raise GraphkilnError(f"atol must be a finite number >= 0, got {atol!r}: pass e.g. --atol 1e-4 or omit it")
    if streamed is not None and not isinstance(streamed, bool):
        raise GraphkilnError(f"streamed must be True, False or None, got {streamed!r}")
    from graphkiln.export.checkpoint import prepared_checkpoint
    from graphkiln.export.streamed_reference import StreamedReference

    engine = engine or Engine.load(artifact)
    if engine.manifest.embedding is not None:  # no logits: its pooled vectors against transformers' base model
        from graphkiln.export.verify_embeddings import verify_embeddings

        return verify_embeddings(engine, reference, _refuse_auto_map, seed, atol)
    vision = engine.manifest.vision is not None
    # a GGUF or GPTQ/AWQ reference is its dequantized float weights, converted for the load (and kept
    # while the streamed reference reads them)
    with prepared_checkpoint(reference) as path:
        perplexity = engine.manifest.model.quant is not None and engine.tokenizer is not None
        if _use_streamed(streamed, reference, path, vision, perplexity):
            _refuse_auto_map(reference, path)
            with StreamedReference(path) as model:
                return _compare(engine, model, reference, steps, seed, batch_shapes, atol, min_agreement, text)
        model = _load_reference(reference, path, vision)
    return _compare(engine, model, reference, steps, seed, batch_shapes, atol, min_agreement, text)


def _compare(engine: Engine, model, reference: str, steps: int, seed: int, batch_shapes, atol, min_agreement,
             text) -> VerifyReport:
    """``verify_artifact`` once the reference is loaded: the transformers model, or the streamed reference."""
    import torch

    from graphkiln.export.streamed_reference import StreamedReference

    dtype = engine.manifest.model.dtype
    quant = getattr(engine.manifest.model, "quant", None)
    vision = engine.manifest.vision
    streamed = isinstance(model, StreamedReference)
    vocab = engine.manifest.model.vocab_size
    _check_same_vocabulary(model, vocab, reference)
    limit = engine.max_seq_len - steps
    if limit < 2:
        raise GraphkilnError(f"--steps {steps} leaves no room for a prompt under max sequence length {engine.max_seq_len}")
    shapes = batch_shapes or ((min(12, limit),), tuple(min(n, limit) for n in (7, 16, 3)))
    rng = np.random.default_rng(seed)
    max_abs = max_rel = 0.0
    compared = agreed = 0
    positions = top1 = 0
    err2 = spread2 = 0.0
    nonfinite: str | None = None
    vision_checked: list[str] = []
    vision_skipped: list[str] = []
    vision_max = 0.0
    in_vision = False  # compare() also tracks the vision cases' largest error

    def random_ids(n: int) -> list[int]:
        ids = rng.integers(0, vocab, n)
        if vision is not None:  # an image (or image row) token in a text prompt would need an image
            for tid in {vision.image_token_id, vision.placeholder.row_token_id} - {None}:
                ids[ids == tid] = (tid + 1) % vocab
        return ids.tolist()

    def compare(ours: np.ndarray, ref: np.ndarray, where) -> None:
        """Accumulate the errors of rows [..., vocab]; ``where(i)`` names flat row i for a
        NaN/Inf report. Raises _NonFinite first, so every measure below sees finite values."""
        nonlocal max_abs, max_rel, positions, top1, err2, spread2, vision_max
        for who, a in (("ours", ours), ("reference", ref)):
            bad = ~np.isfinite(a).reshape(-1, a.shape[-1]).all(-1)
            if bad.any():
                raise _NonFinite(f"{who} at {where(int(bad.argmax()))}")
        err2 += float(np.square(ours - ref, dtype=np.float64).sum())
        spread2 += float(np.square(ref - ref.mean(-1, keepdims=True), dtype=np.float64).sum())
        err = float(np.abs(ours - ref).max())
        max_abs = max(max_abs, err)
        if in_vision:
            vision_max = max(vision_max, err)
        max_rel = max(max_rel, err / max(float(np.abs(ref).max()), 1e-12))
        positions += int(np.prod(ref.shape[:-1]))
        top1 += int((ours.argmax(-1) == ref.argmax(-1)).sum())

    def compare_greedy(p: list[int], res, pixels: dict | None, where: str) -> None:
        """Our greedy run ``res`` of prompt ``p`` against the reference's, step logits included."""
        nonlocal compared, agreed
        with torch.no_grad():
            ids = torch.tensor([p])
            # An explicit mask: otherwise generate() masks every token equal to pad_token_id.
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True, **(pixels or {}))
        ref_tokens = out.sequences[0, len(p):].tolist()
        ref_logits = torch.stack(out.logits, 1)[0].float().numpy()
        compared += steps
        for t, (x, y) in enumerate(zip(res.token_ids, ref_tokens)):
            # same context up to and including step t (steps counted from 1, as the engine does)
            compare(res.logits[t], ref_logits[t], lambda _: f"generation step {t + 1} of {where}")
            if x != y:
                break
            agreed += 1

    def compare_forced(p: list[int], res, ref: np.ndarray, where: str) -> None:
        """Our greedy run ``res`` of prompt ``p`` against the streamed reference's logits ``ref`` over
        p + our tokens (teacher forcing): ``ref[len(p) - 1 + t]`` saw the context our step t saw, which
        up to the first divergence is the context the reference's own greedy run would have had."""
        nonlocal compared, agreed
        compared += steps
        for t, x in enumerate(res.token_ids):
            row = ref[len(p) - 1 + t]
            compare(res.logits[t], row, lambda _: f"generation step {t + 1} of {where}")
            if x != int(row.argmax()):
                break
            agreed += 1

    def streamed_text_checks() -> None:
        """The text batches against the streamed reference: our prompt logits and greedy runs for
        every batch first, then one pass of the reference over every prompt and its continuation,
        compared in the order the transformers path compares."""
        done, pending = [], None
        for b, shape in enumerate(shapes):
            prompts = [random_ids(n) for n in shape]
            ours = engine.prompt_logits(prompts)
            try:
                results = engine.generate(prompts, GenerationConfig(max_new_tokens=steps, do_sample=False, stop_token_ids=(),
                                                                    output_logits=True))
            except NonFiniteLogitsError as exc:
                done.append((b, prompts, ours, None))
                pending = f"ours at generation step {exc.step} of prompt {exc.request} in batch {b}"
                break
            done.append((b, prompts, ours, results))
        sequences = [p + (list(results[i].token_ids[:-1]) if results is not None else [])
                     for _, prompts, _, results in done for i, p in enumerate(prompts)]
        refs = iter(model.logits(sequences))
        for b, prompts, ours, results in done:
            rows = [next(refs) for _ in prompts]
            for i, (p, mine, ref) in enumerate(zip(prompts, ours, rows)):
                compare(mine, ref[:len(p)], lambda pos: f"prompt position {pos} of prompt {i} in batch {b}")
            if results is None:
                raise _NonFinite(pending)
            for i, (p, res, ref) in enumerate(zip(prompts, results, rows)):
                compare_forced(p, res, ref, f"prompt {i} in batch {b}")

    try:
        if streamed:
            streamed_text_checks()
        for b, shape in enumerate(shapes if not streamed else ()):
            prompts = [random_ids(n) for n in shape]
            for i, (p, ours) in enumerate(zip(prompts, engine.prompt_logits(prompts))):
                with torch.no_grad():
                    ref = model(torch.tensor([p])).logits[0].float().numpy()
                compare(ours, ref, lambda pos: f"prompt position {pos} of prompt {i} in batch {b}")
            try:
                results = engine.generate(prompts, GenerationConfig(max_new_tokens=steps, do_sample=False, stop_token_ids=(),
                                                                    output_logits=True))
            except NonFiniteLogitsError as exc:
                raise _NonFinite(f"ours at generation step {exc.step} of prompt {exc.request} in batch {b}") from None
            for i, (p, res) in enumerate(zip(prompts, results)):
                compare_greedy(p, res, None, f"prompt {i} in batch {b}")
        if vision is not None:
            in_vision = True
            for label, prompts, images in _vision_cases(engine, limit, random_ids, seed):
                if isinstance(prompts, str):  # why it was skipped
                    vision_skipped.append(f"{label} ({prompts})")
                    continue
                pixels = [_pixel_values(engine, imgs) for imgs in images]
                try:
                    results = engine.generate(prompts, GenerationConfig(max_new_tokens=steps, do_sample=False,
                                                                        stop_token_ids=(), output_logits=True),
                                              images=images)
                except NonFiniteLogitsError as exc:
                    raise _NonFinite(f"ours at generation step {exc.step} of prompt {exc.request} ({label})") from None
                expanded = [r.prompt_ids for r in results]  # the ids the model saw, image tokens expanded
                pixels = [_reference_image_inputs(engine, ids, px) for ids, px in zip(expanded, pixels)]
                for i, (ids, ours) in enumerate(zip(expanded, engine.prompt_logits(prompts, images=images))):
                    with torch.no_grad():
                        ref = model(input_ids=torch.tensor([ids]), **(pixels[i] or {})).logits[0].float().numpy()
                    compare(ours, ref, lambda pos: f"prompt position {pos} of prompt {i} ({label})")
                for i, (ids, res) in enumerate(zip(expanded, results)):
                    compare_greedy(ids, res, pixels[i], f"prompt {i} ({label})")
                vision_checked.append(label)
    except _NonFinite as exc:
        nonfinite = str(exc)
    ppl = None
    if quant:  # compared with the fp32 reference: quantization error bounds (see module docstring)
        default_atol, default_agreement = float("inf"), DEFAULT_QUANT_MIN_AGREEMENT.get(quant, 0.0)
        if nonfinite is None:
            ppl = _perplexities(engine, model, text)
    else:
        default_atol, default_agreement = DEFAULT_ATOL.get(dtype, 1e-4), DEFAULT_MIN_AGREEMENT.get(dtype, 1.0)
    return VerifyReport(
        batch_shapes=tuple(tuple(s) for s in shapes),
        steps=steps,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        tokens_compared=compared,
        tokens_agreed=agreed,
        atol=default_atol if atol is None else atol,
        min_agreement=default_agreement if min_agreement is None else min_agreement,
        quant=quant,
        rms_rel_error=(err2 / spread2) ** 0.5 if spread2 > 0 else 0.0,
        rtol=DEFAULT_QUANT_RTOL.get(quant, 1.0) if quant else None,
        positions_compared=positions,
        positions_top1_agreed=top1,
        min_top1=DEFAULT_QUANT_MIN_TOP1.get(quant, 0.0) if quant else None,
        nonfinite=nonfinite,
        vision_checked=tuple(vision_checked),
        vision_skipped=tuple(vision_skipped),
        vision_max_abs_error=vision_max,
        perplexity=ppl[0].value if ppl else None,
        reference_perplexity=ppl[1].value if ppl else None,
        perplexity_tokens=ppl[0].tokens if ppl else 0,
        max_perplexity_ratio=DEFAULT_QUANT_MAX_PPL_RATIO.get(quant) if quant else None,
        reference_kind="streamed" if streamed else "transformers",
    )


def synthetic_images(seed: int, sizes: tuple[tuple[int, int], ...]) -> list[np.ndarray]:
    """Deterministic random RGB images (uint8 ``[height, width, 3]``), one per (height, width)."""
    rng = np.random.default_rng([seed, 0x1A6E])
    return [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _image_sizes(engine: Engine) -> tuple[tuple[int, int], tuple[int, int]]:
    """Two input sizes that differ from each other and from what the processor makes of them."""
    out = engine.manifest.vision.preprocessing.output_size or (56, 56)
    h, w = out
    return (h + h // 4 + 1, w), (h, w + w // 2 + 3)


def _vision_cases(engine: Engine, limit: int, random_ids, seed: int):
    """(label, prompts, per-prompt images) for the vision path; prompts is a string (the reason)
    for a case that does not fit ``limit`` tokens."""
    tok = engine.manifest.vision.image_token_id
    small, large = synthetic_images(seed, _image_sizes(engine))
    n_small, n_large = (engine.vision.load(im).tokens for im in (small, large))
    cases = []
    for label, parts, images in (
        ("1 image", [(3, [small]), (4, [])], [[small]]),
        (f"2 images ({small.shape[0]}x{small.shape[1]}, {large.shape[0]}x{large.shape[1]}) in one prompt",
         [(2, [small]), (3, [large]), (2, [])], [[small, large]]),
        ("batch of 2, one without an image", None, [[large], None]),
    ):
        if parts is None:  # the batch: an image prompt and a text-only one
            prompts = [random_ids(2) + [tok] + random_ids(5), random_ids(9)]
            need = max(7 + n_large, 9)
        else:
            prompts = [[t for n, imgs in parts for t in random_ids(n) + [tok] * len(imgs)]]
            need = sum(n + sum(n_small if im is small else n_large for im in imgs) for n, imgs in parts)
        if need > limit:
            cases.append((label, f"{need} tokens with the images expanded, more than the {limit} that fit", images))
        else:
            cases.append((label, prompts, images))
    return cases


def _reference_image_inputs(engine: Engine, ids: list[int], pixels: dict | None) -> dict | None:
    """``pixels`` plus what the reference model needs to know which tokens are image rows, as its
    processor returns it: ``token_type_ids`` for a decoder whose image tokens see their whole image
    (``lookahead``: Gemma3; without them transformers masks the image causally) and
    ``mm_token_type_ids`` for M-RoPE (Qwen2.5-VL; without them it falls back to 1-D positions)."""
    import torch

    if not pixels:
        return pixels
    vision = engine.manifest.vision
    row = vision.placeholder.row_token_id if vision.placeholder.row_token_id is not None else vision.image_token_id
    rows = torch.tensor([ids]) == row
    extra = {}
    if any(t.role == "lookahead" for t in engine.decoder.spec.inputs):
        extra["token_type_ids"] = rows.long()
    if vision.positions == "mrope":
        extra["mm_token_type_ids"] = rows.int()
    return {**pixels, **extra}


def _pixel_values(engine: Engine, images) -> dict | None:
    """The reference's image inputs: the runtime's own preprocessing of ``images``, as torch."""
    import torch

    from graphkiln.imaging import load_image, preprocess

    if not images:
        return None
    spec = engine.manifest.vision
    pre = preprocess([load_image(im, spec.max_image_pixels) for im in images], spec.preprocessing)
    out = {"pixel_values": torch.from_numpy(pre.pixel_values)}
    if pre.image_grid_thw is not None:
        out["image_grid_thw"] = torch.from_numpy(pre.image_grid_thw)
    return out
