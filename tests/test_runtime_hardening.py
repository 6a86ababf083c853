"""Runtime and verify hardening (issue 10): broken models, hostile settings, shared engines.

Broken weights are made by writing NaN/Inf into a real exported artifact's external data
(at the byte offset onnx records for the initializer, with the manifest's sha256 updated) or
into a real checkpoint's safetensors, never by mocking onnxruntime or transformers.
"""

from __future__ import annotations

import gc
import hashlib
import io
import json
import math
import re
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import StateSpec
from graphkiln.runtime import Engine, GenerationConfig
from graphkiln.runtime.engine import BUSY, NonFiniteLogitsError
from graphkiln.runtime.request.sampling import NonFiniteLogits, SamplingParams, select_token
from graphkiln.memory import available_memory
from graphkiln.runtime.backends.state import StatePool
from cli_contract import assert_one_error, run_cli
from conftest import checkpoint_claiming_a_huge_layer

EMBED = "model.embed_tokens.weight"  # [vocab, hidden] in the checkpoint and in the portable graph
# The portable llama graph's lm_head, stored transposed [hidden, vocab] under a name the exporter
# picks (it changes with the graph), so poison_artifact finds it by shape.
LM_HEAD_T = "lm_head, transposed"


def greedy_cfg(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=False, stop_token_ids=(), **kw)


def sampled_cfg(n: int, **kw) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=n, do_sample=True, temperature=1.0, seed=3, stop_token_ids=(), **kw)


# -- building broken models ---------------------------------------------------------------------

def poison_artifact(art: Path, initializer: str, index, value: float) -> None:
    """Write ``value`` into ``initializer[index]`` (float32, external data) and re-seal the
    manifest's sha256 of the data file, so the artifact loads and only its numbers are wrong."""
    import onnx

    manifest = json.loads((art / "manifest.json").read_text())
    graph = manifest["graphs"][0]["file"]
    model = onnx.load(str(art / graph), load_external_data=False)
    if initializer == LM_HEAD_T:
        shape = [manifest["model"]["hidden_size"], manifest["model"]["vocab_size"]]
        (init,) = [i for i in model.graph.initializer if list(i.dims) == shape]
    else:
        init = next(i for i in model.graph.initializer if i.name == initializer)
    info = {e.key: e.value for e in init.external_data}
    assert init.data_type == onnx.TensorProto.FLOAT
    data = art / info["location"]
    weights = np.memmap(data, np.float32, "r+", offset=int(info.get("offset", 0)), shape=tuple(init.dims))
    weights[index] = value
    weights.flush()
    del weights
    manifest["files"][info["location"]] = hashlib.sha256(data.read_bytes()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))


def poison_checkpoint(ckpt: Path, tensor: str, index, value: float) -> None:
    from safetensors.numpy import load_file, save_file

    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    tensors[tensor] = tensors[tensor].copy()
    tensors[tensor][index] = value
    save_file(tensors, str(path), metadata={"format": "pt"})


def verify_first_prompt(case, seed: int) -> list[int]:
    """The first prompt ``graphkiln verify --seed seed`` draws (one prompt of 12 tokens; see
    graphkiln.export.verify): the tests poison tokens it does or does not contain."""
    return np.random.default_rng(seed).integers(0, case.vocab_size, 12).tolist()


def fresh_generated_token(case, prompt: list[int], steps: int) -> tuple[int, int]:
    """(token, s): the clean model's s-th greedy token (1-based, s < steps) that is neither in
    the prompt nor generated before, so poisoning its embedding row first shows at step s + 1."""
    tokens = case.engine.generate([prompt], greedy_cfg(steps))[0].token_ids
    for s, t in enumerate(tokens[:-1], start=1):
        if t not in prompt and t not in tokens[: s - 1]:
            return t, s
    raise AssertionError("no fresh token in the greedy continuation: pick another prompt")


# -- non-finite logits: sampling primitive ------------------------------------------------------

