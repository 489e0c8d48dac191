"""Engine specifics beyond the contract: mid-block cancel, broken sessions, loading, fault injection."""

import json
import time

import numpy as np
from typing import Callable

import pytest

from inference_engine.errors import InvalidRequest, InvariantViolation, PoolExhausted
from inference_engine.model import forward as forward_module
from inference_engine.shard.protocol.errors import ShardUnavailable, WorkCancelled
from inference_engine.shard.protocol.types import LayerRange, ShardWork
from inference_engine.shard.worker import mlx_engine
from inference_engine.shard.worker.mlx_engine import MlxShardEngine, load_weights, model_fingerprint
from inference_engine.execution import executor as executor_module
from inference_engine.execution.kv_cache import CacheGeometry
from tests.fixtures.fault_config import FaultConfig
from tests.fixtures.fault_injection import FaultInjectingEngine
from tests.shard_helpers import GEOMETRY, ref_block, reference, run_chain
from tests.tiny_models import random_model

TOKENS = np.random.default_rng(3).integers(0, 256, 40).tolist()


@pytest.fixture
def full(tiny):
    engine = MlxShardEngine(tiny.model, LayerRange(0, 2), block=4, max_rollback=4)
    engine.load()
    engine.open_session("s", GEOMETRY)
    return engine


def _cancel_after_first_chunk(monkeypatch) -> Callable[[], bool]:
    """An item's `is_cancelled` that turns true once the first chunk of rows has run (as a stream's cancel)."""
    real, chunks = forward_module.forward_rows, []

    def run_then_cancel(*args):
        out = real(*args)
        chunks.append(1)
        return out

    monkeypatch.setattr(forward_module, "forward_rows", run_then_cancel)
    return lambda: bool(chunks)


def test_cancel_mid_block_within_rollback_restores_the_cache(full, tiny, monkeypatch):
    run_chain([full], "s", 1, 0, TOKENS[:10])
    cancelled = _cancel_after_first_chunk(monkeypatch)
    with pytest.raises(WorkCancelled):
        full.prefill("s", ShardWork(2, 10, tuple(TOKENS[10:18]), None), cancelled)  # 4 rows done, then cancelled
    monkeypatch.undo()
    ref = reference(tiny)
    ref_block(ref, TOKENS[:10])
    got = run_chain([full], "s", 3, 10, TOKENS[10:14])
    assert got.tobytes() == ref_block(ref, TOKENS[10:14]).tobytes()


def test_cancel_mid_block_beyond_rollback_breaks_the_session(tiny, monkeypatch):
    engine = MlxShardEngine(tiny.model, LayerRange(0, 2), block=4, max_rollback=2)
    engine.load()
    engine.open_session("s", CacheGeometry(2, 5, 4, 2))
    cancelled = _cancel_after_first_chunk(monkeypatch)
    with pytest.raises(InvariantViolation, match="cannot be restored"):
        engine.prefill("s", ShardWork(1, 0, tuple(TOKENS[:8]), None), cancelled)
    with pytest.raises(InvariantViolation, match="broken"):
        engine.prefill("s", ShardWork(2, 4, (1,), None))


