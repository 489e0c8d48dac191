"""Client side of one worker's Batch stream: many route sessions' blocks in one message each way.

One request is in flight at a time: `request` writes every entry in one ShardBatchRequest and
reads the one response, whose frames answer the entries in order. A stream that breaks (the
worker died or restarted) or does not answer in time raises the shard error hierarchy naming
the worker, and the next request opens a new stream.
"""

from __future__ import annotations

import asyncio

import grpc

from inference_engine.shard.protocol.errors import DeadlineExpired, MalformedShardOutput, ShardUnavailable, error_of_rpc
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc


class BatchStream:
    """One worker's Batch stream, shared by every session of the route."""

    def __init__(self, stub: pb_grpc.ShardRuntimeStub, address: str, where: str, timeout_s: float):
        self.stub = stub
        self.address = address
        self.where = where  # 'shard worker HOST:PORT (layers A:B)'
        self.timeout_s = timeout_s
        self._call: grpc.aio.StreamStreamCall | None = None
        self._lock = asyncio.Lock()

    async def request(self, entries: list[pb.ShardBatchEntry]) -> list[pb.ShardResponseFrame]:
        """The worker's answer to each entry, in order.

        Raises:
            ShardUnavailable (or the mapped status) when the stream broke; DeadlineExpired when no
            answer came within the timeout; MalformedShardOutput for a response of the wrong size.
            Which entries ran is then unknown: their sessions must be treated as failed.
        """
        async with self._lock:
            if self._call is None or self._call.done():
                self._call = self.stub.Batch()
            try:
                await self._call.write(pb.ShardBatchRequest(entries=entries))
                response = await asyncio.wait_for(self._call.read(), self.timeout_s)
            except asyncio.TimeoutError:
                self.close()
                raise DeadlineExpired(f"{self.where} did not answer a Batch request within {self.timeout_s:.1f} s") \
                    from None
            except grpc.aio.AioRpcError as exc:
                self.close()
                raise error_of_rpc(exc, self.address) from exc
            except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                self.close()
                raise ShardUnavailable(f"{self.where} ended the Batch stream ({exc!r})") from exc
            if response is grpc.aio.EOF:
                self.close()
                raise ShardUnavailable(f"{self.where} ended the Batch stream")
            if len(response.frames) != len(entries):
                self.close()
                raise MalformedShardOutput(f"{self.where} answered {len(response.frames)} frames to a Batch "
                                           f"request of {len(entries)} entries")
            return list(response.frames)

    def close(self) -> None:
        """Cancel the stream (the next request opens another)."""
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self._call = None
