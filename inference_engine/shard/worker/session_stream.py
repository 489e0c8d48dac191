"""Server side of one Session stream: admission, in-order execution, fail-closed ending.

Three tasks share the stream: a reader admits frames (epoch, deadline, duplicate step,
credit, payload checks) and answers rejections at once; an executor runs admitted work
in order on the runtime's engine thread (prefill and decode blocks through the worker's
BatchQueue: blocks of sessions waiting at once share one forward); the writer (the RPC's own task)
sends every answer. Work frames that come in a Batch request (`submit`) go through the same
admission and the same in-order executor; their answers go back to the batch, not the stream.
A non-retryable error "fails closed": its error frame is the last one written, the session's caches are released and the RPC ends with the matching status code.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Coroutine

import grpc

from inference_engine.errors import InvalidRequest, RuntimeServiceError, SessionNotFound
from inference_engine.runtime.batch_queue import BatchQueue
from inference_engine.runtime.scheduler import Scheduler
from inference_engine.shard.protocol.errors import (
    DeadlineExpired,
    EpochStale,
    FlowControlViolation,
    ShardUnavailable,
    WorkCancelled,
)
from inference_engine.shard.protocol.types import ShardOutput, ShardWork, StepItem
from inference_engine.shard.protocol.wire import (
    FrameHeader,
    LayerKV,
    check,
    error_frame,
    frame_header,
    kv_import_of,
    kv_result,
    open_request,
    result_frame,
    step_of,
    step_result,
    work_of,
)
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.route_table import RouteTable
from inference_engine.status_codes import abort_shard
from inference_engine.v1 import shard_runtime_pb2 as pb

log = logging.getLogger(__name__)
_EOF = object()  # inbox: the client half-closed
_END = object()  # outbox: end the stream normally
REMEMBERED_STEPS = 4096  # idempotency steps remembered exactly; older ones count as duplicates
_CLEANUPS: set[asyncio.Task] = set()  # clean-ups outliving their cancelled RPC (strong references)


def _background(coro: Coroutine[object, object, None]) -> asyncio.Task:
    """Run `coro` as a task that survives the cancellation of whoever started it."""
    task = asyncio.ensure_future(coro)
    _CLEANUPS.add(task)
    task.add_done_callback(_CLEANUPS.discard)
    return task


@dataclass(frozen=True)
class _Admitted:
    """A work frame that passed admission, waiting for the executor."""

    header: FrameHeader  # epoch, deadline, step, kind
    work: ShardWork | None  # chunk/decode payload; None for a trim, digest or K/V frame
    position: int  # trim/digest/K/V: the session position the frame expects
    trim_tokens: int  # trim: positions to drop
    kv: tuple[int, LayerKV] | None = None  # kv_import: target position and per-block K/V
    reply: asyncio.Future | None = None  # a Batch entry's answer (None: the stream's outbox)


class SessionStream:
    """One route session bound to one Session RPC on a worker."""

    def __init__(self, engine: MlxShardEngine, thread: Scheduler, batcher: BatchQueue[StepItem, ShardOutput], routes: RouteTable,
                 context: grpc.aio.ServicerContext, max_credits: int, default_credits: int):
        self.engine, self.thread, self.batcher, self.routes, self.context = engine, thread, batcher, routes, context
        self.max_credits, self.default_credits = max_credits, default_credits
        self.route_session_id = ""
        self.epoch = 0
        self.key = ""  # the engine's session id: "<route_session_id>@<epoch>"
        self.credits = 0  # work frames the client may still send
        self.closed = asyncio.Event()  # caches released, stream over
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._steps: set[int] = set()  # admitted idempotency steps (recent)
        self._step_order: deque[int] = deque()
        self._step_floor = 0  # steps at or below this were forgotten: treated as duplicates
        self._queued: set[int] = set()  # admitted, not started
        self._cancelled: set[int] = set()  # queued or running items cancelled by id
        self._running = 0  # step on the engine now (0 = none)
        self._closing = False  # fail() or release() happened: execute nothing more
        self._failure: BaseException | None = None  # why the session failed closed
        self._replies: dict[asyncio.Future, int] = {}  # Batch entries not answered yet -> their steps
        self._serving = False  # SessionAccepted was sent: work frames may come (on the stream or in a Batch)

    # -- entry -----------------------------------------------------------------------

    async def serve(self) -> None:
        """Run the stream to its end (returns normally, or aborts with a status code)."""
        first = await self.context.read()
        if first is grpc.aio.EOF:
            return
        try:
            accepted = await self._open(first)
        except Exception as exc:  # noqa: BLE001 - every refusal is answered and fails closed
            await self._refuse(exc)
            return
        tasks: list[asyncio.Task] = []
        fatal = None
        try:
            await self.context.write(pb.ShardResponseFrame(accepted=accepted))
            self._serving = True
            tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._execute_loop())]
            fatal = await self._write_loop()
        finally:
            # The clean-up runs to its end even if this RPC is cancelled (the client hung up).
            await asyncio.shield(_background(self._close(tasks)))
        if fatal is not None:
            await abort_shard(self.context, fatal)

    async def _open(self, frame: pb.ShardRequestFrame) -> pb.SessionAccepted:
        """Validate the SessionOpen, register the session and allocate its caches."""
        if frame.WhichOneof("frame") != "open":
            raise InvalidRequest("the first frame of a Session stream must be SessionOpen")
        req = open_request(frame.open)
        self._check_deadline(req.deadline_ns)
        self.route_session_id, self.epoch = req.route_session_id, req.epoch
        self.key = f"{req.route_session_id}@{req.epoch}"
        self.credits = min(req.credits or self.default_credits, self.max_credits)
        self.routes.admit(self)
        try:
            await self.thread.run(self.engine.open_session, self.key, req.geometry)
        except asyncio.CancelledError:
            _background(self._release())  # the open may have completed: free it again
            raise
        except BaseException:
            self.routes.remove(self)
            raise
        caps = self.engine.capabilities()
        return pb.SessionAccepted(route_session_id=self.route_session_id, route_epoch=self.epoch,
                                  credits=self.credits, layer_start=caps.layers.start, layer_end=caps.layers.end)

    async def _refuse(self, exc: BaseException) -> None:
        if not isinstance(exc, RuntimeServiceError):
            log.exception("unexpected error opening a shard session", exc_info=exc)
        await self.context.write(error_frame(exc, 0, session_closed=True))
        await abort_shard(self.context, exc)

    def submit(self, frame: pb.ShardRequestFrame) -> asyncio.Future:
        """Admit a chunk or decode frame of a Batch request (the servicer checked the kind); the
        future gets its answer frame.

        Admission and execution are the stream's own (`_admit`, the executor, in order with the
        frames of the stream); a frame that fails the session closed also ends the stream.
        """
        reply: asyncio.Future = asyncio.get_running_loop().create_future()
        step = step_of(frame)
        self._replies[reply] = step
        reply.add_done_callback(lambda f: self._replies.pop(f, None))
        if self._closing:
            self._answer(error_frame(self._ended(), step, session_closed=True), reply)
            return reply
        if not self._serving:  # its SessionOpen is still being answered
            exc = SessionNotFound(f"route session {self.route_session_id!r} is not open yet")
            self._answer(error_frame(exc, step, session_closed=False), reply)
            return reply
        try:
            self._admit(frame, reply)
        except Exception as exc:  # noqa: BLE001 - as on the stream: a bad frame fails the session closed
            if not isinstance(exc, RuntimeServiceError):
                log.exception("unexpected error admitting a batched frame of session %s", self.key)
            self.fail(exc, step)
            self._answer(error_frame(exc, step, session_closed=True), reply)
        return reply

    def _answer(self, frame: pb.ShardResponseFrame, reply: asyncio.Future | None) -> None:
        """Send an answer to where its frame came from: the stream, or a Batch entry."""
        if reply is None:
            self._outbox.put_nowait(frame)
        elif not reply.done():
            reply.set_result(frame)

    def _ended(self) -> BaseException:
        """Why work can no longer run on this session."""
        return self._failure or ShardUnavailable(f"session {self.route_session_id!r} was released")

    # -- control from the route table (out-of-band Cancel / Release / supersede) ------

    def fail(self, exc: BaseException, step: int = 0) -> None:
        """Fail the session closed: `exc` becomes the stream's last frame and status."""
        if self._closing:
            return
        self._closing, self._failure = True, exc  # a running item stops at its next chunk boundary
        self._outbox.put_nowait(error_frame(exc, step, session_closed=True))

    def release(self) -> None:
        """End the stream normally after the answers already queued; work not started is dropped."""
        if self._closing:
            return
        self._closing = True
        self._outbox.put_nowait(_END)

    def cancel_item(self, work_id: int) -> bool:
        """Cancel one queued or running item; returns whether it was found."""
        found = work_id in self._queued or work_id == self._running
        if found:
            self._cancelled.add(work_id)  # a running item stops at its next chunk boundary
        return found

    # -- the three loops -------------------------------------------------------------

    async def _write_loop(self) -> BaseException | None:
        """Write answers until the stream ends; returns the failure that ended it, if any."""
        while True:
            frame = await self._outbox.get()
            if frame is _END:
                return None
            await self.context.write(frame)
            if frame.HasField("error") and frame.error.session_closed:
                return self._failure

    async def _read_loop(self) -> None:
        while True:
            try:
                frame = await self.context.read()
            except Exception:  # noqa: BLE001 - the client is gone; nobody is left to answer
                log.debug("session %s: reading the stream failed", self.key, exc_info=True)
                self.release()
                return
            if frame is grpc.aio.EOF:
                self._inbox.put_nowait(_EOF)
                return
            try:
                self._admit(frame)
            except Exception as exc:  # noqa: BLE001 - a bad frame fails the session closed
                if not isinstance(exc, RuntimeServiceError):
                    log.exception("unexpected error admitting a frame of session %s", self.key)
                self.fail(exc, step_of(frame))
                return

    def _admit(self, frame: pb.ShardRequestFrame, reply: asyncio.Future | None = None) -> None:
        kind = frame.WhichOneof("frame")
        if kind == "cancel":
            self._on_cancel_signal(frame.cancel)
            return
        if kind not in ("chunk", "decode", "trim", "digest", "kv_export", "kv_import"):
            raise InvalidRequest(f"unexpected {kind or 'empty'} frame after SessionOpen")
        h = frame_header(frame)
        if h.epoch != self.epoch:
            raise EpochStale(f"frame of route epoch {h.epoch} on session {self.route_session_id!r} "
                             f"at epoch {self.epoch}")
        if h.route_session_id and h.route_session_id != self.route_session_id:
            raise InvalidRequest(f"chunk for session {h.route_session_id!r} on the stream of {self.route_session_id!r}")
        if h.step in self._steps or h.step <= self._step_floor:  # a resend: answer it, never run it twice
            self._answer(pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=h.step, duplicate=True)), reply)
            return
        self._check_deadline(h.deadline_ns)
        if self.credits == 0:
            exc = FlowControlViolation(f"step {h.step} sent with no credit left; resend it after a FlowControl grant")
            self._answer(error_frame(exc, h.step, session_closed=False), reply)
            return
        work = work_of(frame) if kind in ("chunk", "decode") else None
        position = getattr(frame, kind).position
        trim_tokens = check("trim.tokens", frame.trim.tokens) if kind == "trim" else 0
        kv = kv_import_of(frame) if kind == "kv_import" else None
        self.credits -= 1
        self._remember_step(h.step)
        self._queued.add(h.step)
        self._inbox.put_nowait(_Admitted(h, work, position, trim_tokens, kv, reply))

    def _on_cancel_signal(self, msg: pb.CancelSignal) -> None:
        if msg.route_epoch != self.epoch:
            raise EpochStale(f"CancelSignal of route epoch {msg.route_epoch} on a session at epoch {self.epoch}")
        if msg.work_id == 0:
            self._outbox.put_nowait(pb.ShardResponseFrame(ack=pb.ShardAck(cancelled=True)))
            self.fail(WorkCancelled(f"session {self.route_session_id!r} was cancelled by a CancelSignal"))
            return
        found = self.cancel_item(msg.work_id)
        self._outbox.put_nowait(pb.ShardResponseFrame(ack=pb.ShardAck(idempotency_step=msg.work_id, cancelled=found)))

    async def _execute_loop(self) -> None:
        while True:
            item = await self._inbox.get()
            if item is _EOF:
                self._outbox.put_nowait(_END)
                return
            step = item.header.step
            self._queued.discard(step)
            if self._closing:
                return
            self._running = step
            try:
                if step in self._cancelled:
                    raise WorkCancelled(f"work {step} was cancelled before it started")
                self._check_deadline(item.header.deadline_ns)
                frame = await self._execute(item)
            except WorkCancelled as exc:
                if self._closing:
                    return
                self._answer(error_frame(exc, step, session_closed=False, flow=self._grant()), item.reply)
                continue
            except Exception as exc:  # noqa: BLE001 - engine failures fail the session closed
                if not isinstance(exc, RuntimeServiceError):
                    log.exception("unexpected engine error in session %s step %d", self.key, step)
                self.fail(exc, step)
                if item.reply is not None:
                    self._answer(error_frame(exc, step, session_closed=True), item.reply)
                return
            finally:
                self._running = 0
                self._cancelled.discard(step)
            self._answer(frame, item.reply)

    async def _execute(self, item: _Admitted) -> pb.ShardResponseFrame:
        step, kind, position = item.header.step, item.header.kind, item.position
        if kind == "trim":
            new_position = await self.thread.run(self.engine.trim, self.key, item.trim_tokens, position)
            return step_result(step, position, new_position, self._grant())
        if kind == "digest":
            digests = await self.thread.run(self.engine.layer_digests, self.key, position)
            return step_result(step, position, position, self._grant(), layer_digests=digests)
        if kind == "kv_export":
            layers = await self.thread.run(self.engine.export_kv, self.key, position)
            return kv_result(step, position, layers, self._grant())
        if kind == "kv_import":
            target, layers = item.kv
            new_position = await self.thread.run(self.engine.import_kv, self.key, position, target, layers)
            return step_result(step, position, new_position, self._grant())
        out = await self.batcher.run(StepItem(self.key, item.work, item.header.kind == "decode",
                                              lambda: self._closing or step in self._cancelled))
        return result_frame(out, self._grant())

    # -- helpers ---------------------------------------------------------------------

    def _grant(self) -> pb.FlowControl:
        """Return one credit to the client (the top-up rides on the answer)."""
        self.credits += 1
        return pb.FlowControl(credits_granted=1, credits_available=self.credits)

    def _remember_step(self, step: int) -> None:
        self._steps.add(step)
        self._step_order.append(step)
        if len(self._step_order) > REMEMBERED_STEPS:
            old = self._step_order.popleft()
            self._steps.discard(old)
            self._step_floor = max(self._step_floor, old)

    @staticmethod
    def _check_deadline(deadline_ns: int) -> None:
        if deadline_ns and time.time_ns() > deadline_ns:
            late_ms = (time.time_ns() - deadline_ns) / 1e6
            raise DeadlineExpired(f"the frame's deadline passed {late_ms:.1f} ms ago; the work was not started")

    async def _close(self, tasks: list[asyncio.Task]) -> None:
        """Stop the reader and executor, then free the session's caches."""
        self._closing = True  # a running item stops at its next chunk boundary
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for reply, step in list(self._replies.items()):  # Batch entries that will never run
            self._answer(error_frame(self._ended(), step, session_closed=True), reply)
        await self._release()

    async def _release(self) -> None:
        # Leave the table only once the caches are freed: a Release arriving meanwhile finds the
        # stream and waits for `closed`, instead of answering at once while the slot is still held.
        with contextlib.suppress(RuntimeServiceError):
            await self.thread.run(self.engine.release, self.key)
        self.routes.remove(self)
        self.closed.set()
