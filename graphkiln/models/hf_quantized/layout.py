"""What every pre-quantized format shares: the ``Layout`` base (which tensors form a quantized
module, header checks), the readers of quantization_config values (each refusal one line),
unpacking int32 words, and ``BlockQuantized`` from unpacked values.

Packed words are int32 read as unsigned, their first element in the lowest bits (K: input
features, N: output features)."""

from __future__ import annotations

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

FIX_FLOAT = "export the float checkpoint with --quant int4 instead"
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def refuse(method: str, what: str, fix: str = FIX_FLOAT) -> GraphkilnError:
    return GraphkilnError(f"{method} checkpoint: {what}: {fix}")


def read_group_block(method: str, group_size, k_text: str = "K") -> int:
    """The MatMulNBits block size of a group size, or a one-line refusal."""
    from graphkiln.export.lowering.quantize import MATMUL_NBITS_BLOCK_SIZES, block_size_ok

    sizes = f"{MATMUL_NBITS_BLOCK_SIZES[0]}..{MATMUL_NBITS_BLOCK_SIZES[-1]}"
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise refuse(method, f"group size {show(group_size)} is not an integer",
                     "fix quantization_config in config.json")
    if group_size == -1:
        raise refuse(method, f"group size -1 (one scale per output across all {k_text} inputs) is not one of "
                              f"MatMulNBits' block sizes {sizes}")
    if not block_size_ok(group_size):
        raise refuse(method, f"group size {group_size} is not one of MatMulNBits' block sizes {sizes} "
                              f"({', '.join(map(str, MATMUL_NBITS_BLOCK_SIZES))})")
    return group_size


def read_bits(method: str, bits, allowed=(4, 8)) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        shown = " and ".join(map(str, allowed))
        raise refuse(method, f"bits {show(bits)} is not supported (graphkiln maps {shown}-bit weights onto "
                             "MatMulNBits)")
    return bits


def read_bool(method: str, qc: dict, key: str, default: bool) -> bool:
    value = qc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise refuse(method, f"{show(key)} is {show(value)}, not true or false",
                     "fix quantization_config in config.json")
    return value


def read_names(method: str, value, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise refuse(method, f"{show(key)} is not a list of module names", "fix quantization_config in config.json")
    return value


def unpack_along_first(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] each holding 32/bits values along the first axis (first in the lowest
    bits) -> [R * 32/bits, C] unsigned values."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.int64) * bits)[None, :, None]
    vals = (words.astype(np.int64)[:, None, :] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0] * per, words.shape[1])


def unpack_along_last(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] each holding 32/bits values along the last axis -> [R, C * 32/bits]."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.int64) * bits)[None, None, :]
    vals = (words.astype(np.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0], words.shape[1] * per)


class Layout:
    """One quantization format: which tensors form a quantized module, their header checks, and
    their blocks."""

    method = ""
    anchor = ""  # the role whose tensor marks a module as quantized
    roles: tuple[str, ...] = ()  # every role's tensor suffix ("qweight", ...)
    optional: tuple[str, ...] = ()

    def plan(self, store: Store) -> tuple[dict[str, dict[str, str]], list[str]]:
        """{module: {role: tensor name}} of the quantized modules, and the tensors copied as they are."""
        modules: dict[str, dict[str, str]] = {}
        for name in store.names:
            if name.endswith("." + self.anchor):
                modules[name[: -len(self.anchor) - 1]] = {}
        claimed = set()
        for module, parts in modules.items():
            for role in self.roles:
                name = f"{module}.{role}"
                if name in store.where:
                    parts[role] = name
                    claimed.add(name)
                elif role not in self.optional:
                    raise GraphkilnError(f"checkpoint tensor {show(name)} is missing ({self.method}: "
                                         f"{show(module + '.' + self.anchor)} needs it): the checkpoint is "
                                         "incomplete; re-download it")
            if f"{module}.weight" in store.where:
                raise GraphkilnError(f"checkpoint has both {show(module + '.weight')} and "
                                     f"{show(module + '.' + self.anchor)}: one module stored float and "
                                     f"{self.method}-packed; re-save the checkpoint")
        if not modules:
            raise GraphkilnError(f"config.json says quant_method {self.method}, but no checkpoint tensor is a "
                                 f"'*.{self.anchor}': the weights are not {self.method}-packed; fix config.json or "
                                 "re-download the checkpoint")
        passthrough = []
        for name in store.names:
            if name in claimed:
                continue
            module, _, role = name.rpartition(".")
            if role in self.roles:  # e.g. a stray qzeros without its qweight
                raise GraphkilnError(f"checkpoint tensor {show(name)} has no {show(module + '.' + self.anchor)} "
                                     "beside it: the checkpoint is incomplete; re-download it")
            passthrough.append(name)
        self.check_modules(modules)
        return modules, passthrough

    def check_modules(self, modules: dict) -> None:
        """Refuse quantized modules the config says are not converted."""

    def check_headers(self, store: Store, module: str, parts: dict[str, str]) -> None:
        raise NotImplementedError

    def blocks(self, store: Store, module: str, parts: dict[str, str]):
        raise NotImplementedError

    # Formats whose values are not integer blocks (FP8, NVFP4) choose their blocks on conversion
    # and keep their own values as the float weight; the integer formats keep these defaults.
    # offers_blocks False: the conversion's blocks only check the stored values, and the export
    # quantizes the float weight itself (its calibrated quantizer beats blocks chosen without
    # activations where they cannot be exact: FP8/NVFP4 at --quant int4).
    offers_blocks = True

    def request(self, bits: int | None, block_size: int | None) -> None:
        """The export's ``--quant`` width and ``--quant-block-size`` (None: not given), for formats
        whose blocks are chosen on conversion; the integer formats store their own and ignore it."""

    def weight(self, store: Store, module: str, parts: dict[str, str], blocks) -> np.ndarray:
        """The module's float32 ``[N, K]`` weight the converted checkpoint holds: the blocks' values,
        or the stored format's own values where the blocks only approximate them."""
        return blocks.dequantize()

    def summary(self) -> str | None:
        """One line on what the conversion did (e.g. the blocks' error against the stored values)."""
        return None

    # shared header checks
    def _expect(self, store: Store, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                what: str) -> None:
        dtype, got = store.dtype(name), store.shape(name)
        if dtype not in dtypes:
            raise GraphkilnError(f"checkpoint tensor {show(name)} is stored as {dtype}, but {self.method} {what} are "
                                 f"{'/'.join(dtypes)}: the checkpoint is corrupt or not {self.method}; re-download it")
        if shape is not None and got != shape:
            raise GraphkilnError(f"checkpoint tensor {show(name)} has shape {list(got)}, but {self.method} {what} "
                                 f"of this module are {list(shape)} ({self.described(name)}): the checkpoint is "
                                 "truncated or corrupt, or quantization_config does not describe it; re-download it")

    def described(self, name: str) -> str:
        """The quantization_config values the expected shapes follow from, for messages."""
        return f"bits {self.bits}, group size {self.group}"



def make_blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, block: int, fmt: str, name: str):
    """BlockQuantized from [N, K] codes and [N, G] scales / zero points (values already in range)."""
    from graphkiln.models.prequantized import BlockQuantized

    try:
        return BlockQuantized(np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(scales, np.float32),
                              np.ascontiguousarray(zeros, dtype=np.uint8), bits, block, fmt)
    except ValueError as exc:  # shapes are checked from the headers first: a guard, named all the same
        raise GraphkilnError(f"checkpoint tensor {show(name)} does not fit its module's blocks ({exc}): the checkpoint "
                             "is corrupt; re-download it") from None
