"""``graphkiln build ART --backend tensorrt``: a TensorRT engine for an artifact's decoder, written into it.

One build, in order (each step refuses with one ``GraphkilnError`` line, and nothing is
written until the last):

1. the manifest is read and every file checked against its sha256 (``graphkiln.artifact``),
   under an exclusive lock on the artifact directory (``publish.lock_artifact``);
2. the tensorrt-target decoder graph is found and the two optimization profiles computed
   from ``max_batch``/``max_seq_len`` (``profiles``: plain code);
3. the files the build will write are checked to be graphkiln's to write (``publish``);
4. TensorRT 11 and a GPU are found (``tensorrt``: the only module that imports TensorRT or
   CUDA), the graph is statically checked against TensorRT's parser support list
   (``graphkiln.export.trt_check``), parsed and built, reusing the previous build's timing cache;
5. the plan and timing cache are written to ``engines/tensorrt/`` and an ``EngineSpec``
   (profiles, sizes, TensorRT version, GPU name and compute capability) replaces any previous
   engine entry of the graph in ``manifest.json`` (``publish.publish_engine``), which changes
   the artifact's digest.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import MANIFEST_NAME, EngineSpec, Manifest, artifact_file, open_artifact_file

BACKENDS = ("tensorrt",)


@dataclass(frozen=True)
class BuildResult:
    """What ``build`` wrote: the engine entry now in the manifest and the manifest's digests."""

    root: Path
    engine: EngineSpec
    plan_bytes: int
    pool_bytes: int  # the runner's state pools at the engine's sizes
    digest: str  # sha256 of the new manifest.json
    previous_digest: str
    replaced: bool  # a previous engine of the graph was replaced
    timing_cache_reused: bool
    seconds: float

    def summary(self) -> str:
        e = self.engine
        lines = [
            f"engine       {e.graph} ({e.target}): {e.file}, {_size(self.plan_bytes)}, TensorRT {e.tensorrt_version} "
            f"for {e.gpu_name} (sm {e.compute_capability}), built in {self.seconds:.0f} s"
            + (", replacing the previous one" if self.replaced else ""),
            "profiles     " + "; ".join(_describe_profile(i, e, p) for i, p in enumerate(e.profiles)),
            f"state pools  {e.max_batch} slots x {e.max_seq_len} tokens: {_size(self.pool_bytes)} of GPU memory for "
            "the runner",
            f"timing cache {e.timing_cache} ({'reused and extended' if self.timing_cache_reused else 'new'})",
            f"digest       {self.digest}  (sha256 of {MANIFEST_NAME}; this build changed it from "
            f"{self.previous_digest}: pin the new one with run --expect-digest)",
        ]
        return "\n".join(lines)


def build(artifact_dir: str | Path, backend: str = "tensorrt", max_batch: int | None = None,
          max_seq_len: int | None = None, log: Callable[[str], None] | None = None) -> BuildResult:
    """Build the decoder's engine for ``backend`` and write it into the artifact (see the module docstring)."""
    from graphkiln.artifact import check_artifact
    from graphkiln.trt_build.profiles import DEFAULT_MAX_BATCH, build_sizes, make_profiles, state_pool_bytes, tensorrt_graph
    from graphkiln.trt_build.publish import check_destinations, engine_paths, lock_artifact, publish_engine

    if backend not in BACKENDS:
        raise GraphkilnError(f"backend {backend!r} cannot build engines: choose one of {', '.join(BACKENDS)}")
    root = Path(artifact_dir)
    Manifest.read(root)  # a clear error for a path that is not an artifact, before it is locked
    with lock_artifact(root):
        manifest, digest = Manifest.read_with_digest(root)
        check_artifact(root, manifest)
        graph = tensorrt_graph(manifest)
        sizes = build_sizes(manifest, DEFAULT_MAX_BATCH if max_batch is None else max_batch, max_seq_len)
        profiles = make_profiles(manifest, graph, sizes)
        plan_rel, cache_rel = engine_paths(graph)
        check_destinations(root, manifest, [plan_rel, cache_rel])
        previous = manifest.engine_for(graph, backend)
        old_cache = None
        if previous is not None and previous.timing_cache is not None:
            with open_artifact_file(root, previous.timing_cache) as f:  # its sha256 was just checked
                old_cache = f.read()

        from graphkiln.trt_build import tensorrt as trt_build

        trt = trt_build.load_tensorrt()
        gpu = trt_build.find_gpu()
        _static_check(root)
        started = time.monotonic()
        built = trt_build.build_engine(trt, artifact_file(root, graph.file), graph, profiles, gpu, old_cache, log)
        seconds = time.monotonic() - started
        engine = EngineSpec(graph=graph.name, target=graph.target, file=plan_rel, backend="tensorrt",
                            profiles=profiles, max_batch=sizes.max_batch, max_seq_len=sizes.max_seq_len,
                            tensorrt_version=built.tensorrt_version, gpu_name=built.gpu.name,
                            compute_capability=built.gpu.compute_capability, timing_cache=cache_rel)
        _, new_digest = publish_engine(root, manifest, digest, engine,
                                       {plan_rel: built.plan, cache_rel: built.timing_cache})
    return BuildResult(root, engine, built.plan.nbytes, state_pool_bytes(manifest, sizes), new_digest, digest,
                       previous is not None, built.timing_cache_reused, seconds)


def _static_check(root: Path) -> None:
    """``graphkiln check``'s verdict on the tensorrt-target graph; its first error refuses the build."""
    from graphkiln.export.trt_check import check_artifact as trt_check

    report = trt_check(root)
    if report.errors:
        f = report.errors[0]
        where = f"{f.op} node {f.node}" if f.op and f.node else (f.op or "graph")
        more = f" (and {len(report.errors) - 1} more)" if len(report.errors) > 1 else ""
        raise GraphkilnError(f"{f.graph}: {where}: {f.message}{more}; TensorRT {report.trt_version}'s parser would "
                             f"refuse it: see 'graphkiln check {root} --backend tensorrt' and re-export with "
                             "--target tensorrt")


def _describe_profile(i: int, engine: EngineSpec, profile) -> str:
    lo, opt, hi = profile.shapes.get("input_ids", ((0, 0),) * 3)
    seq = f"seq {lo[1]}..{hi[1]}" if lo[1] != hi[1] else f"seq {hi[1]}"
    return f"{i} {profile.name}: batch {lo[0]}..{hi[0]} x {seq} (tuned at {opt[0]} x {opt[1]})"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
