"""--persist-sessions on the tiny model, in process: sessions written after calls and on a tick, restored
with their ids and owners by the next runtime, deleted when closed; damaged files set aside, partial
writes cleaned up, and a write that dies before its rename leaves the previous file intact."""

import asyncio
import os

import grpc
import numpy as np
import pytest

from inference_engine.runtime import persistence as persistence_module
from inference_engine.runtime import snapshot_files
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.persistence import SessionPersistence, open_persistence
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.session import snapshot_format as fmt
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.kernel_guard import assert_full_tile
from tests.ops_helpers import serving

PROMPT = np.random.default_rng(4).integers(2, 256, 30).tolist()


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


async def _generate(stub, sid, n) -> list[int]:
    return [t async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True))
            for t in m.tokens]


async def _settled(p: SessionPersistence) -> None:
    """Wait for every background write and delete."""
    for _ in range(200):
        if not p._tasks:
            return
        await asyncio.gather(*list(p._tasks), return_exceptions=True)
    raise AssertionError("writes never settled")


def _history(path) -> int:
    return fmt.decode(path.read_bytes()).history_length


async def test_files_follow_calls_closes_and_expiry(engine, tmp_path):
    async with serving(engine, session_ttl_s=0.5) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path / "sessions", 1, 0)
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
        await _settled(p)
        assert _history(p.path(sid)) == 0  # written at creation
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        await _generate(stub, sid, 5)
        await _settled(p)
        assert _history(p.path(sid)) == len(PROMPT) + 5  # and after every call
        closed = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await _settled(p)
        await stub.CloseSession(pb.CloseSessionRequest(session_id=closed))
        await _settled(p)
        assert not p.path(closed).exists() and p.path(sid).exists()
        await asyncio.sleep(0.6)
        served.runtime.store.expire_idle()
        await _settled(p)
        assert list((tmp_path / "sessions").iterdir()) == []  # expired: gone with its file
        await p.close()


async def test_restart_continues_exactly(engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(engine, security) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path / "s", 1, 0)
        a = served.stub(ClientSecurity(token=TOKEN_A))
        sid = (await a.CreateSession(pb.CreateSessionRequest(client_label="kept"))).session_id
        await a.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        fork = (await a.ForkSession(pb.ForkSessionRequest(session_id=sid))).session_id
        want = await _generate(a, fork, 6)  # the reference continuation
        before = await a.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        await _settled(p)
        assert await p.close() == 0  # every file was already up to date
    async with serving(engine, security) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path / "s", 1, 0)
        a, b = served.stub(ClientSecurity(token=TOKEN_A)), served.stub(ClientSecurity(token=TOKEN_B))
        info = await a.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert (info.state_digest, info.client_label, info.created_unix_nanos) == \
            (before.state_digest, "kept", before.created_unix_nanos)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await b.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))  # the owner is kept
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        assert await _generate(a, sid, 6) == want
        assert len(await _generate(a, fork, 2)) == 2  # the fork was persisted too
        await a.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[3, 4]))
        await _settled(p)
        p.store.on_change = None  # stop following: the next file must come from close()
        await a.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[5]))
        p.store.on_change = p._changed
        p._unwritten[sid] = 1
        assert await p.close() == 1
        assert _history(p.path(sid)) == len(PROMPT) + 6 + 3


async def test_every_n_calls_and_the_tick(engine, tmp_path):
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 3, 0.2)
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id  # call 1
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:5]))  # call 2
        await _settled(p)
        assert not p.path(sid).exists()
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[5:9]))  # call 3: written
        await _settled(p)
        assert _history(p.path(sid)) == 9
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[9:12]))
        for _ in range(100):  # the tick writes what the call count did not
            await asyncio.sleep(0.05)
            await _settled(p)
            if _history(p.path(sid)) == 12:
                break
        assert _history(p.path(sid)) == 12
        await p.close()


async def test_bad_files_are_set_aside_and_the_pool_bounds_the_restore(engine, tmp_path):
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)
        stub = served.stub()
        sids = [(await stub.CreateSession(pb.CreateSessionRequest())).session_id for _ in range(3)]
        for sid in sids:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:7]))
        await _settled(p)
        await p.close()
    damaged = p.path(sids[0])
    damaged.write_bytes(damaged.read_bytes()[:-10])  # a torn file (as if written without the rename)
    renamed = tmp_path / "session-000000000000.iesnap"
    p.path(sids[1]).rename(renamed)  # a file that does not name the session it holds
    partial = tmp_path / ".session-abc.iesnap.tmp-99"
    partial.write_bytes(b"partial")
    async with serving(engine, max_sessions=1) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)
        assert not partial.exists() and (tmp_path / (damaged.name + ".rejected")).exists()
        assert (tmp_path / (renamed.name + ".rejected")).exists()
        assert [s.session_id for s in served.runtime.store.sessions()] == [sids[2]]
    async with serving(engine, max_sessions=0 + 1) as served:  # full pool: the file stays for a later start
        await served.stub().CreateSession(pb.CreateSessionRequest())
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)
        assert p.path(sids[2]).exists() and served.runtime.store.slabs_in_use == 1


def test_a_write_that_dies_before_its_rename_leaves_the_previous_file(tmp_path, monkeypatch):
    target = tmp_path / "session-x.iesnap"
    snapshot_files.write_atomic(target, b"first")

    def crash(*_):
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        snapshot_files.write_atomic(target, b"second")
    assert target.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == [target.name]


