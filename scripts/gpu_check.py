#!/usr/bin/env python
"""GPU check: graphkiln's Triton kernels on a real NVIDIA GPU, in one short run (< 5 minutes on an H200).

    python scripts/gpu_check.py [--quick] [--json PATH] [--only SECTION ...] [--budget SECONDS]

What it runs (every result is one row of the table it prints; run order: copy, the graph
step in fp16, the kernels dtype by dtype, the graph step in bf16, TensorRT):
  0. copy      the card's device-to-device copy bandwidth: a large ``torch`` copy (bytes read
               + written / time), the yardstick for every kernel's "% copy".
  1. kernels   every Triton kernel in ``graphkiln/plugins_trt/kernels/`` — attention (decode
               and prefill tactics), MoE (decode and prefill tiles), ShortConv (decode and
               prefill tiles) — in fp16, bf16 and fp32, on decode- and prefill-sized shapes,
               ragged rows, arbitrary state slots, against the op's torch reference
               (``graphkiln/ops/*.py`` ``reference``) run on the same GPU in the same dtype,
               with the CPU tests' tolerances (tests/test_trt_kernels_*.py run the same
               kernels in the Triton interpreter).
               "max error" = max |kernel - reference| / max |reference| over the compared
               outputs (padding tokens' outputs are not part of the contract); state written
               in place is checked too: cache rows and pool slots the kernel must not touch
               stay bit-identical, written values are exact copies (fp16/bf16 rotated keys
               included; fp32 keys within the tolerance: the GPU compiler may contract the
               rotary multiply-add into an FMA where the reference rounds twice).
               Cases marked "bench" are also timed: CUDA events around a CUDA graph of
               ``REPS`` back-to-back launches (graph replay keeps the launcher's Python
               overhead out of the timing), warm-up, median of ``TRIALS``; GB/s = the bytes
               the launch must move at least (``attention_bytes``/``moe_bytes``/
               ``short_conv_bytes``: each input read once, each output written once) / time.
               A figure whose bytes fit in L2 is marked: it is not a DRAM bandwidth.
  2. graph     a tiny model-shaped decode step (ShortConv with its pool updated in place ->
               attention decode with the KV cache written in place -> MoE) captured in a CUDA
               graph through ``torch.cuda.CUDAGraph`` and replayed for two steps; outputs and
               the in-place state must equal the eager run's bit for bit.
  3. tensorrt  where TensorRT is importable: exports a tiny random LFM2-MoE-style model (no
               network; built as tests/conftest.py builds its checkpoints), runs
               ``graphkiln build ART --backend tensorrt``, compares the engine with its graph
               in onnxruntime step by step through polygraphy (``graphkiln.trt_build.compare``:
               polygraphy's TrtRunner and OnnxrtRunner, its Comparator) and greedy generation
               of ``Engine.load(ART, backend="tensorrt")`` with the CPU ``Engine.load(ART)``
               (tokens; logits before the first divergence by polygraphy's comparator). Its
               "max error" is polygraphy's max |difference| and its tolerance the atol of
               ``compare.TOLERANCES`` (an element passes within atol or rtol).
               Otherwise one row: "skipped: TensorRT not installed".

Exit status: 0 when every row that ran passed, 1 when any failed or was cut by ``--budget``,
2 when it cannot run (no CUDA device: one line on stderr, nothing written).

``--quick``: fp16 only, two edge cases each for attention and ShortConv, one for MoE, the
decode bench shapes of attention and MoE, the graph step, no TensorRT (< 1 minute after
start-up). ``--budget`` (default 270 s) stops starting checks once spent and lists the rest
as "not run" (the summary then says INCOMPLETE), so the table comes out inside a 5-minute
slot. ``--only tensorrt`` runs the engine parity alone (export and build take minutes of
their own). Progress goes to stderr, one line per row as it finishes, so a run killed from
outside still shows how far it got.

What it does not cover: the kernels run through Triton's JIT (``run_attention``/``run_moe``/
``run_short_conv``), which specialises int arguments equal to 1 or divisible by 16; the PTX
that TensorRT loads is ``aot.compile_kernel``'s, with every scalar a runtime int32. The same
Triton source, not the same binary: only section 3 (TensorRT) runs that PTX.

TRITON_INTERPRET is removed from the environment before any kernel module is imported
(``triton.jit`` reads it when a kernel is decorated): the test suite sets it, and a kernel
decorated under it would run in the interpreter on host copies.

Nothing here needs a GPU at import time: the byte counts, the case tables and the table
formatting are plain code (tests/test_gpu_check.py checks them on CPU, and runs the check
functions on CPU tensors in the Triton interpreter with ``device="cpu"``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/gpu_check.py` from a checkout, not installed
    sys.path.insert(0, str(ROOT))

NO_GPU = ("gpu_check: no CUDA device visible (torch.cuda.is_available() is False): "
          "run it on a machine with an NVIDIA GPU")

# The CPU tests' tolerances (tests/test_trt_kernels_*.py): max |err| relative to max |reference|.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}
DTYPES = tuple(TOL)
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
POISON = 1000.0  # cache rows at positions >= a row's start: never visible, so never in the output
REPS = 10  # launches per captured timing graph
TRIALS = 5  # timed replays; the median is reported
COPY_BYTES = 1 << 30  # the copy-bandwidth buffer (read + written: 2 GiB of traffic per copy)
POOL_SLOTS = 11  # ShortConv pool rows: more than any case's batch, so some slots stay untouched
GRAPH_ROW = "decode step (CUDA graph)"


# ----------------------------------------------------------------------------------------------
# results


@dataclass
class Row:
    """One line of the table. ``passed`` None: skipped (``note`` says why). ``error`` is the
    worst relative error of the tolerance checks (None when the row has none); ``gbps`` the
    achieved bandwidth (bench cases and the copy only)."""

    kernel: str
    dtype: str
    shape: str
    error: float | None = None
    tolerance: float | None = None
    passed: bool | None = True
    gbps: float | None = None
    pct_copy: float | None = None
    note: str = ""
    seconds: float | None = None  # per launch, for timed rows
    bytes_moved: int | None = None
    cut: bool = False  # skipped because --budget ran out: the run is incomplete, not passed


class Verdict:
    """Collects one case's comparisons: tolerance checks raise ``error``; any check that fails
    adds a problem (the row fails with them as its note)."""

    def __init__(self) -> None:
        self.error = 0.0
        self.problems: list[str] = []

    def close(self, what: str, got, want, tol: float) -> None:
        err = rel_error(got, want)
        self.error = max(self.error, err)
        if not err <= tol:  # NaN fails too
            self.problems.append(f"{what}: error {err:.3g} > {tol:g}")

    def equal(self, what: str, got, want) -> None:
        import torch

        if got.shape != want.shape or not torch.equal(got, want):
            same_shape = got.shape == want.shape and got.numel()
            diff = float((got.float() - want.float()).abs().max()) if same_shape else math.nan
            self.problems.append(f"{what}: not bit-identical (max diff {diff:.3g})")

    def true(self, what: str, ok: bool) -> None:
        if not ok:
            self.problems.append(what)

    def row(self, kernel: str, dtype: str, shape: str, tol: float | None) -> Row:
        return Row(kernel, dtype, shape, self.error if tol is not None else None, tol, not self.problems,
                   note="; ".join(self.problems))


def rel_error(got, want) -> float:
    """max |got - want| / max |want| (1e-6 floor on the scale); inf when got has NaN/Inf."""
    import torch

    if got.shape != want.shape:
        return math.inf
    if got.numel() == 0:
        return 0.0
    g, w = got.float(), want.float()
    if not bool(torch.isfinite(g).all()):
        return math.inf
    scale = max(float(w.abs().max()), 1e-6)
    return float((g - w).abs().max()) / scale


# ----------------------------------------------------------------------------------------------
# bytes a launch must move (the numerator of every GB/s figure)


def attention_bytes(batch: int, seq: int, nq: int, nkv: int, d: int, cache: int, window: int,
                    starts: Sequence[int], itemsize: int) -> int:
    """Bytes one attention launch (kv_update=1) must move at least, for row b's tokens at
    positions starts[b] + 0..seq-1:
      * q, k, v read and out written once: batch * seq * (2*nq + 2*nkv) * d elements;
      * the cached keys and values the row's first token may see, read once: positions
        [lo_b, min(start_b, cache)) with lo_b = 0, or start_b - window + 1 (floored at 0)
        with a sliding window; nkv * d elements each, for K and V;
      * the new rows written into the cache: tokens at positions in [0, cache), K and V;
      * position_ids (int64) read, and one fp32 cos row and one sin row of d/2 per token.
    """
    act = batch * seq * (2 * nq + 2 * nkv) * d * itemsize
    cached = written = 0
    for start in starts:
        n_cached = max(min(start, cache), 0)
        lo = max(start - window + 1, 0) if window > 0 else 0
        cached += max(n_cached - lo, 0)
        written += sum(1 for s in range(seq) if 0 <= start + s < cache)
    kv = (cached + written) * 2 * nkv * d * itemsize
    ids = batch * seq * 8
    tables = batch * seq * 2 * (d // 2) * 4
    return act + kv + ids + tables


def moe_bytes(tokens: int, experts: int, hidden: int, inter: int, routed: int, itemsize: int) -> int:
    """Bytes one MoE launch must move at least: hidden [T, H] and router_logits [T, E] read,
    expert_bias [E] (fp32) read, the ``routed`` distinct experts' weights read once
    (gate_up 2*I*H + down H*I elements each; unrouted experts are never read), out [T, H]
    written."""
    return (2 * tokens * hidden + tokens * experts + routed * 3 * inter * hidden) * itemsize + experts * 4


def short_conv_bytes(batch: int, seq: int, channels: int, width: int, itemsize: int) -> int:
    """Bytes one ShortConv launch (state_update=1) must move at least: x read and y written
    (B*S*C each), weight [C, K] and bias [C] read, each row's slot read and written
    (C*(K-1) each way), slot_idx and seq_lens (int64) read."""
    return (2 * batch * seq * channels + channels * width + channels
            + 2 * batch * channels * (width - 1)) * itemsize + 2 * batch * 8


# ----------------------------------------------------------------------------------------------
# cases


def spread(n: int, lo: int, hi: int) -> tuple[int, ...]:
    """n deterministic, unordered values in [lo, hi] (ragged starts for a bench batch)."""
    span = hi - lo + 1
    return tuple(lo + (i * 7919 + 13) % span for i in range(n))


@dataclass(frozen=True)
class AttnCase:
    name: str
    nq: int
    nkv: int
    d: int
    cache: int  # C
    window: int
    starts: tuple[int, ...]  # position_ids[b, 0]
    seq: int = 1  # S
    lengths: tuple[int, ...] | None = None  # real tokens per row (the rest is padding); None = all
    kernel: str | None = None  # "decode" / "prefill" to force a tactic; None: decode iff S == 1
    bench: bool = False
    quick: bool = False

    @property
    def batch(self) -> int:
        return len(self.starts)

    @property
    def tactic(self) -> str:
        return self.kernel or ("decode" if self.seq == 1 else "prefill")

    def shape(self) -> str:
        s = f"{self.name}: B={self.batch} S={self.seq} Nq={self.nq} Nkv={self.nkv} D={self.d} C={self.cache}"
        return s + (f" W={self.window}" if self.window else "") + (" ragged" if self.lengths else "")


@dataclass(frozen=True)
class MoECase:
    name: str
    style: str  # a key of MOE_STYLES
    tokens: int
    experts: int
    hidden: int
    inter: int
    top_k: int
    tactic: str | None = None  # None: prefill for more than DECODE_MAX_TOKENS tokens
    bench: bool = False
    quick: bool = False

    def resolved_tactic(self, decode_max_tokens: int = 16) -> str:
        return self.tactic or ("prefill" if self.tokens > decode_max_tokens else "decode")

    def shape(self) -> str:
        return (f"{self.name}: T={self.tokens} E={self.experts} H={self.hidden} I={self.inter} top{self.top_k} "
                f"{self.style}")


@dataclass(frozen=True)
class ConvCase:
    name: str
    seq: int
    channels: int
    width: int  # K
    lens: tuple[int, ...]  # seq_lens (real tokens per row)
    slots: tuple[int, ...]  # slot_idx: distinct, unordered, < POOL_SLOTS
    tactic: str | None = None
    bench: bool = False
    quick: bool = False
    pool_slots: int = POOL_SLOTS

    @property
    def batch(self) -> int:
        return len(self.lens)

    @property
    def resolved_tactic(self) -> str:
        return self.tactic or ("decode" if self.seq == 1 else "prefill")

    def shape(self) -> str:
        ragged = " ragged" if len(set(self.lens)) > 1 else ""
        return f"{self.name}: B={self.batch} S={self.seq} C={self.channels} K={self.width}{ragged}"


# (scoring, normalize, norm_eps, routed_scaling, expert bias): the CPU tests' routing styles
MOE_STYLES = {
    "mixtral": (0, 1, 0.0, 1.0, False),  # softmax, renormalised top-k (Qwen3-MoE with norm_topk_prob)
    "softmax_raw": (0, 0, 0.0, 1.0, False),  # softmax, weights not renormalised
    "lfm2": (1, 1, 1e-6, 2.5, True),  # sigmoid, bias for selection only, eps, routed scaling
}

ATTN_CASES = (
    # decode: a row at start 0 sees only its new key; a row at start C writes nothing
    AttnCase("gqa-starts", nq=8, nkv=2, d=64, cache=300, window=0, starts=(0, 17, 299, 300), quick=True),
    AttnCase("mha-window", nq=4, nkv=4, d=128, cache=512, window=64, starts=(5, 511, 200, 64)),
    AttnCase("mqa-d96-window", nq=8, nkv=1, d=96, cache=256, window=100, starts=(255, 1, 130)),
    AttnCase("gqa-d256", nq=4, nkv=2, d=256, cache=200, window=0, starts=(199, 50)),
    # prefill: ragged rows (padding after the real tokens); the last row runs past C
    AttnCase("gqa-ragged", nq=8, nkv=2, d=64, cache=512, window=0, starts=(0, 100, 490), seq=64,
             lengths=(64, 7, 30), quick=True),
    AttnCase("window-ragged", nq=4, nkv=2, d=128, cache=256, window=32, starts=(3, 0), seq=100, lengths=(100, 50)),
    AttnCase("mqa-d80", nq=6, nkv=1, d=80, cache=160, window=0, starts=(20, 1, 33), seq=40, lengths=(40, 40, 3)),
    # TensorRT may pick either tactic for any profile: each must be right for any S
    AttnCase("decode-tactic-S24", nq=8, nkv=2, d=64, cache=128, window=16, starts=(0, 40), seq=24,
             lengths=(24, 9), kernel="decode"),
    AttnCase("prefill-tactic-S1", nq=8, nkv=2, d=64, cache=300, window=0, starts=(299, 0, 150), kernel="prefill"),
    # bench (Llama-3-8B-like heads; caches far larger than L2)
    AttnCase("bench-decode", nq=32, nkv=8, d=128, cache=4096, window=0, starts=spread(32, 2048, 4095), bench=True),
    AttnCase("bench-prefill", nq=32, nkv=8, d=128, cache=4096, window=0, starts=(0, 2048), seq=1024, bench=True),
)
ATTN_QUICK_BENCH = AttnCase("bench-decode", nq=32, nkv=8, d=128, cache=2048, window=0, starts=spread(16, 1024, 2047),
                            bench=True, quick=True)

MOE_CASES = (
    MoECase("decode-1", "mixtral", tokens=1, experts=8, hidden=256, inter=96, top_k=2, quick=True),
    MoECase("decode-ragged-tiles", "lfm2", tokens=5, experts=32, hidden=320, inter=80, top_k=4),
    MoECase("decode-tiles-T40", "softmax_raw", tokens=40, experts=16, hidden=192, inter=64, top_k=2, tactic="decode"),
    MoECase("prefill-ragged", "mixtral", tokens=100, experts=8, hidden=200, inter=72, top_k=2),
    # bench: Qwen3-30B-A3B's expert dims (H 2048, I 768, top 8) with 64 experts; Mixtral-like prefill
    MoECase("bench-decode", "mixtral", tokens=8, experts=64, hidden=2048, inter=768, top_k=8, bench=True, quick=True),
    MoECase("bench-prefill", "mixtral", tokens=256, experts=16, hidden=1024, inter=512, top_k=2, bench=True),
)

CONV_CASES = (
    # decode: len 1 < K-1 shifts old state columns; a len-0 row keeps its state
    ConvCase("decode", seq=1, channels=1000, width=4, lens=(1, 1, 0), slots=(5, 0, 7), quick=True),
    ConvCase("prefill-ragged", seq=37, channels=2048, width=3, lens=(37, 1, 20, 0, 36), slots=(8, 3, 0, 10, 1),
             quick=True),
    ConvCase("prefill-decode-tiles", seq=29, channels=768, width=4, lens=(29, 2, 7), slots=(2, 9, 4),
             tactic="decode"),
    ConvCase("prefill-K2", seq=16, channels=384, width=2, lens=(16, 5), slots=(6, 1)),
    ConvCase("bench-decode", seq=1, channels=4096, width=4, lens=(1,) * 64, slots=tuple(range(63, -1, -1)),
             bench=True, pool_slots=64),
    ConvCase("bench-prefill", seq=4096, channels=4096, width=4, lens=(4096, 3000, 4096, 17), slots=(3, 0, 2, 1),
             bench=True, pool_slots=4),
)


# ----------------------------------------------------------------------------------------------
# timing


def gpu_seconds(fn: Callable[[], object], reps: int = REPS, trials: int = TRIALS) -> float:
    """Median seconds per call of ``fn`` (CUDA work on the current stream): ``fn`` is warmed
    up eagerly and on a side stream, ``reps`` calls are captured in one CUDA graph, and each
    of ``trials`` replays is timed with CUDA events. Raises what capture raises."""
    import torch

    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream before capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    del graph
    return statistics.median(times)


def copy_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """Device-to-device copy bandwidth in bytes/s: (read + written) / time of ``dst.copy_(src)``."""
    import torch

    def timed() -> float:
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(1)
        dst = torch.empty_like(src)
        return gpu_seconds(lambda: dst.copy_(src), reps=5)

    secs = timed()
    torch.cuda.empty_cache()  # the buffers are gone with timed(); hand their memory back
    return 2 * nbytes / secs


class Bench:
    """Adds timing to a bench row: GB/s from ``nbytes`` and the median time, % of ``copy_bps``;
    marks figures whose bytes fit in L2 (``l2_bytes``)."""

    def __init__(self, copy_bps: float, l2_bytes: int) -> None:
        self.copy_bps, self.l2_bytes = copy_bps, l2_bytes

    def measure(self, row: Row, fn: Callable[[], object], nbytes: int) -> None:
        try:
            secs = gpu_seconds(fn)
        except Exception as exc:  # a kernel that cannot be captured in a CUDA graph fails its row
            row.passed = False
            row.note = _join(row.note, f"timing capture failed: {_one_line(exc)}")
            return
        row.seconds, row.bytes_moved = secs, nbytes
        row.gbps = nbytes / secs / 1e9
        row.pct_copy = 100 * nbytes / secs / self.copy_bps
        if nbytes < self.l2_bytes:
            row.note = _join(row.note, "fits in L2")


# ----------------------------------------------------------------------------------------------
# kernel checks (device "cuda" in the script; the CPU test runs them on "cpu" in the interpreter)


def _tdtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def _randn(g, shape, dtype: str, device: str, scale: float = 1.0):
    import torch

    return (torch.randn(shape, generator=g, device=device) * scale).to(_tdtype(dtype))


def _generator(seed: int, device: str):
    import torch

    return torch.Generator(device=device).manual_seed(seed)


def rope_tables(positions: int, d: int, device: str):
    """fp32 cos/sin [positions, d/2] with a rope-scaling factor folded in, as export writes them."""
    import torch

    inv = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float32, device=device) / (d // 2))
    freqs = torch.arange(positions, dtype=torch.float32, device=device)[:, None] * inv
    return freqs.cos() * 1.1, freqs.sin() * 1.1


def attention_inputs(case: AttnCase, dtype: str, device: str, seed: int):
    """q, k, v, past_key, past_value (rows at positions >= start poisoned), position_ids, cos, sin."""
    import torch

    g = _generator(seed, device)
    b, s = case.batch, case.seq
    q = _randn(g, (b, s, case.nq * case.d), dtype, device)
    k = _randn(g, (b, s, case.nkv * case.d), dtype, device)
    v = _randn(g, (b, s, case.nkv * case.d), dtype, device)
    past_k = _randn(g, (b, case.nkv, case.cache, case.d), dtype, device)
    past_v = _randn(g, (b, case.nkv, case.cache, case.d), dtype, device)
    for i, start in enumerate(case.starts):
        past_k[i, :, start:] = POISON
        past_v[i, :, start:] = -POISON
    pos = torch.tensor(case.starts, dtype=torch.int64, device=device)[:, None] + torch.arange(s, device=device)[None]
    cos, sin = rope_tables(max(case.starts) + s + 1, case.d, device)
    return q, k, v, past_k, past_v, pos, cos, sin


def check_attention(case: AttnCase, dtype: str, device: str = "cuda", *, launch: Callable | None = None,
                    bench: Bench | None = None, seed: int = 1) -> Row:
    """``run_attention`` (the kernel writes present_* into past_* in place) against the op's
    reference with kv_update=1 (out, and the cache with every new row written)."""
    import torch

    from graphkiln.ops.attention import reference
    from graphkiln.plugins_trt.kernels import attention as attn_k

    launch = launch or attn_k.run_attention
    kernel = {"decode": attn_k.DECODE, "prefill": attn_k.PREFILL}[case.tactic]
    q, k, v, past_k, past_v, pos, cos, sin = attention_inputs(case, dtype, device, seed)
    scale = case.d ** -0.5
    args = (case.nq, case.nkv, case.window, scale)
    causal = torch.zeros(1, 1, dtype=torch.int64, device=device)  # lookahead: a text model's tokens
    sinks = torch.zeros(case.nq, dtype=torch.float32, device=device)  # unread: use_sinks defaults to 0
    want_out, want_k, want_v = reference(q, k, v, past_k, past_v, pos, cos, sin, causal, sinks, *args, kv_update=1)
    cache_k, cache_v = past_k.clone(), past_v.clone()  # present_* alias past_*: the kernel writes these
    out = launch(q, k, v, cache_k, cache_v, pos, cos, sin, *args, kernel=kernel)

    tol = TOL[dtype]
    verdict = Verdict()
    lengths = case.lengths or (case.seq,) * case.batch
    for b, n in enumerate(lengths):  # padding tokens' outputs are not part of the contract
        verdict.close(f"out row {b}", out[b, :n], want_out[b, :n], tol)
    written = torch.zeros(case.batch, case.cache, dtype=torch.bool, device=device)
    rows_b, rows_s = torch.nonzero(pos < case.cache, as_tuple=True)
    written[rows_b, pos[rows_b, rows_s]] = True
    keep = ~written[:, None, :, None].expand_as(past_k)
    verdict.equal("cache rows not written (K)", cache_k[keep], past_k[keep])
    verdict.equal("cache rows not written (V)", cache_v[keep], past_v[keep])
    verdict.equal("present_value", cache_v, want_v)
    wb, wp = torch.nonzero(written, as_tuple=True)
    if dtype == "float32":  # the compiled kernel may fuse the rotary multiply-add (one rounding)
        verdict.close("present_key rows", cache_k[wb, :, wp], want_k[wb, :, wp], tol)
    else:
        verdict.equal("present_key rows", cache_k[wb, :, wp], want_k[wb, :, wp])
    row = verdict.row(kernel.name, dtype, case.shape(), tol)
    if bench is not None and case.bench:
        nbytes = attention_bytes(case.batch, case.seq, case.nq, case.nkv, case.d, case.cache, case.window,
                                 case.starts, ITEMSIZE[dtype])
        # Re-running rewrites the same rows with the same values: the timed launches are the checked one.
        bench.measure(row, lambda: launch(q, k, v, cache_k, cache_v, pos, cos, sin, *args, kernel=kernel), nbytes)
    return row


def moe_inputs(case: MoECase, dtype: str, device: str, seed: int):
    """hidden, router_logits, gate_up, down, expert_bias, gate_up_bias, down_bias (zeros: a
    bias-free SwiGLU model, what every MoE case here is). Each token's logits are a shuffled
    ladder of distinct values (steps far above fp16/bf16 resolution) plus small noise: no two
    experts tie, so the kernel's and torch's top-k agree without depending on tie order."""
    import torch

    g = _generator(seed, device)
    t, e, h, i = case.tokens, case.experts, case.hidden, case.inter
    hidden = _randn(g, (t, h), dtype, device)
    ladder = torch.linspace(-3.0, 3.0, e, device=device)
    order = torch.argsort(torch.rand(t, e, generator=g, device=device), dim=1)
    noise = 0.2 * (6.0 / max(e - 1, 1)) * torch.rand(t, e, generator=g, device=device)  # < a fifth of a step
    logits = (ladder[order] + noise).to(_tdtype(dtype))
    gate_up = _randn(g, (e, 2 * i, h), dtype, device, h ** -0.5)
    down = _randn(g, (e, h, i), dtype, device, i ** -0.5)
    biased = MOE_STYLES[case.style][4]
    bias = 0.3 * torch.randn(e, generator=g, device=device) if biased else torch.zeros(e, device=device)
    zeros = (torch.zeros(e, 2 * i, dtype=hidden.dtype, device=device), torch.zeros(e, h, dtype=hidden.dtype,
                                                                                   device=device))
    return hidden, logits, gate_up, down, bias, *zeros


def check_moe(case: MoECase, dtype: str, device: str = "cuda", *, launch: Callable | None = None,
              bench: Bench | None = None, seed: int = 2) -> Row:
    """``run_moe`` against ``graphkiln.ops.moe.reference``."""
    from graphkiln.ops import moe as moe_op
    from graphkiln.plugins_trt.kernels import moe as moe_k

    launch = launch or moe_k.run_moe
    tactic = case.resolved_tactic(moe_k.DECODE_MAX_TOKENS)
    scoring, normalize, eps, scaling, _ = MOE_STYLES[case.style]
    attrs = (case.top_k, scoring, normalize, eps, scaling)
    inputs = moe_inputs(case, dtype, device, seed)
    want = moe_op.reference(*inputs, *attrs)
    got = launch(*inputs, *attrs, tactic=tactic)
    verdict = Verdict()
    verdict.close("out", got, want, TOL[dtype])
    row = verdict.row(f"moe/{tactic}", dtype, case.shape(), TOL[dtype])
    if bench is not None and case.bench:
        _, idx = moe_op.routing(inputs[1], inputs[4], *attrs)
        routed = int(idx.unique().numel())
        nbytes = moe_bytes(case.tokens, case.experts, case.hidden, case.inter, routed, ITEMSIZE[dtype])
        out = got
        bench.measure(row, lambda: launch(*inputs, *attrs, out=out, tactic=tactic), nbytes)
        row.note = _join(row.note, f"{routed}/{case.experts} experts routed")
    return row


def conv_inputs(case: ConvCase, dtype: str, device: str, seed: int):
    import torch

    g = _generator(seed, device)
    b, s, c, k = case.batch, case.seq, case.channels, case.width
    x = _randn(g, (b, s, c), dtype, device)
    weight = _randn(g, (c, k), dtype, device)
    bias = _randn(g, (c,), dtype, device)
    pool = _randn(g, (case.pool_slots, c, k - 1), dtype, device)
    slot_idx = torch.tensor(case.slots, dtype=torch.int64, device=device)
    seq_lens = torch.tensor(case.lens, dtype=torch.int64, device=device)
    return x, weight, bias, pool, slot_idx, seq_lens


def check_short_conv(case: ConvCase, dtype: str, device: str = "cuda", *, launch: Callable | None = None,
                     bench: Bench | None = None, seed: int = 3) -> Row:
    """``run_short_conv`` with state_update=1 (pool rows written in place) against
    ``graphkiln.ops.short_conv.reference`` with state_update=1 (the whole pool)."""
    from graphkiln.ops import short_conv as conv_op
    from graphkiln.plugins_trt.kernels import short_conv as conv_k

    launch = launch or conv_k.run_short_conv
    x, weight, bias, pool, slot_idx, seq_lens = conv_inputs(case, dtype, device, seed)
    want_y, want_pool = conv_op.reference(x, weight, bias, pool, slot_idx, seq_lens, case.channels, state_update=1)
    live = pool.clone()
    y, new_state = launch(x, weight, bias, live, slot_idx, seq_lens, case.channels, state_update=1,
                          tactic=case.resolved_tactic)
    tol = TOL[dtype]
    verdict = Verdict()
    verdict.true("new_state is not the pool itself (not in place)", new_state.data_ptr() == live.data_ptr())
    verdict.close("y", y, want_y, tol)
    untouched = [r for r in range(case.pool_slots) if r not in case.slots]
    verdict.equal("untouched pool slots", live[untouched], pool[untouched])
    verdict.close("written pool slots", live[slot_idx], want_pool[slot_idx], tol)
    row = verdict.row(f"short_conv/{case.resolved_tactic}", dtype, case.shape(), tol)
    if bench is not None and case.bench:
        nbytes = short_conv_bytes(case.batch, case.seq, case.channels, case.width, ITEMSIZE[dtype])
        # The timed launches keep shifting the live pool's rows: same traffic, values no longer checked.
        bench.measure(row, lambda: launch(x, weight, bias, live, slot_idx, seq_lens, case.channels, state_update=1,
                                          tactic=case.resolved_tactic), nbytes)
    return row


# ----------------------------------------------------------------------------------------------
# 2. a decode step in a CUDA graph


@dataclass(frozen=True)
class StepShape:
    """A tiny model-shaped decode step: ShortConv over (Nq + 2 Nkv) * D channels, its output
    split into q, k, v for attention decode, the attention output (H = Nq * D) routed through
    MoE, plus the residual. Batch rows use conv pool slots ``slots`` (unordered, distinct)."""

    nq: int = 8
    nkv: int = 2
    d: int = 32
    cache: int = 128
    starts: tuple[int, ...] = (3, 40, 0, 100)
    slots: tuple[int, ...] = (5, 0, 7, 2)
    pool_slots: int = 8
    width: int = 4
    experts: int = 8
    inter: int = 64
    top_k: int = 2
    steps: int = 2

    @property
    def channels(self) -> int:
        return (self.nq + 2 * self.nkv) * self.d

    def describe(self) -> str:
        return (f"B={len(self.starts)} conv ch={self.channels} K={self.width} -> attn Nq={self.nq} Nkv={self.nkv} "
                f"D={self.d} C={self.cache} -> MoE E={self.experts} I={self.inter} top{self.top_k}, "
                f"{self.steps} steps")


class DecodeStep:
    """The step's weights, state and static inputs on ``device``, and the step itself.

    Buffer ownership: ``state`` (conv pool, key cache, value cache) and the static inputs
    ``x_in`` / ``pos_in`` are allocated once here and never replaced — a captured graph records
    their addresses, so every replay reads and writes these same buffers. ``feed(t)`` copies
    step t's inputs into the static inputs; ``restore()`` copies the snapshot ``state0`` back
    into ``state`` in place (warm-up runs mutate the state)."""

    def __init__(self, dtype: str, shape: StepShape = StepShape(), seed: int = 4, device: str = "cuda") -> None:
        import torch

        sh = self.shape = shape
        g = _generator(seed, device)
        b, hid = len(sh.starts), sh.nq * sh.d
        self.conv_w = _randn(g, (sh.channels, sh.width), dtype, device)
        self.conv_b = _randn(g, (sh.channels,), dtype, device)
        self.gate_up = _randn(g, (sh.experts, 2 * sh.inter, hid), dtype, device, hid ** -0.5)
        self.down = _randn(g, (sh.experts, hid, sh.inter), dtype, device, sh.inter ** -0.5)
        self.expert_bias = torch.zeros(sh.experts, device=device)
        self.expert_biases = (torch.zeros(sh.experts, 2 * sh.inter, dtype=self.down.dtype, device=device),
                              torch.zeros(sh.experts, hid, dtype=self.down.dtype, device=device))
        self.cos, self.sin = rope_tables(max(sh.starts) + sh.steps + 1, sh.d, device)
        self.slot_idx = torch.tensor(sh.slots, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(b, dtype=torch.int64, device=device)
        self.state0 = {
            "conv_pool": _randn(g, (sh.pool_slots, sh.channels, sh.width - 1), dtype, device),
            "key_cache": _randn(g, (b, sh.nkv, sh.cache, sh.d), dtype, device),
            "value_cache": _randn(g, (b, sh.nkv, sh.cache, sh.d), dtype, device),
        }
        self.xs = [_randn(g, (b, 1, sh.channels), dtype, device) for _ in range(sh.steps)]
        starts = torch.tensor(sh.starts, dtype=torch.int64, device=device)[:, None]
        self.positions = [starts + t for t in range(sh.steps)]
        self.state = {k: v.clone() for k, v in self.state0.items()}
        self.x_in = torch.empty_like(self.xs[0])
        self.pos_in = torch.empty_like(self.positions[0])

    def restore(self) -> None:
        for name, buf in self.state.items():
            buf.copy_(self.state0[name])

    def feed(self, t: int) -> None:
        self.x_in.copy_(self.xs[t])
        self.pos_in.copy_(self.positions[t])

    def __call__(self):
        """One decode step on the static inputs: returns [B, Nq*D]; conv pool and KV cache in place."""
        from graphkiln.plugins_trt.kernels.attention import DECODE, run_attention
        from graphkiln.plugins_trt.kernels.moe import run_moe
        from graphkiln.plugins_trt.kernels.short_conv import run_short_conv

        sh, st = self.shape, self.state
        y, _ = run_short_conv(self.x_in, self.conv_w, self.conv_b, st["conv_pool"], self.slot_idx, self.seq_lens,
                              sh.channels, state_update=1, tactic="decode")
        qd, kd = sh.nq * sh.d, sh.nkv * sh.d
        q, k, v = (y[..., lo:hi].contiguous() for lo, hi in ((0, qd), (qd, qd + kd), (qd + kd, qd + 2 * kd)))
        attn = run_attention(q, k, v, st["key_cache"], st["value_cache"], self.pos_in, self.cos, self.sin, sh.nq,
                             sh.nkv, 0, sh.d ** -0.5, kernel=DECODE)[:, 0]
        logits = (attn[:, : sh.experts] * 4).contiguous()
        return attn + run_moe(attn, logits, self.gate_up, self.down, self.expert_bias, *self.expert_biases, sh.top_k,
                              0, 1, 0.0, 1.0, tactic="decode")

    def run_eager(self) -> tuple[list, dict]:
        """Every step eagerly from ``state0``: (outputs, the state after the last step), copies."""
        self.restore()
        outs = []
        for t in range(self.shape.steps):
            self.feed(t)
            outs.append(self().clone())
        return outs, {k: v.clone() for k, v in self.state.items()}


def check_decode_graph(dtype: str, shape: StepShape = StepShape(), seed: int = 4) -> Row:
    """Eager steps vs the same steps replayed from one captured CUDA graph: outputs and the
    in-place state (conv pool, KV cache) must be bit-identical (same kernels, same inputs:
    nothing in them depends on launch order or timing)."""
    import torch

    step = DecodeStep(dtype, shape, seed, "cuda")
    sh = step.shape
    eager, eager_state = step.run_eager()

    step.restore()
    step.feed(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # torch's recipe: warm up on a side stream before capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    step.restore()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    torch.cuda.synchronize()
    step.restore()  # capture runs nothing, but be exact about the starting state
    replayed = []
    for t in range(sh.steps):
        step.feed(t)
        graph.replay()
        replayed.append(static_out.clone())
    torch.cuda.synchronize()

    verdict = Verdict()
    for t in range(sh.steps):
        verdict.equal(f"step {t} output", replayed[t], eager[t])
    for name, buf in step.state.items():
        verdict.equal(f"{name} after {sh.steps} steps", buf, eager_state[name])
    step_has_effect(verdict, step, eager, eager_state)
    del graph
    return verdict.row(GRAPH_ROW, dtype, sh.describe(), None)


def step_has_effect(verdict: Verdict, step: DecodeStep, outs: list, state: dict) -> None:
    """Teeth for the graph check: the steps wrote state the next step read, and only the
    slots and cache rows they own."""
    import torch

    sh = step.shape
    verdict.true("non-finite step output", all(bool(torch.isfinite(o).all()) for o in outs))
    verdict.true("consecutive steps gave the same output (state not carried?)",
                 all(not torch.equal(a, b) for a, b in zip(outs, outs[1:])))
    used = list(sh.slots)
    free = [r for r in range(sh.pool_slots) if r not in used]
    verdict.true("conv pool slots of the batch unchanged by the steps",
                 not torch.equal(state["conv_pool"][used], step.state0["conv_pool"][used]))
    verdict.equal("conv pool slots no row uses", state["conv_pool"][free], step.state0["conv_pool"][free])
    written = torch.zeros(len(sh.starts), sh.cache, dtype=torch.bool, device=state["key_cache"].device)
    for b, start in enumerate(sh.starts):
        written[b, start:start + sh.steps] = True
    keep = ~written[:, None, :, None].expand_as(state["key_cache"])
    for name in ("key_cache", "value_cache"):
        verdict.equal(f"{name} rows the steps do not own", state[name][keep], step.state0[name][keep])
        verdict.true(f"{name} rows at the steps' positions not written",
                     not torch.equal(state[name][~keep], step.state0[name][~keep]))


# ----------------------------------------------------------------------------------------------
# 3. TensorRT engines vs the CPU artifact


# LFM2-MoE-shaped (conv + attention + MoE layers: every plugin), as tests/conftest.py's "lfm2_moe"
TRT_MODEL = ("Lfm2MoeForCausalLM", dict(
    hidden_size=64, intermediate_size=128, max_position_embeddings=256, initializer_range=0.15, vocab_size=300,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    layer_types=["conv", "full_attention", "conv", "full_attention"], num_dense_layers=1, num_experts=8,
    num_experts_per_tok=2, moe_intermediate_size=32, routed_scaling_factor=2.0, pad_token_id=0, bos_token_id=1,
    eos_token_id=2), 24)
TRT_MAX_SEQ_LEN = 128
TRT_MAX_BATCH = 4
TRT_PROMPT_LENGTHS = (5, 11, 3)
TRT_NEW_TOKENS = 16


def build_tiny_checkpoint(out_dir: Path) -> Path:
    """A random checkpoint saved with save_pretrained (no network); biases and norm weights
    randomised so that a runtime ignoring them could not pass (as tests/conftest.py does)."""
    import torch
    import transformers
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    arch, config, seed = TRT_MODEL
    cfg = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**config)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1_000_003)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.2)
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return out_dir


def check_tensorrt(workdir: Path) -> Row:
    """Export (onnxruntime + tensorrt graphs in one artifact), ``graphkiln build`` through the
    CLI, then, through polygraphy: the engine against its tensorrt-target graph in onnxruntime
    step by step (``trt_build.compare.compare_engine``: prefill, decode and a chunk onto a
    filled cache; logits and the state rows each step wrote), and greedy generation of the
    TensorRT engine against the CPU engine on the same artifact (tokens, and the logits before
    the first divergence compared by polygraphy's comparator)."""
    row = Row("tensorrt engine vs CPU", "float32", f"{TRT_MODEL[0]} tiny, prompts {list(TRT_PROMPT_LENGTHS)}, "
              f"{TRT_NEW_TOKENS} greedy tokens", passed=None)
    if importlib.util.find_spec("tensorrt") is None:
        row.note = "skipped: TensorRT not installed"
        return row
    missing = [m for m in ("transformers", "onnxscript", "polygraphy") if importlib.util.find_spec(m) is None]
    if missing:
        row.note = f"skipped: {', '.join(missing)} not installed (needed to export the tiny model and compare)"
        return row
    import numpy as np

    from graphkiln.export.pipeline import ExportOptions, export_model
    from graphkiln.runtime import Engine, GenerationConfig
    from graphkiln.trt_build.compare import TOLERANCES, compare_engine

    ckpt = build_tiny_checkpoint(workdir / "checkpoint")
    art = workdir / "artifact"
    export_model(str(ckpt), art, ExportOptions(progress=False, max_seq_len=TRT_MAX_SEQ_LEN,
                                               target="onnxruntime,tensorrt"))
    cmd = [sys.executable, "-m", "graphkiln.cli", "build", str(art), "--backend", "tensorrt",
           "--max-batch", str(TRT_MAX_BATCH), "--max-seq-len", str(TRT_MAX_SEQ_LEN)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH")))))
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=540)
    if proc.returncode != 0:
        row.passed = False
        row.note = f"graphkiln build exit {proc.returncode}: {_last_line(proc.stderr or proc.stdout)}"
        return row
    steps = compare_engine(art)
    rng = np.random.default_rng(TRT_MODEL[2])
    prompts = [rng.integers(3, TRT_MODEL[1]["vocab_size"], n).tolist() for n in TRT_PROMPT_LENGTHS]
    cfg = GenerationConfig(max_new_tokens=TRT_NEW_TOKENS, do_sample=False, stop_token_ids=(), output_logits=True)
    cpu = Engine.load(art).generate(prompts, cfg)
    trt = Engine.load(art, backend="tensorrt").generate(prompts, cfg)
    agree, total, greedy, problems = compare_greedy(cpu, trt)
    compared = [c for c in (steps, greedy) if c.diffs]
    row.error = max(c.max_absdiff for c in compared) if compared else None
    row.tolerance = TOLERANCES[row.dtype][0]
    row.passed = steps.passed and not problems and (greedy.passed or not greedy.diffs)
    row.note = _join(f"greedy tokens agree {agree}/{total}", "; ".join(
        problems + [f"engine steps: {steps.summary()}"] + ([f"greedy logits: {greedy.summary()}"] if greedy.diffs else [])))
    return row


def compare_greedy(want: Sequence, got: Sequence):
    """Greedy ``GenerationResult``s of two engines on the same prompts: (tokens that agree,
    tokens wanted, polygraphy's comparison of the logits of each prompt's steps before its
    first divergence — later logits follow different tokens — ``want`` the reference, one
    problem per prompt whose tokens differ). Prompts without logits before the divergence
    add nothing to the comparison."""
    import numpy as np

    from graphkiln.trt_build.compare import compare_results

    agree = total = 0
    problems = []
    named: dict[str, list[dict]] = {"want": [], "got": []}
    iterations = []
    if len(want) != len(got):
        return 0, sum(len(a.token_ids) for a in want), compare_results(named), [f"{len(got)} results for {len(want)} prompts"]
    for i, (a, b) in enumerate(zip(want, got)):
        same = [x == y for x, y in zip(a.token_ids, b.token_ids)]
        prefix = next((j for j, s in enumerate(same) if not s), len(same))
        agree += sum(same)
        total += len(a.token_ids)
        if prefix < len(a.token_ids) or len(a.token_ids) != len(b.token_ids):
            problems.append(f"prompt {i} differs from token {prefix}")
        if a.logits is not None and b.logits is not None and prefix:
            named["want"].append({"logits": np.asarray(a.logits[:prefix], np.float32)})
            named["got"].append({"logits": np.asarray(b.logits[:prefix], np.float32)})
            iterations.append(f"prompt {i}")
    return agree, total, compare_results(named, iterations=iterations), problems


# ----------------------------------------------------------------------------------------------
# the table


COLUMNS = ("kernel", "dtype", "shape", "max error", "tolerance", "pass", "GB/s", "% copy", "note")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: Row) -> list[str]:
    status = ("not run" if row.cut else "skip") if row.passed is None else ("ok" if row.passed else "FAIL")
    return [row.kernel, row.dtype, row.shape, _fmt(row.error, ".2e"), _fmt(row.tolerance, "g"), status,
            _fmt(row.gbps, ".1f"), _fmt(row.pct_copy, ".1f"), row.note.replace("|", "/")]


