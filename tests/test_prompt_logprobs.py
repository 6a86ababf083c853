"""Prompt log-probabilities (``GenerationConfig.prompt_logprobs``), what evaluation harnesses
score multiple-choice answers with: against transformers' own log-softmax over the prompt, for a
dense and a conv-state hybrid model, in ragged batches, through the scheduler's chunked prefill
(chunks smaller than the prompts), with and without generation after the prompt.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import GenerationConfig
from graphkiln.runtime.request.scheduler import Scheduler

LENGTHS = (9, 1, 40, 17)


def _reference_logprobs(case, prompt: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        logits = case.reference(torch.tensor([prompt])).logits[0].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def _check(case, result, prompt: list[int], top: int, atol: float = 1e-4) -> None:
    ref = _reference_logprobs(case, prompt)
    assert len(result.prompt_logprobs) == len(prompt) and result.prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        lp = result.prompt_logprobs[i]
        assert lp.token_id == prompt[i]
        assert abs(lp.logprob - ref[i - 1, prompt[i]]) < atol, (i, lp.logprob, ref[i - 1, prompt[i]])
        assert len(lp.top) == top
        best = np.argsort(-ref[i - 1])[:top]
        assert [t for t, _ in lp.top] == best.tolist() or np.allclose(  # near-ties may swap places
            [v for _, v in lp.top], ref[i - 1, best], atol=atol)


@pytest.mark.parametrize("name", ["llama_gqa_bias", "lfm2"])
@pytest.mark.parametrize("new_tokens", [0, 6])
def test_prompt_logprobs_equal_transformers_in_a_ragged_batch(tiny, name, new_tokens):
    case = tiny(name)
    prompts = case.prompts(LENGTHS, salt=3)
    cfg = GenerationConfig(max_new_tokens=new_tokens, prompt_logprobs=3, do_sample=False, stop_token_ids=())
    results = case.engine.generate(prompts, cfg)
    for result, prompt in zip(results, prompts):
        _check(case, result, prompt, 3)
        assert len(result.token_ids) == new_tokens and result.finish_reason == "length"
    # scoring the prompt changes nothing of what is generated
    plain = case.engine.generate(prompts, GenerationConfig(max_new_tokens=new_tokens, do_sample=False,
                                                           stop_token_ids=()))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert all(r.prompt_logprobs is None for r in plain)


@pytest.mark.parametrize("name", ["llama_gqa_bias", "lfm2"])
def test_prompt_logprobs_through_chunked_prefill_beside_other_requests(tiny, name):
    """step_tokens 8: the 40- and 17-token prompts are scored over several chunks while other
    requests decode; requests that score nothing run beside them unchanged."""
    case = tiny(name)
    prompts = case.prompts(LENGTHS, salt=4)
    scheduler = Scheduler(case.engine, max_batch=4, step_tokens=8)
    scheduler.start()
    try:
        handles = [scheduler.submit(p, GenerationConfig(max_new_tokens=n, prompt_logprobs=k, do_sample=False,
                                                        stop_token_ids=()))
                   for p, n, k in zip(prompts, (0, 4, 3, 0), (1, 0, None, 2))]
        results = [h.result() for h in handles]
    finally:
        scheduler.shutdown(5)
    _check(case, results[0], prompts[0], 1)
    _check(case, results[1], prompts[1], 0)
    assert results[2].prompt_logprobs is None and len(results[2].token_ids) == 3
    _check(case, results[3], prompts[3], 2)
    assert [len(r.token_ids) for r in results] == [0, 4, 3, 0]


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_prompt_logprobs_refuses_what_is_not_a_count(value):
    with pytest.raises(GraphkilnError, match="prompt_logprobs must be an integer >= 0"):
        GenerationConfig(prompt_logprobs=value)
