"""Hugging Face checkpoints stored pre-quantized (GPTQ, AWQ, compressed-tensors ``pack-quantized``)
converted into an ordinary float checkpoint plus the blocks they store (``models.prequantized``).

``convert_quantized_checkpoint(src, dest)`` (called by ``export.checkpoint.prepared_checkpoint``)
writes into ``dest``: every file of ``src`` that is not a weight file (tokenizer, generation
config, chat template...), ``config.json`` without its ``quantization_config``, the float tensors
as they are, and for each quantized Linear its *dequantized* float32 ``<module>.weight`` ``[out,
in]`` in place of its integer tensors (biases kept), plus the sidecar holding those weights' exact
integer codes, scales and zero points. The export then writes the very integers the checkpoint
stored into ``MatMulNBits``, while transformers (the reference) and the tracer read the floats.

The layouts, as the libraries that write them do (K: input features, N: output features; every
packed word is an int32 read as unsigned, its first element in the lowest bits):

* GPTQ (auto-gptq / gptqmodel / optimum, ``quant_method: gptq``): ``qweight`` int32 ``[K*bits/32,
  N]`` packed along K; ``qzeros`` int32 ``[K/group, N*bits/32]`` packed along N; ``scales``
  ``[K/group, N]``; ``g_idx`` ``[K]`` (the group of each input). ``W[n, k] = (q[k, n] -
  z[g_idx[k], n]) * scales[g_idx[k], n]``. Format ``gptq`` (v1) stores each zero point minus one
  (``z = stored + 1``); ``gptq_v2`` stores it as it is. A v1 stored 15 (zero point 16, which the
  kernels read differently: 16, or 0 carried into the next zero) is refused. Act-order (a g_idx
  that is not ``k // group``) reorders inputs across groups, which contiguous blocks cannot say:
  refused.
* AWQ (autoawq GEMM, ``quant_method: awq``, ``version``/``format`` ``gemm``): ``qweight`` int32
  ``[K, N/8]`` packed along N in the interleaved order ``[0, 2, 4, 6, 1, 3, 5, 7]`` (nibble ``i``
  of word ``c`` holds column ``8c + order[i]``), ``qzeros`` int32 ``[K/group, N/8]`` the same way,
  ``scales`` ``[K/group, N]``; zero points as they are. GEMV and other versions are refused.
* compressed-tensors (``quant_method: compressed-tensors``, format ``pack-quantized``; int weights,
  group strategy): ``weight_packed`` int32 ``[N, ceil(K*bits/32)]`` packed along K, holding
  ``q + 2**(bits-1)`` for the signed values ``q`` (``pack_to_int32``); ``weight_scale`` ``[N,
  K/group]``; ``weight_shape`` ``[N, K]``; when asymmetric ``weight_zero_point`` (signed, offset the
  same way) packed along N: int32 ``[ceil(N*bits/32), K/group]`` (older writers: int8 ``[N,
  K/group]`` unpacked). ``W = (q - zp) * scale``, i.e. the stored unsigned values minus the stored
  unsigned zero point (symmetric: ``2**(bits-1)``).

Refused with one line naming the cause (and, for layouts MatMulNBits cannot hold, pointing at
``--quant int4`` on the float checkpoint): bits other than 4 and 8 (AWQ: 4), group sizes that are
not one of MatMulNBits' block sizes (16..256; ``-1`` / per-channel is one block of all K),
act-order, per-module layout overrides, activation or KV-cache quantization, a module listed as
not converted that stores packed tensors. The checkpoint is untrusted input: missing or misshapen
tensors, wrong dtypes, out-of-range ``g_idx``, non-finite scales are one ``GraphkilnError`` line
naming the tensor. Only safetensors are read (never a pickle), and nothing is written outside
``dest``.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

# Files of the source directory not copied into the converted one: weights (rewritten, or formats
# never read), and the quantizers' own config files, which describe weights the copy no longer has.
_SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5",
                     ".gguf", ".npz", ".npy")
_SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "quantize_config.json", "quant_config.json",
                  "quantization_config.json")
# An output shard is written once it holds this many bytes (dequantized weights are float32).
SHARD_BYTES = 2 << 30
_FIX_FLOAT = "export the float checkpoint with --quant int4 instead"
_FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


# --------------------------------------------------------------------------- entry point


def convert_quantized_checkpoint(src: Path, dest: Path) -> None:
    """Convert the GPTQ / AWQ / compressed-tensors checkpoint directory ``src`` into the ordinary
    checkpoint directory ``dest`` (see the module docstring); one ``GraphkilnError`` line when the
    checkpoint is malformed or its layout does not map onto MatMulNBits (``dest`` removed then)."""
    from graphkiln.models.weights import read_config

    src, dest = Path(src), Path(dest)
    raw = read_config(src)
    qc = raw.get("quantization_config")
    layout = layout_for(qc)
    store = _Store(src)
    try:
        modules, passthrough = layout.plan(store)
        for module, parts in modules.items():  # every header checked before anything is written
            layout.check_headers(store, module, parts)
        created = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        try:
            _write(src, dest, raw, store, layout, modules, passthrough)
        except BaseException:
            if created:
                shutil.rmtree(dest, ignore_errors=True)
            raise
    finally:
        store.close()


def _write(src: Path, dest: Path, raw: dict, store: "_Store", layout: "_Layout", modules: dict,
           passthrough: list[str]) -> None:
    from graphkiln.models.prequantized import write_sidecar

    for path in sorted(src.iterdir()):  # the non-weight files (hub snapshots hold symlinks: followed)
        if path.name in _SKIPPED_FILES or path.suffix.lower() in _SKIPPED_SUFFIXES or path.name.startswith("."):
            continue
        if path.is_file():
            shutil.copyfile(path, dest / path.name)
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # tensors in the source's order, each quantized module's weight where its packed weight was
    anchor = {parts[layout.anchor]: module for module, parts in modules.items()}
    order = sorted([*passthrough, *anchor], key=lambda n: (store.order(n), n))
    writer = _ShardWriter(dest)
    blocks = {}
    for name in order:
        if name in anchor:
            module = anchor[name]
            b = layout.blocks(store, module, modules[module])
            blocks[f"{module}.weight"] = b
            writer.add(f"{module}.weight", _torch(b.dequantize()))
        else:
            writer.add(name, store.tensor(name))
    writer.close()
    write_sidecar(dest, blocks)


def _torch(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


# --------------------------------------------------------------------------- reading


class _Store:
    """The source's safetensors shards: every tensor's shard, dtype and shape from the headers
    (nothing read), tensors read one at a time."""

    def __init__(self, src: Path) -> None:
        from safetensors import safe_open

        from graphkiln.models.prequantized import PREQUANTIZED_FILE

        shards = sorted(p for p in src.glob("*.safetensors") if p.name != PREQUANTIZED_FILE)
        if not shards:
            raise GraphkilnError(f"no *.safetensors files in {src}: a GPTQ/AWQ/compressed-tensors checkpoint is read "
                                 "from safetensors only (never a pickle); re-save it with safe_serialization=True")
        self.where: dict[str, Path] = {}
        self.headers: dict[str, tuple[str, tuple[int, ...]]] = {}
        self._order: dict[str, tuple[int, int]] = {}
        self.handles: dict[Path, object] = {}
        for i, shard in enumerate(shards):
            try:
                f = safe_open(str(shard), framework="pt")
                for j, name in enumerate(f.keys()):
                    if name in self.where:
                        raise GraphkilnError(f"checkpoint tensor '{name}' is in both {self.where[name].name} and "
                                             f"{shard.name}: remove the stale shard")
                    sl = f.get_slice(name)
                    self.where[name] = shard
                    self.headers[name] = (str(sl.get_dtype()), tuple(int(d) for d in sl.get_shape()))
                    self._order[name] = (i, j)
            except GraphkilnError:
                raise
            except Exception as exc:  # safetensors raises several types for corrupt headers
                raise GraphkilnError(f"{shard.name} is truncated or corrupt ({str(exc).splitlines()[0][:160]}): "
                                     "re-download or re-save the checkpoint") from None
            self.handles[shard] = f

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
        """The stored torch tensor, as it is."""
        try:
            return self.handles[self.where[name]].get_tensor(name)
        except Exception as exc:
            raise GraphkilnError(f"checkpoint tensor '{name}' cannot be read from {self.where[name].name} "
                                 f"({str(exc).splitlines()[0][:160]}): re-download or re-save the checkpoint") from None

    def ints(self, name: str) -> np.ndarray:
        """An integer tensor as int64 (packed int32 words keep their bit pattern: masked later)."""
        return self.tensor(name).numpy().astype(np.int64)

    def floats(self, name: str) -> np.ndarray:
        """A float tensor as float32 (fp16/bf16 scales convert exactly); non-finite values refused."""
        import torch

        t = self.tensor(name)
        a = t.to(torch.float32).numpy() if t.dtype != torch.float64 else t.numpy()
        if not np.isfinite(a).all():
            raise GraphkilnError(f"checkpoint tensor '{name}' holds NaN or infinite values: the checkpoint is "
                                 "corrupt; re-download it or quantize it again")
        if a.dtype != np.float32:
            a = a.astype(np.float32)
            if not np.isfinite(a).all():
                raise GraphkilnError(f"checkpoint tensor '{name}' overflows float32: the checkpoint is corrupt")
        return a

    def close(self) -> None:
        self.handles.clear()


class _ShardWriter:
    """Output shards of at most ``SHARD_BYTES``: model.safetensors, or model-0000i-of-0000n with an
    index, as transformers writes them."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.pending: dict = {}
        self.bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []

    def add(self, name: str, tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.bytes += tensor.numel() * tensor.element_size()
        if self.bytes >= SHARD_BYTES:
            self._flush()

    def _flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending and self.shards:
            return
        path = self.dest / f".shard-{len(self.shards)}.safetensors.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.shards.append((path, list(self.pending)))
        self.pending, self.bytes = {}, 0

    def close(self) -> None:
        self._flush()
        n = len(self.shards)
        if n == 1:
            self.shards[0][0].rename(self.dest / "model.safetensors")
            return
        weight_map, total = {}, 0
        for i, (path, names) in enumerate(self.shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            total += path.stat().st_size
            path.rename(self.dest / final)
            weight_map.update({name: final for name in names})
        (self.dest / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


# --------------------------------------------------------------------------- layouts


def _refuse(method: str, what: str, fix: str = _FIX_FLOAT) -> GraphkilnError:
    return GraphkilnError(f"{method} checkpoint: {what}: {fix}")


def _group_block(method: str, group_size, k_text: str = "K") -> int:
    """The MatMulNBits block size of a group size, or a one-line refusal."""
    from graphkiln.export.lowering.quantize import MATMUL_NBITS_BLOCK_SIZES, block_size_ok

    sizes = f"{MATMUL_NBITS_BLOCK_SIZES[0]}..{MATMUL_NBITS_BLOCK_SIZES[-1]}"
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise _refuse(method, f"group size {group_size!r} is not an integer", "fix quantization_config in config.json")
    if group_size == -1:
        raise _refuse(method, f"group size -1 (one scale per output across all {k_text} inputs) is not one of "
                              f"MatMulNBits' block sizes {sizes}")
    if not block_size_ok(group_size):
        raise _refuse(method, f"group size {group_size} is not one of MatMulNBits' block sizes {sizes} "
                              f"({', '.join(map(str, MATMUL_NBITS_BLOCK_SIZES))})")
    return group_size


def _bits(method: str, bits, allowed=(4, 8)) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        shown = " and ".join(map(str, allowed))
        raise _refuse(method, f"bits {bits!r} is not supported (graphkiln maps {shown}-bit weights onto MatMulNBits)")
    return bits


def _bool(method: str, qc: dict, key: str, default: bool) -> bool:
    value = qc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _refuse(method, f"'{key}' is {value!r}, not true or false", "fix quantization_config in config.json")
    return value


def _name_list(method: str, value, key: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _refuse(method, f"'{key}' is not a list of module names", "fix quantization_config in config.json")
    return value


def _unpack_along_first(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] each holding 32/bits values along the first axis (first in the lowest
    bits) -> [R * 32/bits, C] unsigned values."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.int64) * bits)[None, :, None]
    vals = (words.astype(np.int64)[:, None, :] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0] * per, words.shape[1])


def _unpack_along_last(words: np.ndarray, bits: int) -> np.ndarray:
    """int32 words [R, C] each holding 32/bits values along the last axis -> [R, C * 32/bits]."""
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.int64) * bits)[None, None, :]
    vals = (words.astype(np.int64)[:, :, None] >> shifts) & ((1 << bits) - 1)
    return vals.reshape(words.shape[0], words.shape[1] * per)


class _Layout:
    """One quantization format: which tensors form a quantized module, their header checks, and
    their blocks."""

    method = ""
    anchor = ""  # the role whose tensor marks a module as quantized
    roles: tuple[str, ...] = ()  # every role's tensor suffix ("qweight", ...)
    optional: tuple[str, ...] = ()

    def plan(self, store: _Store) -> tuple[dict[str, dict[str, str]], list[str]]:
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
                    raise GraphkilnError(f"checkpoint tensor '{name}' is missing ({self.method}: '{module}.{self.anchor}' "
                                         f"needs it): the checkpoint is incomplete; re-download it")
            if f"{module}.weight" in store.where:
                raise GraphkilnError(f"checkpoint has both '{module}.weight' and '{module}.{self.anchor}': one module "
                                     f"stored float and {self.method}-packed; re-save the checkpoint")
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
                raise GraphkilnError(f"checkpoint tensor '{name}' has no '{module}.{self.anchor}' beside it: the "
                                     "checkpoint is incomplete; re-download it")
            passthrough.append(name)
        self.check_modules(modules)
        return modules, passthrough

    def check_modules(self, modules: dict) -> None:
        """Refuse quantized modules the config says are not converted."""

    def check_headers(self, store: _Store, module: str, parts: dict[str, str]) -> None:
        raise NotImplementedError

    def blocks(self, store: _Store, module: str, parts: dict[str, str]):
        raise NotImplementedError

    # shared header checks
    def _expect(self, store: _Store, name: str, dtypes: tuple[str, ...], shape: tuple[int, ...] | None,
                what: str) -> None:
        dtype, got = store.dtype(name), store.shape(name)
        if dtype not in dtypes:
            raise GraphkilnError(f"checkpoint tensor '{name}' is stored as {dtype}, but {self.method} {what} are "
                                 f"{'/'.join(dtypes)}: the checkpoint is corrupt or not {self.method}; re-download it")
        if shape is not None and got != shape:
            raise GraphkilnError(f"checkpoint tensor '{name}' has shape {list(got)}, but {self.method} {what} of this "
                                 f"module are {list(shape)} ({self.described(name)}): the checkpoint is truncated or "
                                 "corrupt, or quantization_config does not describe it; re-download it")

    def described(self, name: str) -> str:
        """The quantization_config values the expected shapes follow from, for messages."""
        return f"bits {self.bits}, group size {self.group}"


def _listed(module: str, pattern: str) -> bool:
    """transformers' rule for modules_to_not_convert (quantizers_utils.should_convert_module): the
    pattern matches from the start up to a module boundary, as a regex too, or is a suffix."""
    try:
        if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
            return True
    except re.error:
        pass
    return module.endswith(pattern)


def _modules_not_converted(method: str, modules: dict, names: list[str], key: str) -> None:
    """Refuse packed modules that ``key`` (modules_to_not_convert) says stay float."""
    for module in modules:
        hit = next((n for n in names if n and _listed(module, n)), None)
        if hit is not None:
            raise _refuse(method, f"'{module}' stores packed weights but {key} lists '{hit}'",
                          f"remove it from {key} in config.json, or re-quantize the checkpoint")


class _GPTQ(_Layout):
    method = "gptq"
    anchor = "qweight"
    roles = ("qweight", "qzeros", "scales", "g_idx")
    optional = ("g_idx",)

    def __init__(self, qc: dict) -> None:
        self.bits = _bits("gptq", qc.get("bits"))
        self.group = _group_block("gptq", qc.get("group_size", 128))
        self.desc_act = _bool("gptq", qc, "desc_act", False)
        fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
        fmt = fmt.lower() if isinstance(fmt, str) else fmt
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse("gptq", f"checkpoint_format {fmt!r} is not supported (graphkiln reads gptq and gptq_v2)",
                          "convert it to the gptq format with gptqmodel, or " + _FIX_FLOAT)
        self.v1 = fmt == "gptq"
        self.format = fmt
        pack = qc.get("pack_dtype", "int32")
        if pack not in (None, "int32", "torch.int32"):
            raise _refuse("gptq", f"pack_dtype {pack!r} is not supported (graphkiln reads int32 words)",
                          "re-save the checkpoint with pack_dtype int32")
        dynamic = qc.get("dynamic")
        if dynamic:
            if not isinstance(dynamic, dict):
                raise _refuse("gptq", "'dynamic' is not a mapping", "fix quantization_config in config.json")
            for rule, override in dynamic.items():
                if not str(rule).startswith("-:") and override:
                    raise _refuse("gptq", f"'dynamic' rule {rule!r} changes the layout of some modules ({override}); "
                                          "graphkiln converts one layout per checkpoint")
        self.not_converted = _name_list("gptq", qc.get("modules_to_not_convert"), "modules_to_not_convert")

    def check_modules(self, modules: dict) -> None:
        _modules_not_converted("gptq", modules, self.not_converted, "modules_to_not_convert")

    def _dims(self, store: _Store, parts: dict) -> tuple[int, int, int]:
        per = 32 // self.bits
        qw = store.shape(parts["qweight"])
        if len(qw) != 2 or 0 in qw:
            raise GraphkilnError(f"checkpoint tensor '{parts['qweight']}' has shape {list(qw)}, not [K*{self.bits}/32, "
                                 "N]: the checkpoint is corrupt; re-download it")
        k, n = qw[0] * per, qw[1]
        return k, n, math.ceil(k / self.group)

    def check_headers(self, store: _Store, module: str, parts: dict) -> None:
        self._expect(store, parts["qweight"], ("I32",), None, "qweights")
        k, n, groups = self._dims(store, parts)
        self._expect(store, parts["scales"], _FLOAT_DTYPES, (groups, n), "scales")
        self._expect(store, parts["qzeros"], ("I32",), (groups, math.ceil(n * self.bits / 32)), "qzeros")
        if "g_idx" in parts:
            self._expect(store, parts["g_idx"], ("I32", "I64"), (k,), "g_idx")
        elif self.desc_act:
            raise GraphkilnError(f"checkpoint tensor '{module}.g_idx' is missing, and desc_act (act-order) needs it "
                                 "to place the inputs in groups: re-download the checkpoint")

    def blocks(self, store: _Store, module: str, parts: dict):
        k, n, groups = self._dims(store, parts)
        limit = 1 << self.bits
        scales = store.floats(parts["scales"])  # [G, N]
        if "g_idx" in parts:
            g_idx = store.ints(parts["g_idx"])
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
                bad = int(g_idx[(g_idx < 0) | (g_idx >= groups)][0])
                raise GraphkilnError(f"checkpoint tensor '{parts['g_idx']}' names group {bad}, but the module has "
                                     f"{groups} groups (0..{groups - 1}): the checkpoint is corrupt; re-download it")
            if not np.array_equal(g_idx, np.arange(k) // self.group):
                raise _refuse("gptq", f"'{parts['g_idx']}' orders the inputs by activation (act-order, desc_act): its "
                                      "groups are not contiguous runs of inputs, which MatMulNBits blocks cannot express",
                              "re-quantize without desc_act, or " + _FIX_FLOAT)
        codes = _unpack_along_first(store.ints(parts["qweight"]), self.bits)  # [K, N]
        zeros = _unpack_along_last(store.ints(parts["qzeros"]), self.bits)[:, :n]  # [G, N]
        if self.v1:  # gptq v1 stores zero - 1
            zeros = zeros + 1
            if (zeros >= limit).any():
                raise GraphkilnError(f"checkpoint tensor '{parts['qzeros']}' stores {limit - 1} for a zero point "
                                     f"(gptq v1 stores zero - 1: a zero point of {limit}, which {self.bits}-bit blocks "
                                     "cannot hold and kernels read differently): convert the checkpoint to gptq_v2 "
                                     "with gptqmodel, or " + _FIX_FLOAT)
        return _blocks(codes.T, scales.T, zeros.T, self.bits, self.group, self.format, parts["scales"])


class _AWQ(_Layout):
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
            raise _refuse("awq", f"version {version!r} is not supported (graphkiln reads autoawq's GEMM layout)",
                          "re-save it in the gemm version, or " + _FIX_FLOAT)
        self.bits = _bits("awq", qc.get("bits", qc.get("w_bit", 4)), (4,))
        self.group = _group_block("awq", qc.get("group_size", qc.get("q_group_size", 128)))
        if not _bool("awq", qc, "zero_point", True):
            raise _refuse("awq", "zero_point false is not a layout autoawq's GEMM writes")
        self.not_converted = _name_list("awq", qc.get("modules_to_not_convert"), "modules_to_not_convert")

    def check_modules(self, modules: dict) -> None:
        _modules_not_converted("awq", modules, self.not_converted, "modules_to_not_convert")

    def _dims(self, store: _Store, parts: dict) -> tuple[int, int, int]:
        qw = store.shape(parts["qweight"])
        if len(qw) != 2 or 0 in qw:
            raise GraphkilnError(f"checkpoint tensor '{parts['qweight']}' has shape {list(qw)}, not [K, N/8]: the "
                                 "checkpoint is corrupt; re-download it")
        k, n = qw[0], qw[1] * 8
        return k, n, math.ceil(k / self.group)

    def check_headers(self, store: _Store, module: str, parts: dict) -> None:
        self._expect(store, parts["qweight"], ("I32",), None, "qweights")
        k, n, groups = self._dims(store, parts)
        self._expect(store, parts["scales"], _FLOAT_DTYPES, (groups, n), "scales")
        self._expect(store, parts["qzeros"], ("I32",), (groups, n // 8), "qzeros")

    def _unpack(self, words: np.ndarray) -> np.ndarray:
        vals = _unpack_along_last(words, 4).reshape(words.shape[0], words.shape[1], 8)
        out = np.empty_like(vals)
        out[:, :, list(self.ORDER)] = vals
        return out.reshape(words.shape[0], -1)

    def blocks(self, store: _Store, module: str, parts: dict):
        scales = store.floats(parts["scales"])  # [G, N]
        codes = self._unpack(store.ints(parts["qweight"]))  # [K, N]
        zeros = self._unpack(store.ints(parts["qzeros"]))  # [G, N]
        return _blocks(codes.T, scales.T, zeros.T, self.bits, self.group, "awq", parts["scales"])


class _CompressedTensors(_Layout):
    method = "compressed-tensors"
    anchor = "weight_packed"
    roles = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
    optional = ("weight_zero_point", "weight_g_idx")

    def __init__(self, qc: dict) -> None:
        m = self.method
        fmt = qc.get("format")
        for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
            if qc.get(key):
                raise _refuse(m, f"'{key}' is set: graphkiln converts weight-only int quantization and cannot honor it")
        groups = qc.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise _refuse(m, "'config_groups' is missing or empty", "fix quantization_config in config.json")
        self.schemes = []  # (group name, targets, weight args)
        for gname, group in groups.items():
            if not isinstance(group, dict):
                raise _refuse(m, f"config group {gname!r} is not a mapping", "fix quantization_config in config.json")
            gfmt = group.get("format") or fmt
            if gfmt != "pack-quantized":
                raise _refuse(m, f"format {gfmt!r} (config group {gname!r}) is not supported (graphkiln reads "
                                 "pack-quantized int weights)")
            for act in ("input_activations", "output_activations"):
                if group.get(act):
                    raise _refuse(m, f"config group {gname!r} quantizes {act.replace('_', ' ')}, which weight-only "
                                     "MatMulNBits cannot honor")
            w = group.get("weights")
            if not isinstance(w, dict):
                raise _refuse(m, f"config group {gname!r} has no 'weights' scheme")
            if w.get("type", "int") != "int":
                raise _refuse(m, f"config group {gname!r} quantizes weights as {w.get('type')!r}, not int")
            if w.get("dynamic"):
                raise _refuse(m, f"config group {gname!r} quantizes weights dynamically")
            bits = _bits(m, w.get("num_bits"))
            strategy, gs = w.get("strategy"), w.get("group_size")
            if gs is not None and gs != -1:
                _group_block(m, gs)  # not an integer: one line
            if strategy is None:  # as QuantizationArgs infers it
                known = isinstance(gs, int) and not isinstance(gs, bool)
                strategy = "group" if known and gs > 0 else "channel" if gs == -1 else "tensor"
            if strategy == "channel":
                raise _refuse(m, "strategy channel (one scale per output across all K inputs) is not one of "
                                 "MatMulNBits' block sizes 16..256")
            if strategy != "group":
                raise _refuse(m, f"strategy {strategy!r} (config group {gname!r}) is not supported (graphkiln maps "
                                 "group-wise weights)")
            block = _group_block(m, w.get("group_size"))
            symmetric = w.get("symmetric", True)
            if not isinstance(symmetric, bool):
                raise _refuse(m, f"'symmetric' is {symmetric!r}", "fix quantization_config in config.json")
            targets = _name_list(m, group.get("targets"), f"config_groups.{gname}.targets")
            self.schemes.append((gname, targets, (bits, block, symmetric)))
        self.ignore = _name_list(m, qc.get("ignore"), "ignore")

    @staticmethod
    def _match(module: str, target: str) -> bool:
        """compressed-tensors' match_name; a class name target ('Linear') matches every packed module,
        each of which is a Linear."""
        if target.startswith("re:"):
            try:
                return re.match(target[3:], module) is not None
            except re.error:
                raise _refuse("compressed-tensors", f"target {target!r} is not a valid regular expression",
                              "fix quantization_config in config.json") from None
        return target == module or target == "Linear"

    def check_modules(self, modules: dict) -> None:
        self.scheme = {}
        for module in modules:
            ignored = next((t for t in self.ignore if t != "Linear" and self._match(module, t)), None)
            if ignored is not None:
                raise _refuse(self.method, f"'{module}' stores packed weights but 'ignore' lists {ignored!r}",
                              "remove it from 'ignore' in config.json, or re-quantize the checkpoint")
            found = {args for _, targets, args in self.schemes if any(self._match(module, t) for t in targets)}
            if not found:
                raise _refuse(self.method, f"'{module}' stores packed weights but no config group targets it",
                              "fix quantization_config in config.json")
            if len(found) > 1:
                raise _refuse(self.method, f"'{module}' is targeted by config groups with different weight schemes")
            self.scheme[module] = found.pop()

    def described(self, name: str) -> str:
        bits, block, _ = self.scheme[name.rpartition(".")[0]]
        return f"bits {bits}, group size {block}"

    def _dims(self, store: _Store, module: str, parts: dict) -> tuple[int, int, int]:
        bits, block, _ = self.scheme[module]
        shape = store.shape(parts["weight_shape"])
        if shape != (2,):
            raise GraphkilnError(f"checkpoint tensor '{parts['weight_shape']}' has shape {list(shape)}, not [2]: the "
                                 "checkpoint is corrupt; re-download it")
        n, k = (int(v) for v in store.ints(parts["weight_shape"]))
        if n <= 0 or k <= 0:
            raise GraphkilnError(f"checkpoint tensor '{parts['weight_shape']}' says the weight is [{n}, {k}]: the "
                                 "checkpoint is corrupt; re-download it")
        return n, k, math.ceil(k / block)

    def check_headers(self, store: _Store, module: str, parts: dict) -> None:
        bits, block, symmetric = self.scheme[module]
        self._expect(store, parts["weight_shape"], ("I64", "I32"), None, "weight shapes")
        n, k, groups = self._dims(store, module, parts)
        self._expect(store, parts["weight_packed"], ("I32",), (n, math.ceil(k * bits / 32)), "packed weights")
        self._expect(store, parts["weight_scale"], _FLOAT_DTYPES, (n, groups), "weight scales")
        zp = parts.get("weight_zero_point")
        if symmetric and zp is not None:
            raise GraphkilnError(f"checkpoint tensor '{zp}' is a zero point, but the scheme is symmetric: fix "
                                 "'symmetric' in config.json or re-download the checkpoint")
        if not symmetric:
            if zp is None:
                raise GraphkilnError(f"checkpoint tensor '{module}.weight_zero_point' is missing (the scheme is "
                                     "asymmetric): the checkpoint is incomplete; re-download it")
            if store.dtype(zp) == "I32":
                self._expect(store, zp, ("I32",), (math.ceil(n * bits / 32), groups), "packed zero points")
            else:
                self._expect(store, zp, ("I8",), (n, groups), "zero points")
        if "weight_g_idx" in parts:
            self._expect(store, parts["weight_g_idx"], ("I32", "I64"), (k,), "g_idx")

    def blocks(self, store: _Store, module: str, parts: dict):
        bits, block, symmetric = self.scheme[module]
        n, k, groups = self._dims(store, module, parts)
        offset = 1 << (bits - 1)
        scales = store.floats(parts["weight_scale"])  # [N, G]
        if "weight_g_idx" in parts:
            g_idx = store.ints(parts["weight_g_idx"])
            if g_idx.size and (g_idx.min() < 0 or g_idx.max() >= groups):
                raise GraphkilnError(f"checkpoint tensor '{parts['weight_g_idx']}' names groups outside 0..{groups - 1}: "
                                     "the checkpoint is corrupt; re-download it")
            if not np.array_equal(g_idx, np.arange(k) // block):
                raise _refuse(self.method, f"'{parts['weight_g_idx']}' orders the inputs by activation (actorder "
                                           "group): its groups are not contiguous runs of inputs, which MatMulNBits "
                                           "blocks cannot express", "re-quantize without actorder group, or " + _FIX_FLOAT)
        codes = _unpack_along_last(store.ints(parts["weight_packed"]), bits)[:, :k]  # [N, K], value + offset
        if symmetric:
            zeros = np.full((n, groups), offset, np.int64)
        elif store.dtype(parts["weight_zero_point"]) == "I32":
            zeros = _unpack_along_first(store.ints(parts["weight_zero_point"]), bits)[:n]  # stored as zp + offset
        else:
            zeros = store.ints(parts["weight_zero_point"])
            if zeros.min() < -offset or zeros.max() >= offset:
                raise GraphkilnError(f"checkpoint tensor '{parts['weight_zero_point']}' holds zero points outside "
                                     f"[{-offset}, {offset - 1}]: the checkpoint is corrupt; re-download it")
            zeros = zeros + offset
        return _blocks(codes, scales, zeros, bits, block, self.method, parts["weight_scale"])


def _blocks(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray, bits: int, block: int, fmt: str, name: str):
    """BlockQuantized from [N, K] codes and [N, G] scales / zero points (values already in range)."""
    from graphkiln.models.prequantized import BlockQuantized

    try:
        return BlockQuantized(np.ascontiguousarray(codes, dtype=np.uint8), np.ascontiguousarray(scales, np.float32),
                              np.ascontiguousarray(zeros, dtype=np.uint8), bits, block, fmt)
    except ValueError as exc:  # shapes are checked from the headers first: a guard, named all the same
        raise GraphkilnError(f"checkpoint tensor '{name}' does not fit its module's blocks ({exc}): the checkpoint "
                             "is corrupt; re-download it") from None


def layout_for(qc) -> _Layout:
    """The layout of a ``quantization_config``, or a one-line refusal of what it cannot map."""
    if not isinstance(qc, dict):
        raise GraphkilnError("config.json: 'quantization_config' is not a mapping: fix or re-save config.json")
    method = qc.get("quant_method")
    if method == "gptq":
        return _GPTQ(qc)
    if method == "awq":
        return _AWQ(qc)
    if method == "compressed-tensors":
        return _CompressedTensors(qc)
    raise GraphkilnError(f"quantized checkpoints (quant_method {method}) are not converted by graphkiln (it reads "
                         "gptq, awq, compressed-tensors): export the unquantized checkpoint and use --quant")