@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.8, top_k=5, top_p=0.9)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("row", [
    [1.0, np.nan, 2.0, 0.5],
    [np.nan, np.nan, np.nan, np.nan],
    [1.0, 2.0, np.inf, 0.5],
    [-np.inf, -np.inf, -np.inf, -np.inf],
    [1.0, 2.0, 3.0, np.nan],
], ids=["nan_inside", "all_nan", "pos_inf", "all_neg_inf", "nan_last"])
def test_select_token_refuses_rows_without_a_distribution(params, row):
    with pytest.raises(NonFiniteLogits):
        select_token(np.array(row, np.float32), params, np.random.default_rng(0))


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(do_sample=True, temperature=0.8, top_k=3),
                                    SamplingParams(do_sample=True, temperature=1e-300)],
                         ids=["greedy", "sampled", "tiny_temperature"])
def test_select_token_accepts_minus_inf_entries_and_tiny_temperatures(params):
    """-Inf is a legitimate zero probability (the check must not refuse it), and a tiny
    temperature must not overflow into NaN probabilities."""
    row = np.array([-np.inf, 3.0e38, -np.inf, 1.0e38], np.float32)
    for seed in range(20):
        assert select_token(row, params, np.random.default_rng(seed)) == 1


# -- non-finite logits: run ---------------------------------------------------------------------

POISONS = {  # (initializer, index, value) -> every step's logits are broken
    "lm_head_column_nan": (LM_HEAD_T, (slice(None), 7), np.nan),
    "lm_head_column_inf": (LM_HEAD_T, (slice(None), 7), np.inf),
    "embedding_nan": (EMBED, slice(None), np.nan),
    "embedding_neg_inf": (EMBED, slice(None), -np.inf),
    "mlp_weight_nan": ("model.layers.1.mlp.down_proj.weight.T", (3, 5), np.nan),
}


@pytest.mark.parametrize("mode", ["generate", "stream"])
@pytest.mark.parametrize("cfg", [greedy_cfg(6), sampled_cfg(6), sampled_cfg(6, logprobs=3, output_logits=True)],
                         ids=["greedy", "sampled", "sampled_logprobs"])
@pytest.mark.parametrize("poison", list(POISONS))
def test_engine_refuses_to_sample_from_non_finite_logits(llama_case, artifact_copy, poison, cfg, mode):
    art = artifact_copy(llama_case)
    poison_artifact(art, *POISONS[poison])
    engine = Engine.load(art, threads=1)
    prompts = llama_case.prompts((5, 9), salt=40)
    with pytest.raises(NonFiniteLogitsError, match=r"NaN/Inf logits at step 1 of request 0: .*re-export") as info:
        if mode == "generate":
            engine.generate(prompts, cfg)
        else:
            events = []
            for ev in engine.stream(prompts, cfg):
                events.append(ev)
    assert isinstance(info.value, GraphkilnError) and (info.value.request, info.value.step) == (0, 1)
    if mode == "stream":
        assert events == []
    assert engine.pool.live == 0
    engine.generate(prompts, GenerationConfig(max_new_tokens=0))  # the engine is free again


@pytest.mark.parametrize("mode", ["generate", "stream"])
@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("salt", [41, 42])
def test_logits_that_break_mid_generation_name_their_step_and_request(llama_case, artifact_copy, mode, value, salt):
    """Poison the embedding row of a token the model generates later: the steps before it
    are produced (and streamed), the first step that reads it is refused."""
    prompts = llama_case.prompts((6, 4), salt=salt)
    token, s = fresh_generated_token(llama_case, prompts[1], 10)
    if token in prompts[0]:
        pytest.skip("token also in the other prompt")
    clean = llama_case.engine.generate(prompts, greedy_cfg(10))
    art = artifact_copy(llama_case)
    poison_artifact(art, EMBED, token, value)
    engine = Engine.load(art, threads=1)
    streamed = []
    with pytest.raises(NonFiniteLogitsError) as info:
        if mode == "generate":
            engine.generate(prompts, greedy_cfg(10))
        else:
            for ev in engine.stream(prompts, greedy_cfg(10)):
                streamed.append(ev)
    # request 0 may have generated the token earlier than request 1 did
    first = min((clean[i].token_ids.index(token) + 2, i) for i in (0, 1) if token in clean[i].token_ids[:-1])
    assert (info.value.step, info.value.request) == first
    assert f"at step {first[0]} of request {first[1]}" in str(info.value)
    if mode == "stream":
        assert [ev.token_id for ev in streamed if ev.request == 1] == clean[1].token_ids[: first[0] - 1]
    assert engine.pool.live == 0


