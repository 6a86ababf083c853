"""MXFP4 experts as the Hub stores gpt-oss, read directly and streamed (never converted, never
expanded to float as a whole).

Layout (transformers' ``integrations/mxfp4.py``): an expert tensor ``W [E, out, in]`` is two
uint8 tensors, ``<name>_blocks [E, out, in / 32, 16]`` (32 E2M1 codes per block, two a byte, the
low nibble the even element) and ``<name>_scales [E, out, in / 32]`` (E8M0: the block's power of
two is ``scale - 127``). An E2M1 code's bit 3 is the sign, bits 0-2 index the magnitudes
``0, .5, 1, 1.5, 2, 3, 4, 6``; so ``W[e, o, i] = e2m1 * 2 ** (scale - 127)``, and twice an E2M1
value is an integer in ``[-12, 12]``: ``W = halves * 2 ** (scale - 128)`` with ``halves`` integers.
gpt-oss's ``gate_up_proj`` has ``out = 2I`` rows with gate and up alternating (g0, u0, g1, ...),
``down_proj`` ``out = H``.

Two readers:

* ``Mxfp4Experts``, a weight ``Source`` (``models.sources``) the gpt-oss family offers beside the
  float layout: read as float (the calibration pass, the whole-model path) one expert at a time
  into the decoder's layout (gate rows then up rows). It checks its own headers (``check_shape``)
  and reads integers (``reads_integers``), which ``models.weights`` asks of a source.
* ``expert_codes`` / ``requantize``: one expert's blocks straight from the shard, turned into
  onnxruntime ``QMoE`` int8 or int4 blocks of 32 (``export.lowering.ort_moe``), one expert at a
  time, as the data file is written.

int8: the codes are ``halves + 128`` with scale ``2 ** (scale - 128)``: exact. int4 (codes -8..7)
holds 15 of E2M1's values per block only approximately: each block gets the step among
``STEPS_INT4`` (in halves) with the least squared error against its MXFP4 values.

The checkpoint is untrusted: ``check_checkpoint`` (before anything is written) refuses a blocks
tensor without its scales or scales without blocks, a wrong dtype or shape, and scales out of
range (255 is E8M0's NaN; above 252 a block's largest value overflows float32), each as one line.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np

from graphkiln.errors import GraphkilnError

QUANT_METHOD = "mxfp4"
BLOCK = 32  # E2M1 codes per scale
BLOCK_BYTES = BLOCK // 2
MAX_SCALE = 252  # 6 * 2 ** (252 - 127) is finite in float32; 253 would overflow (255 is NaN)
# twice each E2M1 code's value (code bit 3: sign), an integer: int8 holds it exactly
HALVES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int8)
# int4 steps tried per block, in halves: 1 (exact up to 3.5, -4), 12/7 (6 -> 7), 1.5 (-6 -> -8, 6 -> 7 * 1.5),
# 1.25 and 2 (exact 0, 1, 2, 3, 4, 6 except 1.5 and .5)
STEPS_INT4 = (1.0, 1.25, 1.5, 12.0 / 7.0, 2.0)
FIX = "re-download or re-save the checkpoint (MXFP4 experts: uint8 *_blocks [E, out, in/32, 16] and *_scales [E, out, in/32])"


def is_mxfp4(raw: dict) -> bool:
    """Whether config.json declares MXFP4 weights (``quantization_config.quant_method: "mxfp4"``)."""
    qc = raw.get("quantization_config")
    return isinstance(qc, dict) and qc.get("quant_method") == QUANT_METHOD


# --------------------------------------------------------------------------- the weight source


@dataclass(frozen=True)
class Mxfp4Experts:
    """A stacked expert weight ``[E, out, in]`` stored as MXFP4 ``parts = (blocks, scales)``;
    ``deinterleave``: its rows alternate two parts (gpt-oss's gate/up), read as part 0's rows then
    part 1's (the decoder's gate_up layout)."""

    parts: tuple
    deinterleave: bool = False
    reads_integers: ClassVar[bool] = True  # models.weights: its tensors are uint8, checked here

    def check_shape(self, reader, expected: tuple[int, ...], param: str) -> None:
        """The headers against the float shape config.json implies (``expected``)."""
        blocks, scales = self.parts
        e, out, k = expected
        if k % BLOCK:
            raise GraphkilnError(f"{param}: MXFP4 experts need in-features divisible by {BLOCK}, config.json implies "
                                 f"{k}: fix config.json or {FIX}")
        want = {blocks: (e, out, k // BLOCK, BLOCK_BYTES), scales: (e, out, k // BLOCK)}
        for name, shape in want.items():
            h = reader.header(name)
            if h["dtype"] != "U8":
                raise GraphkilnError(f"MXFP4 tensor '{name}' is stored as {h['dtype']}, not U8: {FIX}")
            if tuple(h["shape"]) != shape:
                raise GraphkilnError(f"MXFP4 tensor '{name}' has shape {tuple(h['shape'])} but config.json implies "
                                     f"{shape}: {FIX}")

    def read_from(self, reader):
        """The float32 ``[E, out, in]`` weight, in the decoder's row order, one expert at a time."""
        import torch

        blocks, scales = self.parts
        e, out, nb, _ = reader.header(blocks)["shape"]
        result = torch.empty((e, out, nb * BLOCK), dtype=torch.float32)
        view = result.numpy()
        for i in range(e):
            w = dequantize(*expert_codes(reader, blocks, scales, i))
            if self.deinterleave:
                w = np.concatenate([w[0::2], w[1::2]])
            view[i] = w
        return result


