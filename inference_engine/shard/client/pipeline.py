"""ShardPipeline: drive a route of shard workers (head, middles, tail) as one model.

    async with ShardPipeline(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"]) as route:
        await route.open("s1", sink=4, window=1024)
        logits = await route.forward("s1", prompt, all_logits=False)  # (1, vocab) float32
        logits = await route.forward("s1", draft)                     # (len(draft), vocab)
        await route.trim("s1", 2)                                     # drop 2 rejected tokens
        digests = await route.layer_digests("s1")                     # per-layer K/V SHA-256s
        layers = await route.export_kv("s1"); await route.release("s1")  # retained K/V; free
        # (export_kv / import_kv: a snapshot of a routed session is the same file as one process's)

    # After a worker restart (or any failure): a newer epoch, then replay the history.
    route.advance_epoch()
    await route.open("s1", sink=4, window=1024)
    logits = await route.forward("s1", history, all_logits=False)

Every answer is checked (step, positions, dtype, shape, finite values) before use: a wrong
OK answer raises MalformedShardOutput. A failed step leaves the workers inconsistent, so the
session is closed on every worker and later calls raise InvariantViolation until it is opened
at a newer route epoch (`advance_epoch`) and its tokens (the caller's history) are replayed.
Calls on one session are serialized; sessions are independent.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Sequence

import grpc

from inference_engine.errors import InvalidRequest, InvariantViolation, SessionNotFound
from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.shard.client.forwarding import Forwarding
from inference_engine.shard.client.hop_stream import HopStream
from inference_engine.shard.client.route_session import (
    HopStats, RouteSession, check_positions, check_route, checked_digests, checked_kv,
)
from inference_engine.shard.protocol.errors import error_of_rpc
from inference_engine.shard.protocol.types import LayerRange, ShardCapabilities, ShardHealth
from inference_engine.shard.protocol.wire import (
    CLIENT_CHANNEL_OPTIONS,
    LayerKV,
    capabilities_of,
    step_frame,
    kv_import_frame,
)
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc
from inference_engine.execution.kv_cache import CacheGeometry


class ShardPipeline(Forwarding):
    """A route of shard workers computing one model, for many sessions."""

    def __init__(self, addresses: Sequence[str], *, epoch: int = 1, step_timeout_s: float = 120.0,
                 connect_timeout_s: float = 10.0, channel_security: ClientSecurity | None = None):
        """
        Args:
            addresses: "host:port" of each worker, head first, tail last.
            epoch: the route epoch sessions open at (>= 1).
            step_timeout_s: deadline of one work frame on one worker.
            connect_timeout_s: deadline of SessionOpen and of GetCapability / Health / Release / Cancel calls.
            channel_security: CA, client certificate and token presented to the workers (None = plaintext).
        """
        if not addresses:
            raise InvalidRequest("a route needs at least one worker address")
        if epoch < 1:
            raise InvalidRequest(f"route epoch {epoch} is out of range; allowed >= 1")
        self.addresses = tuple(addresses)
        self.step_timeout_s = step_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._epoch = epoch
        self.channel_security = channel_security
        self._channels: list[grpc.aio.Channel] = []
        self._stubs: list[pb_grpc.ShardRuntimeStub] = []
        self._batches = []  # each worker's Batch stream (forward_many), from `connect`
        self._caps: tuple[ShardCapabilities, ...] = ()
        self._sessions: dict[str, RouteSession] = {}
        self._stats = [[0, 0.0] for _ in self.addresses]  # calls, seconds per hop
        self.on_silent: Callable[[str], None] | None = None  # told a worker's address when it misses a deadline

    async def __aenter__(self) -> "ShardPipeline":
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- route -----------------------------------------------------------------------

    async def connect(self) -> tuple[ShardCapabilities, ...]:
        """Ask every worker what it computes and check that they form one route.

        Returns:
            Each worker's capabilities, head first.
        Raises:
            ShardUnavailable: a worker cannot be reached.
            InvalidRequest: the layer ranges do not tile [0, num_layers) in order, or the
                workers do not run the same model.
        """
        if not self._channels:
            self._channels = [open_channel(a, self.channel_security, CLIENT_CHANNEL_OPTIONS) for a in self.addresses]
            self._stubs = [pb_grpc.ShardRuntimeStub(c) for c in self._channels]
        replies = await asyncio.gather(*(self._unary(i, "GetCapability", pb.ShardCapabilityRequest())
                                         for i in range(len(self._stubs))))
        caps = tuple(capabilities_of(r) for r in replies)
        check_route(self.addresses, caps)
        self._caps = caps
        self._open_batches()
        return caps

    @property
    def capabilities(self) -> tuple[ShardCapabilities, ...]:
        """Each worker's capabilities, head first (empty before `connect`)."""
        return self._caps

    @property
    def max_block(self) -> int:
        """Largest rows-per-chunk every worker accepts (the route's exact tile)."""
        return min(c.max_block for c in self._connected())

    @property
    def max_rollback(self) -> int:
        """Largest rollback every worker accepts."""
        return min(c.max_rollback for c in self._connected())

    @property
    def vocab_size(self) -> int:
        """Logits width; token ids must be below it."""
        return self._connected()[0].vocab_size

    @property
    def epoch(self) -> int:
        """The route epoch new sessions open at."""
        return self._epoch

    def advance_epoch(self, epoch: int | None = None) -> int:
        """Move to a newer route epoch (after a worker restart); returns it.

        Sessions opened afterwards supersede older incarnations on every worker.

        Raises:
            InvalidRequest: `epoch` is not newer than the current one.
        """
        new = self._epoch + 1 if epoch is None else epoch
        if new <= self._epoch:
            raise InvalidRequest(f"route epoch {new} is not newer than {self._epoch}")
        self._epoch = new
        return new

    def _connected(self) -> tuple[ShardCapabilities, ...]:
        if not self._caps:
            raise InvariantViolation("the pipeline is not connected; call connect() first")
        return self._caps

    # -- sessions --------------------------------------------------------------------

    async def open(self, session_id: str, sink: int, window: int, *, max_block: int | None = None,
                   max_rollback: int | None = None) -> CacheGeometry:
        """Open a session on every worker at the current route epoch.

        Args:
            session_id: the caller's id (1..128 characters).
            sink / window: cache geometry, as for a single-process session.
            max_block: rows per forward chunk (default: the route's `max_block`); use the
                single-process engine's block to reproduce its results bit for bit.
            max_rollback: deepest `trim` (default: the route's `max_rollback`).
        Returns:
            The geometry every worker uses.
        Raises:
            InvalidRequest: the session is already open at this epoch, or a worker rejects the geometry.
            PoolExhausted, ShardUnavailable, EpochStale, WorkCancelled: a worker refused.
        """
        self._connected()
        old = self._sessions.get(session_id)
        if old is not None:
            if old.epoch >= self._epoch:
                raise InvalidRequest(f"session {session_id!r} is already open at route epoch {old.epoch}; "
                                     "advance_epoch() before opening it again")
            self._close_hops(old)
            del self._sessions[session_id]
        geometry = CacheGeometry(sink=sink, window=window, max_block=max_block or self.max_block,
                                 max_rollback=self.max_rollback if max_rollback is None else max_rollback)
        hops = [HopStream(stub, address, caps, self.step_timeout_s, self._silent)
                for stub, address, caps in zip(self._stubs, self.addresses, self._caps)]
        session = RouteSession(session_id, self._epoch, geometry, hops)
        try:  # every open settles first: a release racing a SessionOpen in flight would miss it
            for outcome in await asyncio.gather(*(h.open(session_id, self._epoch, geometry, self.connect_timeout_s)
                                                  for h in hops), return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        except BaseException as exc:  # free what did open, so the same epoch can be tried again at once
            self._close_hops(session)
            if not isinstance(exc, asyncio.CancelledError):  # cancelled: the ended streams free it (no waiting)
                await self._release_on_workers(session)
            raise
        self._sessions[session_id] = session
        return geometry

    def position(self, session_id: str) -> int:
        """The session's next global position (tokens computed into its caches).

        Raises:
            SessionNotFound: not open in this pipeline.
        """
        return self._session(session_id).position

    async def trim(self, session_id: str, n: int) -> int:
        """Drop the session's last `n` positions on every worker (speculative rollback).

        Returns:
            The new position.
        Raises:
            InvariantViolation: n exceeds max_rollback or the position (nothing is sent),
                or the session failed earlier.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        allowed = min(s.geometry.max_rollback, s.position)
        if not 0 <= n <= allowed:
            self._check_usable(s)
            raise InvariantViolation(f"cannot trim {n} positions; allowed 0..{allowed}")

        def advance() -> None:
            s.position -= n

        await self._round(s, lambda i, _, deadline: step_frame("trim", s.epoch, s.step, s.position, deadline, tokens=n),
                          lambda hop, result, _: check_positions(hop, result, s.position, s.position - n, "trimmed"),
                          advance)
        return s.position

    async def layer_digests(self, session_id: str) -> list[bytes]:
        """SHA-256 of every block's cached K/V, in layer order (head's blocks first).

        Equal to `[c.digest() for c in verifier.cache]` of a single process fed the same
        tokens, so `verifier.state_digest(logits, cached_tokens, position, digests)` can be
        computed for a route exactly as for one process.

        Raises:
            InvariantViolation: the session failed earlier.
            MalformedShardOutput: a worker reported the wrong number or size of digests.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)

        return await self._round(s, lambda i, _, deadline: step_frame("digest", s.epoch, s.step, s.position, deadline),
                                 lambda hop, result, got: (got or []) + checked_digests(hop, result, s.position),
                                 count=False)

    async def export_kv(self, session_id: str) -> LayerKV:
        """Every block's retained K/V, in layer order (head's blocks first): the session's canonical state.

        Equal to `SinkWindowKVCache.canonical_state()` of a single process fed the same tokens.

        Raises:
            InvariantViolation: the session failed earlier.
            MalformedShardOutput: a worker reported the wrong number, shape or dtype of tensors.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        n = len(s.geometry.visible_positions(s.position)[:-1]) if s.position else 0

        return await self._round(s, lambda i, _, deadline: step_frame("kv_export", s.epoch, s.step, s.position, deadline),
                                 lambda hop, result, got: (got or []) + checked_kv(hop, result, s.position, n),
                                 count=False)

    async def import_kv(self, session_id: str, position: int, layers: LayerKV) -> int:
        """Load a canonical state (as `export_kv` returns it) into a session just opened; returns `position`.

        Each worker gets its own blocks' K/V; the session then stands at `position`.

        Raises:
            InvalidRequest: `layers` is not one (keys, values) per model block (nothing is sent).
            InvariantViolation: the session is not at position 0, or failed earlier.
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        if len(layers) != self._connected()[0].num_layers:
            raise InvalidRequest(f"K/V of {len(layers)} blocks for a model of {self._connected()[0].num_layers}")
        if s.position != 0:
            self._check_usable(s)
            raise InvariantViolation(f"K/V import into session {session_id!r} at position {s.position}; it must be "
                                     "just opened (position 0)")

        def frame(i: int, _: object, deadline: int) -> pb.ShardRequestFrame:
            span = s.hops[i].caps.layers
            return kv_import_frame(s.epoch, s.step, 0, position, layers[span.start : span.end], deadline)

        def advance() -> None:
            s.position = position

        await self._round(s, frame, lambda hop, result, _: check_positions(hop, result, 0, position, "imported K/V to"),
                          advance, count=False)
        return position

    async def cancel(self, session_id: str) -> None:
        """Cancel the session on every worker (out of band; a running step stops within a chunk).

        The session fails: reopen it at a newer epoch to use it again.
        """
        s = self._session(session_id)
        s.broken = s.broken or "cancelled"
        await asyncio.gather(*(self._unary(i, "Cancel", pb.ShardCancelRequest(route_session_id=session_id,
                                                                              route_epoch=s.epoch))
                               for i in range(len(s.hops))), return_exceptions=True)
        self._close_hops(s)

    async def release(self, session_id: str) -> bool:
        """Free the session on every worker and forget it.

        Returns:
            Whether every worker still held the session (False if unknown here).
        Raises:
            the mapped error of a worker that could not be asked (after asking the others).
        """
        s = self._sessions.pop(session_id, None)
        if s is None:
            return False
        replies = await self._release_on_workers(s)
        self._close_hops(s)
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        return all(r.existed for r in replies)

    async def health(self) -> tuple[ShardHealth, ...]:
        """Each worker's health, head first.

        Raises:
            ShardUnavailable: a worker cannot be reached.
        """
        replies = await asyncio.gather(*(self._unary(i, "Health", pb.ShardHealthRequest())
                                         for i in range(len(self.addresses))))
        return tuple(ShardHealth(r.serving, r.detail, r.sessions) for r in replies)

    def hop_stats(self) -> tuple[HopStats, ...]:
        """Per-worker round-trip counters (for benchmarks)."""
        layers = [c.layers for c in self._caps] or [LayerRange(0, 1)] * len(self.addresses)
        return tuple(HopStats(a, lr, calls, secs) for a, lr, (calls, secs) in zip(self.addresses, layers, self._stats))

    async def close(self) -> None:
        """Close every session's streams (workers free their caches) and the channels."""
        for s in self._sessions.values():
            self._close_hops(s)
        self._sessions.clear()
        self._close_batches()
        for channel in self._channels:
            await channel.close()
        self._channels, self._stubs = [], []

    # -- helpers ---------------------------------------------------------------------

    def _session(self, session_id: str) -> RouteSession:
        s = self._sessions.get(session_id)
        if s is None:
            raise SessionNotFound(f"session {session_id!r} is not open in this pipeline")
        return s

    @staticmethod
    def _check_usable(s: RouteSession) -> None:
        if s.broken:
            raise InvariantViolation(f"session {s.session_id!r} failed ({s.broken}); advance_epoch(), open it "
                                     "again and replay its tokens")

    def _break(self, s: RouteSession, exc: BaseException) -> None:
        s.broken = s.broken or f"{type(exc).__name__}: {exc}"
        self._close_hops(s)

    @staticmethod
    def _close_hops(s: RouteSession) -> None:
        for hop in s.hops:
            hop.close()

    async def _release_on_workers(self, s: RouteSession) -> list[object]:
        """Release on every worker; each reply or exception, head first."""
        request = pb.ShardReleaseRequest(route_session_id=s.session_id, route_epoch=s.epoch)
        return await asyncio.gather(*(self._unary(i, "Release", request) for i in range(len(s.hops))),
                                    return_exceptions=True)

    async def _round(self, s: RouteSession, frame: Callable[[int, Any, int], pb.ShardRequestFrame],
                     check: Callable[[HopStream, pb.ShardStepResult, Any], Any], done: Callable[[], None] = lambda: None,
                     count: bool = True) -> Any:
        """One idempotency step through every hop, head first; any failure fails the session.

        Args:
            frame: (hop index, previous hop's checked output, deadline) -> the hop's frame.
            check: (hop, its answer, previous output) -> this hop's checked output (raises if wrong).
            done: applied once every hop answered (under the session's lock).
            count: record the hops' latencies (forward blocks and trims).
        Returns:
            The last hop's checked output.
        """
        async with s.lock:
            self._check_usable(s)
            s.step += 1
            deadline = time.time_ns() + int(self.step_timeout_s * 1e9)
            data: Any = None
            try:
                for i, hop in enumerate(s.hops):
                    started = time.perf_counter()
                    result = await hop.request(frame(i, data, deadline), s.step)
                    data = check(hop, result, data)
                    if count:
                        self._count(i, started)
            except BaseException as exc:
                self._break(s, exc)
                raise
            done()
            return data

    def _silent(self, address: str) -> None:
        """A worker did not answer within its deadline (a hung worker counts as failed: `on_silent` may end it)."""
        if self.on_silent is not None:
            self.on_silent(address)

    def _count(self, hop: int, started: float) -> None:
        self._stats[hop][0] += 1
        self._stats[hop][1] += time.perf_counter() - started

    async def _unary(self, i: int, method: str, request: object) -> object:
        if not self._stubs:
            raise InvariantViolation("the pipeline is not connected; call connect() first")
        try:
            return await getattr(self._stubs[i], method)(request, timeout=self.connect_timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._silent(self.addresses[i])
            raise error_of_rpc(exc, self.addresses[i]) from exc
