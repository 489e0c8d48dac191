"""Sink + sliding-window KV cache with global positions and a fixed per-row key layout.

Every query row at global position p attends to the same canonical key list, however
the tokens were chunked: slots [0, sink) hold positions 0..sink-1, slots sink..sink+window
hold positions p-window..p (oldest first). Missing positions are masked. Because the
layout depends only on p, attention reduces over identical data in identical order.

Storage is a ring: sinks at fixed slots, the rest at `sink + (p - sink) % ring`, where
`ring = window + max_block + max_rollback` so a block's rows and a rollback of up to
`max_rollback` tokens never need an overwritten slot.
"""

from __future__ import annotations

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

    @property
    def keys_per_row(self) -> int:
        """Width of the canonical key list of one query row."""
        return self.sink + self.window + 1

    def slot_of(self, positions: np.ndarray) -> np.ndarray:
        """Storage slot of each global position."""
        return np.where(positions < self.sink, positions, self.sink + (positions - self.sink) % self.ring)

    def visible_positions(self, p: int) -> list[int]:
        """Positions (ascending) a query at p attends to."""
        return list(range(min(self.sink, p + 1))) + list(range(max(self.sink, p - self.window), p + 1))


@lru_cache(maxsize=256)
def row_layout(geometry: CacheGeometry, start: int, length: int) -> tuple[mx.array, mx.array]:
    """Gather indices and validity mask for rows at positions start..start+length-1.

    Returns:
        (slots (length * keys_per_row,) int32, mask (length, 1, 1, keys_per_row) bool)
    """
    g = geometry
    p = np.arange(start, start + length)[:, None]  # (L, 1)
    sink_pos = np.broadcast_to(np.arange(g.sink)[None, :], (length, g.sink))  # (L, sink)
    win_pos = p - g.window + np.arange(g.window + 1)[None, :]  # (L, window + 1)
    sink_ok = sink_pos <= p
    win_ok = win_pos >= g.sink
    pos = np.concatenate([sink_pos, win_pos], axis=1)  # (L, C)
    ok = np.concatenate([sink_ok, win_ok], axis=1)
    # Masked slots read slot 0 (always finite) so 0 * value stays 0 in probs @ V.
    slots = np.where(ok, g.slot_of(np.maximum(pos, 0)), 0).astype(np.int32)
    return mx.array(slots.reshape(-1)), mx.array(ok[:, None, None, :])


class SinkWindowKVCache:
    """One layer's K/V storage for one session.

    Protocol (as mlx-lm caches): `offset`, `update_and_fetch`, `trim`, `nbytes`,
    plus `canonical_state` for digests.
    """

    def __init__(self, geometry: CacheGeometry, num_kv_heads: int, head_dim: int, dtype: mx.Dtype = mx.float32):
        self.geometry = geometry
        self.offset = 0
        shape = (num_kv_heads, geometry.slots, head_dim)
        self.keys = mx.zeros(shape, dtype=dtype)  # (n_kv, slots, D)
        self.values = mx.zeros(shape, dtype=dtype)  # (n_kv, slots, D)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Store K/V for positions offset..offset+L-1 and gather each row's key list.

        Args:
            keys: (n_kv, L, D) RoPE-rotated keys of the new rows.
            values: (n_kv, L, D) values of the new rows.
        Returns:
            keys (L, n_kv, C, D), values (L, n_kv, C, D), mask (L, 1, 1, C) bool.
        """
        g = self.geometry
        length = keys.shape[1]
        if length > g.max_block:
            raise ValueError(f"block of {length} rows exceeds max_block {g.max_block}")
        write = mx.array(g.slot_of(np.arange(self.offset, self.offset + length)).astype(np.int32))
        self.keys[:, write, :] = keys
        self.values[:, write, :] = values
        slots, mask = row_layout(g, self.offset, length)
        self.offset += length
        n_kv, _, d = self.keys.shape
        k = self.keys[:, slots, :].reshape(n_kv, length, g.keys_per_row, d).transpose(1, 0, 2, 3)
        v = self.values[:, slots, :].reshape(n_kv, length, g.keys_per_row, d).transpose(1, 0, 2, 3)
        return k, v, mask

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

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage held (fixed at creation: the memory bound)."""
        return self.keys.nbytes + self.values.nbytes
