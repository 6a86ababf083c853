"""Phi3ForCausalLM (Phi-3, Phi-4-mini): Llama's layers with q/k/v and gate/up stored fused.

``self_attn.qkv_proj`` (q rows, then k, then v) and ``mlp.gate_up_proj`` (gate rows, then up) are
the decoder's own fused Linears; the loader reads them as row ranges (``sources.Rows``) of the
stored tensor. Rotary covers ``partial_rotary_factor`` of each head (Phi-4-mini: 0.75). A
``sliding_window``, when set, applies to every layer. ``longrope`` ("su" and "yarn" in older Phi-3
configs) is exact up to ``original_max_position_embeddings``, the export's limit for it
(``pipeline.check_max_seq_len``).
"""

from __future__ import annotations

import re
from dataclasses import replace

from graphkiln.models.config import RopeConfig, cfg_window, num_layers, parse_dense
from graphkiln.models.qwen3_5 import rotary_dim
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Rows

ARCH = "Phi3ForCausalLM"


def _parse(raw: dict):
    window = cfg_window(raw)
    cfg = parse_dense(raw, ARCH, qkv_bias=False, o_bias=False, mlp_bias=False,
                      layer_windows=(window,) * num_layers(raw, ARCH))
    if cfg.rope.rope_type in ("su", "yarn"):  # transformers' Phi3Config renames them to longrope
        rope = RopeConfig(cfg.rope.theta, "longrope", {**cfg.rope.parameters, "rope_type": "longrope"})
        cfg = replace(cfg, rope=rope, ropes={"default": rope})
    dim = rotary_dim(raw, cfg.head_dim, default=1.0)
    return replace(cfg, rotary_dim=dim if dim < cfg.head_dim else None)


def _source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.weight$", name)
    if not m:
        return name
    layer, module, part = m.groups()
    if module == "self_attn":
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        total = q + 2 * kv
        rows = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, total)}[part]
        return Rows((f"{layer}.self_attn.qkv_proj.weight",), (rows,), total)
    inter = cfg.intermediate_size
    rows = (0, inter) if part == "gate" else (inter, 2 * inter)
    return Rows((f"{layer}.mlp.gate_up_proj.weight",), (rows,), 2 * inter)


FAMILY = register(ModelFamily(ARCH, _parse, _source))