@pytest.mark.parametrize("extra", [(), ("--stream",), ("--temperature", "0.9"), ("--stream", "--top-k", "4"),
                                   ("--logprobs", "2")])
def test_cli_run_of_a_nan_artifact_is_one_error_line(llama_case, artifact_copy, capsys, extra):
    art = artifact_copy(llama_case)
    poison_artifact(art, *POISONS["lm_head_column_nan"])
    code, out, err = run_cli(capsys, "run", art, "--prompt-ids", "5,6,7", "--prompt-ids", "9,3",
                             "--max-new-tokens", "4", *extra)
    assert_one_error(code, err, "NaN/Inf logits at step 1 of request 0", "re-export", "graphkiln verify")
    assert out.strip() == ""


# -- non-finite logits: verify ------------------------------------------------------------------

def _verify_case(case, artifact_copy, checkpoint_copy, who: str, where: str, value: float):
    """(artifact, reference, seed, expected location) with NaN/Inf placed as asked."""
    art, ckpt = case.artifact, case.checkpoint
    seed = 0
    if where == "prompt_head":  # every position's logit 7
        expected = "at prompt position 0 of prompt 0 in batch 0"
        if who == "ours":
            poison_artifact(art := artifact_copy(case), LM_HEAD_T, (slice(None), 7), value)
        else:
            poison_checkpoint(ckpt := checkpoint_copy(case), "lm_head.weight", 7, value)
    elif where == "prompt_token":  # the embedding of a token in the middle of the prompt
        # Its NaN key/value rows reach earlier positions too (masked attention still multiplies
        # them by probability 0, and 0 * NaN is NaN), so which position is first is the graph's.
        prompt = verify_first_prompt(case, seed)
        pos = next(k for k in range(3, 12) if prompt[k] not in prompt[:k])
        expected = r"at prompt position \d+ of prompt 0 in batch 0"
        if who == "ours":
            poison_artifact(art := artifact_copy(case), EMBED, prompt[pos], value)
        else:
            poison_checkpoint(ckpt := checkpoint_copy(case), EMBED, prompt[pos], value)
    else:  # a token the model generates later
        for seed in range(8):
            try:
                token, s = fresh_generated_token(case, verify_first_prompt(case, seed), 8)
                break
            except AssertionError:
                continue
        expected = f"at generation step {s + 1} of prompt 0 in batch 0"
        if who == "ours":
            poison_artifact(art := artifact_copy(case), EMBED, token, value)
        else:
            poison_checkpoint(ckpt := checkpoint_copy(case), EMBED, token, value)
    return art, ckpt, seed, f"{who} {expected}" if where == "prompt_token" else re.escape(f"{who} {expected}")


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("where", ["prompt_head", "prompt_token", "generation"])
@pytest.mark.parametrize("who", ["ours", "reference"])
def test_verify_fails_on_non_finite_logits_and_says_where(llama_case, artifact_copy, checkpoint_copy, capsys,
                                                          who, where, value):
    """A verdict, not a usage error: exit status 1 with the FAIL line on stdout, as for any
    other failed verification (before the fix a NaN compared as error 0 and passed)."""
    art, ckpt, seed, expected = _verify_case(llama_case, artifact_copy, checkpoint_copy, who, where, value)
    code, out, err = run_cli(capsys, "verify", art, "--reference", ckpt, "--steps", "8", "--seed", seed)
    assert code == 1, (out, err)
    assert re.search(rf"logits contain NaN/Inf \({expected}\) -> FAIL$", out.strip()), out
    assert "PASS" not in out and "Traceback" not in err


