"""RuntimeService over a route of real `shard-worker` processes (packaged SmolLM2-135M, layers
0:10 / 10:20 / 20:30): token streams and state_digest equal the single process through a
window wrap and speculative rollbacks; a dead worker means UNAVAILABLE until it is back;
with `serve --spawn-shards` a worker SIGKILLed mid-Generate is restarted and the stream
continues exactly as an uninterrupted run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import jsonschema
import numpy as np
import pytest

from inference_engine.config import add_server_flags, config_from_args
from inference_engine.errors import InvalidRequest
from inference_engine.model.loader import model_fingerprint
from inference_engine.readiness import wait_ready
from inference_engine.runtime.engine import Engine
from inference_engine.server import server as server_module
from inference_engine.server.server import connect_shards
from inference_engine.serving_path import kernels_in_use
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from inference_engine.execution.executor import LocalBackend
from tests.conftest import make_config, running_server
from tests.shard_helpers import running_workers, spawn_worker, worker_ready

pytestmark = pytest.mark.real_model
SINK, WINDOW = 4, 24  # small: the ring wraps within the script
RANGES = ("0:10", "10:20", "20:30")
PROMPT = np.random.default_rng(11).integers(0, 49152, 40).tolist()
MORE = np.random.default_rng(12).integers(0, 49152, 7).tolist()


def _spawn_worker(layers: str, port: int = 0) -> subprocess.Popen:
    return spawn_worker(layers, port=port)  # the workers' defaults cover the server's defaults


@pytest.fixture(scope="module")
def workers(real_model_path):
    with running_workers([_spawn_worker(r) for r in RANGES]) as w:
        yield w


async def _generate(stub, sid: str, n: int, mode=pb.DECODE_MODE_GREEDY, kill=None) -> list[int]:
    tokens: list[int] = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode,
                                                      num_draft_tokens=4)):
        tokens += list(msg.tokens)
        if kill is not None and len(tokens) >= 8:
            kill()
            kill = None
    return tokens


async def _script(stub, kill=None) -> tuple[list[int], str, pb.GetSessionInfoResponse]:
    """Prefill, greedy, an append, speculative lookup (rollbacks), greedy past the wrap."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
    stream = await _generate(stub, sid, 20)
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=MORE + stream[-6:]))
    stream += await _generate(stub, sid, 16, mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP)
    stream += await _generate(stub, sid, 40, kill=kill)
    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
    assert info.history_length > SINK + WINDOW + 16 + 9  # the ring wrapped
    return stream, sid, info


@pytest.fixture(scope="module")
def single_process(real_engine) -> tuple[list[int], str]:
    """The uninterrupted single-process run of the script: its stream and final digest."""
    async def run() -> tuple[list[int], str]:
        async with running_server(real_engine) as (stub, _):
            stream, _, info = await _script(stub)
        return stream, info.state_digest

    return asyncio.run(run())


@contextlib.asynccontextmanager
async def route_engine(real_model, addresses, recovery_s: float):
    route = ShardRoute(addresses, recovery_s, retry_interval_s=0.1)
    await route.start()
    engine = Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    try:
        engine.use_backend(RouteBackend(route, real_model.spec, engine.block))
        yield engine
    finally:
        route.is_closed = True
        await asyncio.to_thread(engine.close)
        await route.stop()


async def test_route_serves_bitwise_the_single_process(workers, real_model, single_process):
    _, addresses = workers
    async with route_engine(real_model, addresses, 5.0) as engine, running_server(engine) as (stub, _):
        stream, _, info = await _script(stub)
        assert engine.backend.route.pipeline.hop_stats()[2].calls > 0
    want_stream, want_digest = single_process
    assert stream == want_stream and len(stream) == 76
    assert info.state_digest == want_digest and info.exact and info.kv_bytes > 0


