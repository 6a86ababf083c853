"""Generation behaviour of the runtime: sampling, log-probabilities, stops, streaming, limits.

References are transformers (logits, greedy tokens) and the ``tokenizers`` library (text);
the runtime under test is always the real onnxruntime engine on an exported artifact.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from graphkiln.runtime import Engine, GenerationConfig
from reference import ATOL, greedy, log_softmax, max_abs, teacher_forced_logits

TEXT_PROMPTS = ["The potter shapes the clay", "A kiln is a furnace", "When the fire rises slowly, the"]


def sample_cfg(**kw) -> GenerationConfig:
    base = dict(max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, seed=0, stop_token_ids=())
    base.update(kw)
    return GenerationConfig(**base)


def greedy_cfg(**kw) -> GenerationConfig:
    base = dict(max_new_tokens=24, do_sample=False, stop_token_ids=())
    base.update(kw)
    return GenerationConfig(**base)


def hf_tokenizer(case):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(case.checkpoint / "tokenizer.json"))


def ids(results) -> list[list[int]]:
    return [r.token_ids for r in results]


# -- sampling ----------------------------------------------------------------------------------

def test_same_seed_same_samples_and_different_seed_different_samples(tok_case):
    eng = tok_case.engine
    prompts = tok_case.prompts((6, 13), salt=10)
    a = ids(eng.generate(prompts, sample_cfg(seed=123)))
    b = ids(eng.generate(prompts, sample_cfg(seed=123)))
    c = ids(eng.generate(prompts, sample_cfg(seed=124)))
    g = ids(eng.generate(prompts, greedy_cfg()))
    assert a == b
    for i in range(len(prompts)):
        assert a[i] != c[i], "a different seed gave the same samples"
        assert a[i] != g[i], "sampling at temperature 1 produced the greedy sequence"


@pytest.mark.parametrize("settings", [
    dict(top_k=1, temperature=1.5),
    dict(top_p=1e-6, temperature=1.5),
    dict(temperature=0.0),
], ids=["top_k=1", "tiny_top_p", "temperature=0"])
def test_degenerate_sampling_settings_are_greedy(tok_case, settings):
    prompts = tok_case.prompts((6, 13), salt=11)
    got = ids(tok_case.engine.generate(prompts, sample_cfg(seed=7, **settings)))
    for p, toks in zip(prompts, got):
        assert toks == greedy(tok_case.reference, p, 24)[0]


def test_top_k_only_samples_among_the_k_most_likely(tok_case):
    prompts = tok_case.prompts((5, 9, 14, 3), salt=12)
    res = tok_case.engine.generate(prompts, sample_cfg(top_k=3, temperature=3.0, seed=1, output_logits=True))
    ranks = []
    for r in res:
        for t, logits in zip(r.token_ids, r.logits):
            ranks.append(int((logits > logits[t]).sum()))
    assert max(ranks) < 3, ranks
    assert sum(1 for k in ranks if k > 0) > len(ranks) // 4, "top_k=3 at high temperature barely sampled"


def test_top_p_only_samples_from_the_nucleus(tok_case):
    prompts = tok_case.prompts((5, 9, 14, 3), salt=13)
    top_p = 0.3
    res = tok_case.engine.generate(prompts, sample_cfg(top_p=top_p, temperature=2.0, seed=2, output_logits=True))
    outside_top1 = 0
    for r in res:
        for t, logits in zip(r.token_ids, r.logits):
            probs = np.exp(log_softmax(logits / 2.0))
            above = probs[probs > probs[t]].sum()  # mass of tokens strictly more likely than the sample
            assert above < top_p, f"sampled token {t} lies outside the top_p={top_p} nucleus (mass above {above:.3f})"
            outside_top1 += above > 0
    assert outside_top1 > 0, "top_p sampling never picked anything but the most likely token"


def test_temperature_sharpens_and_flattens(tok_case):
    prompts = tok_case.prompts((5, 9, 14, 3, 7, 11), salt=14)

    def mean_logprob(temperature):
        res = tok_case.engine.generate(prompts, sample_cfg(temperature=temperature, seed=3, logprobs=0))
        return float(np.mean([lp.logprob for r in res for lp in r.logprobs]))

    cold, warm, hot = mean_logprob(0.3), mean_logprob(1.0), mean_logprob(3.0)
    assert cold > warm > hot, (cold, warm, hot)


def test_sample_frequencies_follow_the_reference_distribution(tok_case):
    """Many one-token requests (each with its own generator) vs softmax(logits / T) over the top k."""
    prompt = tok_case.prompts((8,), salt=15)[0]
    n, temperature, top_k = 2000, 0.8, 6
    res = tok_case.engine.generate([prompt] * n, sample_cfg(max_new_tokens=1, temperature=temperature, top_k=top_k))
    counts = np.bincount([r.token_ids[0] for r in res], minlength=tok_case.vocab_size)

    from reference import forward_logits

    logits = forward_logits(tok_case.reference, prompt)[-1] / temperature
    top = np.argsort(-logits)[:top_k]
    expected = np.zeros(tok_case.vocab_size)
    expected[top] = np.exp(log_softmax(logits[top]))
    assert counts[expected == 0].sum() == 0, "sampled tokens outside the top k"
    freq = counts / n
    sigma = np.sqrt(expected * (1 - expected) / n)
    bad = np.flatnonzero(np.abs(freq - expected) > 5 * sigma + 1e-3)
    assert not bad.size, {int(t): (float(freq[t]), float(expected[t])) for t in bad}


def test_a_requests_samples_do_not_depend_on_the_rest_of_the_batch(tok_case):
    eng = tok_case.engine
    a, b, c, x = tok_case.prompts((7, 12, 9, 4), salt=16)
    near_full = tok_case.prompts((tok_case.max_seq_len - 5,), salt=17)[0]  # finishes after 5 tokens
    cfg = sample_cfg(seed=42, temperature=1.2)
    alone = eng.generate([c], cfg)[0].token_ids
    first_in_batch = eng.generate([c, a, near_full], cfg)
    assert first_in_batch[0].token_ids == alone
    assert len(first_in_batch[2].token_ids) == 5
    # request index 2 in two batches with different company (one of which finishes early)
    in_batch = eng.generate([a, b, c], cfg)[2].token_ids
    other_company = eng.generate([x, near_full, c], cfg)[2].token_ids
    assert in_batch == other_company


# -- log-probabilities -------------------------------------------------------------------------

def test_greedy_logprobs_equal_reference_log_softmax(tok_case):
    prompts = tok_case.prompts((6, 15), salt=20)
    n_top = 5
    res = tok_case.engine.generate(prompts, greedy_cfg(logprobs=n_top))
    for p, r in zip(prompts, res):
        ref_tokens, ref_logits = greedy(tok_case.reference, p, 24)
        assert r.token_ids == ref_tokens
        assert r.logprobs is not None and len(r.logprobs) == len(r.token_ids)
        ref_lps = log_softmax(ref_logits)
        for step, (t, lp) in enumerate(zip(r.token_ids, r.logprobs)):
            assert lp.token_id == t
            assert abs(lp.logprob - ref_lps[step, t]) <= ATOL
            assert len(lp.top) == n_top
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert lp.top[0] == (t, lp.logprob)  # greedy: the chosen token is the most likely
            ref_top = np.argsort(-ref_lps[step])[:n_top]
            assert [i for i, _ in lp.top] == ref_top.tolist()
            assert max_abs(np.array(values), ref_lps[step, ref_top]) <= ATOL


def test_sampled_logprobs_are_of_the_raw_distribution(tok_case):
    """Log-probabilities are log_softmax of the raw logits, not of the temperature-scaled ones."""
    prompts = tok_case.prompts((6, 15), salt=21)
    n_top = 3
    res = tok_case.engine.generate(prompts, sample_cfg(temperature=1.7, seed=9, logprobs=n_top))
    chosen_outside_top = 0
    for p, r in zip(prompts, res):
        ref_lps = log_softmax(teacher_forced_logits(tok_case.reference, p, r.token_ids))
        for step, (t, lp) in enumerate(zip(r.token_ids, r.logprobs)):
            assert lp.token_id == t
            assert abs(lp.logprob - ref_lps[step, t]) <= ATOL
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True) and len(values) == n_top
            for i, v in lp.top:
                assert abs(v - ref_lps[step, i]) <= ATOL
            top_ids = [i for i, _ in lp.top]
            if t in top_ids:
                assert lp.top[top_ids.index(t)][1] == lp.logprob
            else:
                chosen_outside_top += 1
                assert lp.logprob <= values[-1]
    assert chosen_outside_top > 0  # the samples were not all among the top alternatives


def test_logprobs_off_and_zero_alternatives(tok_case):
    p = tok_case.prompts((6,), salt=22)
    assert tok_case.engine.generate(p, greedy_cfg(max_new_tokens=4))[0].logprobs is None
    res = tok_case.engine.generate(p, greedy_cfg(max_new_tokens=4, logprobs=0))[0]
    assert len(res.logprobs) == 4 and all(lp.top == () for lp in res.logprobs)


# -- text, stop strings, stop tokens -----------------------------------------------------------

def test_text_prompts_use_the_checkpoint_tokenizer_and_match_transformers(tok_case):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(str(tok_case.checkpoint))
    res = tok_case.engine.generate(TEXT_PROMPTS, greedy_cfg(max_new_tokens=16))
    dec = hf_tokenizer(tok_case)
    for text, r in zip(TEXT_PROMPTS, res):
        assert r.prompt_ids == hf_tok(text).input_ids
        assert r.prompt_ids[0] == 1  # BOS added by the tokenizer's post-processor
        assert r.token_ids == greedy(tok_case.reference, r.prompt_ids, 16)[0]
        assert r.text == dec.decode(r.token_ids, skip_special_tokens=True)


def _long_greedy(tok_case, prompt: str, n: int = 48):
    return tok_case.engine.generate(prompt, greedy_cfg(max_new_tokens=n))[0]


def _clean_window(text: str, start: int, width: int) -> str:
    """A substring of ``width`` characters at or after ``start`` without replacement characters."""
    for i in range(start, len(text) - width):
        s = text[i:i + width]
        if "\ufffd" not in s and s.strip():
            return s
    raise AssertionError(f"no clean {width}-character window in {text!r}")


def _stop_candidates(tok_case, full) -> dict[str, str]:
    dec = hf_tokenizer(tok_case)
    text = full.text
    return {
        "middle": _clean_window(text, len(text) // 2, 4),
        "across_tokens": _across_token_boundary(dec, full.token_ids, text),
        "single_char": _clean_window(text, len(text) // 2, 1),
    }


def _across_token_boundary(dec, tokens: list[int], text: str) -> str:
    """Two characters either side of a token boundary in the second half of the text."""
    for j in range(len(tokens) // 2, len(tokens) - 1):
        head = dec.decode(tokens[:j])
        b = len(head)
        s = text[b - 2: b + 2]
        clean = len(s) == 4 and "\ufffd" not in s and s.strip()
        if clean and text.startswith(head) and len(dec.decode([tokens[j]])) >= 2:
            return s
    raise AssertionError(f"no clean token boundary in {text!r}")


@pytest.mark.parametrize("which", ["middle", "across_tokens", "single_char"])
def test_stop_string_ends_text_right_before_it(tok_case, which):
    prompt = TEXT_PROMPTS[0]
    full = _long_greedy(tok_case, prompt)
    assert full.finish_reason == "length"
    stop = _stop_candidates(tok_case, full)[which]
    first = full.text.find(stop)
    assert first > 0 and "\ufffd" not in stop

    res = tok_case.engine.generate(prompt, greedy_cfg(max_new_tokens=48, stop_strings=(stop,)))[0]
    assert res.finish_reason == "stop"
    assert res.text == full.text[:first]
    # generation stopped at the first token whose text completes the stop string
    dec = hf_tokenizer(tok_case)
    assert res.token_ids == full.token_ids[:len(res.token_ids)]
    assert stop in dec.decode(res.token_ids)
    assert stop not in dec.decode(res.token_ids[:-1])


def test_earliest_of_several_stop_strings_wins(tok_case):
    prompt = TEXT_PROMPTS[1]
    full = _long_greedy(tok_case, prompt)
    late = _clean_window(full.text, 3 * len(full.text) // 4, 3)
    early = _clean_window(full.text, len(full.text) // 3, 3)
    first = min(full.text.find(late), full.text.find(early))
    res = tok_case.engine.generate(prompt, greedy_cfg(max_new_tokens=48, stop_strings=(late, early)))[0]
    assert res.finish_reason == "stop" and res.text == full.text[:first]


def test_stop_string_that_never_appears(tok_case):
    res = tok_case.engine.generate(TEXT_PROMPTS[0], greedy_cfg(max_new_tokens=20, stop_strings=("\x00never\x00",)))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 20


def test_stop_token_ids_end_one_request_and_leave_the_others_alone(tok_case):
    eng = tok_case.engine
    prompts = tok_case.prompts((6, 11, 8), salt=30)
    base = ids(eng.generate(prompts, greedy_cfg()))
    # a token request 0 produces at step >= 3 that the other requests never produce
    others = set(base[1]) | set(base[2])
    step = next(k for k in range(3, 24) if base[0][k] not in others and base[0][k] not in base[0][:k])
    stop = base[0][step]
    res = eng.generate(prompts, greedy_cfg(stop_token_ids=(stop,)))
    assert res[0].token_ids == base[0][:step + 1]  # the stop token is included
    assert res[0].finish_reason == "stop"
    assert [r.token_ids for r in res[1:]] == base[1:]
    assert [r.finish_reason for r in res[1:]] == ["length", "length"]


def test_artifact_eos_ids_are_the_default_stop_tokens(tok_case, artifact_copy):
    """stop_token_ids=None stops on the manifest's eos_token_ids; () disables that."""
    assert tok_case.manifest.generation.eos_token_ids == (2,)
    prompt = tok_case.prompts((7,), salt=31)[0]
    base = tok_case.engine.generate(prompt, greedy_cfg())[0].token_ids
    eos = next(t for k, t in enumerate(base) if k >= 3 and t not in base[:k])
    art = artifact_copy(tok_case)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["generation"]["eos_token_ids"] = [eos]
    (art / "manifest.json").write_text(json.dumps(manifest))
    eng = Engine.load(art)
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=24, do_sample=False))[0]
    assert res.token_ids == base[:base.index(eos) + 1] and res.finish_reason == "stop"
    res = eng.generate(prompt, GenerationConfig(max_new_tokens=24, do_sample=False, stop_token_ids=()))[0]
    assert res.token_ids == base


