import mlx.core as mx
import numpy as np
import pytest

from inference_engine.verifier.kv_cache import CacheGeometry, SinkWindowKVCache, row_mask

G = CacheGeometry(sink=2, window=4, max_block=3, max_rollback=2)


def test_geometry_sizes():
    assert G.ring == 9 and G.slots == 11
    assert G.slot_of(np.array([0, 1, 2, 10, 11])).tolist() == [0, 1, 2, 10, 2]
    assert G.visible_positions(0) == [0]
    assert G.visible_positions(3) == [0, 1, 2, 3]
    assert G.visible_positions(20) == [0, 1, 16, 17, 18, 19, 20]


def test_row_mask_depends_only_on_position():
    m = np.array(row_mask(G, 1, 2))[:, 0, 0, :]
    # Row at p=1 sees sinks 0 and 1 only; row at p=2 also sees slot 2 (position 2).
    assert np.flatnonzero(m[0]).tolist() == [0, 1]
    assert np.flatnonzero(m[1]).tolist() == [0, 1, 2]
    # Row at p=20: sinks, then positions 16..20 in ring slots 2 + (x - 2) % 9.
    assert np.flatnonzero(np.array(row_mask(G, 20, 1))[0, 0, 0]).tolist() == [0, 1, 2, 7, 8, 9, 10]
    assert np.array_equal(np.array(row_mask(G, 19, 2))[1], np.array(row_mask(G, 20, 1))[0])


def test_update_trim_and_canonical_state():
    c = SinkWindowKVCache(G, num_kv_heads=1, head_dim=2)
    for p in range(12):
        kv = mx.full((1, 1, 2), float(p))
        k, v, mask = c.update_and_fetch(kv, kv)
        assert k.shape == (1, 11, 2) and mask.shape == (1, 1, 1, 11)
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
