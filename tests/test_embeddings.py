"""Embeddings (issue 39, item 3): ``export --task embed``, ``Engine.embed``, ``Scheduler.embed`` and
``POST /v1/embeddings``.

The checkpoint is shaped as Qwen3-Embedding ships: a tiny random Qwen3 decoder saved from the base
model class (``Qwen3Model``: architectures ["Qwen3Model"], no ``model.`` prefix, no lm_head), a
tokenizer whose post-processor appends the end-of-text token, and sentence-transformers' files
(last-token pooling, Normalize). References: transformers' ``last_hidden_state`` of the same
checkpoint, pooled here (each text alone, so no padding reaches them), and sentence-transformers'
own ``encode`` of the same directory with the same pooling.
"""

from __future__ import annotations

import base64
import json
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError

MAX_SEQ = 64
TEXTS = ["The capital of France is Paris.", "a", "Embeddings pool the final hidden states of every token in a text.",
         "two words", "Once upon a time there was a tiny model with random weights and a small vocabulary."]


def _checkpoint(out):
    """The Qwen3-Embedding-shaped checkpoint (module docstring)."""
    import torch
    from tokenizers import Tokenizer, processors
    from transformers import Qwen3Config, Qwen3Model

    from conftest import TOKENIZER_VOCAB
    from graphkiln.demo.run import train_tokenizer

    out.mkdir(parents=True)
    vocab = train_tokenizer(out, TOKENIZER_VOCAB)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 2)])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<unk>"}))
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=True, initializer_range=0.15)
    torch.manual_seed(39)
    Qwen3Model(cfg).eval().save_pretrained(out)
    # sentence-transformers' description of the model: its pooling and normalisation
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": True}))
    return out


@pytest.fixture(scope="module")
def embed_case(tmp_path_factory):
    """(checkpoint, manifest, Engine) of the checkpoint exported with --task embed."""
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine

    root = tmp_path_factory.mktemp("embed")
    ckpt = _checkpoint(root / "checkpoint")
    manifest = export_model(str(ckpt), root / "artifact", ExportOptions(progress=False, max_seq_len=MAX_SEQ,
                                                                          task="embed"))
    return ckpt, manifest, Engine.load(root / "artifact", threads=1)


