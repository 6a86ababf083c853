"""What a caller chooses for ``distributed="ray"`` (``RayOptions``, ``check_distributed``), the
defaults, Ray imported on demand, and the two failures the driver and the actors share."""

from __future__ import annotations

from dataclasses import dataclass

from graphkiln.errors import GraphkilnError


INSTALL_HINT = "pip install 'graphkiln[distributed]'"
RESTART_WAIT_S = 120.0  # how long a restarting stage actor may take to answer before it counts as gone
CONNECT_TIMEOUT_S = 30.0  # RayOptions.connect_timeout_s / --ray-timeout: joining a cluster at an address
START_TIMEOUT_S = 600.0  # RayOptions.start_timeout_s: placing the stage actors and opening their files
DISTRIBUTED = ("ray",)
# ray.init's arguments besides where: no dashboard, Ray's logs kept out of the terminal
INIT_KWARGS = {"include_dashboard": False, "log_to_driver": False, "logging_level": "ERROR", "configure_logging": True}


class StageFailed(GraphkilnError):
    """A stage's actor died or restarted under a forward: the requests in it failed."""


class Restarted(RuntimeError):
    """Raised by a stage actor given a call meant for an earlier incarnation of itself (Ray
    restarted it: its pools are new and empty); the driver turns it into ``StageFailed``."""


@dataclass(frozen=True)
class RayOptions:
    """How ``distributed="ray"`` places the stages.

    ``address``: an existing Ray cluster to join ("auto", "ray://host:10001"); None starts a
    local one unless this process is already connected. ``num_cpus``: the local cluster's CPUs
    (default: the machine's, at least one per stage). ``stage_dirs``: per stage, the artifact
    directory as the node running that stage sees it (default: the driver's directory, for
    every stage); each needs only ``manifest.json`` and that stage's files. ``max_restarts``:
    how often Ray restarts a dead stage actor (0: a dead stage ends the pipeline).
    ``stage_nodes``: per stage, the Ray node that must run it (a node id, or a node's IP address
    when one node has it), e.g. the host holding that stage's directory; default: wherever Ray
    places it. A node that is not alive in the cluster is refused before any actor starts.
    ``cpus_per_stage``: the CPUs Ray reserves for each actor (placement only; its onnxruntime
    threads are the Engine's ``threads``). ``connect_timeout_s``: how long joining the cluster at
    ``address`` may take before it fails with one line (Ray itself would keep retrying an
    unreachable address for minutes). ``start_timeout_s``: how long the stage actors may take to
    be placed and to open (hash) their files before loading fails with one line (None: no limit;
    an actor no node has a free CPU for would otherwise wait for one forever)."""

    address: str | None = None
    num_cpus: int | None = None
    stage_dirs: tuple[str, ...] | None = None
    max_restarts: int = 1
    cpus_per_stage: float = 1.0
    stage_nodes: tuple[str, ...] | None = None
    connect_timeout_s: float = CONNECT_TIMEOUT_S
    start_timeout_s: float | None = START_TIMEOUT_S


def import_ray():
    """Ray, or the one-line refusal naming the extra that installs it."""
    try:
        import ray
    except ImportError:
        raise GraphkilnError(f"--distributed ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def check_distributed(distributed: object) -> RayOptions | None:
    """``distributed`` as given to ``Engine.load``: None, "ray" or a ``RayOptions``."""
    if distributed is None:
        return None
    if isinstance(distributed, RayOptions):
        return distributed
    if distributed in DISTRIBUTED:
        return RayOptions()
    raise GraphkilnError(f"distributed {distributed!r} is not supported: choose one of {', '.join(DISTRIBUTED)} "
                         "(or leave it unset to run in this process)")
