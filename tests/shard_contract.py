"""The shard engine contract: every engine must pass these (subclass with `make_engine`).

Run on the tiny 2-layer model split head [0, 1) / tail [1, 2); a chain of engines must
reproduce the single-process SinkWindowVerifier bit for bit, across chunk edges, window
wrap, decode rows and trims.
"""

from __future__ import annotations

import numpy as np
import pytest

from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted, SessionNotFound
from inference_engine.shard.protocol.errors import WorkCancelled
from inference_engine.shard.protocol.types import LayerRange, ShardWork, StepItem
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.execution.kv_cache import CacheGeometry
from tests.shard_helpers import GEOMETRY, chain_differences, ref_block, reference, run_chain

TOKENS = np.random.default_rng(7).integers(0, 256, 64).tolist()
# Block sizes: chunk edges (> max_block 4), single rows, and enough tokens to wrap the window.
PATTERNS = {"mixed": [7, 1, 3, 10, 1, 1, 5, 9], "singles": [1] * 14, "one-block": [30]}


class ShardEngineContract:
    """Reusable contract test; subclasses define `make_engine`."""

    def make_engine(self, model, layers: LayerRange, **limits) -> MlxShardEngine:
        """An unloaded engine for `layers` of `model` with block 4 and `limits` (max_sessions, ...)."""
        raise NotImplementedError

    @pytest.fixture
    def chain(self, tiny) -> list[MlxShardEngine]:
        engines = [self.make_engine(tiny.model, LayerRange(0, 1)), self.make_engine(tiny.model, LayerRange(1, 2))]
        for e in engines:
            e.load()
        return engines

    def _open(self, chain, sid="s", geometry=GEOMETRY):
        for e in chain:
            e.open_session(sid, geometry)

    def test_capabilities(self, chain, tiny):
        head, tail = (e.capabilities() for e in chain)
        assert head.is_head and not head.is_tail and tail.is_tail and not tail.is_head
        assert (head.layers, tail.layers) == (LayerRange(0, 1), LayerRange(1, 2))
        assert head.model_fingerprint == tail.model_fingerprint and len(head.model_fingerprint) == 64
        assert (head.hidden_size, head.vocab_size, head.num_layers) == (64, 256, 2)
        assert head.activation_dtype == "float32" and head.max_block == 4
        chain[0].load()  # idempotent
        assert chain[0].capabilities() == head

    @pytest.mark.parametrize("pattern", PATTERNS)
    def test_chain_reproduces_single_process_bitwise(self, chain, tiny, pattern):
        self._open(chain)
        assert chain_differences(chain, tiny, "s", TOKENS, PATTERNS[pattern]) == []
        assert sum(PATTERNS[pattern]) > GEOMETRY.sink + GEOMETRY.window + GEOMETRY.max_block  # the ring wrapped

    def test_trim_is_an_exact_rollback(self, chain, tiny):
        self._open(chain)
        ref = reference(tiny)
        run_chain(chain, "s", 1, 0, TOKENS[:12])
        ref_block(ref, TOKENS[:12])
        run_chain(chain, "s", 2, 12, TOKENS[12:16])  # a 4-token draft ...
        ref_block(ref, TOKENS[12:16], keep=1)  # ... of which one is accepted
        for e in chain:
            assert e.trim("s", 3, 16) == 13
        got = run_chain(chain, "s", 3, 13, [5, 6, 7])
        assert got.tobytes() == ref_block(ref, [5, 6, 7]).tobytes()

    def test_layer_digests_split_like_the_single_process(self, chain, tiny):
        self._open(chain)
        ref = reference(tiny)
        run_chain(chain, "s", 1, 0, TOKENS[:20])
        ref_block(ref, TOKENS[:20])
        digests = [d for e in chain for d in e.layer_digests("s", 20)]
        assert digests == ref.executor.layer_digests() and len(digests) == 2
        with pytest.raises(InvariantViolation, match="position 19"):
            chain[0].layer_digests("s", 19)
        with pytest.raises(SessionNotFound):
            chain[0].layer_digests("nope", 0)

    def test_kv_export_import_is_the_single_process_canonical_state(self, chain, tiny):
        self._open(chain)
        ref = reference(tiny)
        run_chain(chain, "s", 1, 0, TOKENS[:20])  # past the window: the ring wrapped
        ref_block(ref, TOKENS[:20])
        layers = [kv for e in chain for kv in e.export_kv("s", 20)]
        want = ref.executor.canonical_kv()
        assert [k.tobytes() for k, _ in layers] == [k.tobytes() for k in want.keys]
        assert [v.tobytes() for _, v in layers] == [v.tobytes() for v in want.values]
        for e, part in zip(chain, ([layers[0]], [layers[1]])):  # a fresh session continues exactly
            e.open_session("t", GEOMETRY)
            assert e.import_kv("t", 0, 20, part) == 20
        assert [d for e in chain for d in e.layer_digests("t", 20)] == ref.executor.layer_digests()
        got = run_chain(chain, "t", 2, 20, TOKENS[20:27])
        assert got.tobytes() == ref_block(ref, TOKENS[20:27]).tobytes()
        with pytest.raises(InvariantViolation, match="position 19"):
            chain[0].export_kv("s", 19)
        with pytest.raises(InvariantViolation, match="just opened|at 0"):
            chain[0].import_kv("t", 27, 30, [layers[0]])
        chain[0].open_session("u", GEOMETRY)
        with pytest.raises(InvalidRequest, match="K/V of 2 blocks"):
            chain[0].import_kv("u", 0, 20, layers)
        with pytest.raises(InvalidRequest, match="do not fit"):
            chain[0].import_kv("u", 0, 3, [layers[0]])  # 3 retains 3 positions, 20 retains 7
        with pytest.raises(InvariantViolation, match="broken"):
            chain[0].prefill("u", ShardWork(1, 0, (1,), None))

    def test_input_errors(self, chain, tiny):
        head, tail = chain
        self._open(chain)
        with pytest.raises(SessionNotFound):
            head.prefill("nope", ShardWork(1, 0, (1,), None))
        with pytest.raises(InvalidRequest, match="already open"):
            head.open_session("s", GEOMETRY)
        with pytest.raises(InvalidRequest, match="max_block"):
            head.open_session("t", CacheGeometry(2, 5, max_block=5, max_rollback=4))
        with pytest.raises(InvalidRequest, match="token ids"):
            head.prefill("s", ShardWork(1, 0, (), None))
        with pytest.raises(InvalidRequest, match="token id 256"):
            head.prefill("s", ShardWork(1, 0, (1, 256), None))
        with pytest.raises(InvalidRequest, match="exactly one row"):
            head.decode("s", ShardWork(1, 0, (1, 2), None))
        with pytest.raises(InvariantViolation, match="position 3"):
            head.prefill("s", ShardWork(1, 3, (1,), None))
        with pytest.raises(InvalidRequest, match="shape"):
            tail.prefill("s", ShardWork(1, 0, (), np.zeros((2, 63), np.float32)))
        with pytest.raises(InvalidRequest, match="shape"):
            tail.prefill("s", ShardWork(1, 0, (), None))
        with pytest.raises(InvalidRequest, match="dtype"):
            tail.prefill("s", ShardWork(1, 0, (), np.zeros((2, 64), np.float16)))
        with pytest.raises(InvalidRequest, match="sideband"):
            tail.prefill("s", ShardWork(1, 0, (1,), np.zeros((2, 64), np.float32)))
        run_chain(chain, "s", 1, 0, TOKENS[:6])
        with pytest.raises(InvariantViolation, match="allowed 0..4"):
            head.trim("s", 5, 6)
        with pytest.raises(InvariantViolation, match="position 5"):
            head.trim("s", 1, 5)

    def test_session_capacity(self, tiny):
        engine = self.make_engine(tiny.model, LayerRange(0, 2), max_sessions=1)
        engine.load()
        engine.open_session("a", GEOMETRY)
        with pytest.raises(PoolExhausted):
            engine.open_session("b", GEOMETRY)
        assert engine.release("a") and not engine.release("a")
        engine.open_session("b", GEOMETRY)

    def test_a_cancelled_item_leaves_the_session_exact(self, chain, tiny):
        head, _ = chain
        self._open(chain)
        for run in (head.prefill, head.decode):  # asked before the block: nothing computed
            with pytest.raises(WorkCancelled, match="work 5"):
                run("s", ShardWork(5, 0, tuple(TOKENS[:1]), None), lambda: True)
        out = head.step_many([StepItem("s", ShardWork(5, 0, tuple(TOKENS[:6]), None), False, lambda: True)])
        assert isinstance(out[0], WorkCancelled) and head.metrics().steps == 0
        got = run_chain(chain, "s", 6, 0, TOKENS[:6])  # the session is intact and exact
        assert got.tobytes() == ref_block(reference(tiny), TOKENS[:6]).tobytes()

    def test_release_health_metrics(self, chain):
        head, _ = chain
        assert head.health().is_serving and head.health().sessions == 0
        before = head.metrics()
        self._open(chain)
        run_chain(chain, "s", 1, 0, TOKENS[:6])
        m = head.metrics()
        assert (m.sessions, m.steps - before.steps, m.rows - before.rows) == (1, 1, 6)
        assert m.kv_bytes > 0 and m.busy_s > 0
        assert head.health().sessions == 1
        assert head.release("s") and not head.release("s")
        assert head.metrics().kv_bytes == 0