async def test_dead_worker_is_unavailable_until_it_is_back(workers, real_model, single_process):
    procs, addresses = workers
    async with route_engine(real_model, addresses, 1.0) as engine, running_server(engine) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[:30]))
        procs[2].kill()
        procs[2].wait()
        for call in (stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[30:])),
                     stub.CreateSession(pb.CreateSessionRequest())):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "is not answering" in err.value.details() and "retry shortly" in err.value.details()
        procs[2] = _spawn_worker(RANGES[2], int(addresses[2].rsplit(":", 1)[1]))
        assert worker_ready(procs[2]) == addresses[2]
        for attempt in range(30):  # the contract is "UNAVAILABLE: retry shortly": the channel may still be backing off
            try:
                r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT[30:]))
                break
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < 29, exc
                await asyncio.sleep(0.5)
        assert r.history_length == r.next_global_position == len(PROMPT)
        first = await _generate(stub, sid, 20)
    assert first == single_process[0][:20]  # replayed from the history: exactly where it left off


def _server_log_pids(path, timeout_s: float = 10.0) -> dict[str, int]:
    """Latest pid of each spawned worker from the server's log (timeout_s=0: what is there now)."""
    end = time.monotonic() + timeout_s
    while True:
        found = dict(re.findall(r"shard worker (\d+:\d+) \(pid (\d+)\) serves at", path.read_text()))
        if len(found) == len(RANGES) or time.monotonic() >= end:
            if len(found) < len(RANGES) and timeout_s:
                raise AssertionError(path.read_text())
            return {k: int(v) for k, v in found.items()}
        time.sleep(0.1)


async def test_spawned_worker_killed_or_hung_mid_generate_continues_exactly(real_model_path, single_process,
                                                                             tmp_path):
    """Two sessions at once (their blocks share Batch messages): one SIGKILLs the middle worker mid-Generate,
    the other SIGSTOPs the tail. The dead worker is restarted; the hung one misses its step deadline and is
    killed by the supervisor, then restarted; both streams continue exactly."""
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log_file:
        server = subprocess.Popen(
            [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--spawn-shards", ",".join(RANGES),
             "--draft-model", "none", "--max-sessions", "2", "--grace", "1", "--max-tile", "16",  # single_process's
             "--shard-step-timeout", "3"],
            stdout=subprocess.PIPE, stderr=log_file, text=True,
        )
    try:
        address = wait_ready(server)
        pids = _server_log_pids(log_path)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.RuntimeServiceStub(channel)
            (stream, _, info), (other, _, other_info) = await asyncio.gather(
                _script(stub, kill=lambda: _kill(pids["10:20"])),
                _script(stub, kill=lambda: _kill(pids["20:30"], signal.SIGSTOP)))
        logged = log_path.read_text()
        assert "shard worker 10:20" in logged.split("exited with status -9; restarting it")[0]
        assert f"shard worker 20:30 (pid {pids['20:30']}) at " in logged and "3 s deadline; killing it" in logged
        assert stream == other == single_process[0]
        assert info.state_digest == other_info.state_digest == single_process[1]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        after = _server_log_pids(log_path)
        assert after["10:20"] != pids["10:20"] and after["20:30"] != pids["20:30"]  # restarted: their own pids
        for pid in after.values():
            with pytest.raises(ProcessLookupError):
                _kill(pid, 0)  # every worker ended with the server
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)  # a clean stop takes its workers with it
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        for pid in _server_log_pids(log_path, timeout_s=0).values():
            with contextlib.suppress(ProcessLookupError):
                _kill(pid)  # a worker the server could not stop


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