def test_verify_api_report_of_non_finite_logits(llama_case, artifact_copy):
    from graphkiln.export.verify import verify_artifact

    art = artifact_copy(llama_case)
    poison_artifact(art, LM_HEAD_T, (slice(None), 7), np.nan)
    report = verify_artifact(art, str(llama_case.checkpoint), steps=4)
    assert not report.passed
    assert report.nonfinite == "ours at prompt position 0 of prompt 0 in batch 0"
    assert math.isfinite(report.max_abs_error)  # measures only ever saw finite rows
    clean = verify_artifact(llama_case.artifact, str(llama_case.checkpoint), steps=4, engine=llama_case.engine)
    assert clean.passed and clean.nonfinite is None


# -- padding ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pad", [-1, -7, 320, 321, 10**6, 2**31, 2**62, 2**63 - 1, 2**63, 2**70])
def test_padding_does_not_use_the_checkpoints_pad_id(llama_case, pad):
    """Mixed-length batches pad with an id of the engine's own: a pad_token_id outside the
    vocabulary (or outside int64) changes nothing. The Engine is built from the manifest
    object so this tests the runtime even where the loader would refuse such a manifest."""
    assert llama_case.vocab_size == 320
    m = llama_case.manifest
    engine = Engine(llama_case.artifact, replace(m, generation=replace(m.generation, pad_token_id=pad)), threads=1)
    prompts = llama_case.prompts((3, 11, 6), salt=50)
    expected = llama_case.engine.generate(prompts, greedy_cfg(8))
    assert [r.token_ids for r in engine.generate(prompts, greedy_cfg(8))] == [r.token_ids for r in expected]
    for ours, ref in zip(engine.prompt_logits(prompts), llama_case.engine.prompt_logits(prompts)):
        np.testing.assert_array_equal(ours, ref)


# -- concurrency --------------------------------------------------------------------------------

def _tokens(engine, kind: str, prompts, cfg):
    if kind == "generate":
        return [r.token_ids for r in engine.generate(prompts, cfg)]
    if kind == "stream":
        out = [[] for _ in prompts]
        for ev in engine.stream(prompts, cfg):
            out[ev.request].append(ev.token_id)
        return out
    return [l.tobytes() for l in engine.prompt_logits(prompts)]


