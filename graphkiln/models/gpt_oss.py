"""GptOssForCausalLM: attention with per-head sinks, sliding and full layers alternating, q/k/v/o
biases, YaRN rotary; every FFN a routed MoE of clamped-SwiGLU experts with biases.

Routing is top-k of the router's logits (its Linear has a bias) then softmax over those k, which
is the op's softmax-then-renormalise. The checkpoint keeps its experts as x @ W weights with gate
and up columns alternating (``experts.gate_up_proj`` [E, H, 2I], ``gate_up_proj_bias`` [E, 2I],
``down_proj`` [E, I, H]): ``sources.Rearranged`` reads them into graphkiln.MoE's layout (gate rows
then up rows, [E, 2I, H]; down [E, H, I]). A checkpoint in the Hub's form stores the experts as
MXFP4 blocks instead (``models.mxfp4``: ``*_blocks``/``*_scales`` [E, out, in/32...], gate and up
rows alternating), read directly: the export writes them as onnxruntime QMoE blocks. Layers without ``layer_types`` alternate as transformers'
default: even layers slide, odd layers attend fully.
"""

from __future__ import annotations

import re

from graphkiln.models.config import (LayerSpec, cfg_bool, cfg_float, cfg_int, cfg_layer_types, cfg_window,
                                     num_layers, parse_dense)
from graphkiln.models.mixtral import moe_config
from graphkiln.models.registry import ModelFamily, register
from graphkiln.models.mxfp4 import experts_source
from graphkiln.models.sources import Alt, Rearranged

ARCH = "GptOssForCausalLM"


def _layers(raw: dict) -> tuple[LayerSpec, ...]:
    n = num_layers(raw, ARCH)
    types = cfg_layer_types(raw, ("sliding_attention", "full_attention"), n)
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    window = cfg_window(raw) if "sliding_window" in raw else 128  # transformers' default when absent
    return tuple(LayerSpec(window=window if t == "sliding_attention" else None, ffn="moe") for t in types)


def _parse(raw: dict):
    bias = cfg_bool(raw, "attention_bias", True)
    moe = moe_config(raw, ARCH, experts_default=128, top_k_default=4, size_key="intermediate_size",
                     experts_first="num_local_experts", normalize=True, activation=2,
                     alpha=cfg_float(raw, "swiglu_alpha", 1.702, positive=True),
                     limit=cfg_float(raw, "swiglu_limit", 7.0, positive=True), expert_biases=True, router_bias=True)
    return parse_dense(raw, ARCH, qkv_bias=bias, o_bias=bias, mlp_bias=False, layers=_layers(raw), moe=moe,
                       attention_sinks=True, max_position_embeddings=cfg_int(raw, "max_position_embeddings", 131072))


def _source(name: str, cfg):
    m = re.match(r"(model\.layers\.\d+\.mlp)\.(gate\.(?:weight|bias)|experts\.\w+)$", name)
    if not m:
        return name
    prefix, part = m.groups()
    if part.startswith("gate."):
        return f"{prefix}.router.{part[5:]}"
    stored = f"{prefix}.{part}"
    if part == "experts.gate_up_proj":  # MXFP4 blocks (the Hub's form, rows g0, u0, g1...) or floats
        return Alt((experts_source(f"{stored}_blocks", f"{stored}_scales", deinterleave=True),
                    Rearranged((stored,), interleave=2, transpose=True)))
    if part == "experts.gate_up_proj_bias":
        return Rearranged((stored,), interleave=2)
    if part == "experts.down_proj":
        return Alt((experts_source(f"{stored}_blocks", f"{stored}_scales"), Rearranged((stored,), transpose=True)))
    return stored


FAMILY = register(ModelFamily(ARCH, _parse, _source))
