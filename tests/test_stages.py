"""Pipeline stages (issue 15): export one graph per slice of layers, run them chained.

The reference is the single-graph artifact of the same checkpoint (``tiny(name, "onnxruntime")``,
itself at parity with transformers in test_parity): staged logits must equal its logits within
1e-5 and greedy tokens must be identical over 32 steps, on a ragged batch. Each stage's data file
must hold its planned share of the weights (computed here from the torch model, independently of
the export) within 10%, and no weight of another stage's layers.
"""

from __future__ import annotations


import numpy as np
import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.export.stages import parse_stage_layers, plan_even

# (checkpoint, how, target): dense with tied embeddings (N=2 planned; N=3 explicit, one layer
# each, on the portable target: state returned as rows), MoE (N=2 planned), conv hybrid (N=3
# explicit: a conv-only first stage, an attention-only middle one, a conv-only last one carrying
# the tied head)
STAGED = [("qwen3_mixed_sliding", 2, "onnxruntime"), ("qwen3_mixed_sliding", "0:1,1:2,2:3", "portable"),
          ("qwen3_moe", 2, "onnxruntime"), ("lfm2", "0:1,1:2,2:4", "onnxruntime")]


@pytest.fixture(scope="session")
def staged(tiny, tmp_path_factory):
    from graphkiln.export.pipeline import ExportOptions, export_model

    from conftest import MAX_SEQ_LEN

    made = {}

    def get(name: str, how, target: str = "onnxruntime"):
        if (name, how, target) not in made:
            case = tiny(name, target)
            out = tmp_path_factory.mktemp("staged") / f"{name}-{how}-{target}".replace(",", "_").replace(":", "-")
            kw = {"stages": how} if isinstance(how, int) else {"stage_layers": how}
            manifest = export_model(str(case.checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN,
                                                                             target=target, **kw))
            made[name, how, target] = (case, out, manifest)
        return made[name, how, target]

    return get


def _forms(p) -> tuple[bytes, ...]:
    """A weight's bytes as stored, and transposed (how the exporter folds a Linear's weight)."""
    a = p.detach().numpy()
    return (a.tobytes(), np.ascontiguousarray(a.T).tobytes()) if a.ndim == 2 else (a.tobytes(),)


def _torch_decoder(checkpoint):
    from graphkiln.models.config import architecture_of
    from graphkiln.models.registry import family_for
    from graphkiln.models.weights import load_decoder, read_config

    from conftest import MAX_SEQ_LEN

    raw = read_config(checkpoint)
    family = family_for(architecture_of(raw))
    decoder = load_decoder(checkpoint, family, family.parse_config(raw), "fp32", progress=False)
    decoder.set_rope_positions(MAX_SEQ_LEN)
    return decoder


