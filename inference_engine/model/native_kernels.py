"""Which block arithmetic a process computes: MLX ops, or native nodes for every session at once.

As MLX ops (`forward._block`'s fallback) a transformer block is ~40 graph nodes, and each
session in a batch adds ~20 more per block for its K/V writes and attention; on the CPU a
step's cost beyond the products is mostly building and dispatching those nodes. The native
kernels (the q4_1 extension, `quant_kernel.py`) make that one node per block:
- `attend` (`native/exact_attention.cpp`): every session's K/V writes and attention rows;
  the norms, RoPE and products stay MLX ops. Needs nothing but the extension.
- `block` (`native/exact_layer.cpp`): the whole block, its products through the exact-gemm
  library (`exact_sgemm_nt` for fp32 rows, `exact_qgemm` for GGUF blocks);
- `matmul` (`native/exact_matmul.cpp`): x @ W.T for fp32 W by the same kernel, for every fp32
  product outside the block (the LM head, linears the block does not compute, the probe), so
  no exact product goes through MLX's matmul and whatever BLAS it resolves (no LD_PRELOAD).
  `block` and `matmul` come together, where the library loads.
A row's bits depend on its position and its session's tokens only (the files say why).

The arithmetic differs from MLX ops' (other summation orders), so the choice is per process
and made once, before the first forward: the launcher's processes (servers, shard workers,
the test run) bind the kernels at start (`quant_kernel.enable_native_kernels`); elsewhere
(Metal, no compiler) blocks stay MLX ops. Binding after a
forward has run is refused, so one process never mixes the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from inference_engine.model.kv_protocol import KVCache


@dataclass(frozen=True)
class NativeKernels:
    """The extension's entry points bound in this process."""

    attend: Callable[..., mx.array]  # (q, k, v, storage, starts, rows, sinks, windows, rings) -> attention rows
    block: Callable[..., mx.array] | None  # (h, weights, storage, ints, floats, starts, ...) -> h'; None: MLX pieces
    matmul: Callable[[mx.array, mx.array], mx.array] | None = None  # (x (..., K), w (N, K)) -> x @ w.T by the
    # exact-gemm kernel: every fp32 product of the model (linears, LM head); None: MLX's matmul


@dataclass(frozen=True)
class BlockPlan:
    """What the native `block` needs of one transformer block (fused_block.py builds it)."""

    weights: tuple[mx.array, ...]  # norm_in, qkv, o_proj, norm_post, gate_up, down_proj, then the family's extras
    # (q/k/v bias, q norm, k norm, attention and MLP output norms, RoPE inverse frequencies: those it has)
    ints: tuple[int, ...]  # n_heads, n_kv, head_dim, hidden, inter, rope dims, rope traditional, 4 formats,
    # 5 family flags (qkv_bias, qk_norm, sandwich, gelu, inv_freq_table)
    floats: tuple[float, ...]  # eps_in, eps_post, scale, rope base, rope scale


_bound: NativeKernels | None = None
_decided = False  # a forward has asked which arithmetic to use: the choice is fixed


def bind(kernels: NativeKernels) -> None:
    """Compute blocks with `kernels` in this process from now on.

    Raises:
        RuntimeError: a forward already ran with other arithmetic in this process.
    """
    global _bound
    if _bound == kernels:
        return
    if _decided:
        raise RuntimeError("the native kernels must be bound before this process's first forward")
    _bound = kernels


def is_bound() -> bool:
    """Native kernels compute this process's blocks."""
    return _bound is not None


def bound() -> NativeKernels | None:
    """The bound kernels, without fixing the choice (for reports)."""
    return _bound


def exact_matmul() -> Callable[[mx.array, mx.array], mx.array] | None:
    """The bound fp32 product primitive (None: MLX's matmul); fixes the choice for this process, like `active`."""
    kernels = active()
    return None if kernels is None else kernels.matmul


def active() -> NativeKernels | None:
    """The bound kernels, or None for MLX ops; fixes the choice for this process."""
    global _decided
    _decided = True
    return _bound


def _segments(caches: Sequence[KVCache], rows: Sequence[int]) -> list[list[int]]:
    """starts, rows, sinks, windows, rings of the segments; each cache reserves its rows."""
    layouts = [c.layout for c in caches]
    starts = [c.offset for c in caches]
    for c, n in zip(caches, rows):
        c.reserve(n)
    return [starts, list(rows), *([lay[i] for lay in layouts] for i in range(3))]


def _storage(caches: Sequence[KVCache]) -> list[mx.array]:
    return [a for c in caches for a in c.state]


def attend(kernels: NativeKernels, q: mx.array, k: mx.array, v: mx.array, caches: Sequence[KVCache],
           rows: Sequence[int]) -> mx.array:
    """One block's attention for consecutive segments of rows, each with its session's cache.

    Args:
        q: (R, n_kv, rep, D) scaled, rotated queries; k, v: (n_kv, R, D) the rows' keys and values.
        caches: the block's cache of each segment, at the segment's first position; each
            reserves the segment's rows (its storage receives them when the node runs).
        rows: rows of each segment (sum R).
    Returns:
        (R, n_kv, rep, D) attention outputs.
    """
    storage = _storage(caches)
    return kernels.attend(q, k, v, storage, *_segments(caches, rows))


def block(kernels: NativeKernels, plan: BlockPlan, h: mx.array, caches: Sequence[KVCache],
          rows: Sequence[int]) -> mx.array:
    """A whole transformer block on (1, R, hidden) for consecutive segments of rows (as `attend`)."""
    assert kernels.block is not None
    storage = _storage(caches)
    return kernels.block(h, list(plan.weights), storage, list(plan.ints), list(plan.floats), *_segments(caches, rows))
