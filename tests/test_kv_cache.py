import mlx.core as mx
import numpy as np
import pytest

from inference_engine.verifier.kv_cache import CacheGeometry, SinkWindowKVCache, row_layout

G = CacheGeometry(sink=2, window=4, max_block=3, max_rollback=2)


def test_geometry_sizes():
    assert G.ring == 9 and G.slots == 11 and G.keys_per_row == 7
    assert G.slot_of(np.array([0, 1, 2, 10, 11])).tolist() == [0, 1, 2, 10, 2]
    assert G.visible_positions(0) == [0]
    assert G.visible_positions(3) == [0, 1, 2, 3]
    assert G.visible_positions(20) == [0, 1, 16, 17, 18, 19, 20]


def test_row_layout_masks_missing_positions():
    slots, mask = row_layout(G, 1, 2)
    m = np.array(mask)[:, 0, 0, :]
    # Row at p=1: sinks 0,1 visible; window p-4..p = -3..1 all < sink -> masked.
    assert m[0].tolist() == [True, True, False, False, False, False, False]
    # Row at p=2: window slot for position 2 is visible.
    assert m[1].tolist() == [True, True, False, False, False, False, True]
    assert np.array(slots).reshape(2, 7)[1, 6] == 2


def test_update_trim_and_canonical_state():
    c = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    for p in range(12):
        kv = mx.full((1, 1, 2), float(p))
        k, v, mask = c.update_and_fetch(kv, kv)
        assert k.shape == (1, 1, 7, 2) and mask.shape == (1, 1, 1, 7)
    assert c.offset == 12
    assert c.retained_positions() == [0, 1, 8, 9, 10, 11]
    keys, _ = c.canonical_state()
    assert np.array(keys)[0, :, 0].tolist() == [0, 1, 8, 9, 10, 11]
    assert c.trim(2) == 2 and c.offset == 10
    keys, _ = c.canonical_state()
    assert np.array(keys)[0, :, 0].tolist() == [0, 1, 6, 7, 8, 9]
    assert c.nbytes == 2 * 11 * 2 * 4


@pytest.mark.parametrize("n", [-1, 3])
def test_trim_out_of_bounds(n):
    c = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    c.update_and_fetch(mx.zeros((1, 3, 2)), mx.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match="cannot trim"):
        c.trim(n)


def test_block_larger_than_tile_rejected():
    c = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    with pytest.raises(ValueError, match="max_block"):
        c.update_and_fetch(mx.zeros((1, 4, 2)), mx.zeros((1, 4, 2)))
