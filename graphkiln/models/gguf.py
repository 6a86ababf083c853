"""GGUF files as export input: ``graphkiln export model.gguf -o ART`` (and ``verify --reference model.gguf``).

``convert_gguf`` turns a llama.cpp GGUF file into a checkpoint directory, which export and verify
then read like any other (``export.checkpoint.prepared_checkpoint`` calls it into a temporary
directory and registers the tensors it returns for that directory, ``models.derived``):

* The tensors: not written. Each is made when read, from the file's bytes, a band of rows at a
  time (``_row_reader``): *dequantized* to float32 under its Hugging Face name, the very values
  transformers' own GGUF loader produces (``AutoModelForCausalLM.from_pretrained(dir,
  gguf_file=...)``): the same bytes through the same ``gguf.dequantize``, the same name map (the
  gguf package's, as ``get_gguf_hf_weights_map`` applies it) and the same tensor processor, which
  for ``llama`` GGUFs undoes the row permutation llama.cpp's converter applies to ``attn_q`` /
  ``attn_k`` (found once by running the processor on the row indices). ``verify --reference
  model.gguf`` loads them. A tied head (no ``output.weight`` in the file) is not listed. Tensors
  transformers does not load (``rope_freqs``) are skipped as it skips them. The conversion reads
  one row of each tensor (its type must dequantize to floats), nothing more.
* ``config.json`` (``architectures`` set, no ``quantization_config``), ``generation_config.json`` and
  the tokenizer (``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja`` from the
  file's ``tokenizer.chat_template``) as transformers builds them from the file's metadata.
* The stored blocks (``models.prequantized.StoredBlocks``, made when the quantizer asks) of the
  2-D weights (Linear layers, token embedding, head) stored in a type that maps onto
  ``MatMulNBits`` exactly, so the artifact computes with the file's own integers:

  - ``Q4_0``: ``w = d * (q - 8)``, q in 0..15, fp16 d per block of 32 -> codes q, zero point 8,
    scale d (fp16 -> float32 is exact), block 32, 4 bits.
  - ``Q8_0``: ``w = d * q``, q int8 -> codes q + 128, zero point 128, scale d, block 32, 8 bits.

  The blocks are permuted like the float rows (the permutation is of rows N, the blocks run along
  K), and each tensor's ``BlockQuantized.dequantize()`` is checked bit for bit against its float
  rows when the blocks are made, a band at a time (exact by construction: both are one float32
  product of the same operands; a mismatch is one error line).

* ``Q4_1`` (``w = d * q + m``, fp16 d and m per block of 32) does *not* map: MatMulNBits' integer
  zero points need ``m = -z * d`` with z an integer in 0..15 (then ``d * q + m == (q - z) * d``
  exactly in float32), i.e. ``-m / d`` integral in every block of a tensor, and llama.cpp picks
  ``m`` as the block minimum and ``d = (max - min) / 15``, so it rarely is (measured on
  SmolLM2-135M-Instruct's Q4_1 file: 8,992 of its 3,317,760 blocks, 0.27%, and no whole tensor).
  MatMulNBits' float zero points would fit, but its CPU kernel runs ~60x slower with them
  (``models.prequantized``). So
  ``Q4_1`` weights, like K-quants, ``Q5_*``, IQ types, F16, BF16 and F32, are dequantized only, and
  the export quantizes them per ``--quant`` (without it: to the bits most of the stored Q4_0 /
  Q8_0 blocks have, ``export.pipeline``).
* A ``llama`` GGUF whose ``general.name`` is ``mistral`` is a ``MistralForCausalLM`` for
  transformers (its config defaults included: ``sliding_window`` 4096), whose GGUF loader then finds
  no tensor names for it and raises; graphkiln maps it with llama's names and permutation, which are
  its tensors'.

A GGUF file is untrusted input: its header is read by ``read_layout``, every count, length, type and
tensor extent checked against the file's size before anything loops over it (``gguf.GGUFReader``
walks declared counts unchecked, and parses every vocabulary string: ~3 s for a 49k vocabulary;
transformers' tokenizer load still runs it, on a file this check passed); ``tensor_data`` hands
``gguf.dequantize`` the bytes ``GGUFReader`` would. Every failure -- not a GGUF file, truncated, an
architecture or tensor type graphkiln cannot convert, metadata that disagrees with the tensors --
is one ``GraphkilnError`` line. Nothing is written outside ``dest``.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError
from graphkiln.models.derived import BASE_CONVERSION_BYTES, SMALL_FILES_BYTES, ConversionNeeds
from graphkiln.untrusted import show

# GGUF ``general.architecture`` values converted (transformers' GGUF loader reads them, graphkiln
# exports the resulting family); a llama GGUF named "mistral" becomes MistralForCausalLM.
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_FIX = "re-download it, or convert the model again with llama.cpp's convert_hf_to_gguf.py"


def convert_gguf(gguf: Path, dest: Path, preflight=None) -> "DerivedWeights":
    """Write the checkpoint directory ``dest`` (created here: its small files; see the module
    docstring) from the GGUF file ``gguf``, and return its tensors (``models.derived``), to be
    registered for ``dest``. ``preflight(ConversionNeeds)`` is called before anything is written."""
    path = Path(gguf)
    name = show(path.name)  # every message names the file through show(): a file name is untrusted text
    try:
        import gguf as gguf_pkg  # noqa: F401
    except ImportError:
        raise GraphkilnError("exporting a GGUF file needs the gguf package: pip install 'graphkiln[export]'") from None
    layout = read_layout(path)
    arch = layout.metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise GraphkilnError(f"{name} has no 'general.architecture' string in its metadata: {_FIX}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GraphkilnError(f"{name} is a GGUF of architecture {show(arch, 40)}, which graphkiln does not convert (it "
                             f"converts {', '.join(SUPPORTED_ARCHITECTURES)} GGUF files): export the model's Hugging "
                             "Face checkpoint instead")
    raw, config = _config(layout, name)
    _check_metadata(layout, config, name)
    model_cls, expected, mapping, processor = _plan(config, raw, arch, name)
    derived = _derive_tensors(path, layout, name, expected, mapping, processor)
    if preflight is not None:
        preflight(ConversionNeeds(BASE_CONVERSION_BYTES, SMALL_FILES_BYTES, "converting the GGUF file"))
    dest.mkdir(parents=True)
    _write_tokenizer(path, layout, dest, name)  # first: transformers looks in ``dest`` for tokenizer files
    _write_config(dest, config, model_cls)
    return derived


# --------------------------------------------------------------------------- metadata


def _config(layout: "Layout", name: str):
    """(the raw config dict, the model config) that ``AutoConfig.from_pretrained(dir, gguf_file=...)``
    builds: transformers' legacy GGUF metadata mapping (``load_gguf_checkpoint``) applied to the
    metadata ``read_layout`` read, not to a second ``gguf.GGUFReader`` parse of the whole file (which
    costs ~4 s for a 49k vocabulary; the tokenizer's load pays it once more). The tests compare the
    result with AutoConfig's."""
    from transformers import CONFIG_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_TO_TRANSFORMERS_MAPPING

    meta = layout.metadata
    arch = meta["general.architecture"]
    # load_gguf_checkpoint: ``"mistral" in read_field(reader, "general.name")``, a list: the name is "mistral"
    updated = "mistral" if "llama" in arch and meta.get("general.name") == "mistral" else arch
    raw = {"tie_word_embeddings": all(t.name != "output.weight" for t in layout.tensors)}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated) or GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {}
    for key, value in defaults.items():
        raw.setdefault(key, value)
    renames = GGUF_TO_TRANSFORMERS_MAPPING["config"]
    for key, value in meta.items():
        prefix, _, config_key = key.replace(arch, updated).partition(".")
        target = renames.get(prefix, {}).get(config_key)
        if target is None or target == -1:
            continue
        if isinstance(value, ArrayInfo):
            raise GraphkilnError(f"{name}: its metadata {show(key)} is an array of {value.count} values where "
                                 f"transformers reads one ({target}): graphkiln does not convert such files")
        raw[target] = value.replace(arch, updated) if isinstance(value, str) and arch in value else value
    if "vocab_size" not in raw and isinstance(meta.get("tokenizer.ggml.tokens"), ArrayInfo):
        raw["vocab_size"] = meta["tokenizer.ggml.tokens"].count
    try:
        config = CONFIG_MAPPING[raw["model_type"]].from_dict(dict(raw))
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot build a config from the metadata of {name} ({_why(exc)}): "
                             f"{_FIX}") from None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return raw, config


