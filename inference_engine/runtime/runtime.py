"""The runtime: sessions, appends and generation over one engine, in asyncio.

Every model computation goes through `Engine.run` (the engine thread); this module only
orchestrates and keeps session bookkeeping consistent under cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import AsyncIterator, Awaitable, Callable

import mlx.core as mx

from inference_engine.config import ServerConfig
from inference_engine.errors import InvariantViolation
from inference_engine.runtime.coordinator import AppendTokensCoordinator
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.session import Session
from inference_engine.runtime.session_store import SessionStore
from inference_engine.runtime.types import (
    AppendParams,
    AppendResult,
    CreateSessionParams,
    GenerateChunk,
    GenerateParams,
    SessionCreated,
    SessionInfo,
    StopReason,
)

log = logging.getLogger(__name__)
Emit = Callable[[GenerateChunk], Awaitable[None]]


@dataclass
class _DecodeState:
    """A token sent to the client but not yet fed to the cache (cleared on the engine thread)."""

    pending: int | None = None


class Runtime:
    """All RPC semantics, independent of gRPC."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.store = SessionStore(config.max_sessions, config.session_ttl_s)
        self.is_shutting_down = False
        self._sweeper: asyncio.Task | None = None

    def start(self) -> None:
        """Start the idle-session sweeper (call from the event loop)."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        """Stop the sweeper; in-flight generations end at their next step."""
        self.is_shutting_down = True
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep(self) -> None:
        period = max(0.05, min(5.0, self.config.session_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            self.store.expire_idle()

    def _coordinator(self, session: Session) -> AppendTokensCoordinator:
        return AppendTokensCoordinator(session, lambda: self.engine.make_verifier(session.sink, session.window))

    async def create_session(self, p: CreateSessionParams) -> SessionCreated:
        """Open a session with its own KV slab.

        Raises:
            PoolExhausted: no slab is free.
        """
        self.store.reserve()
        sink = p.sink or self.config.default_sink
        window = p.window or self.config.default_window
        verifier = await self.engine.run(self.engine.make_verifier, sink, window)
        eos = p.eos_token_ids or self.engine.spec.eos_token_ids
        session = Session(self.store.new_id(), verifier, sink, window, tuple(eos), p.client_label)
        self.store.add(session)
        log.info("session %s created (sink %d, window %d, label %r)", session.session_id, sink, window, p.client_label)
        return SessionCreated(session.session_id, sink, window)

    async def append_tokens(self, p: AppendParams) -> AppendResult:
        """Append tokens to a session (prefill on the first call).

        Raises:
            SessionNotFound, SessionBusy, InvariantViolation.
        """
        session = self.store.get(p.session_id)
        session.acquire("AppendTokens")
        try:
            await self.engine.run(self._coordinator(session).append, list(p.tokens))
            return AppendResult(len(session.history), session.verifier.next_global_position)
        finally:
            self.store.release(session)

    async def generate(self, p: GenerateParams, emit: Emit) -> None:
        """Greedy generation; each token is emitted, then joins the history.

        A token counts as sent once it is handed to `emit`; if the caller is cancelled,
        the history holds exactly the sent tokens and the session stays consistent.

        Raises:
            SessionNotFound, SessionBusy, InvariantViolation (no tokens appended yet).
        """
        session = self.store.get(p.session_id)
        session.acquire("Generate")
        coord = self._coordinator(session)
        state = _DecodeState()
        try:
            if not session.history:
                raise InvariantViolation("the session has no tokens yet: call AppendTokens before Generate")
            stop = StopReason.MAX_TOKENS
            for _ in range(p.max_new_tokens):
                if session.is_closed or self.is_shutting_down:
                    stop = StopReason.CANCELLED
                    break
                token = await self.engine.run(self._greedy_step, coord, state)
                # Sent from the moment it is handed to the transport: a cancel that lands
                # mid-write may still deliver it, so it must join the history either way.
                state.pending = token
                await emit(GenerateChunk((token,)))
                if not p.ignore_eos and token in session.eos_token_ids:
                    stop = StopReason.EOS
                    break
            if state.pending is not None:
                await self.engine.run(self._feed_pending, coord, state)
            await emit(GenerateChunk((), stop, len(session.history)))
        finally:
            if state.pending is not None:  # cancelled after a token was sent
                await self.engine.run(self._feed_pending, coord, state)
            self.store.release(session)

    @staticmethod
    def _feed_pending(coord: AppendTokensCoordinator, state: _DecodeState) -> None:
        if state.pending is not None:
            coord.append([state.pending])
            state.pending = None

    @classmethod
    def _greedy_step(cls, coord: AppendTokensCoordinator, state: _DecodeState) -> int:
        """Feed the token sent last (if any), then pick the next one greedily."""
        cls._feed_pending(coord, state)
        logits = coord.session.verifier.next_token_logits
        return int(mx.argmax(logits).item())

    async def close_session(self, session_id: str) -> int:
        """Close a session; returns its history length.

        Raises:
            SessionNotFound: unknown or already closed.
        """
        session = self.store.close(session_id)
        log.info("session %s closed", session_id)
        return len(session.history)

    async def session_info(self, session_id: str) -> SessionInfo:
        """Describe a session (digest computed on the engine thread).

        Raises:
            SessionNotFound.
        """
        s = self.store.get(session_id)
        s.touch()

        def describe() -> SessionInfo:
            v = s.verifier
            return SessionInfo(
                session_id=s.session_id, history_length=len(s.history),
                next_global_position=v.next_global_position, cached_tokens=len(v.cached_token_sequence),
                sink=s.sink, window=s.window, eos_token_ids=s.eos_token_ids, client_label=s.client_label,
                created_ns=s.created_ns, last_used_ns=s.last_used_ns, state_digest=v.state_digest(),
                is_exact=self.engine.is_exact, kv_bytes=v.nbytes,
            )

        return await self.engine.run(describe)
