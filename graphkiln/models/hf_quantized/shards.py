"""The source checkpoint's safetensors shards, read one tensor at a time (``Store``), and the
converted checkpoint's shards, written as transformers writes them (``ShardWriter``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models import checkpoint_files
from graphkiln.untrusted import show

# An output shard is written once it holds this many bytes (dequantized weights are float32).
SHARD_BYTES = 2 << 30


class Store:
    """The source's safetensors shards: every tensor's shard, dtype and shape from the headers
    (nothing read), tensors read one at a time."""

    def __init__(self, src: Path) -> None:
        from safetensors import safe_open

        from graphkiln.models.prequantized import PREQUANTIZED_FILE

        shards = sorted(p for p in src.glob("*.safetensors") if p.name != PREQUANTIZED_FILE)
        for shard in shards:  # safetensors opens by name (and would block on a FIFO): regular files only
            checkpoint_files.check_file(shard, src, "re-download or re-save the checkpoint")
        if not shards:
            raise GraphkilnError(f"no *.safetensors files in {show(str(src), 120)}: a GPTQ/AWQ/compressed-tensors "
                                 "checkpoint is read from safetensors only (never a pickle); re-save it with "
                                 "safe_serialization=True")
        self.where: dict[str, Path] = {}
        self.headers: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._order: dict[str, tuple[int, int]] = {}
        self.handles: dict[Path, object] = {}
        for i, shard in enumerate(shards):
            try:
                f = safe_open(str(shard), framework="pt")
                for j, name in enumerate(f.keys()):
                    if name in self.where:
                        raise GraphkilnError(f"checkpoint tensor {show(name)} is in both "
                                             f"{show(self.where[name].name)} and {show(shard.name)}: remove the "
                                             "stale shard")
                    sl = f.get_slice(name)
                    self.where[name] = shard
                    self.headers[name] = (str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
                    self._order[name] = (i, j)
            except GraphkilnError:
                raise
            except Exception as exc:  # safetensors raises several types for corrupt headers
                raise GraphkilnError(f"{show(shard.name)} is truncated or corrupt ({show(str(exc), 160)}): "
                                     "re-download or re-save the checkpoint") from None
            self.handles[shard] = f

    @property
    def names(self) -> list[str]:
        return list(self.where)

    def order(self, name: str) -> tuple[int, int]:
        return self._order[name]

    def dtype(self, name: str) -> str:
        return self.headers[name][0]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.headers[name][1]

    def tensor(self, name: str):
        """The stored torch tensor, as it is."""
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as exc:
            raise GraphkilnError(f"checkpoint tensor {show(name)} cannot be read from {show(self.where[name].name)} "
                                 f"({show(str(exc), 160)}): re-download or re-save the checkpoint") from None

    def ints(self, name: str) -> np.ndarray:
        """An integer tensor as int64 (packed int32 words keep their bit pattern: masked later)."""
        return self.tensor(name).numpy().astype(np.int64)

    def floats(self, name: str) -> np.ndarray:
        """A float tensor as float32 (fp16/bf16 scales convert exactly); non-finite values refused."""
        import torch

        t = self.tensor(name)
        a = t.to(torch.float32).numpy() if t.dtype != torch.float64 else t.numpy()
        if not np.isfinite(a).all():
            raise GraphkilnError(f"checkpoint tensor {show(name)} holds NaN or infinite values: the checkpoint is "
                                 "corrupt; re-download it or quantize it again")
        if a.dtype != np.float32:
            a = a.astype(np.float32)
            if not np.isfinite(a).all():
                raise GraphkilnError(f"checkpoint tensor {show(name)} overflows float32: the checkpoint is corrupt")
        return a

    def close(self) -> None:
        self.handles.clear()


class ShardWriter:
    """Output shards of at most ``SHARD_BYTES``: model.safetensors, or model-0000i-of-0000n with an
    index, as transformers writes them."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.pending: dict = {}
        self.bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending and self.shards:
            return
        path = self.dest / f".shard-{len(self.shards)}.safetensors.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.bytes = {}, 0

    def close(self) -> None:
        self._flush()
        n = len(self.shards)
        if n == 1:
            self.shards[0][0].rename(self.dest / "model.safetensors")
            return
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += path.stat().st_size
            path.rename(self.dest / final)
            weight_map.update({name: final for name in names})
        (self.dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
