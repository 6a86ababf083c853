"""Export-friendly torch modules for pre-norm decoders: dense, MoE and conv hybrids.

The module tree uses one canonical set of parameter names (Llama's, with q/k/v fused into
``qkv_proj`` and gate/up into ``gate_up_proj``, plus ``conv`` and fused ``experts``); each
family maps Llama's unfused names to its checkpoint's names (``ModelFamily.source``) and
``sources.fused_source`` assembles the fused ones from them.
The forward takes per-request state as plain tensors and returns only what changed; the
runtime owns the state pools and writes the returned rows back (``graphkiln.runtime.backends.state``).
Cache position == token position: row b's token at position p lives at ``past_key[b, :, p]``.

Graph contract (one graph serves prefill and decode):
  input_ids     int64 [batch, seq]      right-padded when rows differ in length
  position_ids  int64 [batch, seq]      start_b + arange(seq); start_b = tokens already cached
  logits_index  int64 [batch, n_logits] which of the seq positions to produce logits for
  vision_embeddings      [vision_rows, hidden] (model dtype)  } only in a vision-language
  vision_scatter_indices int64 [vision_rows]                  } model's decoder (vision_seam)
                row r replaces the embedding of flat token row vision_scatter_indices[r]
                (b * seq + s) of this step; rows whose index is outside [0, batch*seq) are
                skipped, so a prompt prefilled in chunks can pass every image row each time
                and each lands once. A step without images passes zero rows: the signature
                never changes (a captured CUDA graph or a TensorRT profile replays it as it is).
  rope_position_ids int64 [3, batch, seq] M-RoPE positions (only with mrope_section; see
                runtime.prompt_layout): rotary positions, which need not be the cache positions
  lookahead     int64 [batch, seq]      extra positions each token may see (only with
                image_lookahead: Gemma3's bidirectional images; graphkiln.Attention)
  seq_lens      int64 [batch]           real tokens per row      (only with slot-state layers)
  slot_idx      int64 [batch]           row b's slot             (only with slot-state layers)
  lora_rows     int64 [lora_rows]       the rows that use a LoRA adapter   } only with ``cfg.lora``;
  lora_slots    int64 [lora_rows]       each one's adapter slot (1..N)     } zero rows: none does
  then per layer, in layer order:
    attention:  past_key.i / past_value.i  [batch, kv_heads, cache_len, head_dim]
                (only positions < start_b are read)
    conv:       conv_state.i  [slots, channels, kernel-1]  (the whole pool, read at slot_idx)
    gated_delta: conv_state.i [slots, conv_dim, kernel-1], recurrent_state.i [slots, v_heads,
                k_dim, v_dim] (whole pools, read at slot_idx; ``DecoderConfig.slot_states``)
  then, with ``cfg.lora``, per layer, per projection of ``cfg.lora_targets(layer)``:
    lora_a.{module}.i float32 [slots, in, rank], lora_b.{module}.i float32 [slots, rank, out]
                (every adapter slot's A and B; ``with_lora`` adds (x[r] @ A[slot]) @ B[slot] to each lora row r)
  -> logits     float32 [batch, n_logits, vocab]
  -> last_hidden_state [batch, n_logits, hidden] (model dtype; only with return_hidden_states):
                the final-norm hidden states at the logits_index positions (an embedding graph,
                ``return_logits`` False: this output alone, in the logits' place, and no LM head)
  -> per layer: new_key.i / new_value.i [batch, kv_heads, seq, head_dim]  (rows for position_ids)
                new_conv_state.i [batch, channels, kernel-1]               (rows for slot_idx)
                new_recurrent_state.i [batch, v_heads, k_dim, v_dim]       (rows for slot_idx)

Attention runs through the ``graphkiln.Attention`` custom op (rotary from per-position
cos/sin tables sized by ``set_rope_positions``, grouped heads, windows), so targets can
swap in their own kernel (``export.lowering.ort_attention``: onnxruntime's
GroupQueryAttention, which changes the KV contract to in-place; see ``graphkiln.manifest``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from graphkiln.models.config import DecoderConfig, LayerSpec

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu,
                "relu2": lambda x: F.relu(x) * F.relu(x)}  # a Mul, not Pow: Pow is what unfused norms leave


def with_lora(y: torch.Tensor, x: torch.Tensor, lora, parts: list[tuple[str, int]]) -> torch.Tensor:
    """``y`` [b, s, out], a (fused) projection of ``x`` [b, s, in] whose output concatenates ``parts``
    [(module, size)], plus each adapter row's update: row r = lora_rows[j] gets, per targeted part,
    (x[r] @ A[lora_slots[j]]) @ B[lora_slots[j]] (zeros for untargeted parts), added once before the
    projection's split, so the graph's fusions (packed q/k/v for GroupQueryAttention) still fire.
    ``lora``: (lora_rows, lora_slots, {module: (A stack, B stack)}) or None.

    Only the adapter rows are gathered and multiplied: a step without one runs these ops on zero
    rows, which costs next to nothing (the point of routing rows, not a per-row index into slot 0).
    The stacks are float32, cast to x's dtype after the gather."""
    if lora is None or not any(m in lora[2] for m, _ in parts):
        return y
    rows, slots, stacks = lora
    xs = x.index_select(0, rows)
    deltas = []
    for module, size in parts:
        if module in stacks:
            # index_select: one Gather of whole slots (a[slots] exports as GatherND, measured 10x slower)
            a, b = (t.index_select(0, slots).to(x.dtype) for t in stacks[module])
            deltas.append(torch.matmul(torch.matmul(xs, a), b))
        else:
            deltas.append(xs.new_zeros(*xs.shape[:2], size))
    return y.index_add(0, rows, deltas[0] if len(deltas) == 1 else torch.cat(deltas, -1))


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


