"""The torch module of Qwen2.5-VL's vision graph (see ``models.qwen2_5_vl``), written for export.

transformers' ``Qwen2_5_VisionTransformerPretrainedModel`` computes its windows, rotary positions
and attention segments from ``grid_thw`` with Python loops over images (``.tolist()``), which do
not trace to a graph that takes any grid. This module computes the same function from inputs the
runtime derives from the grids (``runtime.backends.vision_groups``):

- patch embedding: the Conv3d whose kernel equals its stride over a processor row of
  ``C * t * p * p`` values is one MatMul with the kernel flattened in the same (C, t, p, p) order;
- blocks: RMSNorm -> qkv -> 2-D rotary (row and column frequencies, fp32) -> attention within
  each group (``window_groups`` in windowed layers, ``image_groups`` at ``fullatt_block_indexes``;
  rows gathered into padded groups, padding keys masked, results gathered back by ``*_slots``)
  -> proj; RMSNorm -> gated MLP (with bias);
- merger: RMSNorm, four consecutive rows (one merge unit) concatenated, Linear -> GELU -> Linear.

Patches stay in the processor's order throughout (see ``runtime.backends.vision_groups`` for why that is
transformers' result without its window permutation), so output row k is merge unit k.

Below ``models.qwen2_5_vl``: the family checks ``vision_config`` (``vision_fields``) and passes
the checked fields in; nothing here imports the family.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from graphkiln.manifest import TensorSpec
from graphkiln.models.weights import tensor_headers

PREFIXES = ("model.visual.", "visual.")  # transformers 5 in-memory names, then what save_pretrained writes
ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "quick_gelu", "relu")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class PatchEmbed(nn.Module):
    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(dim, channels, temporal, patch, patch))

    def forward(self, x):
        w = self.proj.weight
        return x.to(w.dtype) @ w.reshape(w.shape[0], -1).t()


class MLP(nn.Module):
    def __init__(self, dim: int, inner: int, act: str) -> None:
        super().__init__()
        from transformers.activations import ACT2FN

        self.gate_proj, self.up_proj = nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.down_proj = nn.Linear(inner, dim)
        self.act = ACT2FN[act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def grouped_attention(q, k, v, groups, slots, scale: float):
    """softmax(q k^T * scale) v within each group: q/k/v [N, H, d]; groups [G, L] patch indices
    padded with N; slots [N] each patch's flat index in groups. Returns [N, H * d]."""
    n, heads, d = q.shape
    pad = q.new_zeros(1, heads, d)

    def gather(t):  # [G, H, L, d]
        return torch.cat([t, pad], 0)[groups].transpose(1, 2)

    qg, kg, vg = gather(q), gather(k), gather(v)
    scores = torch.matmul(qg, kg.transpose(2, 3)) * scale
    valid = (groups < n)[:, None, None, :]
    scores = scores.masked_fill(~valid, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(weights, vg).transpose(1, 2)  # [G, L, H, d]
    return out.reshape(-1, heads * d)[slots]


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, cos, sin, groups, slots):
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.heads, self.head_dim).unbind(1)
        dtype = q.dtype
        q, k = q.float(), k.float()
        q = (q * cos + _rotate_half(q) * sin).to(dtype)
        k = (k * cos + _rotate_half(k) * sin).to(dtype)
        return self.proj(grouped_attention(q, k, v, groups, slots, self.head_dim ** -0.5))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, inner: int, act: str) -> None:
        super().__init__()
        self.norm1, self.norm2 = RMSNorm(dim), RMSNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = MLP(dim, inner, act)

    def forward(self, x, cos, sin, groups, slots):
        x = x + self.attn(self.norm1(x), cos, sin, groups, slots)
        return x + self.mlp(self.norm2(x))


class Merger(nn.Module):
    def __init__(self, dim: int, context: int, merge: int) -> None:
        super().__init__()
        self.hidden = context * merge * merge
        self.ln_q = RMSNorm(context)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).reshape(-1, self.hidden))


