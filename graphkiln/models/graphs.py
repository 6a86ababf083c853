"""The graphs a family's artifact holds, as the family declares them (torch-free).

``ModelFamily.graph_specs`` lists them in export order; ``export.graph_exporters`` runs one loop
over the list, one exporter per ``kind``. The default declaration (``default_graph_specs``): the
decoder, or under pipeline stages one stage decoder per slice of layers, then the vision graph
when the family registers one (owned by the first stage, which takes the vision seam).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphPlan:
    """One graph to export. ``kind`` picks its exporter: "decoder" (the whole decoder), "stage"
    (layers [start, end) of a pipeline stage; ``index`` of ``count`` stages), "vision" (the vision
    encoder). ``owner_stage``: the stage whose process runs this graph, which then lists its files
    (None: no stages, or the graph is a stage itself). ``needs_decoder``: its exporter reads the
    loaded torch decoder (the loop frees the decoder once no later graph does)."""

    kind: str
    name: str
    layers: tuple[int, int] | None = None
    index: int = 0
    count: int = 1
    owner_stage: int | None = None

    @property
    def needs_decoder(self) -> bool:
        return self.kind in ("decoder", "stage")

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1


def stage_graph_name(k: int) -> str:
    return f"stage{k}"


def default_graph_specs(has_vision: bool, stage_ranges: tuple[tuple[int, int], ...] | None) -> tuple[GraphPlan, ...]:
    """The decoder (or one graph per stage range), then the vision graph when ``has_vision``."""
    if stage_ranges is None:
        plans = [GraphPlan("decoder", "decoder")]
    else:
        n = len(stage_ranges)
        plans = [GraphPlan("stage", stage_graph_name(k), layers, k, n) for k, layers in enumerate(stage_ranges)]
    if has_vision:
        plans.append(GraphPlan("vision", "vision", owner_stage=0 if stage_ranges is not None else None))
    return tuple(plans)