async def test_connect_shards_checks_the_route(workers, real_model, real_engine, tiny, monkeypatch):
    _, addresses = workers
    engine = Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    try:
        route, supervisor = await connect_shards(make_config(shards=tuple(addresses)), engine)
        assert supervisor is None and engine.backend.route is route and route.pipeline.max_rollback >= 9
        fingerprint, kernels = model_fingerprint(real_model.model), kernels_in_use()  # what the server checks the route with
        with pytest.raises(InvalidRequest, match="needs block 4096 .* and rollback 9"):
            route.check_serves(fingerprint, kernels, 4096, 9)
        with pytest.raises(InvalidRequest, match="this server loaded"):
            route.check_serves(model_fingerprint(tiny.model), kernels, 1, 1)
        with pytest.raises(InvalidRequest, match="same BLAS and kernel"):
            route.check_serves(fingerprint, "reference: bundled", 1, 1)
        await route.stop()
        with monkeypatch.context() as m:  # a server on other kernels than its workers refuses the route
            m.setattr(server_module, "kernels_in_use", lambda: "reference: bundled")
            with pytest.raises(OSError, match="same BLAS and kernel"):
                await connect_shards(make_config(shards=tuple(addresses)), engine)
    finally:
        engine.close()
    assert await connect_shards(make_config(), real_engine) == (None, None)
    with pytest.raises(OSError, match="shard route 127.0.0.1:1: "):  # after waiting the recovery timeout for it
        await connect_shards(make_config(shards=("127.0.0.1:1",), shard_recovery_timeout_s=1.0), real_engine)
    assert isinstance(real_engine.backend, LocalBackend)


@pytest.mark.parametrize("flags,expected", [
    (["--shards", "127.0.0.1:7001, 127.0.0.1:7002"], {"shards": ("127.0.0.1:7001", "127.0.0.1:7002")}),
    (["--spawn-shards", "0:10,10:30", "--shard-recovery-timeout", "5", "--shard-step-timeout", "2"],
     {"spawn_shards": ("0:10", "10:30"), "shard_recovery_timeout_s": 5.0, "shard_step_timeout_s": 2.0}),
    ([], {"shards": (), "spawn_shards": (), "shard_step_timeout_s": 30.0}),
])
def test_shard_flags(flags, expected):
    cfg = config_from_args(_parser().parse_args(flags))
    assert {k: getattr(cfg, k) for k in expected} == expected


@pytest.mark.parametrize("flags", [["--shards", "7001"], ["--spawn-shards", "0-10"], ["--shard-recovery-timeout", "0"],
                                   ["--shard-step-timeout", "0"]])
def test_bad_shard_flags(flags):
    with pytest.raises(ValueError, match=flags[0]):
        config_from_args(_parser().parse_args(flags))


def test_shards_and_spawn_shards_exclude_each_other():
    with pytest.raises(SystemExit):
        _parser().parse_args(["--shards", "h:1", "--spawn-shards", "0:30"])


def _parser():
    import argparse

    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    return parser


