"""Start-up probe: which block sizes give row-invariant matmul bits on this BLAS and CPU.

A row's bits must not depend on how many rows share its matmul nor on where it sits
among them. For each distinct linear of the model (and the LM head) and each block size
M, every row of an M-row block is compared bitwise with the same row computed alone.

The rows of a block are drawn (with repeats) from a few random vectors, so single-row
references cost a few calls, not one per position: a BLAS's bits depend on a row's
values, the block size and the row's position, never on the values of its neighbours,
and every position still holds a random row. The block sizes of one shape are evaluated
as one lazy graph in groups, each reduced to one equal/unequal flag.

Linears stored as GGUF blocks (model/gguf_blocks.py) are also checked against the fp32
kernel, once per (shape, ggml type) the model serves, so every tensor type of a GGUF file is:
a block of rows through the quantized kernel must give bitwise the rows of the fp32 product
with gguf-py's dequantized weights. With both kernels row-invariant (the probe
above, and the fp32 kernel by construction), that makes them equal at every block size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from inference_engine.model import native_kernels
from inference_engine.model.fused_block import apply_linear, fused_linears, head_logits, linear_arrays, linear_kind
from inference_engine.model.gguf_blocks import FORMAT_NAMES, BlockEmbedding, BlockLinear, dequantize_blocks

REFERENCE_ROWS = 8192  # weight rows dequantized at a time for the fp32 reference (bounds its memory)
REFERENCE_BLOCK = 64  # rows of the fp32 comparison: the exact-gemm kernel computes up to 64 rows itself


@dataclass(frozen=True)
class ProbeResult:
    """Outcome of the tile probe."""

    tile: int  # largest M such that every block size 1..M is row-invariant (0: none)
    max_candidate: int  # largest M tried
    failures: tuple[str, ...]  # "shape MxK@N: M=.. row .." descriptions of failed sizes
    shapes: tuple[tuple[int, int], ...]  # (in, out) of the probed linears
    mismatches: tuple[str, ...] = ()  # block-stored shapes whose rows differ from the fp32 kernel's
    block_shapes: tuple[tuple[int, int], ...] = ()  # (in, out) of the shapes checked against fp32

    @property
    def is_exact_possible(self) -> bool:
        """At least single-row execution is deterministic."""
        return self.tile >= 1

    @property
    def is_fp32_equal(self) -> bool:
        """Every block-stored linear gives bitwise the fp32 kernel's rows (vacuously true for fp32 models)."""
        return not self.mismatches


def _linears(model: nn.Module) -> dict[tuple[int, int], nn.Module]:
    """One linear per distinct (in, out) shape, plus the LM head."""
    found: dict[tuple[int, int], nn.Module] = {}
    for _, module in nn.utils.tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
        if isinstance(module, (nn.Linear, nn.QuantizedLinear, BlockLinear)):
            found.setdefault((_in_dim(module), _out_dim(module)), module)
    return found


def _in_dim(module: nn.Module) -> int:
    if isinstance(module, BlockLinear):
        return module.in_features
    if isinstance(module, nn.QuantizedLinear):
        return module.weight.shape[1] * 32 // module.bits
    return module.weight.shape[1]


def _out_dim(module: nn.Module) -> int:
    return module.out_features if isinstance(module, BlockLinear) else module.weight.shape[0]


def _fp32_reference(module: BlockLinear | BlockEmbedding):
    """x @ W.T by the fp32 kernel, W dequantized by the converter's code in slices of rows.

    Each output column is its own dot product, so slicing W's rows cannot change its bits.
    """
    blocks = np.array(module.blocks)
    matmul = native_kernels.exact_matmul()  # the fp32 kernel: the exact primitive where bound

    def reference(x: mx.array) -> mx.array:
        parts = []
        for lo in range(0, blocks.shape[0], REFERENCE_ROWS):
            w = mx.array(dequantize_blocks(blocks[lo : lo + REFERENCE_ROWS], module.fmt))  # (rows, in)
            parts.append(x @ w.T if matmul is None else matmul(x, w))
            mx.eval(parts[-1])  # one slice of fp32 weights alive at a time
        y = mx.concatenate(parts, axis=-1)
        return y + module["bias"] if "bias" in module else y  # a block linear's bias, added as it adds it

    return reference


