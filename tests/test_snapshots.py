"""SnapshotSession / RestoreSession / ForkSession over a real grpc.aio server (tiny model): exact round
trips and forks, files under --snapshot-dir, and every refusal (corrupt, truncated, foreign, another
version or fingerprint field, over the limits, pool full) with its code, its message, the pool slot
returned and the original session intact."""

import asyncio
import dataclasses
import hashlib
import json
import os
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.errors import InvalidRequest
from inference_engine.runtime import session_transfer as session_transfer_module
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.session_transfer import RestoreParams, SessionTransfer
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.session import snapshot_format as fmt
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile
from tests.ops_helpers import serving
from tests.tiny_models import random_model

PROMPT = np.random.default_rng(9).integers(2, 256, 40).tolist()
MORE = [7, 9, 11, 200, 3]
SINK, WINDOW = 4, 16  # the window wraps within PROMPT


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


async def _session(stub, tokens=PROMPT, **kw) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW, **kw))).session_id
    if tokens:
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens))
    return sid


async def _generate(stub, sid, n, mode=pb.DECODE_MODE_GREEDY) -> list[int]:
    out = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode,
                                                      num_draft_tokens=4)):
        out += list(msg.tokens)
    return out


async def _info(stub, sid) -> pb.GetSessionInfoResponse:
    return await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))


async def _error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def _reason(err: grpc.aio.AioRpcError) -> str:
    for packed in rpc_status.from_call(err).details:
        info = error_details_pb2.ErrorInfo()
        if packed.Unpack(info):
            return info.reason
    raise AssertionError("no ErrorInfo")


def _resigned(data: bytes, header_edit=None, version: int | None = None) -> bytes:
    """The snapshot with its header edited (a function of the JSON dict) and/or another version, re-checksummed."""
    _, v, head_len = struct.unpack_from("<8sII", data)
    header = json.loads(data[16 : 16 + head_len])
    if header_edit is not None:
        header_edit(header)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    body = struct.pack("<8sII", fmt.MAGIC, v if version is None else version, len(head)) + head + \
        data[16 + head_len : -32]
    return body + hashlib.sha256(body).digest()


async def test_restore_and_fork_continue_bitwise(engine):
    async with running_server(engine) as (stub, runtime):
        sid = await _session(stub, client_label="talk", eos_token_ids=[5, 6])
        await _generate(stub, sid, 6, pb.DECODE_MODE_SPECULATIVE_LOOKUP)  # rollbacks on the way
        data = await snapshot_bytes(stub, sid)
        info = await _info(stub, sid)
        restored = await restore_bytes(stub, data)
        assert (restored.state_digest, restored.history_length) == (info.state_digest, info.history_length)
        assert (restored.sink_tokens, restored.window_tokens) == (SINK, WINDOW)
        copy = await _info(stub, restored.session_id)
        assert copy.state_digest == info.state_digest and copy.client_label == "talk"
        assert list(copy.eos_token_ids) == [5, 6] and copy.kv_bytes == info.kv_bytes
        assert copy.history_length == copy.next_global_position == len(PROMPT) + 6
        # Both continue alike, and independently.
        assert await _generate(stub, restored.session_id, 8) == await _generate(stub, sid, 8)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=MORE))
        assert (await _info(stub, restored.session_id)).history_length == len(PROMPT) + 14
        # A snapshot of the copy is the same file as one of the original at the same point.
        assert await snapshot_bytes(stub, restored.session_id) != data
        fork = await stub.ForkSession(pb.ForkSessionRequest(session_id=restored.session_id))
        assert fork.state_digest == (await _info(stub, restored.session_id)).state_digest
        assert await snapshot_bytes(stub, fork.session_id) == await snapshot_bytes(stub, restored.session_id)
        assert runtime.store.slabs_in_use == 3


async def test_two_forks_with_the_same_appends_equal_a_fresh_session(engine):
    async with running_server(engine) as (stub, _):
        base = await _session(stub)
        history = PROMPT + await _generate(stub, base, 5)
        forks = [(await stub.ForkSession(pb.ForkSessionRequest(session_id=base))).session_id for _ in range(2)]
        for f in forks:
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=f, tokens=MORE))
        fresh = await _session(stub, history + MORE)
        digests = {(await _info(stub, s)).state_digest for s in forks + [fresh]}
        assert len(digests) == 1
        assert await _generate(stub, forks[0], 6) == await _generate(stub, forks[1], 6) == \
            await _generate(stub, fresh, 6)
        assert (await _info(stub, base)).history_length == len(history)  # the original untouched


