"""Random client cancels and deadlines on appends and generates, reconciled with a replay.

Each client drives its own session (small window, so it wraps) and a mirror session that
gets only what the client saw: every call it interrupts is a random cancel or deadline,
timed against a measured uninterrupted call so some land before, during and after the work.
The server's contract, checked after every call:
- an interrupted AppendTokens either completed (the client saw OK) or left the history as
  before; if the reply was lost in flight the append is whole, and a retry with
  `expected_history_length` fails FAILED_PRECONDITION instead of appending twice;
- an interrupted Generate left the tokens the client read plus the ones the server wrote
  that the client did not read (at most one message when the client reads promptly); with
  greedy decoding or a fixed seed they are the mirror's own continuation;
- GetSessionInfo says so at once and never changes afterwards;
so history length and digest equal the mirror's after every call, and at the end equal a
fresh session fed the client's whole view in one append.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc

from reliabilitykit.outcomes import (
    BUSY_PATIENCE_S,
    BUSY_RETRY_S,
    CANCELLED,
    CANCELLED_BY_CLIENT,
    OK,
    Outcome,
    call_outcome,
    outcome_of,
    patient_outcome,
    typing_problem,
)
from reliabilitykit.report import SectionReport
from reliabilitykit.sessions import (
    RPC_TIMEOUT_S,
    Limits,
    close_quietly,
    limits_of,
    open_session,
    replay_state,
    state_of,
)
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

INTERRUPTED = {CANCELLED_BY_CLIENT, "DEADLINE_EXCEEDED"}


@dataclass(frozen=True)
class CancelPlan:
    """How many calls to interrupt, and how big they are."""

    trials: int = 100  # interrupted calls in all (appends and generates)
    clients: int = 4  # concurrent clients, each with its own session
    sink: int = 4  # session geometry: small, so the window wraps during the run
    window: int = 32
    append_tokens: int = 96  # most tokens of an interrupted append
    new_tokens: int = 24  # max_new_tokens of an interrupted Generate
    seed: int = 0  # of the random choices (kinds, delays, tokens)


@dataclass
class _Client:
    """One client's session, its mirror and its view of the history."""

    stub: pb_grpc.RuntimeServiceStub
    lim: Limits
    plan: CancelPlan
    rng: random.Random
    report: SectionReport
    sid: str = ""
    mirror: str = ""
    seen: list[int] | None = None  # the history as this client knows it


def _variants(lim: Limits) -> list[tuple[str, dict, int]]:
    """Generate settings with deterministic tokens: (name, request fields, most tokens in one message)."""
    out = [("greedy", {}, 1), ("seeded", {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "seed": 7}, 1),
           ("lookup K=3", {"mode": pb.DECODE_MODE_SPECULATIVE_LOOKUP, "num_draft_tokens": 3}, 4)]
    if lim.has_draft_model:
        out.append(("draft K=2", {"mode": pb.DECODE_MODE_SPECULATIVE_DRAFT, "num_draft_tokens": 2}, 3))
    return out


async def _timed(coro: object) -> float:
    started = time.monotonic()
    await coro  # type: ignore[misc]
    return time.monotonic() - started


async def _interrupt(call: object, how: str, delay: float) -> Outcome:
    """Await a unary call, cancelling it after `delay` when `how` is "cancel" (a deadline was set at the call)."""
    if how == "cancel":
        await asyncio.sleep(delay)
        call.cancel()  # type: ignore[attr-defined]
    return (await call_outcome(call))[0]


