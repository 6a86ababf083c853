"""Pipeline-stage planning: which layers each stage runs (issue 15), decided before anything is
traced, below both the export's preflight and ``export.stages`` (which traces and writes each
stage's graph).

``--stages N`` splits the layers into N contiguous, non-empty ranges whose weight bytes are as
even as possible (the largest stage is minimised; the first stage also carries the token
embedding, the last the final norm and the head, and each stage the rotary tables its attention
layers read); ``--stage-layers 0:6,6:12`` gives the ranges. Both are checked against the config
before anything is written (``check_stage_request``).
"""

from __future__ import annotations

from dataclasses import dataclass

from graphkiln.errors import GraphkilnError

# every target's lowering runs per stage graph as on the single graph; a target added to
# manifest.TARGETS without that is refused until it is listed here
STAGE_TARGETS = ("onnxruntime", "portable", "tensorrt")


@dataclass(frozen=True)
class StagePlan:
    """Layer ranges [start, end), contiguous and covering every layer, and each stage's
    planned weight bytes (what its data file should hold, before any quantization)."""

    ranges: tuple[tuple[int, int], ...]
    planned_bytes: tuple[int, ...]


# -- requests and planning ---------------------------------------------------------------------


def parse_stage_layers(text: str, num_layers: int) -> tuple[tuple[int, int], ...]:
    """``--stage-layers 0:6,6:12`` as ranges; a one-line GraphkilnError for a range that is
    malformed, empty, out of bounds, overlapping, leaves a gap or does not cover every layer."""
    ranges = []
    for item in str(text).split(","):
        parts = item.strip().split(":")
        try:
            start, end = (int(p) for p in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            start = end = None
        if start is None:
            raise GraphkilnError(f"--stage-layers {text}: {item.strip() or 'an empty item'!r} is not a START:END layer "
                                 "range: write e.g. 0:6,6:12")
        if not 0 <= start < end <= num_layers:
            raise GraphkilnError(f"--stage-layers {text}: range {start}:{end} is empty or outside the model's "
                                 f"{num_layers} layers (0:{num_layers}): use START < END <= {num_layers}")
        ranges.append((start, end))
    if len(ranges) < 2:
        raise GraphkilnError(f"--stage-layers {text} names one stage: give at least two ranges, or drop it for an "
                             "unstaged artifact")
    expected = 0
    for start, end in ranges:
        if start < expected:
            raise GraphkilnError(f"--stage-layers {text}: range {start}:{end} overlaps the one before it: "
                                 f"start it at {expected}")
        if start > expected:
            raise GraphkilnError(f"--stage-layers {text}: layers {expected}:{start} are in no stage: "
                                 f"ranges must cover 0:{num_layers} without gaps")
        expected = end
    if expected != num_layers:
        raise GraphkilnError(f"--stage-layers {text}: layers {expected}:{num_layers} are in no stage: "
                             f"ranges must cover 0:{num_layers}")
    return tuple(ranges)


def check_stage_request(stages: int | None, stage_layers: str | None, num_layers: int,
                        targets: tuple[str, ...] = ("onnxruntime",)) -> tuple | None:
    """Refuse a stage request the model cannot take (before anything is written); returns the
    explicit ranges of ``--stage-layers``, () for ``--stages N`` (planned once weights are
    known), or None for an unstaged export."""
    if stages is None and stage_layers is None:
        return None
    flag = "--stages" if stages is not None else "--stage-layers"
    if stages is not None and stage_layers is not None:
        raise GraphkilnError("--stages and --stage-layers both given: use one of them")
    if any(t not in STAGE_TARGETS for t in targets):
        raise GraphkilnError(f"{flag} with --target {','.join(targets)} is not supported yet: use --target "
                             f"{' or --target '.join(STAGE_TARGETS)}")
    if stage_layers is not None:
        return parse_stage_layers(stage_layers, num_layers)
    if stages is None:
        return None
    if type(stages) is not int or stages < 2:
        raise GraphkilnError(f"--stages {stages} is not a number of stages >= 2: use at least 2, or drop it for an "
                             "unstaged artifact")
    if stages > num_layers:
        raise GraphkilnError(f"--stages {stages} is more stages than the model's {num_layers} layers: use at most "
                             f"{num_layers}")
    return ()


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def stage_costs(decoder) -> tuple[list[int], int, int, dict[str, int]]:
    """Weight bytes per layer, of the embedding, of the head (final norm + lm_head; counted
    again when tied: the last stage carries its own copy), and of each rope flavor's tables."""
    layers = [_bytes(layer) for layer in decoder.model.layers]
    head = _bytes(decoder.model.norm) + decoder.lm_head.weight.numel() * decoder.lm_head.weight.element_size()
    ropes = {}
    for name in decoder.rope_flavors:
        cos, sin = decoder.rope_tables(name)
        ropes[name] = cos.numel() * cos.element_size() + sin.numel() * sin.element_size()
    return layers, _bytes(decoder.model.embed_tokens), head, ropes


def planned_bytes(decoder, ranges) -> tuple[int, ...]:
    layers, embed, head, ropes = stage_costs(decoder)
    out = []
    for k, (start, end) in enumerate(ranges):
        flavors = {decoder.cfg.layers[i].rope for i in range(start, end) if decoder.cfg.layers[i].mixer == "attention"}
        total = sum(layers[start:end]) + sum(ropes[f] for f in flavors)
        total += embed if k == 0 else 0
        total += head if k == len(ranges) - 1 else 0
        out.append(total)
    return tuple(out)


def plan_even(costs: list[int], n: int, first_extra: int = 0, last_extra: int = 0) -> tuple[tuple[int, int], ...]:
    """N contiguous non-empty ranges over ``costs`` minimising the largest stage's bytes (ties:
    the earliest split). Exact dynamic programme, O(n * L^2): L is at most a few hundred."""
    num = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(k: int, start: int, end: int) -> int:
        return (prefix[end] - prefix[start] + (first_extra if k == 0 else 0)
                + (last_extra if k == n - 1 else 0))

    inf = float("inf")
    # best[k][e]: the smallest largest-stage over stages 0..k covering layers [0, e)
    best = [[inf] * (num + 1) for _ in range(n)]
    cut = [[0] * (num + 1) for _ in range(n)]
    for e in range(1, num + 1):
        best[0][e] = cost(0, 0, e)
    for k in range(1, n):
        for e in range(k + 1, num + 1):
            for s in range(k, e):
                value = max(best[k - 1][s], cost(k, s, e))
                if value < best[k][e]:
                    best[k][e], cut[k][e] = value, s
    ranges, end = [], num
    for k in range(n - 1, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    ranges.append((0, end))
    return tuple(reversed(ranges))


def make_plan(decoder, stages: int | None, ranges: tuple) -> StagePlan:
    if not ranges:
        layers, embed, head, _ = stage_costs(decoder)
        ranges = plan_even(layers, stages, embed, head)
    return StagePlan(tuple(ranges), planned_bytes(decoder, ranges))
