"""Weights a checkpoint already stores quantized (a GGUF file's Q4_0/Q8_0 blocks, GPTQ/AWQ int4), kept
exactly as they are instead of being dequantized and quantized again.

A checkpoint in such a format is first converted (``graphkiln.models.gguf``,
``graphkiln.models.hf_quantized``) into an ordinary checkpoint directory whose float weights are
made from the stored ones when read (``models.derived``: nothing full-precision is written or kept),
which transformers (the reference) and the tracer read as usual, and whose blocks that map onto
onnxruntime's ``MatMulNBits`` without loss are ``StoredBlocks``: made when the quantizer asks for
them, one weight at a time. (A directory may also hold a sidecar ``PREQUANTIZED_FILE`` of blocks,
read whole: ``read_sidecar``.) The export maps them to the decoder's parameters
(``models.weights.prequantized_parameters``: a fused q/k/v or gate/up weight is quantized when all its parts are,
alike) and the quantizer (``export.lowering.quantize``) writes them instead of quantizing the float
weight: the artifact computes with the very integers the checkpoint stored, and its float weights
are bit-exact with them (``BlockQuantized.dequantize``).

Layout: a Linear weight ``W [N, K]`` (the checkpoint's ``[out, in]``) in blocks of ``block_size``
along K: ``W[n, k] = (codes[n, k] - zero_points[n, k // block]) * scales[n, k // block]``, codes
and zero points integers in ``[0, 2**bits)``. That is MatMulNBits' own arithmetic, which has integer
zero points only (it takes float zero points too, but its CPU kernel then runs ~60x slower,
measured): a format whose blocks carry a float offset (GGUF Q4_1, Q4_K) does not map, and is
dequantized and quantized per ``--quant`` instead.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.untrusted import parse_json, show

PREQUANTIZED_FILE = "graphkiln-prequantized.safetensors"
# The sidecar's metadata key holding {tensor name: {"bits": b, "block_size": n, "format": "..."}}
_META_KEY = "graphkiln.prequantized"


@dataclass(frozen=True)
class BlockQuantized:
    """One ``[N, K]`` Linear weight as integer codes in blocks along K (see the module docstring).

    ``format`` names where the blocks came from ("gguf:Q4_0", "gptq", ...), for reports only.
    """

    codes: np.ndarray  # uint8 [N, K], values < 2**bits
    scales: np.ndarray  # float32 [N, ceil(K / block_size)]
    zero_points: np.ndarray  # uint8 [N, ceil(K / block_size)], values < 2**bits
    bits: int
    block_size: int
    format: str = ""

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        blocks = (k + self.block_size - 1) // self.block_size
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        if self.codes.dtype != np.uint8 or self.zero_points.dtype != np.uint8:
            raise ValueError("codes and zero points must be uint8")
        if self.scales.shape != (n, blocks) or self.zero_points.shape != (n, blocks):
            raise ValueError(f"scales {self.scales.shape} / zero points {self.zero_points.shape} do not match "
                             f"codes {self.codes.shape} in blocks of {self.block_size}")
        limit = 1 << self.bits
        if self.codes.size and (int(self.codes.max()) >= limit or int(self.zero_points.max()) >= limit):
            raise ValueError(f"codes or zero points do not fit in {self.bits} bits")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def centered(self) -> bool:
        """Every zero point is the midpoint ``2**(bits-1)`` (MatMulNBits' implicit zero point)."""
        return bool((self.zero_points == 1 << (self.bits - 1)).all())

    def load(self) -> "BlockQuantized":
        """The blocks themselves (``StoredBlocks.load``'s counterpart)."""
        return self

    def dequantize(self) -> np.ndarray:
        """The float32 ``[N, K]`` weight these blocks stand for (what the float checkpoint holds)."""
        n, k = self.codes.shape
        expand = lambda a: np.repeat(a, self.block_size, axis=1)[:, :k]  # noqa: E731
        return ((self.codes.astype(np.float32) - expand(self.zero_points).astype(np.float32))
                * expand(self.scales.astype(np.float32)))


@dataclass(frozen=True)
class StoredBlocks:
    """A weight's blocks as a converted checkpoint stores them (``models.derived``): what the
    quantizer plans with (bits, block size, shape, whether every zero point is the midpoint), the
    codes themselves made by ``make`` only when asked for (``load``), and not kept: a model's blocks
    are never all in memory at once."""

    shape: tuple[int, int]
    bits: int
    block_size: int
    format: str
    centered: bool
    make: object  # () -> BlockQuantized

    def load(self) -> BlockQuantized:
        b = self.make()
        if (b.shape, b.bits, b.block_size, b.centered) != (tuple(self.shape), self.bits, self.block_size,
                                                            self.centered):
            raise GraphkilnError(f"the stored blocks of a {self.format} weight changed while the export read them "
                                 f"({b.shape} {b.bits}-bit, planned {tuple(self.shape)} {self.bits}-bit): leave the "
                                 "checkpoint unchanged while it is exported")
        return b


def concat_rows(parts: list) -> "BlockQuantized | StoredBlocks | None":
    """Blocks of a weight fused from ``parts`` along N (q/k/v, gate/up), or None when they are not
    alike (bits, block size, K) and the fused weight must be quantized from its floats. Parts that
    are ``StoredBlocks`` give ``StoredBlocks`` (concatenated when loaded)."""
    first = parts[0]
    if any((p.bits, p.block_size, p.shape[1]) != (first.bits, first.block_size, first.shape[1]) for p in parts):
        return None
    if len(parts) == 1:
        return first
    if any(isinstance(p, StoredBlocks) for p in parts):
        return StoredBlocks((sum(p.shape[0] for p in parts), first.shape[1]), first.bits, first.block_size,
                            "+".join(sorted({p.format for p in parts})), all(p.centered for p in parts),
                            lambda: concat_rows([p.load() for p in parts]))
    formats = sorted({p.format for p in parts})
    return BlockQuantized(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                          np.concatenate([p.zero_points for p in parts]), first.bits, first.block_size,
                          "+".join(formats))


_DEFAULT_BITS_KEY = "graphkiln.default_bits"


def write_sidecar(directory: Path, blocks: dict[str, BlockQuantized], default_bits: int | None = None) -> None:
    """Write ``blocks`` (checkpoint tensor name -> blocks) into ``directory / PREQUANTIZED_FILE``.
    ``default_bits``: the width most of the checkpoint's quantized weights had, mapped or not (a Q4_1
    GGUF: 4), which an export without ``--quant`` uses for the weights that have no blocks here."""
    from safetensors.numpy import save_file

    tensors, meta = {}, {}
    for name, b in blocks.items():
        tensors[f"{name}.codes"] = np.ascontiguousarray(b.codes)
        tensors[f"{name}.scales"] = np.ascontiguousarray(b.scales.astype(np.float32))
        tensors[f"{name}.zero_points"] = np.ascontiguousarray(b.zero_points)
        meta[name] = {"bits": b.bits, "block_size": b.block_size, "format": b.format}
    extra = {_DEFAULT_BITS_KEY: str(default_bits)} if default_bits in (4, 8) else {}
    save_file(tensors, str(directory / PREQUANTIZED_FILE), metadata={_META_KEY: json.dumps(meta), **extra})


def sidecar_default_bits(directory: Path) -> int | None:
    """The ``default_bits`` the converter recorded (``models.derived``, or ``write_sidecar``), or None."""
    from graphkiln.models.derived import derived_weights

    derived = derived_weights(directory)
    if derived is not None:
        return derived.default_bits
    path = directory / PREQUANTIZED_FILE
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            value = (f.metadata() or {}).get(_DEFAULT_BITS_KEY)
    except (OSError, ValueError, SafetensorError) as exc:
        raise _malformed(path, exc) from None
    return int(value) if value in ("4", "8") else None


def _malformed(path: Path, exc: BaseException | str) -> GraphkilnError:
    return GraphkilnError(f"{show(str(path), 120)} is malformed ({show(str(exc), 160)}): delete it, or convert the "
                          "checkpoint again")


def read_sidecar(directory: Path) -> dict[str, BlockQuantized]:
    """The sidecar's blocks by checkpoint tensor name; {} when the directory has none. The sidecar is
    written by graphkiln's own conversion into a directory it created, but it is checked like any
    checkpoint file: a malformed one is one error line."""
    path = directory / PREQUANTIZED_FILE
    if not path.is_file():
        return {}
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="numpy") as f:
            meta = parse_json((f.metadata() or {})[_META_KEY], f"{show(str(path), 120)}'s metadata",
                              "delete it, or convert the checkpoint again")
            if not isinstance(meta, dict):
                raise _malformed(path, "its metadata is not a JSON object")
            out = {}
            for name, info in meta.items():
                out[name] = BlockQuantized(f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"),
                                           f.get_tensor(f"{name}.zero_points"), int(info["bits"]),
                                           int(info["block_size"]), str(info.get("format", "")))
            return out
    except (KeyError, ValueError, TypeError, AttributeError, OSError, SafetensorError) as exc:
        raise _malformed(path, exc) from None
