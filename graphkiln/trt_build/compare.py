"""A graph or an engine against onnxruntime, through polygraphy (NVIDIA's TensorRT debugging tool).

polygraphy runs one model on several runners with the same inputs and compares what they
return (``polygraphy run model.onnx --trt --onnxrt``; in Python ``Comparator.run`` and
``Comparator.compare_accuracy``). graphkiln uses it wherever a TensorRT engine is compared with
onnxruntime (``scripts/gpu_check.py``'s TensorRT section) and documents the command lines that
work on its graphs (docs/tensorrt.md, "Comparing with polygraphy"). This module adds the two
things polygraphy cannot know about graphkiln's graphs:

* **Inputs a runtime would feed.** polygraphy's default data loader draws every input at random,
  which a decoder graph does not survive: positions must follow each row's start, logits indices
  must point inside the row, onnxruntime's GroupQueryAttention checks ``total_sequence_length``
  against the positions and refuses several new tokens onto a filled cache for a batch of more
  than one. ``STEPS`` are three steps the runtime really runs (a ragged prefill from an empty
  cache, a decode step over filled caches, one row's chunk onto its filled cache);
  ``step_feeds`` makes one step's inputs for any decoder graph (every target, LoRA, slot
  states, the vision seam with no image rows) by the manifest's roles, sized to an engine when
  the artifact has one (``feed_sizes``: TensorRT profiles fix ``cache_len`` and ``slots``).
  Caches and slot states hold random values: they stand for earlier tokens' state, and both
  runners read the same. Invariant: each step is valid for every target's decoder graph, so one
  data loader serves runners of different targets of one artifact.
* **Our plugins.** polygraphy's ``--plugins`` loads shared libraries; graphkiln's plugins are
  TensorRT Python plugins (``tensorrt.plugin``, ``graphkiln.plugins_trt.register``).
  ``network_runner`` registers them before TensorRT parses a graph, and
  ``python -m graphkiln.trt_build.compare polygraphy ARGS...`` runs polygraphy's own CLI with
  them registered. An engine ``graphkiln build`` made needs no registration to run: its plugins
  are ahead-of-time kernels inside the plan.

``compare`` runs runners over steps and compares every output they share (or the named ones)
with polygraphy's ``SimpleCompareFunc`` at ``TOLERANCES`` of the graph's dtype; ``compare_results``
compares outputs that came from elsewhere (a runtime's generations) with the same comparator.

Command line (``python -m graphkiln.trt_build.compare``):
  inputs ART -o FEEDS.json [--target T] [--max-batch B --max-seq-len L]
      polygraphy's JSON input list (``polygraphy run ... --load-inputs FEEDS.json``): ``STEPS``
      for every decoder graph of the artifact at once (polygraphy feeds each graph the inputs it
      takes), or for the one of target T; sized to the artifact's engine when it has one.
  trt-shapes ART [--max-batch B --max-seq-len L]
      the ``--trt-min-shapes/--trt-opt-shapes/--trt-max-shapes`` arguments of the engine's
      prefill profile (``profiles.make_profiles``), for polygraphy building an engine itself.
  polygraphy ARGS...
      polygraphy's CLI with graphkiln's plugins registered (needs TensorRT).

The onnxruntime runs are tested on CPU (tests/test_polygraphy.py); nothing TensorRT here has
run: no TensorRT or GPU where graphkiln is built and tested.
"""

from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import LORA_STACK_ROLES, GraphSpec, Manifest

# (atol, rtol) per graph dtype, polygraphy's elementwise rule: |a - b| <= atol or |a - b| <= rtol * |b|.
# fp32 is loose because TensorRT may run fp32 matmuls in TF32 (10-bit mantissa); fp16/bf16 as
# the kernels' tolerances in scripts/gpu_check.py scaled to a whole model's accumulated rounding.
TOLERANCES = {"float32": (1e-2, 1e-2), "float16": (5e-2, 5e-2), "bfloat16": (1e-1, 1e-1)}


