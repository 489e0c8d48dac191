"""The model as a function of (tokens, cache): one forward path for every step.

Prefill, append, decode and verification all call `forward`: rows run in chunks of at
most `max_block` (a tile size whose matmul bits were probed to be row-invariant), and
attention reads each row's canonical key list from the sink-window cache.
"""

from __future__ import annotations

from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from inference_engine.verifier.kv_cache import CacheGeometry, SinkWindowKVCache


def _attention(layer: nn.Module, x: mx.array, cache: SinkWindowKVCache) -> mx.array:
    """Self-attention of one block over the sink-window key layout.

    Args:
        layer: an mlx-lm llama `Attention` (q/k/v/o projections and rope).
        x: (1, L, hidden) normalized hidden states.
        cache: this layer's cache; receives the L new K/V rows.
    Returns:
        (1, L, hidden) attention output after o_proj.
    """
    _, length, _ = x.shape
    n_heads, n_kv = layer.n_heads, layer.n_kv_heads
    q = layer.q_proj(x).reshape(1, length, n_heads, -1).transpose(0, 2, 1, 3)  # (1, H, L, D)
    k = layer.k_proj(x).reshape(1, length, n_kv, -1).transpose(0, 2, 1, 3)  # (1, n_kv, L, D)
    v = layer.v_proj(x).reshape(1, length, n_kv, -1).transpose(0, 2, 1, 3)  # (1, n_kv, L, D)
    q = layer.rope(q, offset=cache.offset)
    k = layer.rope(k, offset=cache.offset)
    start = cache.offset
    keys, values, mask = cache.update_and_fetch(k[0], v[0])  # (n_kv, S, D) x2, (L, 1, 1, S)
    head_dim = q.shape[-1]
    q = (q[0] * layer.scale).transpose(1, 0, 2).reshape(length, n_kv, n_heads // n_kv, head_dim)  # (L, n_kv, rep, D)
    outs = []
    for lo, hi, extent in _row_groups(cache.geometry, start, length):
        # Broadcast over rows: one small matmul per (row, kv head) over a key prefix that
        # depends on the row's position only, so a row's bits never depend on the block.
        ks, vs = keys[:, :extent, :], values[:, :extent, :]  # (n_kv, E, D)
        scores = q[lo:hi] @ ks.transpose(0, 2, 1)[None]  # (l, n_kv, rep, E)
        scores = mx.where(mask[lo:hi, ..., :extent], scores, mx.array(-mx.inf, dtype=scores.dtype))
        # Row-local softmax from primitives: ~2x faster than mx.softmax on the CPU here.
        weights = mx.exp(scores - mx.max(scores, axis=-1, keepdims=True))
        probs = weights / mx.sum(weights, axis=-1, keepdims=True)
        outs.append(probs @ vs[None])  # (l, n_kv, rep, D)
    out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
    return layer.o_proj(out.reshape(1, length, n_heads * head_dim))


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


def _block(layer: nn.Module, h: mx.array, cache: SinkWindowKVCache) -> mx.array:
    h = h + _attention(layer.self_attn, layer.input_layernorm(h), cache)
    return h + layer.mlp(layer.post_attention_layernorm(h))


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
    for layer, layer_cache in zip(model.model.layers[start:end], cache):
        h = _block(layer, h, layer_cache)
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


def forward(model: nn.Module, tokens: list[int], cache: list[SinkWindowKVCache], all_logits: bool = True) -> mx.array:
    """Compute the tokens not yet in the cache, chunked by the cache's `max_block`.

    Returns:
        (L, V) logits if `all_logits`, else (1, V) for the last token. Evaluated.
    """
    step = cache[0].geometry.max_block
    chunks = []
    for i in range(0, len(tokens), step):
        part = tokens[i : i + step]
        is_last = i + step >= len(tokens)
        out = forward_chunk(model, mx.array(part, dtype=mx.int32), cache, all_logits or is_last)
        if all_logits or is_last:
            chunks.append(out if all_logits else out[-1:])
        mx.eval(out, [c.keys for c in cache], [c.values for c in cache])
    return chunks[0] if len(chunks) == 1 else mx.concatenate(chunks, axis=0)
