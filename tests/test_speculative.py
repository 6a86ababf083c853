"""Speculative decoding (runtime.request.speculate, runtime.draft_model): greedy output is exactly
plain greedy decoding with prompt-lookup and draft-model drafts, on dense, MoE and hybrid (conv,
gated delta, Mamba) models, alone and several rows per step, with stops and budgets; drafts are
really accepted; sampled output has the target's distribution (a chi-square test against the
exact distribution, on a vocabulary of 8, that an always-accept rule fails); bad settings and
mismatched drafts are one line."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest

from conftest import MAX_SEQ_LEN, Spec, _COMMON, build_checkpoint
from graphkiln.errors import GraphkilnError
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.request import speculate
from graphkiln.runtime.request.sampling import SamplingParams, probabilities
from graphkiln.runtime.request.speculate import ngram_draft

PLAIN = GenerationConfig(max_new_tokens=48, stop_token_ids=())


def _export(ckpt, out, **opts):
    from graphkiln.export.pipeline import ExportOptions, export_model

    export_model(str(ckpt), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, target="onnxruntime", **opts))
    return out


def counted_runs(engine) -> list[int]:
    """The tokens per row of every run of ``engine``'s decoder from now on that does not start at
    position 0 (decode steps and verifications; not a prompt's first prefill run)."""
    runs: list[int] = []
    run = engine.decoder.run

    @functools.wraps(run)  # its signature stays visible (the scheduler asks it for first_slot)
    def counting(*args, **kwargs):
        if args[2][0, 0] > 0:
            runs.append(args[1].shape[1])
        return run(*args, **kwargs)

    engine.decoder.run = counting
    return runs


def test_ngram_draft():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # the longest repeated suffix's continuation
    assert ngram_draft([5, 1, 2, 7, 1, 2], 2) == [7, 1]
    assert ngram_draft([1, 2, 3, 4], 3) == []
    assert ngram_draft([1, 2, 3, 1], 3) == []  # a single repeated token proposes nothing
    assert ngram_draft([4, 4, 4, 4], 5) == [4]  # only what followed is proposed


def test_draft_length_follows_the_expected_gain():
    """Speculator.size: (1 - a^(k+1)) / ((1 - a)(1 + k (c + 0.1))) over k, a = 0.8 before any
    verification; below 1.2, pauses twice as long each time in a row."""
    from graphkiln.runtime.request.speculate import Speculator

    s = Speculator(8, "draft")
    assert s.size(100, 0.2) == 3 and s.size(2, 0.2) == 2  # a = 0.8 assumed: 1.55x at k=3, within the room
    assert s.size(100, 0.6) == 0 and s.paused == 16  # not worth a try even so
    s = Speculator(8, "draft")
    for _ in range(3):
        s.record(8, 8)
    assert s.size(100, 0.2) == 8  # every draft accepted: the longest
    s = Speculator(8, "draft")
    s.record(8, 1)
    s.record(8, 1)  # 2 accepted of 4 compared: a = 0.5
    assert s.size(100, 0.05) == 2  # 1.35x expected
    assert s.size(100, 0.2) == 0 and s.paused == 16 and not s.history  # 1.15x at best: not worth it
    s.paused = 0
    assert s.size(100, 0.2) == 3  # a try after the pause
    s.record(3, 0)
    assert s.size(100, 0.2) == 0 and s.paused == 32  # twice as long


@pytest.mark.parametrize("name, target", [("llama_tok", "onnxruntime"), ("llama_tok", "portable"),
                                          ("qwen3_moe", "onnxruntime"), ("lfm2", "onnxruntime"),
                                          ("qwen3_5", "onnxruntime"), ("nemotron_h", "onnxruntime")])
def test_greedy_ngram_equals_plain_decoding(tiny, name, target, monkeypatch):
    """Dense, MoE and hybrids (conv; gated delta; Mamba: slot states restored after a rejection)."""
    case = tiny(name, target)
    engine = Engine.load(case.artifact, threads=1)
    # repetitive prompts, so that drafts may be proposed (whether the model continues them varies)
    prompts = [p * 3 for p in case.prompts([5, 7, 4], salt=3)]
    for prompt in prompts:
        plain = engine.generate(prompt, PLAIN)[0]
        for k in ("ngram", "ngram:8"):
            spec = engine.generate(prompt, dataclasses.replace(PLAIN, speculative=k))[0]
            assert spec.token_ids == plain.token_ids, (name, target, k)
    # drafts right up to a wrong token at a varying place (none wrong at times): every accepted
    # length and rejection happens, each rejection rolling back what the run consumed
    plain = engine.generate(prompts[0], PLAIN)[0].token_ids

    def oracle(sequence, k):
        at = len(sequence) - len(prompts[0])
        drafts = list(plain[at: at + k])
        wrong = at * 7 % (k + 2)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % case.vocab_size
        return drafts

    runs = counted_runs(engine)
    with monkeypatch.context() as m:
        m.setattr("graphkiln.runtime.request.step.ngram_draft", oracle)
        assert engine.generate(prompts[0], dataclasses.replace(PLAIN, speculative="ngram:4"))[0].token_ids == plain
    assert max(runs) > 1 and len(runs) < 40, runs
    # several rows per step, each verified in its own run, equal to the batch decoded plainly
    batch = [r.token_ids for r in engine.generate(prompts, dataclasses.replace(PLAIN, speculative="ngram:8"))]
    assert batch == [r.token_ids for r in engine.generate(prompts, PLAIN)]
    if name == "llama_tok" and target == "onnxruntime":  # stops and budgets end where plain decoding ends
        prompt = prompts[0]
        plain = engine.generate(prompt, PLAIN)[0].token_ids
        stop = dataclasses.replace(PLAIN, stop_token_ids=(plain[9],), max_new_tokens=30)
        assert (engine.generate(prompt, dataclasses.replace(stop, speculative="ngram:8"))[0].token_ids
                == engine.generate(prompt, stop)[0].token_ids)
        short = dataclasses.replace(PLAIN, max_new_tokens=5, speculative="ngram:8")
        assert engine.generate(prompt, short)[0].token_ids == plain[:5]


def test_scheduler_mixes_speculating_rows_on_a_hybrid(tiny, monkeypatch):
    """Continuous batching on a conv hybrid with prefix reuse and chunked prefill: requests that
    speculate (each verified in a run of its own, states restored after rejections) beside ones
    that do not, each equal to plain decoding alone."""
    from graphkiln.runtime.request.scheduler import Scheduler

    case = tiny("lfm2", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    base = case.prompts([20], salt=8)[0]  # a shared first block: reused from the prefix cache
    prompts = [base + p for p in case.prompts([3, 5, 9, 4, 6], salt=9)]
    plain = {tuple(p): engine.generate(p, PLAIN)[0].token_ids for p in prompts}

    def oracle(sequence, k):  # the plain continuation, wrong at a varying place
        prompt = next(p for p in plain if tuple(sequence[: len(p)]) == p)
        at = len(sequence) - len(prompt)
        drafts = list(plain[prompt][at: at + k])
        wrong = at * 5 % (k + 2)
        if wrong < len(drafts):
            drafts[wrong] = (drafts[wrong] + 1) % case.vocab_size
        return drafts

    monkeypatch.setattr("graphkiln.runtime.request.step.ngram_draft", oracle)
    runs = counted_runs(engine)
    sched = Scheduler(engine, max_batch=3, step_tokens=16)
    sched.start()
    try:
        handles = [sched.submit(p, dataclasses.replace(PLAIN, speculative="ngram:8" if i % 2 == 0 else None))
                   for i, p in enumerate(prompts)]
        assert [h.result(timeout=60).token_ids for h in handles] == [plain[tuple(p)] for p in prompts]
        assert sched.stats().accepted_draft_tokens > 0
    finally:
        sched.shutdown(5.0)
    assert max(runs) > 1


def test_drafts_are_accepted_on_repetitive_text(tiny):
    """A random model repeats itself under greedy decoding: the speculator must then accept drafts
    (fewer graph runs than tokens), or the speed-up claimed in benchmarks could not exist."""
    case = tiny("llama_tok", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    runs = counted_runs(engine)
    prompt = case.prompts([6], salt=5)[0] * 4
    out = engine.generate(prompt, dataclasses.replace(PLAIN, max_new_tokens=100, speculative="ngram:4"))[0]
    assert len(out.token_ids) == 100 and len(runs) < 100, len(runs)
    assert max(runs[1:]) > 1  # multi-token verification steps happened


@pytest.fixture(scope="module")
def drafted(tiny, tmp_path_factory):
    """Targets with drafts: llama_tok with its own int4 export (same tokenizer); the hybrid lfm2
    drafted by qwen3_moe and the other way round (a hybrid draft: its slot states restored after
    a rejection; other families, both vocabulary 300, no tokenizer)."""
    root = tmp_path_factory.mktemp("drafts")
    llama = tiny("llama_tok", "onnxruntime")
    lfm2, moe = tiny("lfm2", "onnxruntime"), tiny("qwen3_moe", "onnxruntime")
    return {"llama_tok": (llama, _export(llama.checkpoint, root / "llama-int4", quant="int4")),
            "lfm2": (lfm2, moe.artifact), "qwen3_moe": (moe, lfm2.artifact)}


@pytest.mark.parametrize("name", ["llama_tok", "lfm2", "qwen3_moe"])
def test_greedy_draft_model_equals_plain_decoding(drafted, name):
    case, draft = drafted[name]
    # drafting whatever it costs: a tiny draft's step costs about the target's, which the engine would decline
    engine = Engine.load(case.artifact, threads=1, draft=draft, draft_cost=0.0)
    prompts = [p * 2 for p in case.prompts([5, 9], salt=4)]
    runs = counted_runs(engine)
    plain = [r.token_ids for r in engine.generate(prompts, PLAIN)]
    for k in ("draft:2", "draft:8"):
        for prompt, expected in zip(prompts, plain):
            assert engine.generate(prompt, dataclasses.replace(PLAIN, speculative=k))[0].token_ids == expected, k
        assert [r.token_ids for r in engine.generate(prompts, dataclasses.replace(PLAIN, speculative=k))] == plain
    assert max(runs) > 1
    # with logprobs (logits at every verified position instead of the folded argmax): same tokens, same logprobs
    lp = dataclasses.replace(PLAIN, logprobs=2, max_new_tokens=12)
    a = engine.generate(prompts[0], lp)[0]
    b = engine.generate(prompts[0], dataclasses.replace(lp, speculative="draft:4"))[0]
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose([x.logprob for x in a.logprobs], [x.logprob for x in b.logprobs], atol=1e-4)
    # a draft that is the target itself is always right: every step commits k+1 tokens (its cache kept in step)
    if name == "llama_tok":
        same = Engine.load(case.artifact, threads=1, draft=case.artifact)
        assert 0.5 <= same.draft.cost <= 2.0  # measured: the same graph
        assert same.generate(prompts[0], dataclasses.replace(PLAIN, speculative="draft:4"))[0].token_ids == plain[0]
        runs = counted_runs(same)
        same.generate(prompts[0], dataclasses.replace(PLAIN, speculative="draft:4"))
        assert runs == [1] * 47  # as costly as the target: declined (Speculator.size)
        same.draft.cost = 0.0  # as if free
        runs.clear()
        out = same.generate(prompts[0], dataclasses.replace(PLAIN, speculative="draft:4"))[0]
        assert out.token_ids == plain[0] and len(runs) == -(-47 // 5), runs
    if name == "qwen3_moe":  # a hybrid draft: after rejections (restored states) it still drafts its own greedy text
        proposals = []
        propose = engine.draft.propose

        def spy(spec, sequence, k, params, rng):
            out = propose(spec, sequence, k, params, rng)
            proposals.append((list(sequence), out.tokens))
            return out

        engine.draft.propose = spy
        engine.generate(prompts[1], dataclasses.replace(PLAIN, speculative="draft:4"))
        alone = Engine.load(draft, threads=1)
        for sequence, tokens in proposals:
            assert alone.generate(sequence, dataclasses.replace(PLAIN, max_new_tokens=len(tokens)))[0].token_ids == tokens
        assert len(proposals) >= 6, len(proposals)
    # a seeded sampled request draws the same tokens every time (draft lengths depend on nothing else)
    sampled = dataclasses.replace(PLAIN, do_sample=True, temperature=0.8, seed=5, speculative="draft:4")
    assert engine.generate(prompts[0], sampled)[0].token_ids == engine.generate(prompts[0], sampled)[0].token_ids
    # a Scheduler (continuous batching, a draft slot per request) gives the same tokens too
    from graphkiln.runtime.request.scheduler import Scheduler

    sched = Scheduler(engine, max_batch=2)
    sched.start()
    try:
        handles = [sched.submit(p, dataclasses.replace(PLAIN, speculative="draft:4")) for p in prompts]
        assert [h.result().token_ids for h in handles] == plain
    finally:
        sched.shutdown(5.0)


# -- sampling preserves the target's distribution -----------------------------------------------------

V8 = Spec("llama_v8", "LlamaForCausalLM",
          dict(_COMMON, vocab_size=8, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               tie_word_embeddings=False, initializer_range=0.3),
          seed=31, features=("tiny_vocab",))
# every bigram (2, t) occurs, so a prompt-lookup draft follows whatever the first token is
V8_PROMPT = [2, 0, 2, 1, 2, 2, 2, 3, 2, 4, 2, 5, 2, 6, 2, 7, 2]
SAMPLES = 2000


@pytest.fixture(scope="module")
def v8(tmp_path_factory):
    """A vocabulary-8 target and a differently seeded draft (so q differs from p), and the exact
    distribution of the target's first three sampled tokens after ``V8_PROMPT`` [8, 8, 8] under
    given sampling settings (``joint(params)``)."""
    root = tmp_path_factory.mktemp("v8")
    target = _export(build_checkpoint(V8, root / "target"), root / "target-art")
    draft = _export(build_checkpoint(V8, root / "draft", seed=32), root / "draft-art")
    engine = Engine.load(target, threads=1, draft=draft, draft_cost=0.0)  # drafting whatever it costs
    prefixes = [[]] + [[a] for a in range(8)] + [[a, b] for a in range(8) for b in range(8)]
    logits = [x[-1] for x in engine.prompt_logits([V8_PROMPT + p for p in prefixes])]

    def joint(params: SamplingParams) -> np.ndarray:
        probs = [probabilities(x, params) for x in logits]
        return np.einsum("a,ab,abc->abc", probs[0], np.stack(probs[1:9]), np.stack(probs[9:]).reshape(8, 8, 8))

    return engine, joint


def chi_square_p(samples: list[list[int]], joint: np.ndarray) -> float:
    """p-value of the samples' first three tokens under ``joint`` (cells expecting < 5 merged)."""
    from scipy.stats import chi2

    counts = np.zeros(joint.size)
    for s in samples:
        counts[np.ravel_multi_index(tuple(s[:3]), joint.shape)] += 1
    expected = joint.ravel() * len(samples)
    small = expected < 5
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    return float(chi2.sf(stat, keep.sum() - 1))


def _sample(engine, speculative: str, params: SamplingParams) -> list[list[int]]:
    cfg = GenerationConfig(max_new_tokens=4, stop_token_ids=(), do_sample=True, temperature=params.temperature,
                           top_k=params.top_k, top_p=params.top_p, speculative=speculative)
    return [engine.generate(V8_PROMPT, dataclasses.replace(cfg, seed=i))[0].token_ids for i in range(SAMPLES)]


T1 = SamplingParams(do_sample=True)
FILTERED = SamplingParams(do_sample=True, temperature=0.8, top_k=5, top_p=0.9)


@pytest.mark.parametrize("source, params", [("ngram:3", T1), ("draft:3", T1), ("draft:3", FILTERED)],
                         ids=["ngram", "draft", "draft-top_k-top_p"])
def test_sampling_keeps_the_target_distribution(v8, source, params, monkeypatch):
    """Tokens 2 and 3 come from one verification (drafts accepted, or a rejection's resample), so
    their joint distribution with token 1 is what the rejection rule must get right: a chi-square
    test against the exact distribution (under the request's temperature, top-k and top-p, which
    shape both p and the draft's q), fixed seeds, passes at p > 1e-3; the same test on an
    always-accept rule (drafts taken as they come) fails it, so it can tell them apart."""
    engine, joint = v8
    runs = counted_runs(engine)
    assert chi_square_p(_sample(engine, source, params), joint(params)) > 1e-3
    assert max(runs) > 1  # drafts were verified
    if params is FILTERED:
        return
    real = speculate.accept
    monkeypatch.setattr("graphkiln.runtime.request.step.accept",
                        lambda p_at, proposal, rng: proposal.tokens + real(lambda i: p_at(i + len(proposal.tokens)),
                                                                           speculate.Proposal([]), rng))
    assert chi_square_p(_sample(engine, source, params), joint(params)) < 1e-6


# -- refusals -------------------------------------------------------------------------------------------

def test_bad_settings_are_one_line(tiny, tmp_path):
    with pytest.raises(GraphkilnError, match="'beam:4' is not supported"):
        GenerationConfig(speculative="beam:4")
    with pytest.raises(GraphkilnError, match="K from 1 to 16"):
        GenerationConfig(speculative="ngram:99")
    case = tiny("llama_tok", "onnxruntime")
    engine = Engine.load(case.artifact, threads=1)
    with pytest.raises(GraphkilnError, match="needs a draft model and none is loaded"):
        engine.generate([5, 6, 7], GenerationConfig(speculative="draft"))
    with pytest.raises(GraphkilnError, match="vocabulary has 300 tokens"):
        Engine.load(case.artifact, threads=1, draft=tiny("qwen3_moe", "onnxruntime").artifact)
    with pytest.raises(GraphkilnError, match="vision-language"):
        Engine.load(tiny("llava_clip", "onnxruntime").artifact, threads=1, draft=tiny("llava_clip", "onnxruntime").artifact)
    with pytest.raises(GraphkilnError, match="is not a directory"):
        Engine.load(case.artifact, threads=1, draft=tmp_path / "missing")


# the two (an empty K, another script's digit), their kin, and spellings already refused
BAD_SETTINGS = ["ngram:", "draft:", "ngram:\u0663", "draft:\uff13", "ngram:\u00b2", "ngram:04", "ngram:+3", "ngram:-3",
                "ngram: 3", "ngram:3 ", " ngram", "ngram:3\n", "ngram:0", "ngram:17", "NGRAM", "ngram:4:4", ""]


def test_spelling_is_strict_everywhere():
    """Every way a speculation setting is given (the Python API's GenerationConfig, --speculative
    at startup, a request's ``speculative``) refuses a spelling that is not exactly ngram[:K],
    draft[:K] (K 1-16 in ASCII digits) or off, in one line; it once took "ngram:" and "ngram:\u0663"."""
    from pydantic import ValidationError

    from graphkiln.serve.schemas import CompletionRequest
    from graphkiln.serve.server import default_speculation

    for value in BAD_SETTINGS:
        with pytest.raises(GraphkilnError, match="is not supported") as err:
            GenerationConfig(speculative=value)
        assert "\n" not in str(err.value) and str(err.value).isascii(), value
        with pytest.raises(GraphkilnError, match="^--speculative .* is not supported"):
            default_speculation(value, None)
        with pytest.raises(ValidationError, match="is not supported"):
            CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": value})
    for good, setting in (("ngram", ("ngram", 4)), ("draft:16", ("draft", 16)), ("ngram:1", ("ngram", 1))):
        assert speculate.parse_speculative(good) == setting
