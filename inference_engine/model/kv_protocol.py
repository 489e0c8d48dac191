"""The KV cache as the model sees it: a small protocol (mlx-lm's cache, plus row masks).

The model is a function of (tokens, cache); this is all it asks of a cache. The sink-window
cache (`execution/kv_cache.py`) implements it; the model never imports it.
"""

from __future__ import annotations

from typing import Protocol

import mlx.core as mx


class KVCache(Protocol):
    """One layer's K/V storage for one session."""

    offset: int  # positions stored so far (the next row's global position)

    @property
    def max_block(self) -> int:
        """Most rows one `update_and_fetch` may take (the probed tile)."""

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        """The storage arrays (what to evaluate after a chunk)."""

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Store the K/V of the next L positions; return the storage and each row's mask.

        Args:
            keys, values: (n_kv, L, D) of the new rows (keys RoPE-rotated).
        Returns:
            keys (n_kv, S, D), values (n_kv, S, D), mask (L, 1, 1, S) bool.
        """

    def attention_groups(self, start: int, length: int) -> tuple[tuple[int, int, int, mx.array], ...]:
        """Consecutive rows at positions start.. sharing a key extent: ((lo, hi, extent, mask), ...).

        Row i only reads the first `extent` storage slots (a prefix fixed by its position);
        `mask` (hi - lo, 1, 1, extent) bool is those rows' mask cut to it.
        """

    @property
    def layout(self) -> tuple[int, int, int]:
        """(sinks, window, ring): position p < sinks is stored at slot p, later ones at
        sinks + (p - sinks) % ring; a query at p sees the sinks and p - window .. p."""

    def reserve(self, rows: int) -> tuple[mx.array, mx.array]:
        """The K and V storage for an attention kernel that writes the next `rows` positions
        into it in place when it runs (model/native_kernels.py); the offset advances now.

        Raises:
            ValueError: more rows than `max_block`.
        """
