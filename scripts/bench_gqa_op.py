#!/usr/bin/env python
"""onnxruntime CPU GroupQueryAttention in isolation: one decode step's cost against position.

Builds a graph of --layers GroupQueryAttention nodes (rotary inside, KV buffer shared between
past and present, as the onnxruntime target lowers attention), binds the buffers once and
times one decode token at several positions, for the given query-head counts over 4 KV
heads. The cost per position grows with the number of query heads, not of KV heads: the CPU
kernel runs one GEMM per query head and packs that head's keys and values each time.

    .venv/bin/python scripts/bench_gqa_op.py [--heads 16 4] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def build(q_heads: int, kv_heads: int, head_dim: int, capacity: int, layers: int) -> bytes:
    from onnx import TensorProto, helper

    width = (q_heads + 2 * kv_heads) * head_dim
    cache = [1, kv_heads, capacity, head_dim]
    inputs = [helper.make_tensor_value_info("qkv", TensorProto.FLOAT, [1, 1, width]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
              helper.make_tensor_value_info("total", TensorProto.INT32, []),
              helper.make_tensor_value_info("cos", TensorProto.FLOAT, [capacity, head_dim // 2]),
              helper.make_tensor_value_info("sin", TensorProto.FLOAT, [capacity, head_dim // 2])]
    nodes, outputs = [], []
    for i in range(layers):
        inputs += [helper.make_tensor_value_info(f"past_key.{i}", TensorProto.FLOAT, cache),
                   helper.make_tensor_value_info(f"past_value.{i}", TensorProto.FLOAT, cache)]
        nodes.append(helper.make_node(
            "GroupQueryAttention", ["qkv", "", "", f"past_key.{i}", f"past_value.{i}", "seqlens_k", "total", "cos", "sin"],
            [f"out.{i}", f"present_key.{i}", f"present_value.{i}"], domain="com.microsoft",
            num_heads=q_heads, kv_num_heads=kv_heads, do_rotary=1))
        outputs += [helper.make_tensor_value_info(f"out.{i}", TensorProto.FLOAT, [1, 1, q_heads * head_dim]),
                    helper.make_tensor_value_info(f"present_key.{i}", TensorProto.FLOAT, cache),
                    helper.make_tensor_value_info(f"present_value.{i}", TensorProto.FLOAT, cache)]
    graph = helper.make_graph(nodes, "gqa", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return model.SerializeToString()


def main() -> int:
    import onnxruntime as ort

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 4], help="query-head counts to compare")
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--positions", type=int, nargs="+", default=[1, 128, 256, 512, 1024, 2000])
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    print(f"| query heads / kv heads | " + " | ".join(f"pos {p}" for p in args.positions) + " | µs per position |")
    print("|---|" + "---|" * (len(args.positions) + 1))
    for q_heads in args.heads:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = args.threads
        sess = ort.InferenceSession(build(q_heads, args.kv_heads, args.head_dim, args.capacity, args.layers), opts,
                                    providers=["CPUExecutionProvider"])
        shape = (1, args.kv_heads, args.capacity, args.head_dim)
        caches = {f"{kind}.{i}": rng.standard_normal(shape).astype(np.float32)
                  for i in range(args.layers) for kind in ("past_key", "past_value")}
        fixed = {"qkv": rng.standard_normal((1, 1, (q_heads + 2 * args.kv_heads) * args.head_dim)).astype(np.float32),
                 "cos": rng.standard_normal((args.capacity, args.head_dim // 2)).astype(np.float32),
                 "sin": rng.standard_normal((args.capacity, args.head_dim // 2)).astype(np.float32)}
        cells = []
        for pos in args.positions:
            binding = sess.io_binding()
            for name, arr in {**fixed, **caches}.items():
                binding.bind_cpu_input(name, arr)
            binding.bind_cpu_input("seqlens_k", np.array([pos], np.int32))
            binding.bind_cpu_input("total", np.array(pos + 1, np.int32))
            for name, arr in caches.items():  # in place, as the runtime binds the pool
                binding.bind_output(name.replace("past_", "present_"), "cpu", 0, np.float32, list(shape), arr.ctypes.data)
            for i in range(args.layers):
                binding.bind_output(f"out.{i}", "cpu")
            for _ in range(10):
                sess.run_with_iobinding(binding)
            best = float("inf")
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(20):
                    sess.run_with_iobinding(binding)
                best = min(best, (time.perf_counter() - t) / 20 / args.layers)
            cells.append(best * 1e6)
        slope = (cells[-1] - cells[0]) / (args.positions[-1] - args.positions[0])
        print(f"| {q_heads} / {args.kv_heads} | " + " | ".join(f"{c:.0f} µs" for c in cells) + f" | {slope:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
