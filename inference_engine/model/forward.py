"""The model as a function of (tokens, cache): one forward path for every step.

Prefill, append, decode and verification all run `forward_rows`: the rows of one or more
sessions (segments) go through the transformer blocks together, so each weight is read
once for all of them, while attention reads each row's own session cache. A row's bits
never depend on its companions: every matmul is row-invariant for blocks up to the probed
tile (execution/tile_probe.py), RoPE takes each row's own global position, and attention
is per (row, KV head) over keys fixed by the row's position: MLX ops per session
(kv_protocol.py), or native nodes for all sessions at once (native_kernels.py).

`forward` is the one chunk loop (blocks of at most `max_block` rows) for a single
session, used by the local executor and by shard workers running a layer range.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn

from inference_engine.model import native_kernels
from inference_engine.model.families import Family, family_of_model
from inference_engine.model.fused_block import fused_block, head_logits
from inference_engine.model.kv_protocol import KVCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Span:
    """Which part of the model a forward runs: blocks [start, end), with or without the ends."""

    start: int  # first transformer block
    end: int  # one past the last block
    embeds: bool  # input is token ids (the head); else hidden states
    has_lm_head: bool  # output is logits (the tail); else hidden states

    @classmethod
    def whole(cls, model: nn.Module) -> "Span":
        """Every block, token ids in, logits out."""
        return cls(0, len(model.model.layers), True, True)


@dataclass(frozen=True)
class Segment:
    """One session's consecutive rows in a forward."""

    caches: Sequence[KVCache]  # one per block of the span, each advanced by `rows`
    rows: int  # rows of this session (>= 1)
    all_logits: bool  # logits of every row (verification), else of the last row only


def _block(layer: nn.Module, family: Family, h: mx.array, positions: mx.array, segments: Sequence[Segment], i: int,
           native: native_kernels.NativeKernels | None) -> mx.array:
    """Transformer block `i` of the span on (1, R, hidden); each segment's cache gets its rows' K/V."""
    f = fused_block(layer, family)
    if native is not None:
        caches, rows = [s.caches[i] for s in segments], [s.rows for s in segments]
        if native.block is not None and f.plan is not None:  # the whole block: one node
            return native_kernels.block(native, f.plan, h, caches, rows)
        if native.block is not None:
            _log_mlx_ops(layer, family, f.not_native)
        q, k, v = f.pre(h, positions, *f.pre_arrays)  # every segment's writes and attention: one node
        return f.post(h, native_kernels.attend(native, q, k, v, caches, rows), *f.post_arrays)
    q, k, v = f.pre(h, positions, *f.pre_arrays)  # (R, n_kv, rep, D), (n_kv, R, D) x2
    outs, lo = [], 0
    for seg in segments:
        cache, hi = seg.caches[i], lo + seg.rows
        start = cache.offset
        keys, values, _ = cache.update_and_fetch(k[:, lo:hi], v[:, lo:hi])  # (n_kv, S, D) x2
        for a, b, extent, mask in cache.attention_groups(start, seg.rows):  # mask (b - a, 1, 1, extent)
            outs.append(f.core(q[lo + a : lo + b], keys[:, :extent, :], values[:, :extent, :], mask))
        lo = hi
    return f.post(h, outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0), *f.post_arrays)


def _log_mlx_ops(layer: nn.Module, family: Family, why: str) -> None:
    """Say once per block that the native block kernel does not compute it (never silent)."""
    if not layer.__dict__.get("_logged_mlx_ops"):
        layer.__dict__["_logged_mlx_ops"] = True
        log.info("a %s block runs as MLX ops with native attention (exact; the native block lacks %s)",
                 family.model_type, why)


def _embed(model: nn.Module, family: Family, x: mx.array) -> mx.array:
    h = model.model.embed_tokens(x[None])  # (1, R, hidden)
    scale = family.embedding_scale(model.args)
    return h if scale is None else h * scale


def _lm_head(model: nn.Module, family: Family, h: mx.array) -> mx.array:
    inner = model.model
    norm = inner.norm
    weight = model.__dict__.get("_head_norm")
    if weight is None:  # the effective weight, once (a plain attribute, not a parameter)
        weight = model.__dict__["_head_norm"] = family.norm_weight(norm, bool(model.__dict__.get("_norms_effective")))
    h = mx.fast.rms_norm(h, weight, norm.eps)
    logits = head_logits(model, h)  # tied (mlx-lm drops lm_head): the embedding's rows
    cap = family.logit_softcap(model.args)
    return logits if cap is None else mx.tanh(logits / cap) * cap


