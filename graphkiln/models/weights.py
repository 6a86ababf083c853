"""Build a ``DecoderForExport`` from a checkpoint directory's safetensors, without extra copies.

The module is created on the meta device (no memory), then each parameter is bound to the
tensor read from safetensors (converted only when the dtype differs), so peak memory is
about one copy of the weights.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from graphkiln import untrusted
from graphkiln.errors import GraphkilnError
from graphkiln.models import checkpoint_files
from graphkiln.models.config import DecoderConfig
from graphkiln.models.decoder import DecoderForExport, RMSNorm
from graphkiln.models.registry import ModelFamily
from graphkiln.models.sources import (BASE_MODEL_PREFIX, Alt, Cat, Rows, Source, Stack, Rearranged, fused_source, names_in,
                                      without_base_prefix)

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The stored types a float weight may have (F64 is converted like the others). Anything else, an
# integer or bool tensor where a float weight belongs, would be cast into a silently wrong model.
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
# Tensors a checkpoint may hold that no model reads, and that transformers itself skips when it
# loads the supported families (modeling_utils._adjust_missing_and_unexpected_keys): rotary
# inv_freq buffers that old checkpoints saved per layer, and the once-persistent position_ids.
# Every other unread tensor is an error: it means config.json describes another model (fewer
# layers, another architecture) than the weights.
IGNORABLE_TENSORS = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"), re.compile(r"(^|\.)position_ids$"))
SHARD_FIX = "re-download or re-save the checkpoint"
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own bound on a header


def rope_inv_freq(cfg: DecoderConfig, flavor: str = "default") -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling of one rope flavor, as the reference computes them."""
    rope = cfg.ropes[flavor]
    if rope.rope_type == "default":
        dim = cfg.rotary_dim or cfg.head_dim  # partial rotary: frequencies over the rotated dims only
        inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope.rope_type == "dynamic":
        raise GraphkilnError("rope_type 'dynamic' changes with sequence length and cannot be exported; use a static rope type")
    from transformers import CONFIG_MAPPING
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope.rope_type not in ROPE_INIT_FUNCTIONS:
        raise GraphkilnError(f"unknown rope_type {untrusted.show(rope.rope_type)} in config.json")
    fields = dict(cfg.raw)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise GraphkilnError(f"config.json: 'model_type' is {untrusted.show(model_type)}, which transformers does not "
                             "know: "
                             f"rope_type '{rope.rope_type}' needs it; fix config.json")
    try:
        # transformers' own config class for the model type (never a checkpoint's code: no
        # auto_map lookup happens here) evaluates the scaled rope exactly as the reference does.
        hf_cfg = CONFIG_MAPPING[model_type](**fields)
        kwargs = {"layer_type": flavor} if flavor != "default" else {}
        inv, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](hf_cfg, "cpu", **kwargs)
    except Exception as exc:  # transformers validates rope parameters with several exception types
        raise GraphkilnError(f"config.json: the '{rope.rope_type}' rope parameters are rejected by transformers "
                             f"({type(exc).__name__}: {str(exc).splitlines()[0][:160]}): fix config.json") from None
    inv = inv.float()
    if not bool(torch.isfinite(inv).all()) or not math.isfinite(float(scaling)):
        raise GraphkilnError(f"config.json: the '{rope.rope_type}' rope parameters give non-finite rotary "
                             "frequencies: fix config.json")
    return inv, float(scaling)