def _check_metadata(layout: "Layout", config, name: str) -> None:
    """The metadata's sizes against the tensors' (bounded by the file's size): a hostile block count
    or width is refused before a model is built from it."""
    shapes = {t.name: t.shape for t in layout.tensors}
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.") and n.split(".")[1].isdigit()}
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise GraphkilnError(f"{name} has no 2-D token_embd.weight tensor: {_FIX}")
    found = {"num_hidden_layers": max(blocks) + 1 if blocks else 0, "vocab_size": embed[0], "hidden_size": embed[1]}
    for key, value in found.items():
        if getattr(config, key, None) != value:
            raise GraphkilnError(f"{name}: its metadata gives {key} {show(getattr(config, key, None))}, its tensors "
                                 f"{value}: the file is inconsistent; {_FIX}")


def _plan(config, raw_config: dict, arch: str, name: str):
    """(model class name, {HF name: shape} of every tensor the model loads, GGUF -> HF name map,
    transformers' tensor processor for this architecture), from a model built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=raw_config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
        mapping = gguf_name_map(config.model_type, config.num_hidden_layers, expected, processor)
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot build the model {name} describes ({_why(exc)}): {_FIX}") from None
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    return type(model).__name__, expected, mapping, processor


def gguf_name_map(model_type: str, num_layers: int, hf_names, processor) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name for the model's ``hf_names``: transformers'
    ``get_gguf_hf_weights_map`` for a decoder whose state-dict names all resolve at the top level
    (the Llama family's do), which that function re-derives for every submodule (~10 s for a
    30-layer model); ``mistral`` (a llama GGUF named so) takes llama's names, as its tensors are."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    gguf_type = {"mistral": "llama"}.get(model_type, model_type)
    arch = next((k for k, v in MODEL_ARCH_NAMES.items() if v == gguf_type), None)
    if arch is None:
        raise ValueError(f"the gguf package knows no tensor names for model type {model_type}")
    names = get_tensor_name_map(arch, num_layers)
    out = {}
    for hf_name in hf_names:
        hf_name = processor.preprocess_name(hf_name)
        stem, suffix = hf_name, ""
        if hf_name.endswith((".weight", ".bias")):
            stem, suffix = hf_name.rsplit(".", 1)
            suffix = "." + suffix
        gguf_name = names.get_name(stem)
        if gguf_name is None:
            processor.perform_fallback_tensor_mapping(out, suffix, "", hf_name)
        else:
            out[gguf_name + suffix] = hf_name
    return out


# --------------------------------------------------------------------------- tensors


def tensor_data(path: Path, layout: "Layout", t: "TensorInfo", blob: np.ndarray | None = None) -> np.ndarray:
    """A tensor's bytes as ``gguf.GGUFReader`` presents them (``ReaderTensor.data``): the values
    for F32/F16, ``[..., bytes per row]`` uint8 for block types; read-only, memory-mapped (``blob``:
    the file already mapped)."""
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quant_shape_to_byte_shape

    if blob is None:
        blob = np.memmap(path, dtype=np.uint8, mode="r")
    raw = blob[layout.data_start + t.offset: layout.data_start + t.offset + t.nbytes]
    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
             Q.I32: np.int32, Q.I64: np.int64}
    if t.qtype in plain:
        return raw.view(plain[t.qtype]).reshape(t.shape)
    return raw.reshape(quant_shape_to_byte_shape(t.shape, t.qtype))


# bytes held beyond a tensor's float32 rows, per output byte, while it is read: gguf's numpy
# dequantization holds float32 temporaries of the output's size (measured with tracemalloc on
# Q4_0 Llama-3.2-1B-shaped weights: 2.1-2.3x the output in all; making and checking its stored
# blocks 3.4-3.6x); plain types only convert
_WORK_QUANT, _WORK_PLAIN = 3.0, 0.5


def _derive_tensors(path: Path, layout: "Layout", name: str, expected: dict, mapping: dict, processor):
    """The ``DerivedWeights`` of the file's tensors (see the module docstring): every check the
    whole conversion made, from the header and one row of each tensor; nothing dequantized whole."""
    from gguf import GGMLQuantizationType

    from graphkiln.models.derived import DerivedTensor, DerivedWeights
    from graphkiln.models.prequantized import StoredBlocks

    derived = DerivedWeights()
    widths = {4: 0, 8: 0}  # elements of quantized 2-D weights by the width they were stored at
    exact = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0)
    for t in layout.tensors:
        order = _row_order(t, processor, mapping, name)
        if order is False:
            continue  # transformers' loader skips it too
        result_name, order = order
        hf = mapping[result_name]
        if hf not in expected:
            continue  # a tied head stored anyway: the model reads the embedding
        if tuple(t.shape) != expected[hf]:
            raise GraphkilnError(f"{name}: tensor {show(t.name)} has shape {tuple(t.shape)}, but the metadata implies "
                                 f"{expected[hf]} for {hf}: the file is inconsistent; {_FIX}")
        rows = _row_reader(path, layout, t, order, name)
        sample = rows(0, 1)  # the type is one gguf dequantizes, to floats
        if sample.dtype.kind != "f":
            raise GraphkilnError(f"{name}: tensor {show(t.name)} is stored as {t.qtype.name}, not a float or quantized "
                                 f"type: {_FIX}")
        bits = _stored_bits(t.qtype.name)
        if len(t.shape) == 2 and bits is not None:
            widths[bits] += t.shape[0] * t.shape[1]
        blocks = None
        if t.qtype in exact and len(t.shape) == 2 and "norm" not in hf and t.shape[1] % 32 == 0:
            q4 = t.qtype == GGMLQuantizationType.Q4_0
            # centered: Q4_0's zero point is 8 and Q8_0's 128, the midpoints
            blocks = StoredBlocks(tuple(t.shape), 4 if q4 else 8, 32, f"gguf:{t.qtype.name}", True,
                                  lambda t=t, rows=rows: _stored_blocks(path, layout, t, rows, processor, mapping,
                                                                                name))
        plain = t.qtype.name in ("F32", "F16", "BF16", "F64")
        derived.tensors[hf] = DerivedTensor(tuple(t.shape), rows, blocks, _WORK_PLAIN if plain else _WORK_QUANT)
    missing = sorted(set(expected) - set(derived.tensors))
    if missing:
        raise GraphkilnError(f"{name} lacks {len(missing)} of the model's tensors ({', '.join(missing[:3])}): the file "
                             f"is incomplete; {_FIX}")
    derived.default_bits = max(widths, key=widths.get) if any(widths.values()) else None
    return derived


def _row_order(t: "TensorInfo", processor, mapping: dict, name: str):
    """False when transformers' loader skips the tensor, else (its name after the tensor
    processor, the processor's permutation of its rows: None when there is none). The processors
    of the architectures converted only permute rows (llama's attn_q / attn_k), so running the
    processor on the row indices finds the permutation without dequantizing anything."""
    n = t.shape[0]
    probe = np.arange(n).reshape(n, *([1] * (len(t.shape) - 1)))
    try:
        result = processor.process(weights=probe, name=t.name, tensor_key_mapping=mapping,
                                   parsed_parameters={"tensors": {}})
    except Exception as exc:
        raise GraphkilnError(f"{name}: tensor {show(t.name)} has shape {t.shape}, which does not fit the model's "
                             f"heads ({_why(exc)}): {_FIX}") from None
    if result.name not in mapping:
        return False
    order = np.asarray(result.weights)
    if order.shape != probe.shape or not np.array_equal(np.sort(order.reshape(n)), np.arange(n)):
        raise GraphkilnError(f"{name}: transformers' tensor processor reshapes {show(t.name)} in a way graphkiln "
                             f"cannot read in rows: {_FIX}")
    order = order.reshape(n)
    return result.name, None if np.array_equal(order, np.arange(n)) else order


def _row_reader(path: Path, layout: "Layout", t: "TensorInfo", order, name: str):
    """``rows(start, stop)``: rows [start, stop) of the tensor as transformers loads it (float32:
    ``gguf.dequantize`` of the stored bytes, the processor's row permutation ``order`` applied),
    reading only those rows' bytes (a permuted tensor, a layer's q or k, is read whole)."""
    from gguf import GGMLQuantizationType as Q
    from gguf import dequantize
    from gguf.quants import quant_shape_to_byte_shape

    from graphkiln.models.derived import read_exact

    n = t.shape[0]
    one_d = len(t.shape) == 1
    row_bytes = t.nbytes // n if not one_d else t.nbytes
    plain = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
             Q.I32: np.int32, Q.I64: np.int64}
    base = layout.data_start + t.offset

    def rows(start: int, stop: int) -> np.ndarray:
        if one_d:  # a norm or bias: small, read whole
            raw, count, shape = read_exact(path, base, t.nbytes, name), None, t.shape
        elif order is None:
            count = stop - start
            raw = read_exact(path, base + start * row_bytes, count * row_bytes, name)
            shape = (count, *t.shape[1:])
        else:
            whole = read_exact(path, base, t.nbytes, name).reshape(n, row_bytes)
            raw = np.ascontiguousarray(whole[order[start:stop]]).reshape(-1)
            shape = (len(order[start:stop]), *t.shape[1:])
        data = raw.view(plain[t.qtype]).reshape(shape) if t.qtype in plain else \
            raw.reshape(quant_shape_to_byte_shape(shape, t.qtype))
        try:
            w = dequantize(data, t.qtype)
        except NotImplementedError:
            raise GraphkilnError(f"{name}: tensor {show(t.name)} is stored as {t.qtype.name}, which the gguf package "
                                 "cannot dequantize: upgrade gguf (pip install -U gguf), or use a GGUF of another "
                                 "quantization type") from None
        except Exception as exc:
            raise GraphkilnError(f"{name}: tensor {show(t.name)} ({t.qtype.name}) is malformed ({_why(exc)}): "
                                 f"{_FIX}") from None
        if w.dtype.kind != "f":
            return w
        w = np.ascontiguousarray(w, dtype=np.float32).reshape(shape)
        return w[start:stop] if one_d else w

    return rows


def _stored_blocks(path: Path, layout: "Layout", t: "TensorInfo", rows, processor, mapping: dict, name: str):
    """The ``BlockQuantized`` blocks of a Q4_0 / Q8_0 tensor, checked bit for bit against its
    dequantized rows (``exact_blocks``: exact by construction, Q4_0 and Q8_0 dequantize as one
    float32 product, checked all the same)."""
    from graphkiln.models.derived import read_exact

    from graphkiln.models.prequantized import BlockQuantized

    raw = read_exact(path, layout.data_start + t.offset, t.nbytes, name).reshape(t.shape[0], -1)
    b = exact_blocks(raw, t, None, processor, mapping)
    del raw
    n, k = t.shape
    step = max(1, _CHECK_BAND_BYTES // (k * 4))  # checked a band of rows at a time: a table's floats are never whole
    for a in range(0, n if b is not None else 0, step):
        band = BlockQuantized(b.codes[a:a + step], b.scales[a:a + step], b.zero_points[a:a + step], b.bits,
                              b.block_size, b.format)
        if not np.array_equal(band.dequantize().view(np.uint32), rows(a, min(n, a + step)).view(np.uint32)):
            b = None
    if b is None:
        raise GraphkilnError(f"{name}: the blocks of tensor {show(t.name)} do not dequantize to its weights: {_FIX}")
    return b


_CHECK_BAND_BYTES = 64 << 20


def _stored_bits(qtype: str) -> int | None:
    """The MatMulNBits width nearest a GGML type's (4: Q2..Q4 and 4-bit IQ types; 8: Q5, Q6, Q8), or
    None for float types: what an export without --quant gives the weights it dequantized."""
    if qtype.startswith(("Q5", "Q6", "Q8")):
        return 8
    if qtype.startswith(("Q2", "Q3", "Q4", "IQ", "TQ")):
        return 4
    return None


def exact_blocks(data: np.ndarray, t: "TensorInfo", w: np.ndarray | None, processor=None, mapping=None):
    """The ``BlockQuantized`` form of a Q4_0 / Q8_0 tensor (its GGUF bytes ``data``) whose float
    weight after transformers' tensor processor is ``w``, or None when the two would not be
    bit-exact (``w`` None: not checked here; the caller checks it a band at a time)."""
    from gguf import GGMLQuantizationType

    from graphkiln.models.prequantized import BlockQuantized

    n, k = w.shape if w is not None else t.shape
    if data.ndim != 2 or data.shape[0] != n or k % 32:
        return None
    q4 = t.qtype == GGMLQuantizationType.Q4_0
    raw = np.asarray(data).reshape(n, k // 32, 18 if q4 else 34)
    scales = np.ascontiguousarray(raw[..., :2]).view(np.float16)[..., 0].astype(np.float32)
    if q4:  # low nibbles are the block's first 16 weights, high nibbles its last 16
        qs = raw[..., 2:]
        codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
        zero = 8
    else:
        codes = (raw[..., 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8).reshape(n, k)
        zero = 128
    if processor is not None:
        # the processor's permutation of rows (llama's attn_q / attn_k), found by running it on row indices
        order = np.asarray(processor.process(weights=np.arange(n).reshape(n, 1), name=t.name,
                                             tensor_key_mapping=mapping, parsed_parameters={"tensors": {}}).weights)
        if order.shape != (n, 1) or not np.array_equal(np.sort(order[:, 0]), np.arange(n)):
            return None
        codes, scales = codes[order[:, 0]], scales[order[:, 0]]
    b = BlockQuantized(np.ascontiguousarray(codes), np.ascontiguousarray(scales),
                       np.full((n, k // 32), zero, np.uint8), 4 if q4 else 8, 32, f"gguf:{t.qtype.name}")
    if w is not None and not np.array_equal(b.dequantize().view(np.uint32), w.view(np.uint32)):
        return None
    return b


# --------------------------------------------------------------------------- config and tokenizer


def _write_config(dest: Path, config, model_cls: str) -> None:
    import torch
    from transformers import GenerationConfig

    config.architectures = [model_cls]
    config.dtype = torch.float32
    config.save_pretrained(dest)
    # what from_pretrained gives a GGUF-loaded model: the file has no generation config of its own
    GenerationConfig.from_model_config(config).save_pretrained(dest)


def _write_tokenizer(path: Path, layout: "Layout", dest: Path, name: str) -> None:
    """The tokenizer transformers builds from the file's metadata (with its chat template), saved
    into ``dest``; none for a file without ``tokenizer.ggml.model`` (the artifact runs on token ids)."""
    if "tokenizer.ggml.model" not in layout.metadata:
        return
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        # ``dest`` is still empty: no tokenizer file but the GGUF's is read
        tokenizer = AutoTokenizer.from_pretrained(str(dest), gguf_file=str(path.resolve()), trust_remote_code=False)
        tokenizer.save_pretrained(str(dest))
    except Exception as exc:
        raise GraphkilnError(f"transformers cannot build a tokenizer from the metadata of {name} ({_why(exc)}): "
                             f"{_FIX}") from None


def _why(exc: BaseException) -> str:
    lines = str(exc).splitlines()  # library messages quote the file's values: shown, not echoed
    return f"{type(exc).__name__}: {show(lines[0], 160)}" if lines else type(exc).__name__


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF stores the fastest-moving dimension first)
    qtype: object  # gguf.GGMLQuantizationType
    offset: int  # from the start of the data section
    nbytes: int


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array, read as far as its element type and count (the elements are checked, not kept)."""

    etype: int
    count: int


@dataclass(frozen=True)
class Layout:
    """A GGUF file's header: scalar and string metadata (arrays as ``ArrayInfo``), the tensor table,
    and where the tensor data begins."""

    metadata: dict
    tensors: tuple[TensorInfo, ...]
    data_start: int


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Bad(Exception):
    pass


def read_layout(path: Path) -> Layout:
    """Read and check a GGUF file's header: every count, length and type against the file's size
    (a declared count is never looped over before the bytes it needs are known to exist), every
    tensor's extent inside the file. One GraphkilnError naming what is wrong."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    name = show(path.name)
    try:
        f = path.open("rb")
    except OSError as exc:
        raise GraphkilnError(f"cannot read {show(str(path), 120)} ({exc.strerror or exc}): check the path and its "
                             "permissions") from None
    with f:
        size = path.stat().st_size
        if size < 24:
            raise GraphkilnError(f"{name} is not a valid GGUF file ({size} bytes, shorter than a GGUF header): {_FIX}")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            try:
                if buf[:4] != b"GGUF":
                    raise _Bad("it does not start with the GGUF magic bytes")
                version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
                if version not in (2, 3):
                    if version & 0xFFFF == 0 and version >> 24 in (2, 3):
                        raise _Bad("it is a big-endian GGUF, which graphkiln does not read")
                    raise _Bad(f"GGUF version {version}; graphkiln reads versions 2 and 3")
                if n_kv * 13 > size or n_tensors * 24 > size:  # the smallest entry of each kind
                    raise _Bad(f"it declares {n_kv} metadata entries and {n_tensors} tensors, more than its "
                               f"{size} bytes can hold: the file is truncated or corrupt")
                pos, metadata = 24, {}
                for _ in range(n_kv):
                    key, pos = _string(buf, pos, size)
                    vtype, pos = _unpack("<I", buf, pos, size)
                    if key in metadata:
                        raise _Bad(f"metadata key {show(key)} appears twice")
                    metadata[key], pos = _value(buf, pos, vtype, size)
                alignment = metadata.get("general.alignment", 32)
                if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
                    raise _Bad(f"general.alignment {show(alignment)} is not a power of two")
                entries, names = [], set()
                for _ in range(n_tensors):
                    tname, pos = _string(buf, pos, size)
                    if tname in names:
                        raise _Bad(f"tensor {show(tname)} appears twice")
                    names.add(tname)
                    n_dims, pos = _unpack("<I", buf, pos, size)
                    if not 1 <= n_dims <= _MAX_DIMS:
                        raise _Bad(f"tensor {show(tname)} has {n_dims} dimensions (1 to {_MAX_DIMS} allowed)")
                    dims = []
                    for _ in range(n_dims):
                        d, pos = _unpack("<Q", buf, pos, size)
                        dims.append(d)
                    ttype, pos = _unpack("<I", buf, pos, size)
                    offset, pos = _unpack("<Q", buf, pos, size)
                    entries.append((tname, dims, ttype, offset))
                data_start = (pos + alignment - 1) // alignment * alignment
                tensors = []
                for tname, dims, ttype, offset in entries:
                    try:
                        qtype = GGMLQuantizationType(ttype)
                        block, type_size = GGML_QUANT_SIZES[qtype]
                    except (ValueError, KeyError):
                        raise _Bad(f"tensor {show(tname)} has unknown ggml type {ttype}") from None
                    if min(dims) < 1 or dims[0] % block:
                        raise _Bad(f"tensor {show(tname)} has dimensions {dims}, which {qtype.name} blocks of "
                                   f"{block} cannot hold")
                    count = 1
                    for d in dims:
                        count *= d
                    nbytes = count // block * type_size
                    if data_start + offset + nbytes > size:
                        raise _Bad(f"tensor {show(tname)} lies past the end of the file (the file is truncated)")
                    if offset % alignment:
                        raise _Bad(f"tensor {show(tname)} is not aligned to {alignment} bytes")
                    tensors.append(TensorInfo(tname, tuple(reversed(dims)), qtype, offset, nbytes))
            except _Bad as exc:
                raise GraphkilnError(f"{name} is not a valid GGUF file ({exc}): {_FIX}") from None
    return Layout(metadata, tuple(tensors), data_start)


def _unpack(fmt: str, buf, pos: int, size: int):
    width = struct.calcsize(fmt)
    if pos + width > size:
        raise _Bad("its header runs past the end of the file (the file is truncated)")
    return struct.unpack_from(fmt, buf, pos)[0], pos + width


def _string(buf, pos: int, size: int) -> tuple[str, int]:
    length, pos = _unpack("<Q", buf, pos, size)
    if length > size - pos:
        raise _Bad("a string in its header runs past the end of the file (the file is truncated)")
    try:
        return bytes(buf[pos:pos + length]).decode("utf-8"), pos + length
    except UnicodeDecodeError:
        raise _Bad(f"the string at byte {pos} is not UTF-8") from None


def _value(buf, pos: int, vtype: int, size: int):
    """(a metadata value, the position after it): scalars and strings as they are, an array as
    an ``ArrayInfo`` (its elements checked, not kept)."""
    if vtype in _SCALARS:
        return _unpack(_SCALARS[vtype], buf, pos, size)
    if vtype == _STRING:
        return _string(buf, pos, size)
    if vtype == _ARRAY:
        etype, pos = _unpack("<I", buf, pos, size)
        count, pos = _unpack("<Q", buf, pos, size)
        if etype in _SCALARS:
            width = struct.calcsize(_SCALARS[etype])
            if count > (size - pos) // width:
                raise _Bad("a metadata array runs past the end of the file (the file is truncated)")
            return ArrayInfo(etype, count), pos + count * width
        if etype != _STRING:  # nested arrays: nothing llama.cpp writes
            raise _Bad(f"a metadata array holds values of type {etype}")
        if count > (size - pos) // 8:
            raise _Bad("a metadata array runs past the end of the file (the file is truncated)")
        for _ in range(count):
            length, pos = _unpack("<Q", buf, pos, size)
            if length > size - pos:
                raise _Bad("a metadata string runs past the end of the file (the file is truncated)")
            pos += length
        return ArrayInfo(etype, count), pos
    raise _Bad(f"a metadata value has unknown type {vtype}")
