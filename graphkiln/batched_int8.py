"""Int8 weights for batched steps of a quantized artifact, derived from its int4/int8 blocks at load.

Why: onnxruntime's MatMulNBits (the int4/int8 block kernel quantized artifacts run with) costs
the same per row whatever the batch: at 16 rows, int4 block 32 takes 29 µs per row of
``[1024] x [1024, 2816]`` where MatMulInteger over per-channel int8 weights takes 13 µs
(docs/quantization.md), so int4 decode scaled 1.8x from one stream to 16 where fp32 scaled 3.9x.
A quantized artifact therefore carries a second decoder graph for steps of many token rows
(``manifest.BatchedGraphSpec``), the same graph with each MatMulNBits replaced by

    x = A / s;  a = max|x| per row / 127;  y = (MatMulInteger(round(x / a) + 128, Wq, 128) * a) * c

over the same state pools, where ``Wq [K, N]`` int8 and ``c [N]`` are the per-output-channel int8
quantization of ``diag(s) W``, W the block weights dequantized. ``s [K]`` is SmoothQuant's
migration of activation outliers into the weights (``s_k = sqrt(rms x_k / max_n |W_kn|)``, from
the export's calibration pass; ones without it): per-row int8 activations alone cost 1.138x
fp32 perplexity on the real checkpoint, smoothed 1.114x (int4 blocks: 1.108x).

The artifact stores only the graph and ``s``; ``Wq`` and ``c`` are computed here from the int4
blocks when the runtime opens the graph (``derived_weights``), so the artifact stays the int4
size and the int8 weights cost memory only where a deployment turns the path on. Export and
runtime both use this module's arithmetic, so what export measures is what the runtime derives.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from graphkiln.errors import GraphkilnError

# external-data location of the initializers computed at load (no such file exists: onnxruntime
# is handed them as external initializers, and artifact checks let exactly this name through)
DERIVED_LOCATION = "graphkiln-derived-at-load"
SMOOTHING_ALPHA = 0.5  # measured on the real checkpoint: 0.3 1.127x, 0.5 1.114x, 0.7 1.124x, 0.8 1.142x
# steps with fewer token rows run the block graph: at 1 row its kernel reads 2x fewer bytes
DEFAULT_MIN_ROWS = 4


def unpack_codes(blob: np.ndarray, bits: int) -> np.ndarray:
    """MatMulNBits' packed B ``[N, k_blocks, block * bits / 8]`` uint8 -> codes ``[N, k_blocks, block]``."""
    if bits == 8:
        return blob
    lo, hi = blob & 0x0F, blob >> 4
    return np.stack([lo, hi], -1).reshape(blob.shape[0], blob.shape[1], -1)


def dequantize(blob: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, bits: int) -> np.ndarray:
    """The float32 ``[K, N]`` weight MatMulNBits (B, scales, zero points) represents; without zero
    points, the kernel's midpoint 2^(bits-1)."""
    n, k_blocks = blob.shape[:2]
    codes = unpack_codes(blob, bits).astype(np.float32)
    if zero_points is None:
        zp = np.float32(1 << (bits - 1))
    else:
        zp = unpack_codes(zero_points.reshape(n, 1, -1), bits).reshape(n, -1)[:, :k_blocks, None].astype(np.float32)
    w = (codes - zp) * scales.reshape(n, k_blocks, 1).astype(np.float32)
    return np.ascontiguousarray(w.reshape(n, -1)[:, :k].T)


def smoothing(w_kn: np.ndarray, mean_sq_input: np.ndarray | None, alpha: float = SMOOTHING_ALPHA) -> np.ndarray:
    """SmoothQuant's per-input-feature factors ``s [K]``: ``rms(x_k)^alpha / max_n |W_kn|^(1 - alpha)``
    from the calibration pass's mean squared input per feature; ones when there is none."""
    if mean_sq_input is None or len(mean_sq_input) != w_kn.shape[0]:
        return np.ones(w_kn.shape[0], np.float32)
    return smoothing_from_max(np.abs(w_kn).max(axis=1), mean_sq_input, alpha)


