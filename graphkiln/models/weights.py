"""Build a ``DecoderForExport`` from a checkpoint directory's safetensors, without extra copies.

The module is created on the meta device (no memory), then each parameter is bound to the
tensor read from safetensors (converted only when the dtype differs), so peak memory is
about one copy of the weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from graphkiln.errors import GraphkilnError
from graphkiln.models.config import DecoderConfig
from graphkiln.models.decoder import DecoderForExport
from graphkiln.models.registry import ModelFamily

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def rope_inv_freq(cfg: DecoderConfig) -> tuple[torch.Tensor, float]:
    """inv_freq and attention scaling, computed by the reference's own rope init functions."""
    if cfg.rope.rope_type == "default":
        inv = 1.0 / (cfg.rope.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.int64).float() / cfg.head_dim))
        return inv, 1.0
    if cfg.rope.rope_type == "dynamic":
        raise GraphkilnError("rope_type 'dynamic' changes with sequence length and cannot be exported; use a static rope type")
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if cfg.rope.rope_type not in ROPE_INIT_FUNCTIONS:
        raise GraphkilnError(f"unknown rope_type '{cfg.rope.rope_type}' in config.json")
    hf_cfg = AutoConfig.for_model(**cfg.raw)
    inv, scaling = ROPE_INIT_FUNCTIONS[cfg.rope.rope_type](hf_cfg, "cpu")
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


def load_decoder(model_dir: Path, family: ModelFamily, cfg: DecoderConfig, dtype: str, progress: bool = True) -> DecoderForExport:
    torch_dtype = DTYPES[dtype]
    inv_freq, scaling = rope_inv_freq(cfg)
    with torch.device("meta"):
        model = DecoderForExport(cfg, inv_freq.to("meta"), scaling)
    model.inv_freq = inv_freq  # the buffer is computed, not stored in checkpoints

    where = _open_shards(model_dir)
    wanted = dict(model.named_parameters())
    if cfg.tie_word_embeddings:
        wanted.pop("lm_head.weight")
    missing = [n for n in wanted if family.checkpoint_name(n) not in where]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise GraphkilnError(
            f"checkpoint is missing weight '{family.checkpoint_name(missing[0])}'"
            f"{', ' + ', '.join(missing[1:3]) if len(missing) > 1 else ''}{more}: "
            "the safetensors files do not match config.json"
        )

    handles: dict[Path, object] = {}
    state: dict[str, torch.Tensor] = {}
    try:
        for name in tqdm(wanted, desc="loading weights", unit="tensor", disable=not progress, leave=False):
            shard = where[family.checkpoint_name(name)]
            if shard not in handles:
                handles[shard] = safe_open(str(shard), framework="pt").__enter__()
            try:
                t = handles[shard].get_tensor(family.checkpoint_name(name))
            except Exception as exc:
                raise GraphkilnError(
                    f"{shard.name} is truncated or corrupt reading '{name}' ({str(exc).splitlines()[0]}): "
                    "re-download or re-save the checkpoint"
                ) from None
            expected = tuple(wanted[name].shape)
            if tuple(t.shape) != expected:
                raise GraphkilnError(
                    f"weight '{name}' has shape {tuple(t.shape)} but config.json implies {expected}: "
                    "the safetensors files do not match config.json"
                )
            state[name] = t if t.dtype == torch_dtype else t.to(torch_dtype)
            del t
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
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