@pytest.fixture(scope="module")
def reference(embed_case):
    import torch
    from transformers import AutoModel, AutoTokenizer

    ckpt = embed_case[0]
    model = AutoModel.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))

    def pooled(ids: list[int], pooling: str, normalize: bool = True) -> np.ndarray:
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0].numpy()
        v = h[-1] if pooling == "last" else h.mean(axis=0)
        return v / np.linalg.norm(v) if normalize else v

    pooled.tokenizer = tok
    return pooled


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_artifact_records_the_checkpoints_pooling_and_has_no_head(embed_case):
    _, manifest, engine = embed_case
    [graph] = manifest.graphs
    assert [t.role for t in graph.outputs if t.layer is None] == ["last_hidden_state"]
    assert (manifest.embedding.pooling, manifest.embedding.normalize) == ("last", True)  # from 1_Pooling, Normalize
    for call in (lambda: engine.generate([[5, 6]]), lambda: engine.stream([[5, 6]]),
                 lambda: engine.prompt_logits([[5, 6]])):
        with pytest.raises(GraphkilnError, match="embedding artifact"):
            call()
    with pytest.raises(GraphkilnError, match="pooling must be"):
        engine.embed("x", pooling="cls")
    with pytest.raises(GraphkilnError, match="dimensions must be"):
        engine.embed("x", dimensions=65)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_pooled_hidden_states(embed_case, reference, pooling):
    _, manifest, engine = embed_case
    rng = np.random.default_rng(7)
    vocab = manifest.model.vocab_size
    for lengths in ((9,), (5, 17, 1), (3, 30, 12, 8, 2, 25)):  # one, ragged, more rows than a batch's longest
        prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
        got = engine.embed(prompts, pooling=pooling)
        want = np.stack([reference(p, pooling) for p in prompts])
        assert got.shape == (len(prompts), 64) and got.dtype == np.float32
        assert _cosines(got, want).min() >= 0.99999 and np.abs(got - want).max() < 1e-4, lengths
    raw = engine.embed(prompts, pooling=pooling, normalize=False)  # not normalised: the pooled rows themselves
    assert np.abs(raw - np.stack([reference(p, pooling, normalize=False) for p in prompts])).max() < 1e-4
    cut = engine.embed(prompts, pooling=pooling, dimensions=16)  # Matryoshka: the first 16, renormalised
    want = np.stack([reference(p, pooling, normalize=False)[:16] for p in prompts])
    assert np.abs(cut - want / np.linalg.norm(want, axis=1, keepdims=True)).max() < 1e-5
    # text: the tokenizer's post-processor (the end-of-text token last) as transformers' tokenizer applies it
    ids = [reference.tokenizer(t)["input_ids"] for t in TEXTS]
    assert [engine.encode(t) for t in TEXTS] == ids and ids[0][-1] == 2
    assert _cosines(engine.embed(TEXTS, pooling=pooling), np.stack([reference(i, pooling) for i in ids])).min() >= 0.99999


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_sentence_transformers_encode_is_a_second_reference(embed_case, pooling):
    st = pytest.importorskip("sentence_transformers")
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer

    ckpt, _, engine = embed_case
    if pooling == "lasttoken":  # the checkpoint's own modules.json, as a user loads it
        model = st.SentenceTransformer(str(ckpt), device="cpu", local_files_only=True)
    else:
        model = st.SentenceTransformer(modules=[Transformer(str(ckpt)), Pooling(64, pooling), Normalize()], device="cpu")
    want = model.encode(TEXTS, batch_size=4)  # padded batches: its attention mask, its pooling
    got = engine.embed(TEXTS, pooling="last" if pooling == "lasttoken" else "mean")
    assert _cosines(got, want).min() >= 0.99999 and np.abs(got - want).max() < 1e-4


@pytest.fixture(scope="module")
def srv(embed_case):
    from test_serve import serving

    with serving(embed_case[0].parent / "artifact", max_batch=4, step_tokens=48) as running:
        yield running