async def test_snapshot_of_an_empty_session(engine):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub, tokens=[])
        restored = await restore_bytes(stub, await snapshot_bytes(stub, sid))
        assert restored.history_length == 0 and restored.state_digest == (await _info(stub, sid)).state_digest
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=restored.session_id, tokens=PROMPT))


async def test_snapshot_dir_files_belong_to_their_writer(engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(engine, security, snapshot_dir=tmp_path) as served:
        a, b = served.stub(ClientSecurity(token=TOKEN_A)), served.stub(ClientSecurity(token=TOKEN_B))
        sid = await _session(a)
        (msg,) = [m async for m in a.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
        assert msg.file.endswith(".iesnap") and not msg.data and (tmp_path / msg.file).stat().st_size == \
            msg.snapshot_bytes
        assert msg.history_length == len(PROMPT) and msg.state_digest == (await _info(a, sid)).state_digest
        restored = await a.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)]))
        assert restored.state_digest == msg.state_digest
        stolen = await _error(b.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)])))
        missing = await _error(b.RestoreSession(iter([pb.RestoreSessionRequest(file="snap-nope.iesnap")])))
        assert stolen.code() == missing.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert stolen.details().replace(msg.file, "F") == missing.details().replace("snap-nope.iesnap", "F")
        bad = await _error(a.RestoreSession(iter([pb.RestoreSessionRequest(file="../etc/passwd")])))
        assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "plain name" in bad.details()
        assert served.runtime.store.slabs_in_use == 2


async def test_request_shape_errors(engine):
    async with running_server(engine, max_snapshot_bytes=1000) as (stub, runtime):
        sid = await _session(stub)
        snap = await snapshot_bytes(stub, sid)
        # Each call starts only when its turn comes (a call object starts its RPC when made): made
        # all at once, the restores would run side by side and meet --max-transfers-per-identity.
        cases = [
            (lambda: stub.RestoreSession(iter([])), grpc.StatusCode.INVALID_ARGUMENT, "needs the snapshot"),
            (lambda: stub.RestoreSession(iter([pb.RestoreSessionRequest(file="a.iesnap", data=b"x")])),
             grpc.StatusCode.INVALID_ARGUMENT, "must come alone"),
            (lambda: stub.RestoreSession(iter([pb.RestoreSessionRequest(data=b"x" * 600)] * 2)),
             grpc.StatusCode.INVALID_ARGUMENT, "not an inference_engine session snapshot"),
            (lambda: restore_bytes(stub, snap), grpc.StatusCode.INVALID_ARGUMENT,
             "bytes; allowed up to 1000 (--max-snapshot-bytes)"),
            (lambda: stub.RestoreSession(iter([pb.RestoreSessionRequest(file="a.iesnap")])),
             grpc.StatusCode.FAILED_PRECONDITION, "--snapshot-dir"),
            (lambda: _drain(stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))),
             grpc.StatusCode.FAILED_PRECONDITION, "--snapshot-dir"),
            (lambda: _drain(stub.SnapshotSession(pb.SnapshotSessionRequest(session_id="nope"))),
             grpc.StatusCode.NOT_FOUND, "'nope'"),
            (lambda: stub.ForkSession(pb.ForkSessionRequest(session_id="nope")), grpc.StatusCode.NOT_FOUND, "'nope'"),
            (lambda: stub.ForkSession(pb.ForkSessionRequest(session_id="")),
             grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
        ]
        for make, code, fragment in cases:
            err = await _error(make())
            assert err.code() == code and fragment in err.details(), err
        assert runtime.store.slabs_in_use == 1


async def _drain(stream) -> list:
    return [m async for m in stream]


@pytest.fixture(scope="module")
def other_engines(tiny):
    """Engines that differ from `engine` in one fingerprint field each (model, block size, mode)."""
    engines = {
        "model": Engine(random_model(seed=1), exact=True, max_tile=16, plain_block=64, max_rollback=8),
        "block_size": Engine(tiny, exact=True, max_tile=4, plain_block=64, max_rollback=8),
        "is_exact": Engine(tiny, exact=False, max_tile=16, plain_block=16, max_rollback=8),
    }
    yield engines
    for e in engines.values():
        e.close()


