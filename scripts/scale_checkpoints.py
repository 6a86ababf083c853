"""Random-weight bf16 checkpoints of real model shapes, written without torch (numpy only).

Used by scripts/bench_export_scale.py (issue 36). A checkpoint directory is what the Hub
holds for the model, with random weights:

  config.json                         the real model's config.json (Hub form: rope_theta /
                                      rope_scaling, torch_dtype; Qwen3-MoE's num_experts), except
                                      bos/eos ids, which are the small tokenizer's (1 / 2)
  model-0000k-of-0000n.safetensors    ~2 GB shards (--shard-gb), tensors named as the Hub stores them
  model.safetensors.index.json        {"metadata": {"total_size": N}, "weight_map": {name: shard}}
  tokenizer.json, tokenizer_config.json (with a chat_template), generation_config.json

safetensors layout: 8-byte little-endian header length, a JSON header
{name: {"dtype": "BF16", "shape": [...], "data_offsets": [a, b]}} padded with spaces to a multiple
of 8, then the raw bytes. bf16 = the upper 16 bits of float32 (rounded to nearest even here).

Values: one fixed block of N(0, 0.02) (an odd length, so its repeats do not line up with rows),
read cyclically from a different offset for every tensor, so writing is I/O bound; norm weights
are 1.0. A stamp file (.scale-complete) records the spec a finished checkpoint was written for;
a directory without a matching stamp is rewritten. Each shard is fsynced, so the time reported is
the time to the disk.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

STAMP = ".scale-complete"
BLOCK_LEN = (1 << 22) + 15  # values in the random block (8 MiB of bf16)
ONE_BF16 = 0x3F80  # 1.0

LLAMA_COMMON = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0",
    "use_cache": True,
    "vocab_size": 128256,
}


def _llama3_rope(factor: float) -> dict:
    return {"factor": factor, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192, "rope_type": "llama3"}


CONFIGS: dict[str, dict] = {
    # meta-llama/Llama-3.2-1B
    "1b": dict(LLAMA_COMMON, head_dim=64, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
               num_hidden_layers=16, num_key_value_heads=8, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B
    "3b": dict(LLAMA_COMMON, head_dim=128, hidden_size=3072, intermediate_size=8192, num_attention_heads=24,
               num_hidden_layers=28, num_key_value_heads=8, rope_scaling=_llama3_rope(32.0), tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B (its config has no head_dim: 4096 / 32 = 128)
    "8b": dict(LLAMA_COMMON, hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_hidden_layers=32,
               num_key_value_heads=8, rope_scaling=_llama3_rope(8.0), tie_word_embeddings=False,
               transformers_version="4.43.0.dev0"),
    # Qwen3-30B-A3B's config (field names as the Hub has them) at 20 layers of 64 experts: ~7.0B total
    "moe": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "decoder_sparse_step": 1,
        "eos_token_id": 2,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2048,
        "initializer_range": 0.02,
        "intermediate_size": 6144,
        "max_position_embeddings": 40960,
        "max_window_layers": 20,
        "mlp_only_layers": [],
        "model_type": "qwen3_moe",
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "num_attention_heads": 32,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 20,
        "num_key_value_heads": 4,
        "output_router_logits": False,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000.0,
        "router_aux_loss_coef": 0.001,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    },
}

GENERATION_CONFIG = {"bos_token_id": 1, "do_sample": True, "eos_token_id": 2, "temperature": 0.6, "top_p": 0.9}

# A plain ChatML-like template over the demo tokenizer's specials (<s> = 1, </s> = 2).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<s>' + message['role'] + '\\n' + message['content'] + '</s>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}"
)
TOKENIZER_VOCAB = 1024


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every stored tensor, in the Hub's order (embeddings, layers, norm, lm_head)."""
    d, v, n_layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or d // heads
    moe = cfg["model_type"] == "qwen3_moe"
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, d))]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)),
                (p + "self_attn.q_proj.weight", (heads * hd, d)),
                (p + "self_attn.k_proj.weight", (kv * hd, d)),
                (p + "self_attn.v_proj.weight", (kv * hd, d)),
                (p + "self_attn.o_proj.weight", (d, heads * hd))]
        if moe:
            out += [(p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,))]
        out.append((p + "post_attention_layernorm.weight", (d,)))
        sparse = moe and i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        if sparse:
            f = cfg["moe_intermediate_size"]
            out.append((p + "mlp.gate.weight", (cfg["num_experts"], d)))
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                out += [(q + "gate_proj.weight", (f, d)), (q + "up_proj.weight", (f, d)),
                        (q + "down_proj.weight", (d, f))]
        else:
            f = cfg["intermediate_size"]
            out += [(p + "mlp.gate_proj.weight", (f, d)), (p + "mlp.up_proj.weight", (f, d)),
                    (p + "mlp.down_proj.weight", (d, f))]
    out.append(("model.norm.weight", (d,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (v, d)))
    return out


def n_params(cfg: dict) -> int:
    return sum(math.prod(s) for _, s in tensors(cfg))


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _random_block(seed: int = 0) -> np.ndarray:
    """BLOCK_LEN bf16 values of N(0, 0.02), doubled (so any cyclic window is one contiguous slice)."""
    f = (np.random.default_rng(seed).standard_normal(BLOCK_LEN, dtype=np.float32) * 0.02).view(np.uint32)
    bf = ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return np.concatenate([bf, bf])


@dataclass
class WriteResult:
    path: Path
    bytes: int
    seconds: float
    params: int
    shards: int
    reused: bool = False


def plan_shards(items: list[tuple[str, tuple[int, ...]]], shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for name, shape in items:
        b = math.prod(shape) * 2
        if shards[-1] and size + b > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += b
    return shards


def _write_shard(path: Path, items, block: np.ndarray, ones: np.ndarray) -> int:
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, shape in items:
        b = math.prod(shape) * 2
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + b]}
        off += b
    hj = json.dumps(header, separators=(",", ":")).encode()
    hj += b" " * (-len(hj) % 8)
    bmv = memoryview(block).cast("B")
    with open(path, "wb") as fh:
        fh.write(len(hj).to_bytes(8, "little"))
        fh.write(hj)
        for name, shape in items:
            n = math.prod(shape)
            if _is_norm(name):
                fh.write(ones[:n].tobytes())
                continue
            start = zlib.crc32(name.encode()) % BLOCK_LEN  # a different window per tensor
            window = bmv[2 * start: 2 * (start + BLOCK_LEN)]  # one period of the cyclic stream
            left = n * 2
            while left:
                k = min(left, len(window))
                fh.write(window[:k])
                left -= k
        fh.flush()
        os.fsync(fh.fileno())  # the time reported is the time to the disk, not to the page cache
    return 8 + len(hj) + off