@dataclass(frozen=True)
class Step:
    """One step's layout: row b has ``lengths[b]`` real tokens at positions ``starts[b]`` on
    (the rest of its ``seq`` tokens are padding, as the runtime right-pads a ragged batch)."""

    name: str
    starts: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def batch(self) -> int:
        return len(self.starts)

    @property
    def seq(self) -> int:
        return max(self.lengths)

    def end(self) -> int:
        return max(s + n for s, n in zip(self.starts, self.lengths))


# Every step fits an engine of --max-batch 2 --max-seq-len 16 and onnxruntime's GroupQueryAttention
# (several new tokens onto a filled cache only for a batch of one: request.speculate says why).
STEPS = (
    Step("prefill", starts=(0, 0), lengths=(5, 3)),  # ragged prompts, empty caches
    Step("decode", starts=(5, 9), lengths=(1, 1)),  # one token per row over filled caches
    Step("chunk", starts=(6,), lengths=(4,)),  # a row's next prompt chunk onto its filled cache
)


@dataclass(frozen=True)
class FeedSizes:
    """The sizes an engine fixes (``trt_build.profiles``): state pools of ``slots`` rows and
    ``cache_len`` token positions; a step's batch and length must fit them."""

    slots: int
    cache_len: int


def feed_sizes(manifest: Manifest, max_batch: int | None = None, max_seq_len: int | None = None) -> FeedSizes:
    """The artifact's engine sizes when it has an engine and none are given, else the given ones
    (batch defaults to the widest step, length to the states' ``max_seq_len``), checked as
    ``graphkiln build`` checks them."""
    from graphkiln.trt_build.profiles import build_sizes

    engine = next((e for e in manifest.engines if e.backend == "tensorrt"), None)
    if engine is not None and max_batch is None and max_seq_len is None:
        return FeedSizes(engine.max_batch, engine.max_seq_len)
    sizes = build_sizes(manifest, max(s.batch for s in STEPS) if max_batch is None else max_batch, max_seq_len)
    return FeedSizes(sizes.max_batch, sizes.max_seq_len)


def decoder_graph(manifest: Manifest, target: str | None = None) -> GraphSpec:
    """The decoder graph of ``target`` (None: the artifact's first, its default)."""
    for g in manifest.graphs:
        if g.name == "decoder" and target in (None, g.target):
            return g
    have = ", ".join(f"{g.name} ({g.target})" for g in manifest.graphs)
    raise GraphkilnError(f"artifact has no decoder graph for target {target!r} (it has {have}): pick one of those "
                         "with --target")


