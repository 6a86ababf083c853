"""``open_ray``: a staged artifact's (runner, pool) with one Ray actor per stage."""

from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime.backends.distributed.cluster import end_actors, join_cluster, local_cluster, resolve_stage_nodes
from graphkiln.runtime.backends.distributed.driver import Pipeline, RayStagedDecoder, RayStagedPool
from graphkiln.runtime.backends.distributed.options import INIT_KWARGS, RayOptions, import_ray
from graphkiln.runtime.backends.distributed.worker import StageWorker


def open_ray(artifact_dir: Path, manifest: Manifest, manifest_digest: str | None, threads: int | None,
             target: str | None = None, options: RayOptions | None = None) -> tuple[RayStagedDecoder, RayStagedPool]:
    """(runner, pool) for a staged artifact with one Ray actor per stage."""
    options = options or RayOptions()
    for name in ("connect_timeout_s", "start_timeout_s"):
        timeout = getattr(options, name)
        if name == "start_timeout_s" and timeout is None:
            continue
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and math.isfinite(timeout)
                                             and timeout > 0):
            raise GraphkilnError(f"RayOptions.{name} must be a finite number of seconds > 0, got {timeout!r}")
    if not manifest.stages:
        raise GraphkilnError("--distributed ray runs a pipeline-staged artifact, and this one has a single graph: "
                             "re-export with --stages N or --stage-layers, or run it without --distributed")
    n = len(manifest.stages)
    dirs = options.stage_dirs or tuple(str(Path(artifact_dir).resolve()) for _ in range(n))
    if len(dirs) != n:
        raise GraphkilnError(f"stage_dirs has {len(dirs)} entries but the artifact has {n} stages: give one per stage")
    if manifest_digest is None:
        from graphkiln.manifest import MANIFEST_NAME
        import hashlib

        manifest_digest = hashlib.sha256((Path(artifact_dir) / MANIFEST_NAME).read_bytes()).hexdigest()
    ray = import_ray()
    if not ray.is_initialized():
        local_cluster.update(started=False, drivers=0)
        kwargs = dict(INIT_KWARGS)
        # ray.init replaces this process's SIGTERM handler with sys.exit, and it stays after
        # ray.shutdown: the CLI's own handling (serve's draining, cleanup on interruption) must
        # keep working, so the handler in place before is put back.
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            if options.address is not None:
                join_cluster(ray, options.address, options.connect_timeout_s, kwargs)
            else:
                cpus = options.num_cpus or max(math.ceil(n * options.cpus_per_stage), os.cpu_count() or 1)
                ray.init(num_cpus=cpus, **kwargs)
                local_cluster["started"] = True
        finally:
            if threading.current_thread() is threading.main_thread() and sigterm is not None:
                signal.signal(signal.SIGTERM, sigterm)
    owns_cluster = local_cluster["started"]
    if owns_cluster:
        local_cluster["drivers"] += 1
    actor_class = ray.remote(StageWorker)
    placement = {"num_cpus": options.cpus_per_stage, "max_restarts": options.max_restarts, "max_task_retries": 0}
    try:
        nodes = resolve_stage_nodes(ray, options.stage_nodes, n)
    except BaseException:
        if owns_cluster:
            end_actors(ray, [], owns_cluster)
        raise
    actors = []
    for k in range(n):
        where = {}
        if nodes is not None:  # hard affinity: a stage never runs where its files are not
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            where["scheduling_strategy"] = NodeAffinitySchedulingStrategy(nodes[k], soft=False)
        actors.append(actor_class.options(**placement, **where).remote(dirs[k], k, manifest_digest, threads, target))
    try:
        pipeline = Pipeline(ray, actors, [st.layers for st in manifest.stages], owns_cluster,
                             options.start_timeout_s)
    except ray.exceptions.RayActorError as exc:
        end_actors(ray, actors, owns_cluster)
        # Ray keeps only the text of a failed __init__: its own one-line error is the last line
        text = str(getattr(exc, "error_msg", None) or exc)
        ours = [l.split("GraphkilnError: ", 1)[1] for l in text.splitlines() if "GraphkilnError: " in l]
        if ours:
            raise GraphkilnError(ours[-1]) from None
        line = (text.splitlines() or [type(exc).__name__])[-1].strip()
        raise GraphkilnError(f"a pipeline stage's Ray actor could not start ({line[:300]}): check the stage's files "
                             "and that graphkiln is installed on every node") from None
    except BaseException:
        end_actors(ray, actors, owns_cluster)
        raise
    return RayStagedDecoder(pipeline), RayStagedPool(pipeline)
