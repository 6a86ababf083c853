"""How the Mamba-2 families read their config.json (parity and serving: test_parity.py,
test_recurrent_models.py): Nemotron-H's block pattern in either spelling, Granite's legacy layer
names and JSON infinity, and one ``error:`` line for a config that cannot be this model."""

from __future__ import annotations

import math

import pytest

from graphkiln.errors import GraphkilnError
from graphkiln.models.registry import family_for

NEMOTRON = dict(architectures=["NemotronHForCausalLM"], vocab_size=100, hidden_size=64, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=16,
                ssm_state_size=16, n_groups=2, conv_kernel=4)
GRANITE = dict(architectures=["GraniteMoeHybridForCausalLM"], vocab_size=100, hidden_size=64, num_hidden_layers=3,
               num_attention_heads=4, num_key_value_heads=2, intermediate_size=32, shared_intermediate_size=48,
               num_local_experts=0, mamba_n_heads=8, mamba_d_state=16, mamba_n_groups=2)


def nemotron(**changes):
    return family_for("NemotronHForCausalLM").parse_config({**NEMOTRON, **changes})


def granite(**changes):
    return family_for("GraniteMoeHybridForCausalLM").parse_config({**GRANITE, **changes})


def test_nemotron_pattern_and_block_list_give_the_same_layers():
    by_pattern = nemotron(hybrid_override_pattern="M-*-", num_hidden_layers=52)  # a stale count is ignored
    by_list = nemotron(layers_block_type=["mamba", "mlp", "attention", "mlp"])
    assert by_pattern.layers == by_list.layers and by_pattern.num_layers == 4
    assert [(l.mixer, l.ffn) for l in by_pattern.layers] == [("mamba", "none"), ("none", "mlp"),
                                                              ("attention", "none"), ("none", "mlp")]
    cfg = by_pattern
    assert cfg.rotary_dim == 0 and cfg.partial_rotary and not cfg.mlp_gated and cfg.hidden_act == "relu2"
    assert [cfg.state_arity(i) for i in range(4)] == [2, 0, 2, 0]
    assert [s.shape for s in cfg.slot_states(0)] == [(8 * 16 + 2 * 2 * 16, 3), (8, 16, 16)]


def test_nemotron_moe_blocks_route_as_the_reference():
    cfg = nemotron(hybrid_override_pattern="ME", n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32,
                   moe_shared_expert_intermediate_size=48, routed_scaling_factor=2.5, n_group=2, topk_group=2)
    m = cfg.moe
    assert (m.scoring, m.expert_bias, m.norm_eps, m.routed_scaling, m.activation) == (1, True, 1e-20, 2.5, 1)
    assert (m.shared_expert_size, m.shared_expert_gate, m.router_fp32) == (48, False, True)


@pytest.mark.parametrize("changes,needle", [
    (dict(hybrid_override_pattern="ME", n_group=4, topk_group=2), "group-limited expert routing"),
    (dict(hybrid_override_pattern="M-X"), "'hybrid_override_pattern'"),
    (dict(layers_block_type=["mamba", "conv"]), "'layers_block_type'"),
    (dict(hybrid_override_pattern="M*", mamba_num_heads=6, n_groups=4), "not a multiple of 'n_groups'"),
    (dict(hybrid_override_pattern="M*", mamba_hidden_act="gelu"), "'mamba_hidden_act'"),
])
def test_nemotron_config_errors_name_the_key(changes, needle):
    with pytest.raises(GraphkilnError, match=needle) as err:
        nemotron(**changes)
    assert "fix config.json" in str(err.value) or "not supported" in str(err.value)


def test_granite_legacy_layer_names_scalings_and_infinite_dt_limit():
    cfg = granite(layer_types=["mamba", "attention", "mamba"], embedding_multiplier=12.0, residual_multiplier=0.22,
                  attention_multiplier=0.0078125, logits_scaling=8.0,
                  time_step_limit=[0.0, {"__float__": "Infinity"}])
    assert [l.mixer for l in cfg.layers] == ["mamba", "attention", "mamba"]
    assert (cfg.embed_scale, cfg.residual_multiplier, cfg.attention_scale, cfg.logits_scaling) == (12.0, 0.22,
                                                                                                   0.0078125, 8.0)
    assert cfg.mamba.head_dim == 2 * 64 // 8 and math.isinf(cfg.mamba.dt_max) and cfg.rotary_dim == 0
    assert granite(position_embedding_type="rope").rotary_dim is None
    assert granite().residual_multiplier is None  # a multiplier of 1 adds no graph op


@pytest.mark.parametrize("changes,needle", [
    (dict(mamba_d_head=12), "'mamba_n_heads' 8 x 'mamba_d_head' 12"),
    (dict(time_step_limit=[0.5, 0.1]), "'time_step_limit'"),
    (dict(layer_types=["mamba", "attention"]), "'layer_types' has 2 entries"),
    (dict(position_embedding_type="alibi"), "'position_embedding_type'"),
])
def test_granite_config_errors_name_the_key(changes, needle):
    with pytest.raises(GraphkilnError, match=needle):
        granite(**changes)