class RMSNormGated(nn.Module):
    """Gated delta net's output norm: RMSNorm of x (fp32, scaled in the input dtype) times silu(gate)
    in fp32 (transformers' Qwen3_5RMSNormGated). Its weight is stored plain (no +1 offset)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(gate.to(torch.float32))).to(dtype)


def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Rotary over the first ``2 * cos.shape[-1]`` dims of each head of ``x`` [b, s, heads, head_dim]
    (rotate-half pairing inside them, the rest passed through), as transformers' apply_rotary_pos_emb
    with partial_rotary_factor < 1, in x's dtype."""
    half = cos.shape[-1]
    c = cos[position_ids].unsqueeze(2).to(x.dtype)  # [b, s, 1, half]
    s_ = sin[position_ids].unsqueeze(2).to(x.dtype)
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat((x1 * c - x2 * s_, x2 * c + x1 * s_, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = spec.window
        self.rope = spec.rope
        self.rotary_dim = cfg.rotary_dim if cfg.partial_rotary else None
        self.output_gate = cfg.attention_output_gate
        # q, k and v in one Linear (one weight read, one GEMM per step): checkpoints' separate
        # q_proj/k_proj/v_proj are concatenated on load (``sources.fused_source``); with an output
        # gate, q_proj's rows are each head's query then its gate (Qwen3-Next's layout).
        q_rows = cfg.num_heads * cfg.head_dim * (2 if cfg.attention_output_gate else 1)
        self.qkv_sizes = [q_rows, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim]
        self.qkv_proj = nn.Linear(cfg.hidden_size, sum(self.qkv_sizes), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.g_proj = nn.Linear(cfg.hidden_size, cfg.num_heads, bias=False) if cfg.attention_gate else None
        self.scale = cfg.head_dim**-0.5 if cfg.attention_scale is None else cfg.attention_scale
        # gpt-oss's learned per-head sink logit (graphkiln.Attention's sinks, use_sinks=1)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_heads)) if cfg.attention_sinks else None

    def forward(self, x, rope_tables, position_ids, past_k, past_v, lookahead=None, lora=None):
        """``rope_tables``: (cos, sin, rope_layout) as graphkiln.Attention takes them, and with
        partial rotary the identity tables the op gets instead (``DecoderForExport._rope``);
        ``lora``: (lora_rows, lora_slots, this layer's stacks by module) or None (``with_lora``)."""
        from graphkiln.ops import torch_op

        b, s, _ = x.shape
        qkv = with_lora(self.qkv_proj(x), x, lora, list(zip(("q_proj", "k_proj", "v_proj"), self.qkv_sizes)))
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        gate = None
        if self.output_gate:
            q, gate = q.view(b, s, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.reshape(b, s, -1), gate.reshape(b, s, -1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(b, s, self.num_heads, self.head_dim)).view(b, s, -1)
            k = self.k_norm(k.view(b, s, self.num_kv_heads, self.head_dim)).view(b, s, -1)
        cos, sin, layout, identity = rope_tables
        if self.rotary_dim is not None:
            # Partial rotary is applied here and the op gets identity tables (cos 1, sin 0): the op
            # rotates whole heads. Costs a few elementwise ops; an op attribute would save them.
            if self.rotary_dim:
                q = rotate_partial(q.view(b, s, self.num_heads, self.head_dim), cos, sin, position_ids).view(b, s, -1)
                k = rotate_partial(k.view(b, s, self.num_kv_heads, self.head_dim), cos, sin, position_ids).view(b, s, -1)
            cos, sin = identity
        if lookahead is None:  # causal tokens: one constant zero (folded by every target)
            lookahead = torch.zeros(1, 1, dtype=torch.int64)
        if self.sinks is not None:
            sinks, use_sinks = self.sinks.float(), 1  # the op reads sinks in fp32 (exact from any model dtype)
        else:  # never read with use_sinks=0; a constant the exporter shares between layers
            sinks, use_sinks = torch.zeros(self.num_heads), 0
        out, new_k, new_v = torch_op("Attention")(q, k, v, past_k, past_v, position_ids, cos, sin, lookahead, sinks,
                                                  self.num_heads, self.num_kv_heads, self.window or 0, self.scale,
                                                  rope_layout=layout, use_sinks=use_sinks)
        if self.g_proj is not None:
            out = (out.view(b, s, self.num_heads, self.head_dim) * torch.sigmoid(self.g_proj(x)).unsqueeze(-1)).view(b, s, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return with_lora(self.o_proj(out), out, lora, [("o_proj", self.o_proj.out_features)]), new_k, new_v


class ShortConv(nn.Module):
    """LFM-style gated short convolution: in_proj -> B, C, x -> C * conv(B * x) -> out_proj."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.in_proj = nn.Linear(h, 3 * h, bias=cfg.conv_bias)
        self.conv = nn.Conv1d(h, h, cfg.conv_kernel, groups=h, bias=cfg.conv_bias)
        self.out_proj = nn.Linear(h, h, bias=cfg.conv_bias)
        self.channels = h

    def forward(self, x, pool, slot_idx, seq_lens):
        from graphkiln.ops import torch_op

        b_gate, c_gate, xs = self.in_proj(x).chunk(3, dim=-1)
        weight = self.conv.weight.squeeze(1)
        bias = self.conv.bias if self.conv.bias is not None else torch.zeros_like(weight[:, 0])
        y, new_state = torch_op("ShortConv")(b_gate * xs, weight, bias, pool, slot_idx, seq_lens, self.channels)
        return self.out_proj(c_gate * y), new_state


class GatedDeltaNet(nn.Module):
    """A gated-delta-net layer (Qwen3.5 / Qwen3-Next ``linear_attn``): in_proj_qkv -> causal conv
    (graphkiln.ShortConv, per-slot state) -> SiLU -> q, k, v heads; beta = sigmoid(in_proj_b),
    g = -exp(A_log) * softplus(in_proj_a + dt_bias); the recurrence (graphkiln.GatedDeltaRule,
    per-slot matrix state); RMSNormGated with silu(in_proj_z); out_proj. Parameter names are
    transformers'."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        g = self.g = cfg.gated_delta
        h = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(h, g.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, g.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, g.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, g.num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(g.conv_dim, g.conv_dim, g.conv_kernel, groups=g.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(g.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(g.num_v_heads))
        self.norm = RMSNormGated(g.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(g.value_dim, h, bias=False)

    def forward(self, x, conv_pool, recurrent_pool, slot_idx, seq_lens):
        from graphkiln.ops import torch_op

        g = self.g
        b, s, _ = x.shape
        weight = self.conv1d.weight.squeeze(1)
        mixed, new_conv = torch_op("ShortConv")(self.in_proj_qkv(x), weight, torch.zeros_like(weight[:, 0]),
                                                 conv_pool, slot_idx, seq_lens, g.conv_dim)
        q, k, v = F.silu(mixed).split([g.key_dim, g.key_dim, g.value_dim], dim=-1)
        beta = torch.sigmoid(self.in_proj_b(x))
        decay = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, new_state = torch_op("GatedDeltaRule")(
            q.reshape(b, s, g.num_k_heads, g.head_k_dim), k.reshape(b, s, g.num_k_heads, g.head_k_dim),
            v.reshape(b, s, g.num_v_heads, g.head_v_dim), decay, beta, recurrent_pool, slot_idx, seq_lens,
            g.head_k_dim ** -0.5)
        z = self.in_proj_z(x).reshape(b, s, g.num_v_heads, g.head_v_dim)
        return self.out_proj(self.norm(out, z).reshape(b, s, g.value_dim)), new_conv, new_state


class MLP(nn.Module):
    """Gated: down(act(gate x) * up x), gate and up fused in ``gate_up_proj``; with
    ``cfg.mlp_gated`` False: down(act(up x)) (Nemotron-H's relu2 MLP)."""

    def __init__(self, cfg: DecoderConfig, intermediate: int | None = None) -> None:
        super().__init__()
        inter = intermediate or cfg.intermediate_size
        self.gated = cfg.mlp_gated
        if self.gated:
            self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=cfg.mlp_bias)  # gate rows, then up rows
        else:
            self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, x, lora=None):
        """``lora``: (lora_rows, lora_slots, this layer's stacks by module) or None; x is [b, s, hidden] then."""
        if not self.gated:
            h = self.act(with_lora(self.up_proj(x), x, lora, [("up_proj", self.up_proj.out_features)]))
        else:
            inter = self.down_proj.in_features
            gate, up = with_lora(self.gate_up_proj(x), x, lora, [("gate_proj", inter), ("up_proj", inter)]).chunk(2, dim=-1)
            h = self.act(gate) * up
        return with_lora(self.down_proj(h), h, lora, [("down_proj", self.down_proj.out_features)])


class Experts(nn.Module):
    """The routed experts' weights in graphkiln.MoE's layout: gate_up_proj [E, F, D] (gate rows then
    up rows, F = 2I; for the non-gated activation 1 only the F = I up rows), down_proj [E, D, I]
    and, with ``expert_biases``, gate_up_proj_bias [E, F] and down_proj_bias [E, D] (else None:
    the op gets zeros). D is the hidden size, or the latent size where the experts work in one."""

    def __init__(self, cfg: DecoderConfig) -> None:
        from graphkiln.ops.moe import gate_up_rows

        super().__init__()
        m = cfg.moe
        d = m.latent_size or cfg.hidden_size
        f = gate_up_rows(m.intermediate_size, m.activation)
        self.gate_up_proj = nn.Parameter(torch.empty(m.num_experts, f, d))
        self.down_proj = nn.Parameter(torch.empty(m.num_experts, d, m.intermediate_size))
        biases = m.expert_biases
        self.register_parameter("gate_up_proj_bias", nn.Parameter(torch.zeros(m.num_experts, f)) if biases else None)
        self.register_parameter("down_proj_bias", nn.Parameter(torch.zeros(m.num_experts, d)) if biases else None)

    def biases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up bias, down bias) for the op: the parameters, or zeros in the weights' dtype
        (adding zeros is exact, so a bias-free model computes what it did without the inputs)."""
        if self.gate_up_proj_bias is not None:
            return self.gate_up_proj_bias, self.down_proj_bias
        e, f, d = self.gate_up_proj.shape
        dtype = self.gate_up_proj.dtype
        return torch.zeros(e, f, dtype=dtype), torch.zeros(e, d, dtype=dtype)


class MoE(nn.Module):
    """Router + routed experts through the graphkiln.MoE custom op (routing inside the op), plus
    the optional latent projections around the experts and a shared expert beside them."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        m = self.cfg = cfg.moe
        self.gate = nn.Linear(cfg.hidden_size, m.num_experts, bias=m.router_bias)
        self.experts = Experts(cfg)
        self.expert_bias = nn.Parameter(torch.zeros(m.num_experts)) if m.expert_bias else None
        if m.latent_size:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, m.latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(m.latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None
        self.shared_expert = MLP(cfg, m.shared_expert_size) if m.shared_expert_size else None
        gated = m.shared_expert_size and m.shared_expert_gate
        self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False) if gated else None

    def forward(self, x):
        from graphkiln.ops import torch_op

        m = self.cfg
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        if m.router_fp32:  # as Nemotron-H: fp32 activations and weight, whatever the model dtype
            bias = None if self.gate.bias is None else self.gate.bias.float()
            logits = F.linear(flat.float(), self.gate.weight.float(), bias)
        else:
            logits = self.gate(flat)
        expert_bias = self.expert_bias if self.expert_bias is not None else torch.zeros(m.num_experts,
                                                                                        dtype=torch.float32)
        xe = flat if self.fc1_latent_proj is None else self.fc1_latent_proj(flat)
        out = torch_op("MoE")(xe, logits, self.experts.gate_up_proj, self.experts.down_proj, expert_bias,
                              *self.experts.biases(), m.top_k, m.scoring, int(m.normalize), m.norm_eps,
                              m.routed_scaling, m.activation, m.alpha, m.limit)
        if self.fc2_latent_proj is not None:
            out = self.fc2_latent_proj(out)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(b, s, h)


class DecoderLayer(nn.Module):
    """Pre-norm mixer then pre-norm FFN, each with its residual add; a half whose kind is "none"
    (``LayerSpec``) is absent with its norm, so one layer is one of Nemotron-H's one-sublayer blocks."""

    def __init__(self, cfg: DecoderConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.spec = spec
        self.residual_multiplier = cfg.residual_multiplier
        if spec.mixer == "attention":
            self.self_attn = Attention(cfg, spec)
        elif spec.mixer == "gated_delta":
            self.linear_attn = GatedDeltaNet(cfg)
        elif spec.mixer == "mamba":
            from graphkiln.models.mamba2 import Mamba2Mixer

            self.mamba = Mamba2Mixer(cfg)
        elif spec.mixer == "conv":
            self.conv = ShortConv(cfg)
        if spec.mixer != "none":
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if spec.ffn != "none":
            self.mlp = MoE(cfg) if spec.ffn == "moe" else MLP(cfg)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.sandwich_norm:
            self.post_mixer_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        else:
            self.post_mixer_norm = self.post_ffn_norm = None

    def _mix(self, h, rope, position_ids, state, slot_idx, seq_lens, lookahead, lora):
        """The mixer's output and its new state rows (a tuple, in ``DecoderConfig.slot_states`` order)."""
        mixer = self.spec.mixer
        if mixer == "attention":
            h, k, v = self.self_attn(h, rope[self.spec.rope], position_ids, *state, lookahead=lookahead, lora=lora)
            return h, (k, v)
        if mixer == "gated_delta":
            h, conv_state, recurrent_state = self.linear_attn(h, state[0], state[1], slot_idx, seq_lens)
            return h, (conv_state, recurrent_state)
        if mixer == "mamba":
            h, conv_state, scan_state = self.mamba(h, state[0], state[1], slot_idx, seq_lens)
            return h, (conv_state, scan_state)
        h, conv_state = self.conv(h, state[0], slot_idx, seq_lens)
        return h, (conv_state,)

    def _residual(self, x, h):
        if self.residual_multiplier is not None:
            h = h * self.residual_multiplier
        return x + h

    def forward(self, x, rope, position_ids, state, slot_idx, seq_lens, lookahead=None, lora=None):
        """Returns the new hidden states and this layer's new state rows (a tuple). ``lora``:
        (lora_rows, lora_slots, {module: (A stack, B stack)}) for this layer's targeted projections, or None."""
        new = ()
        if self.spec.mixer != "none":
            h, new = self._mix(self.input_layernorm(x), rope, position_ids, state, slot_idx, seq_lens, lookahead, lora)
            if self.post_mixer_norm is not None:
                h = self.post_mixer_norm(h)
            x = self._residual(x, h)
        if self.spec.ffn != "none":
            h = self.post_attention_layernorm(x)
            h = self.mlp(h) if self.spec.ffn == "moe" else self.mlp(h, lora)
            if self.post_ffn_norm is not None:
                h = self.post_ffn_norm(h)
            x = self._residual(x, h)
        return x, new


def scatter_vision_rows(x: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """The seam: token embeddings ``x`` [b, s, h] with flat row ``indices[r]`` replaced by
    ``rows[r]``. Out-of-range indices go to a spare row that is dropped (one ScatterND, no
    data-dependent shapes: a zero-row step is the same graph)."""
    b, s, h = x.shape
    n = b * s
    flat = torch.cat([x.reshape(n, h), x.new_zeros(1, h)], 0)
    inside = (indices >= 0) & (indices < n)
    target = torch.where(inside, indices, torch.full_like(indices, n))
    flat = flat.index_put((target,), rows.to(x.dtype))
    return flat[:n].reshape(b, s, h)


def embed(cfg: DecoderConfig, table: nn.Embedding, input_ids: torch.Tensor) -> torch.Tensor:
    """Token embeddings, times ``cfg.embed_scale`` when set. Before the vision seam: image rows
    enter unscaled (Gemma3's get_placeholder_mask replaces the already-scaled text embeddings). The
    scalar is rounded to the model dtype first, as the reference does (sqrt(3072) is 55.5 in bf16)."""
    x = table(input_ids)
    if cfg.embed_scale is not None:
        x = x * torch.tensor(cfg.embed_scale, dtype=torch.float32).to(x.dtype)
    return x


def final_norm(norm: nn.Module, x: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
    """The final norm of ``x`` [batch, seq, hidden] at the ``logits_index`` positions (transformers'
    ``last_hidden_state`` there): what the head reads, and what an embedding graph returns."""
    return norm(torch.gather(x, 1, logits_index.unsqueeze(-1).expand(-1, -1, x.shape[-1])))


def head(cfg: DecoderConfig, norm: nn.Module, lm_head: nn.Linear, x: torch.Tensor, logits_index: torch.Tensor):
    """(fp32 logits, final-norm hidden states) at the ``logits_index`` positions of ``x``: the
    final norm, the LM head, then Granite's logits scaling or Gemma2's softcap in the model dtype."""
    hidden = final_norm(norm, x, logits_index)
    logits = lm_head(hidden)
    if cfg.logits_scaling is not None:
        logits = logits / cfg.logits_scaling
    if cfg.final_logit_softcap is not None:
        cap = cfg.final_logit_softcap
        logits = torch.tanh(logits / cap) * cap
    return logits.to(torch.float32), hidden


def layer_stacks(cfg: DecoderConfig, layers, stacks) -> dict[int, dict]:
    """The flat LoRA stack inputs of ``layers`` (A then B per projection, ``cfg.lora_targets`` order)
    as {layer: {module: (A, B)}}."""
    out, it = {}, iter(stacks)
    for i in layers:
        out[i] = {module: (next(it), next(it)) for module, _, _ in cfg.lora_targets(i)}
    return out


class DecoderBody(nn.Module):
    """Named ``model`` in the parent so parameter names match HF's ``model.*``."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, spec) for spec in cfg.layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderForExport(nn.Module):
    """Causal LM whose forward is the graph contract in this module's docstring."""

    def __init__(self, cfg: DecoderConfig, inv_freqs: dict[str, torch.Tensor], scalings: dict[str, float]) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_flavors = sorted(inv_freqs)
        for name, inv in inv_freqs.items():
            self.register_buffer(f"inv_freq_{name}", inv.to(torch.float32), persistent=False)
        self.scalings = scalings
        self.has_conv = cfg.has_slot_states  # the graph takes seq_lens and slot_idx
        self.rope_positions = cfg.max_position_embeddings

    def set_rope_positions(self, positions: int) -> None:
        """Build the rotary tables, graph constants [positions, head_dim/2], before tracing.

        fp32, the flavor's attention scaling folded in, computed from the inv_freq buffer as
        the reference computes its per-position values. Call after the inv_freq buffers are
        real (not meta) tensors; without a call, forward sizes them to max_position_embeddings.
        """
        self.rope_positions = positions
        for name in self.rope_flavors:
            inv = getattr(self, f"inv_freq_{name}").to(torch.float32)
            freqs = torch.arange(positions, dtype=torch.float32).unsqueeze(-1) * inv
            self.register_buffer(f"rope_cos_{name}", freqs.cos() * self.scalings[name], persistent=False)
            self.register_buffer(f"rope_sin_{name}", freqs.sin() * self.scalings[name], persistent=False)
            if self.cfg.partial_rotary:  # named buffers, not anonymous constants: layer stamping copies them
                half = self.cfg.head_dim // 2
                self.register_buffer(f"rope_identity_cos_{name}", torch.ones(positions, half), persistent=False)
                self.register_buffer(f"rope_identity_sin_{name}", torch.zeros(positions, half), persistent=False)

    def rope_tables(self, flavor: str) -> tuple[torch.Tensor, torch.Tensor]:
        if not hasattr(self, f"rope_cos_{flavor}"):
            self.set_rope_positions(self.rope_positions)
        return getattr(self, f"rope_cos_{flavor}"), getattr(self, f"rope_sin_{flavor}")

    def identity_tables(self, flavor: str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos 1 / sin 0 tables of the whole head, sized as the flavor's rope tables (partial rotary only)."""
        if not hasattr(self, f"rope_identity_cos_{flavor}"):
            self.set_rope_positions(self.rope_positions)
        return getattr(self, f"rope_identity_cos_{flavor}"), getattr(self, f"rope_identity_sin_{flavor}")

    def _rope(self, flavor: str, rope_position_ids):
        """(cos, sin, rope_layout, identity) for the attention layers: the tables (layout 0), or
        with M-RoPE each token's values (layout 1), frequency section j taken at stream j's
        position, computed once per step for every layer. ``identity``: with partial rotary (the
        layers rotate their heads' first dims themselves), cos 1 / sin 0 tables of the whole head
        for graphkiln.Attention, one pair per flavor shared by every layer; else None."""
        cos, sin = self.rope_tables(flavor)
        identity = self.identity_tables(flavor) if self.cfg.partial_rotary else None
        if rope_position_ids is None:
            return cos, sin, 0, identity
        sections = list(self.cfg.mrope_section)

        def per_token(table):
            streams = table[rope_position_ids]  # [3, B, S, D/2]
            return torch.cat([part[j % 3] for j, part in enumerate(streams.split(sections, dim=-1))], dim=-1)

        return per_token(cos), per_token(sin), 1, identity

    # export --return-hidden-states: forward also returns ``last_hidden_state`` [batch, n_logits,
    # hidden] (model dtype) right after logits, the final-norm states the head reads
    return_hidden_states: bool = False
    # export --task embed: no LM head in the graph; forward returns ``last_hidden_state`` in the
    # logits' place (the graph's first output), then the states
    return_logits: bool = True

    def forward(self, input_ids, position_ids, logits_index, *rest):
        x = embed(self.cfg, self.model.embed_tokens, input_ids)
        if self.cfg.vision_seam:
            x = scatter_vision_rows(x, rest[0], rest[1])
            rest = rest[2:]
        rope_position_ids = lookahead = None
        if self.cfg.mrope_section:
            rope_position_ids, rest = rest[0], rest[1:]
        if self.cfg.image_lookahead:
            lookahead, rest = rest[0], rest[1:]
        seq_lens = slot_idx = None
        if self.has_conv:
            seq_lens, slot_idx, rest = rest[0], rest[1], rest[2:]
        routing = None
        if self.cfg.lora is not None:
            routing, rest = (rest[0], rest[1]), rest[2:]
        n_states = self._offset(self.cfg.num_layers)
        states, stacks = rest[:n_states], layer_stacks(self.cfg, range(self.cfg.num_layers), rest[n_states:])
        rope = {name: self._rope(name, rope_position_ids) for name in self.rope_flavors}
        new_states = []
        for i, layer in enumerate(self.model.layers):
            off = self._offset(i)
            lora = (*routing, stacks[i]) if stacks.get(i) else None
            x, new = layer(x, rope, position_ids, states[off: off + self.cfg.state_arity(i)], slot_idx, seq_lens, lookahead,
                           lora)
            new_states += new

        if not self.return_logits:  # an embedding graph: the final norm at the chosen positions, no head
            return (final_norm(self.model.norm, x, logits_index), *new_states)
        logits, hidden = head(self.cfg, self.model.norm, self.lm_head, x, logits_index)
        if self.return_hidden_states:  # after the final norm, as transformers' last_hidden_state
            return (logits, hidden, *new_states)
        return (logits, *new_states)

    def _offset(self, layer: int) -> int:
        return sum(self.cfg.state_arity(i) for i in range(layer))