def format_table(rows: Sequence[Row]) -> str:
    """A Markdown table, one line per row, columns ``COLUMNS``."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    lines += ["| " + " | ".join(format_row(r)) + " |" for r in rows]
    return "\n".join(lines)


def summary_line(rows: Sequence[Row], device: str, copy_gbps: float | None, seconds: float) -> str:
    """One line: FAILED (a check failed), INCOMPLETE (none failed, some cut by --budget) or passed."""
    ran = [r for r in rows if r.passed is not None]
    failed = [r for r in ran if not r.passed]
    cut = sum(r.cut for r in rows)
    skipped = len(rows) - len(ran) - cut
    verdict = "FAILED" if failed else ("INCOMPLETE" if cut else "passed")
    copy = "-" if copy_gbps is None else f"{copy_gbps:.0f}"
    not_run = f", {cut} not run (--budget)" if cut else ""
    return (f"gpu_check {verdict}: {len(ran) - len(failed)}/{len(ran)} checks passed, {len(failed)} failed, "
            f"{skipped} skipped{not_run}; {device}; copy bandwidth {copy} GB/s; {seconds:.0f} s")


def exit_status(rows: Sequence[Row]) -> int:
    """1 when a check failed or was cut by --budget; skipped sections (no TensorRT) do not count."""
    return 1 if any(r.passed is False or r.cut for r in rows) else 0


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _last_line(text: str) -> str:
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1][:300] if lines else "(no output)"


def _join(a: str, b: str) -> str:
    return "; ".join(x for x in (a, b) if x)


# ----------------------------------------------------------------------------------------------
# main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a subset: fp16, one edge case and one bench shape per "
                                                        "kernel, the graph step, no TensorRT (< 1 minute)")
    p.add_argument("--json", metavar="PATH", help="write the results (rows, device, copy bandwidth) as JSON")
    p.add_argument("--budget", type=float, default=270.0, metavar="SECONDS",
                   help="stop starting new checks after this many seconds; the rest are listed as not run and "
                        "the run is INCOMPLETE (default 270: the table still comes out inside a 5-minute slot)")
    p.add_argument("--only", action="append", default=[], metavar="SUBSTRING",
                   help="run only sections whose name contains it: copy, attention, moe, short_conv, graph, "
                        "tensorrt (repeatable; copy always runs)")
    return p.parse_args(argv)


def plan(quick: bool) -> list[tuple[str, object, str]]:
    """(section, case, dtype) in run order; the graph and TensorRT sections take no case.

    Ordered by dtype (fp16 first, the graph step right after the copy), so a run cut short by
    ``--budget`` loses whole dtypes' later rows, never a whole kernel."""
    dtypes = ("float16",) if quick else DTYPES
    attn = ([c for c in ATTN_CASES if c.quick and not c.bench] + [ATTN_QUICK_BENCH]) if quick else list(ATTN_CASES)
    moe = [c for c in MOE_CASES if c.quick or not quick]
    conv = [c for c in CONV_CASES if c.quick or not quick]
    out: list[tuple[str, object, str]] = [("graph", None, "float16")]
    for dt in dtypes:
        for section, cases in (("attention", attn), ("moe", moe), ("short_conv", conv)):
            out += [(section, c, dt) for c in cases]
    if not quick:
        out.append(("graph", None, "bfloat16"))
    out.append(("tensorrt", None, "float32"))
    return out


