"""Runtime-owned KV cache buffers.

Layout (matches ``StateSpec.layout``): one key and one value array per attention layer,
``[batch, kv_heads, capacity, head_dim]``, C-contiguous, in the artifact's dtype. A token at
position p of request row b is stored at ``[b, :, p, :]``.

Lifecycle: a ``KVCache`` is allocated once per generation session (one batch of requests)
with ``capacity`` = the longest prompt plus the token budget, and is never reallocated
while the session runs. The graph reads the whole buffer (positions past a row's length
are masked) and returns only the new rows, which ``write`` stores in place. When requests
finish, ``compact`` moves the survivors' rows to the front, so the live batch is always
the prefix ``[:n]`` — still contiguous, still at the same address — which is what
CUDA-graph replay and slot pools need next.
"""

from __future__ import annotations

import numpy as np

from graphkiln.manifest import StateSpec


class KVCache:
    def __init__(self, states: tuple[StateSpec, ...], batch: int, capacity: int, np_dtype: np.dtype) -> None:
        self.capacity = capacity
        self.batch = batch
        self.keys: dict[int, np.ndarray] = {}
        self.values: dict[int, np.ndarray] = {}
        for spec in states:
            if spec.kind != "kv":
                continue
            shape = (batch, spec.num_kv_heads, capacity, spec.head_dim)
            for layer in spec.layers:
                self.keys[layer] = np.zeros(shape, np_dtype)
                self.values[layer] = np.zeros(shape, np_dtype)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.keys.values()) * 2

    def views(self, n: int) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """The first n rows of every buffer: contiguous views, no copies."""
        return {l: a[:n] for l, a in self.keys.items()}, {l: a[:n] for l, a in self.values.items()}

    def write(self, layer: int, new_k: np.ndarray, new_v: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> None:
        """Store new rows: row b's first lengths[b] tokens go to positions starts[b]... in place."""
        k, v = self.keys[layer], self.values[layer]
        n, seq = new_k.shape[0], new_k.shape[2]
        if seq == 1:
            rows = np.arange(n)
            k[rows, :, starts] = new_k[:, :, 0]
            v[rows, :, starts] = new_v[:, :, 0]
            return
        for b in range(n):
            s, ln = int(starts[b]), int(lengths[b])
            k[b, :, s : s + ln] = new_k[b, :, :ln]
            v[b, :, s : s + ln] = new_v[b, :, :ln]

    def compact(self, keep: list[int]) -> None:
        """Move rows ``keep`` (ascending) to the front, in place."""
        for bufs in (self.keys, self.values):
            for a in bufs.values():
                for dst, src in enumerate(keep):
                    if dst != src:
                        a[dst] = a[src]