async def test_every_refusal_fails_closed(engine, other_engines):
    async with running_server(engine) as (stub, runtime):
        sid = await _session(stub)
        await _generate(stub, sid, 3)
        data = await snapshot_bytes(stub, sid)
        before = await _info(stub, sid)
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01

        def edit(section: str, key: str, value: object):
            return lambda h: h[section].__setitem__(key, value)

        invalid = {
            "truncated": data[: len(data) - 100],
            "corrupted": bytes(flipped),
            "foreign": b"\x89PNG\r\n\x1a\n" + bytes(200),
            "tiny": b"IE",
            "digest": _resigned(data, edit("state", "state_digest", "0" * 64)),
            "header": _resigned(data, edit("state", "history_length", "many")),
            "token": _resigned(data, lambda h: h["sections"][0].__setitem__("dtype", "<i8")),
            "label": _resigned(data, edit("session", "client_label", "x" * 300)),
            "eos": _resigned(data, edit("session", "eos_token_ids", [256])),
        }
        incompatible = {
            "version 3": _resigned(data, version=fmt.FORMAT_VERSION + 1),  # a newer format
            "tokenizer": _resigned(data, edit("fingerprint", "tokenizer", "f" * 64)),
            "kernels": _resigned(data, edit("fingerprint", "kernels", "reference: bundled")),
        }
        for name, blob in list(invalid.items()) + list(incompatible.items()):
            err = await _error(restore_bytes(stub, blob))
            want = grpc.StatusCode.INVALID_ARGUMENT if name in invalid else grpc.StatusCode.FAILED_PRECONDITION
            assert err.code() == want, (name, err.details())
            assert _reason(err) == ("SNAPSHOT_CORRUPT" if name in invalid else "SNAPSHOT_INCOMPATIBLE")
            assert name.split()[0] in err.details() or name in invalid, (name, err.details())
            assert runtime.store.slabs_in_use == 1, name  # nothing half restored, the slot returned
        # A snapshot from an engine differing in one fingerprint field names that field.
        for field, other in other_engines.items():
            async with running_server(other) as (other_stub, _):
                foreign_sid = await _session(other_stub)
                blob = await snapshot_bytes(other_stub, foreign_sid)
            err = await _error(restore_bytes(stub, blob))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and field in err.details(), err.details()
            assert runtime.store.slabs_in_use == 1
        after = await _info(stub, sid)
        assert after.state_digest == before.state_digest
    # A sink or window over the restoring server's limits.
    for limits in ({"max_window": 8, "default_window": 8}, {"max_sink": 2, "default_sink": 2}):
        async with running_server(engine, **limits) as (small, small_runtime):
            err = await _error(restore_bytes(small, data))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "sink 4 and window 16" in err.details()
            assert small_runtime.store.slabs_in_use == 0


async def test_pool_full_is_resource_exhausted(engine):
    async with running_server(engine, max_sessions=2) as (stub, runtime):
        a = await _session(stub)
        data = await snapshot_bytes(stub, a)
        await _session(stub, tokens=[])
        for call in (restore_bytes(stub, data), stub.ForkSession(pb.ForkSessionRequest(session_id=a))):
            err = await _error(call)
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 session slabs" in err.details()
        assert runtime.store.slabs_in_use == 2
        await stub.CloseSession(pb.CloseSessionRequest(session_id=a))
        assert (await restore_bytes(stub, data)).history_length == len(PROMPT)


async def test_snapshot_during_a_stream_holds_exactly_what_was_sent(engine):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub)
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=60, ignore_eos=True))
        sent = list((await stream.read()).tokens)
        data = await snapshot_bytes(stub, sid)
        rest = []
        while (msg := await stream.read()) is not grpc.aio.EOF:
            rest += list(msg.tokens)
        snap = fmt.decode(data)
        held = snap.tokens.tolist()
        assert held[: len(PROMPT)] == PROMPT and len(held) >= len(PROMPT) + len(sent)
        assert held == (PROMPT + sent + rest)[: len(held)]
        restored = await restore_bytes(stub, data)
        n = 60 - (len(held) - len(PROMPT))
        assert await _generate(stub, restored.session_id, n) == (sent + rest)[len(held) - len(PROMPT) :]


