"""What a local attacker puts on a shard worker's port: a rogue listener and a relay, both recording.

A spawned worker's port is free between the worker's death and its restart. A rogue gRPC
listener bound there answers every call after recording its method, metadata and request
bytes (where the bearer token and the prompt's token ids would show); a relay forwards every
byte to the real worker and records what went through. Both serve the reliability battery's
rogue-worker section and the tests that show the route sends them nothing they can use.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator

import grpc

from inference_engine.security.credentials import SERVER_OPTIONS

READ_WINDOW_S = 1.0  # how long a rogue call keeps reading what the route sends before it fails the call


def varint_ids(token_ids: list[int]) -> bytes:
    """Token ids as protobuf packs them (`repeated uint32`): what a prompt looks like on the wire in clear."""
    out = bytearray()
    for value in token_ids:
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


class RogueListener:
    """A plaintext gRPC server on a port it does not own: records every call, then fails it UNAVAILABLE."""

    def __init__(self) -> None:
        self.methods: list[str] = []  # the method of every call that reached it
        self.metadata: list[tuple[str, str | bytes]] = []  # every metadata entry of those calls
        self.received = bytearray()  # every metadata value and request message, concatenated
        self._server: grpc.aio.Server | None = None

    @property
    def calls(self) -> int:
        """How many calls reached it."""
        return len(self.methods)

    def holds(self, secret: bytes) -> bool:
        """Whether `secret` appears in anything it received."""
        return bool(secret) and secret in bytes(self.received)

    async def start(self, port: int, wait_s: float = 5.0) -> None:
        """Bind 127.0.0.1:`port` (retrying while the dead worker's socket still holds it) and serve.

        Raises:
            OSError: the port stayed in use for `wait_s`.
        """
        deadline = time.monotonic() + wait_s
        while True:
            server = grpc.aio.server(options=list(SERVER_OPTIONS))  # exclusive, as a careful attacker binds
            server.add_generic_rpc_handlers((_Recorder(self),))
            try:
                bound = server.add_insecure_port(f"127.0.0.1:{port}")
            except RuntimeError:
                bound = 0
            if bound == port:
                await server.start()
                self._server = server
                return
            await server.stop(None)
            if time.monotonic() >= deadline:
                raise OSError(f"the rogue listener could not bind 127.0.0.1:{port} within {wait_s} s")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Stop listening: the port is free for the real worker again."""
        if self._server is not None:
            await self._server.stop(None)
            self._server = None

    def _record(self, method: str, metadata: Any) -> None:
        self.methods.append(method)
        for key, value in metadata or ():
            self.metadata.append((key, value))
            self.received += value if isinstance(value, bytes) else value.encode("utf-8", "replace")


class _Recorder(grpc.GenericRpcHandler):
    """Every method, as a bidirectional stream of raw bytes (a unary call is a stream of one)."""

    def __init__(self, rogue: RogueListener):
        self.rogue = rogue

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        self.rogue._record(details.method, details.invocation_metadata)

        async def record(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
            with contextlib.suppress(asyncio.TimeoutError):
                async with asyncio.timeout(READ_WINDOW_S):
                    async for raw in requests:
                        self.rogue.received += raw
            await context.abort(grpc.StatusCode.UNAVAILABLE, "rogue listener")

        return grpc.stream_stream_rpc_method_handler(record)


class Relay:
    """A TCP relay on 127.0.0.1: every connection is forwarded to `upstream`, its bytes recorded both ways."""

    def __init__(self, upstream: str):
        self.upstream = upstream  # host:port of the real worker
        self.sent = bytearray()  # what the client sent through it
        self.answered = bytearray()  # what the worker sent back
        self.port = 0  # bound at start
        self._server: asyncio.Server | None = None
        self._pumps: set[asyncio.Task] = set()

    def holds(self, secret: bytes) -> bool:
        """Whether `secret` appears in the bytes the client sent through it."""
        return bool(secret) and secret in bytes(self.sent)

    async def start(self) -> str:
        """Listen on a free loopback port; returns its address."""
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop listening and drop every relayed connection."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.close()
            return
        for source, sink, record in ((reader, up_writer, self.sent), (up_reader, writer, self.answered)):
            pump = asyncio.ensure_future(_pump(source, sink, record))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, record: bytearray) -> None:
    try:
        while data := await source.read(65536):
            record += data
            sink.write(data)
            await sink.drain()
    except (OSError, asyncio.CancelledError):
        pass
    finally:
        sink.close()
