"""Export-friendly torch modules for dense pre-norm decoders (Llama, Qwen2/3, Mistral).

The module tree mirrors Hugging Face's parameter names so weights load by name. The
forward takes the KV cache as plain tensors and returns only the *new* K/V rows; the
runtime owns the cache buffers and writes those rows in place (see
``graphkiln.runtime.state``). Cache position == token position: row b's token at position
p lives at ``past_key[b, :, p]``.

Graph contract (one graph serves prefill and decode):
  input_ids     int64 [batch, seq]      right-padded when rows differ in length
  position_ids  int64 [batch, seq]      start_b + arange(seq); start_b = tokens already cached
  logits_index  int64 [batch, n_logits] which of the seq positions to produce logits for
  past_key.i / past_value.i  [batch, kv_heads, cache_len, head_dim]; only positions < start_b
                                         are read, the rest may hold anything
  -> logits     float32 [batch, n_logits, vocab]
  -> new_key.i / new_value.i  [batch, kv_heads, seq, head_dim]  (rows to store at position_ids)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphkiln.models.config import DecoderConfig

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic order as the reference: normalise in fp32, scale in the input dtype.
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = window
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, mask, past_k, past_v):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin

        keys = torch.cat((past_k, k), dim=2)
        values = torch.cat((past_v, v), dim=2)
        # Grouped-query attention without copying the cache per head: fold each KV group's
        # query heads into the sequence axis so one batched matmul serves the whole group.
        rep = self.num_heads // self.num_kv_heads
        qg = q.reshape(b, self.num_kv_heads, rep * s, self.head_dim)
        scores = torch.matmul(qg, keys.transpose(2, 3)) * (self.head_dim**-0.5)
        scores = scores.to(torch.float32).view(b, self.num_kv_heads, rep, s, -1)
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(x.dtype).view(b, self.num_kv_heads, rep * s, -1)
        out = torch.matmul(probs, values).view(b, self.num_heads, s, self.head_dim)
        out = out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.o_proj(out), k, v


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, window: int | None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, window)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, past_k, past_v):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask, past_k, past_v)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class DecoderBody(nn.Module):
    """Named ``model`` in the parent so parameter names match HF's ``model.*``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, w) for w in cfg.layer_windows)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def attention_mask(position_ids: torch.Tensor, cache_len: int, window: int | None) -> torch.Tensor:
    """Boolean [batch, 1, 1, seq, cache_len + seq]: may query (b, q) see key k?

    Keys are the cache (positions 0..cache_len-1) followed by the new tokens. A cached key
    at position j is valid only below the row's start; a new key is visible causally by
    position, and within ``window`` positions when the layer slides.
    """
    start = position_ids[:, :1]  # [b, 1]
    cache_pos = torch.arange(cache_len, device=position_ids.device).unsqueeze(0).expand(position_ids.shape[0], -1)
    key_pos = torch.cat((cache_pos, position_ids), dim=1)  # [b, cache_len + seq]
    q_pos = position_ids.unsqueeze(2)  # [b, seq, 1]
    k_pos = key_pos.unsqueeze(1)  # [b, 1, keys]
    visible = k_pos <= q_pos
    cached = torch.cat((cache_pos < start, torch.ones_like(position_ids, dtype=torch.bool)), dim=1)
    visible = visible & cached.unsqueeze(1)
    if window is not None:
        visible = visible & (k_pos > q_pos - window)
    return visible[:, None, None]


class DecoderForExport(nn.Module):
    """Causal LM whose forward is the graph contract in this module's docstring."""

    def __init__(self, cfg: DecoderConfig, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, input_ids, position_ids, logits_index, *past):
        x = self.model.embed_tokens(input_ids)
        dtype = x.dtype
        freqs = position_ids.unsqueeze(-1).to(torch.float32) * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.attention_scaling).to(dtype).unsqueeze(1)
        sin = (emb.sin() * self.attention_scaling).to(dtype).unsqueeze(1)

        cache_len = past[0].shape[2]
        masks: dict[int | None, torch.Tensor] = {}
        new_states = []
        for i, layer in enumerate(self.model.layers):
            window = layer.self_attn.window
            if window not in masks:
                masks[window] = attention_mask(position_ids, cache_len, window)
            x, k, v = layer(x, cos, sin, masks[window], past[2 * i], past[2 * i + 1])
            new_states += [k, v]

        index = logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1])
        x = torch.gather(x, 1, index)
        logits = self.lm_head(self.model.norm(x)).to(torch.float32)
        return (logits, *new_states)