@pytest.mark.parametrize("threads,calls", [(8, 20), (3, 30)])
def test_threads_sharing_one_engine_get_correct_results_or_the_busy_error(llama_case, threads, calls):
    engine = Engine.load(llama_case.artifact, threads=1)
    prompts = llama_case.prompts((5, 9, 2), salt=60)
    cfg = greedy_cfg(5)
    kinds = ("generate", "stream", "prompt_logits")
    solo = {k: _tokens(engine, k, prompts, cfg) for k in kinds}
    assert solo["generate"] == solo["stream"]
    barrier = threading.Barrier(threads)
    outcomes: list[tuple[str, object]] = []

    def worker(w: int) -> None:
        barrier.wait()
        for j in range(calls):
            kind = kinds[(w + j) % len(kinds)]
            try:
                outcomes.append((kind, _tokens(engine, kind, prompts, cfg)))
            except BaseException as exc:  # noqa: BLE001 - the test asserts on every kind
                outcomes.append((kind, exc))

    pool = [threading.Thread(target=worker, args=(w,)) for w in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(outcomes) == threads * calls
    unexpected = [(k, o) for k, o in outcomes if isinstance(o, BaseException)
                  and not (type(o) is GraphkilnError and str(o) == BUSY)]
    assert not unexpected, unexpected[:3]
    wrong = [k for k, o in outcomes if not isinstance(o, BaseException) and o != solo[k]]
    assert not wrong, wrong
    busy = sum(isinstance(o, BaseException) for _, o in outcomes)
    assert 0 < busy < len(outcomes), busy  # the callers really collided, and some got through
    assert engine.pool.live == 0
    assert _tokens(engine, "generate", prompts, cfg) == solo["generate"]


@pytest.mark.parametrize("release", ["close", "exhaust", "garbage_collect", "consumer_raises"])
@pytest.mark.parametrize("intruder", ["generate", "stream", "prompt_logits", "other_thread"])
def test_an_open_stream_holds_the_engine_until_it_ends(llama_case, release, intruder):
    engine = Engine.load(llama_case.artifact, threads=1)
    prompts = llama_case.prompts((4, 7), salt=61)
    cfg = greedy_cfg(6)
    expected = _tokens(engine, "generate", prompts, cfg)

    idle = engine.stream(prompts, cfg)  # not started: holds nothing
    assert _tokens(engine, "generate", prompts, cfg) == expected
    del idle

    stream = engine.stream(prompts, cfg)
    next(stream)
    if intruder == "other_thread":
        errors = []
        t = threading.Thread(target=lambda: errors.append(_catch(lambda: engine.generate(prompts, cfg))))
        t.start()
        t.join()
        assert type(errors[0]) is GraphkilnError and str(errors[0]) == BUSY
    else:
        with pytest.raises(GraphkilnError, match="already generating: use one Engine per concurrent caller"):
            _tokens(engine, intruder, prompts, cfg)
    assert engine.pool.live == len(prompts)  # the intruder did not disturb the open stream

    if release == "close":
        stream.close()
    elif release == "exhaust":
        for _ in stream:
            pass
    elif release == "garbage_collect":
        del stream
        gc.collect()
    else:  # the consumer fails and drops the stream
        with pytest.raises(KeyError):
            for _ in stream:
                raise KeyError("consumer")
        del stream
        gc.collect()
    assert engine.pool.live == 0
    assert _tokens(engine, "generate", prompts, cfg) == expected
    assert _tokens(engine, "prompt_logits", prompts, cfg) == _tokens(llama_case.engine, "prompt_logits", prompts, cfg)


@pytest.mark.parametrize("kind", ["generate", "stream", "prompt_logits"])
def test_a_failed_session_releases_the_engine(llama_case, kind):
    engine = Engine.load(llama_case.artifact, threads=1)
    prompts = llama_case.prompts((4, 7), salt=62)
    for bad in ([[1, 2], [llama_case.vocab_size]], [[1, 2], list(range(llama_case.max_seq_len))]):
        with pytest.raises(GraphkilnError, match="vocabulary|maximum sequence length"):
            _tokens(engine, kind, bad, greedy_cfg(3))
        assert _tokens(engine, kind, prompts, greedy_cfg(3)) == _tokens(llama_case.engine, kind, prompts, greedy_cfg(3))


def _catch(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    return None


# -- settings and inputs ------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needles", [
    (("--stop", ""), ("--stop", "non-empty string")),
    (("--temperature", "nan"), ("--temperature", "finite")),
    (("--temperature", "inf"), ("--temperature", "finite")),
    (("--temperature", "-inf"), ("--temperature", "finite")),
    (("--temperature", "-0.5"), ("--temperature", ">= 0")),
    (("--temperature", "warm"), ("--temperature", "not a number")),
    (("--top-p", "nan"), ("--top-p",)),
    (("--top-p", "0"), ("--top-p", "> 0")),
    (("--top-p", "1.01"), ("--top-p", "<= 1")),
    (("--top-p", "-0.2"), ("--top-p",)),
    (("--top-k", "-1"), ("--top-k", ">= 0")),
    (("--max-new-tokens", "-1"), ("--max-new-tokens", ">= 0")),
    (("--max-new-tokens", "1.5"), ("--max-new-tokens", "not an integer")),
    (("--seed", "-1"), ("--seed", ">= 0")),
    (("--seed", "-99999999999999999999"), ("--seed", ">= 0")),
    (("--seed", "x"), ("--seed", "not an integer")),
    (("--logprobs", "-1"), ("--logprobs", ">= 0")),
    (("--threads", "0"), ("--threads", ">= 1")),
    (("--threads", "-4"), ("--threads", ">= 1")),
    (("--prompt-ids", "-1,2"), ("-1", "token ids")),
    (("--prompt-ids", str(2**63 + 5)), (str(2**63 + 5), "vocabulary")),
    (("--prompt-ids", "99999999999999999999999999999"), ("vocabulary",)),
    (("--prompt-ids", "1.5,2"), ("--prompt-ids", "integers")),
])
def test_cli_run_refuses_bad_settings(llama_case, capsys, argv, needles):
    base = () if argv[0] == "--prompt-ids" else ("--prompt-ids", "1,2,3")
    # FLAG=VALUE: argparse takes a lone '-inf' or '-1,2' for an option
    code, out, err = run_cli(capsys, "run", llama_case.artifact, *base, "=".join(argv))
    assert_one_error(code, err, *needles)
    assert out == ""


