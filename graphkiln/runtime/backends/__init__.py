"""Which graph runs on what: ``open_backend`` turns (artifact, backend, device) into the step
runner and the state pool the ``Engine`` generates with.

A step runner has ``spec`` (the ``GraphSpec`` it runs) and ``run(pool, input_ids, position_ids,
logits_index, lengths) -> logits [n, n_logits, vocab]`` (numpy, host memory) over the live
slots ``0..n-1`` of its pool; a pool has ``reserve(slots, capacity)``, ``claim()`` and
``release(slot)`` as ``StatePool`` defines them. The engine owns both for its life.

Backends: ``onnxruntime`` on ``cpu`` (the embedded default: ``DecoderGraph`` + ``StatePool``),
``onnxruntime`` on ``cuda`` (onnxruntime-gpu's CUDA execution provider), ``tensorrt`` (built
engines, ``graphkiln build``; always ``cuda``). Each imports its libraries only when chosen,
so the CPU runtime needs onnxruntime and numpy alone.
"""

from __future__ import annotations

from pathlib import Path

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import TARGETS, Manifest

BACKENDS = ("onnxruntime", "tensorrt")
DEVICES = ("cpu", "cuda")


def check_choice(backend: object, device: object, target: object) -> None:
    """One-line refusals for a backend/device/target the runtime does not have."""
    if backend not in BACKENDS:
        raise GraphkilnError(f"backend {backend!r} is not supported: choose one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise GraphkilnError(f"device {device!r} is not supported: choose one of {', '.join(DEVICES)}")
    if backend == "tensorrt" and device != "cuda":
        raise GraphkilnError("backend tensorrt runs on device cuda: pass device='cuda' (or leave device unset)")
    if target is not None and target not in TARGETS:
        raise GraphkilnError(f"graph target {target!r} is not one of {', '.join(TARGETS)}")


def open_backend(artifact_dir: Path, manifest: Manifest, backend: str, device: str, threads: int | None,
                 target: str | None = None, distributed=None, manifest_digest: str | None = None,
                 batched_int8: bool = False, spinning: bool = True):
    """The (step runner, state pool) for ``backend`` on ``device``. ``target`` picks the graph
    lowered for that target (default: the one the backend runs best, ``Manifest.graph_for``).
    ``distributed`` ("ray" or a ``runtime.backends.distributed.RayOptions``): a staged artifact's stages
    each in a Ray actor (``runtime.backends.distributed``) instead of chained in this process.
    ``batched_int8``: steps of many token rows run the artifact's batched-step graph
    (``graphkiln.batched_int8``; onnxruntime on the CPU, quantized single-graph artifacts).
    ``spinning`` False: the CPU graph's threads sleep between runs (``ort_cpu.DecoderGraph``), for
    a graph that takes turns with another in this process (a speculative draft model's)."""
    if batched_int8:
        check_batched_int8(manifest, backend, device, distributed)
    if manifest.lora is not None and (backend, device) != ("onnxruntime", "cpu"):
        # the adapter stacks are host arrays the CPU runners bind (runtime.lora); no device copy yet
        raise GraphkilnError(f"LoRA artifacts run on onnxruntime on the CPU only for now, not {backend} on {device}: "
                             f"load it without backend/device, or re-export without --lora-rank")
    if distributed is not None:
        from graphkiln.runtime.backends.distributed import check_distributed, import_ray, open_ray

        options = check_distributed(distributed)
        if (backend, device) != ("onnxruntime", "cpu"):
            raise GraphkilnError(f"--distributed ray runs stages on onnxruntime on the CPU only for now, not {backend} "
                                 f"on {device}: load it without backend/device")
        import_ray()  # before anything else: the missing extra is the one line to give
        return open_ray(artifact_dir, manifest, manifest_digest, threads, target, options)
    if any(s.kind == "recurrent" for s in manifest.states) and (backend, device) != ("onnxruntime", "cpu"):
        # the GPU pools (runtime.backends.device_state) hold KV and conv state only so far
        raise GraphkilnError(f"models with recurrent-state layers (gated delta net, Mamba-2) run on onnxruntime on the "
                             f"CPU only for now, not {backend} on {device}: load it without backend/device")
    if manifest.vision is not None and (backend, device) != ("onnxruntime", "cpu"):
        # the GPU runners bind no vision seam yet (runtime.backends.trt_runner, runtime.backends.ort_cuda)
        raise GraphkilnError(f"vision-language artifacts run on onnxruntime on the CPU only for now, not {backend} on "
                             f"{device}: load it without backend/device")
    if manifest.stages:  # one graph per slice of layers, chained in this process (runtime.backends.stages)
        from graphkiln.runtime.backends.stages import open_staged

        return open_staged(artifact_dir, manifest, backend, device, threads, target)
    spec = manifest.graph("decoder", target) if target else manifest.graph_for("decoder", backend)
    if backend == "onnxruntime" and device == "cpu":
        from graphkiln.runtime.backends.ort_cpu import DecoderGraph, numpy_dtype
        from graphkiln.runtime.backends.state import StatePool, takes_window_offset

        batched = next((b for b in manifest.batched if (b.graph, b.target) == (spec.name, spec.target)), None)
        if batched_int8 and batched is None:
            raise GraphkilnError(f"the artifact has no batched-step graph for its {spec.target} decoder graph: "
                                 "load it without batched_int8")
        return (DecoderGraph(artifact_dir, spec, threads, spinning, batched=batched if batched_int8 else None),
                StatePool(manifest.states, numpy_dtype(manifest.states[0].dtype), windowed=takes_window_offset(spec)))
    if backend == "onnxruntime":
        from graphkiln.runtime.backends.ort_cuda import open_onnxruntime_cuda

        return open_onnxruntime_cuda(artifact_dir, manifest, spec, threads)
    from graphkiln.runtime.backends.trt_runner import open_tensorrt

    return open_tensorrt(artifact_dir, manifest, spec)


def check_batched_int8(manifest: Manifest, backend: str, device: str, distributed) -> None:
    """One-line refusals for turning on the batched int8 steps where they do not exist."""
    if not manifest.batched:
        why = ("it is not quantized" if manifest.model.quant is None else
               "it is a pipeline-staged artifact" if manifest.stages else
               f"its activations are {manifest.model.dtype}" if manifest.model.dtype != "fp32" else
               "it was exported before graphkiln wrote one")
        raise GraphkilnError(f"--batched-int8 needs the batched-step graph that int4/int8 fp32 exports carry, and this "
                             f"artifact has none ({why}): drop --batched-int8, or re-export with --quant int4")
    if (backend, device) != ("onnxruntime", "cpu") or distributed is not None:
        raise GraphkilnError("--batched-int8 runs on onnxruntime on the CPU only: drop it, or load without "
                             "backend/device/distributed")