async def test_failed_writes_are_logged_and_retried(engine, tmp_path, caplog, monkeypatch):
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await _settled(p)

        def disk_full(path, data):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(persistence_module, "write_atomic", disk_full)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:4]))
        await _settled(p)
        stale = p.path(sid).with_name(p.path(sid).name + persistence_module.STALE)
        assert "could not be written" in caplog.text and p._unwritten[sid] == 1 and _history(stale) == 0
        assert not p.path(sid).exists()  # set aside: never restored as if current
        assert await p.close() == 0 and "could not be written at shutdown" in caplog.text
        monkeypatch.undo()
        assert await p.close() == 1 and _history(p.path(sid)) == 4  # retried: nothing lost
        assert not stale.exists()
        assert await open_persistence(SessionTransfer(served.runtime), None, 1, 0) is None


def test_flags_build_the_config(tmp_path):
    import argparse

    from inference_engine.config import add_server_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    cfg = config_from_args(parser.parse_args(["--persist-sessions", str(tmp_path), "--persist-every", "3",
                                              "--persist-interval", "5", "--snapshot-dir", str(tmp_path),
                                              "--max-snapshot-bytes", "1000"]))
    assert (cfg.persist_dir, cfg.persist_every, cfg.persist_interval_s) == (tmp_path, 3, 5.0)
    assert (cfg.snapshot_dir, cfg.max_snapshot_bytes) == (tmp_path, 1000)
    for bad in (["--persist-every", "0"], ["--persist-interval", "-1"], ["--max-snapshot-bytes", "0"]):
        with pytest.raises(ValueError, match=bad[0]):
            config_from_args(parser.parse_args(bad))


def _parsed(*flags: str):
    import argparse

    from inference_engine.config import add_server_flags, config_from_args

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    return config_from_args(parser.parse_args(list(flags)))


@pytest.mark.parametrize("flag", ["--persist-sessions", "--snapshot-dir"])
def test_a_folder_flag_that_cannot_hold_files_is_refused_at_start_up(tmp_path, monkeypatch, flag):
    """Not by the first write (which would log a WARNING per call and lose every session at SIGTERM)."""
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    sub = a_file / "sub"  # refused even for root, whom permission bits do not stop
    for folder, message in ((a_file, f"{a_file} exists and is not a folder"),
                            (sub, f"{sub} is not a writable folder (Not a directory)")):
        with pytest.raises(ValueError) as err:
            _parsed(flag, str(folder))
        assert str(err.value) == f"{flag}: {message}"
    made = tmp_path / "new" / "folder"
    assert _parsed(flag, str(made)) and made.is_dir() and made.stat().st_mode & 0o777 == 0o700  # made, private
    assert list(made.iterdir()) == []  # the probe file is gone

    def read_only(path, *args):  # what a read-only mount or `chattr +i` does, even to root
        raise OSError(30, "Read-only file system", str(path))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ValueError, match=f"^{flag}: {made} is not a writable folder \\(Read-only file system\\)$"):
        _parsed(flag, str(made))


async def test_open_persistence_refuses_a_folder_it_cannot_write(engine, tmp_path, monkeypatch):
    """The same check when the runtime is built without the flags: the server stops before SERVING."""
    (tmp_path / "a-file").write_bytes(b"x")
    async with serving(engine) as served:
        with pytest.raises(NotADirectoryError, match="a-file/sub is not a writable folder"):
            await open_persistence(SessionTransfer(served.runtime), tmp_path / "a-file" / "sub", 1, 0)

        def denied(path, *args):
            raise PermissionError(13, "Permission denied", str(path))

        monkeypatch.setattr(os, "open", denied)
        with pytest.raises(PermissionError, match=r"is not a writable folder \(Permission denied\)"):
            await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)


async def test_files_are_private_whatever_the_umask(engine, tmp_path):
    folder = tmp_path / "sessions"
    previous = os.umask(0)  # the most permissive: nothing but the code keeps other users out
    try:
        async with serving(engine) as served:
            p = await open_persistence(SessionTransfer(served.runtime), folder, 1, 0)
            sid = (await served.stub().CreateSession(pb.CreateSessionRequest())).session_id
            await _settled(p)
            assert folder.stat().st_mode & 0o777 == 0o700 and p.path(sid).stat().st_mode & 0o777 == 0o600
            p.path(sid).chmod(0o644)  # a file written by an earlier version is replaced by a private one
            await served.stub().AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:3]))
            await _settled(p)
            assert p.path(sid).stat().st_mode & 0o777 == 0o600 and _history(p.path(sid)) == 3
            await p.close()
    finally:
        os.umask(previous)
    leftover = tmp_path / ".x.iesnap.tmp-1"
    target = tmp_path / "x.iesnap"
    leftover.write_bytes(b"old")
    leftover.chmod(0o666)
    snapshot_files.write_atomic(target, b"new")
    assert target.stat().st_mode & 0o777 == 0o600


async def test_the_restore_names_the_limit_that_stops_it(engine, tmp_path, caplog):
    async with serving(engine) as served:
        p = await open_persistence(SessionTransfer(served.runtime), tmp_path, 1, 0)
        for _ in range(3):
            await served.stub().CreateSession(pb.CreateSessionRequest())
        per_session = served.runtime.store.kv_bytes_in_use() // 3
        await _settled(p)
        await p.close()
    async with serving(engine, max_kv_bytes=per_session * 3 // 2) as served:  # room for one, 8 slabs
        assert await SessionPersistence(SessionTransfer(served.runtime), tmp_path).restore_all() == 1
    assert f"--max-kv-bytes {per_session * 3 // 2} reached: session-" in caplog.text
    assert "--max-sessions" not in caplog.text and "--max-kv-bytes is" in caplog.text  # the store's numbers too
    caplog.clear()
    async with serving(engine, max_sessions=2) as served:
        assert await SessionPersistence(SessionTransfer(served.runtime), tmp_path).restore_all() == 2
    assert "--max-sessions 2 reached: session-" in caplog.text and "--max-kv-bytes" not in caplog.text
