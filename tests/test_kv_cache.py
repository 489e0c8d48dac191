import mlx.core as mx
import numpy as np
import pytest

from inference_engine.execution.kv_cache import CacheGeometry, SinkWindowKVCache, attention_groups, row_mask, write_slots

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


def test_write_slots_are_a_slice_unless_the_block_wraps():
    assert write_slots(G, 1, 3) == slice(1, 4)  # across the sinks' end: still consecutive slots
    assert write_slots(G, 9, 2) == slice(9, 11)  # the ring's last slots
    assert np.array(write_slots(G, 10, 3)).tolist() == [10, 2, 3]  # wraps: a scatter


@pytest.mark.parametrize("block", [1, 2, 3])
def test_every_chunking_stores_the_same_cache(block):
    # Blocks of 1 (slices only), 2 and 3 (some wrap: scatters) store bitwise the same slots.
    rng = np.random.default_rng(block)
    kv = rng.standard_normal((1, 40, 2)).astype(np.float32)
    one, other = (SinkWindowKVCache(G, num_kv_heads=1, head_dim=2) for _ in range(2))
    for p in range(40):
        one.update_and_fetch(mx.array(kv[:, p : p + 1]), mx.array(kv[:, p : p + 1]))
    for p in range(0, 40, block):
        other.update_and_fetch(mx.array(kv[:, p : p + block]), mx.array(kv[:, p : p + block]))
    mx.eval(one.state, other.state)
    assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(one.state, other.state))


def test_attention_groups_cut_each_rows_mask_to_its_extent():
    g = CacheGeometry(sink=4, window=300, max_block=8, max_rollback=2)
    groups = attention_groups(g, 124, 8)  # rows at 124..131: extents 128, then 256
    assert [(lo, hi, e) for lo, hi, e, _ in groups] == [(0, 4, 128), (4, 8, 256)]
    full = np.array(row_mask(g, 124, 8))
    for lo, hi, e, mask in groups:
        assert np.array_equal(np.array(mask), full[lo:hi, ..., :e])
