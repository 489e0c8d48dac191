"""The runtime: sessions, appends and generation over one engine, in asyncio.

Every model computation runs on the engine's scheduler (the one engine thread): appends
and generations as jobs that share its batched forwards, everything else as plain calls.
This module only orchestrates and keeps what clients see consistent: a call either
succeeds or changes nothing, a stream's history holds exactly the tokens it handed out,
and a describe or close never reports work no client was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, Callable

from inference_engine.config import ServerConfig
from inference_engine.decoding.call_output import CallOutput
from inference_engine.decoding.drafter import Drafter, ModelDrafter
from inference_engine.decoding.options import StepOptions
from inference_engine.errors import EngineUnavailable, InvariantViolation, SessionNotFound
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.jobs import AppendCancelled, AppendJob, GenerateEnd, GenerateJob
from inference_engine.runtime.types import (
    ANONYMOUS,
    AppendParams,
    AppendResult,
    CreateSessionParams,
    DecodeMode,
    GenerateChunk,
    GenerateParams,
    SessionCreated,
    SessionInfo,
)
from inference_engine.runtime.verify_row_cost import lookup_drafter
from inference_engine.session.session import Session
from inference_engine.session.session_store import SessionStore
from inference_engine.short_id import short_id
from inference_engine.text.chat import resolve_input
from inference_engine.text.codec import require, text_codec
from inference_engine.text.constraint import ConstraintCompiler
from inference_engine.text.text_pool import run_text
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier

log = logging.getLogger(__name__)
Emit = Callable[[GenerateChunk], Awaitable[None]]


class Runtime:
    """All RPC semantics, independent of gRPC."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.store = SessionStore(config.max_sessions, config.session_ttl_s, config.max_kv_bytes)
        self.is_shutting_down = False  # running streams end at their next step
        self.is_draining = False  # new calls are refused (running ones go on)
        self._sweeper: asyncio.Task | None = None
        self._streams: set[asyncio.Future] = set()  # running Generate jobs' `finished`
        # The model's tokenizer (None = token ids only); large texts go to its processes.
        self.text = text_codec(engine.loaded.tokenizer, config.text_process_chars)
        self.constraints = ConstraintCompiler(self.text, engine.spec.vocab_size, engine.spec.eos_token_ids)
        self.drafters: dict[DecodeMode, Drafter] = {DecodeMode.SPECULATIVE_LOOKUP: lookup_drafter(engine.verify_row_cost)}
        if engine.has_draft_model:
            # The draft cache catches up with a long history as an append would: a batch's rows per step at most.
            catch_up = engine.scheduler.append_rows or engine.scheduler.max_rows
            self.drafters[DecodeMode.SPECULATIVE_DRAFT] = ModelDrafter(self._draft_cache, catch_up)

    def _draft_cache(self, session: Session) -> SinkWindowVerifier:
        """A draft-model cache for `session`, counted in the pool (engine thread).

        Raises:
            PoolExhausted: it would exceed --max-kv-bytes.
        """
        replaced = session.draft.verifier.nbytes if session.draft is not None else 0
        self.store.reserve_bytes(self.engine.draft_slab_bytes(session.sink, session.window) - replaced)
        return self.engine.make_draft_cache(session.sink, session.window)

    def start(self) -> None:
        """Start the idle-session sweeper (call from the event loop)."""
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def drain(self, grace_s: float) -> None:
        """Shutting down: refuse new calls, let running streams finish, and end the rest in time.

        Streams get `grace_s` less a margin to finish on their own; those still running are
        then ended at their next step with their final message (stop reason CANCELLED),
        so no client sees its stream cut.
        """
        self.is_draining = True
        margin = min(1.0, grace_s / 4)
        if self._streams:
            await asyncio.wait(list(self._streams), timeout=max(0.0, grace_s - margin))
        self.is_shutting_down = True
        self.engine.scheduler.wake()
        if self._streams:
            await asyncio.wait(list(self._streams), timeout=margin)

    def check_serving(self) -> None:
        """Refuse a call that would start something new (a session, an append, a stream) while draining.

        Raises:
            EngineUnavailable: the server is shutting down.
        """
        if self.is_draining:
            raise EngineUnavailable("the server is shutting down; retry against a live server")

    async def stop(self) -> None:
        """Stop the sweeper and the tokenizer processes; in-flight generations end at their next step."""
        self.is_shutting_down = True
        if self._sweeper:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        if self.text is not None:
            await asyncio.to_thread(self.text.close)  # running tokenizations finish, the workers are joined

    async def _sweep(self) -> None:
        period = max(0.05, min(5.0, self.config.session_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            self.store.expire_idle()

    async def create_session(self, p: CreateSessionParams) -> SessionCreated:
        """Open a session with its own KV slab.

        Raises:
            PoolExhausted: no slab is free.
            EngineUnavailable: the server is shutting down.
        """
        self.check_serving()
        sink = p.sink or self.config.default_sink
        window = p.window or self.config.default_window
        # The slab is held while the session is built (its K/V prepared off the engine thread, then
        # opened on it), so CreateSessions racing for the last slab are refused before they allocate.
        with self.store.reservation(self.engine.slab_bytes(sink, window)):
            session_id = self.store.new_id()
            prepared = await asyncio.to_thread(self.engine.prepare_session, sink, window)
            coordinator = await self.engine.run(self.engine.open_session, sink, window, short_id(session_id), prepared)
            eos = p.eos_token_ids or self.engine.spec.eos_token_ids
            session = Session(session_id, coordinator, sink, window, tuple(eos), p.client_label, owner=p.owner)
            try:
                self.store.add(session, reserved=True)
            except BaseException:
                session.free()
                raise
        log.info("session %s created by %s (sink %d, window %d, label %r)", session.tag, short_id(p.owner), sink,
                 window, p.client_label)
        return SessionCreated(session.session_id, sink, window)

    async def append_tokens(self, p: AppendParams) -> AppendResult:
        """Append tokens to a session (prefill on the first call), in chunks shared with other sessions' work.

        If the caller goes away (cancelled, deadline) before the result is returned, the
        append is undone whole: the history is exactly as before the call.

        Raises:
            SessionNotFound: unknown, or closed before the append completed (nothing appended).
            SessionBusy, InvariantViolation.
        """
        self.check_serving()
        session = self.store.get(p.session_id, p.owner)
        session.acquire("AppendTokens")
        try:
            if p.expected_history_length is not None and p.expected_history_length != len(session.history):
                raise InvariantViolation(
                    f"expected_history_length is {p.expected_history_length} but the session holds "
                    f"{len(session.history)} tokens; nothing was appended (read the history length with GetSessionInfo)"
                )
            tokens, chat = list(p.tokens), session.chat
            if p.text is not None:  # text or chat messages become tokens once the session is held
                r = await run_text(resolve_input, require(self.text), chat, session.history, p.text,
                                            session.eos_token_ids, self.config.max_tokens_per_request)
                tokens, chat = list(r.tokens), r.chat
            job = AppendJob(session, tokens, asyncio.get_running_loop())
            self.engine.scheduler.start(job)
            try:
                result = await asyncio.shield(job.future)
            except AppendCancelled:
                raise self._closed(session) from None
            except asyncio.CancelledError:
                await self._undo_append(job)
                raise
            # From here on the append counts (no await in between: no cancel can land), with its chat turn.
            if job.take(also=lambda: setattr(session, "chat", chat)):
                self.engine.scheduler.settled(session)  # wakes the engine only for a call waiting on the session
            else:
                raise EngineUnavailable("the engine is shutting down; nothing was appended")
            return result
        finally:
            self.store.release(session)

    async def _undo_append(self, job: AppendJob) -> None:
        """The caller went away: the job stops, or undoes the append if it had completed (on the engine thread)."""
        job.cancel()
        self.engine.scheduler.wake()
        await asyncio.wait([job.finished])
        job.future.exception()  # retrieved: an undone append's error goes to no one

    def _closed(self, session: Session) -> SessionNotFound:
        return SessionNotFound(f"session {session.session_id!r} was closed before the call completed; nothing was "
                               "appended")

    async def generate(self, p: GenerateParams, emit: Emit) -> None:
        """Greedy or speculative generation; tokens join the history as they are sent.

        Each step commits its tokens, then hands them to `emit`. A step whose tokens were
        never handed over (the caller was cancelled meanwhile) is retracted, so the
        history holds exactly the sent tokens and the session stays consistent.

        Raises:
            SessionNotFound, SessionBusy, InvariantViolation (no tokens appended yet, or
            a draft-model mode on a server without a draft model). InvalidRequest: the
            constraint does not compile. FeatureUnavailable: a constraint on a model without a tokenizer.
        """
        self.check_serving()
        session = self.store.get(p.session_id, p.owner)
        if p.mode is DecodeMode.SPECULATIVE_DRAFT and not self.engine.has_draft_model:
            raise InvariantViolation(
                "SPECULATIVE_DRAFT needs a draft model and this server has none (start it with --draft-model); "
                "SPECULATIVE_LOOKUP and GREEDY are available"
            )
        if p.options.stop:
            require(self.text)  # stop strings are matched on text
        session.acquire("Generate")
        try:
            if not session.history:
                raise InvariantViolation("the session has no tokens yet: call AppendTokens before Generate")
            matcher = None
            if p.options.constraint is not None:  # compiled (or re-derived from the session's tokens) off the loop
                session.constraint, matcher = await asyncio.to_thread(
                    self.constraints.resume, p.options.constraint, session.constraint, list(session.history))
            out = CallOutput(self.text, session.history, p.options.stop)  # text, stop strings, usage
            options = StepOptions(p.options.sampling, p.options.top_logprobs if p.options.logprobs else None,
                                  out.keep if out.has_text else None, matcher)
            stop_ids = p.options.stop_ids(session.eos_token_ids, p.ignore_eos)
            job = GenerateJob(session, p, self.drafters.get(p.mode), stop_ids, options, out,
                              asyncio.get_running_loop(), lambda: session.is_closed or self.is_shutting_down,
                              self.engine.scheduler.wake)
            self._streams.add(job.finished)
            try:
                self.engine.scheduler.start(job)
                await self._stream(job, emit)
            finally:
                if not job.is_done:  # else it ended by itself: no crossing needed
                    job.cancel()  # its unsent step is retracted
                    self.engine.scheduler.wake()
                await asyncio.wait([job.finished])
                self._streams.discard(job.finished)
        finally:
            self.store.release(session)

    @staticmethod
    async def _stream(job: GenerateJob, emit: Emit) -> None:
        while True:
            item = await job.out.get()
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, GenerateEnd):
                await emit(GenerateChunk((), item.stop_reason, item.history_length, item.drafted, item.accepted,
                                         text=item.text, usage=item.usage, seed=item.seed))
                return
            if job.hand(item):  # from here on it counts as sent
                await emit(GenerateChunk(item.step.tokens, text=item.text, logprobs=item.step.logprobs))

    async def rollback(self, session_id: str, n: int, owner: str = ANONYMOUS) -> int:
        """Drop the last `n` tokens of `owner`'s idle session (at most --max-rollback); returns its length.

        The next-token logits are gone until a token is appended (Generate needs an append first).

        Raises:
            SessionNotFound: unknown, closed or another identity's. SessionBusy: a call holds it.
            InvariantViolation: `n` is beyond the rollback room or the history.
        """
        self.check_serving()
        session = self.store.get(session_id, owner)
        session.acquire("Rollback")
        try:
            def cut() -> int:
                session.coordinator.retract(n, None)
                return len(session.history)

            return await self.engine.run(cut)
        finally:
            self.store.release(session)

    async def close_session(self, session_id: str, owner: str = ANONYMOUS) -> int:
        """Close `owner`'s session; returns its final history length (after its running call ends).

        Raises:
            SessionNotFound: unknown, already closed or another identity's.
        """
        session = self.store.close(session_id, owner)
        log.info("session %s closed", session.tag)
        self.engine.scheduler.wake()  # a running call ends at its next step
        return await self.engine.run(lambda: len(session.history), session=session)

    async def session_info(self, session_id: str, owner: str = ANONYMOUS) -> SessionInfo:
        """Describe `owner`'s session as its clients have seen it (waits for a running call's clean point).

        Raises:
            SessionNotFound: unknown, closed, expired or another identity's.
        """
        s = self.store.get(session_id, owner)
        s.touch()

        def describe() -> SessionInfo:
            digest = s.coordinator.state_digest()  # first: it may rebuild the cache
            v = s.coordinator.verifier
            return SessionInfo(
                session_id=s.session_id, history_length=len(s.history),
                next_global_position=v.next_global_position, cached_tokens=len(v.cached_token_sequence),
                sink=s.sink, window=s.window, eos_token_ids=s.eos_token_ids, client_label=s.client_label,
                created_ns=s.created_ns, last_used_ns=s.last_used_ns, state_digest=digest,
                is_exact=self.engine.is_exact, kv_bytes=s.kv_bytes,
            )

        return await self.engine.run(describe, session=s)
