"""FP8 weights (e4m3, or e5m2) with float scales over tiles of the weight, as three writers store
them, converted into MatMulNBits int8 blocks chosen on conversion (the default; at ``--quant int4``
the export quantizes the stored values itself, calibrated: int4 cannot hold FP8 values).

* ``quant_method: fp8`` (DeepSeek-V3, Qwen3-*-FP8; transformers' finegrained_fp8): ``weight``
  F8_E4M3 ``[N, K]`` and ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` for ``weight_block_size:
  [bn, bk]`` (``null``: one scale); ``W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]``
  (despite its name the scale multiplies, as transformers' ``Fp8Dequantize`` does).
* compressed-tensors ``float-quantized`` (llm-compressor's FP8 / FP8_DYNAMIC): ``weight`` F8 and
  ``weight_scale`` per tensor (``[]``/``[1]``), per channel (``[N, 1]``), per group (``[N, K/g]``)
  or per block (``[ceil(N/bn), ceil(K/bk)]``, ``block_structure``); ``W = weight * weight_scale``.
* ModelOpt ``quant_algo: FP8`` (``hf_quant_config.json`` or ``quant_method: modelopt``): ``weight``
  F8 and a per-tensor ``weight_scale``.

All three are one ``FP8`` layout over a per-module tile ``(bn, bk)`` (per tensor: ``(N, K)``; per
channel: ``(1, K)``). The activation scheme (dynamic per token, or a static ``input_scale``) and
an FP8 KV cache's ``k_scale``/``v_scale`` are not honoured: the artifact is weight-only, its
activations float, i.e. the model transformers computes with ``dequantize=True`` on a CPU. Those
scales are checked (float scalars) and dropped.

The integer blocks (``nearest_blocks``): FP8 values share a scale per tile, not a step, so a block
of them is exactly integer codes only when its values' exponents are close: each block takes the
largest power of two dividing all its values as its step when the codes then fit (exact: the
dequantized block is bit-identical to ``weight * scale`` in float32), else round to nearest with
the block's peak at the end code. The float checkpoint holds ``weight * scale`` itself (what the
reference and a ``--quant none`` artifact compute with); ``summary`` reports the blocks' error
against it. Everything runs one module at a time, in bands of rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.layout import FLOAT_DTYPES, Layout, make_blocks, read_bits, read_names, refuse
from graphkiln.models.hf_quantized.patterns import MatchBudget, Targets, refuse_not_converted
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
DEFAULT_BLOCK = 32  # MatMulNBits blocks along K when --quant-block-size is not given (graphkiln's default)
BAND_ROWS = 256  # rows converted at a time: a module's temporaries stay a few bands of [256, K] floats
# Tensors of activation / KV-cache quantization the weight-only artifact does not use (scalars).
DROPPED_SCALES = ("input_scale", "output_scale", "k_scale", "v_scale")
_FIX_CONFIG = "fix quantization_config in config.json"
REQUANTIZED = ("{what}: {n} weights' stored values quantized to int4 by the export's own quantizer "
               "(--quant-method; int4 blocks cannot hold them exactly)")


@dataclass
class BlockError:
    """The converted blocks against the values the checkpoint stores, over every module."""

    modules: int = 0
    blocks: int = 0
    exact: int = 0
    err2: float = 0.0
    ref2: float = 0.0
    worst: float = 0.0  # the largest |error| over the block's peak |value|

    def line(self, what: str, bits: int, block: int) -> str:
        rel = math.sqrt(self.err2 / self.ref2) if self.ref2 > 0 else 0.0
        if self.exact == self.blocks:
            return (f"{what}: {self.modules} weights into int{bits} blocks of {block}, every block exact")
        return (f"{what}: {self.modules} weights into int{bits} blocks of {block}: {self.exact:,} of {self.blocks:,} "
                f"blocks exact, the rest rounded to nearest; error against the stored values: relative RMS "
                f"{rel:.2e}, worst {self.worst:.2e} of a block's peak")


def nearest_blocks(values: np.ndarray, scale: np.ndarray | None, bits: int, block: int, few_bits: bool,
                   stats: BlockError) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric integer blocks along K for ``values`` ``[R, K]`` (float32) times ``scale`` ``[R,
    G]`` (each block's one stored scale; None: 1). ``few_bits``: the values have at most 4
    significant bits (FP8, E2M1 values), so a power-of-two step that divides all of a block's values
    exists; where its codes fit the block is exact, else it is rounded to nearest (the block's peak
    at the end code). Returns codes ``uint8 [R, K]`` (value + 2**(bits-1)) and scales ``float32 [R,
    G]``; adds the error to ``stats``."""
    qmax = (1 << (bits - 1)) - 1
    rows, k = values.shape
    groups = -(-k // block)
    v = np.zeros((rows, groups * block), np.float32)
    v[:, :k] = values
    v = v.reshape(rows, groups, block)
    peak = np.abs(v).max(-1)
    step = peak / qmax
    exact = np.zeros(peak.shape, bool)
    if few_bits:
        mant, exp = np.frexp(v)  # v = mant * 2**exp, 0.5 <= |mant| < 1: 4 significant bits make mant * 16 whole
        whole = np.abs(mant * 16).astype(np.int64)
        lowest = np.where(whole > 0, whole & -whole, 1)  # the lowest set bit: 1, 2, 4 or 8
        low = np.where(whole > 0, exp - 4 + np.log2(lowest).astype(np.int64), 1 << 20).min(-1)
        pow2 = np.ldexp(np.float32(1), np.minimum(low, 126)).astype(np.float32)
        exact = (peak > 0) & (peak <= qmax * pow2)
        step = np.where(exact, pow2, step)
    step = np.where(peak > 0, step, 1.0).astype(np.float32)
    codes = np.clip(np.rint(v / step[..., None]), -qmax - 1, qmax)
    diff = codes * step[..., None] - v
    sc = np.ones(peak.shape, np.float32) if scale is None else scale.astype(np.float32)
    stats.blocks += peak.size
    stats.exact += int((exact | (peak == 0) | (np.abs(diff).max(-1) == 0)).sum())
    stats.err2 += float(((diff * sc[..., None]) ** 2).sum(dtype=np.float64))
    stats.ref2 += float(((v * sc[..., None]) ** 2).sum(dtype=np.float64))
    worst = np.abs(diff).max(-1) / np.where(peak > 0, peak, 1)
    stats.worst = max(stats.worst, float(worst.max()) if worst.size else 0.0)
    codes = (codes.reshape(rows, groups * block)[:, :k] + (qmax + 1)).astype(np.uint8)
    return codes, (step * sc).astype(np.float32)


def read_positive_scales(store: Store, name: str, method: str) -> np.ndarray:
    """A scale tensor as float32: finite (``Store.floats``) and not negative, else one line."""
    s = store.floats(name)
    if (s < 0).any():
        raise GraphkilnError(f"checkpoint tensor {show(name)} holds negative scales ({float(s.min()):g}): {method} "
                             "scales are positive; the checkpoint is corrupt; re-download it")
    return s


def float_quantized(qc: dict) -> bool:
    """Whether a compressed-tensors quantization_config stores FP8 weights (format
    ``float-quantized``, per config group or overall); a mix with other formats is one line."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        return False  # CompressedTensors refuses it
    formats = {(g.get("format") if isinstance(g, dict) else None) or qc.get("format") for g in groups.values()}
    if "float-quantized" not in formats:
        return False
    if len(formats) > 1:
        raise refuse("compressed-tensors", f"config groups mix formats {show(sorted(map(str, formats)))}: graphkiln "
                                           "converts one format per checkpoint")
    return True


@dataclass(frozen=True)
class Tile:
    """One scale per ``rows`` x ``cols`` tile of a weight (None: the whole extent), and its role."""

    rows: int | None
    cols: int | None
    role: str
    shown: str  # for messages: "block [128, 128]", "channel", "tensor"


class FP8(Layout):
    """FP8 weights and their tile scales (see the module docstring)."""

    anchor = "weight"

    def __init__(self, method: str, tiles: list[tuple[Targets | None, Tile]], not_converted: list[str],
                 not_converted_key: str, drops_scales: bool, fmt: str) -> None:
        self.method = method
        self.tiles = tiles  # (targets or None for every module, tile); one per config group
        self.scale_roles = tuple(sorted({t.role for _, t in tiles}))
        self.roles = ("weight", *self.scale_roles)
        self.not_converted, self.not_converted_key = not_converted, not_converted_key
        self.drops_scales = drops_scales
        self.format = fmt
        self.bits, self.block = 8, DEFAULT_BLOCK
        self.stats = BlockError()
        self.counted: set[str] = set()

    # -- quantization_config readers (one per writer) --
    @classmethod
    def from_fp8_config(cls, qc: dict) -> FP8:
        """``quant_method: fp8`` (transformers' FineGrainedFP8Config)."""
        m = "fp8"
        fmt = qc.get("fmt", "e4m3")
        if fmt not in ("e4m3", "e5m2", None):
            raise refuse(m, f"fmt {show(fmt)} is not an FP8 format graphkiln reads (e4m3, e5m2)", _FIX_CONFIG)
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static", None):
            raise refuse(m, f"activation_scheme {show(scheme)} is not dynamic or static", _FIX_CONFIG)
        size = qc.get("weight_block_size")
        if size is None:
            tile = Tile(None, None, "weight_scale_inv", "tensor")
        else:
            if (not isinstance(size, list) or len(size) != 2
                    or not all(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 20 for v in size)):
                raise refuse(m, f"weight_block_size {show(size)} is not two positive integers", _FIX_CONFIG)
            tile = Tile(size[0], size[1], "weight_scale_inv", f"block {size}")
        names = read_names(m, qc.get("modules_to_not_convert"), "modules_to_not_convert")
        return cls(m, [(None, tile)], names, "modules_to_not_convert", True, f"fp8:{fmt or 'e4m3'}")

    @classmethod
    def from_modelopt(cls, qc: dict) -> FP8:
        """ModelOpt ``quant_algo: FP8`` (per-tensor weight scale, static per-tensor input scale)."""
        names = read_names("modelopt", qc.get("exclude_modules", qc.get("ignore")), "exclude_modules")
        return cls("modelopt", [(None, Tile(None, None, "weight_scale", "tensor"))], names, "exclude_modules",
                   True, "modelopt:fp8")

    @classmethod
    def from_compressed_tensors(cls, qc: dict) -> FP8:
        """compressed-tensors ``float-quantized`` config groups (8-bit float weights)."""
        m = "compressed-tensors"
        for key in ("sparsity_config", "transform_config"):
            if qc.get(key):
                raise refuse(m, f"{show(key)} is set: graphkiln converts weight quantization and cannot honor it")
        budget = MatchBudget()
        tiles = []
        for gname, group in qc["config_groups"].items():
            w = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(w, dict):
                raise refuse(m, f"config group {show(gname)} has no 'weights' scheme", _FIX_CONFIG)
            if w.get("type") != "float":
                raise refuse(m, f"config group {show(gname)} of a float-quantized checkpoint quantizes weights as "
                                f"{show(w.get('type'))}, not float", _FIX_CONFIG)
            read_bits(m, w.get("num_bits"), (8,))
            if w.get("dynamic"):
                raise refuse(m, f"config group {show(gname)} quantizes weights dynamically (no stored scales)",
                             _FIX_CONFIG)
            if w.get("symmetric", True) is not True:
                raise refuse(m, f"config group {show(gname)} has asymmetric FP8 weights (zero points), which no "
                                "FP8 writer stores; graphkiln reads symmetric ones")
            strategy, gs = w.get("strategy"), w.get("group_size")
            if strategy == "tensor":
                tile = Tile(None, None, "weight_scale", "tensor")
            elif strategy == "channel":
                tile = Tile(1, None, "weight_scale", "channel")
            elif strategy == "group" and isinstance(gs, int) and not isinstance(gs, bool) and gs > 0:
                tile = Tile(1, gs, "weight_scale", f"group {gs}")
            elif strategy == "block":
                bs = w.get("block_structure")
                if (not isinstance(bs, list) or len(bs) != 2
                        or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in bs)):
                    raise refuse(m, f"config group {show(gname)}: block_structure {show(bs)} is not two positive "
                                    "integers", _FIX_CONFIG)
                tile = Tile(bs[0], bs[1], "weight_scale", f"block {bs}")
            else:
                raise refuse(m, f"config group {show(gname)}: FP8 strategy {show(strategy)} (group size "
                                f"{show(gs)}) is not one graphkiln reads (tensor, channel, group, block)")
            key = f"config_groups.{gname}.targets"
            tiles.append((Targets(m, key, read_names(m, group.get("targets"), key), budget), tile))
        ignore = read_names(m, qc.get("ignore"), "ignore")
        layout = cls(m, tiles, [], "ignore", True, "compressed-tensors:float-quantized")
        layout.ignore = Targets(m, "ignore", ignore, budget)
        return layout

    # -- Layout --
    def request(self, bits: int | None, block_size: int | None) -> None:
        # int4 cannot hold FP8 values: the export's own (calibrated) quantizer takes the stored values
        # (measured on SmolLM2: 1.11x the FP8 model's perplexity, against 1.27x for int4 blocks chosen
        # here); the conversion's blocks then only check the values, as int8
        self.offers_blocks = bits != 4
        self.bits = 8
        self.block = block_size or DEFAULT_BLOCK

    def plan(self, store: Store) -> tuple[dict[str, dict[str, str]], list[str]]:
        """Quantized modules: each ``<module>.weight`` stored as FP8, with its scale beside it."""
        modules: dict[str, dict[str, str]] = {}
        claimed = set()
        for name in store.names:
            module, _, role = name.rpartition(".")
            if role in self.scale_roles:
                weight = f"{module}.weight"
                if weight not in store.where:
                    raise GraphkilnError(f"checkpoint tensor {show(name)} has no {show(weight)} beside it ({self.method} "
                                         f"FP8, {self.format}): the checkpoint is incomplete or not FP8; re-download "
                                         "it or fix quantization_config")
                if module in modules:
                    raise GraphkilnError(f"checkpoint module {show(module)} has both {' and '.join(self.scale_roles)}"
                                         f": {self.method} stores one; re-download the checkpoint")
                modules[module] = {"weight": weight, role: name}
                claimed.update((weight, name))
        passthrough = []
        for name in store.names:
            if name in claimed:
                continue
            module, _, role = name.rpartition(".")
            if store.dtype(name) in FP8_DTYPES:
                raise GraphkilnError(f"checkpoint tensor {show(name)} is stored as FP8 ({store.dtype(name)}) but has "
                                     f"no {' or '.join(show(f'{module}.{r}') for r in self.scale_roles)} beside it: "
                                     "the checkpoint is incomplete (a missing half); re-download it")
            if self.drops_scales and role in DROPPED_SCALES:
                if store.dtype(name) not in FLOAT_DTYPES or math.prod(store.shape(name)) != 1:
                    raise GraphkilnError(f"checkpoint tensor {show(name)} is an activation/KV scale but has dtype "
                                         f"{store.dtype(name)} and shape {list(store.shape(name))}, not one float: the "
                                         "checkpoint is corrupt; re-download it")
                continue  # weight-only artifact: activation and KV scales are not used (module docstring)
            passthrough.append(name)
        if not modules:
            raise GraphkilnError(f"config.json says the checkpoint is {self.method} FP8, but no checkpoint tensor is a "
                                 f"'*.{self.scale_roles[0]}': the weights are not FP8; fix config.json or re-download "
                                 "the checkpoint")
        self.check_modules(modules)
        return modules, passthrough

    def check_modules(self, modules: dict) -> None:
        if self.not_converted:
            refuse_not_converted(self.method, modules, self.not_converted, self.not_converted_key)
        ignore = getattr(self, "ignore", None)
        self.tile: dict[str, Tile] = {}
        for module, parts in modules.items():
            if ignore is not None and (hit := ignore.first(module, classes=False)) is not None:
                raise refuse(self.method, f"{show(module)} stores FP8 weights but 'ignore' lists {show(hit)}",
                             "remove it from 'ignore' in config.json, or re-quantize the checkpoint")
            found = {t for targets, t in self.tiles if targets is None or targets.first(module) is not None}
            found = {t for t in found if t.role in parts}
            if len(found) != 1:
                raise refuse(self.method, f"{show(module)} stores FP8 weights but "
                                          f"{'no config group targets it' if not found else 'several config groups with different scale layouts target it'}",
                             _FIX_CONFIG)
            self.tile[module] = found.pop()

    def _dims(self, store: Store, module: str, parts: dict) -> tuple[int, int, int, int]:
        shape = store.shape(parts["weight"])
        if len(shape) != 2 or 0 in shape:
            raise GraphkilnError(f"checkpoint tensor {show(parts['weight'])} has shape {list(shape)}, not [out, in]: "
                                 "the checkpoint is corrupt; re-download it")
        n, k = shape
        tile = self.tile[module]
        return n, k, tile.rows or n, tile.cols or k

    def described(self, name: str) -> str:
        return f"one scale per {self.tile[name.rpartition('.')[0]].shown}"

    def check_headers(self, store: Store, module: str, parts: dict) -> None:
        self._expect(store, parts["weight"], FP8_DTYPES, None, "weights")
        n, k, bn, bk = self._dims(store, module, parts)
        tile = self.tile[module]
        name = parts[tile.role]
        expected = (math.ceil(n / bn), math.ceil(k / bk))
        got = store.shape(name)
        # a per-tensor scale is stored as [] or [1], a per-channel one as [N] or [N, 1]
        alike = {(1, 1): ((), (1,)), (n, 1): ((n,),)}.get(expected, ())
        self._expect(store, name, FLOAT_DTYPES, None if got in alike else expected, "scales")

    def _bands(self, store: Store, module: str, parts: dict):
        """(first row, FP8 values as float32, each row's tile scales, the float weight) for bands of
        ``BAND_ROWS`` rows, the values checked (NaN, float32 overflow) as they are read."""
        import torch

        n, k, bn, bk = self._dims(store, module, parts)
        role = self.tile[module].role
        stored = store.tensor(parts["weight"])
        scales = read_positive_scales(store, parts[role], self.method).reshape(math.ceil(n / bn), math.ceil(k / bk))
        for r0 in range(0, n, BAND_ROWS):
            r1 = min(n, r0 + BAND_ROWS)
            v = stored[r0:r1].to(torch.float32).numpy()
            if not np.isfinite(v).all():
                raise GraphkilnError(f"checkpoint tensor {show(parts['weight'])} holds NaN values: the checkpoint is "
                                     "corrupt; re-download it")
            row_scales = scales[np.arange(r0, r1) // bn]  # [R, tiles along K]
            full = np.repeat(row_scales, bk, axis=1)[:, :k] if row_scales.shape[1] > 1 else row_scales
            with np.errstate(over="ignore"):  # an overflow is refused just below
                dense = v * full
            if not np.isfinite(dense).all():
                raise GraphkilnError(f"checkpoint tensors {show(parts['weight'])} times {show(parts[role])} "
                                     "overflow float32: the scales are out of range; the checkpoint is corrupt")
            yield r0, v, row_scales, dense

    def blocks(self, store: Store, module: str, parts: dict):
        n, k, _, bk = self._dims(store, module, parts)
        aligned = bk % self.block == 0 or bk >= k  # every block inside one tile column: one stored scale
        groups = -(-k // self.block)
        codes = np.empty((n, k), np.uint8)
        out_scales = np.empty((n, groups), np.float32)
        col_tile = np.minimum(np.arange(groups) * self.block // bk, math.ceil(k / bk) - 1)
        stats = self.stats if module not in self.counted else BlockError()  # each module counted once
        for r0, v, row_scales, dense in self._bands(store, module, parts):
            r1 = r0 + v.shape[0]
            if aligned:
                c, s = nearest_blocks(v, row_scales[:, col_tile], self.bits, self.block, True, stats)
            else:  # a block spans two tiles' scales: rounded from the float values
                c, s = nearest_blocks(dense, None, self.bits, self.block, False, stats)
            codes[r0:r1], out_scales[r0:r1] = c, s
        if module not in self.counted:
            self.counted.add(module)
            self.stats.modules += 1
        zeros = np.full(out_scales.shape, 1 << (self.bits - 1), np.uint8)
        return make_blocks(codes, out_scales, zeros, self.bits, self.block, self.format, parts["weight"])

    def weight(self, store: Store, module: str, parts: dict, blocks) -> np.ndarray:
        """``weight * scale`` itself (the blocks only approximate it), made band by band."""
        n, k, _, _ = self._dims(store, module, parts)
        out = np.empty((n, k), np.float32)
        for r0, v, _, dense in self._bands(store, module, parts):
            out[r0:r0 + v.shape[0]] = dense
        return out

    def summary(self) -> str | None:
        if not self.offers_blocks:
            return REQUANTIZED.format(what=f"{self.method} FP8 ({self.format})", n=self.stats.modules)
        return self.stats.line(f"{self.method} FP8 ({self.format})", self.bits, self.block)