def _open_shards(model_dir: Path) -> dict:
    """Map every tensor name to the safetensors shard holding it, or, in a converted quantized
    checkpoint (``models.derived``), to the ``DerivedTensor`` that makes it when read."""
    from graphkiln.models.derived import derived_weights
    from graphkiln.models.prequantized import PREQUANTIZED_FILE

    derived = derived_weights(model_dir)
    if derived is not None:  # the source's shards were checked when the conversion opened them
        return {**derived.shards, **derived.tensors}

    found = sorted(model_dir.glob("*.safetensors"))
    for shard in found:  # safetensors opens by name (and would block on a FIFO): regular files only
        checkpoint_files.check_file(shard, model_dir, SHARD_FIX)
    # the sidecar of a converted checkpoint's stored blocks is not a weight shard
    shards = [p for p in found if p.name != PREQUANTIZED_FILE]
    if not shards:
        raise GraphkilnError(f"no *.safetensors files in {model_dir}: save the checkpoint with safe_serialization=True")
    where: dict[str, Path] = {}
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    where[name] = shard
        except Exception as exc:  # safetensors raises several types for corrupt headers
            raise GraphkilnError(
                f"{shard.name} is truncated or corrupt ({str(exc).splitlines()[0]}): re-download or re-save the checkpoint"
            ) from None
    return where


def read_tensors(model_dir: Path, names: list[str], dtype: str) -> dict[str, torch.Tensor]:
    """The named checkpoint tensors in ``dtype`` (float types only, like the decoder's): for the
    graph specs beside the decoder (a vision tower), which load whole modules by name."""
    where = _open_shards(model_dir)
    reader = _Reader(where)
    try:
        out = {}
        for name in names:
            stored = reader.header(name)["dtype"]
            if stored not in _SAFETENSORS_DTYPES:
                raise GraphkilnError(f"checkpoint tensor '{name}' is stored as {stored}, not as a float type: export "
                                     "the unquantized float checkpoint")
            out[name] = reader.read(name).to(DTYPES[dtype])
        return out
    finally:
        reader.close()


def tensor_headers(model_dir: Path) -> dict[str, dict]:
    """Every checkpoint tensor's safetensors header entry ({"dtype", "shape", ...}), no data read."""
    reader = _Reader(_open_shards(model_dir))
    return {name: reader.header(name) for name in reader.where}


