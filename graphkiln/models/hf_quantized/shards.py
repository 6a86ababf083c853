"""The source checkpoint's safetensors shards, read one tensor at a time (``Store``). Nothing is
written: the converted checkpoint reads its tensors from here (``models.derived``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models import checkpoint_files
from graphkiln.untrusted import show

# safetensors dtypes read with plain reads (others through safetensors itself)
_TORCH_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                 "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
                 "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


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
        self.offsets: dict[Path, tuple[int, dict]] = {}  # shard -> (data start, header entries)
        for i, shard in enumerate(shards):
            f = None
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
            finally:
                del f  # no handle kept: its memory map would hold every page read until closed
            self.offsets[shard] = _data_offsets(shard)

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
        """The stored torch tensor, as it is, read into new memory with plain reads (not through
        safetensors' memory map, whose pages stay mapped, and counted, until it is closed)."""
        import torch

        shard = self.where[name]
        base, entries = self.offsets[shard]
        dtype, shape = self.headers[name]
        kind = getattr(torch, _TORCH_DTYPES[dtype], None) if dtype in _TORCH_DTYPES else None
        try:
            if kind is None:  # a dtype read through safetensors itself, its map closed after
                from safetensors import safe_open

                with safe_open(str(shard), framework="pt") as f:
                    return f.get_tensor(name).clone()
            begin, end = entries[name]["data_offsets"]
            out = torch.empty(shape, dtype=kind)
            if end - begin != out.numel() * out.element_size():
                raise ValueError(f"{end - begin} bytes for shape {list(shape)}")
            with open(shard, "rb") as f:
                f.seek(base + begin)
                got = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) if end > begin else 0
            if got != end - begin:
                raise ValueError("the file ends before the tensor")
            return out
        except Exception as exc:
            raise GraphkilnError(f"checkpoint tensor {show(name)} cannot be read from {show(shard.name)} "
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
        """Nothing is held open (every read opens its shard)."""


def _data_offsets(shard: Path) -> tuple[int, dict]:
    """A shard's (data start, header entries), its header already validated by safetensors."""
    import struct

    from graphkiln.untrusted import parse_json

    with open(shard, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = parse_json(f.read(n), f"{show(shard.name)}'s safetensors header", "re-download or re-save the checkpoint")
    return 8 + n, header
