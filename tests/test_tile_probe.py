"""The tile probe finds the first block size whose rows differ from single rows, wherever they sit."""

import mlx.core as mx
import numpy as np

from inference_engine.execution.tile_probe import first_variant_size

IN, OUT = 40, 24
W = mx.array(np.random.default_rng(9).standard_normal((OUT, IN)).astype(np.float32))


def split_sum(x: mx.array) -> mx.array:
    """x @ W.T with the reduction split in two: other rounding than one matmul."""
    return x[..., : IN // 2] @ W[:, : IN // 2].T + x[..., IN // 2 :] @ W[:, IN // 2 :].T


def test_an_invariant_linear_passes_every_size():
    assert first_variant_size(lambda x: x @ W.T, IN, 64, np.random.default_rng(0)) == ("", 64)


def test_the_first_variant_size_bounds_the_tile():
    def variant_from_6(x):
        return split_sum(x) if x.shape[1] >= 6 else x @ W.T

    failure, tile = first_variant_size(variant_from_6, IN, 64, np.random.default_rng(0))
    assert tile == 5 and failure.startswith("M=6 rows [0, 1, 2, 3] differ from M=1")


def test_a_row_whose_bits_depend_on_its_position_is_caught():
    def last_row_differs(x):  # only the block's last row, and only in blocks of 20 rows or more
        if x.shape[1] < 20:
            return x @ W.T
        return mx.concatenate([x[:, :-1] @ W.T, split_sum(x[:, -1:])], axis=1)

    failure, tile = first_variant_size(last_row_differs, IN, 64, np.random.default_rng(0))
    assert (failure, tile) == ("M=20 rows [19] differ from M=1", 19)


def test_single_rows_that_are_not_repeatable_refuse_exact_mode():
    noise = iter(np.random.default_rng(1).standard_normal(100))
    failure, tile = first_variant_size(lambda x: x @ W.T + float(next(noise)), IN, 16, np.random.default_rng(0))
    assert (failure, tile) == ("single row not repeatable", 0)
