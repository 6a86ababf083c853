"""Qwen3NextForCausalLM: Qwen3.5's layer kinds with a sparse MoE (+ gated shared expert) FFN, and
the gated delta net's projections stored fused and grouped per q/k head.

Checkpoint layout: ``linear_attn.in_proj_qkvz`` holds, for each of the ``num_k_heads`` groups,
that head's q rows, k rows, then the group's ``Hv/Hk`` v heads and as many z heads;
``in_proj_ba`` holds per group its b rows then its a rows. The decoder's separate ``in_proj_qkv``
(all q, all k, all v: the order its conv weights follow), ``in_proj_z``, ``in_proj_b`` and
``in_proj_a`` are row ranges of those (``sources.Rows``), so the export reads each weight once
and the graph needs no reshuffling. MoE layers by ``decoder_sparse_step`` / ``mlp_only_layers``
as Qwen3-MoE; routing renormalised when ``norm_topk_prob``.
"""

import re
from dataclasses import replace

from graphkiln.models.config import LayerSpec, cfg_bool, cfg_int, cfg_int_list, parse_dense
from graphkiln.models.mixtral import experts_key, moe_config
from graphkiln.models.qwen3_5 import gated_delta_config, hybrid_layers, rotary_dim
from graphkiln.models.qwen3_moe import stacked_expert_source
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.sources import Rows

ARCH = "Qwen3NextForCausalLM"


def _parse(raw: dict):
    mixers = hybrid_layers(raw, ARCH)
    n = len(mixers)
    step = cfg_int(raw, "decoder_sparse_step", 1)
    dense_only = set(cfg_int_list(raw, "mlp_only_layers", below=n) or ())
    experts = cfg_int(raw, experts_key(raw, "num_experts"), 0, min=0)
    layers = tuple(LayerSpec(mixer=m.mixer, ffn="moe" if experts and i not in dense_only and (i + 1) % step == 0
                             else "mlp") for i, m in enumerate(mixers))
    moe = moe_config(raw, ARCH, experts_default=experts, top_k_default=10, size_key="moe_intermediate_size",
                     normalize=cfg_bool(raw, "norm_topk_prob", True),
                     shared_expert_size=cfg_int(raw, "shared_expert_intermediate_size", 0, min=0)) if experts else None
    cfg = parse_dense(raw, ARCH, qk_norm=True, mlp_bias=False, layers=layers, moe=moe,
                      gated_delta=gated_delta_config(raw, ARCH), attention_output_gate=True, norm_weight_offset=1.0)
    return replace(cfg, rotary_dim=rotary_dim(raw, cfg.head_dim))


def _grouped(name: str, groups: int, parts: tuple[int, ...], wanted: tuple[int, ...]) -> Rows:
    """Rows of tensor ``name`` laid out as ``groups`` repeats of ``parts`` (row counts): for each
    wanted part index, that part's rows of every group, in group order."""
    size = sum(parts)
    starts = [sum(parts[:i]) for i in range(len(parts))]
    ranges = tuple((g * size + starts[p], g * size + starts[p] + parts[p]) for p in wanted for g in range(groups))
    return Rows((name,), ranges, groups * size)


def _source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+\.linear_attn)\.in_proj_(qkv|z|b|a)\.weight$", name)
    if not m:
        return stacked_expert_source(name, cfg)
    g = cfg.gated_delta
    ratio = g.num_v_heads // g.num_k_heads
    qkvz = (g.head_k_dim, g.head_k_dim, ratio * g.head_v_dim, ratio * g.head_v_dim)
    part = m.group(2)
    if part in ("qkv", "z"):
        return _grouped(f"{m.group(1)}.in_proj_qkvz.weight", g.num_k_heads, qkvz, (0, 1, 2) if part == "qkv" else (3,))
    return _grouped(f"{m.group(1)}.in_proj_ba.weight", g.num_k_heads, (ratio, ratio), (0,) if part == "b" else (1,))


FAMILY = register(ModelFamily(ARCH, _parse, _source))