def write_tokenizer(out: Path, vocab: int = TOKENIZER_VOCAB) -> int:
    """graphkiln's demo byte-level BPE (ids 0-2 = <unk> <s> </s>) plus a chat_template."""
    from graphkiln.demo.run import train_tokenizer

    size = train_tokenizer(out, vocab)
    tc_path = out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc.update(chat_template=CHAT_TEMPLATE, model_max_length=131072)
    tc_path.write_text(json.dumps(tc, indent=2))
    return size


def write_checkpoint(out: Path, cfg: dict, shard_gb: float = 2.0, log=print) -> WriteResult:
    """Write cfg's checkpoint into out (replacing it unless its stamp matches); return the sizes and time."""
    items = tensors(cfg)
    want = json.dumps({"config": cfg, "shard_gb": shard_gb, "block": BLOCK_LEN}, sort_keys=True)
    stamp = out / STAMP
    total = sum(math.prod(s) for _, s in items) * 2
    if stamp.exists() and stamp.read_text() == want:
        return WriteResult(out, _dir_bytes(out), 0.0, total // 2, len(list(out.glob("*.safetensors"))), reused=True)
    free = shutil.disk_usage(out.parent if out.parent.exists() else Path("/")).free
    if out.exists():
        free += _dir_bytes(out)
    need = total + (1 << 30)
    if free < need:
        raise OSError(f"not enough free disk for {out}: {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t = time.perf_counter()
    block = _random_block()
    biggest_norm = max((math.prod(s) for n, s in items if _is_norm(n)), default=0)
    ones = np.full(biggest_norm, ONE_BF16, np.uint16)
    shards = plan_shards(items, int(shard_gb * 1e9))
    weight_map: dict[str, str] = {}
    written = 0
    for k, group in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        written += _write_shard(out / fname, group, block, ones)
        weight_map.update((name, fname) for name, _ in group)
        log(f"  {out.name}/{fname}: {len(group)} tensors, {written / 1e9:.2f} GB so far, "
            f"{time.perf_counter() - t:.0f} s")
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        dict(GENERATION_CONFIG, transformers_version=cfg["transformers_version"]), indent=2))
    vocab = write_tokenizer(out)
    assert vocab < cfg["vocab_size"]
    secs = time.perf_counter() - t
    stamp.write_text(want)
    return WriteResult(out, _dir_bytes(out), secs, total // 2, len(shards))


def _dir_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def verify_checkpoint(path: Path) -> str:
    """Cross-check the files with safetensors, the index and transformers' AutoConfig; return a summary."""
    import torch  # only here: bf16 values need it (numpy has no bf16); the writer does not
    from safetensors import safe_open
    from transformers import AutoConfig

    cfg = json.loads((path / "config.json").read_text())
    expect = dict(tensors(cfg))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    seen: dict[str, tuple] = {}
    total = 0
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / shard), framework="pt") as f:
            for name in f.keys():
                assert index["weight_map"][name] == shard, name
                t = f.get_tensor(name)
                assert t.dtype == torch.bfloat16, (name, t.dtype)
                seen[name] = tuple(t.shape)
                total += t.numel() * 2
                if _is_norm(name):
                    assert bool((t == 1).all()), name
                else:
                    std = t.float().std().item()
                    assert 0.015 < std < 0.025 and abs(t.float().mean().item()) < 0.005, (name, std)
    assert seen == expect, set(seen) ^ set(expect)
    assert index["metadata"]["total_size"] == total
    hf = AutoConfig.from_pretrained(str(path))
    assert hf.hidden_size == cfg["hidden_size"] and hf.num_hidden_layers == cfg["num_hidden_layers"]
    return f"{len(seen)} tensors, {total} bytes, {type(hf).__name__}"


if __name__ == "__main__":  # python scripts/scale_checkpoints.py NAME OUT_DIR  (or: verify DIR)
    if sys.argv[1] == "verify":
        print(verify_checkpoint(Path(sys.argv[2])))
    else:
        r = write_checkpoint(Path(sys.argv[2]), CONFIGS[sys.argv[1]])
        print(f"{r.path}: {r.params / 1e9:.2f}B params, {r.bytes / 1e9:.2f} GB in {r.seconds:.1f} s")
