"""gpt-oss in the Hub's MXFP4 form (models.mxfp4): real-size export and QMoE measurements (not a test).

    .venv/bin/python scripts/bench_gpt_oss_mxfp4.py write DIR            # gpt-oss-20b-shaped random checkpoint
    .venv/bin/python scripts/bench_gpt_oss_mxfp4.py export DIR OUT [-- graphkiln export flags]
    .venv/bin/python scripts/bench_gpt_oss_mxfp4.py small [--threads 2]  # QMoE vs MoE, error, perplexity
    (load, prefill, decode: scripts/bench_load_scale.py OUT; the MoE bound: ``active`` below)
    .venv/bin/python scripts/bench_gpt_oss_mxfp4.py active OUT           # weight bytes a decode token reads

``write``: openai/gpt-oss-20b's config.json (24 layers, 32 experts top-4, hidden 2880, intermediate
2880, vocab 201088, 64 query / 8 kv heads of 64, sinks, YaRN, alternating 128-token windows) with
random weights written shard by shard with numpy alone: bf16 attention, router, embedding, head,
norms, biases, sinks; the experts as the Hub stores them, uint8 ``*_blocks`` [32, out, in/32, 16]
(random bytes: every E2M1 code equally likely) and ``*_scales`` [32, out, in/32] (E8M0 values 118..124,
blocks of 2^-9..2^-3, the range a trained checkpoint's scales fall in); graphkiln's demo tokenizer.

``export``: ``graphkiln export`` in a child process: wall time, peak RSS (the child's VmHWM), bytes
written, artifact size.

``small``: one MoE layer of a small shape (32 experts top-4, hidden = intermediate = 1024) as
onnxruntime's QMoE (int8, int4) and as its MoE over the dequantized float weights: decode (1 token)
and prefill (128 tokens) time at ``--threads``; the requantized experts' error against the MXFP4
values (random codes, and Gaussian weights packed to MXFP4); and on the tests' tiny gpt-oss packed to
MXFP4 (tests/test_mxfp4.py), perplexity of a random 128-token sequence under transformers'
dequantized model (fp32) and the int8 / int4 artifacts (everything else fp32).

``active``: the bytes one decode token reads: every initializer once (the embedding: one row), but of
the QMoE weights and scales only top_k / num_experts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 2, "bos_token_id": 1, "pad_token_id": 0, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.55.0.dev0", "use_cache": True,
    "vocab_size": 201088,
}


def tensors(cfg: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of every stored tensor, as the Hub's gpt-oss checkpoints name them."""
    d, v, e = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"]
    i_, hd, h, kv = cfg["intermediate_size"], cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = [("model.embed_tokens.weight", (v, d), "BF16")]
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out += [(p + "input_layernorm.weight", (d,), "BF16"), (p + "post_attention_layernorm.weight", (d,), "BF16"),
                (p + "self_attn.q_proj.weight", (h * hd, d), "BF16"), (p + "self_attn.q_proj.bias", (h * hd,), "BF16"),
                (p + "self_attn.k_proj.weight", (kv * hd, d), "BF16"), (p + "self_attn.k_proj.bias", (kv * hd,), "BF16"),
                (p + "self_attn.v_proj.weight", (kv * hd, d), "BF16"), (p + "self_attn.v_proj.bias", (kv * hd,), "BF16"),
                (p + "self_attn.o_proj.weight", (d, h * hd), "BF16"), (p + "self_attn.o_proj.bias", (d,), "BF16"),
                (p + "self_attn.sinks", (h,), "BF16"),
                (p + "mlp.router.weight", (e, d), "BF16"), (p + "mlp.router.bias", (e,), "BF16"),
                (p + "mlp.experts.gate_up_proj_blocks", (e, 2 * i_, d // 32, 16), "U8"),
                (p + "mlp.experts.gate_up_proj_scales", (e, 2 * i_, d // 32), "U8"),
                (p + "mlp.experts.gate_up_proj_bias", (e, 2 * i_), "BF16"),
                (p + "mlp.experts.down_proj_blocks", (e, d, i_ // 32, 16), "U8"),
                (p + "mlp.experts.down_proj_scales", (e, d, i_ // 32), "U8"),
                (p + "mlp.experts.down_proj_bias", (e, d), "BF16")]
    out += [("model.norm.weight", (d,), "BF16"), ("lm_head.weight", (v, d), "BF16")]
    return out


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * (2 if dtype == "BF16" else 1)


def write(out: Path, shard_gb: float = 2.0) -> None:
    from scale_checkpoints import BLOCK_LEN, ONE_BF16, _random_block, write_tokenizer

    cfg = GPT_OSS_20B
    items = tensors(cfg)
    total = sum(_nbytes(s, t) for _, s, t in items)
    free = shutil.disk_usage(out.parent).free
    if free < total + (2 << 30):
        raise SystemExit(f"not enough disk: {free / 1e9:.1f} GB free, {total / 1e9:.1f} GB needed")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.perf_counter()
    block = _random_block()
    bmv = memoryview(block).cast("B")
    rng = np.random.default_rng(0)
    random_bytes = rng.integers(0, 256, 64 << 20, dtype=np.uint8)
    scales = rng.integers(118, 125, 16 << 20, dtype=np.uint8)
    shards, size = [[]], 0
    for item in items:
        b = _nbytes(item[1], item[2])
        if shards[-1] and size + b > shard_gb * 1e9:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += b
    weight_map = {}
    for k, group in enumerate(shards, 1):
        fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype in group:
            b = _nbytes(shape, dtype)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + b]}
            off += b
        hj = json.dumps(header, separators=(",", ":")).encode()
        hj += b" " * (-len(hj) % 8)
        with open(out / fname, "wb") as fh:
            fh.write(len(hj).to_bytes(8, "little"))
            fh.write(hj)
            for name, shape, dtype in group:
                left = _nbytes(shape, dtype)
                if name.endswith("norm.weight"):
                    fh.write(np.full(left // 2, ONE_BF16, np.uint16).tobytes())
                    continue
                if dtype == "U8":
                    src = memoryview(scales if name.endswith("_scales") else random_bytes)
                else:
                    start = hash(name) % BLOCK_LEN
                    src = bmv[2 * start: 2 * (start + BLOCK_LEN)]
                while left:
                    n = min(left, len(src))
                    fh.write(src[:n])
                    left -= n
            fh.flush()
            os.fsync(fh.fileno())
        weight_map.update((name, fname) for name, _, _ in group)
        print(f"  {fname}: {len(group)} tensors, {time.perf_counter() - t0:.0f} s", flush=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}))
    write_tokenizer(out)
    print(f"wrote {total / 1e9:.2f} GB in {time.perf_counter() - t0:.0f} s -> {out}")


def export(ckpt: Path, out: Path, extra: list[str]) -> None:
    cmd = [str(REPO / ".venv/bin/graphkiln"), "export", str(ckpt), "-o", str(out), "--overwrite", *extra]
    print(" ".join(cmd), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) if out.exists() else 0
    print(json.dumps({"rc": rc, "wall_s": round(wall, 1), "peak_rss_gib": round(peak / 2**30, 2),
                      "artifact_gib": round(size / 2**30, 2), "load_avg": os.getloadavg()}))


def active(art: Path) -> None:
    import onnx

    from bench_load_scale import weight_bytes

    manifest = json.loads((art / "manifest.json").read_text())
    graph = art / manifest["graphs"][0]["file"]
    w = weight_bytes(graph)
    model = onnx.load(str(graph), load_external_data=False)
    nbytes = {t.name: math.prod(t.dims) * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
              for t in model.graph.initializer}
    skipped, experts = 0, None
    for n in model.graph.node:
        if n.op_type == "QMoE":
            k = next(a.i for a in n.attribute if a.name == "k")
            for i in (2, 3, 5, 6):
                if len(n.input) > i and n.input[i] in nbytes:
                    e = next(t.dims[0] for t in model.graph.initializer if t.name == n.input[i])
                    experts = e
                    skipped += nbytes[n.input[i]] * (1 - k / e)
    print(json.dumps({"bytes_per_token_all_experts": w["bytes_per_token"],
                      "bytes_per_token_active": w["bytes_per_token"] - skipped, "experts": experts}))


# --------------------------------------------------------------------------- small shape


def _moe_graph(op: str, e: int, h: int, i: int, k: int, bits: int | None, weights: dict, accuracy_level: int = 0):
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(v, n) for n, v in weights.items()]
    if op == "MoE":
        ins = ["x", "r", "w1", "", "w2"]
        quant = {}
    else:
        ins = ["x", "r", "w1", "s1", "", "w2", "s2"]
        quant = dict(expert_weight_bits=bits, block_size=32, accuracy_level=accuracy_level)
    node = helper.make_node(op, ins, ["y"], domain="com.microsoft", k=k, activation_type="swiglu", swiglu_fusion=1,
                            normalize_routing_weights=1, activation_alpha=1.702, activation_beta=1.0, swiglu_limit=7.0,
                            **quant)
    g = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", h]),
                                          helper.make_tensor_value_info("r", TensorProto.FLOAT, ["T", e])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", h])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def small(threads: int, tiny: bool = True) -> None:
    import onnxruntime as ort

    from graphkiln.models.mxfp4 import HALVES, dequantize, requantize, requantized_values

    e, h, i, k = 32, 1024, 1024, 4
    rng = np.random.default_rng(0)

    def codes(n, kk):
        return HALVES[rng.integers(0, 16, (e, n, kk))], rng.integers(118, 125, (e, n, kk // 32)).astype(np.uint8)

    fc1, fc2 = codes(2 * i, h), codes(h, i)
    floats = {"w1": np.stack([dequantize(fc1[0][x], fc1[1][x]) for x in range(e)]),
              "w2": np.stack([dequantize(fc2[0][x], fc2[1][x]) for x in range(e)])}
    variants = {"MoE fp32": ("MoE", None, floats)}
    errors = {}
    for bits in (8, 4):
        q1 = [requantize(fc1[0][x], fc1[1][x], bits) for x in range(e)]
        q2 = [requantize(fc2[0][x], fc2[1][x], bits) for x in range(e)]
        variants[f"QMoE int{bits}"] = ("QMoE", bits, {"w1": np.stack([a for a, _ in q1]), "s1": np.stack([b for _, b in q1]),
                                                      "w2": np.stack([a for a, _ in q2]), "s2": np.stack([b for _, b in q2])})
        err = np.concatenate([(requantized_values(*q1[x], bits) - floats["w1"][x]).ravel() for x in range(4)])
        ref = floats["w1"][:4].ravel()
        errors[f"int{bits}, random E2M1 codes"] = float(np.sqrt(np.square(err).sum() / np.square(ref).sum()))
    # Gaussian weights packed to MXFP4 (as a trained checkpoint's are), then requantized
    sys.path.insert(0, str(REPO / "tests"))
    from test_mxfp4 import pack_mxfp4

    g = rng.standard_normal((256, 1024)).astype(np.float32)
    blocks, sc = pack_mxfp4(g)
    halves = np.empty((256, 32, 32), np.int8)
    halves[..., 0::2] = HALVES[blocks & 15]
    halves[..., 1::2] = HALVES[blocks >> 4]
    halves = halves.reshape(256, 1024)
    exact = dequantize(halves, sc)
    for bits in (8, 4):
        err = requantized_values(*requantize(halves, sc, bits), bits) - exact
        errors[f"int{bits}, Gaussian weights packed to MXFP4"] = float(np.sqrt(np.square(err).sum() / np.square(exact).sum()))
    print("relative RMS error of the QMoE weights against the MXFP4 values:")
    for name, v in errors.items():
        print(f"  {name}: {v:.4f}")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    results = {}
    inputs = {t: (rng.standard_normal((t, h)).astype(np.float32), rng.standard_normal((t, e)).astype(np.float32))
              for t in (1, 128)}
    for name, (op, bits, w) in variants.items():
        sess = ort.InferenceSession(_moe_graph(op, e, h, i, k, bits, w).SerializeToString(), opts,
                                    providers=["CPUExecutionProvider"])
        row = {}
        for t in (1, 128):
            x, r = inputs[t]
            sess.run(None, {"x": x, "r": r})
            reps = 50 if t == 1 else 5
            t0 = time.perf_counter()
            for _ in range(reps):
                y = sess.run(None, {"x": x, "r": r})[0]
            row[t] = (time.perf_counter() - t0) / reps * 1e3
            if t == 128:
                row["y"] = y
        results[name] = row
        wb = sum(v.nbytes for v in w.values())
        print(f"{name:10s} weights {wb / 1e6:7.1f} MB  decode (1 token) {row[1]:7.3f} ms  prefill (128) {row[128]:8.2f} ms")
    base = results["MoE fp32"]["y"]
    for name in ("QMoE int8", "QMoE int4"):
        d = results[name]["y"] - base
        print(f"  {name} output vs MoE fp32: relative RMS {np.sqrt(np.square(d).sum() / np.square(base).sum()):.4f}")
    print(f"(threads {threads}, load average {os.getloadavg()})")
    if tiny:
        perplexity()


def layer(threads: int, accuracy_levels=(0,), bits_list=(8, 4)) -> None:
    """One gpt-oss-20b-sized MoE layer (32 experts top-4, hidden = intermediate = 2880) from random
    MXFP4 codes: the export's requantization time per layer, then QMoE int8 / int4 decode and prefill
    time at ``threads`` against the bound of the bytes a token reads (4 of 32 experts)."""
    import gc

    import onnxruntime as ort

    from bench_load_scale import measure_bandwidth
    from graphkiln.models.mxfp4 import HALVES, requantize

    e, h, i, k = 32, 2880, 2880, 4
    rng = np.random.default_rng(0)
    bw = measure_bandwidth(threads, gib=0.5)
    print(f"bandwidth copy {bw['copy_gb_s']:.1f} GB/s, read {bw['read_gb_s']:.1f} GB/s (threads {threads})")
    inputs = {t: (rng.standard_normal((t, h)).astype(np.float32), rng.standard_normal((t, e)).astype(np.float32))
              for t in (1, 128)}
    for bits in bits_list:
        w = {}
        requant_s = 0.0
        for key, (n, kk) in (("1", (2 * i, h)), ("2", (h, i))):
            q = np.empty((e, n, kk * bits // 8), np.uint8)
            s = np.empty((e, n, kk // 32), np.float32)
            for x in range(e):
                halves = HALVES[rng.integers(0, 16, (n, kk), dtype=np.uint8)]
                sc = rng.integers(118, 125, (n, kk // 32)).astype(np.uint8)
                t1 = time.perf_counter()
                q[x], s[x] = requantize(halves, sc, bits)
                requant_s += time.perf_counter() - t1
            w["w" + key], w["s" + key] = q, s
        wbytes = sum(v.nbytes for v in w.values())
        model = _moe_graph("QMoE", e, h, i, k, bits, w)
        del w
        gc.collect()
        for level in accuracy_levels:
            for a in model.graph.node[0].attribute:
                if a.name == "accuracy_level":
                    a.i = level
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
            row = {}
            for t in (1, 128):
                x, r = inputs[t]
                sess.run(None, {"x": x, "r": r})
                reps = 30 if t == 1 else 3
                t1 = time.perf_counter()
                for _ in range(reps):
                    sess.run(None, {"x": x, "r": r})
                row[t] = (time.perf_counter() - t1) / reps
            active = wbytes * k / e
            bound = active / (bw["copy_gb_s"] * 1e9)
            print(f"QMoE int{bits} accuracy_level {level}: layer weights {wbytes / 1e9:.3f} GB (a token reads "
                  f"{active / 1e6:.0f} MB); requantizing the layer {requant_s:.1f} s; decode {row[1] * 1e3:.2f} ms a "
                  f"token (copy-bandwidth bound {bound * 1e3:.2f} ms: {100 * bound / row[1]:.0f}%), prefill 128 tokens "
                  f"{row[128] * 1e3:.0f} ms", flush=True)
            del sess
            gc.collect()
        del model
    print(f"(load average {os.getloadavg()})")


def perplexity() -> None:
    """Perplexity of one random sequence: transformers' dequantized tiny gpt-oss vs the QMoE artifacts."""
    import dataclasses
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    sys.path.insert(0, str(REPO / "tests"))
    from conftest import SPECS, build_checkpoint
    from test_mxfp4 import mxfp4_checkpoint

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = dataclasses.replace(SPECS["gpt_oss"], config={**SPECS["gpt_oss"].config, "num_hidden_layers": 4})
        ck = mxfp4_checkpoint(build_checkpoint(spec, root / "float"), root / "mxfp4")
        ref = AutoModelForCausalLM.from_pretrained(str(ck), dtype=torch.float32,
                                                   quantization_config=Mxfp4Config(dequantize=True)).float().eval()
        ids = np.random.default_rng(1).integers(3, 300, 128).tolist()

        def ppl(logits):
            logits = np.asarray(logits, np.float64)[:-1]
            lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
            return float(np.exp(np.mean(lse - logits[np.arange(len(ids) - 1), ids[1:]])))

        with torch.no_grad():
            rows = {"transformers, dequantized (fp32)": ppl(ref(torch.tensor([ids])).logits[0].numpy())}
        for q in ("int8", "int4"):
            export_model(str(ck), root / q, ExportOptions(progress=False, max_seq_len=256, expert_quant=q,
                                                          quant_method="rtn"))
            rows[f"experts QMoE {q}, the rest fp32"] = ppl(Engine.load(root / q).prompt_logits([ids])[0])
    print("perplexity of a random 128-token sequence, tiny gpt-oss (4 layers) packed to MXFP4:")
    for name, v in rows.items():
        print(f"  {name}: {v:.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("dir", type=Path)
    x = sub.add_parser("export")
    x.add_argument("ckpt", type=Path)
    x.add_argument("out", type=Path)
    x.add_argument("extra", nargs="*")
    s = sub.add_parser("small")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--no-perplexity", action="store_true")
    ly = sub.add_parser("layer")
    ly.add_argument("--threads", type=int, default=2)
    ly.add_argument("--accuracy-levels", default="0", help="comma-separated QMoE accuracy_level values to time")
    ly.add_argument("--bits", default="8,4")
    a = sub.add_parser("active")
    a.add_argument("artifact", type=Path)
    args = ap.parse_args()
    if args.cmd == "write":
        write(args.dir)
    elif args.cmd == "export":
        export(args.ckpt, args.out, args.extra)
    elif args.cmd == "small":
        small(args.threads, not args.no_perplexity)
    elif args.cmd == "layer":
        layer(args.threads, tuple(int(x) for x in args.accuracy_levels.split(",")),
              tuple(int(x) for x in args.bits.split(",")))
    else:
        active(args.artifact)
    return 0


if __name__ == "__main__":
    sys.exit(main())