class Qwen25VisionForExport(nn.Module):
    """forward(pixel_values [patches, C*t*p*p], patch_positions, window_groups, window_slots,
    image_groups, image_slots) -> image_embeddings [patches / merge**2, text hidden]."""

    def __init__(self, v: dict, window: int) -> None:
        super().__init__()
        dim, heads = v["hidden_size"], v["num_heads"]
        self.merge, self.window = v["spatial_merge_size"], window
        self.patch_embed = PatchEmbed(v["in_channels"], v["temporal_patch_size"], v["patch_size"], dim)
        self.blocks = nn.ModuleList(Block(dim, heads, v["intermediate_size"], v["hidden_act"]) for _ in range(v["depth"]))
        self.merger = Merger(v["out_hidden_size"], dim, self.merge)
        self.full = frozenset(v["fullatt_block_indexes"])
        head_dim = dim // heads
        spatial = head_dim // 2
        inv = 1.0 / (v["rope_theta"] ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))
        self.register_buffer("inv_freq", inv, persistent=False)

    def rotary(self, positions):
        """cos, sin [N, 1, head_dim] (fp32): row frequencies then column frequencies, twice."""
        freqs = positions[..., None].float() * self.inv_freq  # [N, 2, head_dim/4]
        freqs = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, pixel_values, patch_positions, window_groups, window_slots, image_groups, image_slots):
        x = self.patch_embed(pixel_values)
        cos, sin = self.rotary(patch_positions)
        for i, block in enumerate(self.blocks):
            groups, slots = (image_groups, image_slots) if i in self.full else (window_groups, window_slots)
            x = block(x, cos, sin, groups, slots)
        return self.merger(x)

    def graph_io(self, hidden: int, dtype: str):
        """(inputs, outputs, example args, dynamic shapes) for ``export.vision_export``."""
        from torch.export import Dim

        from graphkiln.runtime.backends.vision_groups import patch_groups, window_area

        w = self.patch_embed.proj.weight
        row = w[0].numel()
        area = window_area(self.merge, self.window)
        ins = (TensorSpec("pixel_values", "float32", ("patches", row), "pixel_values"),
               TensorSpec("patch_positions", "int64", ("patches", 2), "patch_positions"),
               TensorSpec("window_groups", "int64", ("windows", area), "window_groups"),
               TensorSpec("window_slots", "int64", ("patches",), "window_slots"),
               TensorSpec("image_groups", "int64", ("images", "image_patches"), "image_groups"),
               TensorSpec("image_slots", "int64", ("patches",), "image_slots"))
        outs = (TensorSpec("image_embeddings", dtype, ("image_rows", hidden), "image_embeddings"),)
        grids = _example_grids(self.merge, self.window, area)
        feeds = patch_groups(grids, self.merge, self.window)
        n = feeds["patch_positions"].shape[0]
        args = (torch.rand(n, row),) + tuple(torch.from_numpy(feeds[t.name]) for t in ins[1:])
        patches, windows, images, image_patches = Dim("patches"), Dim("windows"), Dim("images"), Dim("image_patches")
        dynamic = ({0: patches}, {0: patches}, {0: windows}, {0: patches}, {0: images, 1: image_patches}, {0: patches})
        return ins, outs, args, dynamic


def _example_grids(merge: int, window: int, area: int) -> list[tuple[int, int, int]]:
    """Two image grids whose dynamic sizes (patches, windows, images, largest image) are all
    different from each other, from 0 and 1 and from the static window area, so tracing keeps
    each axis a symbol of its own."""
    from graphkiln.runtime.backends.vision_groups import patch_groups

    for a in range(2, 12):
        for b in range(1, a):
            grids = [(1, a * merge, (a + 1) * merge), (1, b * merge, (b + 2) * merge)]
            f = patch_groups(grids, merge, window)
            sizes = [len(f["patch_positions"]), len(f["window_groups"]), 2, f["image_groups"].shape[1]]
            if len(set(sizes + [area, merge * merge])) == len(sizes) + len({area, merge * merge}) and min(sizes) > 1:
                return grids
    raise AssertionError("no example grid")  # unreachable for merge, window >= 1


def match_tensors(module: nn.Module, headers: dict[str, dict]) -> dict[str, str]:
    from graphkiln.models.llava_vision import match_tensors

    return match_tensors(module, headers, PREFIXES, "vision tower")


def _module(v: dict, device: str) -> Qwen25VisionForExport:
    with torch.device(device):
        return Qwen25VisionForExport(v, v["window"])


def check_qwen_vision(src: Path, fields: dict) -> None:
    """What ``build_qwen_vision`` would refuse about the weights, from the shard headers alone.
    ``fields``: ``vision_config`` as ``models.qwen2_5_vl.vision_fields`` checked it."""
    match_tensors(_module(fields, "meta"), tensor_headers(src))


def build_qwen_vision(src: Path, fields: dict, dtype: str) -> Qwen25VisionForExport:
    from graphkiln.models.weights import read_tensors

    module = _module(fields, "cpu")  # inv_freq is not in the checkpoint: built for real
    wanted = match_tensors(module, tensor_headers(src))
    tensors = read_tensors(src, list(wanted.values()), dtype)
    module.load_state_dict({key: tensors[name] for key, name in wanted.items()}, strict=True, assign=True)
    return module.eval()