def experts_source(blocks: str, scales: str, deinterleave: bool = False) -> Mxfp4Experts:
    return Mxfp4Experts((blocks, scales), deinterleave)


# --------------------------------------------------------------------------- reading one expert


def _raw(reader, name: str, index: int) -> np.ndarray:
    """Element ``index`` of the first axis of uint8 tensor ``name``, read from its shard."""
    h = reader.header(name)
    shard = reader.where[name]
    base = reader.headers[shard][0]
    begin, end = h["data_offsets"]
    shape = tuple(h["shape"])
    per = int(np.prod(shape[1:], dtype=np.int64))
    if end - begin != per * shape[0]:
        raise GraphkilnError(f"{shard.name}: MXFP4 tensor '{name}' has {end - begin} bytes for shape {list(shape)}: {FIX}")
    out = np.empty(shape[1:], dtype=np.uint8)
    with open(shard, "rb") as f:
        f.seek(base + begin + index * per)
        got = f.readinto(memoryview(out.reshape(-1)))
    if got != per:
        raise GraphkilnError(f"{shard.name} is truncated reading '{name}': {FIX}")
    return out


def expert_codes(reader, blocks: str, scales: str, index: int) -> tuple[np.ndarray, np.ndarray]:
    """Expert ``index``: (halves int8 [out, in], scales uint8 [out, in / 32]) with scales checked."""
    b = _raw(reader, blocks, index)
    s = _raw(reader, scales, index)
    check_scales(s, scales)
    halves = np.empty((*b.shape[:-1], BLOCK), dtype=np.int8)
    halves[..., 0::2] = HALVES[b & 0x0F]
    halves[..., 1::2] = HALVES[b >> 4]
    return halves.reshape(b.shape[0], -1), s


def check_scales(s: np.ndarray, name: str) -> None:
    if s.size and int(s.max()) > MAX_SCALE:
        raise GraphkilnError(f"MXFP4 scales '{name}' hold {int(s.max())}, out of range (at most {MAX_SCALE}; 255 is "
                             f"NaN): {FIX}")


