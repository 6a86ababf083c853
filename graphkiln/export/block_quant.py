"""Block quantizers: a float ``[N, K]`` weight -> integer codes in blocks along K (``BlockQuantized``).

Three methods, chosen by measurement on the real checkpoint (docs/quantization.md has the table):

* ``rtn``: round to nearest. Symmetric: the block's value of largest magnitude maps to the most
  negative code (scale = that value / -2^(bits-1)), as llama.cpp's Q4_0 and onnxruntime's own
  quantizer do; asymmetric: min and max map to the end codes.
* ``search``: for each block, a grid of scales around the RTN one; each candidate's codes are
  rounded, then the scale is refitted by least squares given the codes; the candidate with the
  least squared error wins (llama.cpp's ``make_qx_quants`` / ``make_qkx2_quants`` idea).
* ``calibrated`` (the default): ``search`` with the error of column k weighted by ``importance[k]``,
  the mean squared input of that feature (``export.calibration``): the error in the layer's output,
  not in its weights, is what is minimised (llama.cpp's importance matrix).

Symmetric blocks keep MatMulNBits' implicit midpoint (no zero points: its fastest CPU path);
asymmetric ones store an integer zero point per block. Rows are processed a chunk at a time, so
memory stays a few times one chunk.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from graphkiln.models.prequantized import BlockQuantized

METHODS = ("rtn", "search", "calibrated")
# Scale candidates, as factors of the RTN scale (measured: wider or finer grids gained nothing on the
# real checkpoint; see docs/quantization.md)
_GRID = np.linspace(-0.12, 0.12, 9, dtype=np.float32)
_CHUNK_ELEMENTS = 1 << 22  # weights per chunk of rows


def quantize_blocks(w: np.ndarray, bits: int, block_size: int, symmetric: bool = True, method: str = "rtn",
                    importance: np.ndarray | None = None) -> BlockQuantized:
    """Quantize ``w`` (float ``[N, K]``) in blocks of ``block_size`` along K. ``importance``: float
    ``[K]`` weights of the columns (``calibrated``; ignored otherwise)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    n, k = w.shape
    k_blocks = (k + block_size - 1) // block_size
    padded = k_blocks * block_size
    col_weight = None
    if method == "calibrated" and importance is not None:
        col_weight = np.zeros(padded, np.float32)
        # a feature that never fired still counts a little, so its columns are not rounded at random
        imp = np.asarray(importance, np.float32)
        col_weight[:k] = imp + 1e-3 * float(imp.mean()) + 1e-12
        col_weight = col_weight.reshape(k_blocks, block_size)
    codes = np.empty((n, padded), np.uint8)
    scales = np.empty((n, k_blocks), np.float32)
    zero_points = np.empty((n, k_blocks), np.uint8)
    rows = max(1, _CHUNK_ELEMENTS // padded)

    def one(start: int, chunk: np.ndarray) -> None:
        if padded != k:
            chunk = np.pad(chunk, ((0, 0), (0, padded - k)))
        x = chunk.reshape(-1, block_size)
        weights = None if col_weight is None else np.broadcast_to(
            col_weight[None], (chunk.shape[0], k_blocks, block_size)).reshape(-1, block_size)
        q, s, z = _quantize(x, bits, symmetric, method != "rtn", weights)
        end = start + chunk.shape[0]
        codes[start:end] = q.reshape(chunk.shape[0], padded)
        scales[start:end] = s.reshape(-1, k_blocks)
        zero_points[start:end] = z.reshape(-1, k_blocks)

    # Chunks are independent: one per CPU at a time, each single-threaded in torch. torch's own
    # two-thread operations wait at a barrier after each small op, and on a machine with any other
    # load one of the threads is often descheduled there: measured 6.7 s instead of 1.0 s for a
    # 2048x4096 weight. Rows are read (``w`` may read them from a checkpoint) in this thread, in order.
    import torch

    from graphkiln.threads import usable_cpus

    workers = max(1, min(usable_cpus(), 4, -(-n // rows)))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="quantize") as pool:
            pending: deque = deque()
            for start in range(0, n, rows):
                pending.append(pool.submit(one, start, np.asarray(w[start:start + rows], dtype=np.float32)))
                while len(pending) >= workers:  # bounded: at most one chunk per worker in memory
                    pending.popleft().result()
            while pending:
                pending.popleft().result()
    finally:
        torch.set_num_threads(before)
    return BlockQuantized(np.ascontiguousarray(codes[:, :k]), scales, zero_points, bits, block_size,
                          f"{method}-{'sym' if symmetric else 'asym'}")


def _quantize(x: np.ndarray, bits: int, symmetric: bool, search: bool, weights: np.ndarray | None):
    """Blocks ``x [B, block]`` -> (codes uint8 [B, block], scales float32 [B], zero points uint8 [B]).

    In torch (float32, the export's threads): the same arithmetic as numpy, ~3x faster here."""
    import torch

    xt = torch.from_numpy(x)
    wt = None if weights is None else torch.from_numpy(np.ascontiguousarray(weights))
    qmax = float((1 << bits) - 1)
    mid = float(1 << (bits - 1))
    if symmetric:
        peak = torch.gather(xt, 1, xt.abs().argmax(dim=1, keepdim=True))[:, 0]
        base = peak / -mid
        lo = None
    else:
        lo, hi = xt.amin(dim=1), xt.amax(dim=1)
        base = (hi - lo) / qmax
    base = torch.where(base == 0, torch.ones_like(base), base)

    def zero_point(s):
        return torch.full_like(s, mid) if lo is None else torch.clamp(torch.round(-lo / s), 0, qmax)

    def levels(s, z):  # codes minus zero points, as floats
        return torch.clamp(torch.round(xt / s[:, None]) + z[:, None], 0, qmax) - z[:, None]

    best_s, best_z = base, zero_point(base)
    if search:
        # the same arithmetic as levels() and the sums below, into reused buffers: a fresh 16 MB
        # tensor per operation was page-faulted in each time (a fifth of the export's time went there)
        wx = xt if wt is None else wt * xt
        total = (wx * xt).sum(dim=1)  # sum W x^2
        best_err = torch.full_like(base, float("inf"))
        d, scratch = torch.empty_like(xt), torch.empty_like(xt)
        wd_buf = None if wt is None else torch.empty_like(xt)
        for f in _GRID:
            s = base * (1 + float(f))
            z = zero_point(s)
            torch.div(xt, s[:, None], out=d)
            d.round_().add_(z[:, None]).clamp_(0, qmax).sub_(z[:, None])
            wd = d if wt is None else torch.mul(wt, d, out=wd_buf)
            num = torch.mul(wd, xt, out=scratch).sum(dim=1)
            den = torch.mul(wd, d, out=scratch).sum(dim=1)
            ok = den > 0
            safe = torch.where(ok, den, torch.ones_like(den))
            fit = torch.where(ok, num / safe, s)  # least-squares scale for these codes
            err = torch.where(ok, total - num * num / safe, total)  # its weighted squared error
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, fit, best_s)
            best_z = torch.where(better, z, best_z)
        best_s = torch.where(best_s == 0, torch.ones_like(best_s), best_s)
    codes = (levels(best_s, best_z) + best_z[:, None]).to(torch.uint8)
    return codes.numpy(), best_s.numpy().astype(np.float32), best_z.to(torch.uint8).numpy()
