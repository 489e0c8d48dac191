"""The model as a function of (tokens, cache): one forward path for every step.

Prefill, append, decode and verification all call `forward`: rows run in chunks of at
most `max_block` (a tile size whose matmul bits were probed to be row-invariant), each
block runs as compiled pieces over fused projections (fused_block.py), and attention
reads each row's canonical key list from the sink-window cache.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from inference_engine.model.fused_block import fused_block
from inference_engine.verifier.kv_cache import CacheGeometry, SinkWindowKVCache


def _block(layer: nn.Module, h: mx.array, cache: SinkWindowKVCache, offset: mx.array) -> mx.array:
    """One transformer block on (1, L, hidden); the cache receives the L new K/V rows.

    `offset` is cache.offset as an array (an input of the compiled pieces, so one trace
    serves every position).
    """
    f = fused_block(layer)
    start, length = cache.offset, h.shape[1]
    q, k, v = f.pre(h, offset, *f.pre_arrays)  # (L, n_kv, rep, D), (n_kv, L, D) x2
    keys, values, mask = cache.update_and_fetch(k, v)  # (n_kv, S, D) x2, (L, 1, 1, S)
    outs = [f.core(q[lo:hi], keys[:, :extent, :], values[:, :extent, :], mask[lo:hi, ..., :extent])
            for lo, hi, extent in _row_groups(cache.geometry, start, length)]
    return f.post(h, outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0), *f.post_arrays)


@lru_cache(maxsize=64)
def _row_groups(geometry: CacheGeometry, start: int, length: int) -> tuple[tuple[int, int, int], ...]:
    """Consecutive rows sharing a key extent: [(row_lo, row_hi, extent), ...]."""
    groups: list[tuple[int, int, int]] = []
    for i in range(length):
        extent = geometry.key_extent(start + i)
        if groups and groups[-1][2] == extent:
            groups[-1] = (groups[-1][0], i + 1, extent)
        else:
            groups.append((i, i + 1, extent))
    return tuple(groups)  # cached: computed once per block, not once per layer


def _lm_head(model: nn.Module, h: mx.array) -> mx.array:
    inner = model.model
    h = inner.norm(h)
    if getattr(model.args, "tie_word_embeddings", True) and not hasattr(model, "lm_head"):
        return inner.embed_tokens.as_linear(h)
    return model.lm_head(h)


def embed(model: nn.Module, tokens: mx.array) -> mx.array:
    """(L,) int32 token ids -> (1, L, hidden) embeddings (the head shard's first step)."""
    return model.model.embed_tokens(tokens[None])


def run_layers(model: nn.Module, h: mx.array, cache: list[SinkWindowKVCache], start: int, end: int) -> mx.array:
    """Run transformer blocks [start, end) on (1, L, hidden); cache[i] belongs to block start+i."""
    if not cache:
        return h
    offset = mx.array(cache[0].offset, dtype=mx.int32)  # every block of a chunk starts at the same position
    for layer, layer_cache in zip(model.model.layers[start:end], cache):
        h = _block(layer, h, layer_cache, offset)
    return h


def lm_head(model: nn.Module, h: mx.array, all_logits: bool) -> mx.array:
    """Final norm + LM head (the tail shard's last step): (1, L, hidden) -> (L or 1, V) fp32."""
    if not all_logits:
        h = h[:, -1:, :]
    return _lm_head(model, h)[0].astype(mx.float32)


def forward_chunk(model: nn.Module, tokens: mx.array, cache: list[SinkWindowKVCache], all_logits: bool) -> mx.array:
    """Run one chunk of at most `max_block` rows through every layer.

    Args:
        model: an mlx-lm llama-family `Model`.
        tokens: (L,) int32 token ids at positions cache[0].offset ...
        cache: one SinkWindowKVCache per layer, advanced by L.
        all_logits: logits for every row, else for the last row only.
    Returns:
        (L, V) or (1, V) float32 logits.
    """
    h = run_layers(model, embed(model, tokens), cache, 0, len(model.model.layers))
    return lm_head(model, h, all_logits)


def forward(
    model: nn.Module, tokens: list[int], cache: list[SinkWindowKVCache], all_logits: bool = True, wait: bool = True
) -> mx.array:
    """Compute the tokens not yet in the cache, chunked by the cache's `max_block`.

    Args:
        wait: evaluate before returning; if False the last chunk is only started
            (`mx.async_eval`) and reading the logits waits for it, so the caller can hand
            out earlier results while it computes (a decode step overlaps its stream write).
    Returns:
        (L, V) logits if `all_logits`, else (1, V) for the last token.
    """
    step = cache[0].geometry.max_block
    chunks = []
    for i in range(0, len(tokens), step):
        part = tokens[i : i + step]
        is_last = i + step >= len(tokens)
        out = forward_chunk(model, mx.array(part, dtype=mx.int32), cache, all_logits or is_last)
        if all_logits or is_last:
            chunks.append(out if all_logits else out[-1:])
        state = (out, [c.keys for c in cache], [c.values for c in cache])
        if wait or not is_last:
            mx.eval(*state)
        else:
            mx.async_eval(*state)
    return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=0)
