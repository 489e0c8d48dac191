"""Sink-window verifier on the tiny model: API contract, INV-3, wrap and rollback."""

import numpy as np
import pytest

from inference_engine.errors import InvariantViolation
from inference_engine.runtime.engine import Engine
from inference_engine.model import forward as forward_module
from tests.exactness import chunkings, feed, rows_variant
from tests.kernel_guard import assert_full_tile, is_kernel_bound

SINK, WINDOW = 3, 8
TOKENS = np.random.default_rng(1).integers(0, 256, 3 * (SINK + WINDOW) + 5).tolist()


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=4))
    yield e
    e.close()


def test_probe_picked_the_whole_tile(engine):
    """16 rows where the exact-gemm kernel computes (on Linux always: conftest), else what the probe found."""
    assert engine.is_exact and engine.probe.max_candidate == 16 and engine.block >= 2
    assert engine.block == (16 if is_kernel_bound() else engine.probe.tile)


@pytest.mark.parametrize("name,sizes", chunkings(len(TOKENS)).items())
def test_any_chunking_same_digest(engine, name, sizes):
    ref = feed(engine, TOKENS, [len(TOKENS)], SINK, WINDOW)
    v = feed(engine, TOKENS, sizes, SINK, WINDOW)
    assert v.next_global_position == len(TOKENS)
    assert v.cached_token_sequence == TOKENS[:SINK] + TOKENS[-WINDOW:]
    assert np.array(v.next_token_logits).tobytes() == np.array(ref.next_token_logits).tobytes()
    assert v.state_digest() == ref.state_digest()


def test_rollback_after_wrap_equals_never_fed(engine):
    base = TOKENS[:30]
    extra = TOKENS[30:34]
    ref = feed(engine, TOKENS, [30], SINK, WINDOW)
    v = feed(engine, TOKENS, [30], SINK, WINDOW)
    logits = v.forward_block(extra)
    assert logits.shape == (4, 256)
    assert v.next_global_position == 30  # pending tokens are not committed
    v.commit_or_truncate(forwarded=4, accepted=0)
    assert v.state_digest() == ref.state_digest()
    # Accept part of a block: same as feeding just that part.
    v.forward_block(extra)
    v.commit_or_truncate(4, 2)
    ref2 = feed(engine, base + extra[:2], [32], SINK, WINDOW)
    assert v.state_digest() == ref2.state_digest()
    assert v.cached_token_sequence == ref2.cached_token_sequence


def test_verification_logits_equal_sequential(engine):
    v = feed(engine, TOKENS, [20], SINK, WINDOW)
    block = v.forward_block(TOKENS[20:24])
    seq = feed(engine, TOKENS, [20], SINK, WINDOW)
    for i, t in enumerate(TOKENS[20:24]):
        seq.forward_block([t])
        seq.commit_or_truncate(1, 1)
        assert np.array(block[i]).tobytes() == np.array(seq.next_token_logits).tobytes()


def test_contract_errors(engine):
    v = engine.make_verifier(SINK, WINDOW)
    assert v.next_token_logits is None and v.cached_token_sequence == [] and v.next_global_position == 0
    with pytest.raises(InvariantViolation, match="at least one"):
        v.forward_block([])
    with pytest.raises(InvariantViolation, match="pending"):
        v.commit_or_truncate(1, 1)
    v.forward_block([1, 2, 3, 4, 5, 6])
    with pytest.raises(InvariantViolation, match="awaits"):
        v.forward_block([1])
    with pytest.raises(InvariantViolation, match="accepted="):
        v.commit_or_truncate(6, 0)  # would drop 6 > rollback room 4 + 1
    v.commit_or_truncate(6, 6)
    v.forward_block([7, 8], all_logits=False)
    with pytest.raises(InvariantViolation, match="accepted whole"):
        v.commit_or_truncate(2, 1)
    v.commit_or_truncate(2, 2)
    assert v.next_global_position == 8 and v.nbytes > 0


def test_memory_bounded_by_geometry(engine):
    v = feed(engine, TOKENS, [len(TOKENS)], SINK, WINDOW)
    before = v.nbytes
    more = feed(engine, TOKENS * 4, [len(TOKENS) * 4], SINK, WINDOW)
    assert more.nbytes == before
    g = engine.geometry(SINK, WINDOW)
    assert before == 2 * 2 * g.slots * engine.spec.num_kv_heads * engine.spec.head_dim * 4  # layers*K/V*...


@pytest.mark.parametrize("defect", [False, True], ids=["clean", "rows-variant"])
def test_plain_mode_blocks_of_128(tiny, monkeypatch, defect):
    """Plain 128-row blocks: no probe; on the exact kernels (any row count) still chunking-invariant, and the
    chunking comparison sees a product whose bits depend on the row count (the negative control)."""
    if defect:
        monkeypatch.setattr(forward_module, "_block", rows_variant(forward_module._block))
    plain = Engine(tiny, exact=False, max_tile=16, plain_block=128, max_rollback=4)
    assert not plain.is_exact and plain.probe is None
    tokens = np.random.default_rng(2).integers(0, 256, 100).tolist()
    digests = {feed(plain, tokens, sizes, SINK, WINDOW).state_digest() for sizes in chunkings(len(tokens)).values()}
    plain.close()
    assert (len(digests) > 1) == (defect or not is_kernel_bound())


@pytest.mark.parametrize("name,sizes", list(chunkings(400, seeds=range(2)).items()))
def test_chunking_invariance_across_key_extent_buckets(engine, name, sizes):
    """Window 300: rows read key prefixes of 128/256/all slots by position; still exact."""
    tokens = np.random.default_rng(5).integers(0, 256, 400).tolist()
    ref = feed(engine, tokens, [400], 2, 300)
    v = feed(engine, tokens, sizes, 2, 300)
    assert v.state_digest() == ref.state_digest()


def test_block_returned_before_it_is_computed_has_the_same_bits(engine):
    """wait=False (a decode step hands its token out while the logits compute) changes no bit."""
    waited = feed(engine, TOKENS, [20], SINK, WINDOW)
    early = feed(engine, TOKENS, [20], SINK, WINDOW)
    a = waited.forward_block(TOKENS[20:23], wait=True)
    b = early.forward_block(TOKENS[20:23], wait=False)
    assert np.array(b).tobytes() == np.array(a).tobytes()
    for v in (waited, early):
        v.commit_or_truncate(3, 2)
    assert early.state_digest() == waited.state_digest()