async def _append_trial(c: _Client, how: str, delay: float) -> None:
    stub, report = c.stub, c.report
    before = await state_of(stub, c.sid)
    tokens = [c.rng.randrange(3, c.lim.vocab_size) for _ in range(c.rng.randint(1, c.plan.append_tokens))]
    req = pb.AppendTokensRequest(session_id=c.sid, tokens=tokens)
    give_up = time.monotonic() + BUSY_PATIENCE_S
    while True:
        got = await _interrupt(stub.AppendTokens(req, timeout=delay if how == "deadline" else RPC_TIMEOUT_S), how, delay)
        if got.code != "ABORTED" or time.monotonic() > give_up:
            break
        report.count("ABORTED retried (the session was still ending an interrupted call)")
        await asyncio.sleep(BUSY_RETRY_S)
    after = await state_of(stub, c.sid)
    what = f"append of {len(tokens)} ({how} at {delay * 1e3:.0f} ms)"
    report.check(not typing_problem(got), f"{what}: typed", typing_problem(got))
    landed = after.history_length == before.history_length + len(tokens)
    if got.is_ok:
        report.count("append completed")
        report.check(landed, f"{what}: OK appended the tokens", f"{before} -> {after}")
    elif got.code in INTERRUPTED:
        if after == before:
            report.count("append interrupted, nothing appended")
            if c.rng.random() < 0.5:  # the documented safe retry
                again = (await _safe_retry(c, tokens))[0]
                report.check(again.is_ok, f"{what}: the retry with expected_history_length appends", str(again))
                landed = again.is_ok
        else:
            report.count("append interrupted after it completed (reply lost)")
            report.check(landed, f"{what}: an interrupted append is whole or absent", f"{before} -> {after}")
            again = (await _safe_retry(c, tokens))[0]
            report.check(again.code == "FAILED_PRECONDITION", f"{what}: a retry with expected_history_length "
                         "cannot append twice", str(again))
    else:
        report.check(False, f"{what}: OK, CANCELLED or DEADLINE_EXCEEDED", str(got))
    if landed:
        c.seen += tokens
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=c.mirror, tokens=tokens), timeout=RPC_TIMEOUT_S)
    await _compare(c, what)


async def _safe_retry(c: _Client, tokens: list[int]) -> tuple[Outcome, object, int]:
    """Append `tokens` again, only if the history still holds exactly what the client saw."""
    req = pb.AppendTokensRequest(session_id=c.sid, tokens=tokens, expected_history_length=len(c.seen))
    return await patient_outcome(lambda: c.stub.AppendTokens(req, timeout=RPC_TIMEOUT_S))


async def _read_stream(call: object, how: str, k: int, read: list[int]) -> tuple[Outcome, pb.GenerateResponse | None]:
    """Read a Generate stream into `read` until it ends, fails, or (`read-k`) k messages were read."""
    messages = 0
    try:
        async for msg in call:  # type: ignore[attr-defined]
            read += msg.tokens
            if msg.stop_reason:
                return OK, msg
            messages += 1
            if how == "read-k" and messages >= k:
                call.cancel()  # type: ignore[attr-defined]
                return CANCELLED, None
        return OK, None
    except (grpc.RpcError, asyncio.CancelledError) as err:
        if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
            raise
        return outcome_of(err), None


async def _generate_trial(c: _Client, how: str, delay: float) -> None:
    stub, report = c.stub, c.report
    name, fields, per_message = c.rng.choice(_variants(c.lim))
    before = await state_of(stub, c.sid)
    req = pb.GenerateRequest(session_id=c.sid, max_new_tokens=c.plan.new_tokens, ignore_eos=True, **fields)
    k = c.rng.randint(1, 4)
    give_up = time.monotonic() + BUSY_PATIENCE_S
    while True:
        call = stub.Generate(req, timeout=delay if how == "deadline" else None)
        read: list[int] = []
        reader = asyncio.ensure_future(_read_stream(call, how, k, read))
        if how == "cancel":
            done, _ = await asyncio.wait([reader], timeout=delay)
            if not done:
                call.cancel()
        got, last = await reader
        if got.code != "ABORTED" or read or time.monotonic() > give_up:
            break
        report.count("ABORTED retried (the session was still ending an interrupted call)")
        await asyncio.sleep(BUSY_RETRY_S)
    after = await state_of(stub, c.sid)
    what = f"Generate {name} ({how}{' ' + str(k) if how == 'read-k' else ''} at {delay * 1e3:.0f} ms)"
    report.check(not typing_problem(got), f"{what}: typed", typing_problem(got))
    report.check(got.is_ok or got.code in INTERRUPTED, f"{what}: OK, CANCELLED or DEADLINE_EXCEEDED", str(got))
    extra = after.history_length - before.history_length - len(read)
    if last is not None:
        report.count("generate completed")
        report.check(extra == 0 and last.history_length == after.history_length,
                     f"{what}: a completed stream's final message counts the history", f"extra {extra}")
    else:
        report.count(f"generate interrupted, unread tokens {extra}")
        report.check(extra >= 0, f"{what}: the history holds every token the client read", f"extra {extra}")
        if extra > per_message:  # written before the server learnt of the cancel; the replay below still holds
            report.count(f"generate {how}: more than one message unread")
    n = len(read) + max(0, extra)
    if n:
        mirrored = [t async for m in stub.Generate(pb.GenerateRequest(
            session_id=c.mirror, max_new_tokens=n, ignore_eos=True, **fields)) for t in m.tokens]
        report.check(mirrored[: len(read)] == read, f"{what}: the tokens read are the deterministic continuation",
                     f"read {read[:8]}..., replay {mirrored[:8]}...")
        c.seen += mirrored
    if c.rng.random() < 0.25:  # GetSessionInfo never changes its mind later
        await asyncio.sleep(0.05)
        later = await state_of(stub, c.sid)
        report.check(later == after, f"{what}: GetSessionInfo is final at once", f"{after} -> {later}")
    await _compare(c, what)