def test_compute_failure_breaks_the_session(full, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("simulated MLX failure")

    monkeypatch.setattr(executor_module, "forward", boom)
    with pytest.raises(RuntimeError, match="simulated"):
        full.prefill("s", ShardWork(1, 0, (1, 2), None))
    monkeypatch.undo()
    with pytest.raises(InvariantViolation, match="broken .*RuntimeError"):
        full.prefill("s", ShardWork(2, 0, (1, 2), None))


def test_not_loaded_and_bad_ranges(tiny, tmp_path):
    engine = MlxShardEngine(tiny.model, LayerRange(0, 3))
    assert not engine.health().is_serving
    with pytest.raises(InvariantViolation, match="load"):
        engine.capabilities()
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        engine.load()
    with pytest.raises(FileNotFoundError):
        load_weights(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="gpt2"):
        load_weights(tmp_path)
    with pytest.raises(ValueError, match="START:END"):
        LayerRange.parse("3")
    with pytest.raises(ValueError, match="0 <= START < END"):
        LayerRange.parse("4:2")
    assert str(LayerRange.parse("2:4")) == "2:4" and len(LayerRange(2, 4)) == 2


def test_probe_at_load_and_fingerprint(tiny):
    engine = MlxShardEngine(tiny.model, LayerRange(1, 2), max_tile=4, name="tiny")
    engine.load()
    caps = engine.capabilities()
    assert 1 <= caps.max_block <= 4 and caps.model_name == "tiny" and caps.is_tail
    assert model_fingerprint(random_model(seed=1).model) != caps.model_fingerprint


def test_load_refuses_inexact_blas_and_uncarried_dtypes(monkeypatch):
    import mlx.core as mx

    from inference_engine.execution.tile_probe import ProbeResult

    monkeypatch.setattr(mlx_engine, "probe_tile", lambda *a, **k: ProbeResult(0, 16, ("not repeatable",), ()))
    with pytest.raises(InvariantViolation, match="not repeatable"):
        MlxShardEngine(random_model(seed=2).model, LayerRange(0, 2)).load()
    half = random_model(seed=2).model
    half.set_dtype(mx.bfloat16)
    with pytest.raises(ValueError, match="bfloat16"):
        MlxShardEngine(half, LayerRange(0, 2), block=4).load()


def test_fault_config_parse():
    cfg = FaultConfig.parse("delay=0.5,memory_budget=100,malformed=nan,crash_after=3")
    assert cfg == FaultConfig(0.5, 100, "nan", 3)
    assert FaultConfig.parse("") == FaultConfig()
    with pytest.raises(ValueError, match="unknown fault"):
        FaultConfig.parse("explode=1")
    with pytest.raises(ValueError, match="malformed='bits'"):
        FaultConfig.parse("malformed=bits")


def _faulty(tiny, layers=LayerRange(0, 2), **faults):
    engine = FaultInjectingEngine(MlxShardEngine(tiny.model, layers, block=4, max_rollback=4), FaultConfig(**faults))
    engine.load()
    return engine


def test_fault_delay(tiny, monkeypatch):
    engine = _faulty(tiny, delay_s=0.2)
    engine.open_session("s", GEOMETRY)
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)  # the delay is asked for, not timed
    out = engine.decode("s", ShardWork(1, 0, (1,), None))
    assert slept == [0.2] and out.next_position == 1


def test_fault_memory_budget(tiny):
    probe = _faulty(tiny)
    probe.open_session("x", GEOMETRY)
    per_session = probe.metrics().kv_bytes
    engine = _faulty(tiny, memory_budget_bytes=per_session + per_session // 2)
    engine.open_session("a", GEOMETRY)
    with pytest.raises(PoolExhausted, match="memory budget"):
        engine.open_session("b", GEOMETRY)
    assert engine.metrics().sessions == 1  # the refused session was not kept


@pytest.mark.parametrize("kind", ["rows", "width", "nan", "position"])
def test_fault_malformed_outputs(tiny, kind):
    engine = _faulty(tiny, malformed=kind)
    engine.open_session("s", GEOMETRY)
    out = engine.prefill("s", ShardWork(1, 0, (1, 2, 3), None, all_logits=True))
    assert {"rows": out.tensor.shape == (2, 256), "width": out.tensor.shape == (3, 255),
            "nan": bool(np.isnan(out.tensor).any()), "position": out.position == 1}[kind]
    single = engine.decode("s", ShardWork(2, 3, (4,), None))
    if kind == "rows":
        assert single.tensor.shape == (2, 256)


def test_fault_crash_after(tiny):
    engine = _faulty(tiny, crash_after=2)
    engine.open_session("s", GEOMETRY)
    engine.prefill("s", ShardWork(1, 0, (1, 2), None))
    assert engine.trim("s", 1, 2) == 1
    assert not engine.health().is_serving and "crashed" in engine.health().detail
    with pytest.raises(ShardUnavailable, match="crashed after 2"):
        engine.decode("s", ShardWork(2, 1, (3,), None))
    with pytest.raises(ShardUnavailable):
        engine.open_session("t", GEOMETRY)
    assert engine.release("s")


def test_fault_engine_rejects_like_inner(tiny):
    engine = _faulty(tiny)
    with pytest.raises(InvalidRequest):
        engine.open_session("s", CacheGeometry(2, 5, 99, 4))
