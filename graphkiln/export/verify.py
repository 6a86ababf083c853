"""Parity between an artifact and its transformers reference on random prompts.

Compares logits at every prompt position (one batched prefill, rows of different
lengths) and greedy generation over ``steps`` tokens, step logits included. Needs the
``export`` extra because the reference is transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig

DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 5e-2, "bf16": 2.5e-1}
# Half-precision artifacts legitimately flip near-tied greedy choices; fp32 must not.
DEFAULT_MIN_AGREEMENT = {"fp32": 1.0, "fp16": 0.75, "bf16": 0.5}


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

    @property
    def agreement(self) -> float:
        return self.tokens_agreed / max(1, self.tokens_compared)

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.atol and self.agreement >= self.min_agreement

    def summary(self) -> str:
        shapes = ", ".join("batch %d (lengths %s)" % (len(s), "/".join(map(str, s))) for s in self.batch_shapes)
        return (
            f"checked {shapes}; logits max abs error {self.max_abs_error:.3g} (tolerance {self.atol:g}), "
            f"max rel error {self.max_rel_error:.3g}; greedy tokens identical {self.tokens_agreed}/{self.tokens_compared} "
            f"({100 * self.agreement:.1f}%, need {100 * self.min_agreement:.0f}%) over {self.steps} steps -> "
            + ("PASS" if self.passed else "FAIL")
        )


def _reference(reference: str):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from graphkiln.export.checkpoint import resolve_checkpoint

    path = resolve_checkpoint(reference)
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot load the reference {reference} ({str(exc).splitlines()[0][:160]})") from None
    return model


def verify_artifact(artifact: str | Path, reference: str, steps: int = 32, seed: int = 0,
                    batch_shapes: tuple[tuple[int, ...], ...] | None = None, atol: float | None = None,
                    min_agreement: float | None = None, engine: Engine | None = None) -> VerifyReport:
    import torch

    engine = engine or Engine.load(artifact)
    dtype = engine.manifest.model.dtype
    model = _reference(reference)
    vocab = engine.manifest.model.vocab_size
    limit = engine.max_seq_len - steps
    if limit < 2:
        raise GraphkilnError(f"--steps {steps} leaves no room for a prompt under max sequence length {engine.max_seq_len}")
    shapes = batch_shapes or ((min(12, limit),), tuple(min(n, limit) for n in (7, 16, 3)))
    rng = np.random.default_rng(seed)
    max_abs = max_rel = 0.0
    compared = agreed = 0

    def compare(ours: np.ndarray, ref: np.ndarray) -> None:
        nonlocal max_abs, max_rel
        err = float(np.abs(ours - ref).max())
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / max(float(np.abs(ref).max()), 1e-12))

    for shape in shapes:
        prompts = [rng.integers(0, vocab, n).tolist() for n in shape]
        for p, ours in zip(prompts, engine.prompt_logits(prompts)):
            with torch.no_grad():
                compare(ours, model(torch.tensor([p])).logits[0].float().numpy())
        results = engine.generate(prompts, GenerationConfig(max_new_tokens=steps, do_sample=False, stop_token_ids=(), output_logits=True))
        for p, res in zip(prompts, results):
            with torch.no_grad():
                ids = torch.tensor([p])
                # An explicit mask: otherwise generate() masks every token equal to pad_token_id.
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                     eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            ref_tokens = out.sequences[0, len(p):].tolist()
            ref_logits = torch.stack(out.logits, 1)[0].float().numpy()
            compared += steps
            for t, (a, b) in enumerate(zip(res.token_ids, ref_tokens)):
                compare(res.logits[t], ref_logits[t])  # same context up to and including step t
                if a != b:
                    break
                agreed += 1
    return VerifyReport(
        batch_shapes=tuple(tuple(s) for s in shapes),
        steps=steps,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
        tokens_compared=compared,
        tokens_agreed=agreed,
        atol=DEFAULT_ATOL.get(dtype, 1e-4) if atol is None else atol,
        min_agreement=DEFAULT_MIN_AGREEMENT.get(dtype, 1.0) if min_agreement is None else min_agreement,
    )
