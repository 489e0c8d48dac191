"""Coordinator, session store, engine and config units (tiny model, no server)."""

import argparse
import time

import mlx.core as mx
import pytest

from inference_engine import config as config_mod
from inference_engine.errors import InvariantViolation, PoolExhausted, SessionBusy, SessionNotFound
from inference_engine.runtime.engine import Engine
from inference_engine.status_codes import status_of
from inference_engine.session.session import Session
from inference_engine.session.session_store import SessionStore
from inference_engine.execution import executor as executor_mod
from inference_engine.execution import tile_probe
from tests.coordinator_helpers import append_alone
from tests.kernel_guard import assert_full_tile


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=4))
    yield e
    e.close()


def _session(engine) -> Session:
    sid = SessionStore.new_id()
    return Session(sid, engine.open_session(2, 8, "t"), 2, 8, (1,), "t")


@pytest.mark.parametrize("tokens", [[6, 7], list(range(6, 40))])  # within the ring's slack, and far beyond it
def test_failed_compute_commits_nothing_and_leaves_the_cache_exact(engine, monkeypatch, tokens):
    s = _session(engine)
    coord = s.coordinator
    append_alone(coord, [1, 2, 3, 4, 5])
    digest = coord.verifier.state_digest()
    real, calls = executor_mod.forward, []

    def explode(model, x, cache, *args, **kw):
        calls.append(len(x))
        if len(calls) > 1:  # the rebuild's replay computes normally
            return real(model, x, cache, *args, **kw)
        real(model, x[:3], cache, *args, **kw)  # the cache advances, then compute "fails"
        raise RuntimeError("boom")

    monkeypatch.setattr(executor_mod, "forward", explode)
    with pytest.raises(RuntimeError, match="boom"):
        append_alone(coord, tokens)
    monkeypatch.undo()
    assert list(s.history) == [1, 2, 3, 4, 5]
    assert coord.state_digest() == digest  # back where it was (rebuilt from the log if need be)
    assert calls == [len(tokens)] + ([5] if len(tokens) > 21 else [])  # a rebuild only beyond the ring's slack
    append_alone(coord, tokens)
    ref = _session(engine)
    append_alone(ref.coordinator, [1, 2, 3, 4, 5, *tokens])
    assert coord.verifier.state_digest() == ref.coordinator.verifier.state_digest()


def test_invariant_violation_is_reported(engine):
    s = _session(engine)
    coord = s.coordinator
    append_alone(coord, [1, 2, 3])
    s.history.extend([9])  # the log ahead of the cache: INV-2 broken
    with pytest.raises(InvariantViolation, match="next_global_position 3 != history length 4"):
        append_alone(coord, [4])
    assert status_of(InvariantViolation("x")).name == "FAILED_PRECONDITION"
    assert status_of(KeyError("x")).name == "INTERNAL"


def test_restore_undoes_an_append_within_and_beyond_the_rollback_room(engine):
    s = _session(engine)
    coord = s.coordinator
    append_alone(coord, list(range(1, 12)))
    digest, mark = coord.verifier.state_digest(), coord.checkpoint()
    append_alone(coord, [20, 21])
    coord.restore(mark)  # a trim
    assert coord.verifier.state_digest() == digest and len(s.history) == 11
    append_alone(coord, list(range(30, 60)))  # wraps the window many times
    coord.restore(mark)  # a rebuild from the log
    assert coord.verifier.state_digest() == digest and list(s.history) == list(range(1, 12))
    deep = coord.checkpoint(tokens_to_come=30)
    assert deep.kv is not None and mark.kv is None
    append_alone(coord, list(range(30, 60)))
    coord.restore(deep)  # the K/V snapshot put back
    assert coord.verifier.state_digest() == digest and list(s.history) == list(range(1, 12))
    append_alone(coord, [20, 21])
    ref = _session(engine)
    append_alone(ref.coordinator, list(range(1, 12)) + [20, 21])
    assert coord.verifier.state_digest() == ref.coordinator.verifier.state_digest()


