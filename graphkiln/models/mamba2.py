"""The Mamba-2 mixer (Nemotron-H, Granite 4 ``mamba`` layers) as export-friendly torch modules.

in_proj -> gate z, xBC, dt; causal conv over xBC (graphkiln.ShortConv, per-slot conv state) then
SiLU; x, B, C split; the selective scan (graphkiln.SsmScan, per-slot [heads, state, head_dim]
state, D skip included); the gated group RMSNorm; out_proj. Parameter names are transformers'
(``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``), so Granite's
``mamba.*`` tensors load as they are and Nemotron-H's ``mixer.*`` by a rename.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphkiln.models.config import DecoderConfig


class GroupRMSNormGated(nn.Module):
    """Mamba-2's output norm (transformers' NemotronHRMSNormGated / BambaRMSNormGated): x times
    silu(gate) in fp32, *then* RMS-normalised over each of ``groups`` equal channel groups, scaled in
    the input dtype. (Qwen3.5's RMSNormGated gates after the norm: a different function.)"""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups, self.eps = groups, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) * F.silu(gate.to(torch.float32))
        # F.rms_norm exports as one RMSNormalization node (a native norm on every target); the
        # weight multiplies after the groups are merged back, in the input dtype, as the reference
        grouped = F.rms_norm(h.unflatten(-1, (self.groups, -1)), (h.shape[-1] // self.groups,), eps=self.eps)
        return self.weight * grouped.flatten(-2).to(dtype)


class Mamba2Mixer(nn.Module):
    """One Mamba-2 layer over per-slot conv and scan states (graph contract: ``models.decoder``)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        m = self.m = cfg.mamba
        self.in_proj = nn.Linear(cfg.hidden_size, m.inner_size + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(m.conv_dim, m.conv_dim, m.conv_kernel, groups=m.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.num_heads))
        self.A_log = nn.Parameter(torch.zeros(m.num_heads))
        self.D = nn.Parameter(torch.ones(m.num_heads))
        self.norm = GroupRMSNormGated(m.inner_size, m.n_groups, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(m.inner_size, cfg.hidden_size, bias=m.proj_bias)

    def fold_loaded(self) -> None:
        """Once the checkpoint's A_log is loaded: A = -exp(A_log) in fp32, as the reference computes
        it, becomes the parameter ``A`` in its place. Traced from A_log, A would be a constant the
        exporter folds, which layer stamping cannot copy per layer; a parameter is an initializer
        of the layer's own."""
        A = -torch.exp(self.A_log.detach().float())
        del self.A_log
        self.A = nn.Parameter(A, requires_grad=False)

    def forward(self, x, conv_pool, scan_pool, slot_idx, seq_lens):
        from graphkiln.ops import torch_op
        from graphkiln.ops.ssm_scan import FLOAT32_MAX

        m = self.m
        b, s, _ = x.shape
        gate, xbc, dt = self.in_proj(x).split([m.inner_size, m.conv_dim, m.num_heads], dim=-1)
        weight = self.conv1d.weight.squeeze(1)
        bias = self.conv1d.bias if self.conv1d.bias is not None else torch.zeros_like(weight[:, 0])
        xbc, new_conv = torch_op("ShortConv")(xbc, weight, bias, conv_pool, slot_idx, seq_lens, m.conv_dim)
        A = self.A if hasattr(self, "A") else -torch.exp(self.A_log.float())  # before/after fold_loaded
        xs, B, C = F.silu(xbc).split([m.inner_size, m.n_groups * m.state_size, m.n_groups * m.state_size], dim=-1)
        y, new_scan = torch_op("SsmScan")(
            xs.reshape(b, s, m.num_heads, m.head_dim), dt, A,
            B.reshape(b, s, m.n_groups, m.state_size), C.reshape(b, s, m.n_groups, m.state_size),
            self.D, self.dt_bias, scan_pool, slot_idx, seq_lens, 0, m.dt_min, min(m.dt_max, FLOAT32_MAX))
        return self.out_proj(self.norm(y.reshape(b, s, m.inner_size), gate)), new_conv, new_scan
