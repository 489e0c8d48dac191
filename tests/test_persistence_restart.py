"""`serve --persist-sessions` as real processes on the packaged model: a server killed with SIGKILL and
started again continues its sessions (ids, digests, next tokens) from the last after-call write; a
SIGTERM mid-Generate drains the stream, writes the session, and the next start continues it; and a
snapshot streamed out of one server process restores bitwise into another."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference_engine.client.snapshots import restore_bytes_sync, snapshot_bytes_sync
from inference_engine.readiness import wait_ready
from inference_engine.session.snapshot_format import decode
from inference_engine.short_id import short_id
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

pytestmark = pytest.mark.real_model
PROMPT = np.random.default_rng(31).integers(0, 49152, 40).tolist()


def _start(folder: Path) -> tuple[subprocess.Popen, pb_grpc.RuntimeServiceStub]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--draft-model", "none",
         "--max-sessions", "4", "--default-window", "32", "--persist-sessions", str(folder), "--grace", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    return proc, pb_grpc.RuntimeServiceStub(grpc.insecure_channel(wait_ready(proc)))


def _generate(stub, sid: str, n: int) -> list[int]:
    req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)
    return [t for m in stub.Generate(req) for t in m.tokens]


def _written(folder: Path, sid: str, history: int, timeout_s: float = 60.0) -> None:
    """Wait until the session's file holds `history` tokens (the after-call write landed)."""
    path = folder / f"session-{short_id(sid)}.iesnap"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and decode(path.read_bytes()).history_length == history:
            return
        time.sleep(0.05)
    raise AssertionError(f"{path.name} never reached {history} tokens")


def _info(stub, sid: str) -> pb.GetSessionInfoResponse:
    return stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))


def test_sigkill_and_sigterm_restarts_continue_sessions(real_model_path, tmp_path):
    folder = tmp_path / "sessions"
    procs = []
    try:
        proc, stub = _start(folder)
        procs.append(proc)
        sid = stub.CreateSession(pb.CreateSessionRequest(client_label="survivor")).session_id
        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        assert len(_generate(stub, sid, 8)) == 8
        reference = stub.ForkSession(pb.ForkSessionRequest(session_id=sid)).session_id
        want = _generate(stub, reference, 12)  # what `sid` says next, had nothing happened
        before = _info(stub, sid)
        data = snapshot_bytes_sync(stub, sid)
        _written(folder, sid, len(PROMPT) + 8)
        _written(folder, reference, len(PROMPT) + 20)
        proc.kill()  # SIGKILL: no shutdown code runs
        proc.wait()

        proc, stub = _start(folder)
        procs.append(proc)
        after = _info(stub, sid)
        assert (after.state_digest, after.history_length, after.client_label) == \
            (before.state_digest, len(PROMPT) + 8, "survivor")
        assert _info(stub, reference).history_length == len(PROMPT) + 20
        # A snapshot taken by the first process restores bitwise into this one.
        copy = restore_bytes_sync(stub, data)
        assert copy.state_digest == before.state_digest
        assert _generate(stub, copy.session_id, 4) == want[:4]
        # SIGTERM while a Generate streams: the stream is drained, the session written after it.
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=8, ignore_eos=True))
        received = list(next(stream).tokens)
        proc.send_signal(signal.SIGTERM)
        received += [t for m in stream for t in m.tokens]
        assert proc.wait(timeout=120) == 0
        assert received == want[: len(received)] and received

        proc, stub = _start(folder)
        procs.append(proc)
        assert _info(stub, sid).history_length == len(PROMPT) + 8 + len(received)
        assert _generate(stub, sid, 12 - len(received)) == want[len(received) :]
        assert len({_info(stub, s).session_id for s in (sid, reference, copy.session_id)}) == 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    err = procs[-1].stderr.read() if procs[-1].stderr else ""
    assert "restored 3 session(s)" in err, err[-3000:]
