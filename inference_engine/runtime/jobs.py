"""The scheduler's jobs: an AppendTokens call and a Generate call on one session.

Both run on the engine thread, one block per iteration, and hand their results to the
event loop. Neither leaves behind work its client did not see succeed: an append that is
cancelled or fails is undone whole (`SessionCoordinator.restore`), and a Generate step
whose tokens were never taken by the stream is retracted.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from inference_engine.decoding.call_output import CallOutput, Usage
from inference_engine.decoding.drafter import Drafter
from inference_engine.decoding.options import StepOptions
from inference_engine.decoding.step import StepPlan, StepResult, finish_step, plan_step, prefetch_masks
from inference_engine.errors import EngineShutdown, EngineUnavailable
from inference_engine.runtime.job import Job, Kind, Phase, resolve
from inference_engine.runtime.types import AppendResult, GenerateParams, StopReason
from inference_engine.session.coordinator import Checkpoint
from inference_engine.session.session import Session
from inference_engine.execution.executor import Block


class AppendCancelled(Exception):
    """An append was cancelled before it completed; the session is as before it."""


class AppendJob(Job):
    """Feeds an AppendTokens call's tokens in chunks; resolves `future` with the result.

    Once every token is committed the job is HANDING: the result counts as appended only once
    the caller takes it (`take`, on the loop thread, which also ends the job: no engine round
    trip), so no describe or close can show an append whose caller went away and whose abort
    will undo it.
    """

    kind = Kind.APPEND

    def __init__(self, session: Session, tokens: list[int], loop: asyncio.AbstractEventLoop):
        super().__init__(session)
        self.tokens = tokens
        self.fed = 0  # tokens committed so far
        self.future: asyncio.Future[AppendResult] = loop.create_future()
        self.finished: asyncio.Future[None] = loop.create_future()  # resolved once the job ended (taken or undone)
        self._loop = loop
        self._block: Block | None = None
        self.mark: Checkpoint | None = None  # where the session stood before the call (taken at the first plan)
        self._lock = threading.Lock()  # orders `take` (loop thread) against `abort` (engine thread)

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.fed

    def plan(self, budget: int) -> Block | None:
        if self.phase in (Phase.HANDING, Phase.DONE):  # the caller takes the result (maybe since this step's
            return None  # drop of ended jobs), or goes away (then abort undoes it)
        if self.session.is_closed:  # closed while appending: undo it (the close reports the history without it)
            self.is_cancelled = True
            return None
        coord = self.session.coordinator
        if self.mark is None:
            coord.ensure_ready()
            self.mark = coord.checkpoint(len(self.tokens))
        chunk = self.tokens[self.fed : self.fed + budget]
        self._block = coord.begin(chunk, all_logits=False)
        return self._block

    def update(self, result: object) -> None:
        coord, block = self.session.coordinator, self._block
        self._block = None  # the scheduler's plan holds it until the step ends; the ended job lives longer
        coord.end(result)  # raises the block's error: abort undoes the call
        coord.accept(list(block.tokens), len(block.tokens))
        self.fed += len(block.tokens)
        if self.fed == len(self.tokens):
            mx.eval(coord.verifier.next_token_logits)  # the call succeeds only once computed
            self.phase = Phase.HANDING
            self._settle(AppendResult(len(coord.log), coord.verifier.next_global_position, tuple(self.tokens)), None)

    def take(self, also: Callable[[], None] | None = None) -> bool:
        """The caller takes the result (loop thread): from here on it counts, and the job has ended.

        Args:
            also: what else the append changes in the session (its chat log), done in the same step as
                taking it, so a call waiting for the session (a snapshot) sees both or neither.
        Returns:
            False if the job was aborted first (the append was undone; `also` is not called).
        """
        with self._lock:
            if self.phase is not Phase.HANDING:
                return False
            if also is not None:
                also()
            self.phase = Phase.DONE
            # Nothing can undo the append now: its undo point (beyond the rollback room, a copy of the whole
            # K/V) goes with the reply, not when the engine loop next drops the ended job (issue 33).
            self.mark = None
        resolve(self.finished, None, None)
        return True

    def abort(self, exc: BaseException | None) -> None:
        with self._lock:
            if self.phase is not Phase.DONE:  # not taken: undo it
                if self.mark is not None:
                    self.session.coordinator.restore(self.mark)
                self.phase = Phase.DONE
        self._settle(None, exc or AppendCancelled("the append was cancelled; nothing was appended"))
        self.post(self._loop, resolve, self.finished, None, None)

    def _settle(self, result: AppendResult | None, exc: BaseException | None) -> None:
        self.post(self._loop, resolve, self.future, result, exc)


@dataclass(frozen=True)
class GenerateStep:
    """One step's output for the stream."""

    step: StepResult  # the committed tokens (and their logprobs)
    text: str  # their text (a stop string and what follows it cut off)


@dataclass(frozen=True)
class GenerateEnd:
    """The last item of a Generate job's stream."""

    stop_reason: StopReason  # why it ended
    history_length: int  # tokens in the log at the end
    drafted: int  # drafts verified in this call
    accepted: int  # drafts accepted in this call
    text: str  # text held back until the end (a possible stop-string prefix that never completed)
    usage: Usage  # counts and timings of the call
    seed: int  # the seed the call sampled with


