"""A maximal Tokenize beside another client's stream (issue 28, defect 3): no client stalls the others.

One text one character over --max-text-chars must be refused (INVALID_ARGUMENT naming the
flag) before it is tokenized. Then a Generate streams alone, and again while another client
(another process: decoding its large answers must not delay this one's reading) sends
Tokenize calls of the largest text allowed, back to back, for the whole stream: the
worst inter-token gap beside them must stay within `max_ratio` x the stream's median gap
alone (the probe saw 1,833 ms against a median of 19-32 ms when the tokenizer held the GIL).
With `rounds` > 1 the two streams alternate that many times, each round's worst gaps and load
average reported: on a loaded machine the stream alone has gaps as long (its own control).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from reliabilitykit.report import SectionReport
from inference_engine.security.credentials import open_channel
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)
CJK = "漢字かな交じり文"  # several tokens per character pair: the probe's costly kind of text


@dataclass(frozen=True)
class StallPlan:
    """The size of the measurement."""

    max_text_chars: int = 65536  # the server's --max-text-chars (its default)
    new_tokens: int = 256  # tokens of each measured stream
    max_ratio: float = 3.0  # worst gap beside the Tokenize calls / median gap alone
    rounds: int = 1  # alternations of the stream alone and beside the calls


async def _gaps(stub: pb_grpc.RuntimeServiceStub, new_tokens: int) -> list[float]:
    """Seconds between consecutive token messages of one greedy stream (its first token excluded)."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
    gaps, last = [], None
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=new_tokens, ignore_eos=True)):
        if msg.tokens:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    return gaps


def largest_text(chars: int) -> str:
    """`chars` characters of CJK text."""
    return (CJK * (chars // len(CJK) + 1))[:chars]


async def _tokenize_until_eof(target: str, chars: int) -> None:
    """The other client: maximal Tokenize calls back to back until stdin closes; prints how many."""
    text, calls = largest_text(chars), 0
    stdin_closed = asyncio.ensure_future(asyncio.to_thread(sys.stdin.read))
    async with open_channel(target) as channel:
        stub = pb_grpc.RuntimeServiceStub(channel)
        while not stdin_closed.done():
            await stub.Tokenize(pb.TokenizeRequest(text=text))
            calls += 1
            if calls == 1:
                print(flush=True)
    print(calls, flush=True)


async def run_text_stall(channel: grpc.aio.Channel, target: str, plan: StallPlan) -> SectionReport:
    """The bound, then the stream's gaps alone and beside maximal Tokenize calls."""
    report = SectionReport("text_stall")
    stub = pb_grpc.RuntimeServiceStub(channel)
    info = await stub.GetModelInfo(pb.GetModelInfoRequest())
    if not report.check(info.has_tokenizer, "the served model has a tokenizer (the section needs one)"):
        return report.finish()
    text = largest_text(plan.max_text_chars)
    try:
        await stub.Tokenize(pb.TokenizeRequest(text=text + "x"))
        code, details = "OK", ""
    except grpc.aio.AioRpcError as err:
        code, details = err.code().name, err.details() or ""
    report.check(code == "INVALID_ARGUMENT" and "--max-text-chars" in details,
                 "a text over --max-text-chars is refused naming the flag", f"{code}: {details}")
    started = time.perf_counter()
    tokens = len((await stub.Tokenize(pb.TokenizeRequest(text=text))).tokens)
    report.numbers["largest_tokenize"] = {"chars": len(text), "tokens": tokens,
                                          "seconds": round(time.perf_counter() - started, 3)}
    alone: list[float] = []
    beside: list[float] = []
    calls = 0
    rounds = []
    for _ in range(plan.rounds):
        alone_gaps = await _gaps(stub, plan.new_tokens)
        beside_gaps, n = await _beside(stub, target, plan)
        alone += alone_gaps
        beside += beside_gaps
        calls += n
        rounds.append({"worst_alone_ms": round(max(alone_gaps) * 1e3, 1),
                       "worst_beside_ms": round(max(beside_gaps) * 1e3, 1), "load_1m": round(os.getloadavg()[0], 2)})
    median = statistics.median(alone)
    worst = max(beside)
    ratio = worst / median
    report.numbers.update(
        gap_ms={"median_alone": round(median * 1e3, 2), "worst_alone": round(max(alone) * 1e3, 2),
                "median_beside": round(statistics.median(beside) * 1e3, 2), "worst_beside": round(worst * 1e3, 2),
                "p99_alone": round(_p99(alone) * 1e3, 2), "p99_beside": round(_p99(beside) * 1e3, 2)},
        worst_beside_vs_median_alone=round(ratio, 2),
        worst_beside_vs_worst_alone=round(worst / max(alone), 2),  # the machine's own noise, for reading the first
        tokenize_calls_beside=calls, rounds=rounds)
    report.check(calls >= 1, "Tokenize calls ran beside the stream", str(calls))
    report.check(ratio <= plan.max_ratio, f"worst gap beside maximal Tokenize calls <= {plan.max_ratio}x the median",
                 f"{worst * 1e3:.1f} ms vs median {median * 1e3:.1f} ms ({ratio:.1f}x)")
    return report.finish()


async def _beside(stub: pb_grpc.RuntimeServiceStub, target: str, plan: StallPlan) -> tuple[list[float], int]:
    """The stream's gaps while another process sends maximal Tokenize calls; and how many it sent."""
    kit = Path(__file__).resolve().parents[1]  # scripts/, which holds this package, and the checkout above it
    path = os.pathsep.join(p for p in (str(kit), str(kit.parent), os.environ.get("PYTHONPATH", "")) if p)
    other = await asyncio.create_subprocess_exec(
        sys.executable, "-m", __name__, target, str(plan.max_text_chars), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": path})
    try:
        assert other.stdout is not None and other.stdin is not None
        await other.stdout.readline()  # its first Tokenize is answered: it is running
        gaps = await _gaps(stub, plan.new_tokens)
    finally:
        if other.stdin is not None:
            other.stdin.close()
        out, _ = await other.communicate()
    return gaps, int(out.split()[-1]) if out.split() else 0


def _p99(gaps: list[float]) -> float:
    ordered = sorted(gaps)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


if __name__ == "__main__":  # the other client's process
    asyncio.run(_tokenize_until_eof(sys.argv[1], int(sys.argv[2])))
