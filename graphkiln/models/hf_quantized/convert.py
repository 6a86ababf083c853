"""Converting a pre-quantized checkpoint directory: the quantization_config's layout plans the
quantized modules, every header is checked before anything is written, then the non-weight files,
config.json without its quantization_config, the tensors (dequantized weights in place of packed
ones) and the blocks' sidecar are written (see the package docstring)."""

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
from graphkiln.models.hf_quantized.shards import ShardWriter, Store
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


def convert_quantized_checkpoint(src: Path, dest: Path, bits: int | None = None,
                                 block_size: int | None = None) -> str | None:
    """Convert the GPTQ / AWQ / compressed-tensors / FP8 / NVFP4 checkpoint directory ``src`` into
    the ordinary checkpoint directory ``dest`` (see the module docstring); one ``GraphkilnError``
    line when the checkpoint is malformed or its layout does not map onto MatMulNBits (``dest``
    removed then). ``bits``/``block_size``: the export's ``--quant`` width and block size, for the
    formats whose blocks are chosen on conversion (``Layout.request``). Returns the layout's
    one-line summary (e.g. the blocks' error against the stored values), or None."""
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
    return layout.summary()


def _write(src: Path, dest: Path, raw: dict, store: "Store", layout: "Layout", modules: dict,
           passthrough: list[str]) -> None:
    from graphkiln.models.prequantized import write_sidecar

    for path in sorted(src.iterdir()):  # the non-weight files, by checkpoint_files' rules (links inside only)
        if path.name in _SKIPPED_FILES or path.suffix.lower() in _SKIPPED_SUFFIXES or path.name.startswith("."):
            continue
        if path.is_dir():  # a subfolder is nothing export reads; a FIFO or a dangling link is refused below
            continue
        with checkpoint_files.open_file(path, src, _COPY_FIX) as f, open(dest / path.name, "wb") as out:
            shutil.copyfileobj(f, out)
    config = {k: v for k, v in raw.items() if k != "quantization_config"}
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # tensors in the source's order, each quantized module's weight where its packed weight was
    anchor = {parts[layout.anchor]: module for module, parts in modules.items()}
    order = sorted([*passthrough, *anchor], key=lambda n: (store.order(n), n))
    writer = ShardWriter(dest)
    blocks = {}
    for name in order:
        if name in anchor:
            module = anchor[name]
            b = layout.blocks(store, module, modules[module])
            blocks[f"{module}.weight"] = b
            writer.add(f"{module}.weight", _torch(layout.weight(store, module, modules[module], b)))
        else:
            writer.add(name, store.tensor(name))
    writer.close()
    write_sidecar(dest, blocks)


def _torch(a: np.ndarray):
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


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
