"""Converting a pre-quantized checkpoint directory: the quantization_config's layout plans the
quantized modules, every header is checked and every module's blocks made once before anything is
written, then the non-weight files and config.json without its quantization_config are written;
the weights are not: they are read from the source when the export reads them (``models.derived``:
the float tensors in place, each quantized module's float weight from its blocks; see the package
docstring)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models import checkpoint_files
from graphkiln.models.hf_quantized.awq import AWQ
from graphkiln.models.hf_quantized.compressed_tensors import CompressedTensors
from graphkiln.models.hf_quantized.fp8 import FP8, float_quantized
from graphkiln.models.hf_quantized.gptq import GPTQ
from graphkiln.models.hf_quantized.layout import Layout
from graphkiln.models.hf_quantized.nvfp4 import modelopt_layout
from graphkiln.models.hf_quantized.shards import Store
from graphkiln.untrusted import show

# Files of the source directory not copied into the converted one: weights (rewritten, or formats
# never read), and the quantizers' own config files, which describe weights the copy no longer has.
_SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".msgpack", ".h5",
                     ".gguf", ".npz", ".npy")
_SKIPPED_FILES = ("config.json", "model.safetensors.index.json", "quantize_config.json", "quant_config.json",
                  "quantization_config.json", "hf_quant_config.json")
_COPY_FIX = "replace it with the file itself, inside the checkpoint, or remove it"
# What layout_for reads, for refusals
READS = ("gptq, awq, compressed-tensors (pack-quantized int, float-quantized FP8), fp8 (block-scaled e4m3), "
         "modelopt (NVFP4, FP8)")
# A quantization_config nests 4 levels (compressed-tensors' config_groups.NAME.weights.KEY)
MAX_CONFIG_DEPTH = 32


def convert_quantized_checkpoint(src: Path, dest: Path, bits: int | None = None, block_size: int | None = None,
                                 preflight=None) -> "DerivedWeights":
    """Convert the GPTQ / AWQ / compressed-tensors / FP8 / NVFP4 checkpoint directory ``src`` into
    the checkpoint directory ``dest`` (its small files; see the package docstring) and return its
    tensors (``models.derived``: the float tensors read in place from ``src``'s shards, each
    quantized module's float weight made from its blocks when read), to be registered for
    ``dest``; ``.summary`` is the layout's one-line summary (e.g. the blocks' error against the
    stored values), or None. Every header is checked and every module's blocks made once (one
    module at a time, then dropped) before anything is written; ``preflight(ConversionNeeds)`` is
    called before that. One ``GraphkilnError`` line when the checkpoint is malformed or its layout
    does not map onto MatMulNBits (``dest`` removed then). ``bits``/``block_size``: the export's
    ``--quant`` width and block size, for the formats whose blocks are chosen on conversion
    (``Layout.request``)."""
    from graphkiln.models.hf_quantized.nvfp4 import modelopt_config
    from graphkiln.models.weights import read_config

    src, dest = Path(src), Path(dest)
    raw = read_config(src)
    qc = raw.get("quantization_config")
    if qc is None:  # ModelOpt writes its quantization into hf_quant_config.json
        qc = modelopt_config(src)
    layout = layout_for(qc)
    layout.request(bits, block_size)
    store = Store(src)
    try:
        modules, passthrough = layout.plan(store)
        for module, parts in modules.items():  # every header checked before anything is written
            layout.check_headers(store, module, parts)
        if preflight is not None:
            preflight(_needs(src, store, modules))
        derived = _derive(store, layout, modules, passthrough)
        derived.summary = layout.summary()
        created = not dest.exists()
        dest.mkdir(parents=True, exist_ok=True)
        try:
            _write(src, dest, raw)
        except BaseException:
            if created:
                shutil.rmtree(dest, ignore_errors=True)
            raise
    except BaseException:
        store.close()
        raise
    derived.on_close.append(store.close)
    return derived


def _copied(src: Path) -> list[Path]:
    """The source's files copied into the converted directory: every file but weights and the
    quantizers' own configs (a FIFO or a dangling link is refused when it is opened)."""
    return [path for path in sorted(src.iterdir())
            if not (path.name in _SKIPPED_FILES or path.suffix.lower() in _SKIPPED_SUFFIXES
                    or path.name.startswith(".") or path.is_dir())]


# bytes held while one module's blocks are made, per weight: the packed words as int64, the
# unpacking's int64 shifts and masks, the codes (measured with tracemalloc: 10.0 on a 4-bit GPTQ
# module of Llama-3.2-1B's MLP, 2026-12-06)
_WORK_PER_WEIGHT = 12
# what reading a module's float rows holds beyond those rows, per float32 byte: its blocks made
# (10 bytes a weight) and dequantized (9 more, its 4-byte output included): 3.75, measured
_READ_WORK = 4.0


def _needs(src: Path, store: "Store", modules: dict) -> "ConversionNeeds":
    """The conversion's peak memory (the tools and the largest module's blocks being made) and the
    bytes it writes (the copied small files and config.json), from the headers alone."""
    from graphkiln.models.derived import BASE_CONVERSION_BYTES, SMALL_FILES_BYTES, ConversionNeeds

    largest = max((_weights_of(store, parts) for parts in modules.values()), default=0)
    files = 0
    for path in _copied(src):
        try:
            files += path.stat().st_size
        except OSError:
            pass  # refused, with its own message, when it is opened
    return ConversionNeeds(BASE_CONVERSION_BYTES + largest * _WORK_PER_WEIGHT, files + SMALL_FILES_BYTES,
                           "converting the quantized checkpoint")


