"""Client side of one worker's streams: a route session's Session stream, and the Batch stream
every session of the route shares.

On each, one request is in flight at a time. `HopStream.request` writes a frame and reads until
the answer for that step, applying FlowControl grants on the way and resending after a retryable
FLOW_CONTROL_VIOLATION; `BatchStream.request` writes many sessions' frames in one message and
reads the one response. Failures raise the shard error hierarchy, naming the worker; a Batch
stream that broke is opened again by the next request.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable

import grpc

from inference_engine.errors import RuntimeServiceError
from inference_engine.shard.protocol.errors import (
    DeadlineExpired,
    FlowControlViolation,
    MalformedShardOutput,
    ShardErrorCode,
    ShardUnavailable,
    error_for,
    error_of_rpc,
    error_of_status,
)
from inference_engine.shard.protocol.types import ShardCapabilities
from inference_engine.shard.protocol.wire import open_frame
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc
from inference_engine.execution.kv_cache import CacheGeometry

FLOW_RETRIES = 6  # resends of one frame after FLOW_CONTROL_VIOLATION
FLOW_BACKOFF_S = 0.01  # first wait before a resend (doubles each time)
_STREAM_END = object()  # queued by the pump after the stream's last frame
REFUSED = object()  # answer_of: the worker refused the frame for lack of credit (send it again)
UNRELATED = object()  # answer_of: the frame says nothing of this step


def where(address: str, caps: ShardCapabilities) -> str:
    """'shard worker HOST:PORT (layers A:B)' for messages."""
    return f"shard worker {address} (layers {caps.layers})"


def _ignore(address: str) -> None:
    pass


class HopStream:
    """One worker's stream for one route session."""

    def __init__(self, stub: pb_grpc.ShardRuntimeStub, address: str, caps: ShardCapabilities, timeout_s: float,
                 silent: Callable[[str], None] = _ignore):
        """
        Args:
            silent: told the worker's address when it does not answer in time (before DeadlineExpired is raised).
        """
        self.stub = stub
        self.address = address
        self.caps = caps
        self.timeout_s = timeout_s
        self.silent = silent
        self.credits = 0  # work frames the worker will accept now, as last granted
        self._call: grpc.aio.StreamStreamCall | None = None
        self._frames: asyncio.Queue = asyncio.Queue()  # answers as read, then the stream's end
        self._pump_task: asyncio.Task | None = None
        self._end: RuntimeServiceError = ShardUnavailable(f"{self.where} ended the session stream")  # why it ended

    @property
    def where(self) -> str:
        return where(self.address, self.caps)

    async def open(self, route_session_id: str, epoch: int, geometry: CacheGeometry, timeout_s: float) -> None:
        """Start the stream with SessionOpen and check the SessionAccepted answer (within `timeout_s`).

        Raises:
            The mapped shard error when the worker refuses; MalformedShardOutput when the
            acceptance does not match the request.
        """
        self._call = self.stub.Session()
        self._pump_task = asyncio.create_task(self._pump())
        await self._write(open_frame(route_session_id, epoch, geometry))
        frame = await self._read(timeout_s)
        if frame.HasField("error"):
            raise self.error_of(frame.error)
        a = frame.accepted
        got = (a.route_session_id, a.route_epoch, a.layer_start, a.layer_end)
        if not frame.HasField("accepted") or a.credits < 1 or \
                got != (route_session_id, epoch, self.caps.layers.start, self.caps.layers.end):
            raise MalformedShardOutput(f"{self.where} answered SessionOpen with {frame}")
        self.credits = a.credits

    async def request(self, frame: pb.ShardRequestFrame, step: int) -> pb.ShardStepResult:
        """Send a work frame and return its result (resending after flow-control refusals).

        Raises:
            The mapped shard error for an error answer; MalformedShardOutput for an answer
            that is not this step's; DeadlineExpired when no answer comes in time;
            ShardUnavailable when the worker or the stream is gone.
        """
        for attempt in range(FLOW_RETRIES + 1):
            await self._write(frame)
            self.credits -= 1
            answer = await self._answer(step)
            if isinstance(answer, pb.ShardStepResult):
                return answer
            self.credits += 1  # the refused frame took no credit
            if attempt < FLOW_RETRIES:
                await asyncio.sleep(FLOW_BACKOFF_S * 2**attempt)
        raise FlowControlViolation(f"{self.where} refused step {step} {FLOW_RETRIES + 1} times for lack of credit")

    async def _answer(self, step: int) -> pb.ShardStepResult | None:
        """Read until the answer for `step`: its result, or None for a flow-control refusal."""
        while True:
            got = self.answer_of(await self._read(), step)
            if got is not UNRELATED:
                return None if got is REFUSED else got  # type: ignore[return-value]

    def answer_of(self, frame: pb.ShardResponseFrame, step: int) -> pb.ShardStepResult | object:
        """What `frame` says of work step `step` (its FlowControl grant applied): the step's result,
        REFUSED (no credit: send it again), or UNRELATED (an ack of a CancelSignal).

        Raises:
            The mapped shard error for an error answer; MalformedShardOutput for a result of
            another step, a duplicate's ack for a step never sent before, or a second acceptance.
        """
        if frame.HasField("flow"):
            self.credits += frame.flow.credits_granted
        kind = frame.WhichOneof("frame")
        if kind == "result":
            if frame.result.idempotency_step != step:
                raise MalformedShardOutput(f"{self.where} answered step {frame.result.idempotency_step} "
                                           f"while step {step} was in flight")
            return frame.result
        if kind == "error":
            err = frame.error
            if err.code == ShardErrorCode.FLOW_CONTROL_VIOLATION and err.retryable and err.idempotency_step == step:
                return REFUSED
            raise self.error_of(err)
        if kind == "ack" and frame.ack.duplicate and frame.ack.idempotency_step == step:
            raise MalformedShardOutput(f"{self.where} reports step {step} as a duplicate: it was never sent before")
        if kind == "accepted":
            raise MalformedShardOutput(f"{self.where} sent a second SessionAccepted")
        return UNRELATED  # acks of CancelSignals carry nothing for this step

    def error_of(self, err: pb.ShardError) -> RuntimeServiceError:
        """The shard error an error frame of this worker stands for."""
        try:
            code = ShardErrorCode(err.code)
        except ValueError:  # a newer worker's code: treat as INTERNAL
            code = ShardErrorCode.INTERNAL
        return error_for(code, f"{self.where}: {err.message}")

    async def _write(self, frame: pb.ShardRequestFrame) -> None:
        try:
            await self._call.write(frame)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
            # The worker already ended the stream: its last frame (or status) says why.
            raise await self._ended_because() from exc

    async def _pump(self) -> None:
        """Read every frame as it arrives (so a final error frame is never lost); then the end."""
        try:
            while (frame := await self._call.read()) is not grpc.aio.EOF:
                self._frames.put_nowait(frame)
            status = await self._call.code()
            if status != grpc.StatusCode.OK:
                self._end = error_of_status(status, await self._call.details() or "", self.address)
        except grpc.aio.AioRpcError as exc:
            self._end = error_of_rpc(exc, self.address)
        except Exception as exc:  # noqa: BLE001 - whatever broke the stream, readers must learn it ended
            self._end = ShardUnavailable(f"{self.where}: reading the session stream failed: {exc!r}")
        self._frames.put_nowait(_STREAM_END)

    async def _read(self, timeout_s: float | None = None) -> pb.ShardResponseFrame:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            item = await asyncio.wait_for(self._frames.get(), timeout_s)
        except asyncio.TimeoutError:
            self.silent(self.address)
            raise DeadlineExpired(f"{self.where} did not answer within {timeout_s:.1f} s") from None
        if item is _STREAM_END:
            self._frames.put_nowait(item)  # the stream stays ended for later reads
            raise type(self._end)(str(self._end))
        return item

    async def _ended_because(self) -> RuntimeServiceError:
        """Why the worker ended the stream: its error frame if it sent one, else its status."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(self._pump_task), self.timeout_s)
        while not self._frames.empty():
            item = self._frames.get_nowait()
            if item is not _STREAM_END and item.HasField("error"):
                self._end = self.error_of(item.error)
        self._frames.put_nowait(_STREAM_END)
        return type(self._end)(str(self._end))

    def close(self) -> None:
        """Cancel the stream (the worker then releases the session's caches)."""
        if self._call is not None and not self._call.done():
            self._call.cancel()
        if self._pump_task is not None:
            self._pump_task.cancel()


class BatchStream:
    """One worker's Batch stream, shared by every session of the route: many sessions' frames in one
    message each way."""

    def __init__(self, stub: pb_grpc.ShardRuntimeStub, address: str, caps: ShardCapabilities, timeout_s: float,
                 silent: Callable[[str], None] = _ignore):
        self.stub = stub
        self.address = address
        self.where = where(address, caps)
        self.timeout_s = timeout_s
        self.silent = silent  # as HopStream's
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
                if response is grpc.aio.EOF:
                    raise ShardUnavailable(f"{self.where} ended the Batch stream")
                if len(response.frames) != len(entries):
                    raise MalformedShardOutput(f"{self.where} answered {len(response.frames)} frames to a Batch "
                                               f"request of {len(entries)} entries")
                return list(response.frames)
            except asyncio.TimeoutError:
                self.close()
                self.silent(self.address)
                raise DeadlineExpired(f"{self.where} did not answer a Batch request within {self.timeout_s:.1f} s") \
                    from None
            except grpc.aio.AioRpcError as exc:
                self.close()
                raise error_of_rpc(exc, self.address) from exc
            except (asyncio.InvalidStateError, grpc.aio.UsageError) as exc:
                self.close()
                raise ShardUnavailable(f"{self.where} ended the Batch stream ({exc!r})") from exc
            except RuntimeServiceError:
                self.close()
                raise

    def close(self) -> None:
        """Cancel the stream (the next request opens another)."""
        if self._call is not None and not self._call.done():
            self._call.cancel()
        self._call = None
