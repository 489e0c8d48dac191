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

from inference_engine.config import ServerConfig
from inference_engine.decoding.call_output import CallOutput  # issue 13: text, stop strings, usage
from inference_engine.decoding.drafter import Drafter, ModelDrafter, PromptLookupDrafter
from inference_engine.decoding.options import StepOptions  # issue 13: sampling, logprobs
from inference_engine.decoding.step import StepResult, decode_step
from inference_engine.errors import InvariantViolation
from inference_engine.runtime.coordinator import AppendTokensCoordinator
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.session import Session
from inference_engine.runtime.session_store import SessionStore
from inference_engine.runtime.types import (
    AppendParams,
    AppendResult,
    CreateSessionParams,
    DecodeMode,
    GenerateChunk,
    GenerateParams,
    SessionCreated,
    SessionInfo,
    StopReason,
)
from inference_engine.text.chat import resolve_input  # issue 13: text/chat input
from inference_engine.text.codec import require, text_codec  # issue 13: the model's tokenizer

log = logging.getLogger(__name__)
Emit = Callable[[GenerateChunk], Awaitable[None]]


@dataclass
class _DecodeState:
    """The last step's result until it is handed to the stream (set on the engine thread)."""

    unsent: StepResult | None = None


class Runtime:
    """All RPC semantics, independent of gRPC."""

    def __init__(self, engine: Engine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.store = SessionStore(config.max_sessions, config.session_ttl_s)
        self.is_shutting_down = False
        self._sweeper: asyncio.Task | None = None
        self.text = text_codec(engine.loaded.tokenizer)  # issue 13: None = token ids only

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
            tokens, chat = list(p.tokens), session.chat
            if p.text is not None:  # issue 13 hook: text/messages become tokens once the session is held
                r = await asyncio.to_thread(resolve_input, require(self.text), chat, session.history, p.text,
                                            session.eos_token_ids, self.config.max_tokens_per_request)
                tokens, chat = list(r.tokens), r.chat
            await self.engine.run(self._coordinator(session).append, tokens)
            session.chat = chat
            return AppendResult(len(session.history), session.verifier.next_global_position, tuple(tokens))
        finally:
            self.store.release(session)

    def _drafter(self, session: Session, mode: DecodeMode) -> Drafter | None:
        """The session's drafter for `mode` (built on first use; runs on the engine thread)."""
        if mode is DecodeMode.GREEDY:
            return None
        if mode not in session.drafters:
            if mode is DecodeMode.SPECULATIVE_LOOKUP:
                session.drafters[mode] = PromptLookupDrafter()
            else:
                session.drafters[mode] = ModelDrafter(lambda: self.engine.make_draft_verifier(session.sink, session.window))
        return session.drafters[mode]

    async def generate(self, p: GenerateParams, emit: Emit) -> None:
        """Greedy or speculative generation; tokens join the history as they are sent.

        Each step commits its tokens, then hands them to `emit`. A step whose tokens were
        never handed over (the caller was cancelled meanwhile) is retracted, so the
        history holds exactly the sent tokens and the session stays consistent.

        Raises:
            SessionNotFound, SessionBusy, InvariantViolation (no tokens appended yet, or
            a draft-model mode on a server without a draft model).
        """
        session = self.store.get(p.session_id)
        if p.mode is DecodeMode.SPECULATIVE_DRAFT and not self.engine.has_draft_model:
            raise InvariantViolation(
                "SPECULATIVE_DRAFT needs a draft model and this server has none (start it with --draft-model); "
                "SPECULATIVE_LOOKUP and GREEDY are available"
            )
        if p.options.stop:
            require(self.text)  # issue 13: stop strings are matched on text
        session.acquire("Generate")
        coord = self._coordinator(session)
        state = _DecodeState()
        stop_ids = p.options.stop_ids(session.eos_token_ids, p.ignore_eos)
        drafted = accepted = produced = 0
        inflight: asyncio.Future[StepResult] | None = None

        def next_step() -> asyncio.Future[StepResult]:  # starts computing at once, before any await
            return self.engine.submit(
                self._step, coord, state, p.mode, p.num_draft_tokens, p.max_new_tokens - produced, stop_ids,
                step_options,
            )

        try:
            # issue 13 hook: per-call text stream (detokenizer, stop strings, usage) and the step's sampling
            out = CallOutput(self.text, session.history, p.options.stop)
            step_options = StepOptions(p.options.sampling, p.options.top_logprobs if p.options.logprobs else None,
                                       out.keep if out.has_text else None)
            if not session.history:
                raise InvariantViolation("the session has no tokens yet: call AppendTokens before Generate")
            stop = StopReason.CANCELLED if self._is_cancelled(session) else None
            inflight = None if stop else next_step()
            while inflight is not None:
                step = await asyncio.shield(inflight)  # a cancelled caller must not cancel the step
                inflight = None
                state.unsent = None  # handed to the transport from here on: it counts as sent
                produced += len(step.tokens)
                drafted, accepted = drafted + step.drafted, accepted + step.accepted
                text = out.take_text(bool(step.tokens))  # issue 13
                if out.is_stopped:
                    stop = StopReason.STOP_STRING
                elif stop_ids.intersection(step.tokens):
                    stop = StopReason.EOS
                elif produced >= p.max_new_tokens:
                    stop = StopReason.MAX_TOKENS
                elif self._is_cancelled(session):
                    stop = StopReason.CANCELLED
                else:
                    inflight = next_step()  # compute the next step while this one is written
                await emit(GenerateChunk(step.tokens, text=text, logprobs=step.logprobs))
            await emit(GenerateChunk((), stop, len(session.history), drafted, accepted, text=out.finish_text(),
                                     usage=out.usage(produced), seed=p.options.sampling.seed))
        finally:
            if inflight is not None:  # let the engine finish the step it is computing
                await asyncio.wait([inflight])
            if state.unsent is not None:  # its tokens were never handed to the stream
                await self.engine.run(coord.retract, len(state.unsent.tokens), state.unsent.prior_logits)
            self.store.release(session)

    def _is_cancelled(self, session: Session) -> bool:
        return session.is_closed or self.is_shutting_down

    def _step(
        self, coord: AppendTokensCoordinator, state: _DecodeState, mode: DecodeMode, k: int, remaining: int,
        stop_ids: frozenset[int], options: StepOptions,
    ) -> StepResult:
        state.unsent = decode_step(coord, self._drafter(coord.session, mode), k, remaining, stop_ids, options)
        return state.unsent

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
