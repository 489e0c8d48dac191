"""A block of tokens through the route: `forward` (one session, on its own Session streams) and
`forward_many` (the blocks of many route sessions in one message per hop).

Mixed into `ShardPipeline` (it uses the pipeline's sessions, checks and counters). In
`forward_many` each session still takes one idempotency step through every hop, exactly as
`forward` would send it, and the
worker admits and runs each entry as its session stream's own frame; only the transport is
shared: one ShardBatchRequest per hop carries every session's frame, so a scheduler iteration
of N sessions costs a hop one message each way rather than N. The bits cannot change: a worker
computes the sessions that wait together in one forward either way.

A session whose entry fails (its error, a wrong answer, the Batch stream breaking) fails as a
failed `forward` would (the caller reopens it at a newer epoch and replays its tokens); the other
sessions go on. A retryable refusal for lack of credit is sent again on the session's own stream.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

import numpy as np

from inference_engine.errors import InvalidRequest, RuntimeServiceError
from inference_engine.shard.client.hop_stream import REFUSED, UNRELATED, BatchStream, HopStream
from inference_engine.shard.client.route_session import RouteSession, checked_output
from inference_engine.shard.protocol.errors import MalformedShardOutput
from inference_engine.shard.protocol.types import ShardCapabilities
from inference_engine.shard.protocol.wire import MAX_ROWS, work_frame
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc

Request = tuple[str, Sequence[int], bool]  # (session id, tokens, all_logits), as for `forward`


class Forwarding:
    """`forward` and `forward_many` of ShardPipeline."""

    if TYPE_CHECKING:  # provided by ShardPipeline
        addresses: tuple[str, ...]
        step_timeout_s: float
        vocab_size: int
        _stubs: list[pb_grpc.ShardRuntimeStub]
        _caps: tuple[ShardCapabilities, ...]

        def _session(self, session_id: str) -> RouteSession: ...
        @staticmethod
        def _check_usable(s: RouteSession) -> None: ...
        def _break(self, s: RouteSession, exc: BaseException) -> None: ...
        def _count(self, hop: int, started: float) -> None: ...
        def _silent(self, address: str) -> None: ...
        def _round(self, s: RouteSession, frame: Callable[[int, Any, int], pb.ShardRequestFrame],
                   check: Callable[[HopStream, pb.ShardStepResult, Any], Any], done: Callable[[], None] = ...,
                   count: bool = True) -> Awaitable[Any]: ...

    _batches: list[BatchStream]

    def _open_batches(self) -> None:
        """A Batch stream per worker, opened on first use (after `connect` learnt the route)."""
        self._close_batches()
        self._batches = [BatchStream(stub, address, c, self.step_timeout_s, self._silent)
                         for stub, address, c in zip(self._stubs, self.addresses, self._caps)]

    def _close_batches(self) -> None:
        for b in self._batches:
            b.close()
        self._batches = []

    async def forward(self, session_id: str, tokens: Sequence[int], *, all_logits: bool = True) -> np.ndarray:
        """Compute `tokens` at the session's next positions through every worker.

        Args:
            tokens: the block (1..65536 ids, each below vocab_size). One token travels as
                a compact DecodeStep, more as an ActivationChunk.
            all_logits: logits for every row (verification), else for the last row only.
        Returns:
            (len(tokens), vocab) float32 logits, or (1, vocab); row i predicts the token after tokens[i].
        Raises:
            InvalidRequest: bad tokens (nothing is sent).
            InvariantViolation: the session failed earlier and must be reopened.
            MalformedShardOutput: a worker answered OK with wrong output (the session fails).
            any shard error a worker answered with (the session fails).
        """
        s = self._session(session_id)
        block = self._block(tokens)

        def frame(i: int, data: np.ndarray | None, deadline: int) -> pb.ShardRequestFrame:
            return work_frame(session_id, s.epoch, s.step, s.position, block if i == 0 else None, data, all_logits,
                              deadline)

        def advance() -> None:
            s.position += len(block)

        return await self._round(s, frame, lambda hop, result, _: checked_output(hop, result, s.position, len(block),
                                                                                   all_logits), advance)

    async def forward_many(self, requests: Sequence[Request]) -> list[np.ndarray | BaseException]:
        """`forward` of several sessions at once (one message per hop for all of them).

        Returns:
            Per request, in order: its logits as `forward` returns them, or the exception `forward`
            would have raised (InvalidRequest and SessionNotFound leave the session as it was; any
            other fails it).
        """
        out: list[np.ndarray | BaseException | None] = [None] * len(requests)
        live: dict[int, tuple[RouteSession, list[int], bool]] = {}
        for i, (session_id, tokens, all_logits) in enumerate(requests):
            try:
                live[i] = (self._session(session_id), self._block(tokens), all_logits)
            except RuntimeServiceError as exc:
                out[i] = exc
        if len({id(s) for s, _, _ in live.values()}) != len(live):
            raise InvalidRequest("forward_many takes each session at most once")
        async with contextlib.AsyncExitStack() as locks:
            for i in sorted(live, key=lambda i: live[i][0].session_id):  # one order: no deadlock
                await locks.enter_async_context(live[i][0].lock)
            for i, (s, _, _) in list(live.items()):
                try:
                    self._check_usable(s)
                except RuntimeServiceError as exc:
                    del live[i]
                    out[i] = exc
                    continue
                s.step += 1
            deadline = time.time_ns() + int(self.step_timeout_s * 1e9)
            data: dict[int, np.ndarray | None] = dict.fromkeys(live)
            try:
                for hop in range(len(self._batches)):
                    if live:
                        await self._hop(hop, live, data, out, deadline)
            except BaseException as exc:  # cancelled midway: where each session stands is unknown
                for i in list(live):
                    self._break(live.pop(i)[0], exc)
                raise
            for i, (s, block, _) in live.items():
                s.position += len(block)
                out[i] = data[i]
        return out  # type: ignore[return-value] - every entry is set

    async def _hop(self, hop: int, live: dict[int, tuple[RouteSession, list[int], bool]],
                   data: dict[int, np.ndarray | None], out: list, deadline: int) -> None:
        """Every live session's frame to worker `hop` in one Batch request; their checked outputs into
        `data`; a session whose entry failed leaves `live` (failed, its exception in `out`)."""
        started = time.perf_counter()
        frames = {i: work_frame(s.session_id, s.epoch, s.step, s.position, block if hop == 0 else None, data[i],
                                all_logits, deadline) for i, (s, block, all_logits) in live.items()}
        try:
            answers = await self._batches[hop].request(
                [pb.ShardBatchEntry(route_session_id=live[i][0].session_id, frame=frames[i]) for i in live])
        except RuntimeServiceError as exc:
            for i in list(live):
                self._fail(live.pop(i)[0], exc, out, i)
            return
        for i, answer in zip(list(live), answers):
            s, block, all_logits = live[i]
            try:
                result = await self._result(s.hops[hop], answer, frames[i], s.step)
                data[i] = checked_output(s.hops[hop], result, s.position, len(block), all_logits)
            except Exception as exc:  # noqa: BLE001 - this session's failure, not the batch's
                self._fail(live.pop(i)[0], exc, out, i)
        self._count(hop, started)

    def _block(self, tokens: Sequence[int]) -> list[int]:
        """`forward`'s checks of one request's tokens (raises InvalidRequest; nothing is sent)."""
        block = [int(t) for t in tokens]
        if not 1 <= len(block) <= MAX_ROWS:
            raise InvalidRequest(f"forward takes 1..{MAX_ROWS} tokens, got {len(block)}")
        bad = [t for t in block if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is out of range; allowed 0..{self.vocab_size - 1}")
        return block

    def _fail(self, s: RouteSession, exc: BaseException, out: list, i: int) -> None:
        self._break(s, exc)
        out[i] = exc

    @staticmethod
    async def _result(hop: HopStream, answer: pb.ShardResponseFrame, frame: pb.ShardRequestFrame,
                      step: int) -> pb.ShardStepResult:
        """The entry's result, as `HopStream.request` would have returned it (a refusal for lack of
        credit is sent again on the session's own stream)."""
        hop.credits -= 1
        got = hop.answer_of(answer, step)
        if got is REFUSED:
            hop.credits += 1  # the refused frame took no credit
            return await hop.request(frame, step)
        if got is UNRELATED:
            raise MalformedShardOutput(f"{hop.where} answered a Batch entry with {answer.WhichOneof('frame') or 'nothing'}")
        return got  # type: ignore[return-value]