def dequantize(halves: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[out, in]``: halves * 2 ** (scale - 128), exact."""
    exp = np.repeat(scales.astype(np.int32) - 128, BLOCK, axis=1)
    return np.ldexp(halves.astype(np.float32), exp)


# --------------------------------------------------------------------------- QMoE blocks


def requantize(halves: np.ndarray, scales: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """One expert's MXFP4 weight ``[N, K]`` as QMoE blocks of 32 along K with the default zero
    point: (packed uint8 [N, K * bits / 8], float32 scales [N, K / 32])."""
    n, k = halves.shape
    unit = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 128)  # [N, K/32], one half's value
    if bits == 8:
        return (halves.astype(np.int16) + 128).astype(np.uint8), unit.astype(np.float32)
    if bits != 4:
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    # A block's squared error for a step depends only on how many of each value it holds: count the
    # 25 values (halves -12..12) per block, price every step from a table, take the cheapest.
    blocks = n * (k // BLOCK)
    v = halves.reshape(blocks, BLOCK).astype(np.int64) + 12
    counts = np.bincount((np.arange(blocks, dtype=np.int64)[:, None] * 25 + v).ravel(),
                         minlength=blocks * 25).reshape(blocks, 25).astype(np.float32)
    best = (counts @ _INT4_ERR).argmin(axis=1)  # ties: the earlier (smaller) step
    u = _INT4_CODES[best[:, None], v].reshape(n, k)
    steps = np.asarray(STEPS_INT4, np.float32)[best].reshape(n, k // BLOCK)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8), (unit * steps).astype(np.float32)


def _int4_tables() -> tuple[np.ndarray, np.ndarray]:
    """For the values -12..12 (halves) and each step: the squared error [25, steps] and the int4
    code (q + 8) [steps, 25] of rounding to the nearest multiple of the step within -8..7."""
    vals = np.arange(-12, 13, dtype=np.float32)
    steps = np.asarray(STEPS_INT4, np.float32)
    q = np.clip(np.rint(vals[None, :] / steps[:, None]), -8, 7)
    return np.square(q * steps[:, None] - vals[None, :]).T.copy(), (q + 8).astype(np.uint8)


_INT4_ERR, _INT4_CODES = _int4_tables()


def requantized_values(packed: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """float32 ``[N, K]`` the QMoE blocks stand for (what the kernel computes with)."""
    if bits == 8:
        codes = packed.astype(np.float32) - 128
    else:
        codes = np.empty((packed.shape[0], packed.shape[1] * 2), np.float32)
        codes[:, 0::2] = packed & 0x0F
        codes[:, 1::2] = packed >> 4
        codes -= 8
    return codes * np.repeat(scales, BLOCK, axis=1)


class RequantizedExperts:
    """One layer's expert weight as QMoE tensors, made on demand one expert at a time: ``weights()``
    ``[E, N, K * bits / 8]`` uint8 and ``scales()`` ``[E, N, K / 32]`` (``dtype``). Both come from one
    pass (int4 chooses each block's step); the pass's result is kept until both were taken, so a
    layer's tensors are made once, whichever is written first."""

    def __init__(self, reader, source: Mxfp4Experts, bits: int, dtype) -> None:
        self.reader, self.source, self.bits, self.dtype = reader, source, bits, np.dtype(dtype)
        blocks, _ = source.parts
        e, n, nb, _ = reader.header(blocks)["shape"]
        self.shape = (e, n, nb * BLOCK)
        self._made: dict[str, np.ndarray] = {}

    def _make(self) -> None:
        e, n, k = self.shape
        q = np.empty((e, n, k * self.bits // 8), np.uint8)
        s = np.empty((e, n, k // BLOCK), self.dtype)
        blocks, scales = self.source.parts
        for i in range(e):
            qi, si = requantize(*expert_codes(self.reader, blocks, scales, i), self.bits)
            q[i] = qi
            s[i] = si.astype(self.dtype)
            if self.dtype != np.float32 and not np.array_equal(s[i].astype(np.float32), si):
                raise GraphkilnError(f"MXFP4 scales '{scales}' fall outside float16's range: export with --dtype fp32")
        self._made = {"weights": q, "scales": s}

    def _take(self, which: str) -> np.ndarray:
        if which not in self._made:
            self._make()
        return self._made.pop(which)

    def weights(self) -> np.ndarray:
        return self._take("weights")

    def scales(self) -> np.ndarray:
        return self._take("scales")


def requantized_source(weights, param: str) -> Mxfp4Experts | None:
    """The MXFP4 source of a decoder parameter read through ``CheckpointWeights`` (None: not MXFP4)."""
    src = getattr(weights, "sources", {}).get(param)
    return src if isinstance(src, Mxfp4Experts) else None


# --------------------------------------------------------------------------- checkpoint and options

_PAIR = re.compile(r"^(.*)_(blocks|scales)$")


def check_checkpoint(src: Path) -> None:
    """An MXFP4 checkpoint's pairs, before anything is written: every ``*_blocks`` has its
    ``*_scales`` and the reverse, uint8 both, shapes that agree, scales in range (read whole: they
    are 1/16 of the experts' bytes). One ``GraphkilnError`` line for the first problem."""
    from graphkiln.models.weights import _open_shards, _Reader

    reader = _Reader(_open_shards(Path(src)))
    try:
        pairs: dict[str, dict[str, str]] = {}
        for name in reader.where:
            m = _PAIR.match(name)
            if m:
                pairs.setdefault(m.group(1), {})[m.group(2)] = name
        if not pairs:
            raise GraphkilnError("config.json declares MXFP4 weights (quant_method 'mxfp4') but the checkpoint holds no "
                                 f"*_blocks/*_scales tensors: {FIX}")
        for stem, pair in sorted(pairs.items()):
            for half, other in (("blocks", "scales"), ("scales", "blocks")):
                if half in pair and other not in pair:
                    raise GraphkilnError(f"MXFP4 tensor '{pair[half]}' has no '{stem}_{other}' beside it: {FIX}")
            hb, hs = reader.header(pair["blocks"]), reader.header(pair["scales"])
            for name, h in ((pair["blocks"], hb), (pair["scales"], hs)):
                if h["dtype"] != "U8":
                    raise GraphkilnError(f"MXFP4 tensor '{name}' is stored as {h['dtype']}, not U8: {FIX}")
            if len(hb["shape"]) < 2 or hb["shape"][-1] != BLOCK_BYTES or list(hb["shape"][:-1]) != list(hs["shape"]):
                raise GraphkilnError(f"MXFP4 tensors '{pair['blocks']}' {tuple(hb['shape'])} and '{pair['scales']}' "
                                     f"{tuple(hs['shape'])} do not pair (blocks [..., n, {BLOCK_BYTES}], scales "
                                     f"[..., n]): {FIX}")
            count = int(np.prod(hs["shape"], dtype=np.int64))
            shard = reader.where[pair["scales"]]
            begin, end = hs["data_offsets"]
            if end - begin != count:
                raise GraphkilnError(f"{shard.name}: MXFP4 tensor '{pair['scales']}' has {end - begin} bytes for shape "
                                     f"{list(hs['shape'])}: {FIX}")
            reader.header(pair["scales"])
            with open(shard, "rb") as f:
                f.seek(reader.headers[shard][0] + begin)
                data = np.frombuffer(f.read(count), np.uint8)
            if data.size != count:
                raise GraphkilnError(f"{shard.name} is truncated reading '{pair['scales']}': {FIX}")
            check_scales(data, pair["scales"])
    finally:
        reader.close()


def export_quant(quant: str | None, expert_quant: str | None, targets: tuple[str, ...], dtype: str,
                 say=lambda msg: None) -> tuple[str | None, str]:
    """(``--quant``, ``--expert-quant``) an MXFP4 checkpoint exports with: its experts become
    onnxruntime ``QMoE`` blocks of ``expert_quant`` (int8 exact, int4 approximate; default
    ``quant``'s width), the other Linear layers follow ``--quant`` as usual. With neither, both are
    int4 (a quantized checkpoint stays quantized; gpt-oss-20b then loads in ~11 GiB). Other targets
    and bf16 are refused: they would hold the experts in float (docs/quantization.md)."""
    if targets != ("onnxruntime",):
        raise GraphkilnError(f"MXFP4 checkpoints export to --target onnxruntime only for now (asked: {','.join(targets)}; "
                             "the tensorrt target's MXFP4 plugin is not written): use --target onnxruntime")
    if dtype not in ("fp32", "fp16"):
        raise GraphkilnError(f"MXFP4 checkpoints export with --dtype fp32 or fp16 (onnxruntime's QMoE has no CPU "
                             f"kernel for {dtype}): use --dtype fp32")
    if quant is None and expert_quant is None:
        say("      the checkpoint stores MXFP4 experts: exporting as --quant int4 (experts as int4 QMoE blocks; "
            "--expert-quant int8 keeps them exact)")
        return "int4", "int4"
    if quant == "none":
        quant = None
    return quant, expert_quant or quant or "int4"
