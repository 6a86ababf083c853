"""What every op with a per-slot state pool (ShortConv, GatedDeltaRule, SsmScan) returns as its
new state, in torch: the batch's rows, or (``state_update`` 1) the whole pool with those rows
written at ``slot_idx``. One definition for the references and the fakes; torch is not imported
here (the arguments are tensors)."""

from __future__ import annotations


def new_state(state_pool, slot_idx, rows, state_update: int):
    """The reference's new-state output: ``rows`` [B, ...], or a copy of the pool with them written."""
    if not state_update:
        return rows
    pool = state_pool.clone()
    pool[slot_idx] = rows
    return pool


def fake_new_state(state_pool, batch: int, state_update: int):
    """The new-state output's shape for tracing: the pool's, or ``batch`` rows of it."""
    if state_update:
        return state_pool.new_empty(state_pool.shape)
    return state_pool.new_empty((batch, *state_pool.shape[1:]))