# weights per stored element of a module's packed tensor: int32 words (up to 8 4-bit values), FP8
# values, NVFP4 bytes (two E2M1 codes)
_WEIGHTS_PER_ELEMENT = {"I32": 8, "U32": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U8": 2}


def _weights_of(store: "Store", parts: dict) -> int:
    """About the number of weights a module holds, from its packed tensors (_WEIGHTS_PER_ELEMENT)."""
    return max((int(np.prod(store.shape(n), dtype=np.int64)) * _WEIGHTS_PER_ELEMENT[store.dtype(n)]
                for n in parts.values() if store.dtype(n) in _WEIGHTS_PER_ELEMENT), default=0)


def _derive(store: "Store", layout: "Layout", modules: dict, passthrough: list[str]) -> "DerivedWeights":
    """The converted checkpoint's tensors: the passthrough tensors in the source's shards, each
    quantized module's float weight (``Layout.weight``) made from its blocks when read. Each
    module's blocks are made here once (checking the stored values: ranges, non-finite scales,
    g_idx; a layout's summary counts them), one module at a time, and dropped: what the export
    plans with (bits, block size, shape, centered zero points) is kept."""
    from graphkiln.models.derived import DerivedTensor, DerivedWeights
    from graphkiln.models.prequantized import StoredBlocks

    derived = DerivedWeights(shards={name: store.where[name] for name in passthrough})
    last = _LastModule(store, layout, modules)
    for module, parts in sorted(modules.items(), key=lambda mp: store.order(mp[1][layout.anchor])):
        b = layout.blocks(store, module, parts)
        blocks = StoredBlocks(b.shape, b.bits, b.block_size, b.format, b.centered,
                              lambda m=module: layout.blocks(store, m, modules[m])) if layout.offers_blocks else None
        derived.tensors[f"{module}.weight"] = DerivedTensor(tuple(b.shape), lambda a, z, m=module: last.rows(m, a, z),
                                                            blocks, _READ_WORK)
        del b
    return derived


class _LastModule:
    """A module's float rows (``Layout.weight``, from its blocks); what the module read last needs
    (its blocks, or its float weight when the layout keeps its own values) is kept while its rows
    are read in bands (a table), and dropped once its last row has been read."""

    def __init__(self, store: "Store", layout: "Layout", modules: dict) -> None:
        self.store, self.layout, self.modules = store, layout, modules
        self.kept: tuple[str, object] | None = None
        # the default weight is the blocks' values: rows are dequantized from the blocks' rows
        self.from_blocks = type(layout).weight is Layout.weight

    def rows(self, module: str, start: int, stop: int) -> np.ndarray:
        from graphkiln.models.prequantized import BlockQuantized

        parts = self.modules[module]
        if self.kept is not None and self.kept[0] == module:
            held = self.kept[1]
        else:
            self.kept = None
            b = self.layout.blocks(self.store, module, parts)
            held = b if self.from_blocks else self.layout.weight(self.store, module, parts, b)
            del b
        n = held.shape[0]
        self.kept = (module, held) if (start > 0 or stop < n) and stop < n else None
        if not self.from_blocks:
            return np.ascontiguousarray(held[start:stop], dtype=np.float32)
        if start == 0 and stop >= n:
            return held.dequantize()
        return BlockQuantized(held.codes[start:stop], held.scales[start:stop], held.zero_points[start:stop],
                              held.bits, held.block_size, held.format).dequantize()


def _write(src: Path, dest: Path, raw: dict) -> None:
    """The converted directory's files: the source's non-weight files, by checkpoint_files' rules
    (links inside only), and config.json without its quantization_config."""
    for path in _copied(src):
        with checkpoint_files.open_file(path, src, _COPY_FIX) as f, open(dest / path.name, "wb") as out:
            shutil.copyfileobj(f, out)
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _nesting(value) -> int:
    """How deeply dicts and lists nest in ``value``, counted without recursing (a deep value would
    exhaust the stack) and no further than past ``MAX_CONFIG_DEPTH``."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= MAX_CONFIG_DEPTH:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def layout_for(qc) -> Layout:
    """The layout of a ``quantization_config``, or a one-line refusal of what it cannot map. The
    config is untrusted: nested deeper than ``MAX_CONFIG_DEPTH`` it is refused before any value of it
    is read or shown in a message (whose repr would recurse through it)."""
    if not isinstance(qc, dict):
        raise GraphkilnError("config.json: 'quantization_config' is not a mapping: fix or re-save config.json")
    if _nesting(qc) > MAX_CONFIG_DEPTH:
        raise GraphkilnError(f"config.json: 'quantization_config' nests deeper than {MAX_CONFIG_DEPTH} levels (the "
                             "formats graphkiln reads nest 4): fix or re-save config.json")
    method = qc.get("quant_method")
    if method == "gptq":
        return GPTQ(qc)
    if method == "awq":
        return AWQ(qc)
    if method == "compressed-tensors":
        if float_quantized(qc):
            return FP8.from_compressed_tensors(qc)
        return CompressedTensors(qc)
    if method == "fp8":
        return FP8.from_fp8_config(qc)
    if method == "modelopt":
        return modelopt_layout(qc)
    raise GraphkilnError(f"quantized checkpoints (quant_method {show(method)}) are not converted by graphkiln (it "
                         f"reads {READS}): export the unquantized checkpoint and use --quant")