@pytest.mark.parametrize("argv,needles", [
    (("--steps", "0"), ("--steps", ">= 1")),
    (("--steps", "-3"), ("--steps", ">= 1")),
    (("--atol", "-1e-4"), ("--atol", ">= 0")),
    (("--atol", "nan"), ("--atol", "finite")),
    (("--atol", "inf"), ("--atol", "finite")),
    (("--seed", "-2"), ("--seed", ">= 0")),
])
def test_cli_verify_refuses_bad_settings(llama_case, capsys, argv, needles):
    code, out, err = run_cli(capsys, "verify", llama_case.artifact, "--reference", llama_case.checkpoint, "=".join(argv))
    assert_one_error(code, err, *needles)
    assert out == ""


@pytest.mark.parametrize("kwargs,needle", [
    (dict(seed=-1), "seed"),
    (dict(seed=1.5), "seed"),
    (dict(seed=None), "seed"),
    (dict(seed=True), "seed"),
    (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(max_new_tokens=2.0), "max_new_tokens"),
    (dict(top_k=-2), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature="0.7"), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop_strings=("",)), "stop_strings"),
    (dict(stop_strings=("ok", "")), "stop_strings"),
    (dict(stop_strings="abc"), "stop_strings"),
    (dict(stop_token_ids=(1, "2")), "stop_token_ids"),
])
def test_generation_config_refuses_bad_values(kwargs, needle):
    with pytest.raises(GraphkilnError, match=needle):
        GenerationConfig(**kwargs)


@pytest.mark.parametrize("defaults", [
    dict(do_sample=True, temperature=float("nan")),
    dict(do_sample=True, temperature=float("inf")),
    dict(do_sample=True, top_p=float("nan")),
    dict(do_sample=True, top_k=-1),
    dict(max_new_tokens=-5),
])
def test_engine_refuses_broken_generation_defaults_of_an_artifact(llama_case, defaults):
    m = llama_case.manifest
    engine = Engine(llama_case.artifact, replace(m, generation=replace(m.generation, **defaults)), threads=1)
    with pytest.raises(GraphkilnError, match="max_new_tokens|sampling settings out of range"):
        engine.generate([[1, 2, 3]], GenerationConfig(stop_token_ids=()))
    assert engine.pool.live == 0


@pytest.mark.parametrize("threads", [0, -1, 1.5, "4", True, "cpus+1", 100_000])
def test_engine_refuses_bad_thread_counts(llama_case, threads):
    """Every thread count outside 1..usable CPUs is refused before any file is hashed or thread
    started, with the bound in the message (an unbounded one once started 14,533 threads)."""
    from graphkiln.threads import usable_cpus

    threads = usable_cpus() + 1 if threads == "cpus+1" else threads
    with pytest.raises(GraphkilnError, match=rf"threads .*1( to |\.\.){usable_cpus()}") as e:
        Engine.load(llama_case.artifact, threads=threads)
    assert "\n" not in str(e.value)
    from graphkiln.runtime.backends.ort_cpu import cpu_session  # where a Ray stage actor's sessions are made

    with pytest.raises(GraphkilnError, match="threads"):
        cpu_session(llama_case.artifact, llama_case.manifest.graphs[0], threads)


