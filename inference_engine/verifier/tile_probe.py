"""Start-up probe: which block sizes give row-invariant matmul bits on this BLAS and CPU.

A row's bits must not depend on how many rows share its matmul nor on where it sits
among them. For each distinct linear of the model (and the LM head) and each block size
M, random rows are compared bitwise with the same rows computed one at a time.
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


def probe_tile(model: nn.Module, max_candidate: int = 16, trials: int = 2, seed: int = 0) -> ProbeResult:
    """Find the largest tile M such that every block size 1..M is row-invariant.

    Args:
        model: the mlx-lm model whose linears (and LM head) will run in blocks.
        max_candidate: largest block size to try.
        trials: random draws per size.
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
            x = mx.array(rng.standard_normal((max_candidate, in_dim)).astype(np.float32))
            singles = [np.array(fn(x[None, i : i + 1])[0, 0]) for i in range(max_candidate)]
            again = np.array(fn(x[None, 0:1])[0, 0])
            if not np.array_equal(again, singles[0]):
                failures.append(f"{in_dim}->{out_dim}: single row not repeatable")
                tile = 0
            for m in range(2, tile + 1):
                block = np.array(fn(x[None, :m])[0])  # (m, out)
                bad = [i for i in range(m) if not np.array_equal(block[i], singles[i])]
                if bad:
                    failures.append(f"{in_dim}->{out_dim}: M={m} rows {bad[:4]} differ from M=1")
                    tile = m - 1
                    break
    return ProbeResult(tile=tile, max_candidate=max_candidate, failures=tuple(failures), shapes=tuple(sorted(fns)))
