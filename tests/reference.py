"""transformers reference computations shared by the test files (fp32, no cache tricks), and the
closeness criterion the custom-op tests share."""

from __future__ import annotations

import numpy as np
import torch

ATOL = 1e-4


def forward_logits(model, ids: list[int]) -> np.ndarray:
    """Logits [len(ids), vocab] at every position of one unpadded sequence."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers ``generate`` greedy for exactly ``steps`` tokens: (token ids, raw logits [steps, vocab])."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=steps, min_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits, 1)[0].float().numpy()
    # The reference itself must be plain greedy on raw logits (no EOS suppression or other
    # processors), otherwise comparing with it would prove nothing.
    assert len(tokens) == steps
    assert tokens == logits.argmax(-1).tolist(), "reference generate did not pick argmax of its raw logits"
    return tokens, logits


def teacher_forced_logits(model, prompt: list[int], generated: list[int]) -> np.ndarray:
    """Logits [len(generated), vocab] that predicted each generated token, from one full forward."""
    if not generated:
        return np.zeros((0, model.config.vocab_size), np.float32)
    full = forward_logits(model, prompt + generated[:-1])
    return full[len(prompt) - 1:]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def max_abs(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())


def _float64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):  # through torch: numpy has no bfloat16
        return x.detach().cpu().to(torch.float64).numpy()
    return np.asarray(x, dtype=np.float64)


def assert_close(got, want, rel: float = 1e-5, what: str = "") -> None:
    """max |got - want| <= rel * max |want| (the ``atol relative to output scale`` criterion), got finite."""
    got, want = _float64(got), _float64(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-6)
    err = float(np.abs(got - want).max()) if want.size else 0.0
    assert err <= rel * scale, f"{what}: max abs error {err:.3g} > {rel:g} * output scale {scale:.3g}"
