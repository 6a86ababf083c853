"""AWQ (autoawq GEMM, ``quant_method: awq``, ``version``/``format`` ``gemm``): ``qweight`` int32
``[K, N/8]`` packed along N in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i``
of word ``c`` holds column ``8c + order[i]``), ``qzeros`` int32 ``[K/group, N/8]`` the same way,
``scales`` ``[K/group, N]``; zero points as they are. GEMV and other versions are refused."""

from __future__ import annotations

import math

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.layout import (FIX_FLOAT, FLOAT_DTYPES, Layout, make_blocks, read_bits, read_bool,
                                                  read_group_block, read_names, refuse, unpack_along_last)
from graphkiln.models.hf_quantized.patterns import refuse_not_converted
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

class AWQ(Layout):
    method = "awq"
    anchor = "qweight"
    roles = ("qweight", "qzeros", "scales")
    ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8c + ORDER[i]

    def __init__(self, qc: dict) -> None:
        version = qc.get("version", qc.get("format", "gemm"))
        version = version.lower() if isinstance(version, str) else version
        if qc.get("backend") == "llm-awq":
            version = "llm-awq"
        if version != "gemm":
            raise refuse("awq", f"version {show(version)} is not supported (graphkiln reads autoawq's GEMM layout)",
                          "re-save it in the gemm version, or " + FIX_FLOAT)
        self.bits = read_bits("awq", qc.get("bits", qc.get("w_bit", 4)), (4,))
        self.group = read_group_block("awq", qc.get("group_size", qc.get("q_group_size", 128)))
        if not read_bool("awq", qc, "zero_point", True):
            raise refuse("awq", "zero_point false is not a layout autoawq's GEMM writes")
        self.not_converted = read_names("awq", qc.get("modules_to_not_convert"), "modules_to_not_convert")

    def check_modules(self, modules: dict) -> None:
        refuse_not_converted("awq", modules, self.not_converted, "modules_to_not_convert")

    def _dims(self, store: Store, parts: dict) -> tuple[int, int, int]:
        qw = store.shape(parts["qweight"])
        if len(qw) != 2 or 0 in qw:
            raise GraphkilnError(f"checkpoint tensor {show(parts['qweight'])} has shape {list(qw)}, not [K, N/8]: the "
                                 "checkpoint is corrupt; re-download it")
        k, n = qw[0], qw[1] * 8
        return k, n, math.ceil(k / self.group)

    def check_headers(self, store: Store, module: str, parts: dict) -> None:
        self._expect(store, parts["qweight"], ("I32",), None, "qweights")
        k, n, groups = self._dims(store, parts)
        self._expect(store, parts["scales"], FLOAT_DTYPES, (groups, n), "scales")
        self._expect(store, parts["qzeros"], ("I32",), (groups, n // 8), "qzeros")

    def _unpack(self, words: np.ndarray) -> np.ndarray:
        vals = unpack_along_last(words, 4).reshape(words.shape[0], words.shape[1], 8)
        out = np.empty_like(vals)
        out[:, :, list(self.ORDER)] = vals
        return out.reshape(words.shape[0], -1)

    def blocks(self, store: Store, module: str, parts: dict):
        scales = store.floats(parts["scales"])  # [G, N]
        codes = self._unpack(store.ints(parts["qweight"]))  # [K, N]
        zeros = self._unpack(store.ints(parts["qzeros"]))  # [G, N]
        return make_blocks(codes.T, scales.T, zeros.T, self.bits, self.group, "awq", parts["scales"])
