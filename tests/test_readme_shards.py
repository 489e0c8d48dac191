"""docs/shards.md's shard example, run exactly as written: three workers and a server on fixed ports."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path

import grpc
import numpy as np
import pytest

from inference_engine.config import DEFAULT_MAX_TILE
from inference_engine.readiness import wait_ready
from inference_engine.runtime.engine import Engine
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile

pytestmark = pytest.mark.real_model
ROOT = Path(__file__).resolve().parent.parent
PROMPT = np.random.default_rng(21).integers(0, 49152, 30).tolist()


def readme_shard_lines() -> list[str]:
    """The shard example's command lines up to its "# or" alternative."""
    section = ROOT.joinpath("docs", "shards.md").read_text().split("# Distributed shards", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return block.split("\n# or")[0].strip().splitlines()


async def _tokens(stub: pb_grpc.RuntimeServiceStub) -> tuple[list[int], str]:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(window_tokens=64))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
    out: list[int] = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=8, ignore_eos=True)):
        out += list(msg.tokens)
    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
    return out, info.state_digest


async def test_readme_shard_example_serves_as_written(real_model):
    lines = readme_shard_lines()
    assert len(lines) == 4 and lines[-1].split("#")[0].strip().endswith("serve --shards 127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003")
    script = "\n".join(lines) + "\n"
    proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, start_new_session=True)
    watchdog = threading.Timer(600, os.killpg, (proc.pid, signal.SIGKILL))  # a port in use must not hang the test
    watchdog.start()
    try:
        ready = {wait_ready(proc) for _ in range(4)}  # the workers announce themselves too
        assert ready == {"127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003", "127.0.0.1:50051"}
        async with grpc.aio.insecure_channel("127.0.0.1:50051") as channel:
            routed = await _tokens(pb_grpc.RuntimeServiceStub(channel))
    finally:
        watchdog.cancel()
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    engine = assert_full_tile(Engine(real_model, exact=True, max_tile=DEFAULT_MAX_TILE, plain_block=64, max_rollback=8))
    try:  # the server's own defaults, in one process
        async with running_server(engine) as (stub, _):
            assert routed == await _tokens(stub)  # the route is bitwise the single process
    finally:
        engine.close()