def fp32_mismatch(fn, reference, in_dim: int, rows: int, rng: np.random.Generator) -> str:
    """Compare a block of `rows` random rows (and its first row alone) through `fn` and `reference`.

    Returns:
        "" if every row is bitwise equal, else which rows differ.
    """
    x = mx.array(rng.standard_normal((1, rows, in_dim)).astype(np.float32))
    expected = np.array(reference(x)[0])  # (rows, out)
    got = np.array(fn(x)[0])
    bad = [i for i in range(rows) if not np.array_equal(got[i], expected[i])]
    if not np.array_equal(np.array(fn(x[:, :1])[0, 0]), expected[0]):
        bad = [-1, *bad]  # -1: the row alone
    return f"M={rows} rows {bad[:4]} differ from the fp32 kernel" if bad else ""


def _products(model: nn.Module) -> dict[tuple[int, int], Callable[[mx.array], mx.array]]:
    """Every product the forward runs, by (in, out) shape, computed as the forward computes it
    (apply_linear: the exact primitive for fp32 where bound), the LM head included."""
    linears = _linears(model)
    for fused in fused_linears(model):  # the projections forward actually runs
        linears.setdefault((_in_dim(fused), _out_dim(fused)), fused)
    fns = {shape: (lambda x, m=m: apply_linear(linear_kind(m), x, linear_arrays(m))) for shape, m in linears.items()}
    embed = model.model.embed_tokens
    hidden = embed.dims if isinstance(embed, (nn.QuantizedEmbedding, BlockEmbedding)) else embed.weight.shape[1]
    fns[(hidden, model.args.vocab_size)] = lambda x: head_logits(model, x)
    return fns


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
    fns = _products(model)
    failures: list[str] = []
    tile = max_candidate
    for (in_dim, out_dim), fn in sorted(fns.items()):
        for _ in range(trials):
            failure, tile = first_variant_size(fn, in_dim, tile, rng, distinct)
            if failure:
                failures.append(f"{in_dim}->{out_dim}: {failure}")
    blocked = _block_stored(model)
    mismatches = fp32_mismatches(model, min(max_candidate, REFERENCE_BLOCK), rng)
    return ProbeResult(tile=tile, max_candidate=max_candidate, failures=tuple(failures), shapes=tuple(sorted(fns)),
                       mismatches=mismatches, block_shapes=tuple(sorted({(i, o) for i, o, _ in blocked})))


def _block_stored(model: nn.Module) -> dict[tuple[int, int, int], BlockLinear | BlockEmbedding]:
    """One block-stored linear per distinct (in, out, ggml type), over every layer (fused ones included),
    and the embedding if it is blocks: every tensor type the model serves is checked, not only one per shape."""
    found: dict[tuple[int, int, int], BlockLinear | BlockEmbedding] = {}
    modules = nn.utils.tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
    modules = [m for _, m in modules if isinstance(m, BlockLinear)]  # in _linears' order
    for m in [*fused_linears(model), *modules]:
        if isinstance(m, BlockLinear):
            found.setdefault((m.in_features, m.out_features, m.fmt), m)
    embed = model.model.embed_tokens
    if isinstance(embed, BlockEmbedding):
        found[(embed.dims, model.args.vocab_size, embed.fmt)] = embed
    return found


def fp32_mismatches(model: nn.Module, rows: int = REFERENCE_BLOCK, rng: np.random.Generator | None = None
                    ) -> tuple[str, ...]:
    """Every block-stored (shape, type) of `model` against the fp32 kernel (`fp32_mismatch`); () if all equal.

    Args:
        rows: rows of the compared block (at most REFERENCE_BLOCK).
    """
    rng = rng or np.random.default_rng(0)
    out = []
    for (in_dim, out_dim, fmt), module in sorted(_block_stored(model).items()):
        fn = module.as_linear if isinstance(module, BlockEmbedding) else module
        mismatch = fp32_mismatch(fn, _fp32_reference(module), in_dim, rows, rng)
        if mismatch:
            out.append(f"{in_dim}->{out_dim} {FORMAT_NAMES.get(fmt, fmt)}: {mismatch}")
    return tuple(out)


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