class _Entry(NamedTuple):
    """One tensor in a safetensors shard: absolute byte range [begin, end)."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _read_header(shard: Path) -> tuple[int, dict]:
    """A shard's (data start, header entries). The header's length is checked against the file
    before it is read, and its JSON parsed as untrusted text (``_open_shards`` has already let
    safetensors validate it; this read must not be the weak point if it had not)."""
    with open(shard, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 <= n <= min(size - 8, MAX_HEADER_BYTES):
            raise GraphkilnError(f"{shard.name} is truncated or corrupt (a header of {n} bytes in a file of {size}): "
                                 f"{SHARD_FIX}")
        header = untrusted.parse_json(f.read(n), f"{shard.name}'s safetensors header", SHARD_FIX)
    if not isinstance(header, dict):
        raise GraphkilnError(f"{shard.name} is truncated or corrupt (its header is not a JSON object): {SHARD_FIX}")
    return 8 + n, header


class _Reader:
    """Resolves ``Source`` descriptions against the checkpoint's shards, one tensor at a time."""

    def __init__(self, where: dict[str, Path]) -> None:
        self.where = where
        self.handles: dict[Path, object] = {}
        self.headers: dict[Path, tuple[int, dict]] = {}  # shard -> (data start, header entries)

    def has(self, src: Source) -> bool:
        if isinstance(src, str):
            return src in self.where
        if isinstance(src, Alt):
            return any(self.has(o) for o in src.options)
        return all(self.has(p) for p in src.parts)

    def chosen(self, src: Source) -> Source:
        """The layout ``read`` would use (first complete ``Alt`` option); ``src`` must be ``has``."""
        if isinstance(src, Alt):
            return self.chosen(next(o for o in src.options if self.has(o)))
        if isinstance(src, str):
            return src
        return dataclasses.replace(src, parts=tuple(self.chosen(p) for p in src.parts))

    def header(self, name: str) -> dict:
        """The shard header entry of a tensor: {"dtype": "F32", "shape": [...], "data_offsets": [...]}
        (a derived tensor's: float32, as it is made)."""
        shard = self.where[name]
        if not isinstance(shard, Path):
            return {"dtype": "F32", "shape": list(shard.shape), "data_offsets": [0, shard.nbytes]}
        if shard not in self.headers:
            self.headers[shard] = _read_header(shard)
        return self.headers[shard][1][name]

    def missing(self, src: Source) -> str:
        if isinstance(src, Alt):
            return self.missing(src.options[-1])
        return next(n for n in names_in(src) if n not in self.where)

    def read(self, src: Source) -> torch.Tensor:
        if isinstance(src, Alt):
            return self.read(next(o for o in src.options if self.has(o)))
        if hasattr(src, "read_from"):  # a source that reads its own tensors (models.mxfp4.Mxfp4Experts)
            return src.read_from(self)
        if isinstance(src, Stack):
            return torch.stack([self.read(p) for p in src.parts])
        if isinstance(src, Cat):
            return self._read_cat(src)
        if isinstance(src, Rows):
            whole = self.read(src.parts[0])
            return torch.cat([whole[a:b] for a, b in src.ranges])
        if isinstance(src, Rearranged):
            t = self.read(src.parts[0])
            if src.interleave > 1:
                t = torch.cat([t[..., j::src.interleave] for j in range(src.interleave)], dim=-1)
            return (t.transpose(-1, -2) if src.transpose else t).contiguous()
        entry = self._entry(src)
        if entry is not None:
            return self._read_plain(src, entry)
        shard = self.where[src]
        if not isinstance(shard, Path):  # models.derived: made from the source's quantized bytes
            return torch.from_numpy(shard.read())
        if shard not in self.handles:
            self.handles[shard] = safe_open(str(shard), framework="pt").__enter__()
        try:
            return self.handles[shard].get_tensor(src)
        except Exception as exc:
            raise GraphkilnError(
                f"{shard.name} is truncated or corrupt reading '{src}' ({str(exc).splitlines()[0]}): "
                "re-download or re-save the checkpoint"
            ) from None

    def _read_plain(self, name: str, e: "_Entry") -> torch.Tensor:
        """One float tensor read from its shard into new memory. Not through safetensors' memory
        map: every page read that way stays mapped, and counted in the process's memory, until the
        shard is closed, so a streamed export would grow by each tensor it ever read."""
        out = torch.empty(e.shape, dtype=e.dtype)
        size = e.end - e.begin
        if size != out.numel() * out.element_size():
            raise GraphkilnError(f"{e.shard.name}: tensor '{name}' has {size} bytes for shape {list(e.shape)}: "
                                 "re-download or re-save the checkpoint")
        with open(e.shard, "rb") as f:
            f.seek(e.begin)
            got = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy())) if size else 0
        if got != size:
            raise GraphkilnError(f"{e.shard.name} is truncated reading '{name}': re-download or re-save the checkpoint")
        return out

    def _read_cat(self, src: Cat) -> torch.Tensor:
        """Concatenate the parts (along dim 0) straight from the files into one new tensor.

        Reading through safetensors' memory map would leave every part's pages mapped until
        the shard is closed, on top of the concatenated copy: the fused q/k/v and gate/up
        Linears (most of a model's bytes) would count twice in peak RSS. Plain reads into the
        destination keep them once.
        """
        parts = [self._entry(p) if isinstance(p, str) else None for p in src.parts]
        if any(e is None for e in parts) or len({(e.dtype, e.shape[1:]) for e in parts}) != 1:
            return torch.cat([self.read(p) for p in src.parts])  # nested sources or mixed layouts
        out = torch.empty((sum(e.shape[0] for e in parts), *parts[0].shape[1:]), dtype=parts[0].dtype)
        flat = out.view(-1).view(torch.uint8).numpy()
        at = 0
        for name, e in zip(src.parts, parts):
            size = e.end - e.begin
            with open(e.shard, "rb") as f:
                f.seek(e.begin)
                got = f.readinto(memoryview(flat[at: at + size]))
            if got != size:
                raise GraphkilnError(f"{e.shard.name} is truncated reading '{name}': re-download or re-save the checkpoint")
            at += size
        return out

    def _entry(self, name: str) -> "_Entry | None":
        """Where a tensor's bytes are, from its shard's header (None: absent or an unhandled dtype)."""
        if name not in self.where or not isinstance(self.where[name], Path):
            return None
        shard = self.where[name]
        self.header(name)
        base, entries = self.headers[shard]
        entry = entries.get(name)
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"]) if entry else None
        if dtype is None:
            return None
        begin, end = entry["data_offsets"]
        return _Entry(shard, dtype, tuple(entry["shape"]), base + begin, base + end)

    def close(self) -> None:
        for h in self.handles.values():
            h.__exit__(None, None, None)