def step_feeds(manifest: Manifest, spec: GraphSpec, step: Step, sizes: FeedSizes, seed: int = 0) -> dict[str, np.ndarray]:
    """One step's inputs for decoder graph ``spec``, by role (see the module docstring),
    deterministic per ``seed``; GraphkilnError for a step that does not fit ``sizes`` or an input
    no decoder step has (a vision graph's)."""
    from graphkiln.runtime.backends.ort_cpu import numpy_dtype, total_sequence_length
    from graphkiln.runtime.prompt_layout import needed_roles, pack

    if step.batch > sizes.slots or step.end() > sizes.cache_len:
        raise GraphkilnError(f"step {step.name} ({step.batch} rows up to position {step.end()}) does not fit "
                             f"{sizes.slots} slots of {sizes.cache_len} positions: give a larger --max-batch or "
                             "--max-seq-len")
    rng = np.random.default_rng(seed)
    starts = np.array(step.starts, np.int64)
    lengths = np.array(step.lengths, np.int64)
    position_ids = starts[:, None] + np.arange(step.seq, dtype=np.int64)
    dims = {"batch": step.batch, "seq": step.seq, "n_logits": 1, "cache_len": sizes.cache_len, "slots": sizes.slots,
            "vision_rows": 0, "lora_rows": step.batch}
    roles = {t.role for t in spec.inputs}
    stacks = [t.shape[0] for t in spec.inputs if t.role == "lora_a"]  # [adapter slots + 1, in, R]
    adapters = max(stacks[0] - 1, 1) if stacks else 1
    by_role = {"input_ids": rng.integers(0, manifest.model.vocab_size, (step.batch, step.seq), dtype=np.int64),
               "position_ids": position_ids, "logits_index": (lengths - 1)[:, None], "seq_lens": lengths,
               "slot_idx": np.arange(step.batch, dtype=np.int64),
               "total_sequence_length": total_sequence_length(position_ids, lengths),
               "vision_scatter_indices": np.zeros(0, np.int64),
               # every row on an adapter, the slots in turn (slot 0 is "no adapter"): the LoRA branch runs
               "lora_rows": np.arange(step.batch, dtype=np.int64),
               "lora_slots": 1 + np.arange(step.batch, dtype=np.int64) % adapters}
    by_role.update(pack(needed_roles(roles), [None] * step.batch, starts, step.seq))
    feeds = {}
    for t in spec.inputs:
        if t.role in by_role:
            feeds[t.name] = by_role[t.role]
            continue
        shape = tuple(d if isinstance(d, int) else dims[d] for d in t.shape)
        dtype = numpy_dtype(t.dtype)
        if t.role in ("past_key", "past_value", "conv_state", "recurrent_state", "hidden_states", "vision_embeddings"):
            feeds[t.name] = rng.standard_normal(shape).astype(dtype)
        elif t.role in LORA_STACK_ROLES:  # [slots + 1, in, R] / [slots + 1, R, out]; slot 0 stays zero
            stack = (rng.standard_normal(shape) * 0.05).astype(dtype)
            stack[0] = 0
            feeds[t.name] = stack
        else:
            raise GraphkilnError(f"graph {spec.file} input {t.name} ({t.role}) has no polygraphy feed: compare decoder "
                                 "graphs only")
    return feeds


