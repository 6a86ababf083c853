"""compressed-tensors (``quant_method: compressed-tensors``, format ``pack-quantized``; int weights,
group strategy): ``weight_packed`` int32 ``[N, ceil(K*bits/32)]`` packed along K, holding
``q + 2**(bits-1)`` for the signed values ``q`` (``pack_to_int32``); ``weight_scale`` ``[N,
K/group]``; ``weight_shape`` ``[N, K]``; when asymmetric ``weight_zero_point`` (signed, offset the
same way) packed along N: int32 ``[ceil(N*bits/32), K/group]`` (older writers: int8 ``[N,
K/group]`` unpacked). ``W = (q - zp) * scale``, i.e. the stored unsigned values minus the stored
unsigned zero point (symmetric: ``2**(bits-1)``)."""

from __future__ import annotations

import math

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.layout import (FIX_FLOAT, FLOAT_DTYPES, Layout, make_blocks, read_bits,
                                                  read_group_block, read_names, refuse, unpack_along_first,
                                                  unpack_along_last)
from graphkiln.models.hf_quantized.patterns import MatchBudget, Targets
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

class CompressedTensors(Layout):
    method = "compressed-tensors"
    anchor = "weight_packed"
    roles = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    optional = ("weight_zero_point", "weight_g_idx")

    def __init__(self, qc: dict) -> None:
        m = self.method
        fmt = qc.get("format")
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if qc.get(key):
                raise refuse(m, f"{show(key)} is set: graphkiln converts weight-only int quantization and "
                                "cannot honor it")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise refuse(m, "'config_groups' is missing or empty", "fix quantization_config in config.json")
        self.schemes = []  # (targets, weight args)
        budget = MatchBudget()
        for gname, group in groups.items():
            if not isinstance(group, dict):
                raise refuse(m, f"config group {show(gname)} is not a "
                                "mapping", "fix quantization_config in config.json")
            gfmt = group.get("format") or fmt
            if gfmt != "pack-quantized":
                raise refuse(m, f"format {show(gfmt)} (config group {show(gname)}) is not supported (graphkiln "
                                "reads pack-quantized int weights)")
            for act in ("input_activations", "output_activations"):
                if group.get(act):
                    raise refuse(m, f"config group {show(gname)} quantizes {act.replace('_', ' ')}, which weight-only "
                                     "MatMulNBits cannot honor")
            w = group.get("weights")
            if not isinstance(w, dict):
                raise refuse(m, f"config group {show(gname)} has no 'weights' scheme")
            if w.get("type", "int") != "int":
                raise refuse(m, f"config group {show(gname)} quantizes weights as {show(w.get('type'))}, not int")
            if w.get("dynamic"):
                raise refuse(m, f"config group {show(gname)} quantizes weights dynamically")
            bits = read_bits(m, w.get("num_bits"))
            strategy, gs = w.get("strategy"), w.get("group_size")
            if gs is not None and gs != -1:
                read_group_block(m, gs)  # not an integer: one line
            if strategy is None:  # as QuantizationArgs infers it
                known = isinstance(gs, int) and not isinstance(gs, bool)
                strategy = "group" if known and gs > 0 else "channel" if gs == -1 else "tensor"
            if strategy == "channel":
                raise refuse(m, "strategy channel (one scale per output across all K inputs) is not one of "
                                 "MatMulNBits' block sizes 16..256")
            if strategy != "group":
                raise refuse(m, f"strategy {show(strategy)} (config group {show(gname)}) is not supported "
                                "(graphkiln maps group-wise weights)")
            block = read_group_block(m, w.get("group_size"))
            symmetric = w.get("symmetric", True)
            if not isinstance(symmetric, bool):
                raise refuse(m, f"'symmetric' is {show(symmetric)}", "fix quantization_config in config.json")
            key = f"config_groups.{gname}.targets"
            self.schemes.append((Targets(m, key, read_names(m, group.get("targets"), key), budget),
                                 (bits, block, symmetric)))
        self.ignore = Targets(m, "ignore", read_names(m, qc.get("ignore"), "ignore"), budget)

    def check_modules(self, modules: dict) -> None:
        self.scheme = {}
        for module in modules:
            ignored = self.ignore.first(module, classes=False)
            if ignored is not None:
                raise refuse(self.method, f"{show(module)} stores packed weights but 'ignore' lists {show(ignored)}",
                             "remove it from 'ignore' in config.json, or re-quantize the checkpoint")
            found = {args for targets, args in self.schemes if targets.first(module) is not None}
            if not found:
                raise refuse(self.method, f"{show(module)} stores packed weights but no config group targets it",
                             "fix quantization_config in config.json")
            if len(found) > 1:
                raise refuse(self.method, f"{show(module)} is targeted by config groups with different weight schemes")
            self.scheme[module] = found.pop()

    def described(self, name: str) -> str:
        bits, block, _ = self.scheme[name.rpartition(".")[0]]
        return f"bits {bits}, group size {block}"

    def _dims(self, store: Store, module: str, parts: dict) -> tuple[int, int, int]:
        bits, block, _ = self.scheme[module]
        shape = store.shape(parts["weight_shape"])
        if shape != (2,):
            raise GraphkilnError(f"checkpoint tensor {show(parts['weight_shape'])} has shape {list(shape)}, not "
                                 "[2]: the checkpoint is corrupt; re-download it")
        n, k = (int(v) for v in store.ints(parts["weight_shape"]))
        if n <= 0 or k <= 0:
            raise GraphkilnError(f"checkpoint tensor {show(parts['weight_shape'])} says the weight is [{n}, {k}]: the "
                                 "checkpoint is corrupt; re-download it")
        return n, k, math.ceil(k / block)

    def check_headers(self, store: Store, module: str, parts: dict) -> None:
        bits, block, symmetric = self.scheme[module]
        self._expect(store, parts["weight_shape"], ("I64", "I32"), None, "weight shapes")
        n, k, groups = self._dims(store, module, parts)
        self._expect(store, parts["weight_packed"], ("I32",), (n, math.ceil(k * bits / 32)), "packed weights")
        self._expect(store, parts["weight_scale"], FLOAT_DTYPES, (n, groups), "weight scales")
        zp = parts.get("weight_zero_point")
        if symmetric and zp is not None:
            raise GraphkilnError(f"checkpoint tensor {show(zp)} is a zero point, but the scheme is symmetric: fix "
                                 "'symmetric' in config.json or re-download the checkpoint")
        if not symmetric:
            if zp is None:
                raise GraphkilnError(f"checkpoint tensor {show(module + '.weight_zero_point')} is missing (the "
                                     "scheme is asymmetric): the checkpoint is incomplete; re-download it")
            if store.dtype(zp) == "I32":
                self._expect(store, zp, ("I32",), (math.ceil(n * bits / 32), groups), "packed zero points")
            else:
                self._expect(store, zp, ("I8",), (n, groups), "zero points")
        if "weight_g_idx" in parts:
            self._expect(store, parts["weight_g_idx"], ("I32", "I64"), (k,), "g_idx")

    def blocks(self, store: Store, module: str, parts: dict):
        bits, block, symmetric = self.scheme[module]
        n, k, groups = self._dims(store, module, parts)
        offset = 1 << (bits - 1)
        scales = store.floats(parts["weight_scale"])  # [N, G]
        if "weight_g_idx" in parts:
            g_idx = store.ints(parts["weight_g_idx"])
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
                raise GraphkilnError(f"checkpoint tensor {show(parts['weight_g_idx'])} names groups outside "
                                     f"0..{groups - 1}: the checkpoint is corrupt; re-download it")
            if not np.array_equal(g_idx, np.arange(k) // block):
                raise refuse(self.method, f"{show(parts['weight_g_idx'])} orders the inputs by activation (actorder "
                                           "group): its groups are not contiguous runs of inputs, which MatMulNBits "
                                           "blocks cannot express",
                             "re-quantize without actorder group, or " + FIX_FLOAT)
        codes = unpack_along_last(store.ints(parts["weight_packed"]), bits)[:, :k]  # [N, K], value + offset
        if symmetric:
            zeros = np.full((n, groups), offset, np.int64)
        elif store.dtype(parts["weight_zero_point"]) == "I32":
            zeros = unpack_along_first(store.ints(parts["weight_zero_point"]), bits)[:n]  # stored as zp + offset
        else:
            zeros = store.ints(parts["weight_zero_point"])
            if zeros.min() < -offset or zeros.max() >= offset:
                raise GraphkilnError(f"checkpoint tensor {show(parts['weight_zero_point'])} holds zero points outside "
                                     f"[{-offset}, {offset - 1}]: the checkpoint is corrupt; re-download it")
            zeros = zeros + offset
        return make_blocks(codes, scales, zeros, bits, block, self.method, parts["weight_scale"])
