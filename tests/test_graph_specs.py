"""What graphs a family's artifact holds (``models.graphs``), as export's one loop runs them
(``export.graph_exporters``; the exports themselves: test_stages.py, test_vlm_*.py)."""

from __future__ import annotations

from graphkiln.models.graphs import GraphPlan, default_graph_specs
from graphkiln.models.registry import family_for


def test_text_family_declares_its_decoder_or_one_graph_per_stage():
    family = family_for("LlamaForCausalLM")
    assert family.graph_specs(None, None) == (GraphPlan("decoder", "decoder"),)
    stages = family.graph_specs(None, ((0, 3), (3, 5), (5, 8)))
    assert [(p.kind, p.name, p.layers, p.first, p.last) for p in stages] == [
        ("stage", "stage0", (0, 3), True, False), ("stage", "stage1", (3, 5), False, False),
        ("stage", "stage2", (5, 8), False, True)]
    assert all(p.needs_decoder and p.owner_stage is None for p in stages)


def test_vision_graph_comes_last_and_belongs_to_the_first_stage():
    family = family_for("LlavaForConditionalGeneration")
    single = family.graph_specs(None, None)
    assert [p.kind for p in single] == ["decoder", "vision"] and single[1].owner_stage is None
    staged = default_graph_specs(True, ((0, 1), (1, 2)))
    assert [p.kind for p in staged] == ["stage", "stage", "vision"]
    assert staged[-1].owner_stage == 0 and not staged[-1].needs_decoder
