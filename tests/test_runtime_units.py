"""Coordinator, session store, engine and config units (tiny model, no server)."""

import argparse
import time

import pytest

from inference_engine import config as config_mod
from inference_engine.errors import InvariantViolation, PoolExhausted, SessionBusy, SessionNotFound
from inference_engine.runtime.coordinator import AppendTokensCoordinator
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.session import Session
from inference_engine.runtime.session_store import SessionStore
from inference_engine.server.status_codes import status_of
from inference_engine.verifier import tile_probe


@pytest.fixture(scope="module")
def engine(tiny):
    e = Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=4)
    yield e
    e.close()


def _session(engine) -> Session:
    return Session(SessionStore.new_id(), engine.make_verifier(2, 8), 2, 8, (1,), "t")


def test_failed_compute_rebuilds_from_history(engine, monkeypatch):
    s = _session(engine)
    coord = AppendTokensCoordinator(s, lambda: engine.make_verifier(2, 8))
    coord.append([1, 2, 3, 4, 5])
    digest = s.verifier.state_digest()
    real = s.verifier.forward_block

    def explode(tokens, all_logits=True):
        real(tokens, all_logits)  # the cache advances, then compute "fails"
        raise RuntimeError("boom")

    monkeypatch.setattr(s.verifier, "forward_block", explode)
    with pytest.raises(RuntimeError, match="boom"):
        coord.append([6, 7])
    assert s.history == [1, 2, 3, 4, 5] and s.verifier.state_digest() == digest
    coord.append([6, 7])
    assert s.verifier.next_global_position == 7


def test_invariant_violation_is_reported(engine):
    s = _session(engine)
    coord = AppendTokensCoordinator(s, lambda: engine.make_verifier(2, 8))
    coord.append([1, 2, 3])
    s.history.append(9)  # history ahead of the cache: INV-2 broken
    with pytest.raises(InvariantViolation, match="next_global_position 3 != history length 4"):
        coord.append([4])
    assert status_of(InvariantViolation("x")).name == "FAILED_PRECONDITION"
    assert status_of(KeyError("x")).name == "INTERNAL"


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
    s = Session(store.new_id(), engine.make_verifier(2, 8), 2, 8, (1,), "t", owner="token:a")
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


def test_probe_detects_row_variance(tiny, monkeypatch):
    r = tile_probe.probe_tile(tiny.model, max_candidate=4)
    assert 1 <= r.tile <= 4 and len(r.shapes) == 5
    assert r.is_exact_possible


def test_config_from_flags(monkeypatch, tmp_path):
    parser = argparse.ArgumentParser()
    config_mod.add_server_flags(parser)
    monkeypatch.setenv("INFERENCE_ENGINE_CACHE", str(tmp_path))
    cfg = config_mod.config_from_args(parser.parse_args(["--port", "0", "--no-exact", "--default-window", "32"]))
    assert cfg.port == 0 and not cfg.exact and cfg.default_window == 32 and cfg.cache_dir == tmp_path
    with pytest.raises(ValueError, match="--default-window"):
        config_mod.config_from_args(parser.parse_args(["--default-window", "9000"]))
    monkeypatch.delenv("INFERENCE_ENGINE_CACHE")
    assert config_mod.default_cache_dir().name == "inference_engine"