def _meta_decoder(cfg: DecoderConfig, ropes: dict) -> DecoderForExport:
    with torch.device("meta"):
        return DecoderForExport(cfg, {f: inv.to("meta") for f, (inv, _) in ropes.items()},
                                {f: s for f, (_, s) in ropes.items()})


def meta_decoder(cfg: DecoderConfig) -> DecoderForExport:
    """The decoder on the meta device: every parameter's shape, no memory (tied head tied)."""
    model = _meta_decoder(cfg, rope_tables_inputs(cfg))
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _wanted(model: DecoderForExport, cfg: DecoderConfig) -> dict[str, torch.nn.Parameter]:
    wanted = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight")
    return wanted


def _natural(name: str) -> list:
    """Sort key putting model.layers.2 before model.layers.10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _leaves(src: Source) -> list[str]:
    if isinstance(src, str):
        return [src]
    return [n for p in src.parts for n in _leaves(p)]


def _check_shape(reader: _Reader, src: Source, expected: tuple[int, ...], param: str) -> None:
    """Compare the stored shapes of a resolved source's tensors with what config.json implies, naming
    the checkpoint tensor that differs. A ``Cat`` splits its expected rows as the decoder fuses them:
    ``sizes`` when the source gives them, else equal parts (gate/up)."""
    if hasattr(src, "check_shape"):  # a source that checks its own tensors (models.mxfp4.Mxfp4Experts)
        src.check_shape(reader, tuple(expected), param)
        return
    if isinstance(src, str):
        shape = tuple(reader.header(src)["shape"])
        if shape != tuple(expected):
            via = "" if src == param else f" (read for {param})"
            raise GraphkilnError(f"weight '{src}'{via} has shape {shape} but config.json implies {tuple(expected)}: "
                                 "the safetensors files do not match config.json")
        return
    if isinstance(src, Rows):
        if sum(b - a for a, b in src.ranges) != expected[0]:  # the family's ranges: a programming error
            raise GraphkilnError(f"{param}: row ranges {src.ranges} do not make {expected[0]} rows")
        _check_shape(reader, src.parts[0], (src.total, *expected[1:]), param)
        return
    if isinstance(src, Rearranged):
        stored = (*expected[:-2], expected[-1], expected[-2]) if src.transpose else tuple(expected)
        _check_shape(reader, src.parts[0], stored, param)
        return
    if isinstance(src, Stack):
        if len(src.parts) != expected[0]:  # the family builds one part per expert: a programming error
            raise GraphkilnError(f"{param}: {len(src.parts)} stacked tensors for {expected[0]}")
        for part in src.parts:
            _check_shape(reader, part, tuple(expected[1:]), param)
        return
    sizes = src.sizes or (expected[0] // len(src.parts),) * len(src.parts)
    if sum(sizes) != expected[0]:  # no known split: name the parts and their shapes
        shapes = ", ".join(f"'{n}' {tuple(reader.header(n)['shape'])}" for n in _leaves(src))
        raise GraphkilnError(f"weight '{param}' is assembled from {shapes}, which cannot make the {tuple(expected)} "
                             "config.json implies: the safetensors files do not match config.json")
    for part, rows in zip(src.parts, sizes):
        _check_shape(reader, part, (rows, *expected[1:]), param)


def _plan(reader: _Reader, family: ModelFamily, cfg: DecoderConfig, model: DecoderForExport) -> dict[str, Source]:
    """Resolve every parameter's tensors and check them against the shards' headers, before any
    tensor is read: all present, all float, the shapes config.json implies, and nothing left over."""
    wanted = _wanted(model, cfg)
    sources = {name: fused_source(family.source, name, cfg) for name in wanted}
    if not any(n.startswith(BASE_MODEL_PREFIX) for n in reader.where):
        # saved from the base model class (an embedding checkpoint): the same tensors without "model.";
        # the prefixed layout stays the last option, so a missing tensor is named as families name it
        sources = {name: Alt((without_base_prefix(src), src)) for name, src in sources.items()}
    missing = [reader.missing(src) for src in sources.values() if not reader.has(src)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GraphkilnError(
            f"checkpoint is missing weight '{missing[0]}'{more}: the safetensors files do not match config.json"
        )
    resolved = {name: reader.chosen(src) for name, src in sources.items()}
    for name, src in resolved.items():
        for leaf in ([] if getattr(src, "reads_integers", False) else _leaves(src)):  # those check their own
            stored = reader.header(leaf)["dtype"]
            if stored not in _SAFETENSORS_DTYPES:
                raise GraphkilnError(
                    f"checkpoint tensor '{leaf}' is stored as {stored}, not as a float type: graphkiln exports "
                    f"float weights ({', '.join(_SAFETENSORS_DTYPES)}) and does not cast integers or booleans; "
                    "export the unquantized float checkpoint (and use --quant to quantize)"
                )
        _check_shape(reader, src, tuple(wanted[name].shape), name)
    read = {leaf for src in resolved.values() for leaf in _leaves(src)}
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()  # transformers ties it to the embedding
    vision = family.vision.reads if family.vision is not None else (lambda name: False)  # the vision graph's
    unread = sorted((n for n in reader.where if n not in read and n not in ignorable and not vision(n)
                     and not any(p.search(n) for p in IGNORABLE_TENSORS)), key=_natural)
    if unread:
        count = f"{len(unread)} tensors" if len(unread) > 1 else "1 tensor"
        raise GraphkilnError(
            f"checkpoint has {count} that nothing reads (first: '{unread[0]}'): config.json describes another "
            f"model than the safetensors files (wrong 'num_hidden_layers' or architecture?); fix config.json"
        )
    return resolved


def rope_tables_inputs(cfg: DecoderConfig) -> dict[str, tuple[torch.Tensor, float]]:
    """inv_freq and scaling per rope flavor (validates the rope parameters; tiny tensors)."""
    return {flavor: rope_inv_freq(cfg, flavor) for flavor in cfg.ropes}


def check_checkpoint(model_dir: Path, family: ModelFamily, cfg: DecoderConfig) -> None:
    """Everything about the checkpoint that can be refused from config.json and the shard headers
    alone (see ``_plan``), without reading a weight: export runs it before creating its output."""
    ropes = rope_tables_inputs(cfg)
    reader = _Reader(_open_shards(model_dir))
    _plan(reader, family, cfg, _meta_decoder(cfg, ropes))


# Parameters a streamed decoder (``load_decoder(streamed=True)``) holds as uninitialised placeholders
# for tracing: the graph needs their shapes, never their values, and untouched pages cost no memory.
PLACEHOLDER_PARAMS = ("model.embed_tokens.weight", "lm_head.weight")
LAYER_PREFIX = re.compile(r"^model\.layers\.(\d+)\.")


def _layer_of(name: str) -> int | None:
    m = LAYER_PREFIX.match(name)
    return int(m.group(1)) if m else None


class CheckpointWeights:
    """The decoder's parameters read from the checkpoint's shards one at a time, exactly as
    ``load_decoder`` binds them (sources resolved and checked by ``_plan``, norm offsets added in
    fp32, converted to the export dtype, modules' ``fold_loaded`` applied).

    The streamed export's source of weights: the traced graph holds only one layer of each kind,
    and every other weight is read from here as it is written, quantized or run. ``layer(i)``
    builds layer i as a real module and keeps only the last one built, so a pass that visits
    layers in order holds one layer at a time. Owns open shard handles until ``close``."""

    def __init__(self, model_dir: Path, family: ModelFamily, cfg: DecoderConfig, dtype: str) -> None:
        self.cfg, self.dtype_name, self.dtype = cfg, dtype, DTYPES[dtype]
        self.ropes = rope_tables_inputs(cfg)
        self.reader = _Reader(_open_shards(model_dir))
        meta = _meta_decoder(cfg, self.ropes)
        wanted = _wanted(meta, cfg)
        self.shapes = {n: tuple(p.shape) for n, p in wanted.items()}
        self.sources = _plan(self.reader, family, cfg, meta)
        self.offset_norms = _offset_norm_weights(meta, cfg)
        self._layer: tuple[int, nn.Module] | None = None
        # False once a lowering writes a source's integers itself (export.lowering.ort_moe: MXFP4
        # experts as QMoE blocks): layers are then built without its float (meta), so writing a
        # layer's other weights does not dequantize its experts (gpt-oss-20b: 3.2 GB a layer)
        self.expand_integer_sources = True

    def names(self) -> list[str]:
        """Every parameter the checkpoint provides (a tied head is the embedding's: not listed)."""
        return list(self.sources)

    def stored_bytes(self, name: str) -> int:
        """The checkpoint bytes behind one parameter (what reading it costs)."""
        return sum(self.reader.header(n)["data_offsets"][1] - self.reader.header(n)["data_offsets"][0]
                   for n in _leaves(self.sources[self._own(name)]))

    def _own(self, name: str) -> str:
        return "model.embed_tokens.weight" if name == "lm_head.weight" and self.cfg.tie_word_embeddings else name

    def read(self, name: str) -> torch.Tensor:
        """One parameter as ``load_decoder`` binds it (no module folds: see ``layer``)."""
        name = self._own(name)
        t = self.reader.read(self.sources[name])
        expected = self.shapes[name]
        if tuple(t.shape) != expected:
            raise GraphkilnError(f"weight '{name}' has shape {tuple(t.shape)} but config.json implies {expected}: "
                                 "the safetensors files do not match config.json")
        if name in self.offset_norms:  # 1 + w in fp32, as the reference computes it, then the model dtype
            t = t.to(torch.float32) + self.cfg.norm_weight_offset
        return t if t.dtype == self.dtype else t.to(self.dtype)

    def read_stored(self, name: str) -> torch.Tensor:
        """One parameter in the checkpoint's own dtype, before folds and conversion (a table to be
        converted a band at a time)."""
        name = self._own(name)
        if name in self.offset_norms:
            return self.read(name)
        return self.reader.read(self.sources[name])

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of a plain stored 2-D parameter (the embedding, the head), read from
        the file without the rest; parameters assembled from several tensors are read whole."""
        name = self._own(name)
        src = self.sources[name]
        made = self.reader.where.get(src) if isinstance(src, str) else None
        if made is not None and not isinstance(made, Path) and len(made.shape) == 2 and name not in self.offset_norms:
            out = torch.from_numpy(made.rows(start, stop))  # models.derived: only these rows are made
            return out if out.dtype == self.dtype else out.to(self.dtype)
        entry = self.reader._entry(src) if isinstance(src, str) else None
        if entry is None or len(entry.shape) != 2 or name in self.offset_norms:
            return self.read(name)[start:stop]
        row = (entry.end - entry.begin) // entry.shape[0]
        out = torch.empty((stop - start, entry.shape[1]), dtype=entry.dtype)
        with open(entry.shard, "rb") as f:
            f.seek(entry.begin + start * row)
            got = f.readinto(memoryview(out.view(-1).view(torch.uint8).numpy()))
        if got != (stop - start) * row:
            raise GraphkilnError(f"{entry.shard.name} is truncated reading '{src}': re-download or re-save the checkpoint")
        return out if out.dtype == self.dtype else out.to(self.dtype)

    def layer(self, i: int) -> nn.Module:
        """Layer i as a real ``DecoderLayer`` (eval, no grad, folds applied), kept until another
        layer is asked for (the previous one is released first)."""
        if self._layer is not None and self._layer[0] == i:
            return self._layer[1]
        self._layer = None
        module = self.build_layer(i)
        self._layer = (i, module)
        return module

    def build_layer(self, i: int) -> nn.Module:
        """Layer i as a new real ``DecoderLayer``, not kept here (the caller owns it)."""
        from graphkiln.models.decoder import DecoderLayer

        with torch.device("meta"):
            module = DecoderLayer(self.cfg, self.cfg.layers[i])
        prefix = f"model.layers.{i}."
        state = {n[len(prefix):]: self._placeholder(n) if self._skipped(n) else self.read(n)
                 for n in self.sources if n.startswith(prefix)}
        module.load_state_dict(state, strict=True, assign=True)
        return _finish(module)

    def _skipped(self, name: str) -> bool:
        return not self.expand_integer_sources and getattr(self.sources[name], "reads_integers", False)

    def _placeholder(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], dtype=self.dtype, device="meta")

    def release(self) -> None:
        """Drop the layer ``layer`` built last."""
        self._layer = None

    def close(self) -> None:
        self._layer = None
        self.reader.close()
        self.reader.handles.clear()


def _finish(model: nn.Module) -> nn.Module:
    """Folds derived once from loaded parameters (mamba2's A), no gradients, eval mode."""
    for module in model.modules():
        fold = getattr(module, "fold_loaded", None)
        if fold is not None:
            fold()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def load_decoder(model_dir: Path, family: ModelFamily, cfg: DecoderConfig, dtype: str, progress: bool = True,
                 streamed: bool = False) -> DecoderForExport:
    """The decoder with the checkpoint's weights bound. ``streamed``: only what tracing needs is read
    (the first layer of each kind and the small non-layer parameters); the embedding and head are
    uninitialised placeholders of their shapes and every other layer stays on the meta device.
    ``decoder.weights`` (``CheckpointWeights``) then reads the rest one tensor or layer at a time;
    the caller closes it."""
    torch_dtype = DTYPES[dtype]
    ropes = rope_tables_inputs(cfg)
    model = _meta_decoder(cfg, ropes)
    for flavor, (inv, _) in ropes.items():  # computed buffers, not stored in checkpoints
        setattr(model, f"inv_freq_{flavor}", inv)

    weights = CheckpointWeights(model_dir, family, cfg, dtype)
    wanted = _wanted(model, cfg)
    resident = set(wanted)
    if streamed:
        from graphkiln.export.layer_stamping import template_layers

        reps = set(template_layers(cfg))
        resident = {n for n in wanted if n not in PLACEHOLDER_PARAMS and _layer_of(n) in (None, *reps)}
    state: dict[str, torch.Tensor] = {}
    try:
        for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
            if name in resident:
                state[name] = weights.read(name)
            elif name in PLACEHOLDER_PARAMS:
                state[name] = torch.empty(wanted[name].shape, dtype=torch_dtype)
            else:
                state[name] = torch.empty(wanted[name].shape, dtype=torch_dtype, device="meta")
    except BaseException:
        weights.close()
        raise
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _finish(model)
    if streamed:
        model.weights = weights
    else:
        weights.close()
    return model


def _offset_norm_weights(model: DecoderForExport, cfg: DecoderConfig) -> set[str]:
    """The RMSNorm weights ``cfg.norm_weight_offset`` is added to on load (none when it is 0)."""
    if not cfg.norm_weight_offset:
        return set()
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, RMSNorm)}


def find_non_finite(model_dir: Path, family: ModelFamily, cfg: DecoderConfig, dtype: str,
                    hint: str | None = None) -> tuple[str, bool, str] | None:
    """The checkpoint tensor holding NaN/Inf (checked in its stored type, then converted to ``dtype``),
    as (name, only after conversion, "NaN" or "infinite"); ``hint`` (a parameter name) is looked at first. For the error
    message once the exporter's streaming check has found a non-finite initializer: reads tensors
    one at a time, stopping at the first bad one."""
    reader = _Reader(_open_shards(model_dir))
    try:
        sources = _plan(reader, family, cfg, _meta_decoder(cfg, rope_tables_inputs(cfg)))
        order = sorted(sources, key=lambda n: n != hint)
        for name in order:
            for leaf in _leaves(sources[name]):
                for converted in (False, True):
                    t = reader.read(leaf)
                    t = t.to(DTYPES[dtype]) if converted else t
                    if not bool(torch.isfinite(t).all()):
                        return leaf, converted, "NaN" if bool(torch.isnan(t).any()) else "infinite"
    finally:
        reader.close()
    return None


def read_config(model_dir: Path) -> dict:
    """config.json of the checkpoint ``model_dir`` (``checkpoint_files``' rules: a regular file
    inside the checkpoint, untrusted JSON), which must hold an object."""
    raw = checkpoint_files.read_json_object(model_dir, "config.json", "fix or re-save it")
    if raw is None:
        raise GraphkilnError(f"{untrusted.show(str(model_dir), 120)} has no config.json: pass a Hugging Face "
                             "checkpoint directory or hub id")
    return raw


def prequantized_parameters(model_dir: Path, family: ModelFamily, cfg: DecoderConfig) -> dict:
    """The decoder parameters whose checkpoint tensors all have stored blocks in the directory's
    prequantized sidecar (``models.prequantized``), as {parameter name: BlockQuantized} in the
    parameter's own ``[N, K]`` layout: a fused weight's parts concatenated along N. {} without a
    sidecar. A tied head's blocks are the embedding's, under both names. In a converted checkpoint
    (``models.derived``) they are ``StoredBlocks``, made when the quantizer asks for them."""
    from graphkiln.models.derived import derived_weights
    from graphkiln.models.prequantized import concat_rows, read_sidecar

    derived = derived_weights(model_dir)
    stored = derived.blocks() if derived is not None else read_sidecar(model_dir)
    if not stored:
        return {}
    reader = _Reader(_open_shards(model_dir))
    try:
        model = _meta_decoder(cfg, rope_tables_inputs(cfg))
        sources = _plan(reader, family, cfg, model)
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    finally:
        reader.close()
    out = {}
    for name, src in sources.items():
        if isinstance(src, str):
            parts = [src]
        elif isinstance(src, Cat) and all(isinstance(p, str) for p in src.parts):
            parts = list(src.parts)
        else:
            continue  # stacked experts and nested layouts: quantized from their floats, if at all
        if not all(p in stored for p in parts):
            continue
        blocks = concat_rows([stored[p] for p in parts])
        if blocks is not None:
            if blocks.shape != shapes[name]:
                raise GraphkilnError(f"prequantized blocks of '{parts[0]}' have shape {blocks.shape}, but the weight "
                                     f"is {shapes[name]}: convert the checkpoint again")
            out[name] = blocks
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in out:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]  # the graph's name for the tied weight
    return out
