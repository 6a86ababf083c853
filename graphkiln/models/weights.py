"""Build a ``DecoderForExport`` from a checkpoint directory's safetensors, without extra copies.

The module is created on the meta device (no memory), then each parameter is bound to the
tensor read from safetensors (converted only when the dtype differs), so peak memory is
about one copy of the weights.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from tqdm import tqdm

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import DecoderConfig
from graphkiln.models.decoder import DecoderForExport
from graphkiln.models.registry import ModelFamily
from graphkiln.models.sources import Alt, Cat, Source, Stack, fused_source, names_in

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def rope_inv_freq(cfg: DecoderConfig, flavor: str = "default") -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling of one rope flavor, as the reference computes them."""
    rope = cfg.ropes[flavor]
    if rope.rope_type == "default":
        inv = 1.0 / (rope.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        return inv, 1.0
    if rope.rope_type == "dynamic":
        raise GraphkilnError("rope_type 'dynamic' changes with sequence length and cannot be exported; use a static rope type")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope.rope_type not in ROPE_INIT_FUNCTIONS:
        raise GraphkilnError(f"unknown rope_type '{rope.rope_type}' in config.json")
    hf_cfg = AutoConfig.for_model(**cfg.raw)
    kwargs = {"layer_type": flavor} if flavor != "default" else {}
    inv, scaling = ROPE_INIT_FUNCTIONS[rope.rope_type](hf_cfg, "cpu", **kwargs)
    return inv.float(), float(scaling)


def _open_shards(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to the safetensors shard holding it."""
    shards = sorted(model_dir.glob("*.safetensors"))
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


class _Entry(NamedTuple):
    """One tensor in a safetensors shard: absolute byte range [begin, end)."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


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

    def missing(self, src: Source) -> str:
        if isinstance(src, Alt):
            return self.missing(src.options[-1])
        return next(n for n in names_in(src) if n not in self.where)

    def read(self, src: Source) -> torch.Tensor:
        if isinstance(src, Alt):
            return self.read(next(o for o in src.options if self.has(o)))
        if isinstance(src, Stack):
            return torch.stack([self.read(p) for p in src.parts])
        if isinstance(src, Cat):
            return self._read_cat(src)
        shard = self.where[src]
        if shard not in self.handles:
            self.handles[shard] = safe_open(str(shard), framework="pt").__enter__()
        try:
            return self.handles[shard].get_tensor(src)
        except Exception as exc:
            raise GraphkilnError(
                f"{shard.name} is truncated or corrupt reading '{src}' ({str(exc).splitlines()[0]}): "
                "re-download or re-save the checkpoint"
            ) from None

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
        if name not in self.where:
            return None
        shard = self.where[name]
        if shard not in self.headers:
            with open(shard, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                self.headers[shard] = (8 + n, json.loads(f.read(n)))
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


def load_decoder(model_dir: Path, family: ModelFamily, cfg: DecoderConfig, dtype: str, progress: bool = True) -> DecoderForExport:
    torch_dtype = DTYPES[dtype]
    ropes = {flavor: rope_inv_freq(cfg, flavor) for flavor in cfg.ropes}
    with torch.device("meta"):
        model = DecoderForExport(cfg, {f: inv.to("meta") for f, (inv, _) in ropes.items()}, {f: s for f, (_, s) in ropes.items()})
    for flavor, (inv, _) in ropes.items():  # computed buffers, not stored in checkpoints
        setattr(model, f"inv_freq_{flavor}", inv)

    reader = _Reader(_open_shards(model_dir))
    wanted = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight")
    sources = {name: fused_source(family.source, name, cfg) for name in wanted}
    missing = [reader.missing(src) for src in sources.values() if not reader.has(src)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GraphkilnError(
            f"checkpoint is missing weight '{missing[0]}'{more}: the safetensors files do not match config.json"
        )

    state: dict[str, torch.Tensor] = {}
    try:
        for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
            t = reader.read(sources[name])
            expected = tuple(wanted[name].shape)
            if tuple(t.shape) != expected:
                raise GraphkilnError(
                    f"weight '{name}' has shape {tuple(t.shape)} but config.json implies {expected}: "
                    "the safetensors files do not match config.json"
                )
            state[name] = t if t.dtype == torch_dtype else t.to(torch_dtype)
            del t
    finally:
        reader.close()
    if cfg.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def read_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise GraphkilnError(f"{model_dir} has no config.json: pass a Hugging Face checkpoint directory or hub id")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GraphkilnError(f"config.json in {model_dir} is not valid JSON ({exc}): fix or re-save it") from None
    if not isinstance(raw, dict):
        raise GraphkilnError(f"config.json in {model_dir} is not a JSON object: fix or re-save it")
    return raw