class GenerateJob(Job):
    """Decodes a Generate call's steps; hands each to the stream through `out`.

    A step's tokens are committed when its block is forwarded and count as sent once the
    stream takes them (`hand`). The next step is planned only after that, so at most one
    step (at most K + 1 tokens, the rollback room) is ever unsent; it is retracted if the
    stream goes away, and a describe never sees it (the job is not quiescent meanwhile).
    """

    kind = Kind.DECODE

    def __init__(self, session: Session, params: GenerateParams, drafter: Drafter | None, stop_ids: frozenset[int],
                 options: StepOptions, text: CallOutput, loop: asyncio.AbstractEventLoop,
                 is_stopping: Callable[[], bool], wake: Callable[[], None]):
        super().__init__(session)
        self.params = params
        self.drafter = drafter
        self.stop_ids = stop_ids
        self.options = options  # sampling, logprobs, the stop-string cut
        self.text = text  # the call's text stream (engine thread only; see CallOutput)
        self.out: asyncio.Queue[GenerateStep | GenerateEnd | BaseException] = asyncio.Queue()
        self.finished: asyncio.Future[None] = loop.create_future()
        self._loop = loop
        self._is_stopping = is_stopping  # the session was closed or the server is shutting down
        self._wake = wake
        self._lock = threading.Lock()
        self._unhanded: GenerateStep | None = None  # pushed to `out`, not yet taken by the stream
        self._retracted = False  # a step was taken back: its text never reaches the end either
        self._plan: StepPlan | None = None
        self._block: Block | None = None
        self.produced = self.drafted = self.accepted = 0
        self.stop: StopReason | None = None

    @property
    def is_quiescent(self) -> bool:
        return self.is_done or (self.phase is not Phase.HANDING and self._block is None)

    @property
    def is_handing_over(self) -> bool:
        return self.phase is Phase.HANDING and self.stop is None and not self.is_cancelled

    def hand(self, step: GenerateStep) -> bool:
        """The stream takes `step` (loop thread): it counts as sent. False if it was retracted."""
        with self._lock:
            if self._unhanded is not step:
                return False
            self._unhanded = None
            self.phase = Phase.RUNNING
        self._wake()
        return True

    def plan(self, budget: int) -> Block | None:
        if self.stop is None and self._is_stopping():  # closed or shutting down: end now, even mid-hand-off
            self.stop = StopReason.CANCELLED
            self._retract_unhanded()
        if self._unhanded is not None:
            return None  # the stream has not taken the last step yet
        if self.stop is not None:
            self._end()
            return None
        remaining = self.params.max_new_tokens - self.produced
        k = min(self.params.num_draft_tokens, budget - 1)
        self._plan = plan_step(self.session, self.drafter if k > 0 else None, k, remaining, self.stop_ids,
                               self.options)
        self._block = self.session.coordinator.begin(list(self._plan.block), all_logits=self._plan.drafted > 0)
        return self._block

    def overlap(self) -> None:
        if self.options.matcher is not None and self._plan is not None:
            prefetch_masks(self.options.matcher, self._plan, is_finished=False)

    def update(self, result: object) -> None:
        coord = self.session.coordinator
        self._block = None
        step = finish_step(self.session, self._plan, coord.end(result), self.stop_ids, self.options)
        self.produced += len(step.tokens)
        self.drafted, self.accepted = self.drafted + step.drafted, self.accepted + step.accepted
        if self.text.is_stopped:
            self.stop = StopReason.STOP_STRING
        elif self.options.matcher is not None and self.options.matcher.is_complete:
            self.stop = StopReason.CONSTRAINT_COMPLETE
        elif self.stop_ids.intersection(step.tokens):
            self.stop = StopReason.EOS
        elif self.produced >= self.params.max_new_tokens:
            self.stop = StopReason.MAX_TOKENS
        item = GenerateStep(step, self.text.step_text())
        with self._lock:
            self._unhanded = item
            self.phase = Phase.HANDING
        self.post(self._loop, self.out.put_nowait, item)
        if self.options.matcher is not None and self.stop is None:  # the handed step's forward still computes
            prefetch_masks(self.options.matcher, self._plan, is_finished=True)

    def _retract_unhanded(self) -> None:
        """Take back the step the stream has not taken (it will never be sent)."""
        with self._lock:
            unsent, self._unhanded = self._unhanded, None
            if self.phase is Phase.HANDING:
                self.phase = Phase.RUNNING
        if unsent is not None:
            self.session.coordinator.retract(len(unsent.step.tokens), unsent.step.prior_logits)
            if self.options.matcher is not None:
                self.options.matcher.rollback(len(unsent.step.tokens))
            self.produced -= len(unsent.step.tokens)
            self._retracted = True

    def abort(self, exc: BaseException | None) -> None:
        if self._block is not None:  # planned but never forwarded (the iteration was cut short)
            self.session.coordinator.end(None)
            self._block = None
        self._retract_unhanded()
        # Shutting down (or the session closed while a silent route held the step): end the stream properly.
        if isinstance(exc, EngineShutdown) or (isinstance(exc, EngineUnavailable) and self._is_stopping()):
            self.stop = StopReason.CANCELLED
            self._close(self._end_item())
        else:  # a failure (a shard route not answering: UNAVAILABLE; the sent tokens stay), or cancelled
            self._close(exc)

    def _end(self) -> None:
        self._close(self._end_item())

    def _end_item(self) -> GenerateEnd:
        held = "" if self._retracted else self.text.finish_text()
        return GenerateEnd(self.stop, len(self.session.history), self.drafted, self.accepted, held,
                           self.text.usage(self.produced), self.params.options.sampling.seed)

    def _close(self, last: GenerateEnd | BaseException | None) -> None:
        """End the job: `last` (if any) to the stream and `finished` resolved, in one crossing."""
        self.phase = Phase.DONE
        self.post(self._loop, _deliver_last, self.out, last, self.finished)


def _deliver_last(out: asyncio.Queue, last: object | None, finished: asyncio.Future) -> None:
    """On the loop: the stream's last item, then the job's end."""
    if last is not None:
        out.put_nowait(last)
    resolve(finished, None, None)

