"""The TensorRT calls of ``graphkiln build``: few, thin, imported only when a build runs.

Everything decided before TensorRT is involved (sizes, profiles, the static graph check,
where files go) is plain code elsewhere in ``graphkiln.trt_build``, tested on CPU. This module
only finds TensorRT and the GPU, parses the tensorrt-target graph with TensorRT's ONNX parser
into a strongly typed network (TensorRT 11 has no precision flags: the graph's own types
decide), adds the given profiles in order and builds the serialized engine with a timing
cache. It has never run: neither TensorRT nor a GPU is available where graphkiln is built
and tested (tests/test_trt_build.py runs a real build where both are).

The plugins' ahead-of-time kernels are compiled by ``graphkiln.plugins_trt.register`` while
TensorRT builds, so the engine runs without Python afterwards; the plugins are registered
without their Python ``impl`` so no JIT plugin can end up in the engine.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import GraphSpec, ProfileSpec

NEEDS = "graphkiln build --backend tensorrt needs TensorRT 11 (tensorrt-cu13) and an NVIDIA GPU"
INSTALL = "pip install 'graphkiln[tensorrt]'"
MIN_MAJOR = 11


@dataclass(frozen=True)
class Gpu:
    """The CUDA device the engine is built on (the current one, as CUDA_VISIBLE_DEVICES leaves it)."""

    index: int
    name: str
    compute_capability: str  # "9.0"


@dataclass(frozen=True)
class BuiltEngine:
    """A built engine, not yet written anywhere. ``plan`` views TensorRT's host memory (the
    view keeps it alive); ``timing_cache`` is the cache after the build (the loaded one
    plus what this build timed)."""

    plan: memoryview
    timing_cache: bytes
    tensorrt_version: str
    gpu: Gpu
    timing_cache_reused: bool  # the previous build's cache was accepted (same TensorRT and GPU)


def load_tensorrt():
    """``tensorrt``, version-checked; GraphkilnError (one line: what is missing, how to install) otherwise."""
    try:
        import tensorrt as trt
    except Exception as exc:  # ImportError, or OSError when its CUDA libraries cannot be loaded
        raise GraphkilnError(f"{NEEDS}, and TensorRT cannot be imported ({_one_line(exc)}): {INSTALL}") from None
    version = str(getattr(trt, "__version__", "unknown"))
    try:
        major = int(version.split(".")[0])
    except ValueError:
        major = 0
    if major < MIN_MAJOR:
        raise GraphkilnError(f"{NEEDS}, and this is TensorRT {version}: {INSTALL}")
    return trt


def find_gpu() -> Gpu:
    """The current CUDA device through cuda-python's runtime bindings; GraphkilnError when
    cuda-python is missing or no GPU is visible."""
    try:
        from cuda.bindings import runtime as cudart
    except Exception as exc:
        raise GraphkilnError(f"{NEEDS}, and cuda-python cannot be imported ({_one_line(exc)}): {INSTALL}") from None
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count < 1:
        why = _cuda_error(cudart, err) if err != cudart.cudaError_t.cudaSuccess else "0 devices"
        raise GraphkilnError(f"{NEEDS}, and CUDA sees no GPU ({why}): run on a machine with an NVIDIA GPU "
                             "(check nvidia-smi and CUDA_VISIBLE_DEVICES)")
    err, device = cudart.cudaGetDevice()
    if err == cudart.cudaError_t.cudaSuccess:
        err, props = cudart.cudaGetDeviceProperties(device)
    if err != cudart.cudaError_t.cudaSuccess:
        raise GraphkilnError(f"{NEEDS}, and CUDA cannot describe the GPU ({_cuda_error(cudart, err)}): check the "
                             "NVIDIA driver (nvidia-smi)")
    name = props.name.decode(errors="replace") if isinstance(props.name, bytes) else str(props.name)
    # the manifest refuses control characters (inspect prints it): the driver's name is a C string
    name = "".join(c for c in name.split("\x00")[0] if unicodedata.category(c)[0] != "C").strip() or "unknown GPU"
    return Gpu(int(device), name, f"{int(props.major)}.{int(props.minor)}")


def build_engine(trt, graph_path: Path, graph: GraphSpec, profiles: Sequence[ProfileSpec], gpu: Gpu,
                 timing_cache: bytes | None = None, log: Callable[[str], None] | None = None) -> BuiltEngine:
    """Parse ``graph_path`` (the artifact's file of ``graph``; its external data beside it) and
    build the engine with ``profiles`` as profiles 0, 1, ... in order. ``timing_cache``: a
    previous build's, used when TensorRT accepts it (same version and GPU), else started anew."""
    from graphkiln.plugins_trt.register import register_plugins

    register_plugins(with_impl=False)
    logger = _collecting_logger(trt)
    builder = trt.Builder(logger)
    if builder is None:
        raise GraphkilnError(f"TensorRT could not create a builder ({logger.first_error()}): {INSTALL} on a machine "
                             "whose NVIDIA driver supports CUDA 13 (nvidia-smi)")
    flags = 0
    strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    if strongly_typed is not None:  # deprecated and always on in TensorRT 11; required by 10.x
        flags |= 1 << int(strongly_typed)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(graph_path)):
        errors = [parser.get_error(i) for i in range(parser.num_errors)]
        first = _parser_error(errors[0]) if errors else logger.first_error()
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise GraphkilnError(f"TensorRT's ONNX parser refused {graph.file}: {first}{more}: re-export the artifact "
                             "with this graphkiln (--target tensorrt); if it still fails, 'graphkiln check' missed it")
    _check_inputs(network, graph, profiles)

    config = builder.create_builder_config()
    for i, spec in enumerate(profiles):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in spec.shapes.items():
            profile.set_shape(name, lo, opt, hi)
        index = config.add_optimization_profile(profile)
        if index != i:
            raise GraphkilnError(f"TensorRT refused the {spec.name} optimization profile ({logger.first_error()}): "
                                 "rebuild with other --max-batch/--max-seq-len")

    cache, reused = None, False
    if timing_cache:
        try:
            cache = config.create_timing_cache(timing_cache)
            reused = cache is not None and bool(config.set_timing_cache(cache, False))
        except Exception:  # a cache TensorRT cannot read: it only costs timing again
            reused = False
    if not reused:
        cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)

    if log is not None:
        log(f"building     {graph.file} with TensorRT {trt.__version__} on {gpu.name} (sm {gpu.compute_capability}); "
            "this takes minutes")
    host = builder.build_serialized_network(network, config)
    if host is None:
        raise GraphkilnError(f"TensorRT could not build the engine for {graph.file} ({logger.first_error()}): "
                             "lower --max-batch/--max-seq-len if it ran out of memory")
    serialized = config.get_timing_cache().serialize()
    return BuiltEngine(memoryview(host), bytes(memoryview(serialized)), str(trt.__version__), gpu, reused)


