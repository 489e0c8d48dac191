"""Helpers for the shard tests: in-process workers on 127.0.0.1:0, engine chains, frames."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from typing import AsyncIterator, Iterator

import grpc
import numpy as np
import pytest

from inference_engine.readiness import wait_ready
from inference_engine.shard.protocol.types import ShardWork
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.servicer import ShardRuntimeServicer, start_shard_server
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc
from inference_engine.execution.executor import LocalBackend
from inference_engine.execution.kv_cache import CacheGeometry
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.execution.token_log import TokenLog

GEOMETRY = CacheGeometry(sink=2, window=5, max_block=4, max_rollback=4)


@contextlib.asynccontextmanager
async def shard_server(
    engine: MlxShardEngine, max_credits: int = 8,
) -> AsyncIterator[tuple[pb_grpc.ShardRuntimeStub, str, ShardRuntimeServicer]]:
    """A real grpc.aio ShardRuntime server on 127.0.0.1:0; yields a stub, its address and the servicer."""
    server, port, servicer = await start_shard_server(engine, "127.0.0.1", 0, max_credits=max_credits)
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    try:
        yield pb_grpc.ShardRuntimeStub(channel), address, servicer
    finally:
        await channel.close()
        servicer.fail_sessions("test over")
        await server.stop(0.5)
        servicer.close()


def run_chain(chain: list[MlxShardEngine], sid: str, work_id: int, position: int, tokens: list[int],
              all_logits: bool = True, decode: bool = False) -> np.ndarray:
    """Push a block through engines head..tail in-process; returns the tail's logits."""
    hidden = None
    for engine in chain:
        head = engine.capabilities().is_head
        work = ShardWork(work_id, position, tuple(tokens) if head else (), hidden, all_logits)
        out = (engine.decode if decode else engine.prefill)(sid, work)
        assert (out.work_id, out.position, out.next_position) == (work_id, position, position + len(tokens))
        hidden = out.tensor
    return hidden


def reference(loaded, geometry: CacheGeometry = GEOMETRY) -> SinkWindowVerifier:
    """A single-process verifier over the whole model with `geometry`."""
    log = TokenLog()
    return SinkWindowVerifier(LocalBackend(loaded.model, loaded.spec, geometry.max_block).open(geometry, log), log)


def ref_block(v: SinkWindowVerifier, tokens: list[int], all_logits: bool = True, keep: int | None = None) -> np.ndarray:
    """Forward a block on the reference and keep `keep` of it (default all); returns its logits."""
    out = np.array(v.forward_block(tokens, all_logits=all_logits))
    v.commit_or_truncate(len(tokens), len(tokens) if keep is None else keep)
    return out


def chain_differences(chain: list[MlxShardEngine], loaded, sid: str, tokens: list[int], sizes: list[int]) -> list[int]:
    """Feed `tokens` in blocks of `sizes` through `chain` (session `sid`, opened) and through the single process.

    The route-vs-single-process comparison of the contract: every third block asks for the last
    row's logits only, single rows on even steps go as decodes. Returns the steps (from 1) whose
    logits are not bitwise the single process's.
    """
    ref, position, differ = reference(loaded), 0, []
    for step, n in enumerate(sizes, start=1):
        block = tokens[position : position + n]
        all_logits = step % 3 != 0
        got = run_chain(chain, sid, step, position, block, all_logits, decode=n == 1 and step % 2 == 0)
        want = ref_block(ref, block, all_logits)
        if got.dtype != np.float32 or got.tobytes() != want.tobytes():
            differ.append(step)
        position += n
    return differ


def open_msg(rsid: str = "s", epoch: int = 1, geometry: CacheGeometry = GEOMETRY, credits: int = 0,
             deadline_ns: int = 0) -> pb.ShardRequestFrame:
    """A SessionOpen frame."""
    return pb.ShardRequestFrame(open=pb.SessionOpen(
        route_session_id=rsid, route_epoch=epoch, deadline_unix_nanos=deadline_ns, sink_tokens=geometry.sink,
        window_tokens=geometry.window, max_block=geometry.max_block, max_rollback=geometry.max_rollback,
        requested_credits=credits))


def chunk_msg(step: int, position: int, tokens: list[int], epoch: int = 1, rsid: str = "s", deadline_ns: int = 0,
              hidden: pb.ActivationTensor | None = None, all_logits: bool = True) -> pb.ShardRequestFrame:
    """An ActivationChunk frame (token ids, or a prepared hidden tensor)."""
    c = pb.ActivationChunk(route_session_id=rsid, route_epoch=epoch, deadline_unix_nanos=deadline_ns,
                           idempotency_step=step, position=position, token_ids=tokens, all_logits=all_logits)
    if hidden is not None:
        c.hidden.CopyFrom(hidden)
    return pb.ShardRequestFrame(chunk=c)


async def opened(stub: pb_grpc.ShardRuntimeStub, **kw: object) -> grpc.aio.StreamStreamCall:
    """A Session stream whose SessionOpen was accepted."""
    call = stub.Session()
    await call.write(open_msg(**kw))
    reply = await call.read()
    assert reply.HasField("accepted"), reply
    return call


async def fails_closed(call: grpc.aio.StreamStreamCall, code: int, status: grpc.StatusCode,
                       timeout_s: float = 60.0) -> pb.ShardError:
    """Read to the error frame that closes the session and the status that ends the stream, all within
    `timeout_s` (a worker that never fails the session, or never ends the stream, fails the test)."""
    async with asyncio.timeout(timeout_s):
        while True:
            reply = await call.read()
            assert reply is not grpc.aio.EOF, "stream ended without an error frame"
            if reply.HasField("error") and reply.error.session_closed:
                break
        assert reply.error.code == code, reply.error
        assert not reply.error.retryable
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.read()
    assert err.value.code() == status, err.value
    assert err.value.details().startswith(pb.ShardErrorCode.Name(code).removeprefix("SHARD_ERROR_"))
    return reply.error


def spawn_worker(layers: str, *flags: str, port: int = 0, rollback: int | None = None,
                 stderr: int = subprocess.DEVNULL, module: str = "inference_engine") -> subprocess.Popen:
    """A real `python -m inference_engine shard-worker` subprocess (wait for it with `worker_ready`).

    `module="tests.fixtures.fault_worker"` starts the fault-injecting TEST FIXTURE instead. Its
    probe stops at 16 rows, the tile the shard tests' engines use (probing 64 sizes costs each
    worker seconds).
    """
    command = ["shard-worker"] if module == "inference_engine" else []
    return subprocess.Popen(
        [sys.executable, "-m", module, *command, "--layers", layers, "--port", str(port),
         *(["--max-rollback", str(rollback)] if rollback is not None else []), "--max-tile", "16", *flags],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )


def worker_ready(proc: subprocess.Popen) -> str:
    """The worker's address from its readiness line."""
    return wait_ready(proc)


@contextlib.contextmanager
def running_workers(procs: list[subprocess.Popen]) -> Iterator[tuple[list[subprocess.Popen], list[str]]]:
    """Yield the workers and their addresses once ready; kill them all afterwards."""
    try:
        yield procs, [worker_ready(p) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
