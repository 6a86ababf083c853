"""A pipeline-staged artifact run with each stage in its own Ray actor (``distributed="ray"``).

The unit is the in-process one (``runtime.backends.stages``): a stage is a ``DecoderGraph`` plus a
``StatePool`` over only its own states, addressed by slot. Here each stage lives in a Ray actor
(``StageWorker``) that opens only the manifest and its stage's files (``StageSpec.files``,
checked against their sha256) and allocates only its own pools; the driver in the Engine's
process (``RayStagedDecoder`` + ``RayStagedPool``) makes the same calls through actor handles:

- slot bookkeeping (``reserve``, ``claim``, ``release``, ``release_keeping_tail``, ``scrub``)
  is replayed on every actor and checked to agree with the driver's own mirror of the packed
  slots (``PackedSlots`` without storage), so ``live`` / ``free_slots`` cost no round trip;
- a forward is a chain of actor tasks, stage k+1's task taking stage k's result *object ref*
  as its argument: hidden states go actor to actor through Ray's object store, never through
  the driver; the driver waits only on the last stage's logits (or tokens);
- micro-batches: ``submit`` returns a ``PendingRun`` without waiting, so several slot ranges
  can be in flight at once; each actor runs its tasks in submission order, so while range A is
  in stage 1, range B runs in stage 0 (``run`` is ``submit(...).result()``).

Failure. A stage actor that dies (killed, crashed, its node lost) fails the forward that was in
flight with one ``StageFailed`` line (any Ray error is looked into: which stage restarted or is
gone, ``_Pipeline.failed``). Actors are created with ``max_restarts`` (default 1): Ray
restarts the process, which re-opens the stage's files and comes back with empty pools; the
driver recognises it by its new incarnation id, sizes its pools as the others, and refuses any
forward over the rows that were live at the failure (their state on that stage is gone) until
they are all released — on the survivors only, since the restarted stage never held them. Once
no slot is live the pipeline is whole again and the next request is served. When restarts are
exhausted, or the stage cannot be restarted (its pinned node left the cluster: Ray reports the
actor unschedulable), the stage is gone: the survivors' slots are all released at once (nothing
runs on them again) and every forward is refused with one line: load the artifact again.

Cluster. With no Ray connection in this process, ``open_ray`` starts a local one (``num_cpus``
as given, else at least one per stage; no dashboard; Ray's logs kept out of the terminal); with
``RayOptions.address`` it joins an existing cluster, where each stage's directory
(``stage_dirs``) is a path on the node that runs it, within ``connect_timeout_s`` or with one
``GraphkilnError`` line (``join_cluster``: Ray alone would retry an unreachable address for
minutes). Lifecycle: the actors live as long as the driver (``close``, or garbage collection of
the Engine, ends them); a cluster started here is shut down with the last driver that uses it.

One job a module: ``options`` (what a caller chooses, the shared failures), ``worker`` (a stage's
actor), ``driver`` (the pipeline as the Engine's process sees it), ``cluster`` (starting, joining
and ending the Ray cluster, pinning stages to nodes), ``launch`` (``open_ray``, which wires them).
Import from ``graphkiln.runtime.backends.distributed``: the names below are the public ones.
"""

from graphkiln.runtime.backends.distributed.cluster import join_cluster, resolve_stage_nodes
from graphkiln.runtime.backends.distributed.driver import PendingRun, RayStagedDecoder, RayStagedPool
from graphkiln.runtime.backends.distributed.launch import open_ray
from graphkiln.runtime.backends.distributed.options import (CONNECT_TIMEOUT_S, DISTRIBUTED, INIT_KWARGS, INSTALL_HINT,
                                                            RESTART_WAIT_S, START_TIMEOUT_S, RayOptions, Restarted,
                                                            StageFailed, check_distributed, import_ray)
from graphkiln.runtime.backends.distributed.worker import StageWorker, peak_rss

__all__ = [
    "CONNECT_TIMEOUT_S", "DISTRIBUTED", "INIT_KWARGS", "INSTALL_HINT", "RESTART_WAIT_S", "START_TIMEOUT_S",
    "PendingRun", "RayOptions", "RayStagedDecoder", "RayStagedPool", "Restarted", "StageFailed", "StageWorker",
    "check_distributed", "import_ray", "join_cluster", "open_ray", "peak_rss", "resolve_stage_nodes",
]
