"""Which attention a process computes: MLX ops, or one native node per layer for every session.

As MLX ops (`forward._block`'s fallback) each session in a batch adds ~20 graph nodes per
layer, and on the CPU a batched step's cost is mostly building and dispatching those nodes.
The native kernel (`native/exact_attention.cpp`, in the q4_1 kernel's extension) writes
every session's new K/V rows and computes every row's attention as one node per layer; its
bits depend on a row's position and its session's tokens only (the file says why).

The two give different bits (different summation orders), so the choice is per process and
made once, before the first forward: the Linux launcher's processes (servers, shard workers,
the test run) bind the kernel at start (`quant_kernel.enable_exact_attention`); everywhere
else (macOS, a process not started through the launcher) attention stays MLX ops. Binding
after a forward has run is refused, so one process never mixes the two.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from inference_engine.model.kv_protocol import KVCache

Attend = Callable[..., mx.array]  # the extension's `attend`
_bound: Attend | None = None
_decided = False  # a forward has asked which attention to use: the choice is fixed


def bind(attend: Attend) -> None:
    """Compute attention with `attend` in this process from now on.

    Raises:
        RuntimeError: a forward already ran with another attention in this process.
    """
    global _bound
    if _bound is attend:
        return
    if _decided:
        raise RuntimeError("the native attention kernel must be bound before this process's first forward")
    _bound = attend


def is_bound() -> bool:
    """The native kernel computes this process's attention."""
    return _bound is not None


def active() -> Attend | None:
    """The bound kernel, or None for MLX ops; fixes the choice for this process."""
    global _decided
    _decided = True
    return _bound


def attend(kernel: Attend, q: mx.array, k: mx.array, v: mx.array, caches: Sequence[KVCache],
           rows: Sequence[int]) -> mx.array:
    """One layer's attention for consecutive segments of rows, each with its session's cache.

    Args:
        q: (R, n_kv, rep, D) scaled, rotated queries; k, v: (n_kv, R, D) the rows' keys and values.
        caches: the layer's cache of each segment, at the segment's first position; each
            reserves the segment's rows (its storage receives them when the node runs).
        rows: rows of each segment (sum R).
    Returns:
        (R, n_kv, rep, D) attention outputs.
    """
    layouts = [c.layout for c in caches]
    storage = [a for c, n in zip(caches, rows) for a in c.reserve(n)]  # offsets advance: read them first
    starts = [c.offset - n for c, n in zip(caches, rows)]
    return kernel(q, k, v, storage, starts, list(rows), [lay[0] for lay in layouts], [lay[1] for lay in layouts],
                  [lay[2] for lay in layouts])
