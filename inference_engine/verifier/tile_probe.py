"""Start-up probe: which block sizes give row-invariant matmul bits on this BLAS and CPU.

A row's bits must not depend on how many rows share its matmul nor on where it sits
among them. For each distinct linear of the model (and the LM head) and each block size
M, every row of an M-row block is compared bitwise with the same row computed alone.

The rows of a block are drawn (with repeats) from a few random vectors, so single-row
references cost a few calls, not one per position: a BLAS's bits depend on a row's
values, the block size and the row's position, never on the values of its neighbours,
and every position still holds a random row. The block sizes of one shape are evaluated
as one lazy graph in groups, each reduced to one equal/unequal flag.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model.fused_block import fused_linears


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the tile probe."""

    tile: int  # largest M such that every block size 1..M is row-invariant (0: none)
    max_candidate: int  # largest M tried
    failures: tuple[str, ...]  # "shape MxK@N: M=.. row .." descriptions of failed sizes
    shapes: tuple[tuple[int, int], ...]  # (in, out) of the probed linears

    @property
    def is_exact_possible(self) -> bool:
        """At least single-row execution is deterministic."""
        return self.tile >= 1


def _linears(model: nn.Module) -> dict[tuple[int, int], nn.Module]:
    """One linear per distinct (in, out) shape, plus the LM head."""
    found: dict[tuple[int, int], nn.Module] = {}
    for _, module in nn.utils.tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            out_dim, in_dim = module.weight.shape[0], _in_dim(module)
            found.setdefault((in_dim, out_dim), module)
    return found


def _in_dim(module: nn.Module) -> int:
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[1] * 32 // module.bits
    return module.weight.shape[1]


def probe_tile(
    model: nn.Module, max_candidate: int = 64, trials: int = 1, seed: int = 0, distinct: int = 8
) -> ProbeResult:
    """Find the largest tile M such that every block size 1..M is row-invariant.

    Args:
        model: the mlx-lm model whose linears (and LM head) will run in blocks.
        max_candidate: largest block size to try.
        trials: random draws per shape (each fills every position from `distinct` vectors).
        distinct: random vectors per draw that fill the block's rows.
    Returns:
        ProbeResult; `tile` 0 means even single rows are not repeatable.
    """
    rng = np.random.default_rng(seed)
    linears = _linears(model)
    for fused in fused_linears(model):  # the projections forward actually runs
        linears.setdefault((_in_dim(fused), fused.weight.shape[0]), fused)
    fns = {shape: (lambda x, m=m: m(x)) for shape, m in linears.items()}
    embed = model.model.embed_tokens
    hidden = embed.weight.shape[1] if not isinstance(embed, nn.QuantizedEmbedding) else embed.dims
    fns[(hidden, model.args.vocab_size)] = lambda x: embed.as_linear(x)
    failures: list[str] = []
    tile = max_candidate
    for (in_dim, out_dim), fn in sorted(fns.items()):
        for _ in range(trials):
            failure, tile = first_variant_size(fn, in_dim, tile, rng, distinct)
            if failure:
                failures.append(f"{in_dim}->{out_dim}: {failure}")
    return ProbeResult(tile=tile, max_candidate=max_candidate, failures=tuple(failures), shapes=tuple(sorted(fns)))


def first_variant_size(
    fn, in_dim: int, max_size: int, rng: np.random.Generator, distinct: int = 8, group: int = 16
) -> tuple[str, int]:
    """Check block sizes 1..max_size of `fn` on one random draw.

    Args:
        fn: (1, M, in_dim) -> (1, M, out) fp32, the linear under test.
        max_size: largest block size to check.
        distinct: random vectors drawn into the block's rows.
        group: block sizes evaluated per graph (checking stops after a failing group).
    Returns:
        ("", max_size) if every size passed, else (what failed, largest M such that all of
        1..M passed; 0 if single rows are not repeatable).
    """
    base = mx.array(rng.standard_normal((distinct, in_dim)).astype(np.float32))
    which = rng.permutation(np.resize(np.arange(distinct), max(max_size, distinct)))[:max_size]
    x = base[mx.array(which)][None]  # (1, max_size, in): every vector at many positions
    singles = mx.concatenate([fn(base[None, d : d + 1])[0] for d in range(distinct)])  # (distinct, out)
    expected = singles[mx.array(which)]  # (max_size, out): the bits each position must give
    if not np.array_equal(np.array(fn(base[None, 0:1])[0, 0]), np.array(singles[0])):
        return "single row not repeatable", 0
    for lo in range(2, max_size + 1, group):
        sizes = range(lo, min(lo + group, max_size + 1))
        same = np.array(mx.stack([mx.array_equal(fn(x[:, :m])[0], expected[:m]) for m in sizes]))
        if not same.all():
            m = sizes[int(np.argmin(same))]
            bad = np.flatnonzero([not np.array_equal(r, e) for r, e in zip(np.array(fn(x[:, :m])[0]), np.array(expected[:m]))])
            return f"M={m} rows {bad[:4].tolist()} differ from M=1", m - 1
    return "", max_size