def smoothing_from_max(w_max: np.ndarray, mean_sq_input: np.ndarray | None, alpha: float = SMOOTHING_ALPHA) -> np.ndarray:
    """``smoothing`` given ``max_n |W_kn|`` per input feature (computed a band of N at a time by a
    caller that cannot hold the whole float weight)."""
    if mean_sq_input is None or len(mean_sq_input) != w_max.shape[0]:
        return np.ones(w_max.shape[0], np.float32)
    x = np.maximum(np.sqrt(np.asarray(mean_sq_input, np.float64)), 1e-5)
    w = np.maximum(np.asarray(w_max).astype(np.float64), 1e-5)
    return (x ** alpha / w ** (1 - alpha)).astype(np.float32)


def quantize_per_channel(w_kn: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(Wq [K, N] int8, c [N] float32)``: symmetric per-output-channel int8 of ``diag(s) W``."""
    w = w_kn * s[:, None]
    amax = np.abs(w).max(axis=0)
    c = np.where(amax > 0, amax / 127, 1).astype(np.float32)
    q = np.clip(np.rint(w / c), -127, 127).astype(np.int8)
    return q, c


def read_tensor(root: Path, ref) -> np.ndarray:
    """A ``manifest.TensorRef``'s array, read from its artifact file; one error line if it runs past the file."""
    from graphkiln.manifest import open_artifact_file

    dtype = np.dtype(ref.dtype)
    count = int(np.prod(ref.shape))
    with open_artifact_file(root, ref.file) as f:
        f.seek(ref.offset)
        data = f.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise GraphkilnError(f"artifact file {ref.file} ends before the {list(ref.shape)} {ref.dtype} tensor at offset "
                             f"{ref.offset} its manifest names: re-export the artifact")
    return np.frombuffer(data, dtype).reshape(ref.shape)


# Deriving one weight holds float32 temporaries of its [K, N] elements: the dequantized weight, its
# smoothed copy and two of quantize_per_channel's intermediates at once (4 x 4 bytes per element).
WORKING_BYTES_PER_ELEMENT = 16
# What stays per element: the int8 array, and onnxruntime's pre-packed copy of it (MatMulInteger
# packs a constant B when the session is built, and the runtime keeps its arrays alive).
KEPT_BYTES_PER_ELEMENT = 2


def derived_bytes(spec) -> int:
    """About the memory ``derived_weights`` of a ``manifest.BatchedGraphSpec`` and the session that
    takes them hold at their peak, from the manifest's shapes alone (nothing read): every weight's
    int8 ``Wq`` and its packed copy and ``c``, plus the largest weight's float32 temporaries while
    it is derived. Exact Python ints: a manifest's huge shapes do not wrap."""
    kept, largest = 0, 0
    for d in spec.weights:
        k, n = int(d.smooth.shape[0]), int(d.source.shape[0])
        kept += k * n * KEPT_BYTES_PER_ELEMENT + n * 4
        largest = max(largest, k * n)
    return kept + largest * WORKING_BYTES_PER_ELEMENT


def derived_weights(root: Path, spec) -> dict[str, np.ndarray]:
    """The initializers a ``manifest.BatchedGraphSpec``'s graph takes at load, by name: each
    weight's ``Wq`` and ``c``, computed from the blocks and ``s`` the manifest points at."""
    out: dict[str, np.ndarray] = {}
    for d in spec.weights:
        s = read_tensor(root, d.smooth)
        blob = read_tensor(root, d.source)
        scales = read_tensor(root, d.source_scales)
        zp = read_tensor(root, d.source_zero_points) if d.source_zero_points is not None else None
        w = dequantize(blob, scales, zp, len(s), d.bits)
        out[d.weight], out[d.scales] = quantize_per_channel(w, s)
    return out