def test_engine_takes_every_thread_count_in_its_bound(llama_case):
    from graphkiln.threads import usable_cpus

    for threads in sorted({1, usable_cpus()}):
        assert Engine.load(llama_case.artifact, threads=threads, check_files=False).generate(
            [3, 4], greedy_cfg(2))[0].token_ids


@pytest.mark.parametrize("prompt,needle", [
    ([1.5, 2], "not an integer"),
    ([1, "2"], "not an integer"),
    ([1, None], "not an integer"),
    (np.array([1.0, 2.0]), "not an integer"),
    ([1, -3], "outside the vocabulary"),
    ([2**64], "outside the vocabulary"),
    (np.array([1, 2**62], np.int64), "outside the vocabulary"),
])
def test_engine_refuses_prompt_ids_that_are_not_vocabulary_ints(llama_case, prompt, needle):
    for call in (lambda: llama_case.engine.generate(prompt, greedy_cfg(2)),
                 lambda: llama_case.engine.prompt_logits([prompt])):
        with pytest.raises(GraphkilnError, match=needle):
            call()
    assert llama_case.engine.pool.live == 0


@pytest.mark.parametrize("kwargs,needle", [
    (dict(steps=0), "steps"), (dict(steps=-1), "steps"), (dict(seed=-1), "seed"),
    (dict(atol=-1.0), "atol"), (dict(atol=float("nan")), "atol"),
])
def test_verify_api_refuses_bad_settings(llama_case, kwargs, needle):
    from graphkiln.export.verify import verify_artifact

    with pytest.raises(GraphkilnError, match=needle):
        verify_artifact(llama_case.artifact, str(llama_case.checkpoint), **kwargs)


# -- memory -------------------------------------------------------------------------------------

def _kv(layers: int, heads: int, head_dim: int, max_seq_len: int = 2**62) -> StateSpec:
    return StateSpec(kind="kv", layers=tuple(range(layers)), num_kv_heads=heads, head_dim=head_dim,
                     max_seq_len=max_seq_len, dtype="float32")


@pytest.mark.parametrize("specs,slots,capacity", [
    ((_kv(2, 8, 128),), 8, 10**9),  # ~128 TB
    ((_kv(32, 8, 128),), 1, 10**7),  # ~80 TB... of a plausible model at a huge context
    ((_kv(1, 64, 64),), 2**40, 2**40),  # beyond int64: must not wrap to a small size
    ((_kv(1, 4, 64), StateSpec(kind="conv", layers=(1,), num_kv_heads=0, head_dim=0, max_seq_len=2**62,
                               dtype="float32", channels=2**20, width=4)), 2**30, 16),
])
def test_state_pool_refuses_sizes_beyond_available_memory(specs, slots, capacity):
    pool = StatePool(specs, np.dtype(np.float32))
    pool.reserve(2, 8)  # a small session first: its memory is reused, only growth counts
    generation = pool.generation
    with pytest.raises(GraphkilnError, match=r"need .* of memory but only .* is available: lower --max-new-tokens") as info:
        pool.reserve(slots, capacity)
    assert "--max-seq-len" in str(info.value) and "\n" not in str(info.value)
    assert (pool.slots, pool.capacity, pool.generation) == (2, 8, generation)  # unchanged, still usable
    pool.reserve(3, 8)
    assert pool.keys[0].shape == (3, specs[0].num_kv_heads, 8, specs[0].head_dim)
    assert pool.claim() == 0


def test_available_memory_is_known_here_and_plausible():
    avail = available_memory()
    assert avail is not None and 2**20 < avail < 2**50