CHECKS = {"attention": check_attention, "moe": check_moe, "short_conv": check_short_conv}


def kernel_label(section: str, case) -> str:
    """The table's kernel column for a (section, case) of ``plan``: the kernel and tactic it runs."""
    if section == "attention":
        return f"attention_{case.tactic}"
    if section == "moe":
        return f"moe/{case.resolved_tactic()}"
    if section == "short_conv":
        return f"short_conv/{case.resolved_tactic}"
    return GRAPH_ROW if section == "graph" else section


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        print(f"gpu_check: --json {args.json}: its directory does not exist: create it or pick another path",
              file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    # Before any kernel module is imported: triton.jit picks the interpreter at decoration time.
    os.environ.pop("TRITON_INTERPRET", None)
    import triton

    from graphkiln.plugins_trt.kernels import attention as attn_k

    if type(attn_k.attention_kernel).__name__ == "InterpretedFunction":
        print("gpu_check: the kernels were imported in Triton interpreter mode: run the script in a fresh process "
              "without TRITON_INTERPRET", file=sys.stderr)
        return 2
    # References compute in the dtype with fp32 accumulation, as on CPU: no TF32, no reduced-precision sums.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False

    props = torch.cuda.get_device_properties(0)
    device = f"{props.name} (sm_{props.major}{props.minor}), torch {torch.__version__}, triton {triton.__version__}"
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    copy_bps = copy_bandwidth(COPY_BYTES // 4 if args.quick else COPY_BYTES)
    rows = [Row("copy (device to device)", "uint8", f"{(COPY_BYTES // 4 if args.quick else COPY_BYTES) >> 20} MiB",
                tolerance=None, gbps=copy_bps / 1e9, pct_copy=100.0, note="the yardstick: bytes read + written / time")]
    say(f"{device}: copy {copy_bps / 1e9:.0f} GB/s")
    bench = Bench(copy_bps, getattr(props, "L2_cache_size", 0))
    lost = None  # the first error that left the CUDA context unusable: later GPU rows are not run
    for section, case, dtype in plan(args.quick):
        if args.only and not any(o in section for o in args.only):
            continue
        if section == "tensorrt":
            if args.quick:
                rows.append(Row("tensorrt engine vs CPU", "float32", "-", passed=None, note="skipped: --quick"))
                continue
            if time.perf_counter() - t0 > args.budget:
                rows.append(Row("tensorrt engine vs CPU", "float32", "-", passed=None, cut=True,
                                note=f"not run: --budget {args.budget:g} s reached"))
                continue
            with tempfile.TemporaryDirectory(prefix="graphkiln-gpucheck-") as tmp:
                try:
                    row = check_tensorrt(Path(tmp))
                except Exception as exc:
                    row = Row("tensorrt engine vs CPU", "float32", "-", passed=False, note=_one_line(exc))
            rows.append(row)
            say(f"tensorrt: {format_row(row)[5]} {row.note}")
            continue
        label = section if case is None else f"{section} {case.name}"
        name, shape = kernel_label(section, case), StepShape().describe() if case is None else case.shape()
        if time.perf_counter() - t0 > args.budget:
            rows.append(Row(name, dtype, shape, passed=None, note=f"not run: --budget {args.budget:g} s reached",
                            cut=True))
            continue
        if lost is not None:
            rows.append(Row(name, dtype, shape, passed=False, note=f"not run: {lost}"))
            continue
        try:
            row = check_decode_graph(dtype) if section == "graph" else CHECKS[section](case, dtype, "cuda", bench=bench)
        except Exception as exc:
            row = Row(name, dtype, shape, passed=False, note=_one_line(exc))
            try:
                torch.cuda.synchronize()
            except Exception as sync_exc:  # e.g. an illegal address: every later launch would fail the same way
                lost = f"CUDA context lost after {label} {dtype} ({_one_line(sync_exc)})"
        rows.append(row)
        say(f"{label} {dtype}: {format_row(row)[5]}{' ' + row.note if row.note else ''}")
        if lost is None:
            torch.cuda.empty_cache()  # bench cases hold GBs; the next case starts from a clean pool

    seconds = time.perf_counter() - t0
    print(format_table(rows))
    print(summary_line(rows, device, copy_bps / 1e9, seconds))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "device": device, "quick": args.quick, "seconds": seconds, "copy_gbps": copy_bps / 1e9,
            "passed": exit_status(rows) == 0, "rows": [asdict(r) for r in rows]}, indent=1))
    return exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
