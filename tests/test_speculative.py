"""Speculative decoding with prompt-lookup drafts (runtime.request.speculate): greedy output is
exactly plain greedy decoding, on a dense and a MoE model, onnxruntime and portable targets, with
stops, budgets and prefix reuse; drafts are really accepted on repetitive text; artifacts with
slot state decode as usual."""

from __future__ import annotations

import dataclasses

import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request.speculate import ngram_draft

PLAIN = GenerationConfig(max_new_tokens=48, stop_token_ids=())


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the longest repeated suffix's continuation
    assert ngram_draft([5, 1, 2, 7, 1, 2], 2) == [7, 1]
    assert ngram_draft([1, 2, 3, 4], 3) == []
    assert ngram_draft([1, 2, 3, 1], 3) == []  # a single repeated token proposes nothing
    assert ngram_draft([4, 4, 4, 4], 5) == [4]  # only what followed is proposed


@pytest.mark.parametrize("name, target", [("llama_tok", "onnxruntime"), ("llama_tok", "portable"),
                                          ("qwen3_moe", "onnxruntime")])
def test_greedy_tokens_equal_plain_decoding(tiny, name, target):
    case = tiny(name, target)
    engine = Engine.load(case.artifact, threads=1)
    # repetitive prompts, so that drafts are proposed and some accepted
    prompts = [p * 3 for p in case.prompts([5, 7, 4], salt=3)]
    for prompt in prompts:
        plain = engine.generate(prompt, PLAIN)[0]
        for k in ("ngram", "ngram:2", "ngram:8"):
            spec = engine.generate(prompt, dataclasses.replace(PLAIN, speculative=k))[0]
            assert spec.token_ids == plain.token_ids, (name, target, k)
    # stops and budgets end where plain decoding ends
    prompt = prompts[0]
    plain = engine.generate(prompt, PLAIN)[0].token_ids
    stop = dataclasses.replace(PLAIN, stop_token_ids=(plain[9],), max_new_tokens=30)
    assert (engine.generate(prompt, dataclasses.replace(stop, speculative="ngram:8"))[0].token_ids
            == engine.generate(prompt, stop)[0].token_ids)
    short = dataclasses.replace(PLAIN, max_new_tokens=5, speculative="ngram:8")
    assert engine.generate(prompt, short)[0].token_ids == plain[:5]


def test_drafts_are_accepted_on_repetitive_text(tiny):
    """A random model repeats itself under greedy decoding: the speculator must then accept drafts
    (fewer graph runs than tokens), or the speed-up claimed in benchmarks could not exist."""
    case = tiny("llama_tok", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    runs = []
    run = engine.decoder.run

    def counting(*args, **kwargs):
        runs.append(args[1].shape[1])
        return run(*args, **kwargs)

    engine.decoder.run = counting
    prompt = case.prompts([6], salt=5)[0] * 4
    out = engine.generate(prompt, dataclasses.replace(PLAIN, max_new_tokens=100, speculative="ngram:4"))[0]
    assert len(out.token_ids) == 100 and len(runs) < 100, len(runs)
    assert max(runs[1:]) > 1  # multi-token verification steps happened


def test_slot_state_models_decode_as_usual(tiny):
    case = tiny("lfm2", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    prompt = case.prompts([6], salt=2)[0] * 3
    assert (engine.generate(prompt, dataclasses.replace(PLAIN, speculative="ngram"))[0].token_ids
            == engine.generate(prompt, PLAIN)[0].token_ids)


def test_bad_setting_is_one_line():
    with pytest.raises(GraphkilnError, match="'draft:4' is not supported"):
        GenerationConfig(speculative="draft:4")
    with pytest.raises(GraphkilnError, match="K from 1 to 16"):
        GenerationConfig(speculative="ngram:99")
