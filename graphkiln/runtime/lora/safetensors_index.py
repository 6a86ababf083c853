"""``adapter_model.safetensors`` read with json + numpy: an 8-byte little-endian header length, a
JSON header naming each tensor's dtype, shape and byte range, then the raw bytes.

The file is untrusted. Its header's declared size is bounded before a byte of it is read, by the
bytes the most tensors an adapter for this model can hold (an A and a B per projection of each
layer) can take, which bounds its entry count too: a header of millions of entries costs an
8-byte read, not seconds and gigabytes. It is parsed with ``untrusted.parse_json`` (deep nesting
is one line) and every entry is checked against the file before any tensor data is read."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from graphkiln.runtime.lora.adapter_dir import WEIGHTS, read_bounded, refuse
from graphkiln.untrusted import parse_json, show

FLOAT_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2"}  # BF16: widened by hand

# The header's bound: each entry is its name (``name_chars``) plus at most this much JSON (dtype,
# a 2-d shape and two offsets of up to 20 digits each, quotes, spaces), and the whole header may
# hold this much more (``__metadata__``: PEFT writes {"format": "pt"}; the 8-byte alignment padding).
_ENTRY_BYTES = 256
_METADATA_BYTES = 64 << 10


def header_limit(tensors: int, name_chars: int) -> int:
    """The most header bytes an adapter of at most ``tensors`` tensors with names of at most
    ``name_chars`` characters can need."""
    return _METADATA_BYTES + tensors * (name_chars + _ENTRY_BYTES)


@dataclass(frozen=True)
class Stored:
    """One tensor's safetensors header entry, validated: a float dtype, data inside the file."""

    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def _no_duplicates(pairs):
    # json keeps the last of two equal keys silently; two tensors of one name is a corrupt file
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate key " + show(next(k for k in keys if keys.count(k) > 1)))
    return dict(pairs)


def safetensors_index(path: Path, f: BinaryIO, max_tensors: int, name_chars: int) -> dict[str, Stored]:
    """The tensors the open safetensors file ``f`` (of adapter directory ``path``) declares, from
    its header only. Refused (one line) before the header is read: a header longer than the file
    or than ``header_limit(max_tensors, name_chars)``; after it is parsed: any entry that does not
    fit its dtype, shape or the file. (Entries the model has no use for are the caller's to name.)"""
    size = f.seek(0, 2)
    head = read_bounded(f, path, WEIGHTS, 0, 8) if size >= 8 else b""
    if len(head) < 8:
        raise refuse(path, f"{WEIGHTS} is truncated (no header); re-save the adapter")
    n = int.from_bytes(head, "little")
    if n > size - 8:
        raise refuse(path, f"{WEIGHTS} declares a {n:,}-byte header in a {size:,}-byte file; the file is truncated "
                           f"or not safetensors: re-save the adapter")
    limit = header_limit(max_tensors, name_chars)
    if n > limit:
        raise refuse(path, f"{WEIGHTS} declares a {n:,}-byte header, but an adapter for this model holds at most "
                           f"{max_tensors} LoRA tensors, whose header needs at most {limit:,} bytes: the file is not "
                           f"a LoRA adapter for this model (or is corrupt); pass the adapter PEFT's save_pretrained "
                           f"wrote")
    raw = read_bounded(f, path, WEIGHTS, 8, n)
    header = parse_json(raw, f"the header of LoRA adapter file {show(str(path / WEIGHTS), 200)}",
                        "the file is corrupt: re-save the adapter", object_pairs_hook=_no_duplicates)
    if not isinstance(header, dict):
        raise refuse(path, f"{WEIGHTS} has a corrupt header (not an object); re-save the adapter")
    base = 8 + n
    index = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shown = show(name)
        if not (isinstance(entry, dict) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
                and isinstance(entry.get("dtype"), str)):
            raise refuse(path, f"{WEIGHTS} has a corrupt header entry for {shown}; re-save the adapter")
        dtype = entry["dtype"]
        if dtype not in FLOAT_DTYPES:
            raise refuse(path, f"tensor {shown} is {show(dtype, 12)}, not a float tensor; LoRA weights are "
                               f"float32/float16/bfloat16: re-save the adapter")
        shape = tuple(entry["shape"])
        begin, end = entry["data_offsets"]
        nbytes = math.prod(shape) * np.dtype(FLOAT_DTYPES[dtype]).itemsize
        if not 0 <= begin <= end <= size - base or end - begin != nbytes:
            raise refuse(path, f"tensor {shown} has data offsets {show([begin, end])} that do not fit its shape "
                               f"{show(shape)} or the file; the file is corrupt or truncated: re-save the adapter")
        index[name] = Stored(dtype, shape, base + begin, end - begin)
    return index


def read_tensor(path: Path, f: BinaryIO, stored: Stored) -> np.ndarray:
    """One indexed tensor's data from the open file ``f``, as float32 (bfloat16 widened exactly)."""
    blob = read_bounded(f, path, WEIGHTS, stored.offset, stored.nbytes)
    data = np.frombuffer(blob, dtype=FLOAT_DTYPES[stored.dtype])
    if stored.dtype == "BF16":  # bfloat16 is the top half of a float32
        data = (data.astype(np.uint32) << 16).view(np.float32)
    return data.astype(np.float32).reshape(stored.shape)
