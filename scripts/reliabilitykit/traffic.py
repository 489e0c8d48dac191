"""Mixed traffic: N clients x rounds of every kind of call, then the server's memory between rounds.

Each client, each round, opens a session and makes a random mix of calls: appends (tokens,
text, chat messages), Generate in every mode with sampling, stop strings and logprobs
(some cancelled, some under a short deadline), describes, model info, Tokenize/Detokenize,
a malformed request, a call overlapping its own running stream, then closes the session
and calls it once more. Every outcome must be the one that call should get and typed;
UNKNOWN and INTERNAL never. After each round (all its sessions closed) the server's RSS is
read; the rounds must stay within `rss_tolerance` of each other.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable, Collection

import grpc

from reliabilitykit.outcomes import (
    BUSY_PATIENCE_S,
    BUSY_RETRY_S,
    CANCELLED_BY_CLIENT,
    OK,
    Outcome,
    call_outcome,
    outcome_of,
    patient_outcome,
    typing_problem,
)
from reliabilitykit.report import SectionReport
from reliabilitykit.sessions import RPC_TIMEOUT_S, Limits, close_quietly, limits_of
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

Rss = Callable[[], int]  # the server's resident set size in bytes
WORDS = ("the", "sea", "Paris", "🙂", "naïve", "数据", "\u202eRTL", "tab\there", "x" * 40, "\u0301", "end.")
STOPS = (".", "the", "\n", "🙂")


@dataclass(frozen=True)
class TrafficPlan:
    """The size of the traffic."""

    clients: int = 8  # concurrent clients
    rounds: int = 3
    calls: int = 12  # calls per client per round, besides create and close
    new_tokens: int = 16  # most tokens of one Generate
    rss_tolerance: float = 0.05  # most relative RSS change between consecutive rounds
    settle_s: float = 1.0  # pause before each RSS reading (freed buffers return)
    seed: int = 0


class _Client:
    """One client's round: a session and a random mix of calls, every outcome recorded."""

    def __init__(self, stub: pb_grpc.RuntimeServiceStub, lim: Limits, plan: TrafficPlan, rng: random.Random,
                 report: SectionReport, codes: Counter):
        self.stub, self.lim, self.plan, self.rng, self.report, self.codes = stub, lim, plan, rng, report, codes
        self.sid = ""

    def record(self, method: str, got: Outcome, allowed: Collection[str]) -> None:
        self.codes[f"{method} {got.code}"] += 1
        self.report.check(not typing_problem(got), f"{method}: typed", typing_problem(got))
        self.report.check(got.code in allowed, f"{method}: one of {sorted(allowed)}", str(got))

    async def unary(self, method: str, request: object, allowed: Collection[str] = ("OK",),
                    timeout: float = RPC_TIMEOUT_S) -> object:
        """One call; ABORTED (the session still ending a call this client interrupted) is retried unless expected."""
        def make() -> object:
            return getattr(self.stub, method)(request, timeout=timeout)

        if "ABORTED" in allowed:
            got, reply = await call_outcome(make())
        else:
            got, reply, retried = await patient_outcome(make)
            self.codes["ABORTED retried (the session was still ending an interrupted call)"] += retried
        self.record(method, got, allowed)
        return reply

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.lim.vocab_size) for _ in range(n)]

    def text(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(1, 12)))

    async def append(self) -> None:
        kinds = ["tokens"] + ["text"] * self.lim.has_tokenizer + ["messages"] * self.lim.has_chat_template
        kind = self.rng.choice(kinds)
        if kind == "tokens":
            req = pb.AppendTokensRequest(session_id=self.sid, tokens=self.tokens(self.rng.randint(1, 48)))
        elif kind == "text":
            req = pb.AppendTokensRequest(session_id=self.sid, text=self.text())
        else:
            req = pb.AppendTokensRequest(session_id=self.sid, add_generation_prompt=True,
                                         messages=[pb.ChatMessage(role="user", content=self.text())])
        await self.unary("AppendTokens", req)

    def generate_request(self) -> pb.GenerateRequest:
        r = self.rng
        req = pb.GenerateRequest(session_id=self.sid, max_new_tokens=r.randint(1, self.plan.new_tokens),
                                 ignore_eos=r.random() < 0.5)
        modes = [pb.DECODE_MODE_GREEDY, pb.DECODE_MODE_SPECULATIVE_LOOKUP] + \
            [pb.DECODE_MODE_SPECULATIVE_DRAFT] * self.lim.has_draft_model
        req.mode = r.choice(modes)
        if req.mode:
            req.num_draft_tokens = r.randint(0, self.lim.max_draft_tokens)
        if r.random() < 0.5:
            req.temperature, req.top_k, req.top_p, req.min_p = r.uniform(0.1, 1.5), r.choice([0, 40]), 0.9, 0.01
            req.repetition_penalty = r.choice([0.0, 1.1])
            req.seed = r.getrandbits(64)
        if r.random() < 0.3:
            req.logprobs, req.top_logprobs = True, r.randint(0, self.lim.max_top_logprobs)
        if self.lim.has_tokenizer and r.random() < 0.3:
            req.stop.extend(r.sample(STOPS, 2))
        return req

    async def generate(self) -> None:
        how = self.rng.choice(("whole", "whole", "cancel", "deadline"))
        request = self.generate_request()
        allowed = {"OK"} | ({CANCELLED_BY_CLIENT} if how == "cancel" else set()) | \
            ({"DEADLINE_EXCEEDED"} if how == "deadline" else set())
        give_up = time.monotonic() + BUSY_PATIENCE_S
        while True:
            got, last = await self._stream(request, how)
            if got.code != "ABORTED" or last is not None or time.monotonic() > give_up:
                break
            self.codes["ABORTED retried (the session was still ending an interrupted call)"] += 1
            await asyncio.sleep(BUSY_RETRY_S)
        self.record("Generate", got, allowed)
        if got.is_ok and last is not None:
            self.report.check(last.stop_reason != pb.STOP_REASON_UNSPECIFIED, "Generate: the last message has a stop reason")

    async def _stream(self, request: pb.GenerateRequest, how: str) -> tuple[Outcome, pb.GenerateResponse | None]:
        call = self.stub.Generate(request, timeout=0.05 if how == "deadline" else RPC_TIMEOUT_S)
        got, last = OK, None
        try:
            async for msg in call:
                last = msg
                if how == "cancel":
                    call.cancel()
        except (grpc.RpcError, asyncio.CancelledError) as err:
            if isinstance(err, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise
            got = outcome_of(err)
        return got, last

    async def overlapping(self) -> None:
        """A call on the session while its own Generate runs: ABORTED, and the stream goes on."""
        stream = self.stub.Generate(pb.GenerateRequest(session_id=self.sid, max_new_tokens=self.plan.new_tokens,
                                                       ignore_eos=True))
        try:
            first = (await call_outcome(stream.read()))[1]
            if first is None or first is grpc.aio.EOF or first.stop_reason:  # busy still, or over before the overlap
                return
            await self.unary("AppendTokens", pb.AppendTokensRequest(session_id=self.sid, tokens=[3]), {"ABORTED"})
        finally:
            stream.cancel()

    async def malformed(self) -> None:
        req = self.rng.choice([
            pb.AppendTokensRequest(session_id=self.sid, tokens=[self.lim.vocab_size]),
            pb.AppendTokensRequest(session_id=self.sid),
            pb.GenerateRequest(session_id=self.sid, temperature=-1.0),
            pb.GenerateRequest(session_id=self.sid, top_logprobs=1),
            pb.CreateSessionRequest(window_tokens=self.lim.max_window + 1),
        ])
        method = {pb.AppendTokensRequest: "AppendTokens", pb.GenerateRequest: "Generate"}.get(type(req), "CreateSession")
        if method == "Generate":
            got = (await call_outcome(self.stub.Generate(req).read()))[0]
            self.record(method, got, {"INVALID_ARGUMENT"})
        else:
            await self.unary(method, req, {"INVALID_ARGUMENT"})

    async def tokenize(self) -> None:
        reply = await self.unary("Tokenize", pb.TokenizeRequest(text=self.text()))
        if reply is not None:
            await self.unary("Detokenize", pb.DetokenizeRequest(tokens=list(reply.tokens)[:64]))

    async def run(self) -> None:
        sink, window = self.rng.choice([0, 2, 4]), self.rng.choice([0, 16, 64])
        created = await self.unary("CreateSession", pb.CreateSessionRequest(sink_tokens=sink, window_tokens=window,
                                                                           client_label=self.text()[:200]))
        if created is None:
            return
        self.sid = created.session_id
        ops: list[Callable[[], Awaitable[None]]] = [self.append, self.generate, self.generate, self.malformed,
                                                    self.overlapping, self.info, self.model_info]
        if self.lim.has_tokenizer:
            ops.append(self.tokenize)
        await self.append()
        for _ in range(self.plan.calls):
            await self.rng.choice(ops)()
        await self.unary("CloseSession", pb.CloseSessionRequest(session_id=self.sid))
        await self.unary("GetSessionInfo", pb.GetSessionInfoRequest(session_id=self.sid), {"NOT_FOUND"})

    async def info(self) -> None:
        await self.unary("GetSessionInfo", pb.GetSessionInfoRequest(session_id=self.sid))

    async def model_info(self) -> None:
        await self.unary("GetModelInfo", pb.GetModelInfoRequest())


async def run_traffic(channel: grpc.aio.Channel, rss: Rss | None = None, plan: TrafficPlan = TrafficPlan()
                      ) -> SectionReport:
    """`plan.rounds` rounds of `plan.clients` concurrent clients; RSS read (when `rss` is given) after each."""
    report = SectionReport("traffic")
    stub = pb_grpc.RuntimeServiceStub(channel)
    lim = await limits_of(stub)
    rng = random.Random(plan.seed)
    codes: Counter = Counter()
    readings: list[int] = []
    if rss is not None:
        readings.append(rss())
    for r in range(plan.rounds):
        clients = [_Client(stub, lim, plan, random.Random(rng.getrandbits(64)), report, codes) for _ in range(plan.clients)]
        results = await asyncio.gather(*(c.run() for c in clients), return_exceptions=True)
        for c, result in zip(clients, results):
            if isinstance(result, BaseException):
                report.check(False, f"round {r + 1}: a client ran to its end", repr(result))
                await close_quietly(stub, c.sid)
        if rss is not None:
            await asyncio.sleep(plan.settle_s)
            readings.append(rss())
    report.numbers["codes"] = dict(sorted(codes.items()))
    report.numbers["calls"] = sum(codes.values())
    never = {k: n for k, n in codes.items() if k.endswith((" UNKNOWN", " INTERNAL"))}
    report.check(not never, "no UNKNOWN or INTERNAL", str(never))
    if rss is not None:
        mib = [round(b / (1 << 20), 1) for b in readings]
        report.numbers["rss_mib"] = {"before": mib[0], "after_rounds": mib[1:]}
        changes = [(b - a) / a for a, b in zip(readings[1:], readings[2:])]
        report.numbers["rss_change_between_rounds"] = [round(x, 4) for x in changes]
        for i, change in enumerate(changes):
            report.check(abs(change) <= plan.rss_tolerance,
                         f"RSS after round {i + 2} within {plan.rss_tolerance:.0%} of round {i + 1}",
                         f"{mib[i + 1]} -> {mib[i + 2]} MiB ({change:+.1%})")
    return report.finish()
