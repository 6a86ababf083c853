"""Where a canonical parameter's tensor comes from in a checkpoint (torch-free descriptions).

Families describe, per canonical name, a ``Source``: a plain tensor name, an ``Alt`` of
layouts (a fused tensor, or per-expert tensors to stack), ``Stack``/``Cat`` of parts, ``Rows``
and ``Rearranged`` views of one stored tensor. The
loader in ``weights.py`` resolves them against the safetensors index.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Stack:
    parts: tuple  # Sources stacked along a new dim 0


@dataclass(frozen=True)
class Cat:
    parts: tuple  # Sources concatenated along dim 0
    # Rows each part contributes, when known (q/k/v differ); None: equal parts. Only used to
    # name the part whose shape is wrong.
    sizes: tuple | None = None


@dataclass(frozen=True)
class Rows:
    """Row ranges ``[start, stop)`` of one stored tensor of ``total`` rows, concatenated in order
    (a checkpoint's fused projection laid out per head group, split into the decoder's parts)."""

    parts: tuple  # one Source
    ranges: tuple  # ((start, stop), ...)
    total: int


@dataclass(frozen=True)
class Rearranged:
    """One stored tensor in another layout (gpt-oss's experts): its last dim holds ``interleave``
    parts alternating (element c * interleave + j is part j's element c; gpt-oss's gate and up
    alternate), which become consecutive (part 0's, then part 1's...); then, with ``transpose``, its
    last two dims are swapped (gpt-oss stores x @ W weights, [..., in, out] for our [..., out, in])."""

    parts: tuple  # one Source
    interleave: int = 1
    transpose: bool = False


@dataclass(frozen=True)
class Alt:
    options: tuple  # the first option whose tensors all exist wins


Source = str | Stack | Cat | Rows | Rearranged | Alt


def names_in(src: Source) -> list[str]:
    if isinstance(src, str):
        return [src]
    parts = src.options[0:1] if isinstance(src, Alt) else src.parts
    return [n for p in parts for n in names_in(p)]


def renamer(rules: list[tuple[str, str]]):
    """canonical name -> checkpoint name by regex rules applied in order."""
    compiled = [(re.compile(p), r) for p, r in rules]

    def rename(name: str) -> str:
        for pattern, repl in compiled:
            name = pattern.sub(repl, name)
        return name

    return rename


_FUSED = (
    (re.compile(r"^(.*\.self_attn)\.qkv_proj\.(weight|bias)$"), ("q_proj", "k_proj", "v_proj")),
    (re.compile(r"^(.*\.(?:mlp|shared_expert))\.gate_up_proj\.(weight|bias)$"), ("gate_proj", "up_proj")),
)


def fused_source(source, name: str, cfg) -> Source:
    """``source(name, cfg)`` for the decoder's fused Linears too: their tensor is the rows of
    the Llama-named parts, concatenated (q, k, v; gate, up), each part mapped by ``source``."""
    for pattern, parts in _FUSED:
        m = pattern.match(name)
        if m:
            sizes = None
            if parts[0] == "q_proj":
                q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
                if cfg.attention_output_gate:  # q_proj holds each head's query and its gate
                    q *= 2
                sizes = (q, kv, kv)
            return Cat(tuple(source(f"{m.group(1)}.{part}.{m.group(2)}", cfg) for part in parts), sizes)
    return source(name, cfg)


def stacked_experts(prefix: str, num_experts: int, gate: str, up: str, down: str) -> dict[str, Source]:
    """Sources for fused expert tensors from a checkpoint that may store them per expert.

    ``prefix`` is the checkpoint's experts module path, e.g. "model.layers.3.mlp.experts".
    """
    gate_up = Alt((f"{prefix}.gate_up_proj",
                   Stack(tuple(Cat((f"{prefix}.{e}.{gate}.weight", f"{prefix}.{e}.{up}.weight")) for e in range(num_experts)))))
    down_src = Alt((f"{prefix}.down_proj", Stack(tuple(f"{prefix}.{e}.{down}.weight" for e in range(num_experts)))))
    return {"gate_up_proj": gate_up, "down_proj": down_src}


BASE_MODEL_PREFIX = "model."


def without_base_prefix(src: Source) -> Source:
    """``src`` with ``model.`` dropped from every tensor name: where a checkpoint saved from the
    base model class (``Qwen3Model``: Qwen3-Embedding and other embedding checkpoints, no LM head)
    keeps what a ``*ForCausalLM`` checkpoint stores under ``model.``."""
    if isinstance(src, str):
        return src.removeprefix(BASE_MODEL_PREFIX)
    if isinstance(src, Alt):
        return Alt(tuple(without_base_prefix(o) for o in src.options))
    from dataclasses import replace

    return replace(src, parts=tuple(without_base_prefix(p) for p in src.parts))