def data_loader(manifest: Manifest, spec: GraphSpec, sizes: FeedSizes, steps: Sequence[Step] = STEPS,
                seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``steps``' feeds in order: what ``Comparator.run`` (``data_loader=``) and
    ``polygraphy run --load-inputs`` take."""
    return [step_feeds(manifest, spec, step, sizes, seed + i) for i, step in enumerate(steps)]


# ----------------------------------------------------------------------------------------------
# runners


def onnxrt_runner(path: str | Path, name: str | None = None):
    """polygraphy's onnxruntime runner over one graph file on the CPU (its external data beside it)."""
    from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx

    return OnnxrtRunner(SessionFromOnnx(str(path), providers=["cpu"]), name=name or Path(path).name)


def engine_runner(plan: bytes, name: str = "tensorrt engine", profile: int = 0):
    """polygraphy's TensorRT runner over a serialized engine (``graphkiln build``'s plan, profile
    ``profile``: 0 prefill, which admits every step of ``STEPS``). Never run here."""
    from polygraphy.backend.trt import EngineFromBytes, TrtRunner

    return TrtRunner(EngineFromBytes(plan), name=name, optimization_profile=profile)


def network_runner(path: str | Path, manifest: Manifest, graph: GraphSpec, sizes: FeedSizes,
                   name: str = "tensorrt"):
    """polygraphy's TensorRT runner building its own engine from a tensorrt-target graph, with
    graphkiln's plugins registered first and the prefill profile ``graphkiln build`` would use
    (strongly typed, as build's network). Never run here."""
    from polygraphy.backend.trt import CreateConfig, EngineFromNetwork, NetworkFromOnnxPath, Profile, TrtRunner

    from graphkiln.plugins_trt.register import register_plugins
    from graphkiln.trt_build.profiles import BuildSizes, make_profiles

    register_plugins(with_impl=False)  # AOT kernels only, as graphkiln build
    prefill = make_profiles(manifest, graph, BuildSizes(sizes.slots, sizes.cache_len))[0]
    profile = Profile()
    for input_name, (lo, opt, hi) in prefill.shapes.items():
        profile.add(input_name, min=lo, opt=opt, max=hi)
    network = NetworkFromOnnxPath(str(path), strongly_typed=True)
    return TrtRunner(EngineFromNetwork(network, CreateConfig(profiles=[profile])), name=name)


# ----------------------------------------------------------------------------------------------
# comparison


@dataclass(frozen=True)
class OutputDiff:
    """One output of one iteration, ``got`` runner against ``want`` runner (polygraphy's statistics)."""

    want: str
    got: str
    iteration: str
    output: str
    passed: bool
    max_absdiff: float
    max_reldiff: float


@dataclass(frozen=True)
class Comparison:
    """polygraphy's verdict over every compared output; ``passed`` needs at least one."""

    diffs: tuple[OutputDiff, ...]
    atol: float
    rtol: float

    @property
    def passed(self) -> bool:
        return bool(self.diffs) and all(d.passed for d in self.diffs)

    @property
    def max_absdiff(self) -> float:
        return max((d.max_absdiff for d in self.diffs), default=float("nan"))

    def summary(self) -> str:
        """One line: the verdict, what was compared, the worst (or first failing) output."""
        if not self.diffs:
            return "polygraphy compared nothing: the runners share no output"
        bad = [d for d in self.diffs if not d.passed]
        worst = bad[0] if bad else max(self.diffs, key=lambda d: d.max_absdiff)
        verdict = f"{len(bad)} of {len(self.diffs)} outputs differ" if bad else f"{len(self.diffs)} outputs agree"
        return (f"polygraphy: {verdict} (atol {self.atol:g}, rtol {self.rtol:g}); "
                f"{'first failing' if bad else 'worst'}: {worst.output} at {worst.iteration}, {worst.got} vs "
                f"{worst.want}, max abs diff {worst.max_absdiff:.3g}, max rel diff {worst.max_reldiff:.3g}")


@contextmanager
def _quiet():
    """polygraphy logs every run and comparison at INFO; keep its warnings and errors only."""
    from polygraphy.logger import G_LOGGER

    with G_LOGGER.verbosity(G_LOGGER.WARNING):
        yield


def compare_results(results: Mapping[str, Sequence[Mapping[str, np.ndarray]]], dtype: str = "float32",
                    outputs: Iterable[str] | None = None, iterations: Sequence[str] | None = None,
                    tolerance: tuple[float, float] | None = None) -> Comparison:
    """Compare per-iteration outputs ({runner name: [{output: array}, ...]}, the first runner the
    reference) with polygraphy's ``Comparator.compare_accuracy``: every output the runners share,
    or those of ``outputs``; ``tolerance`` (atol, rtol) defaults to ``TOLERANCES[dtype]``."""
    from polygraphy.comparator import Comparator, IterationResult, RunResults, SimpleCompareFunc

    atol, rtol = tolerance or TOLERANCES[dtype]
    keep = None if outputs is None else set(outputs)
    run_results = RunResults()
    for runner, iters in results.items():
        run_results.append((runner, [IterationResult({k: np.asarray(v) for k, v in it.items() if keep is None or k in keep},
                                                     runner_name=runner) for it in iters]))
    count = max((len(v) for v in results.values()), default=0)
    if count == 0:
        return Comparison((), atol, rtol)
    names = iterations or [str(i) for i in range(count)]
    with _quiet():
        (accuracy,) = Comparator.compare_accuracy(  # one AccuracyResult per compare_func
            run_results, compare_func=SimpleCompareFunc(atol=atol, rtol=rtol),
            comparisons=[(0, i) for i in range(1, len(run_results))])
    diffs = []
    for (want, got), per_iteration in accuracy.items():
        for it_name, compared in zip(names, per_iteration):
            for output, r in compared.items():
                diffs.append(OutputDiff(want, got, it_name, output, bool(r), float(r.max_absdiff),
                                        float(r.max_reldiff)))
    return Comparison(tuple(diffs), atol, rtol)


def run(runners: Sequence, feeds: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list[dict[str, np.ndarray]]]:
    """``runners`` over ``feeds`` with polygraphy's ``Comparator.run``: {runner name: [outputs per
    feed]}. polygraphy hands each runner only the inputs its graph takes (graphs of different
    targets take different extras: onnxruntime's seq_lens, ...)."""
    from polygraphy.comparator import Comparator

    with _quiet():
        results = Comparator.run(list(runners), data_loader=list(feeds))
    return {name: [{k: np.array(v) for k, v in it.items()} for it in iters] for name, iters in results.items()}


def compare(runners: Sequence, feeds: Sequence[Mapping[str, np.ndarray]], dtype: str = "float32",
            outputs: Iterable[str] | None = None, iterations: Sequence[str] | None = None,
            tolerance: tuple[float, float] | None = None) -> Comparison:
    """``run``, then ``compare_results`` (the first runner is the reference)."""
    return compare_results(run(runners, feeds), dtype, outputs, iterations, tolerance)


def step_outputs(spec: GraphSpec, step: Step, outputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What a step of graph ``spec`` is defined to produce, under names every target shares:
    logits (and the other per-token outputs) as returned; of each layer's KV, the rows the step
    wrote (``key.3``: [kv_heads, real tokens of every row, head_dim], whether the graph returns
    the new rows or the whole cache with them written); of each slot state, the step's slots.
    The rest of a returned cache is not part of the contract (onnxruntime's GroupQueryAttention
    leaves the rows past a row's end unwritten in a present buffer that is not the past one),
    nor are padding tokens' rows."""
    from graphkiln.manifest import is_pool_output

    out = {}
    for t in spec.outputs:
        value = outputs.get(t.name)
        if value is None:
            continue
        if t.role in ("present_key", "present_value", "new_key", "new_value"):
            whole = t.role.startswith("present")
            rows = [value[b, :, s:s + n] if whole else value[b, :, :n]
                    for b, (s, n) in enumerate(zip(step.starts, step.lengths))]
            out[f"{t.role.split('_')[1]}.{t.layer}"] = np.concatenate(rows, axis=1)
        elif t.role in ("new_conv_state", "new_recurrent_state"):
            out[f"{t.role[4:]}.{t.layer}"] = value[:step.batch] if is_pool_output(t) else value
        else:
            out[t.name] = value
    return out


def compare_graphs(artifact: str | Path, targets: Sequence[str], steps: Sequence[Step] = STEPS,
                   outputs: Iterable[str] | None = None, seed: int = 0) -> Comparison:
    """The artifact's decoder graphs of ``targets`` in onnxruntime on the CPU, over ``steps``,
    each compared with the first on what each step is defined to produce (``step_outputs``;
    ``outputs``: those names only)."""
    root = Path(artifact)
    manifest = Manifest.read(root)
    specs = [decoder_graph(manifest, t) for t in targets]
    sizes = feed_sizes(manifest)
    feeds = _union_feeds(manifest, specs, sizes, steps, seed)
    runners = [onnxrt_runner(root / s.file, f"onnxruntime {s.target}") for s in specs]
    results = run(runners, feeds)
    defined = {name: [step_outputs(spec, step, it) for step, it in zip(steps, iters)]
               for spec, (name, iters) in zip(specs, results.items())}
    return compare_results(defined, _dtype(manifest), outputs, [s.name for s in steps])


def compare_engine(artifact: str | Path, steps: Sequence[Step] = STEPS, seed: int = 0) -> Comparison:
    """The artifact's TensorRT engine (``graphkiln build``'s) against its tensorrt-target graph in
    onnxruntime on the CPU, over ``steps``: logits and the state rows each step wrote
    (``step_outputs``). TensorRT and a GPU needed; never run here."""
    from graphkiln.manifest import open_artifact_file
    from graphkiln.trt_build.profiles import tensorrt_graph

    root = Path(artifact)
    manifest = Manifest.read(root)
    graph = tensorrt_graph(manifest)
    engine = manifest.engine_for(graph, "tensorrt")
    if engine is None:
        raise GraphkilnError(f"artifact has no TensorRT engine for {graph.file}: run 'graphkiln build {root} "
                             "--backend tensorrt' first")
    with open_artifact_file(root, engine.file) as f:
        plan = f.read()
    feeds = data_loader(manifest, graph, FeedSizes(engine.max_batch, engine.max_seq_len), steps, seed)
    runners = [onnxrt_runner(root / graph.file, "onnxruntime"), engine_runner(plan)]
    results = run(runners, feeds)
    defined = {name: [step_outputs(graph, step, it) for step, it in zip(steps, iters)] for name, iters in results.items()}
    return compare_results(defined, _dtype(manifest), iterations=[s.name for s in steps])


def _dtype(manifest: Manifest) -> str:
    return manifest.states[0].dtype


def _union_feeds(manifest: Manifest, specs: Sequence[GraphSpec], sizes: FeedSizes, steps: Sequence[Step],
                 seed: int) -> list[dict[str, np.ndarray]]:
    """One feed list holding every graph's inputs (an input several graphs take is the first
    graph's array, so every runner reads the same values); polygraphy hands each runner the
    inputs its graph takes."""
    merged: list[dict[str, np.ndarray]] = [{} for _ in steps]
    for spec in specs:
        for out, feeds in zip(merged, data_loader(manifest, spec, sizes, steps, seed)):
            out.update({k: v for k, v in feeds.items() if k not in out})
    return merged


# ----------------------------------------------------------------------------------------------
# command line


def trt_shape_args(manifest: Manifest, sizes: FeedSizes) -> list[str]:
    """polygraphy's ``--trt-min-shapes/--trt-opt-shapes/--trt-max-shapes`` for the prefill profile
    of the artifact's tensorrt-target graph at ``sizes``."""
    from graphkiln.trt_build.profiles import BuildSizes, make_profiles, tensorrt_graph

    graph = tensorrt_graph(manifest)
    prefill = make_profiles(manifest, graph, BuildSizes(sizes.slots, sizes.cache_len))[0]
    args = []
    for k, flag in enumerate(("--trt-min-shapes", "--trt-opt-shapes", "--trt-max-shapes")):
        args.append(flag)
        args += [f"{name}:[{','.join(str(d) for d in shapes[k])}]" for name, shapes in prefill.shapes.items()]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["polygraphy"]:
        return _polygraphy(argv[1:])
    p = argparse.ArgumentParser(prog="python -m graphkiln.trt_build.compare",
                                description="polygraphy inputs and TensorRT shapes for a graphkiln artifact")
    sub = p.add_subparsers(dest="command", required=True)
    for name in ("inputs", "trt-shapes"):
        s = sub.add_parser(name)
        s.add_argument("artifact")
        s.add_argument("--max-batch", type=int)
        s.add_argument("--max-seq-len", type=int)
        if name == "inputs":
            s.add_argument("-o", "--output", required=True, help="the JSON file polygraphy --load-inputs reads")
            s.add_argument("--target", help="only this target's decoder graph (default: every decoder graph)")
    sub.add_parser("polygraphy", help="polygraphy's CLI with graphkiln's TensorRT plugins registered")
    args = p.parse_args(argv)
    try:
        manifest = Manifest.read(Path(args.artifact))
        sizes = feed_sizes(manifest, args.max_batch, args.max_seq_len)
        if args.command == "trt-shapes":
            print(" ".join(trt_shape_args(manifest, sizes)))
            return 0
        from polygraphy.json import save_json

        specs = ([decoder_graph(manifest, args.target)] if args.target else
                 [g for g in manifest.graphs if g.name == "decoder"] or [decoder_graph(manifest)])
        feeds = _union_feeds(manifest, specs, sizes, STEPS, seed=0)
        save_json(feeds, args.output, description="graphkiln decoder steps: " + ", ".join(s.name for s in STEPS))
    except GraphkilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _polygraphy(args: list[str]) -> int:
    from polygraphy.tools import main as polygraphy_main

    from graphkiln.plugins_trt.register import register_plugins

    try:
        register_plugins(with_impl=False)
    except GraphkilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return polygraphy_main(run_opts=args)


if __name__ == "__main__":
    sys.exit(main())
