"""Checkpoint tensors made from a quantized source each time they are read: a GGUF file or a GPTQ /
AWQ / compressed-tensors checkpoint exported without a full-precision copy of the model, in memory
or on disk (issue 36).

``export.checkpoint.prepared_checkpoint`` converts such a checkpoint into a directory holding its
small files (config.json without quantization_config, the tokenizer, the generation config) and,
for as long as its ``with`` block runs, registers a ``DerivedWeights`` for that directory
(``registered``). ``models.weights``' reader (``_open_shards``) consults it first: each tensor
transformers would load is either

- a tensor of a real safetensors file the source stores as it is (``shards``: a float tensor of
  a GPTQ checkpoint, read in place from the source's own shard, never copied), or
- a ``DerivedTensor``: float32 rows made from the source's quantized bytes when read (rows
  ``[start, stop)``: a table is made a band at a time), with, where its blocks map onto
  MatMulNBits exactly, those blocks (``models.prequantized.StoredBlocks``, made when the quantizer
  asks for them).

The converted directory holds no weight file at all: nothing of the model is written, and reading
holds one tensor (a band of a table) at a time. The registry is this process's, keyed by the
directory's real path; a directory some other process (or a user) made is never read this way, so
nothing on disk can point a read at another file.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np


# What a conversion holds besides the tensor it checks: the interpreter with torch and transformers,
# and transformers' parse of a GGUF's vocabulary for its tokenizer (measured: ~0.9 GiB peak for a
# 128k-token vocabulary on this machine).
BASE_CONVERSION_BYTES = 1 << 30
# The converted directory's files besides the weights: config, generation config, tokenizer files
# (a 128k-token tokenizer.json is ~10 MB), chat template.
SMALL_FILES_BYTES = 64 << 20


@dataclass(frozen=True)
class ConversionNeeds:
    """What converting a quantized checkpoint will take, known before anything is written: peak
    memory (bytes), bytes written into the converted directory, and the step, for messages."""

    memory: int
    disk: int
    what: str


@dataclass(frozen=True)
class DerivedTensor:
    """One float tensor made when read: ``rows(start, stop)`` gives rows ``[start, stop)`` of the
    first dimension as float32 (every dimension for a 1-D tensor), bit for bit what transformers
    loads for it."""

    shape: tuple[int, ...]
    rows: Callable[[int, int], np.ndarray]
    blocks: object = None  # models.prequantized.StoredBlocks, or None (below prequantized, which reads this)
    # bytes of temporaries making one row costs beyond its float32 output (the dequantizer's),
    # per output byte: what preflight adds to the largest tensor read
    work_factor: float = 1.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    def read(self) -> np.ndarray:
        return self.rows(0, self.shape[0]) if self.shape else self.rows(0, 1)


@dataclass
class DerivedWeights:
    """Every tensor of a converted checkpoint (see the module docstring): ``shards`` {name: the
    safetensors file holding it as stored, already checked as a regular file of the source
    checkpoint}, ``tensors`` {name: DerivedTensor}; ``default_bits`` the width most of the source's
    quantized weights had (a Q4_1 GGUF: 4), for an export without --quant; ``close`` releases the
    source's open files."""

    shards: dict[str, Path] = field(default_factory=dict)
    tensors: dict[str, DerivedTensor] = field(default_factory=dict)
    default_bits: int | None = None
    summary: str | None = None  # the conversion's one line on what it did (e.g. the blocks' error), or None
    on_close: list[Callable[[], None]] = field(default_factory=list)

    def read(self, name: str) -> np.ndarray:
        """A derived tensor, whole (tests and small tensors; the export reads through models.weights)."""
        return self.tensors[name].read()

    def blocks(self) -> dict:
        """{name: StoredBlocks} of the tensors that have blocks."""
        return {n: t.blocks for n, t in self.tensors.items() if t.blocks is not None}

    def largest_read(self) -> int:
        """The most memory reading one derived tensor whole takes: its float32 rows plus the
        dequantizer's temporaries (a table read in bands takes less)."""
        return max((int(t.nbytes * (1 + t.work_factor)) for t in self.tensors.values()), default=0)

    def close(self) -> None:
        for fn in self.on_close:
            fn()
        self.on_close.clear()


_REGISTERED: dict[str, DerivedWeights] = {}


def _key(directory: Path) -> str:
    return os.path.realpath(directory)


@contextlib.contextmanager
def registered(directory: Path, weights: DerivedWeights):
    """``weights`` are the tensors of ``directory`` while the block runs; closed after it."""
    key = _key(directory)
    _REGISTERED[key] = weights
    try:
        yield weights
    finally:
        _REGISTERED.pop(key, None)
        weights.close()


def derived_weights(directory: Path) -> DerivedWeights | None:
    """The ``DerivedWeights`` registered for ``directory``, or None (an ordinary checkpoint)."""
    return _REGISTERED.get(_key(directory)) if _REGISTERED else None


def read_exact(path: Path, offset: int, size: int, what: str) -> np.ndarray:
    """``size`` bytes of ``path`` at ``offset`` into new memory (uint8), with plain reads: not
    through a memory map, whose pages would stay mapped (and counted in the process's memory) for
    as long as the map is open."""
    from graphkiln.errors import GraphkilnError

    out = np.empty(size, np.uint8)
    with open(path, "rb") as f:
        f.seek(offset)
        got = f.readinto(memoryview(out)) if size else 0
    if got != size:
        raise GraphkilnError(f"{what} is truncated (the file changed while it was read): re-download it")
    return out
