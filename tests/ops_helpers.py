"""Servers and channels with the operator surface on: TLS, tokens, health, reflection (tiny model)."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import AsyncIterator

import grpc
import pytest

from inference_engine.runtime.engine import Engine
from inference_engine.runtime.runtime import Runtime
from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.server.frontend import Frontend, open_frontend
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.conftest import make_config

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3]


@dataclasses.dataclass
class Served:
    """A running front (attached or not) and how to reach it."""

    frontend: Frontend
    runtime: Runtime
    target: str  # 127.0.0.1:PORT
    channels: list[grpc.aio.Channel] = dataclasses.field(default_factory=list)

    def channel(self, security: ClientSecurity | None = None) -> grpc.aio.Channel:
        """A channel to the server presenting `security` (closed with the server)."""
        channel = open_channel(self.target, security)
        self.channels.append(channel)
        return channel

    def stub(self, security: ClientSecurity | None = None) -> pb_grpc.RuntimeServiceStub:
        """A RuntimeService stub on a fresh channel."""
        return pb_grpc.RuntimeServiceStub(self.channel(security))


@contextlib.asynccontextmanager
async def serving(engine: Engine, security: ServerSecurity | None = None, attach: bool = True,
                  **overrides: object) -> AsyncIterator[Served]:
    """A front on 127.0.0.1:0 over `engine` with `security`; attached (SERVING) unless `attach` is False."""
    cfg = make_config(security=security or ServerSecurity(), **overrides)
    runtime = Runtime(engine, cfg)
    frontend = await open_frontend(cfg, "127.0.0.1", 0)
    served = Served(frontend, runtime, f"127.0.0.1:{frontend.port}")
    try:
        if attach:
            await frontend.attach(runtime)
        yield served
    finally:
        for channel in served.channels:
            await channel.close()
        await frontend.server.stop(0.5)
        await runtime.stop()


async def rpc_error(coro: object) -> grpc.aio.AioRpcError:
    """The AioRpcError `coro` (a call, or a coroutine draining a stream) ends with."""
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro  # type: ignore[misc]
    return err.value


async def generate(stub: pb_grpc.RuntimeServiceStub, sid: str, n: int) -> list[int]:
    """Generate `n` tokens (EOS ignored); returns them."""
    out: list[int] = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, ignore_eos=True)):
        out += list(msg.tokens)
    return out
