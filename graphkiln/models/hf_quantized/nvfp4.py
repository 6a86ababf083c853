"""NVFP4 weights as NVIDIA ModelOpt exports them (``quant_algo: NVFP4``, in ``hf_quant_config.json``'s
``quantization`` or in config.json's ``quantization_config`` with ``quant_method: modelopt``),
converted into MatMulNBits integer blocks of 16, exact (int8, the default); at ``--quant int4`` the
export quantizes the stored values itself (calibrated), since int4 cannot hold them.

Per quantized Linear (read from ModelOpt's export and vLLM's ``break_fp4_bytes`` /
``dequantize_to_dtype``): ``weight`` U8 ``[N, K/2]``, two E2M1 codes a byte, the even input's in
the low nibble (bit 3 the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6); ``weight_scale``
F8_E4M3 ``[N, K/16]`` (one scale per 16 inputs, stored linearly, not swizzled); ``weight_scale_2``
F32 ``[]`` (per tensor); ``input_scale`` (static activation scale, not used: the artifact is
weight-only, its activations float). ``W[n, k] = e2m1[n, k] * (weight_scale[n, k // 16] *
weight_scale_2)``, the scale product taken in float32 first.

E2M1 values times 2 are the integers 0..12, so an int8 block of 16 holds them exactly (step
``weight_scale * weight_scale_2 / 2``, or larger where the block's values allow:
``fp8.nearest_blocks``); int4's 16 even levels cannot hold E2M1's 15 uneven ones. The float
checkpoint holds ``W`` itself. The tensorrt target gets that
float weight too: keeping FP4 for TensorRT's FP4 GEMM is not done (nothing here can build or run
TensorRT).

``modelopt_config`` finds the quantization a ModelOpt checkpoint declares; ModelOpt's ``FP8``
algorithm is ``fp8.FP8.from_modelopt``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.fp8 import (BAND_ROWS, DROPPED_SCALES, REQUANTIZED, BlockError, nearest_blocks,
                                               read_positive_scales)
from graphkiln.models.hf_quantized.layout import FLOAT_DTYPES, Layout, make_blocks, read_names, refuse
from graphkiln.models.hf_quantized.patterns import refuse_not_converted
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

HF_QUANT_CONFIG = "hf_quant_config.json"
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
GROUP = 16
# What graphkiln reads of ModelOpt's algorithms (others, e.g. W4A8_AWQ, MIXED_PRECISION, are refused)
MODELOPT_ALGOS = ("NVFP4", "FP8")


def modelopt_config(src: Path) -> dict | None:
    """``hf_quant_config.json``'s ``quantization`` section as a quantization_config (``quant_method:
    modelopt``), or None when the checkpoint has no such file. Untrusted JSON: one line when bad."""
    from graphkiln.models.checkpoint_files import read_json_object

    raw = read_json_object(src, HF_QUANT_CONFIG, "re-download the checkpoint or delete the file")
    if raw is None:
        return None
    section = raw.get("quantization")
    if not isinstance(section, dict):
        raise GraphkilnError(f"{HF_QUANT_CONFIG} has no 'quantization' mapping: the checkpoint's ModelOpt config is "
                             "malformed; re-download it")
    return {"quant_method": "modelopt", **section}


def modelopt_layout(qc: dict) -> Layout:
    """The layout of a ModelOpt quantization_config, or one line naming what is not read."""
    from graphkiln.models.hf_quantized.fp8 import FP8

    algo = qc.get("quant_algo")
    if algo is None and isinstance(qc.get("quantization"), dict):
        qc = {**qc, **qc["quantization"]}
        algo = qc.get("quant_algo")
    if algo == "NVFP4":
        return NVFP4(qc)
    if algo == "FP8":
        return FP8.from_modelopt(qc)
    raise refuse("modelopt", f"quant_algo {show(algo)} is not converted (graphkiln reads ModelOpt "
                             f"{' and '.join(MODELOPT_ALGOS)})", "export the unquantized checkpoint and use --quant")


class NVFP4(Layout):
    method = "modelopt"
    anchor = "weight"
    roles = ("weight", "weight_scale", "weight_scale_2")

    def __init__(self, qc: dict) -> None:
        group = qc.get("group_size", GROUP)
        if group != GROUP or isinstance(group, bool):
            raise refuse(self.method, f"NVFP4 group_size {show(group)} is not {GROUP} (NVFP4 scales 16 values)",
                         "fix quantization_config or hf_quant_config.json")
        key = "exclude_modules" if "exclude_modules" in qc else "ignore"
        self.not_converted = read_names(self.method, qc.get(key), key)
        self.not_converted_key = key
        self.bits, self.block = 8, GROUP
        self.stats = BlockError()
        self.counted: set[str] = set()

    def request(self, bits: int | None, block_size: int | None) -> None:
        # int8: blocks of 16, NVFP4's scales' layout (--quant-block-size not used), exact. int4 cannot
        # hold E2M1 x scale: the export's own (calibrated) quantizer takes the stored values (measured
        # on SmolLM2: 1.22x the NVFP4 model's perplexity, against 1.60x for int4 blocks chosen here);
        # the conversion's blocks then only check the values, as int8
        self.offers_blocks = bits != 4
        self.bits = 8

    def plan(self, store: Store) -> tuple[dict[str, dict[str, str]], list[str]]:
        """Quantized modules: each ``<module>.weight_scale_2`` with its weight and block scales."""
        modules: dict[str, dict[str, str]] = {}
        for name in store.names:
            module, _, role = name.rpartition(".")
            if role == "weight_scale_2":
                modules[module] = {}
        claimed = set()
        for module, parts in modules.items():
            for role in self.roles:
                name = f"{module}.{role}"
                if name not in store.where:
                    raise GraphkilnError(f"checkpoint tensor {show(name)} is missing (NVFP4: "
                                         f"{show(module + '.weight_scale_2')} needs it): the checkpoint is incomplete "
                                         "(a missing half); re-download it")
                parts[role] = name
                claimed.add(name)
        passthrough = []
        for name in store.names:
            if name in claimed:
                continue
            module, _, role = name.rpartition(".")
            if role == "weight_scale" or store.dtype(name) in ("U8", "F8_E4M3", "F8_E5M2"):
                raise GraphkilnError(f"checkpoint tensor {show(name)} ({store.dtype(name)}) is NVFP4 data without "
                                     f"{show(module + '.weight_scale_2')} beside it: the checkpoint is incomplete "
                                     "(a missing half); re-download it")
            if role in DROPPED_SCALES:
                if store.dtype(name) not in FLOAT_DTYPES or math.prod(store.shape(name)) != 1:
                    raise GraphkilnError(f"checkpoint tensor {show(name)} is an activation/KV scale but has dtype "
                                         f"{store.dtype(name)} and shape {list(store.shape(name))}, not one float: "
                                         "the checkpoint is corrupt; re-download it")
                continue  # weight-only artifact (module docstring)
            passthrough.append(name)
        if not modules:
            raise GraphkilnError("the checkpoint says it is NVFP4 (quant_algo NVFP4), but no checkpoint tensor is a "
                                 "'*.weight_scale_2': the weights are not NVFP4; fix the config or re-download the "
                                 "checkpoint")
        refuse_not_converted(self.method, modules, self.not_converted, self.not_converted_key)
        return modules, passthrough

    def described(self, name: str) -> str:
        return "NVFP4: two E2M1 codes a byte, one FP8 scale per 16"

    def _dims(self, store: Store, parts: dict) -> tuple[int, int]:
        shape = store.shape(parts["weight"])
        if len(shape) != 2 or 0 in shape:
            raise GraphkilnError(f"checkpoint tensor {show(parts['weight'])} has shape {list(shape)}, not [out, in/2]: "
                                 "the checkpoint is corrupt; re-download it")
        return shape[0], shape[1] * 2

    def check_headers(self, store: Store, module: str, parts: dict) -> None:
        self._expect(store, parts["weight"], ("U8",), None, "packed E2M1 weights")
        n, k = self._dims(store, parts)
        if k % GROUP:
            raise GraphkilnError(f"checkpoint tensor {show(parts['weight'])} has {k} inputs, not a multiple of {GROUP}: "
                                 "NVFP4 scales 16 inputs at a time; the checkpoint is corrupt; re-download it")
        self._expect(store, parts["weight_scale"], ("F8_E4M3",), (n, k // GROUP), "block scales")
        name = parts["weight_scale_2"]
        self._expect(store, name, ("F32",), None if store.shape(name) in ((), (1,)) else (), "per-tensor scales")

    def _bands(self, store: Store, parts: dict):
        """(first row, E2M1 values as float32, their scales [R, K/16]) for bands of rows."""
        n, k = self._dims(store, parts)
        packed = store.tensor(parts["weight"]).numpy()
        block_scales = read_positive_scales(store, parts["weight_scale"], "NVFP4")
        s2 = read_positive_scales(store, parts["weight_scale_2"], "NVFP4").reshape(())
        with np.errstate(over="ignore"):  # an overflow is refused just below
            scale = (block_scales * s2).astype(np.float32)  # [N, K/16]: the float32 product, as dequantizers take it
        if not np.isfinite(scale).all():
            raise GraphkilnError(f"checkpoint tensors {show(parts['weight_scale'])} times {show(parts['weight_scale_2'])} "
                                 "overflow float32: the scales are out of range; the checkpoint is corrupt")
        for r0 in range(0, n, BAND_ROWS):  # in bands of rows: a module's temporaries stay small
            r1 = min(n, r0 + BAND_ROWS)
            values = np.empty((r1 - r0, k), np.float32)
            values[:, 0::2] = E2M1[packed[r0:r1] & 0x0F]  # the even input in the low nibble
            values[:, 1::2] = E2M1[packed[r0:r1] >> 4]
            yield r0, values, scale[r0:r1]

    def blocks(self, store: Store, module: str, parts: dict):
        n, k = self._dims(store, parts)
        codes = np.empty((n, k), np.uint8)
        scales = np.empty((n, k // GROUP), np.float32)
        stats = self.stats if module not in self.counted else BlockError()  # each module counted once
        for r0, values, scale in self._bands(store, parts):
            r1 = r0 + values.shape[0]
            codes[r0:r1], scales[r0:r1] = nearest_blocks(values, scale, self.bits, GROUP, True, stats)
        if module not in self.counted:
            self.counted.add(module)
            self.stats.modules += 1
        zeros = np.full(scales.shape, 1 << (self.bits - 1), np.uint8)
        return make_blocks(codes, scales, zeros, self.bits, GROUP, "modelopt:nvfp4", parts["weight"])

    def weight(self, store: Store, module: str, parts: dict, blocks) -> np.ndarray:
        """``e2m1 * scale`` itself (int4 blocks only approximate it), made band by band."""
        n, k = self._dims(store, parts)
        out = np.empty((n, k), np.float32)
        for r0, values, scale in self._bands(store, parts):
            out[r0:r0 + values.shape[0]] = values * np.repeat(scale, GROUP, axis=1)
        return out

    def summary(self) -> str | None:
        if not self.offers_blocks:
            return REQUANTIZED.format(what="modelopt NVFP4", n=self.stats.modules)
        return self.stats.line("modelopt NVFP4", self.bits, GROUP)
