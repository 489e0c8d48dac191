"""A sliding-window layer's K/V (Gemma 3's local layers), seen through the session's canonical layout.

A local layer attends to the model's last `window` positions (itself included), and never
beyond the session's own window: its keys at position p are p - w .. p with
w = min(window - 1, session window), no sinks. Its storage is a `SinkWindowKVCache` of that
smaller geometry (sink 0, ring w + max_block + max_rollback), so its masks, in-place native
writes and rollback slack work exactly as a global layer's, bounded by the model's window.

The positions it keeps are always a subset of the session's retained ones (sinks, then the
window), so its canonical state is written in the session's layout, zeros where it keeps
nothing: every layer's canonical K/V has one shape, and snapshots, forks, digests and shard
transfers carry sliding layers unchanged.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import mlx.core as mx
import numpy as np

from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache, layer_digest, zeroed_storage


def layer_geometry(geometry: CacheGeometry, window: int | None) -> CacheGeometry:
    """The storage geometry of a layer: the session's for a global layer (window None), else the
    layer's last min(window - 1, session window) positions and no sinks."""
    if window is None:
        return geometry
    return dataclasses.replace(geometry, sink=0, window=max(0, min(window - 1, geometry.window)))


class SlidingKVCache(SinkWindowKVCache):
    """One sliding-window layer's K/V for one session (the KVCache protocol of its storage geometry)."""

    def __init__(self, geometry: CacheGeometry, window: int, num_kv_heads: int, head_dim: int,
                 dtype: mx.Dtype = mx.float32, storage: tuple[mx.array, mx.array] | None = None):
        """
        Args:
            geometry: the session's geometry (its canonical layout).
            window: the model's sliding window for this layer (keys a query sees, itself included).
            storage: zeroed K and V of `layer_geometry(geometry, window)` (allocated here if None).
        """
        super().__init__(layer_geometry(geometry, window), num_kv_heads, head_dim, dtype, storage)
        self.session_geometry = geometry

    def _canonical_index(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """For the session's retained positions at `offset`: which ones this layer keeps, and their slots."""
        pos = np.array(self.session_geometry.visible_positions(offset)[:-1] if offset else [], dtype=np.int64)
        kept = pos >= offset - self.geometry.window
        return kept, self.geometry.slot_of(pos[kept])

    def retained_positions(self) -> list[int]:
        """The session's retained positions (this layer's canonical layout)."""
        return self.session_geometry.visible_positions(self.offset)[:-1] if self.offset else []

    def canonical_state(self) -> tuple[mx.array, mx.array]:
        """K/V of the session's retained positions in order, zeros where this layer keeps nothing."""
        kept, slots = self._canonical_index(self.offset)
        out = []
        for a in (self.keys, self.values):
            full = mx.zeros((a.shape[0], len(kept), a.shape[2]), dtype=a.dtype)
            if kept.any():
                full[:, mx.array(np.flatnonzero(kept).astype(np.int32)), :] = a[:, mx.array(slots.astype(np.int32)), :]
            out.append(full)
        return out[0], out[1]

    def digest(self) -> bytes:
        k, v = self.canonical_state()
        return layer_digest(np.array(k), np.array(v))

    def load_canonical(self, offset: int, keys: np.ndarray, values: np.ndarray) -> None:
        """Put a canonical state (the session's layout) back; only the positions this layer keeps are read.

        Raises:
            ValueError: the cache is not fresh, or the arrays do not fit.
        """
        kept, slots = self._canonical_index(offset)
        self._check_loadable(offset, len(kept), keys, values)
        if kept.any():
            idx = mx.array(slots.astype(np.int32))
            self.keys[:, idx, :] = mx.array(keys[:, kept])
            self.values[:, idx, :] = mx.array(values[:, kept])
            mx.eval(self.keys, self.values)
        self.offset = offset


def layer_storage(geometry: CacheGeometry, spec: Any, dtype: mx.Dtype = mx.float32) -> list[tuple[mx.array, mx.array]]:
    """Every layer's zeroed K and V for a session of `geometry` on a model of `spec` (a ModelSpec)."""
    return [zeroed_storage(layer_geometry(geometry, spec.window_of(i)), spec.num_kv_heads, spec.head_dim, dtype)
            for i in range(spec.num_layers)]


def layer_cache(geometry: CacheGeometry, spec: Any, layer: int,
                storage: tuple[mx.array, mx.array] | None = None) -> SinkWindowKVCache:
    """Layer `layer`'s cache for a session of `geometry` on a model of `spec`: sliding or global."""
    window = spec.window_of(layer)
    if window is None:
        return SinkWindowKVCache(geometry, spec.num_kv_heads, spec.head_dim, storage=storage)
    return SlidingKVCache(geometry, window, spec.num_kv_heads, spec.head_dim, storage=storage)


def session_slab_bytes(geometry: CacheGeometry, spec: Any, layers: range | None = None, itemsize: int = 4) -> int:
    """Bytes of K and V a session of `geometry` holds for `layers` (default: all) of a model of `spec`."""
    layers = layers if layers is not None else range(spec.num_layers)
    return sum(2 * spec.num_kv_heads * layer_geometry(geometry, spec.window_of(i)).slots * spec.head_dim * itemsize
               for i in layers)