async def _compare(c: _Client, what: str) -> None:
    ours, mirror = await state_of(c.stub, c.sid), await state_of(c.stub, c.mirror)
    c.report.check(ours.history_length == len(c.seen), f"{what}: history length is the client's view",
                   f"{ours.history_length} vs {len(c.seen)}")
    c.report.check(ours == mirror, f"{what}: digest equals the replay of what the client saw", f"{ours} vs {mirror}")


async def _run_client(c: _Client, trials: int, times: dict[str, float]) -> None:
    prompt = [c.rng.randrange(3, c.lim.vocab_size) for _ in range(c.rng.randint(8, 24))]
    chunk = c.lim.max_tokens_per_request
    c.sid = await open_session(c.stub, prompt, chunk, c.plan.sink, c.plan.window)
    c.mirror = await open_session(c.stub, prompt, chunk, c.plan.sink, c.plan.window, label="mirror")
    c.seen = list(prompt)
    try:
        for _ in range(trials):
            kind = c.rng.choice(("append", "generate"))
            how = c.rng.choice(("cancel", "deadline") if kind == "append" else ("cancel", "deadline", "read-k"))
            delay = c.rng.uniform(0.0, 1.3 * times[kind])
            c.report.count(f"{kind} {how}")
            await (_append_trial if kind == "append" else _generate_trial)(c, how, delay)
        final = await replay_state(c.stub, c.seen, chunk, c.plan.sink, c.plan.window)
        c.report.check(final == await state_of(c.stub, c.sid), "the session equals a fresh one fed the client's view",
                       f"{len(c.seen)} tokens")
        closed = await c.stub.CloseSession(pb.CloseSessionRequest(session_id=c.sid), timeout=RPC_TIMEOUT_S)
        c.report.check(closed.history_length == len(c.seen), "CloseSession reports the client's history length")
    except grpc.RpcError as err:  # a call the battery did not interrupt failed: report it, go on with the others
        c.report.check(False, "an uninterrupted call succeeds", str(outcome_of(err)))
    finally:
        await close_quietly(c.stub, c.sid)
        await close_quietly(c.stub, c.mirror)


async def _calibrate(stub: pb_grpc.RuntimeServiceStub, lim: Limits, plan: CancelPlan) -> dict[str, float]:
    """Seconds of one uninterrupted append and Generate of the planned sizes."""
    sid = await open_session(stub, [5, 6, 7, 8], 8, plan.sink, plan.window)
    try:
        tokens = [(7 * i) % (lim.vocab_size - 3) + 3 for i in range(plan.append_tokens)]
        append = await _timed(stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens), timeout=RPC_TIMEOUT_S))

        async def generate() -> None:
            async for _ in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=plan.new_tokens, ignore_eos=True)):
                pass

        return {"append": append, "generate": await _timed(generate())}
    finally:
        await close_quietly(stub, sid)


async def run_cancels(channel: grpc.aio.Channel, plan: CancelPlan = CancelPlan()) -> SectionReport:
    """Interrupt `plan.trials` calls at random over `plan.clients` concurrent sessions and reconcile each."""
    report = SectionReport("cancels")
    stub = pb_grpc.RuntimeServiceStub(channel)
    lim = await limits_of(stub)
    times = await _calibrate(stub, lim, plan)
    report.numbers["uninterrupted_s"] = {k: round(v, 4) for k, v in times.items()}
    rng = random.Random(plan.seed)
    clients = [_Client(stub, lim, plan, random.Random(rng.getrandbits(64)), report) for _ in range(plan.clients)]
    shares = [plan.trials // plan.clients + (i < plan.trials % plan.clients) for i in range(plan.clients)]
    await asyncio.gather(*(_run_client(c, n, times) for c, n in zip(clients, shares)))
    report.numbers["trials"] = plan.trials
    return report.finish()
