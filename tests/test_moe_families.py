"""graphkiln.MoE and the decoder's MoE module against transformers' gpt-oss and Nemotron-H blocks.

Random weights (transformers leaves experts uninitialised), tiny sizes, fp32. The op is checked
on its own (its inputs built from the HF module's parameters, as a family's loader will: gpt-oss
columns de-interleaved and transposed) and through ``graphkiln.models.decoder.MoE`` built from a
``MoEConfig``, so what a family sets in config is what the oracle computes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from graphkiln.export.custom_ops import registry as R
from graphkiln.ops import moe as moe_op
from reference import assert_close

H, I, E, TOP_K = 32, 16, 8, 3
TOKENS = (1, 17)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randomize(module: torch.nn.Module, seed: int, scales: dict[str, float]) -> None:
    g = _gen(seed)
    with torch.no_grad():
        for n, p in list(module.named_parameters()) + list(module.named_buffers()):
            if p.is_floating_point():
                p.copy_(torch.randn(p.shape, generator=g) * scales.get(n, 0.3))


def _decoder_cfg(moe, hidden=H, **kw):
    from graphkiln.models.config import DecoderConfig, LayerSpec, RopeConfig

    return DecoderConfig(architecture="test", vocab_size=32, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
                         rope=RopeConfig(10000.0), max_position_embeddings=64, tie_word_embeddings=False,
                         layers=(LayerSpec("attention", ffn="moe"),), moe=moe, **kw)


# ----------------------------------------------------------------------------------------------
# gpt-oss: biased experts, clamped SwiGLU on interleaved columns, softmax over the top-k logits


def _gpt_oss(limit: float = 7.0):
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=TOP_K,
                                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                    vocab_size=64, swiglu_limit=limit)
    block = GptOssMLP(cfg).eval()
    # gate_up large enough that both clamps bind at limit 7 (checked below)
    _randomize(block, 5, {"experts.gate_up_proj": 1.2, "router.weight": 0.5, "experts.gate_up_proj_bias": 1.0})
    return cfg, block


def _gpt_oss_weights(block) -> dict[str, torch.Tensor]:
    """The family's load: gate_up [E, H, 2I] with gate/up interleaved in columns -> [E, 2I, H]
    gate rows then up rows (and its bias likewise); down [E, I, H] -> [E, H, I]."""
    ex = block.experts
    gu = ex.gate_up_proj.detach()
    gub = ex.gate_up_proj_bias.detach()
    return {"gate_up": torch.cat([gu[..., ::2], gu[..., 1::2]], dim=-1).transpose(1, 2).contiguous(),
            "gate_up_bias": torch.cat([gub[:, ::2], gub[:, 1::2]], dim=-1),
            "down": ex.down_proj.detach().transpose(1, 2).contiguous(), "down_bias": ex.down_proj_bias.detach()}


def test_gpt_oss_router_is_softmax_normalize():
    """GptOssTopKRouter (top-k of the logits, softmax over those k) is the op's scoring=0 +
    normalize=1 + norm_eps=0 routing: same experts, same weights up to rounding."""
    _, block = _gpt_oss()
    for tokens in (1, 64):
        x = torch.randn(tokens, H, generator=_gen(tokens))
        with torch.no_grad():
            logits, scores, idx = block.router(x)
            w, ids = moe_op.routing(logits, torch.zeros(E), TOP_K, 0, 1, 0.0, 1.0)
        assert torch.equal(ids, idx)
        assert_close(w, scores, rel=1e-6, what=f"{tokens} tokens")
        assert (scores - w).abs().max() <= 4 * torch.finfo(torch.float32).eps


@pytest.mark.parametrize("limit", [7.0, 0.9])
def test_moe_op_matches_gpt_oss_experts(limit):
    cfg, block = _gpt_oss(limit)
    wts = _gpt_oss_weights(block)
    attrs = (TOP_K, 0, 1, 0.0, 1.0, moe_op.SWIGLU_CLAMPED, cfg.swiglu_alpha, cfg.swiglu_limit)
    for tokens in TOKENS:
        x = torch.randn(1, tokens, H, generator=_gen(100 + tokens))
        with torch.no_grad():
            want, _ = block(x)
            flat = x[0]
            pre = torch.einsum("th,efh->tef", flat, wts["gate_up"]) + wts["gate_up_bias"]
            assert (pre[..., :I] > limit).any() and (pre[..., I:].abs() > limit).any(), "no clamp binds"
            logits = F.linear(flat, block.router.weight, block.router.bias)
            got = R.torch_op("MoE")(flat, logits, wts["gate_up"], wts["down"], torch.zeros(E), wts["gate_up_bias"],
                                    wts["down_bias"], *attrs)
        assert_close(got, want[0], what=f"limit {limit}, {tokens} tokens")


def test_decoder_moe_matches_gpt_oss_block():
    """decoder.MoE from MoEConfig(activation=2, expert_biases, router_bias): the family only sets fields."""
    from graphkiln.models.config import MoEConfig
    from graphkiln.models.decoder import MoE

    hf_cfg, block = _gpt_oss()
    moe = MoEConfig(num_experts=E, top_k=TOP_K, intermediate_size=I, scoring=0, normalize=True, norm_eps=0.0,
                    activation=2, alpha=hf_cfg.swiglu_alpha, limit=hf_cfg.swiglu_limit, expert_biases=True,
                    router_bias=True)
    ours = MoE(_decoder_cfg(moe)).eval()
    wts = _gpt_oss_weights(block)
    state = {"gate.weight": block.router.weight, "gate.bias": block.router.bias,
             "experts.gate_up_proj": wts["gate_up"], "experts.gate_up_proj_bias": wts["gate_up_bias"],
             "experts.down_proj": wts["down"], "experts.down_proj_bias": wts["down_bias"]}
    ours.load_state_dict(state, strict=True)
    for tokens in TOKENS:
        x = torch.randn(2, tokens, H, generator=_gen(200 + tokens))
        with torch.no_grad():
            assert_close(ours(x), block(x)[0], what=f"{tokens} tokens")


# ----------------------------------------------------------------------------------------------
# Nemotron-H: non-gated relu² experts, sigmoid routing with a selection bias, eps 1e-20, scaling


def _nemotron_h(latent: int | None = None, shared: int = 24):
    import transformers

    cfg = transformers.NemotronHConfig(hidden_size=H, moe_intermediate_size=I, n_routed_experts=E,
                                       num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True,
                                       routed_scaling_factor=2.5, moe_latent_size=latent,
                                       moe_shared_expert_intermediate_size=shared, mlp_hidden_act="relu2",
                                       num_hidden_layers=1, layers_block_type=["moe"], vocab_size=64)
    return cfg


def _nemotron_block(cfg):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    block = NemotronHMoE(cfg).eval()
    # a selection bias big enough to change which experts are picked (checked below)
    _randomize(block, 9, {"gate.weight": 0.5, "gate.e_score_correction_bias": 0.5})
    return block


def test_moe_op_matches_nemotron_h_router_and_experts():
    """NemotronHTopkRouter (n_group=1, topk_group=1) + NemotronHExperts = the op with scoring=1,
    normalize=1, norm_eps=1e-20, routed_scaling=routed_scaling_factor, activation=1 (relu²)."""
    cfg = _nemotron_h()
    block = _nemotron_block(cfg)
    router, experts = block.gate, block.experts
    attrs = (TOP_K, 1, 1, 1e-20, cfg.routed_scaling_factor, moe_op.RELU2)
    bias = router.e_score_correction_bias
    for tokens in TOKENS:
        x = torch.randn(tokens, H, generator=_gen(300 + tokens))
        with torch.no_grad():
            logits, w, idx = router(x)
            want = experts(x, idx, w)
            if tokens > 1:  # the selection bias matters here: without it other experts win
                plain = torch.topk(torch.sigmoid(logits), TOP_K).indices
                assert (plain.sort().values != idx.sort().values).any()
            got = R.torch_op("MoE")(x, logits, experts.up_proj, experts.down_proj, bias, torch.zeros(E, I),
                                    torch.zeros(E, H), *attrs)
        assert_close(got, want, what=f"{tokens} tokens")


@pytest.mark.parametrize("latent", [None, 24], ids=["no-latent", "latent"])
def test_decoder_moe_matches_nemotron_h_block(latent):
    """The whole NemotronHMoE (fp32 router, relu² experts, optional latent projections, ungated
    relu² shared expert) against decoder.MoE configured by MoEConfig fields."""
    from graphkiln.models.config import MoEConfig
    from graphkiln.models.decoder import MoE

    cfg = _nemotron_h(latent)
    block = _nemotron_block(cfg)
    moe = MoEConfig(num_experts=E, top_k=TOP_K, intermediate_size=I, scoring=1, normalize=True, norm_eps=1e-20,
                    routed_scaling=cfg.routed_scaling_factor, expert_bias=True, activation=1, router_fp32=True,
                    latent_size=latent or 0, shared_expert_size=cfg.moe_shared_expert_intermediate_size,
                    shared_expert_gate=False)
    ours = MoE(_decoder_cfg(moe, hidden_act="relu2", mlp_gated=False)).eval()
    state = {"gate.weight": block.gate.weight, "expert_bias": block.gate.e_score_correction_bias,
             "experts.gate_up_proj": block.experts.up_proj, "experts.down_proj": block.experts.down_proj,
             "shared_expert.up_proj.weight": block.shared_experts.up_proj.weight,
             "shared_expert.down_proj.weight": block.shared_experts.down_proj.weight}
    if latent:
        state.update({f"{n}.weight": getattr(block, n).weight for n in ("fc1_latent_proj", "fc2_latent_proj")})
    ours.load_state_dict(state, strict=True)
    for tokens in TOKENS:
        x = torch.randn(2, tokens, H, generator=_gen(400 + tokens))
        with torch.no_grad():
            assert_close(ours(x), block(x), what=f"{tokens} tokens")
