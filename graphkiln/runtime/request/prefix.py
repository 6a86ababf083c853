"""Prefix reuse: which cached blocks of KV (and conv state) a new request can start from.

Design (after vLLM's prefix caching: ``vllm/v1/core/kv_cache_utils.py``, ``block_pool.py``).
A sequence's positions are cut into blocks of ``block_size`` tokens; only full blocks are kept.
Block i's key is a hash chain: ``H(key of block i-1, its token ids, the content hashes of the
images whose placeholder tokens fall in it)``, the first block's parent being a salt (the
request's LoRA adapter's content hash, empty for the base model, so two adapters never share rows). Equal keys mean
equal prefixes up to and including that block (tokens, images and everything before), so a
block's rows depend on nothing else and any request whose chain reaches it may reuse them.

``PrefixIndex`` maps keys to block ids of a ``backends.prefix_store.BlockStore`` (one per pool,
or one per pipeline stage, all under the same ids). Rows are copied into a request's slot at
admission and copied out as its blocks fill, so the store is never referenced while a request
runs: every block is evictable, least recently used first. A hit touches its blocks from the
last to the first, so a chain's tail is evicted before its head (a head without its tail is
still a usable shorter prefix; a tail without its head is not).

Conv-state hybrids: a block can end a reused prefix only if it holds a snapshot of the conv
state after its last position (``snapshot``), saved where a run ended exactly at the block's
end: the end of a prefill chunk (chunks end on block boundaries) and every block filled while
decoding. Blocks without one still serve inside a longer prefix.

Window-sized caches (a pool whose sliding layers keep only their window: ``backends.state``):
a block is copied out right after the run that filled it, while the slot still holds it; an
evicted block of an older part of the chain cannot be copied again, so the chain is then held
only up to it. A restored prefix gives sliding layers only its last blocks (``BlockStore.load``).

Lifecycle: made by the driver with the store's capacity; ``lookup`` at admission, ``insert``
after each run; counters read by ``stats``. Single-threaded: the stepping thread owns it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import numpy as np

DEFAULT_BLOCK_SIZE = 32  # tokens per block: a hit is rounded down to a multiple of it
DEFAULT_BUDGET_BYTES = 2 << 30  # at most; and at most a quarter of the memory available at load


@dataclass(frozen=True)
class PrefixStats:
    """Totals since the index was made: prompt tokens taken from the cache (``hit_tokens``) and
    computed (``miss_tokens``), blocks evicted, and the blocks held now and their bytes."""

    hit_tokens: int
    miss_tokens: int
    evictions: int
    blocks: int
    capacity_blocks: int
    bytes: int
    capacity_bytes: int
    block_size: int


@dataclass(frozen=True)
class Hit:
    """A lookup's answer: the cached blocks ``ids`` cover positions ``[0, len(ids) * block_size)``;
    ``snapshot`` is the block id holding the conv state at their end (None: no conv layers)."""

    ids: tuple[int, ...]
    snapshot: int | None
    tokens: int


NO_HIT = Hit((), None, 0)


class PrefixIndex:
    """Keys to block ids, with LRU eviction (module docstring). ``snapshots``: the pool has conv
    layers, so a reused prefix must end at a block holding a conv snapshot."""

    def __init__(self, block_size: int, capacity_blocks: int, block_bytes: int, snapshots: bool) -> None:
        self.block_size = block_size
        self.capacity = capacity_blocks
        self.block_bytes = block_bytes
        self.snapshots = snapshots
        self._blocks: OrderedDict[bytes, list] = OrderedDict()  # key -> [block id, has snapshot]; LRU first
        self._fresh = 0  # block ids below this have been handed out (the store's pages touched)
        self.hit_tokens = self.miss_tokens = self.evictions = 0

    # -- keys -----------------------------------------------------------------------------

    def extend_keys(self, keys: list[bytes], tokens: Sequence[int], images: Sequence[tuple[int, int, str]] = (),
                    salt: bytes = b"") -> None:
        """Append to ``keys`` the keys of the full blocks of ``tokens`` it lacks (``keys`` holds the
        first ``len(keys)`` of them already). ``images``: (start, end, content hash) of each
        image's placeholder span."""
        B = self.block_size
        for i in range(len(keys), len(tokens) // B):
            h = hashlib.blake2b(keys[-1] if keys else b"graphkiln-prefix/" + salt, digest_size=16)
            h.update(np.asarray(tokens[i * B:(i + 1) * B], np.int64).tobytes())
            for start, end, key in images:
                if start < (i + 1) * B and end > i * B:
                    h.update(f"{start}:{end}:{key}".encode())
            keys.append(h.digest())

    # -- lookup, insert ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes], limit: int) -> Hit:
        """The longest cached prefix of ``keys`` that covers at most ``limit`` positions (and,
        with ``snapshots``, ends at a block holding one); its blocks become most recently used."""
        found = []
        for key in keys[: limit // self.block_size]:
            entry = self._blocks.get(key)
            if entry is None:
                break
            found.append((key, entry))
        if self.snapshots:
            while found and not found[-1][1][1]:
                found.pop()
        if not found:
            return NO_HIT
        for key, _ in reversed(found):  # the tail first: it is evicted before the head
            self._blocks.move_to_end(key)
        return Hit(tuple(e[0] for _, e in found), found[-1][1][0] if self.snapshots else None,
                   len(found) * self.block_size)

    def insert(self, keys: Sequence[bytes], snapshot_last: bool,
               first_new: int | None = None) -> tuple[list[tuple[int, int]], int | None]:
        """Hold every block of a chain (``keys``: a sequence's full blocks, all in its slot now)
        and return what to copy: (block index, block id) of each block not held yet (an evicted
        one is taken again), and the block id to write the conv snapshot into when
        ``snapshot_last`` (a run ended at the last block's end) and that block lacks one. The
        chain becomes most recently used, its tail first. Never evicts a block of this chain;
        stops at the first block it has no room for. ``first_new``: the slot no longer holds
        blocks before it (a window-sized cache: ``backends.state``), so an evicted one of those
        is not taken again and the chain is held only up to it."""
        writes: list[tuple[int, int]] = []
        mine = set(keys)
        snapshot = None
        held = 0
        for i, key in enumerate(keys):
            entry = self._blocks.get(key)
            if entry is None:
                if first_new is not None and i < first_new:
                    break
                block = self._take(mine)
                if block is None:
                    break
                entry = self._blocks[key] = [block, False]
                writes.append((i, block))
            held = i + 1
            if i == len(keys) - 1 and snapshot_last and self.snapshots and not entry[1]:
                entry[1] = True
                snapshot = entry[0]
        for key in reversed(keys[:held]):
            self._blocks.move_to_end(key)
        return writes, snapshot

    def _take(self, keep: set[bytes]) -> int | None:
        if self._fresh < self.capacity:  # never-used ids first, lowest first: the store fills from its front
            self._fresh += 1
            return self._fresh - 1
        for key in self._blocks:  # least recently used first
            if key not in keep:
                block, _ = self._blocks.pop(key)
                self.evictions += 1
                return block
        return None

    def clear(self) -> None:
        """Forget every block (the store's rows are gone: a restarted stage)."""
        self._blocks.clear()
        self._fresh = 0

    def stats(self) -> PrefixStats:
        n = len(self._blocks)
        return PrefixStats(self.hit_tokens, self.miss_tokens, self.evictions, n, self.capacity, n * self.block_bytes,
                           self.capacity * self.block_bytes, self.block_size)


class PrefixCache:
    """What the step asks of prefix reuse, over one pool's block stores: ``find`` a waiting
    request's cached prefix, ``restore`` it into the request's claimed slot, ``remember`` the
    blocks a run has filled. Requests whose prompt must be computed at every position (prompt
    log-probabilities, hidden states of every position) reuse nothing but still leave their
    blocks."""

    def __init__(self, pool, index: PrefixIndex) -> None:
        self.pool = pool
        self.index = index
        self._epoch = getattr(pool, "store_epoch", 0)

    def _check_epoch(self) -> None:
        """A pool whose stores were emptied (a restarted Ray stage) leaves nothing to look up."""
        epoch = getattr(self.pool, "store_epoch", 0)
        if epoch != self._epoch:
            self.index.clear()
            self._epoch = epoch

    @property
    def block_size(self) -> int:
        return self.index.block_size

    def find(self, r) -> Hit:
        """The cached prefix request ``r`` (waiting, no slot) would start from; never its whole
        prompt: its last position must run to give the next token's logits. With conv snapshots
        the prefix ends at most one position before that (the state must be that position's)."""
        if r.cfg.prompt_logprobs is not None or r.cfg.return_hidden_states == "all":
            return NO_HIT
        self._check_epoch()
        n = len(r.prompt_ids)
        self.index.extend_keys(r.keys, r.prompt_ids, r.image_spans, r.adapter_salt)
        limit = n - 1 if self.index.snapshots else n
        hit = self.index.lookup(r.keys, limit)
        # never start inside an image (a chunk holds a whole image: runtime.prompt_layout)
        inside = [s for s, e, _ in r.image_spans if s < min(hit.tokens, n - 1) < e]
        while inside and hit.tokens:
            hit = self.index.lookup(r.keys, min(inside))
            inside = [s for s, e, _ in r.image_spans if s < min(hit.tokens, n - 1) < e]
        return hit

    def first_key(self, r) -> bytes | None:
        """The key of ``r``'s first block (None: shorter than a block); requests sharing it share a prefix."""
        self.index.extend_keys(r.keys, r.prompt_ids[: self.block_size], r.image_spans, r.adapter_salt)
        return r.keys[0] if r.keys else None

    def restore(self, r, hit: Hit) -> None:
        """Copy ``hit``'s rows into ``r``'s claimed slot; its prefill starts after them."""
        self.pool.load_blocks(r.slot, hit.ids, hit.snapshot)
        r.done = r.cached_tokens = min(hit.tokens, len(r.prompt_ids) - 1)
        r.saved_blocks = len(hit.ids)
        self.index.hit_tokens += r.done

    def remember(self, r) -> None:
        """After a run: keep the full blocks now in ``r``'s slot that the index lacks (a request
        that failed leaves nothing: its rows may be NaN)."""
        if r.error is not None or r.slot is None:
            return
        n = len(r.prompt_ids)
        cached = r.done if r.done < n else r.position - 1  # positions whose rows are in the slot
        full = cached // self.block_size
        if full <= r.saved_blocks:
            return
        self._check_epoch()
        self.index.extend_keys(r.keys, (r.prompt_ids + r.tokens)[: full * self.block_size], r.image_spans, r.adapter_salt)
        # a window-sized cache keeps only the blocks from the last run's on (backends.state.window_keep)
        first_new = r.saved_blocks if getattr(self.pool, "windowed", False) else None
        writes, snapshot = self.index.insert(r.keys[:full], snapshot_last=cached == full * self.block_size,
                                             first_new=first_new)
        if writes or snapshot is not None:
            self.pool.save_blocks(r.slot, [b for b, _ in writes], [i for _, i in writes], snapshot)
        r.saved_blocks = full

    def computed(self, tokens: int) -> None:
        """Count prompt tokens a prefill run computed (the misses)."""
        self.index.miss_tokens += tokens

    def stats(self) -> PrefixStats:
        return self.index.stats()


def open_prefix_cache(pool, specs, budget_bytes: int | None, block_size: int) -> PrefixCache | None:
    """A prefix cache beside ``pool``, or None where the pool keeps no blocks (the GPU pools:
    prefix reuse runs on the CPU pools only for now). ``budget_bytes`` None: the default
    (``DEFAULT_BUDGET_BYTES``, at most a quarter of the memory available now); an explicit
    budget above the available memory, or too small for one block, is refused."""
    from graphkiln.errors import GraphkilnError
    from graphkiln.memory import available_memory

    if not hasattr(pool, "attach_store"):
        return None
    if not (isinstance(block_size, int) and not isinstance(block_size, bool) and block_size >= 1):
        raise GraphkilnError(f"prefix_block_size must be an integer >= 1, got {block_size!r}")
    per_block = pool.block_bytes(block_size)
    available = available_memory()
    if budget_bytes is None:
        budget = DEFAULT_BUDGET_BYTES if available is None else min(DEFAULT_BUDGET_BYTES, available // 4)
    else:
        if not (isinstance(budget_bytes, int) and not isinstance(budget_bytes, bool) and budget_bytes >= 0):
            raise GraphkilnError(f"the prefix cache budget must be a number of bytes >= 0, got {budget_bytes!r}")
        if available is not None and budget_bytes > available:
            raise GraphkilnError(f"the prefix cache budget ({budget_bytes / 2**30:.2f} GiB) is more than the "
                                 f"{available / 2**30:.2f} GiB of memory available: pass a smaller "
                                 "--prefix-cache-bytes (prefix_cache_bytes)")
        if budget_bytes < per_block:
            raise GraphkilnError(f"the prefix cache budget ({budget_bytes} bytes) holds no block of {block_size} tokens "
                                 f"({per_block} bytes for this model): pass at least {per_block}, or turn the cache "
                                 "off (--no-prefix-cache, prefix_cache=False)")
        budget = budget_bytes
    blocks = budget // per_block
    if blocks < 1:
        return None
    pool.attach_store(blocks, block_size)
    snapshots = any(s.kind in ("conv", "recurrent") for s in specs)
    return PrefixCache(pool, PrefixIndex(block_size, blocks, per_block, snapshots))