async def test_route_samples_bitwise_the_single_process(workers, real_model, real_engine):
    """Seeded sampling (plain and prompt lookup, in bursts) on the 3-worker route equals one process."""
    _, addresses = workers
    sampled = dict(temperature=0.8, top_p=0.9, repetition_penalty=1.1, seed=7)

    async def run(stub) -> tuple[list[int], str]:
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        out: list[int] = []
        for n, mode in ((5, pb.DECODE_MODE_GREEDY), (8, pb.DECODE_MODE_SPECULATIVE_LOOKUP), (11, pb.DECODE_MODE_GREEDY)):
            req = pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True, mode=mode, num_draft_tokens=4,
                                     **sampled)
            out += [t async for m in stub.Generate(req) for t in m.tokens]
        return out, (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest

    async with running_server(real_engine) as (stub, _):
        want = await run(stub)
    async with route_engine(real_model, addresses, 5.0) as engine, running_server(engine) as (stub, _):
        got = await run(stub)
    assert got == want and len(want[0]) == 24 and len(set(want[0])) > 5


async def test_route_serves_a_constrained_stream_bitwise_the_single_process(workers, real_model, real_engine):
    """A JSON-schema constrained stream on the 3-worker route (greedy in one call; seeded in bursts with prompt
    lookup, so drafts are rolled back on the workers, past the window wrap) equals one process, stop reason too."""
    _, addresses = workers
    colors = {"type": "array", "items": {"enum": ["red", "green", "yellow"]}, "maxItems": 3}
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "colors": colors},
              "required": ["name", "colors"], "additionalProperties": False}
    constraint = pb.Constraint(json_schema=json.dumps(schema))
    text = 'Repeat this JSON exactly: {"name": "banana", "colors": ["yellow", "green"]}'
    messages = [pb.ChatMessage(role="user", content=text)]

    async def run(stub) -> list[tuple[list[int], int, str, list[int]]]:
        """Per arm: tokens, stop reason, state digest, [drafted, accepted]."""
        out = []
        for width, kw in ((48, {}), (5, dict(mode=pb.DECODE_MODE_SPECULATIVE_LOOKUP, temperature=0.6, seed=7))):
            sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))).session_id
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=messages,
                                                           add_generation_prompt=True))
            tokens, reason, drafts = [], pb.STOP_REASON_MAX_TOKENS, [0, 0]
            while reason == pb.STOP_REASON_MAX_TOKENS and len(tokens) < 48:
                msgs = [m async for m in stub.Generate(pb.GenerateRequest(
                    session_id=sid, max_new_tokens=min(width, 48 - len(tokens)), constraint=constraint,
                    num_draft_tokens=4, **kw))]
                tokens, reason = tokens + [t for m in msgs for t in m.tokens], msgs[-1].stop_reason
                drafts = [drafts[0] + msgs[-1].drafted_tokens, drafts[1] + msgs[-1].accepted_tokens]
            info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
            assert info.history_length > SINK + WINDOW  # the ring wrapped
            out.append((tokens, reason, info.state_digest, drafts))
            await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        return out

    async with running_server(real_engine) as (stub, _):
        want = await run(stub)
    async with route_engine(real_model, addresses, 5.0) as engine, running_server(engine) as (stub, _):
        got = await run(stub)
        assert engine.backend.route.pipeline.hop_stats()[2].calls > 0
    assert got == want
    drafted, accepted = want[1][3]
    assert 0 < accepted < drafted, want[1][3]  # prompt lookup drafts were accepted, and one rolled back
    for tokens, reason, _, _ in want:
        assert reason == pb.STOP_REASON_CONSTRAINT_COMPLETE
        jsonschema.validate(json.loads(real_model.tokenizer.decode(tokens)), schema)


async def test_a_stopped_worker_fails_generate_unavailable_within_the_recovery_timeout(workers, real_model,
                                                                                     single_process):
    """A worker that stops answering (SIGSTOP) mid-Generate: the stream fails UNAVAILABLE once the route
    has been silent for --shard-recovery-timeout (it ended OK with stop reason CANCELLED after a fixed
    120 s step deadline), keeping the tokens it sent; SIGCONT, and the session continues exactly."""
    procs, addresses = workers
    engine = Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8)
    route, _ = await connect_shards(make_config(shards=tuple(addresses), shard_recovery_timeout_s=3.0), engine)
    stopped: list[bool] = []
    try:
        async with running_server(engine) as (stub, _):
            created = await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=SINK, window_tokens=WINDOW))
            sid = created.session_id
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
            got: list[int] = []

            async def stream() -> None:
                async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=20, ignore_eos=True)):
                    got.extend(msg.tokens)
                    if len(got) >= 5 and not stopped:
                        _kill(procs[1].pid, signal.SIGSTOP)
                        stopped.append(True)

            with pytest.raises(grpc.aio.AioRpcError) as err:
                await asyncio.wait_for(stream(), 60)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
            assert "the session is kept" in err.value.details()  # the recovery timeout ended it, not the guard
            assert re.search(r"recovery timeout \(3 s\)|within 3\.0 s", err.value.details()), err.value.details()
            assert 5 <= len(got) < 20 and got == single_process[0][: len(got)]
            _kill(procs[1].pid, signal.SIGCONT)
            stopped.clear()
            for attempt in range(30):  # "UNAVAILABLE: retry shortly"
                try:
                    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < 29, exc
                    await asyncio.sleep(0.5)
            assert info.history_length == len(PROMPT) + len(got)  # what the client saw
            got += await _generate(stub, sid, 20 - len(got))
        assert got == single_process[0][:20]
    finally:
        if stopped:
            _kill(procs[1].pid, signal.SIGCONT)
        route.is_closed = True
        await asyncio.to_thread(engine.close)
        await route.stop()
