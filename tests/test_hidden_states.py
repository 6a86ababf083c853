"""Hidden states out (issue 15, item 2): ``export --return-hidden-states``.

The reference is transformers' ``output_hidden_states=True`` on the same tiny random-init
checkpoint: ``hidden_states[-1]`` (== ``last_hidden_state``, after the final norm) at every
position of one unpadded sequence. The artifact's rows must match it within 1e-4 (fp32) for the
prompt's every position (``prompt_hidden_states``), its last one (``embed``), and the positions
that chose each generated token (``GenerationConfig(return_hidden_states="last"|"all")``), on a
ragged batch and alone; a staged artifact must give the single graph's rows within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.runtime import GenerationConfig

from reference import ATOL, max_abs

# dense (onnxruntime target: GroupQueryAttention, folded argmax), MoE, conv hybrid (portable target:
# state returned as rows), and the hybrid as three pipeline stages (the last stage returns them)
CASES = [("llama_gqa_bias", "onnxruntime", None), ("qwen3_moe", "onnxruntime", None), ("lfm2", "portable", None),
         ("lfm2", "onnxruntime", "0:1,1:2,2:4")]
LENGTHS = (7, 12, 3)  # ragged: right-padded rows


@pytest.fixture(scope="session")
def hidden_artifact(tiny, tmp_path_factory):
    """Factory: (case, Engine over the checkpoint exported with --return-hidden-states)."""
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine

    from conftest import MAX_SEQ_LEN

    made = {}

    def get(name: str, target: str, stage_layers: str | None = None):
        key = (name, target, stage_layers)
        if key not in made:
            case = tiny(name, target)  # the checkpoint (and, in a full run, an artifact other tests export anyway)
            out = tmp_path_factory.mktemp("hidden") / f"{name}-{target}-{stage_layers or 'single'}".replace(":", "-")
            manifest = export_model(str(case.checkpoint), out, ExportOptions(
                progress=False, max_seq_len=MAX_SEQ_LEN, target=target, return_hidden_states=True,
                stage_layers=stage_layers))
            made[key] = (case, Engine.load(out), manifest)
        return made[key]

    return get


def _reference_states(model, ids: list[int]) -> np.ndarray:
    """transformers' last hidden states [len(ids), hidden] (after the final norm)."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    last = out.hidden_states[-1][0].float().numpy()
    # what "last layer's hidden states" means here: the final-norm output transformers returns
    assert np.array_equal(last, out.hidden_states[-1][0].numpy())
    return last


@pytest.mark.parametrize("name,target,stages", CASES, ids=lambda v: str(v))
def test_hidden_states_match_transformers(hidden_artifact, name, target, stages):
    case, engine, manifest = hidden_artifact(name, target, stages)
    graph = manifest.graphs[-1] if stages else manifest.graphs[0]
    [spec] = [t for t in graph.outputs if t.role == "last_hidden_state"]
    assert spec.shape == ("batch", "n_logits", manifest.model.hidden_size) and spec.dtype == "float32"
    prompts = case.prompts(LENGTHS, salt=5)
    refs = [_reference_states(case.reference, p) for p in prompts]

    every = engine.prompt_hidden_states(prompts)
    assert [h.shape for h in every] == [r.shape for r in refs]
    assert max(max_abs(h, r) for h, r in zip(every, refs)) < ATOL
    embedded = engine.embed(prompts)
    assert embedded.shape == (len(prompts), manifest.model.hidden_size)
    assert max_abs(embedded, np.stack([r[-1] for r in refs])) < ATOL
    assert max_abs(engine.embed(prompts[1]), refs[1][-1:]) < ATOL  # one prompt, batch of one

    steps = 6
    plain = engine.generate(prompts, GenerationConfig(max_new_tokens=steps, stop_token_ids=()))
    for mode in ("last", "all"):
        for batch in (prompts, prompts[:1]):
            results = engine.generate(batch, GenerationConfig(max_new_tokens=steps, stop_token_ids=(),
                                                              return_hidden_states=mode))
            for r, p, same in zip(results, batch, plain):
                assert r.token_ids == same.token_ids  # asking for hidden states changes no token
                seen = p + r.token_ids[:-1]  # the last token is never fed back
                ref = _reference_states(case.reference, seen)
                first = 0 if mode == "all" else len(p) - 1
                assert r.hidden_states.shape == (len(seen) - first, manifest.model.hidden_size)
                assert max_abs(r.hidden_states, ref[first:]) < ATOL, (mode, len(batch))