@pytest.mark.parametrize("max_new_tokens", [2**40, 10**13])
def test_engine_refuses_a_generation_whose_state_does_not_fit(llama_case, max_new_tokens):
    """An artifact claiming a huge max_seq_len, asked for that many tokens: refused before
    any allocation, and the engine works afterwards."""
    m = llama_case.manifest
    engine = Engine(llama_case.artifact, replace(m, states=tuple(replace(s, max_seq_len=2**50) for s in m.states)),
                    threads=1)
    prompts = llama_case.prompts((4, 6), salt=70)
    with pytest.raises(GraphkilnError, match="state pools for 2 request.*need .* available"):
        engine.generate(prompts, greedy_cfg(max_new_tokens))
    assert engine.pool.live == 0 and engine.pool.slots == 0
    assert [r.token_ids for r in engine.generate(prompts, greedy_cfg(5))] == \
        [r.token_ids for r in llama_case.engine.generate(prompts, greedy_cfg(5))]


@pytest.mark.parametrize("how", ["auto", "--streamed-reference", "api"])
def test_verify_refuses_a_reference_whose_streamed_layer_does_not_fit(llama_case, tmp_path, capsys, how):
    """Neither transformers' reference nor the streamed one (a layer at a time, in fp32) fits: one
    line naming the figure, before any of the checkpoint is read (before the fix the streamed
    reference allocated the 3.3 TB layer)."""
    from graphkiln.export.verify import verify_artifact

    ref = checkpoint_claiming_a_huge_layer(llama_case.checkpoint, tmp_path / "reference")
    if how == "api":
        with pytest.raises(GraphkilnError) as caught:
            verify_artifact(llama_case.artifact, str(ref), steps=4, streamed=True, engine=llama_case.engine)
        line = str(caught.value)
    else:
        extra = ["--streamed-reference"] if how != "auto" else []
        code, out, err = run_cli(capsys, "verify", llama_case.artifact, "--reference", ref, "--steps", "4", *extra)
        line = assert_one_error(code, err)
        assert out == ""
    assert re.search(r"the streamed reference of .* needs about [\d.]+ GiB of memory but [\d.]+ GiB is "
                     r"available: verify on a machine with more memory", line), line


# -- remote code --------------------------------------------------------------------------------

@pytest.mark.parametrize("auto_map,model_type", [
    ({"AutoModelForCausalLM": "evil.EvilModel"}, None),
    ({"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}, "graphkiln_evil"),
    ({"AutoModelForCausalLM": "someone/repo--evil.EvilModel"}, "graphkiln_evil"),
    ({"AutoTokenizer": ["evil.EvilTokenizer", None]}, None),
    ({}, None),
])
def test_verify_never_runs_or_asks_about_a_references_code(llama_case, checkpoint_copy, capsys, monkeypatch,
                                                           auto_map, model_type):
    """stdin answers 'y' to any "[y/N]" prompt: the checkpoint is refused before transformers
    could ask, so its module never runs and stdin is never read."""
    ckpt = checkpoint_copy(llama_case)
    marker = ckpt / "REMOTE_CODE_RAN"
    code_text = (f"open({str(marker)!r}, 'w').write('ran')\n"
                 "from transformers import LlamaConfig, LlamaForCausalLM\n"
                 "class EvilConfig(LlamaConfig):\n    model_type = 'graphkiln_evil'\n"
                 "class EvilModel(LlamaForCausalLM):\n    config_class = EvilConfig\n")
    (ckpt / "evil.py").write_text(code_text)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = auto_map
    if model_type:
        cfg["model_type"] = model_type
    (ckpt / "config.json").write_text(json.dumps(cfg))
    stdin = io.StringIO("y\ny\n")
    monkeypatch.setattr("sys.stdin", stdin)
    code, out, err = run_cli(capsys, "verify", llama_case.artifact, "--reference", ckpt, "--steps", "4")
    assert_one_error(code, err, "auto_map", "never runs")
    assert out == "" and "[y/N]" not in err
    assert not marker.exists()
    assert stdin.read() == "y\ny\n"