def _logit_rows(segments: Sequence[Segment]) -> list[int] | None:
    """Rows whose logits are wanted, or None for all of them."""
    if all(s.all_logits for s in segments):
        return None
    rows, lo = [], 0
    for s in segments:
        rows.extend(range(lo, lo + s.rows) if s.all_logits else [lo + s.rows - 1])
        lo += s.rows
    return rows


def forward_rows(model: nn.Module, x: mx.array, segments: Sequence[Segment], span: Span) -> mx.array:
    """Run the rows of every segment through the span's blocks together (lazily; nothing evaluated).

    Args:
        model: an mlx-lm `Model` of a family in `families` (its adapter says what the blocks do).
        x: (R,) int32 token ids if `span.embeds`, else (1, R, hidden) hidden states; the
            segments' rows in order, R = sum of their rows (at most the caches' max_block).
        segments: whose rows these are; their caches are at the rows' first positions.
        span: the blocks to run and whether they embed / end with the LM head.
    Returns:
        With the LM head, (N, V) float32 logits of the wanted rows in order (every row of an
        `all_logits` segment, the last row of the others); else (1, R, hidden).
    """
    family = family_of_model(model)
    h = _embed(model, family, x) if span.embeds else x  # (1, R, hidden)
    layers = model.model.layers[span.start : span.end]
    if layers:
        starts = [s.caches[0].offset for s in segments]
        positions = mx.array([p for s, a in zip(segments, starts) for p in range(a, a + s.rows)], dtype=mx.int32)  # (R,)
        native = native_kernels.active()
        for i, layer in enumerate(layers):
            h = _block(layer, family, h, positions, segments, i, native)
    if not span.has_lm_head:
        return h
    wanted = _logit_rows(segments)
    if wanted is not None:
        h = h[:, mx.array(wanted, dtype=mx.int32)] if len(wanted) > 1 or wanted[0] != h.shape[1] - 1 else h[:, -1:]
    return _lm_head(model, family, h)[0].astype(mx.float32)


def forward(
    model: nn.Module, x: Sequence[int] | mx.array, cache: Sequence[KVCache], all_logits: bool = True,
    wait: bool = True, span: Span | None = None, before_chunk: Callable[[int], None] | None = None,
) -> mx.array:
    """Compute one session's block, chunked at the cache's `max_block` (the one chunk loop).

    Args:
        x: the block's token ids (head), or (L, hidden) hidden states from the previous worker.
        cache: one cache per block of the span.
        all_logits: logits of every row, else of the last row only (tail spans).
        wait: evaluate before returning; if False the last chunk is only started
            (`mx.async_eval`) and reading the result waits for it, so the caller can hand out
            earlier results while it computes (a decode step overlaps its stream write).
        span: the part of the model to run (default: all of it).
        before_chunk: called with the row offset before each chunk (a worker's cancel check;
            it may raise to stop).
    Returns:
        (L, V) or (1, V) float32 logits with the LM head; else (L, hidden).
    """
    span = span or Span.whole(model)
    rows = len(x)
    step = cache[0].max_block if cache else rows
    outs = []
    for lo in range(0, rows, step):
        if before_chunk is not None:
            before_chunk(lo)
        hi = min(rows, lo + step)
        is_last = hi == rows
        part = mx.array(x[lo:hi], dtype=mx.int32) if span.embeds else mx.array(x[lo:hi])[None]
        wanted = all_logits or is_last or not span.has_lm_head  # no LM head for rows nobody reads
        chunk_span = span if wanted else replace(span, has_lm_head=False)
        out = forward_rows(model, part, [Segment(cache, hi - lo, all_logits)], chunk_span)
        if not span.has_lm_head:
            out = out[0]  # (l, hidden)
        if wanted:
            outs.append(out)
        state = (out, [c.state for c in cache])
        if wait or not is_last:
            mx.eval(*state)
        else:
            mx.async_eval(*state)
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
