"""GPTQ (auto-gptq / gptqmodel / optimum, ``quant_method: gptq``): ``qweight`` int32 ``[K*bits/32,
N]`` packed along K; ``qzeros`` int32 ``[K/group, N*bits/32]`` packed along N; ``scales``
``[K/group, N]``; ``g_idx`` ``[K]`` (the group of each input). ``W[n, k] = (q[k, n] -
z[g_idx[k], n]) * scales[g_idx[k], n]``. Format ``gptq`` (v1) stores each zero point minus one
(``z = stored + 1``); ``gptq_v2`` stores it as it is. A v1 stored 15 (zero point 16, which the
kernels read differently: 16, or 0 carried into the next zero) is refused. Act-order (a g_idx
that is not ``k // group``) reorders inputs across groups, which contiguous blocks cannot say:
refused."""

from __future__ import annotations

import math

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.layout import (FIX_FLOAT, FLOAT_DTYPES, Layout, make_blocks, read_bits, read_bool,
                                                  read_group_block, read_names, refuse, unpack_along_first,
                                                  unpack_along_last)
from graphkiln.models.hf_quantized.patterns import refuse_not_converted
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

class GPTQ(Layout):
    method = "gptq"
    anchor = "qweight"
    roles = ("qweight", "qzeros", "scales", "g_idx")
    optional = ("g_idx",)

    def __init__(self, qc: dict) -> None:
        self.bits = read_bits("gptq", qc.get("bits"))
        self.group = read_group_block("gptq", qc.get("group_size", 128))
        self.desc_act = read_bool("gptq", qc, "desc_act", False)
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        fmt = fmt.lower() if isinstance(fmt, str) else fmt
        if fmt not in ("gptq", "gptq_v2"):
            raise refuse("gptq", f"checkpoint_format {show(fmt)} is not supported (graphkiln reads gptq and gptq_v2)",
                          "convert it to the gptq format with gptqmodel, or " + FIX_FLOAT)
        self.v1 = fmt == "gptq"
        self.format = fmt
        pack = qc.get("pack_dtype", "int32")
        if pack not in (None, "int32", "torch.int32"):
            raise refuse("gptq", f"pack_dtype {show(pack)} is not supported (graphkiln reads int32 words)",
                          "re-save the checkpoint with pack_dtype int32")
        dynamic = qc.get("dynamic")
        if dynamic:
            if not isinstance(dynamic, dict):
                raise refuse("gptq", "'dynamic' is not a mapping", "fix quantization_config in config.json")
            for rule, override in dynamic.items():
                if not str(rule).startswith("-:") and override:
                    raise refuse("gptq", f"'dynamic' rule {show(rule)} changes the layout of some modules "
                                         f"({show(override)}); graphkiln converts one layout per checkpoint")
        self.not_converted = read_names("gptq", qc.get("modules_to_not_convert"), "modules_to_not_convert")

    def check_modules(self, modules: dict) -> None:
        refuse_not_converted("gptq", modules, self.not_converted, "modules_to_not_convert")

    def _dims(self, store: Store, parts: dict) -> tuple[int, int, int]:
        per = 32 // self.bits
        qw = store.shape(parts["qweight"])
        if len(qw) != 2 or 0 in qw:
            raise GraphkilnError(f"checkpoint tensor {show(parts['qweight'])} has shape {list(qw)}, not "
                                 f"[K*{self.bits}/32, N]: the checkpoint is corrupt; re-download it")
        k, n = qw[0] * per, qw[1]
        return k, n, math.ceil(k / self.group)

    def check_headers(self, store: Store, module: str, parts: dict) -> None:
        self._expect(store, parts["qweight"], ("I32",), None, "qweights")
        k, n, groups = self._dims(store, parts)
        self._expect(store, parts["scales"], FLOAT_DTYPES, (groups, n), "scales")
        self._expect(store, parts["qzeros"], ("I32",), (groups, math.ceil(n * self.bits / 32)), "qzeros")
        if "g_idx" in parts:
            self._expect(store, parts["g_idx"], ("I32", "I64"), (k,), "g_idx")
        elif self.desc_act:
            raise GraphkilnError(f"checkpoint tensor {show(module + '.g_idx')} is missing, and desc_act (act-order) "
                                 "needs it to place the inputs in groups: re-download the checkpoint")

    def blocks(self, store: Store, module: str, parts: dict):
        k, n, groups = self._dims(store, parts)
        limit = 1 << self.bits
        scales = store.floats(parts["scales"])  # [G, N]
        if "g_idx" in parts:
            g_idx = store.ints(parts["g_idx"])
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
                bad = int(g_idx[(g_idx < 0) | (g_idx >= groups)][0])
                raise GraphkilnError(f"checkpoint tensor {show(parts['g_idx'])} names group {bad}, but the module has "
                                     f"{groups} groups (0..{groups - 1}): the checkpoint is corrupt; re-download it")
            if not np.array_equal(g_idx, np.arange(k) // self.group):
                raise refuse("gptq", f"{show(parts['g_idx'])} orders the inputs by activation (act-order, "
                                     "desc_act): its groups are not contiguous runs of inputs, which MatMulNBits "
                                     "blocks cannot express",
                              "re-quantize without desc_act, or " + FIX_FLOAT)
        codes = unpack_along_first(store.ints(parts["qweight"]), self.bits)  # [K, N]
        zeros = unpack_along_last(store.ints(parts["qzeros"]), self.bits)[:, :n]  # [G, N]
        if self.v1:  # gptq v1 stores zero - 1
            zeros = zeros + 1
            if (zeros >= limit).any():
                raise GraphkilnError(f"checkpoint tensor {show(parts['qzeros'])} stores {limit - 1} for a zero point "
                                     f"(gptq v1 stores zero - 1: a zero point of {limit}, which {self.bits}-bit blocks "
                                     "cannot hold and kernels read differently): convert the checkpoint to gptq_v2 "
                                     "with gptqmodel, or " + FIX_FLOAT)
        return make_blocks(codes.T, scales.T, zeros.T, self.bits, self.group, self.format, parts["scales"])
