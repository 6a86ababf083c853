"""What the per-slot recurrent-state kernels share (``kernels.gated_delta``, ``kernels.ssm_scan``):
the launch plan and the torch-side launch preamble.

Both kernels keep one [rows, cols] fp32 state per (slot, head) and run every real token of a
batch row through it; grid = (B, heads, cdiv(cols, BLOCK_COLS)), program (b, h, j) owning
columns [j*BLOCK_COLS, (j+1)*BLOCK_COLS) of slot slot_idx[b], head h, all rows in registers.
Head h reads group h // (heads / groups) (gated delta: the q/k heads; Mamba-2: the B/C groups).
What differs between the kernels is their recurrence and their constexprs' names
(``StateDims``); the plan's arithmetic and checks are here once.
"""

from __future__ import annotations

from dataclasses import dataclass

from graphkiln.plugins_trt.kernels import aot

# Columns per program at most: the [rows, BLOCK_COLS] fp32 state lives in registers (rows = 128,
# BLOCK_COLS = 32: 32 fp32 per thread at 4 warps).
MAX_BLOCK_COLS = 32
NUM_WARPS = 4


def pow2(n: int) -> int:
    """The smallest power of two >= n (a block size covering n)."""
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class StateDims:
    """One kernel's names: its constexprs for heads, groups, state rows and columns and their
    blocks, and what its messages call the heads and the groups."""

    heads: str
    groups: str
    rows: str
    cols: str
    block_rows: str
    block_cols: str
    heads_what: str
    groups_what: str


def state_launch_plan(spec: aot.KernelSpec, dims: StateDims, b, s, heads: int, groups: int, rows: int, cols: int,
                      state_pool_shape, state_update: int, constexprs: dict) -> aot.LaunchPlan:
    """The one launch of a recurrent-state kernel: B and S may be symbolic (S is the kernel's
    int32 scalar, B a grid dim); heads, groups, rows and cols are static and compile in, with
    ``constexprs`` (the kernel's own) and STATE_UPDATE. ValueError on a pool of another shape,
    heads not a multiple of groups, or state_update not 0/1."""
    if heads % groups:
        raise ValueError(f"the {dims.heads_what} ({heads}) must be a multiple of the {dims.groups_what} ({groups})")
    for dim, want, what in ((state_pool_shape[1], heads, "state heads"), (state_pool_shape[2], rows, "state rows"),
                            (state_pool_shape[3], cols, "state columns")):
        if isinstance(dim, int) and dim != want:
            raise ValueError(f"{what} is {dim}, expected {want}")
    check_flag("state_update", state_update)
    block_cols = min(pow2(cols), MAX_BLOCK_COLS)
    constexprs = {dims.heads: heads, dims.groups: groups, dims.rows: rows, dims.cols: cols, **constexprs,
                  "STATE_UPDATE": int(state_update), dims.block_rows: pow2(rows), dims.block_cols: block_cols}
    return aot.LaunchPlan(spec, constexprs, (b, heads, aot.ceil_div(cols, block_cols)), (s,), num_warps=NUM_WARPS)


def check_flag(name: str, value) -> None:
    """A 0/1 attribute (a bool is refused: the plugin's field is an int)."""
    if value not in (0, 1) or isinstance(value, bool):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def state_launch_args(state_pool, slot_idx, seq_lens, state_update: int, batch: int, new_state=None):
    """(slot_idx, seq_lens, new_state) as the kernels take them: int64 and contiguous indices; with
    ``new_state`` None, the pool itself for state_update=1 (updated in place, TensorRT's aliasing)
    or fresh rows [batch, heads, rows, cols] for 0. The pool must be contiguous."""
    import torch

    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel updates it in place")
    slot_idx = slot_idx.to(torch.int64).contiguous()
    seq_lens = seq_lens.to(torch.int64).contiguous()
    if new_state is None:
        new_state = state_pool if state_update == 1 else state_pool.new_empty((batch, *state_pool.shape[1:]))
    return slot_idx, seq_lens, new_state