@pytest.mark.parametrize("name,how,target", STAGED, ids=[f"{n}-{h}-{t}" for n, h, t in STAGED])
def test_staged_export_and_chained_run(staged, name, how, target):
    from graphkiln.export.stages import planned_bytes, stage_costs
    from graphkiln.runtime import Engine, GenerationConfig

    case, art, manifest = staged(name, how, target)
    assert {g.target for g in manifest.graphs} == {target}
    ranges = [st.layers for st in manifest.stages]
    n = len(ranges)
    assert n == (how if isinstance(how, int) else len(how.split(",")))
    assert not any(g.name == "decoder" for g in manifest.graphs)

    # -- each stage's file: its planned share, only its layers -----------------------------
    decoder = _torch_decoder(case.checkpoint)
    if isinstance(how, int):  # the even plan by bytes, recomputed from the torch weights
        layers, embed, head, _ = stage_costs(decoder)
        assert tuple(ranges) == plan_even(layers, how, embed, head)
    planned = planned_bytes(decoder, ranges)
    tied = case.reference.config.tie_word_embeddings
    layer_weights = [[_forms(p) for p in layer.parameters() if p.numel() >= 16] for layer in decoder.model.layers]
    embed, head = _forms(decoder.model.embed_tokens.weight), _forms(decoder.lm_head.weight)
    del decoder
    for k, st in enumerate(manifest.stages):
        files = [f for f in st.files if f.endswith(".data")]
        assert len(files) == 1, st.files
        data = (art / files[0]).read_bytes()
        assert abs(len(data) - planned[k]) <= 0.1 * planned[k], (k, len(data), planned[k])
        # by content (the exporter names folded weights val_N): another stage's layer weight is
        # nowhere in this file, in either orientation; each own layer has weights stored as they are
        for i, forms in enumerate(layer_weights):
            found = [any(f in data for f in pair) for pair in forms]
            if st.layers[0] <= i < st.layers[1]:
                assert any(found), (k, i)
            else:
                assert not any(found), (k, i)
        assert any(f in data for f in embed) == (k == 0 or (tied and k == n - 1)), k
        assert any(f in data for f in head) == (k == n - 1 or (tied and k == 0)), k  # tied: one tensor
        assert st.tied_head == (tied and k == n - 1)
        owned = {layer for s in st.states for layer in s.layers}
        assert owned and owned <= set(range(*st.layers))

    # -- chained run == the single-graph artifact ------------------------------------------
    single, chained = Engine.load(case.artifact), Engine.load(art)
    prompts = case.prompts([7, 3, 12], salt=5)
    for a, b in zip(single.prompt_logits(prompts), chained.prompt_logits(prompts)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    config = GenerationConfig(max_new_tokens=32, stop_token_ids=(), output_logits=True)
    for a, b in zip(single.generate(prompts, config), chained.generate(prompts, config)):
        assert b.token_ids == a.token_ids and len(a.token_ids) == 32
        np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
    greedy = GenerationConfig(max_new_tokens=32, stop_token_ids=())  # the folded next_token path
    assert [r.token_ids for r in chained.generate(prompts, greedy)] == [r.token_ids for r in single.generate(prompts, greedy)]
    # each stage's pool holds only its own layers' state
    for st, pool in zip(manifest.stages, chained.pool.pools):
        held = set(pool.keys) | set(pool.conv)
        assert held == {layer for s in st.states for layer in s.layers}


def test_plan_even_minimises_the_largest_stage():
    assert plan_even([1, 1, 1, 1], 2) == ((0, 2), (2, 4))
    assert plan_even([1, 1, 1, 1], 2, first_extra=2) == ((0, 1), (1, 4))  # embedding weighs on stage 0
    assert plan_even([5, 1, 1, 1, 1, 1], 2) == ((0, 1), (1, 6))
    assert plan_even([1, 2, 3], 3) == ((0, 1), (1, 2), (2, 3))
    assert parse_stage_layers("0:1,1:3", 3) == ((0, 1), (1, 3))


@pytest.mark.parametrize("kw,match", [
    ({"stages": 4}, "more stages than the model's 3 layers"),
    ({"stages": 1}, "at least 2"),
    ({"stage_layers": "0:2,1:3"}, "overlaps"),
    ({"stage_layers": "0:1,2:3"}, "layers 1:2 are in no stage"),
    ({"stage_layers": "0:1,1:2"}, "layers 2:3 are in no stage"),
    ({"stage_layers": "0:3"}, "one stage"),
    ({"stage_layers": "0:1,1:x"}, "not a START:END"),
    ({"stage_layers": "0:1,1:4"}, "outside the model's 3 layers"),
    ({"stages": 2, "stage_layers": "0:1,1:3"}, "both given"),
    ({"stages": 2, "target": "tensorrt"}, "not supported yet"),
])
def test_bad_stage_requests_are_one_line_and_write_nothing(tiny, tmp_path, kw, match):
    from graphkiln.export.pipeline import ExportOptions, export_model

    case = tiny("qwen3_mixed_sliding", "onnxruntime")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(GraphkilnError, match=match) as info:
        export_model(str(case.checkpoint), tmp_path / "out", ExportOptions(progress=False, **kw))
    assert "\n" not in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli_stage_flags(tiny, tmp_path, capsys):
    from graphkiln.cli import main

    case = tiny("qwen3_mixed_sliding", "onnxruntime")
    assert main(["export", str(case.checkpoint), "-o", str(tmp_path / "out"), "--stage-layers", "0:2,1:3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --stage-layers 0:2,1:3: range 1:3 overlaps") and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_manifest_refuses_inconsistent_stages(staged):
    import dataclasses
    import json

    from graphkiln.manifest import Manifest

    _, _, manifest = staged("qwen3_mixed_sliding", 2)
    d = json.loads(manifest.to_json())
    Manifest.from_json(json.dumps(d))  # the original is accepted
    bad = json.loads(manifest.to_json())
    bad["stages"][1]["layers"] = [1, 3]  # overlaps stage 0
    with pytest.raises(GraphkilnError, match="stages\\[1\\].layers"):
        Manifest.from_json(json.dumps(bad))
    bad = json.loads(manifest.to_json())
    bad["stages"] = bad["stages"][:1]  # a stage graph no stage names
    with pytest.raises(GraphkilnError, match="stages"):
        Manifest.from_json(json.dumps(bad))
    bad = json.loads(manifest.to_json())
    bad["stages"][0]["tied_head"] = True
    with pytest.raises(GraphkilnError, match="tied_head"):
        Manifest.from_json(json.dumps(bad))
    bad = json.loads(manifest.to_json())
    bad["stages"][0]["states"][0]["num_kv_heads"] += 1
    with pytest.raises(GraphkilnError, match="states"):
        Manifest.from_json(json.dumps(bad))
    assert dataclasses.is_dataclass(manifest.stages[0])


def test_inspect_shows_each_stage_and_its_own_layers(staged, capsys):
    from graphkiln.cli import main

    _, out, manifest = staged("lfm2", "0:1,1:2,2:4")
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    lines = [l for l in text.splitlines() if l.startswith("stage ")]
    assert len(lines) == 3
    assert "layers 0..0" in lines[0] and "layers 2..3" in lines[2] and "tied head" in lines[2]
    # the last stage's graph lists its first layer's tensors (layer 2) and counts layer 3's
    last = text[text.index("graph        stage2"):]
    assert "conv_state.2" in last and "(layers 3)" in last