def test_store_pool_busy_and_ttl(engine):
    store = SessionStore(max_sessions=1, ttl_s=0.05)
    s = _session(engine)
    store.add(s)
    with pytest.raises(PoolExhausted):
        store.reserve()
    s.acquire("Generate")
    with pytest.raises(SessionBusy, match="busy"):
        s.acquire("AppendTokens")
    time.sleep(0.1)
    assert store.expire_idle() == []  # busy sessions never expire
    store.close(s.session_id)
    assert store.slabs_in_use == 1  # closed while busy: slab drains
    store.release(s)
    assert store.slabs_in_use == 0
    with pytest.raises(SessionNotFound):
        store.get(s.session_id)


def test_store_checks_the_owner(engine):
    """Another identity's session is reported exactly as a missing one."""
    store = SessionStore(max_sessions=2, ttl_s=60)
    s = Session(store.new_id(), engine.open_session(2, 8), 2, 8, (1,), "t", owner="token:a")
    store.add(s)
    assert store.get(s.session_id, "token:a") is s
    with pytest.raises(SessionNotFound) as other:
        store.close(s.session_id, "token:b")
    with pytest.raises(SessionNotFound) as missing:
        store.get("nope", "token:a")
    assert str(other.value).replace(s.session_id, "ID") == str(missing.value).replace("nope", "ID")
    assert store.close(s.session_id, "token:a") is s


def test_engine_refuses_exact_when_probe_fails(tiny, monkeypatch, caplog):
    monkeypatch.setattr(
        "inference_engine.runtime.engine.probe_tile",
        lambda model, max_candidate: tile_probe.ProbeResult(0, max_candidate, ("single row not repeatable",), ()),
    )
    e = Engine(tiny, exact=True, max_tile=8, plain_block=32, max_rollback=4)
    assert not e.is_exact and e.block == 32
    assert "exact mode REFUSED" in caplog.text
    e.close()


async def test_closed_engine_is_unavailable(tiny):
    e = Engine(tiny, exact=False, max_tile=8, plain_block=32, max_rollback=4)
    assert await e.run(lambda: 3) == 3
    e.close()
    with pytest.raises(Exception, match="shutting down") as err:
        await e.run(lambda: 4)
    assert status_of(err.value).name == "UNAVAILABLE"


class _RowVariantLinear:
    """A linear whose rows pick up a bias once 3 or more share a call (a batch-variant BLAS)."""

    def __init__(self, w: mx.array):
        self.w = w

    def __call__(self, x: mx.array) -> mx.array:
        return x @ self.w.T + (1e-3 if x.shape[-2] >= 3 else 0.0)


def test_probe_finds_the_tile_and_detects_row_variance(tiny, monkeypatch):
    r = tile_probe.probe_tile(tiny.model, max_candidate=4)
    assert r.tile == 4 and len(r.shapes) == 5 and r.is_exact_possible and not r.failures
    w = mx.random.normal((48, 64))
    monkeypatch.setattr(tile_probe, "_products", lambda model: {(64, 48): _RowVariantLinear(w)})
    r = tile_probe.probe_tile(tiny.model, max_candidate=4)
    assert r.tile == 2 and any("64->48: M=3" in f for f in r.failures)


def test_config_from_flags(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    config_mod.add_server_flags(parser)
    monkeypatch.setenv("INFERENCE_ENGINE_CACHE", str(tmp_path))
    cfg = config_mod.config_from_args(parser.parse_args(["--port", "0", "--no-exact", "--default-window", "32"]))
    assert cfg.port == 0 and not cfg.exact and cfg.default_window == 32 and cfg.cache_dir == tmp_path
    with pytest.raises(ValueError, match="--default-window"):
        config_mod.config_from_args(parser.parse_args(["--default-window", "9000"]))
    with pytest.raises(ValueError, match="out-of-range flags: --grace"):
        config_mod.config_from_args(parser.parse_args(["--grace", "-1"]))
    token = tmp_path / "token"
    token.write_text("a-long-enough-shard-token-for-the-test-0123456789\n")
    with pytest.raises(ValueError, match="without --shards nothing would use them"):  # not silently ignored
        config_mod.config_from_args(parser.parse_args(["--shard-token-file", str(token)]))
    assert config_mod.config_from_args(parser.parse_args(["--shard-token-file", str(token), "--shards",
                                                          "127.0.0.1:1"])).shard_security.token
    monkeypatch.delenv("INFERENCE_ENGINE_CACHE")
    assert config_mod.default_cache_dir().name == "inference_engine"