async def test_file_restore_checks_owner_at_the_runtime(engine, tmp_path):
    async with running_server(engine, snapshot_dir=tmp_path) as (stub, runtime):
        sid = await _session(stub)
        (msg,) = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
        transfer = SessionTransfer(runtime)
        with pytest.raises(InvalidRequest, match="no snapshot file") as theirs:
            await transfer.restore(RestoreParams(b"", msg.file, owner="someone-else"))
        missing = "x" * (len(msg.file) - len(".iesnap")) + ".iesnap"
        with pytest.raises(InvalidRequest) as absent:
            await transfer.restore(RestoreParams(b"", missing, owner="someone-else"))
        assert str(theirs.value).replace(msg.file, missing) == str(absent.value)  # the same words: nothing revealed
        assert "SnapshotSession wrote there for the same caller" in str(absent.value)
        snap = fmt.decode((tmp_path / msg.file).read_bytes())
        assert snap.identity.owner == "anonymous" and snap.identity.session_id == sid
        streamed = fmt.decode(await snapshot_bytes(stub, sid))
        assert streamed.identity is None  # bytes handed to a client never carry ids or owners
        assert dataclasses.replace(streamed, identity=snap.identity).state_digest == snap.state_digest


async def test_concurrent_restores_for_the_last_slot(engine):
    async with running_server(engine, max_sessions=2) as (stub, runtime):
        data = await snapshot_bytes(stub, await _session(stub))
        results = await asyncio.gather(restore_bytes(stub, data), restore_bytes(stub, data), return_exceptions=True)
        codes = sorted(r.code().name if isinstance(r, grpc.aio.AioRpcError) else "OK" for r in results)
        assert codes == ["OK", "RESOURCE_EXHAUSTED"] and runtime.store.slabs_in_use == 2


async def test_snapshot_folder_and_files_are_private(engine, tmp_path):
    folder = tmp_path / "snaps"  # named but not made yet: made at the first to_dir, 0700
    previous = os.umask(0)  # the most permissive: nothing but the code keeps other users out
    try:
        async with running_server(engine, snapshot_dir=folder) as (stub, runtime):
            sid = await _session(stub)
            (msg,) = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
    finally:
        os.umask(previous)
    assert folder.stat().st_mode & 0o777 == 0o700 and (folder / msg.file).stat().st_mode & 0o777 == 0o600


async def test_a_snapshot_folder_that_fails_at_call_time_is_failed_precondition(engine, tmp_path, monkeypatch):
    """The folder was fine at start-up, then replaced by a file, removed or filled: a classified error naming
    the cause and what to do instead, never INTERNAL; nothing left behind, the session intact."""
    folder = tmp_path / "snaps"
    async with running_server(engine, snapshot_dir=folder) as (stub, runtime):
        sid = await _session(stub)
        (msg,) = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
        before = await _info(stub, sid)

        def disk_full(path, data):
            raise OSError(28, "No space left on device", str(path))

        monkeypatch.setattr(session_transfer_module, "write_atomic", disk_full)
        err = await _error(_drain(stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and _reason(err) == "FAILED_PRECONDITION"
        assert err.details() == "the server's snapshot folder could not be written (No space left on device); take " \
            "the snapshot as bytes instead (to_dir false)"
        monkeypatch.undo()

        def unreadable(folder, name, limit):
            raise PermissionError(13, "Permission denied", str(folder / name))

        monkeypatch.setattr(session_transfer_module, "open_snapshot", unreadable)
        err = await _error(stub.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)])))
        monkeypatch.undo()
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "could not be read (Permission denied)" in \
            err.details() and "send the snapshot's bytes instead" in err.details()

        (folder / msg.file).unlink()
        folder.rmdir()
        folder.write_bytes(b"not a folder")  # replaced by a regular file
        err = await _error(_drain(stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "could not be created (it is not a folder)" in \
            err.details()
        err = await _error(stub.RestoreSession(iter([pb.RestoreSessionRequest(file=msg.file)])))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "it is not a folder" in err.details()
        assert folder.read_bytes() == b"not a folder" and runtime.store.slabs_in_use == 1
        assert (await _info(stub, sid)).state_digest == before.state_digest
        folder.unlink()  # removed meanwhile: made again
        (msg,) = [m async for m in stub.SnapshotSession(pb.SnapshotSessionRequest(session_id=sid, to_dir=True))]
        assert [p.name for p in folder.iterdir()] == [msg.file]


def test_the_vocabulary_digest_is_computed_once_per_tokenizer():
    """~0.3 s per call on a real vocabulary: a snapshot's fingerprint must not pay it each time."""
    from inference_engine.runtime.session_transfer import vocabulary_digest

    class Vocab:  # counts the reads of its vocabulary
        reads = 0

        def get_vocab(self):
            Vocab.reads += 1
            return {"a": 0, "b": 1}

    tokenizer = Vocab()
    assert vocabulary_digest(tokenizer) == vocabulary_digest(tokenizer) and Vocab.reads == 1
