"""Exporting a quantized input at real size (issue 36): a GGUF of Llama-3.2-1B's shape (Q4_0
Linear weights, a Q8_0 tied embedding, F32 norms: random blocks, written without torch), or with
``--gptq`` a GPTQ checkpoint of that shape (4-bit, group 128, bf16 tied embedding), exported by
``graphkiln export`` in a fresh process, and the same export by another checkout (``--before
DIR``: a git worktree of an earlier commit) in the same run.

Reports per export: peak RSS and bytes written to storage (``/usr/bin/time``'s %M and %O x 512),
wall time, the artifact's size, and the largest size the temporary directory reached (sampled every
0.2 s: the conversion's on-disk copy).

    flock /tmp/gk-big.lock .venv/bin/python scripts/bench_quantized_input.py --work /work/bench-tmp/me \
        [--before /work/bench-tmp/me/before] [--layers 16]

Memory: the GGUF's writer holds its tensors (~0.8 GB for the 1B shape); the exports hold what they hold.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

# Llama-3.2-1B (hidden 2048, 16 layers, 32 heads / 8 KV heads of 64, MLP 8192, vocabulary 128256, tied)
SHAPE = dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, head_dim=64)


def _q_blocks(rows: int, cols: int, qtype, rng) -> np.ndarray:
    """Random Q4_0 (18-byte) or Q8_0 (34-byte) blocks for a [rows, cols] weight: fp16 scales near
    0.01, random codes."""
    from gguf import GGMLQuantizationType as Q

    width = 18 if qtype == Q.Q4_0 else 34
    raw = rng.integers(0, 256, (rows, cols // 32, width), dtype=np.uint8)
    scales = (0.005 + 0.01 * rng.random((rows, cols // 32), dtype=np.float32)).astype(np.float16)
    raw[..., :2] = scales.view(np.uint8).reshape(rows, cols // 32, 2)
    return raw.reshape(rows, cols // 32 * width)


def write_gguf(path: Path, layers: int) -> None:
    import gguf
    from gguf import GGMLQuantizationType as Q

    s = dict(SHAPE, layers=layers)
    h, kv = s["hidden"], s["kv_heads"] * s["head_dim"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("bench-llama-1b")
    w.add_context_length(4096)
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(s["ffn"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_rope_dimension_count(s["head_dim"])
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(500000.0)
    w.add_vocab_size(s["vocab"])
    w.add_tensor("token_embd.weight", _q_blocks(s["vocab"], h, Q.Q8_0, rng), raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        for name, (n, k) in {"attn_q": (h, h), "attn_k": (kv, h), "attn_v": (kv, h), "attn_output": (h, h),
                             "ffn_gate": (s["ffn"], h), "ffn_up": (s["ffn"], h), "ffn_down": (h, s["ffn"])}.items():
            w.add_tensor(f"blk.{i}.{name}.weight", _q_blocks(n, k, Q.Q4_0, rng), raw_dtype=Q.Q4_0)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gptq(directory: Path, layers: int) -> None:
    """A GPTQ (v1, 4-bit, group 128, symmetric, no act-order) checkpoint of the same shape, written
    without torch: random qweight words, fp16 scales near 0.01, zero points 8 (stored 7), bf16
    embedding (tied) and norms, one safetensors file."""
    import struct

    s = dict(SHAPE, layers=layers)
    h, kv, ffn, group = s["hidden"], s["kv_heads"] * s["head_dim"], s["ffn"], 128
    rng = np.random.default_rng(0)
    tensors: list[tuple[str, str, tuple[int, ...], object]] = []  # name, dtype, shape, bytes maker

    def add(name, dtype, shape, make):
        tensors.append((name, dtype, shape, make))

    one = np.full(h, 0x3F80, np.uint16)  # bf16 1.0
    add("model.embed_tokens.weight", "BF16", (s["vocab"], h),
        lambda: (rng.standard_normal((s["vocab"], h), dtype=np.float32) * 0.02).view(np.uint32).__rshift__(16)
        .astype(np.uint16))
    add("model.norm.weight", "BF16", (h,), lambda: one)
    for i in range(layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", "BF16", (h,), lambda: one)
        add(p + "post_attention_layernorm.weight", "BF16", (h,), lambda: one)
        for name, (n, k) in {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
                             "self_attn.o_proj": (h, h), "mlp.gate_proj": (ffn, h), "mlp.up_proj": (ffn, h),
                             "mlp.down_proj": (h, ffn)}.items():
            g = k // group
            add(p + name + ".qweight", "I32", (k // 8, n), lambda k=k, n=n: rng.integers(-2**31, 2**31, (k // 8, n),
                                                                                          dtype=np.int32))
            add(p + name + ".qzeros", "I32", (g, n // 8), lambda g=g, n=n: np.full((g, n // 8), 0x77777777, np.int32))
            add(p + name + ".scales", "F16", (g, n), lambda g=g, n=n: (0.005 + 0.01 * rng.random((g, n))).astype(np.float16))
            add(p + name + ".g_idx", "I32", (k,), lambda k=k: (np.arange(k) // group).astype(np.int32))
    header, offset = {}, 0
    size = {"BF16": 2, "F16": 2, "I32": 4}
    for name, dtype, shape, _ in tensors:
        nbytes = int(np.prod(shape)) * size[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, dtype, shape, make in tensors:
            f.write(np.ascontiguousarray(make()).tobytes())
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "intermediate_size": ffn,
              "num_hidden_layers": layers, "num_attention_heads": s["heads"], "num_key_value_heads": s["kv_heads"],
              "head_dim": s["head_dim"], "vocab_size": s["vocab"], "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16",
              "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                      "sym": True, "checkpoint_format": "gptq"}}
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def run_export(label: str, checkout: Path, gguf: Path, out: Path, scratch: Path) -> dict:
    """``graphkiln export SOURCE -o OUT`` from ``checkout`` in a fresh process: its figures."""
    if out.exists():
        shutil.rmtree(out)
    scratch.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(checkout), TMPDIR=str(scratch))
    stats = scratch.parent / f"time-{label}.txt"
    # /usr/bin/time measures the export alone: %M peak RSS (KiB), %O file system outputs (512-byte blocks)
    cmd = ["/usr/bin/time", "-o", str(stats), "-f", "%M %O", sys.executable, "-m", "graphkiln.cli", "export", str(gguf),
           "-o", str(out), "--max-seq-len", "4096"]
    peak_tmp = [0]
    done = threading.Event()

    def sample():
        while not done.wait(0.2):
            peak_tmp[0] = max(peak_tmp[0], _tree_bytes(scratch))

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    got = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    done.set()
    t.join()
    rss_kib, blocks = (int(v) for v in stats.read_text().split()[-2:])
    row = {"label": label, "rc": got.returncode, "wall_s": round(wall, 1),
           "peak_rss_gib": round(rss_kib / 2**20, 2),
           "written_gb": round(blocks * 512 / 1e9, 2),
           "peak_temp_gb": round(peak_tmp[0] / 1e9, 2),
           "artifact_gb": round(_tree_bytes(out) / 1e9, 2) if out.exists() else None,
           "last_line": (got.stdout.strip().splitlines() or [""])[-1][:200],
           "error": (got.stderr.strip().splitlines() or [""])[-1][:300] if got.returncode else None}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, required=True, help="where the GGUF, the artifacts and temporaries go")
    ap.add_argument("--before", type=Path, help="another checkout (git worktree) to run the same export with, first")
    ap.add_argument("--layers", type=int, default=SHAPE["layers"])
    ap.add_argument("--gptq", action="store_true", help="export a GPTQ checkpoint of the shape instead of the GGUF")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    gguf = args.work / f"llama-1b-q4_0-{args.layers}l.gguf"
    if not gguf.exists():
        t0 = time.perf_counter()
        write_gguf(gguf, args.layers)
        print(f"wrote {gguf} ({gguf.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f}s", flush=True)
    gptq = args.work / f"llama-1b-gptq-{args.layers}l"
    if args.gptq and not (gptq / "config.json").exists():
        t0 = time.perf_counter()
        write_gptq(gptq, args.layers)
        print(f"wrote {gptq} in {time.perf_counter() - t0:.0f}s", flush=True)
    print(f"load average {os.getloadavg()}", flush=True)
    rows = []
    here = Path(__file__).resolve().parents[1]
    runs = ([("before", args.before)] if args.before else []) + [("after", here)]
    inputs = [("gptq", gptq)] if args.gptq else [("gguf", gguf)]
    for kind, source in inputs:
        for label, checkout in runs:
            name = f"{kind}-{label}"
            rows.append(run_export(name, checkout, source, args.work / f"art-{name}", args.work / f"tmp-{name}"))
            print(json.dumps(rows[-1]), flush=True)
            shutil.rmtree(args.work / f"tmp-{name}", ignore_errors=True)
            shutil.rmtree(args.work / f"art-{name}", ignore_errors=True)
    print(f"load average {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
