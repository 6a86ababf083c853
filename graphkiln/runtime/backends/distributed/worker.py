"""One pipeline stage in one process: the body of a stage's Ray actor (``StageWorker``), plain
Python, so it can be read and run without Ray."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.manifest import Manifest
from graphkiln.runtime.backends.distributed.options import Restarted


class StageWorker:
    """One stage in one process (the body of the Ray actor; plain Python, so it can be read and
    run without Ray). Opens ``manifest.json`` (pinned to the driver's digest) and only its own
    stage's graph and data files, each checked against the manifest's sha256 before onnxruntime
    reads it. Owns the stage's ``StatePool``."""

    def __init__(self, artifact_dir: str, index: int, digest: str, threads: int | None, target: str | None) -> None:
        from graphkiln.artifact import graph_external_data, sha256_file
        from graphkiln.manifest import artifact_file
        from graphkiln.runtime.backends.ort_cpu import numpy_dtype
        from graphkiln.runtime.backends.stages import open_stage_graph
        from graphkiln.runtime.backends.state import StatePool

        root = Path(artifact_dir)
        manifest, _ = Manifest.read_with_digest(root, digest)
        if not 0 <= index < len(manifest.stages):
            raise GraphkilnError(f"{root} has {len(manifest.stages)} stages, no stage {index}: check stage_dirs")
        stage = manifest.stages[index]
        spec = manifest.graph(stage.graph, target) if target else manifest.graph_for(stage.graph, "onnxruntime")
        own = set(stage.files)
        for rel in stage.files:
            try:
                ok = rel in manifest.files and sha256_file(artifact_file(root, rel)) == manifest.files[rel]
            except OSError:
                ok = False
            if not ok:
                raise GraphkilnError(f"stage {index} file {rel} in {root} is missing or fails its sha256 check: "
                                     "copy the stage's files there again")
        for rel in graph_external_data(root, spec.file):
            if rel not in own:  # the stage reads nothing it was not given
                raise GraphkilnError(f"stage {index}'s graph reads {rel}, which is not one of its files: re-export")
        self.index, self.layers = index, stage.layers
        self.runner = open_stage_graph(root, spec, threads)
        self.vision_session = self.vision_output = None
        self.vision_runs = 0
        if index == 0 and manifest.vision is not None:  # the vision graph belongs to the first stage
            from graphkiln.runtime.backends.ort_cpu import cpu_session

            vision = manifest.graph_for("vision", "onnxruntime")
            for rel in graph_external_data(root, vision.file):
                if rel not in own:
                    raise GraphkilnError(f"stage 0's vision graph reads {rel}, which is not one of its files: re-export")
            self.vision_session = cpu_session(root, vision, threads)
            self.vision_output = next(t.name for t in vision.outputs if t.role == "image_embeddings")
        self.pool = StatePool(stage.states, numpy_dtype(manifest.states[0].dtype))
        # this stage's own copies of its layers' LoRA stacks, written by the driver's AdapterPool
        # (write_adapter_slot) and bound once; all zeros (no adapter) until then
        self.lora = _StageStacks(spec)
        if self.lora.arrays:
            self.runner.bind_adapters(self.lora)
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new process with a new id

    def info(self, expect: str | None = None) -> dict:
        """Who this is (``incarnation`` changes when Ray restarts the actor) and its pool; any
        incarnation may ask (``expect`` is not checked: this is how a restart is found out)."""
        return {"incarnation": self.incarnation, "pid": os.getpid(), "node_id": _node_id(), "spec": self.runner.spec,
                "has_next_token": self.runner.has_next_token,
                "has_hidden_states": self.runner.has_hidden_states, "slots": self.pool.slots, "live": self.pool.live,
                "nbytes": self.pool.nbytes, "layers": sorted(set(self.pool.keys) | set(self.pool.conv) | set(self.pool.recurrent)),
                "peak_rss": peak_rss(), "vision_runs": self.vision_runs}

    # Every call below names the incarnation the driver believes it talks to: a call meant for
    # the process before a restart must not run on the new one's empty pools.

    def _check(self, expect: str) -> None:
        if expect != self.incarnation:
            raise Restarted(f"stage {self.index} was restarted")

    def reserve(self, expect: str, slots: int, capacity: int) -> None:
        self._check(expect)
        self.pool.reserve(slots, capacity)

    def claim(self, expect: str) -> int:
        self._check(expect)
        return self.pool.claim()

    def release_keeping_tail(self, expect: str, slot: int, tail: int) -> list[tuple[int, int]]:
        self._check(expect)
        return self.pool.release_keeping_tail(slot, tail)

    def release_all(self, expect: str) -> None:
        """Free every slot (another stage is gone: none of these rows will run again)."""
        self._check(expect)
        while self.pool.live:
            self.pool.release(self.pool.live - 1)

    def scrub(self, expect: str, slot: int) -> None:
        self._check(expect)
        self.pool.scrub(slot)

    # cached prefix blocks (backends.prefix_store): this stage's layers' rows, under the driver's ids

    def block_bytes(self, expect: str, block_size: int) -> int:
        self._check(expect)
        return self.pool.block_bytes(block_size)

    def attach_store(self, expect: str, blocks: int, block_size: int) -> None:
        self._check(expect)
        self.pool.attach_store(blocks, block_size)

    def save_blocks(self, expect: str, slot: int, blocks, ids, snapshot) -> None:
        self._check(expect)
        self.pool.save_blocks(slot, blocks, ids, snapshot)

    def load_blocks(self, expect: str, slot: int, ids, snapshot) -> None:
        self._check(expect)
        self.pool.load_blocks(slot, ids, snapshot)

    def write_adapter_slot(self, expect: str, slot: int, rows: dict) -> None:
        """Copy the driver's rows of LoRA slot ``slot`` ({(layer, module): (A row, B row)}) into this
        stage's stacks. The driver sends them before the slot is routable, so no step reads them
        half-written."""
        self._check(expect)
        for key, (a, b) in rows.items():
            self.lora.arrays[key][0][slot], self.lora.arrays[key][1][slot] = a, b

    def run_vision(self, expect: str, feeds: dict) -> np.ndarray:
        """The vision graph over preprocessed ``feeds`` (the first stage's, ``runtime.backends.vision``)."""
        self._check(expect)
        if self.vision_session is None:
            raise RuntimeError(f"stage {self.index} has no vision graph")
        self.vision_runs += 1
        return self.vision_session.run([self.vision_output], feeds)[0]

    def run(self, expect: str, first_input, position_ids, logits_index, lengths, vision, extra, first_slot: int,
            tokens_only: bool, with_hidden: bool = False):
        self._check(expect)
        kwargs = {"with_hidden": True} if with_hidden else {}
        out = self.runner.run(self.pool, first_input, position_ids, logits_index, lengths, vision=vision,
                              extra=extra, first_slot=first_slot, tokens_only=tokens_only, **kwargs)
        # bound output buffers are reused by the next call: the object store gets its own copies
        if with_hidden:
            return tuple(np.array(a, copy=True) for a in out)
        return np.array(out, copy=True)


class _StageStacks:
    """A stage actor's LoRA stacks ({(layer, module): (A [slots, in, R], B [slots, R, out])}, zeros),
    shaped by its graph's inputs; what ``DecoderGraph.bind_adapters`` reads."""

    def __init__(self, spec) -> None:
        shapes: dict = {}
        for t in spec.inputs:
            if t.role in ("lora_a", "lora_b"):
                shapes.setdefault((t.layer, t.module), {})[t.role] = t.shape
        self.arrays = {key: (np.zeros(s["lora_a"], np.float32), np.zeros(s["lora_b"], np.float32))
                       for key, s in shapes.items()}


def _node_id() -> str | None:
    """The Ray node this process runs on (None outside a Ray worker)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except ImportError:
        return None


def peak_rss() -> int | None:
    """This process's peak resident set in bytes (Linux VmHWM; ``ru_maxrss`` would not do: it is
    carried across exec, so a worker started by a big process reports that one's peak)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
