"""Helpers for exactness batteries: feed tokens in a chunking, return the state digest."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from inference_engine.runtime.engine import Engine
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier


def rows_variant(block):
    """TEST FIXTURE: forward's `_block` made to depend on the forward's row count, as a BLAS that hands calls of
    more than 64 rows to another kernel (OpenBLAS behind the old interposer): block 0 leaves those rows with
    their first hidden value's lowest bit flipped (monkeypatch it over inference_engine.model.forward._block)."""

    def variant(layer, family, h, positions, segments, i, native):
        out = block(layer, family, h, positions, segments, i, native)  # (1, R, hidden)
        if i != 0 or out.shape[1] <= 64:
            return out
        first = (mx.arange(out.shape[-1]) == 0).astype(mx.uint32)  # (hidden,)
        return mx.view(mx.view(out, mx.uint32) ^ first, mx.float32)

    return variant


def chunkings(n: int, seeds: range = range(4)) -> dict[str, list[int]]:
    """Named chunk-size lists that each sum to n: 1xN, Nx1, 15x2-style, uneven, seeded random."""
    out = {"1xN": [n], "Nx1": [1] * n, "pairs": [2] * (n // 2) + [1] * (n % 2)}
    q = n // 4
    out["4 uneven"] = [q - 3, q + 5, q - 1, n - (3 * q + 1)]
    for s in seeds:
        rng = np.random.default_rng(s)
        sizes, left = [], n
        while left:
            sizes.append(int(min(left, rng.integers(1, 20))))
            left -= sizes[-1]
        out[f"random{s}"] = sizes
    return out


def feed(engine: Engine, tokens: list[int], sizes: list[int], sink: int, window: int) -> SinkWindowVerifier:
    """A fresh verifier fed the first sum(sizes) `tokens` in chunks of `sizes`."""
    v = engine.make_verifier(sink, window)
    i = 0
    for n in sizes:
        block = tokens[i : i + n]
        if i == 0:
            v.prefill(block)
        else:
            v.forward_block(block)
            v.commit_or_truncate(len(block), len(block))
        i += n
    return v