def _check_inputs(network, graph: GraphSpec, profiles: Sequence[ProfileSpec]) -> None:
    """The parsed network's inputs are the manifest's, and every dynamic one is in every profile
    (TensorRT would refuse the build later, with a longer message)."""
    names = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    expected = {t.name for t in graph.inputs}
    if set(names) != expected:
        raise GraphkilnError(f"graph {graph.file} parses with inputs {sorted(names)}, but the manifest lists "
                             f"{sorted(expected)}: re-export the artifact")
    for spec in profiles:
        missing = [n for n, shape in names.items() if any(d < 0 for d in shape) and n not in spec.shapes]
        if missing:
            raise GraphkilnError(f"graph {graph.file} input {missing[0]!r} is dynamic in TensorRT but the {spec.name} "
                                 "profile does not size it: re-export the artifact")


def _collecting_logger(trt):
    """A TensorRT logger keeping error messages (for the one-line failure) and dropping the rest."""

    class Collecting(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity, msg) -> None:
            if int(severity) <= int(trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg))

        def first_error(self) -> str:
            return _one_line(self.errors[0]) if self.errors else "TensorRT logged no error"

    return Collecting()


def _parser_error(e) -> str:
    node = e.node_name() if hasattr(e, "node_name") else ""
    op = e.node_operator() if hasattr(e, "node_operator") else ""
    where = f" at {op} node {node}" if node or op else ""
    return f"{_one_line(e.desc())}{where}"


def _cuda_error(cudart, err) -> str:
    try:
        _, name = cudart.cudaGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return str(err)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())