def test_artifact_generation_defaults_apply(sampling_default_case):
    """The checkpoint's generation_config.json (sampling, max_new_tokens 24) is the default."""
    case = sampling_default_case
    p = case.prompts((9,), salt=32)[0]
    res = [case.engine.generate(p, GenerationConfig(seed=s, stop_token_ids=()))[0] for s in (0, 1)]
    assert [len(r.token_ids) for r in res] == [24, 24]
    assert res[0].token_ids != res[1].token_ids  # sampled
    forced = case.engine.generate(p, GenerationConfig(do_sample=False, stop_token_ids=()))[0]
    assert forced.token_ids == greedy(case.reference, p, 24)[0]


# -- streaming ---------------------------------------------------------------------------------

def _collect(events):
    text, toks, finish = {}, {}, {}
    for ev in events:
        assert ev.request not in finish, "event after the request's final event"
        text[ev.request] = text.get(ev.request, "") + ev.text
        toks.setdefault(ev.request, []).append(ev.token_id)
        if ev.finish_reason is not None:
            finish[ev.request] = ev.finish_reason
    return text, toks, finish


@pytest.mark.parametrize("mode", ["greedy", "sampled", "stop_string", "unfinished_stop_strings"])
def test_stream_equals_generate(tok_case, mode):
    eng = tok_case.engine
    if mode == "greedy":
        cfg = greedy_cfg(max_new_tokens=40)
    elif mode == "sampled":
        cfg = sample_cfg(max_new_tokens=40, temperature=1.5, seed=5)
    else:
        full = eng.generate(TEXT_PROMPTS[0], greedy_cfg(max_new_tokens=40))[0]
        piece = _clean_window(full.text, len(full.text) // 2, 3)
        if mode == "stop_string":
            cfg = greedy_cfg(max_new_tokens=40, stop_strings=(piece,))
        else:
            # stop strings whose beginnings appear (mid-text and at the very end) but never complete:
            # text held back while a stop string might be starting must still come out
            cfg = greedy_cfg(max_new_tokens=40, stop_strings=(piece + "\x00", full.text[-2:] + "\x00"))
    results = eng.generate(TEXT_PROMPTS, cfg)
    text, toks, finish = _collect(eng.stream(TEXT_PROMPTS, cfg))
    for i, r in enumerate(results):
        assert toks[i] == r.token_ids
        assert text[i] == r.text, f"request {i}: streamed text differs from the final text"
        assert finish[i] == r.finish_reason
    if mode == "stop_string":
        assert results[0].finish_reason == "stop"
    if mode == "unfinished_stop_strings":
        assert results[0].text == full.text and results[0].finish_reason == "length"


def test_stream_without_tokenizer_yields_ids(llama_case):
    prompts = llama_case.prompts((4, 9), salt=40)
    cfg = greedy_cfg(max_new_tokens=10, logprobs=2)
    results = llama_case.engine.generate(prompts, cfg)
    events = list(llama_case.engine.stream(prompts, cfg))
    assert len(events) == 20
    _, toks, finish = _collect(events)
    assert toks == {0: results[0].token_ids, 1: results[1].token_ids}
    assert finish == {0: "length", 1: "length"}
    assert all(ev.text == "" for ev in events)
    assert [ev.logprob for ev in events if ev.request == 0] == results[0].logprobs
    assert results[0].text is None


# -- length limits -----------------------------------------------------------------------------

def test_max_new_tokens_is_clamped_at_the_maximum_sequence_length(tok_case):
    m = tok_case.engine.max_seq_len
    assert m == tok_case.max_seq_len
    long_p, last_p, short_p = tok_case.prompts((m - 30, m - 1, 5), salt=50)
    res = tok_case.engine.generate([long_p, last_p, short_p], greedy_cfg(max_new_tokens=10_000, output_logits=True))
    assert [len(r.token_ids) for r in res] == [30, 1, m - 5]
    assert all(r.finish_reason == "length" for r in res)
    # the tokens up to the very end of the cache still match transformers
    for p, r in zip((long_p, last_p), res):
        ref_tokens, ref_logits = greedy(tok_case.reference, p, len(r.token_ids))
        assert r.token_ids == ref_tokens
        assert max_abs(r.logits, ref_logits) <= ATOL


def test_zero_new_tokens(tok_case):
    res = tok_case.engine.generate(tok_case.prompts((5,), salt=51), greedy_cfg(max_new_tokens=0))[0]
    assert res.token_ids == [] and res.finish_reason == "length"


# -- the run command ---------------------------------------------------------------------------

def test_cli_run_greedy_ids_and_stream(llama_case, capsys):
    from graphkiln.cli import main

    p = llama_case.prompts((6,), salt=60)[0]
    expected = greedy(llama_case.reference, p, 8)[0]
    args = ["run", str(llama_case.artifact), "--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", "8",
            "--ignore-eos"]
    assert main(args) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]
    assert main(args + ["--stream"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in expected]


def test_cli_run_logprobs(llama_case, capsys):
    from graphkiln.cli import main

    p = llama_case.prompts((6,), salt=62)[0]
    res = llama_case.engine.generate(p, greedy_cfg(max_new_tokens=3, logprobs=2))[0]
    assert main(["run", str(llama_case.artifact), "--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", "3",
                 "--logprobs", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == [str(t) for t in res.token_ids]
    assert len(lines) == 4
    for line, lp in zip(lines[1:], res.logprobs):
        alts = ", ".join(f"{t}:{v:.3f}" for t, v in lp.top)
        assert line == f"  token {lp.token_id} logprob {lp.logprob:.4f}  top: {alts}"


def test_cli_run_text_with_stop_string(tok_case, capsys):
    from graphkiln.cli import main

    full = tok_case.engine.generate(TEXT_PROMPTS[0], greedy_cfg(max_new_tokens=30))[0]
    stop = _clean_window(full.text, len(full.text) // 2, 3)
    assert main(["run", str(tok_case.artifact), "--prompt", TEXT_PROMPTS[0], "--max-new-tokens", "30",
                 "--ignore-eos", "--stop", stop]) == 0
    assert capsys.readouterr().out == full.text[:full.text.find(stop)] + "\n"


def test_cli_run_greedy_flag_overrides_sampling_defaults(sampling_default_case, capsys):
    from graphkiln.cli import main

    case = sampling_default_case
    p = case.prompts((7,), salt=61)[0]
    base = ["run", str(case.artifact), "--prompt-ids", " ".join(map(str, p)), "--ignore-eos", "--max-new-tokens", "12"]
    assert main(base + ["--greedy"]) == 0
    assert capsys.readouterr().out.split() == [str(t) for t in greedy(case.reference, p, 12)[0]]
    outs = []
    for seed in ("1", "2"):
        assert main(base + ["--seed", seed]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] != outs[1]  # the artifact's default is sampling


@pytest.mark.parametrize("style", ["byte_level", "metaspace"])
def test_incremental_detokenizer_pieces_join_to_the_full_decode(tmp_path, style):
    """Streaming decodes only the newest tokens with a little left context; joined, the pieces
    must equal decoding everything at once, for byte-level BPE (multi-byte characters split
    across tokens) and for SentencePiece-style tokenizers (leading space stripped)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from graphkiln.runtime.request.tokenizer import IncrementalDetokenizer, Tokenizer

    corpus = ["Ünïcödé tëxt, 漢字かな交じり文, emoji 🚀🔥 and plain words.",
              "The quick brown fox jumps over the lazy dog — twice: naïve café déjà vu.",
              "数字 12345 and ½ ¾ ∑ ∫ √ symbols; 한국어 텍스트도 있습니다."] * 4
    tok = HFTokenizer(models.BPE(unk_token=None if style == "byte_level" else "<unk>"))
    if style == "byte_level":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                      special_tokens=["<eos>"])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"])
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    ours = Tokenizer(tmp_path / "tokenizer.json")

    rng = np.random.default_rng(0)
    sequences = [ours.encode(text) for text in corpus[:3]]
    sequences += [rng.integers(0, tok.get_vocab_size(), 60).tolist() for _ in range(20)]
    for ids in sequences:
        detok = IncrementalDetokenizer(ours)
        pieces = [detok.step(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
        assert "".join(pieces) == ours.decode(ids)
        assert all("\ufffd" not in p[-1:] for p in pieces[:-1]), "a piece ended in a partial character"
