#!/usr/bin/env python
"""One graphkiln.MoE layer on onnxruntime CPU: dense reference function vs the ORT lowering.

The layer is shaped like a ~250M-parameter Qwen3-MoE (hidden 1024, 8 experts, top-2, moe
intermediate 1408, softmax routing with normalized top-k), fp32, random weights. Two
graphs with the same weights:

  dense    the exported graph: graphkiln.MoE + its attached ONNX function (every expert on
           every token; ORT inlines the function)
  lowered  the same graph after ``lower_moe_for_onnxruntime`` (routing in standard ops +
           com.microsoft.MoE, which runs only the routed experts)

Median latency of one layer call at T=1 (decode) and T=128 (prefill). T=1 cycles through
--inputs different tokens (ORT splits the experts across threads, so decode latency depends
on which experts a token picks). Prints a markdown table and optionally writes JSON.

    .venv/bin/python scripts/bench_moe_lowering.py [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def build_model(args, rng):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from graphkiln.ops import moe
    from graphkiln.ops.spec import DOMAIN

    e, i, h = args.experts, args.intermediate, args.hidden
    f = moe.gate_up_rows(i, args.activation)
    weights = {
        "gate_up": (rng.standard_normal((e, f, h)) * h ** -0.5).astype(np.float32),
        "down": (rng.standard_normal((e, h, i)) * i ** -0.5).astype(np.float32),
        "expert_bias": np.zeros(e, np.float32),
        # zeros (a bias-free checkpoint) unless --expert-biases
        "gate_up_bias": (rng.standard_normal((e, f)) * 0.1 * args.expert_biases).astype(np.float32),
        "down_bias": (rng.standard_normal((e, h)) * 0.1 * args.expert_biases).astype(np.float32),
    }
    node = helper.make_node(
        "MoE", ["hidden", "router_logits", *weights], ["out"], name="layer0/moe", domain=DOMAIN,
        top_k=args.top_k, scoring=0, normalize=1, norm_eps=0.0, routed_scaling=1.0, activation=args.activation,
        alpha=1.702, limit=7.0, plugin_namespace=moe.SPEC.plugin_namespace, plugin_version=moe.SPEC.plugin_version)
    graph = helper.make_graph(
        [node], "moe_layer",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["T", h]),
         helper.make_tensor_value_info("router_logits", TensorProto.FLOAT, ["T", e])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["T", h])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(DOMAIN, 1)])
    model.functions.append(moe.onnx_function(23))
    return model, weights


def session(model, threads):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def median_ms(sess, feeds_list, repeats, warmup=3):
    for f in feeds_list[:warmup]:
        sess.run(None, f)
    times = []
    for r in range(repeats):
        f = feeds_list[r % len(feeds_list)]
        t0 = time.perf_counter()
        sess.run(None, f)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def topk_ids(logits, k):
    return np.argsort(-logits, axis=-1, kind="stable")[:, :k]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--activation", type=int, default=0, help="graphkiln.MoE activation: 0 SwiGLU, 1 relu², 2 gpt-oss")
    ap.add_argument("--expert-biases", action="store_true", help="random expert biases instead of zeros")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128])
    ap.add_argument("--inputs", type=int, default=32, help="distinct inputs cycled through per T")
    ap.add_argument("--decode-repeats", type=int, default=200)
    ap.add_argument("--prefill-repeats", type=int, default=20)
    ap.add_argument("--json", type=str, default=None)
    args = ap.parse_args()

    import onnx
    import onnxruntime as ort

    from graphkiln.export.lowering.ort_moe import lower_moe_for_onnxruntime

    rng = np.random.default_rng(0)
    dense_model, weights = build_model(args, rng)
    lowered_model = onnx.ModelProto()
    lowered_model.CopyFrom(dense_model)
    t0 = time.perf_counter()
    assert lower_moe_for_onnxruntime(lowered_model) == 1
    lower_s = time.perf_counter() - t0
    dense, lowered = session(dense_model, args.threads), session(lowered_model, args.threads)

    per_expert = sum(weights[k][0].nbytes for k in ("gate_up", "down"))
    total = per_expert * args.experts
    rows = []
    for t in args.tokens:
        feeds = [{"hidden": rng.standard_normal((t, args.hidden)).astype(np.float32),
                  "router_logits": rng.standard_normal((t, args.experts)).astype(np.float32)}
                 for _ in range(args.inputs)]
        for f in feeds[:4]:  # same answer
            a, b = dense.run(None, f)[0], lowered.run(None, f)[0]
            rel = float(np.abs(a - b).max() / np.abs(a).max())
            assert rel < 1e-4, rel
        repeats = args.decode_repeats if t == 1 else args.prefill_repeats
        # interleave the two paths' measurements so background load hits both alike
        d_ms, l_ms = [], []
        for rnd in range(3):
            d_ms.append(median_ms(dense, feeds, max(1, repeats // 3))[0])
            l_ms.append(median_ms(lowered, feeds, max(1, repeats // 3))[0])
        d, low = statistics.median(d_ms), statistics.median(l_ms)
        touched = [len(np.unique(topk_ids(f["router_logits"], args.top_k))) for f in feeds]
        rows.append(dict(tokens=t, dense_ms=d, lowered_ms=low, speedup=d / low,
                         dense_bytes=total, lowered_bytes=per_expert * statistics.mean(touched),
                         experts_touched=statistics.mean(touched)))

    print(f"\nMoE layer: hidden {args.hidden}, {args.experts} experts, top-{args.top_k}, "
          f"moe intermediate {args.intermediate}, activation {args.activation}, "
          f"{'random' if args.expert_biases else 'zero'} expert biases, fp32; onnxruntime {ort.__version__} CPU, "
          f"{args.threads} threads, {os.cpu_count()} CPUs; expert weights {total / 2**20:.1f} MiB "
          f"({per_expert / 2**20:.2f} MiB per expert); lowering took {lower_s:.2f} s\n")
    print("| T | dense function (ms) | lowered ORT MoE (ms) | speedup | expert weights read: dense | lowered |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['dense_ms']:.2f} | {r['lowered_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['dense_bytes'] / 2**20:.1f} MiB ({args.experts} experts) | "
              f"{r['lowered_bytes'] / 2**20:.1f} MiB ({r['experts_touched']:.2f} experts) |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=vars(args), rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
