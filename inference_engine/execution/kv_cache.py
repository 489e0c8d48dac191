"""Sink + sliding-window KV cache with global positions and a chunking-independent layout.

Storage: sinks at slots [0, sink), every later position x in a ring slot
`sink + (x - sink) % ring`, where `ring = window + max_block + max_rollback`, so the rows of a
block and a rollback of up to `max_rollback` tokens never need an overwritten slot.

A query at global position p attends to the sinks and to positions p-window..p. Attention
reads the whole storage with a per-row mask; which slots are valid, and where, depends only
on p, so scores, softmax and the weighted sum reduce identical data in identical order
however the tokens were chunked (masked slots contribute exact zeros).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class CacheGeometry:
    """Sizes shared by every layer's cache of one session."""

    sink: int  # attention-sink tokens kept forever
    window: int  # most recent tokens each query sees besides itself
    max_block: int  # most rows computed in one forward chunk
    max_rollback: int  # most trailing tokens `trim` may drop

    @property
    def ring(self) -> int:
        """Slots for non-sink positions."""
        return self.window + self.max_block + self.max_rollback

    @property
    def slots(self) -> int:
        """Total storage slots per layer."""
        return self.sink + self.ring

    def key_extent(self, p: int, bucket: int = 128) -> int:
        """Storage slots a query at p reads: a prefix that depends on p only.

        Until the ring wraps, slot == position, so slots past p are all masked and are
        skipped in buckets of `bucket`; once it wraps, every slot is read.
        """
        if p >= self.slots:
            return self.slots
        return min(self.slots, (p // bucket + 1) * bucket)

    def slot_of(self, positions: np.ndarray) -> np.ndarray:
        """Storage slot of each global position."""
        return np.where(positions < self.sink, positions, self.sink + (positions - self.sink) % self.ring)

    def visible_positions(self, p: int) -> list[int]:
        """Positions (ascending) a query at p attends to."""
        return list(range(min(self.sink, p + 1))) + list(range(max(self.sink, p - self.window), p + 1))

    def slab_bytes(self, num_layers: int, num_kv_heads: int, head_dim: int, itemsize: int = 4) -> int:
        """Bytes of K and V storage for a whole model with this geometry (what a session holds)."""
        return 2 * num_layers * num_kv_heads * self.slots * head_dim * itemsize


def rollback_room(max_rollback: int) -> int:
    """Trailing tokens a session's cache must be able to drop, for a server's `--max-rollback`.

    A speculative step forwards up to K + 1 tokens (K <= max_rollback) and may keep only
    the first; a step whose tokens were never sent is retracted whole: K + 1.
    """
    return max_rollback + 1


@lru_cache(maxsize=64)
def write_slots(geometry: CacheGeometry, start: int, length: int) -> mx.array | slice:
    """Storage slots of positions start..start+length-1 (shared by all layers): a slice when
    they are consecutive (every decode step, most chunks, a block across the sinks' end: one
    slice update per array, the fewest graph nodes), else (length,) int32 slots (a block
    across the ring's wrap: a scatter). Either stores the same values in the same slots."""
    slots = geometry.slot_of(np.arange(start, start + length))
    if slots[-1] - slots[0] == length - 1:
        return slice(int(slots[0]), int(slots[0]) + length)
    return mx.array(slots.astype(np.int32))


@lru_cache(maxsize=64)
def row_groups(geometry: CacheGeometry, start: int, length: int) -> tuple[tuple[int, int, int], ...]:
    """Consecutive rows sharing a key extent: ((row_lo, row_hi, extent), ...) (cached per block)."""
    groups: list[tuple[int, int, int]] = []
    for i in range(length):
        extent = geometry.key_extent(start + i)
        if groups and groups[-1][2] == extent:
            groups[-1] = (groups[-1][0], i + 1, extent)
        else:
            groups.append((i, i + 1, extent))
    return tuple(groups)


@lru_cache(maxsize=512)
def row_mask(geometry: CacheGeometry, start: int, length: int) -> mx.array:
    """Validity of every storage slot for rows at positions start..start+length-1.

    Returns:
        (length, 1, 1, slots) bool: slot s is visible to row i.
    """
    g = geometry
    mask = np.zeros((length, g.slots), dtype=bool)
    for i, p in enumerate(range(start, start + length)):  # per decode step: no Python lists of the window
        mask[i, : min(g.sink, p + 1)] = True  # the sinks seen so far
        mask[i, g.slot_of(np.arange(max(g.sink, p - g.window), p + 1))] = True  # the window, then p itself
    return mx.array(mask[:, None, None, :])


@lru_cache(maxsize=64)
def attention_groups(geometry: CacheGeometry, start: int, length: int) -> tuple[tuple[int, int, int, mx.array], ...]:
    """`row_groups` with each group's `row_mask` rows cut to its extent: ((lo, hi, extent, mask), ...).

    Evaluated once here, so every layer (and every worker span) reads the same small arrays
    instead of slicing the mask again per layer (fewer graph nodes per step).
    """
    mask = row_mask(geometry, start, length)
    groups = tuple((lo, hi, extent, mask[lo:hi, ..., :extent]) for lo, hi, extent in row_groups(geometry, start, length))
    mx.eval([m for *_, m in groups])
    return groups


def layer_digest(keys: np.ndarray, values: np.ndarray) -> bytes:
    """SHA-256 of one layer's canonical K bytes then V bytes ((n_kv, n, D) each, C order)."""
    return hashlib.sha256(np.ascontiguousarray(keys).tobytes() + np.ascontiguousarray(values).tobytes()).digest()


@dataclass(frozen=True, eq=False)
class CanonicalKV:
    """A session's retained K/V, every layer, independent of where it ran and of the ring's slack.

    The retained positions are `geometry.visible_positions(position)[:-1]` (the sinks, then the
    window), in position order: what `canonical_state` and the digests read, so two sessions
    with equal digests have equal canonical K/V, whichever block size, rollbacks or route
    produced them.
    """

    position: int  # the caches' next position (tokens computed)
    keys: np.ndarray  # (layers, n_kv, n, D) keys of the retained positions
    values: np.ndarray  # (layers, n_kv, n, D) values of the retained positions

    def layer_digests(self) -> list[bytes]:
        """Per-layer digests, equal to `SinkWindowKVCache.digest` of the caches it was taken from."""
        return [layer_digest(k, v) for k, v in zip(self.keys, self.values)]


def zeroed_storage(geometry: CacheGeometry, num_kv_heads: int, head_dim: int,
                   dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
    """One layer's K and V storage, zeroed; safe on any thread (an allocation and a copy from numpy:
    no graph, nothing for a stream to run), so a new session's ~48 MB need not stall the engine thread.

    Zero-initialised: masked slots must hold finite values (0 * value must be 0). Owned,
    materialized buffers (from numpy, never a broadcast zero): the native attention kernel
    writes into them in place (`reserve`).
    """
    zeros = np.zeros((num_kv_heads, geometry.slots, head_dim), dtype=np.dtype(str(dtype).removeprefix("mlx.core.")))
    return mx.array(zeros), mx.array(zeros)  # (n_kv, slots, D) each


class SinkWindowKVCache:
    """One layer's K/V storage for one session (implements model.kv_protocol.KVCache).

    Protocol (as mlx-lm caches): `offset`, `update_and_fetch`, `trim`, `nbytes`, `state`,
    plus `attention_groups` for attention as MLX ops, `layout` and `reserve` for the native
    attention kernel (model/native_kernels.py), and `canonical_state` for digests.

    The storage arrays are this cache's own buffers: the native kernel writes rows into them
    in place, so a state kept across a forward must be a copy (`Executor.snapshot`).
    """

    def __init__(self, geometry: CacheGeometry, num_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32,
                 storage: tuple[mx.array, mx.array] | None = None):
        """
        Args:
            storage: this layer's zeroed K and V from `zeroed_storage` (allocated here if None).
        """
        self.geometry = geometry
        self.offset = 0
        keys, values = storage or zeroed_storage(geometry, num_kv_heads, head_dim, dtype)
        self.keys = keys  # (n_kv, slots, D)
        self.values = values  # (n_kv, slots, D)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Store K/V for positions offset..offset+L-1; return the storage and each row's mask.

        Args:
            keys: (n_kv, L, D) RoPE-rotated keys of the new rows.
            values: (n_kv, L, D) values of the new rows.
        Returns:
            keys (n_kv, slots, D), values (n_kv, slots, D), mask (L, 1, 1, slots) bool.
            Row i only needs the first `geometry.key_extent(start + i)` slots.
        """
        g = self.geometry
        length = keys.shape[1]
        if length > g.max_block:
            raise ValueError(f"block of {length} rows exceeds max_block {g.max_block}")
        write = write_slots(g, self.offset, length)
        self.keys[:, write, :] = keys
        self.values[:, write, :] = values
        mask = row_mask(g, self.offset, length)
        self.offset += length
        return self.keys, self.values, mask

    @property
    def layout(self) -> tuple[int, int, int]:
        """(sinks, window, ring) of the geometry (what an attention kernel needs)."""
        return self.geometry.sink, self.geometry.window, self.geometry.ring

    def reserve(self, rows: int) -> tuple[mx.array, mx.array]:
        """The storage, for a kernel that writes the next `rows` positions into it in place."""
        if rows > self.geometry.max_block:
            raise ValueError(f"block of {rows} rows exceeds max_block {self.geometry.max_block}")
        self.offset += rows
        return self.keys, self.values

    @property
    def max_block(self) -> int:
        """Most rows one update may take (the geometry's block)."""
        return self.geometry.max_block

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The K and V storage arrays."""
        return self.keys, self.values

    def attention_groups(self, start: int, length: int) -> tuple[tuple[int, int, int, mx.array], ...]:
        """Rows at positions start.. grouped by key extent, with their masks (see `attention_groups`)."""
        return attention_groups(self.geometry, start, length)

    def trim(self, n: int) -> int:
        """Drop the last n positions; returns n. Raises ValueError past max_rollback."""
        if n < 0 or n > self.geometry.max_rollback or n > self.offset:
            raise ValueError(f"cannot trim {n} tokens (allowed 0..{min(self.geometry.max_rollback, self.offset)})")
        self.offset -= n
        return n

    def retained_positions(self) -> list[int]:
        """Positions whose K/V the next query can see (sinks, then the window)."""
        return self.geometry.visible_positions(self.offset)[:-1] if self.offset else []

    def canonical_state(self) -> tuple[mx.array, mx.array]:
        """K/V of `retained_positions()` in position order: (n_kv, n, D) each."""
        pos = np.array(self.retained_positions(), dtype=np.int64)
        idx = mx.array(self.geometry.slot_of(pos).astype(np.int32))
        return self.keys[:, idx, :], self.values[:, idx, :]

    def digest(self) -> bytes:
        """SHA-256 of the canonical K then V bytes (per layer, so shards can report theirs)."""
        k, v = self.canonical_state()
        return layer_digest(np.array(k), np.array(v))

    def load_canonical(self, offset: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Put a canonical state back (a restored snapshot): this cache then stands at `offset`.

        The rows go to the slots their positions map to; every other slot keeps its zeros,
        which no query from `offset` on reads unmasked (see the module docstring).

        Args:
            offset: the position the canonical state was taken at.
            keys / values: (n_kv, n, D) K/V of `geometry.visible_positions(offset)[:-1]`, in order.
        Raises:
            ValueError: the cache is not fresh (offset 0), or the arrays do not fit (shape or dtype).
        """
        pos = np.array(self.geometry.visible_positions(offset)[:-1] if offset else [], dtype=np.int64)
        self._check_loadable(offset, len(pos), keys, values)
        if len(pos):
            idx = mx.array(self.geometry.slot_of(pos).astype(np.int32))
            self.keys[:, idx, :] = mx.array(keys)
            self.values[:, idx, :] = mx.array(values)
            mx.eval(self.keys, self.values)
        self.offset = offset

    def _check_loadable(self, offset: int, count: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Raise ValueError unless this cache is fresh and `keys`/`values` are (n_kv, count, D) of its dtype."""
        if self.offset != 0:
            raise ValueError(f"a canonical state loads into a fresh cache only (this one is at {self.offset})")
        want = (self.keys.shape[0], count, self.keys.shape[2])
        dtype = np.dtype(str(self.keys.dtype).removeprefix("mlx.core."))
        for name, a in (("keys", keys), ("values", values)):
            if a.shape != want or a.dtype != dtype:
                raise ValueError(f"canonical {name} {a.dtype}{list(a.shape)} do not fit a cache at position {offset}; "
                                 f"expected {dtype}{list(want)}")

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held (fixed at creation: the memory bound)."""
        return self.keys.nbytes + self.values.nbytes