def test_staged_hidden_states_equal_the_single_graph(hidden_artifact):
    case, single, _ = hidden_artifact("lfm2", "portable")
    _, staged, manifest = hidden_artifact("lfm2", "onnxruntime", "0:1,1:2,2:4")
    assert [any(t.role == "last_hidden_state" for t in g.outputs) for g in manifest.graphs] == [False, False, True]
    prompts = case.prompts(LENGTHS, salt=6)
    for a, b in zip(single.prompt_hidden_states(prompts), staged.prompt_hidden_states(prompts)):
        assert max_abs(a, b) < 1e-5
    cfg = GenerationConfig(max_new_tokens=5, stop_token_ids=(), return_hidden_states="all")
    for a, b in zip(single.generate(prompts, cfg), staged.generate(prompts, cfg)):
        assert a.token_ids == b.token_ids and max_abs(a.hidden_states, b.hidden_states) < 1e-5


def test_scheduler_chunked_prefill_and_stream_events(hidden_artifact):
    """A prompt prefilled in chunks (step budget 8) beside a decoding request: "all" rows cover
    every chunk's positions; each streamed event carries the row that chose its token."""
    from graphkiln.runtime.request.scheduler import Scheduler

    case, engine, manifest = hidden_artifact("llama_gqa_bias", "onnxruntime")
    long, short = case.prompts((21, 4), salt=7)
    sched = Scheduler(engine, max_batch=2, step_tokens=8)
    sched.start()
    try:
        first = sched.submit(short, GenerationConfig(max_new_tokens=8, stop_token_ids=(), return_hidden_states="last"))
        second = sched.submit(long, GenerationConfig(max_new_tokens=4, stop_token_ids=(), return_hidden_states="all"))
        # embeddings (runtime.embed) between those steps, in the slots they leave free: theirs never move
        embedded = sched.embed([short, long[:9]], pooling="mean")
        events = list(first.events())
        results = [first.result(), second.result()]
        vectors = embedded.result(30).vectors
    finally:
        sched.shutdown(5)
    assert max_abs(vectors, np.stack([_reference_states(case.reference, p).mean(0) for p in (short, long[:9])])) < ATOL
    for r, p, first_row in zip(results, (short, long), (len(short) - 1, 0)):
        ref = _reference_states(case.reference, p + r.token_ids[:-1])
        assert max_abs(r.hidden_states, ref[first_row:]) < ATOL
    assert max_abs(np.stack([e.hidden_state for e in events]), results[0].hidden_states) == 0


def test_refusals(hidden_artifact, tiny, tmp_path):
    from graphkiln.cli import main
    from graphkiln.manifest import Manifest

    plain = tiny("llama_gqa_bias", "onnxruntime")
    with pytest.raises(GraphkilnError, match="--return-hidden-states"):
        plain.engine.generate([[5, 6]], GenerationConfig(max_new_tokens=2, return_hidden_states="last"))
    with pytest.raises(GraphkilnError, match="--return-hidden-states"):
        plain.engine.embed([[5, 6]])
    with pytest.raises(GraphkilnError, match="return_hidden_states must be"):
        GenerationConfig(return_hidden_states="first")
    # tensorrt: refused before anything is written
    out = tmp_path / "trt"
    assert main(["export", str(plain.checkpoint), "-o", str(out), "--target", "tensorrt",
                 "--return-hidden-states"]) == 2
    assert not out.exists()
    # a manifest that declares them on a tensorrt graph, or with another shape, is refused
    import json

    _, _, manifest = hidden_artifact("llama_gqa_bias", "onnxruntime")
    good = json.loads(manifest.to_json())
    [spec] = [t for t in good["graphs"][0]["outputs"] if t["role"] == "last_hidden_state"]
    spec["shape"] = ["batch", "seq", manifest.model.hidden_size]
    with pytest.raises(GraphkilnError, match="n_logits"):
        Manifest.from_json(json.dumps(good))
    spec["shape"] = ["batch", "n_logits", manifest.model.hidden_size]
    Manifest.from_json(json.dumps(good))  # the edit above is what was refused
    good["graphs"][0]["target"] = "tensorrt"
    with pytest.raises(GraphkilnError, match="tensorrt"):
        Manifest.from_json(json.dumps(good))
