"""Executors: where a verifier's layers run and its K/V lives.

The verifier keeps the session's bookkeeping (pending block, tokens, logits); the executor
computes blocks into the K/V, trims it and digests it. `LocalExecutor` runs the whole
model in this process; `inference_engine.shard.remote_executor.RemoteExecutor` runs it on
a route of shard workers. The coordinator never knows which one it has (STYLE rule 9).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import mlx.core as mx
import mlx.nn as nn

from inference_engine.model.forward import forward
from inference_engine.verifier.kv_cache import CacheGeometry, SinkWindowKVCache


class Executor(ABC):
    """Computes one session's blocks through every layer, over K/V it owns."""

    geometry: CacheGeometry  # the session's cache geometry (identical wherever it runs)

    @property
    @abstractmethod
    def offset(self) -> int:
        """Positions computed into the K/V, including a block not yet committed."""

    @abstractmethod
    def forward(self, tokens: list[int], all_logits: bool, wait: bool = True) -> mx.array:
        """Compute `tokens` at positions offset.. into the K/V through every layer.

        Args:
            wait: False lets the result be returned while it is still computing
                (reading it waits); an executor may ignore it and always finish first.
        Returns:
            (L, V) float32 logits, or (1, V) for the last row only; row i predicts the
            token after tokens[i]. Bits equal to `model.forward.forward` over one process.
        Raises:
            RuntimeServiceError: the block could not be computed; the K/V is unchanged.
        """

    @abstractmethod
    def trim(self, n: int) -> None:
        """Drop the last `n` positions (0 <= n <= min(max_rollback, offset)). Never half-applied."""

    @abstractmethod
    def layer_digests(self) -> list[bytes]:
        """SHA-256 of each layer's canonical K/V, in layer order (see SinkWindowKVCache.digest)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of K/V storage the session holds, wherever it lives (fixed by the geometry)."""


class LocalExecutor(Executor):
    """The whole model in this process over one SinkWindowKVCache per layer."""

    def __init__(self, model: nn.Module, geometry: CacheGeometry, num_kv_heads: int, head_dim: int, num_layers: int):
        self.model = model
        self.geometry = geometry
        self.cache = [SinkWindowKVCache(geometry, num_kv_heads, head_dim) for _ in range(num_layers)]

    @property
    def offset(self) -> int:
        return self.cache[0].offset

    def forward(self, tokens: list[int], all_logits: bool, wait: bool = True) -> mx.array:
        return forward(self.model, tokens, self.cache, all_logits=all_logits, wait=wait)

    def trim(self, n: int) -> None:
        for c in self.cache:
            c.trim(n)

    def layer_digests(self) -> list[bytes]:
        return [c.digest() for c in self.cache]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)
