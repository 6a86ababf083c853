"""``graphkiln verify`` for an embedding artifact (``export --task embed``: no logits to compare).

The reference is transformers' base model of the checkpoint (``AutoModel``: ``last_hidden_state``,
after the final norm) in fp32, each prompt run alone (no padding reaches it) and pooled as the
artifact records (last token or mean). The artifact embeds the same random prompts in ragged
batches (its own padding and slots). Checked: the largest absolute difference of the pooled,
unnormalised vectors (``atol``; default 1e-4 for fp32, 2e-2 for fp16/bf16, none for quantized
weights) and the smallest cosine between the two (at least ``MIN_COSINE`` of the artifact's
weights: quantized artifacts are checked by cosine alone).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

BATCH_SHAPES = ((9,), (5, 17, 1), (12, 3, 30, 8))
DEFAULT_ATOL = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 2e-2}
MIN_COSINE = {"fp32": 0.99999, "fp16": 0.999, "bf16": 0.999, "int8": 0.99, "int4": 0.95}


@dataclass(frozen=True)
class EmbeddingVerifyReport:
    pooling: str
    batch_shapes: tuple[tuple[int, ...], ...]
    max_abs_error: float
    min_cosine: float
    atol: float
    min_cosine_bound: float
    weights: str  # the artifact's dtype, or its quantization

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.atol and self.min_cosine >= self.min_cosine_bound

    def summary(self) -> str:
        shapes = ", ".join("batch %d (lengths %s)" % (len(s), "/".join(map(str, s))) for s in self.batch_shapes)
        atol = f" (tolerance {self.atol:g})" if math.isfinite(self.atol) else ""
        return (f"embedding artifact ({self.pooling} pooling, {self.weights} weights) vs transformers' pooled "
                f"last_hidden_state: checked {shapes}; max abs error {self.max_abs_error:.3g}{atol}, min cosine "
                f"{self.min_cosine:.7f} (need {self.min_cosine_bound:g}) -> {'PASS' if self.passed else 'FAIL'}")


def verify_embeddings(engine, reference: str, refuse_auto_map, seed: int = 0,
                      atol: float | None = None) -> EmbeddingVerifyReport:
    """Compare ``engine`` (an embedding artifact) with the checkpoint ``reference`` (module docstring);
    ``refuse_auto_map(reference, path)``: verify's refusal of a checkpoint that needs its own code."""
    import torch

    from graphkiln.export.checkpoint import prepared_checkpoint

    m = engine.manifest
    weights = m.model.quant or m.model.dtype
    if atol is None:
        atol = DEFAULT_ATOL.get(weights, math.inf)
    pooling = m.embedding.pooling
    with prepared_checkpoint(reference) as path:
        model = _load(reference, Path(path), refuse_auto_map)
        rng = np.random.default_rng(seed)
        worst_abs, worst_cos = 0.0, 1.0
        shapes = tuple(tuple(min(n, engine.max_seq_len - 1) for n in s) for s in BATCH_SHAPES)
        for lengths in shapes:
            prompts = [rng.integers(0, m.model.vocab_size, n).tolist() for n in lengths]
            ours = engine.embed(prompts, normalize=False)
            for p, v in zip(prompts, ours):
                with torch.no_grad():
                    h = model(torch.tensor([p])).last_hidden_state[0].float().numpy()
                want = h[-1] if pooling == "last" else h.mean(axis=0)
                worst_abs = max(worst_abs, float(np.abs(v - want).max()))
                cos = float(v @ want / max(np.linalg.norm(v) * np.linalg.norm(want), 1e-30))
                worst_cos = min(worst_cos, cos)
    return EmbeddingVerifyReport(pooling, shapes, worst_abs, worst_cos, atol, MIN_COSINE.get(weights, 0.99), weights)


def _load(reference: str, path: Path, refuse_auto_map):
    import torch
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    refuse_auto_map(reference, path)
    hf_logging.disable_progress_bar()
    try:
        return AutoModel.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False).eval()
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot load the reference {reference} "
                             f"({str(exc).splitlines()[0][:160]})") from None