def test_openai_client_float_base64_dimensions_and_usage(srv, embed_case):
    _, manifest, engine = embed_case
    client = srv.client()
    want = engine.embed(TEXTS)
    counts = [len(engine.encode(t)) for t in TEXTS]
    default = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 and decodes it
    floats = client.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    for resp in (default, floats):
        assert [d.index for d in resp.data] == list(range(len(TEXTS)))
        assert np.abs(np.array([d.embedding for d in resp.data]) - want).max() < 1e-6
        assert resp.usage.prompt_tokens == resp.usage.total_tokens == sum(counts)
    cut = client.embeddings.create(model="tiny", input=TEXTS[0], dimensions=16, encoding_format="float")
    assert np.abs(np.array(cut.data[0].embedding) - engine.embed(TEXTS[0], dimensions=16)[0]).max() < 1e-6
    assert abs(np.linalg.norm(cut.data[0].embedding) - 1) < 1e-5
    raw = srv.post("/v1/embeddings", {"model": "tiny", "input": TEXTS[2], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")  # little-endian float32, as OpenAI
    assert np.array_equal(vec, want[2])
    ids = [engine.encode(t) for t in TEXTS[:3]]
    one = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    many = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert np.abs(np.array(one.data[0].embedding) - want[0]).max() < 1e-6
    assert np.abs(np.array([d.embedding for d in many.data]) - want[:3]).max() < 1e-6
    assert many.usage.prompt_tokens == sum(counts[:3])
    # concurrent calls, batched by the stepping thread in the free slots: each equals its own
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda k: client.embeddings.create(model="tiny", input=TEXTS[k:] + TEXTS[:k],
                                                                    encoding_format="float"), range(6)))
    for k, r in enumerate(results):
        assert np.abs(np.array([d.embedding for d in r.data]) - np.roll(want, -(k % 5), axis=0)).max() < 1e-6
    assert srv.wait_idle().free_slots == 4  # every slot released
    import httpx

    doc = httpx.get(srv.url + "/openapi.json").json()
    body = doc["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["$ref"].endswith("/EmbeddingRequest") and "EmbeddingList" in doc["components"]["schemas"]
    metrics = httpx.get(srv.url + "/metrics").text
    assert "graphkiln_embedding_requests_total" in metrics and "graphkiln_embedding_tokens_total" in metrics


BAD = [
    ({"model": "tiny"}, "input"),
    ({"model": "tiny", "input": ""}, "input"),
    ({"model": "tiny", "input": []}, "input"),
    ({"model": "tiny", "input": [[]]}, "input"),
    ({"model": "tiny", "input": ["ok", ""]}, "input"),
    ({"model": "tiny", "input": ["ok", 5]}, "input"),
    ({"model": "tiny", "input": [5, -1]}, "input"),
    ({"model": "tiny", "input": [5, 10**6]}, "input[1]"),
    ({"model": "tiny", "input": [[5], [5, 10**6]]}, "input[1][1]"),
    ({"model": "tiny", "input": ["x"] * 2049}, "input"),
    ({"model": "tiny", "input": [5] * MAX_SEQ}, "input"),
    ({"model": "tiny", "input": "word " * 400}, "input"),
    ({"model": "tiny", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "tiny", "input": "x", "dimensions": 65}, "dimensions"),
    ({"model": "tiny", "input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"model": "tiny", "input": "x", "pooling": "mean"}, "pooling"),
    ({"model": "tiny", "input": True}, "input"),
]


def test_each_bad_input_is_one_400(srv):
    for body, param in BAD:
        r = srv.post("/v1/embeddings", body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and "\n" not in err["message"], (body, err)
    assert srv.post("/v1/embeddings", {"model": "other", "input": "x"}).status_code == 404
    assert srv.post("/v1/embeddings", b"{not json").status_code == 400
    assert srv.post("/v1/completions", {"model": "tiny", "prompt": "x"}).status_code == 400  # no head to generate
    assert srv.post("/v1/embeddings", {"model": "tiny", "input": "still fine"}).status_code == 200


def test_verify_and_export_refusals(embed_case, tmp_path, capsys):
    from graphkiln.cli import main

    ckpt = str(embed_case[0])
    assert main(["verify", str(embed_case[0].parent / "artifact"), "--reference", ckpt]) == 0
    out = capsys.readouterr().out
    assert "embedding artifact (last pooling, fp32 weights)" in out and out.strip().endswith("PASS")
    for argv, needle in ((["--task", "embed", "--target", "tensorrt"], "--target tensorrt"),
                         (["--pooling", "mean"], "--task embed"),
                         (["--task", "embed", "--stages", "2"], "--stages"),
                         (["--task", "embed", "--return-hidden-states"], "--return-hidden-states")):
        out = tmp_path / "out"
        assert main(["export", ckpt, "-o", str(out), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and needle in err[0], (argv, err)
        assert not out.exists()


def test_schemathesis_fuzzes_the_route(srv):
    """The documented body fuzzed against the embedding server: no 5xx, only documented responses."""
    schemathesis = pytest.importorskip("schemathesis")
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import checks

    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    [operation] = [r.ok() for r in schema.get_all_operations() if r.ok().label == "POST /v1/embeddings"]
    run = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
           checks.response_schema_conformance]

    @settings(max_examples=12, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def fuzz(case):
        case.call_and_validate(base_url=srv.url, checks=run, timeout=60)

    fuzz()
    srv.wait_idle()
