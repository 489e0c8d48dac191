"""SIGTERM mid-stream: health NOT_SERVING, new calls UNAVAILABLE, every stream ends with its final message, exit 0.

Two streams run when the signal arrives: a short one, which `--grace` lets finish
(MAX_TOKENS, every token), and one longer than the grace, which ends with stop reason
CANCELLED. Each final message counts exactly the tokens its client received.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reliabilitykit.outcomes import call_outcome, typing_problem
from reliabilitykit.report import SectionReport
from reliabilitykit.server_process import ServerProcess
from reliabilitykit.sessions import RPC_TIMEOUT_S, limits_of, open_session
from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)
SHORT_TOKENS = 8  # the stream that finishes within the grace


async def _drain(stream: object, received: list[int]) -> pb.GenerateResponse | None:
    """Read a stream to its end; its last message (None if it was cut without one)."""
    last = None
    try:
        while (msg := await stream.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
            received += msg.tokens
            last = msg
    except grpc.RpcError:
        return None
    return last if last is not None and last.stop_reason else None


async def run_shutdown(server: ServerProcess, security: ClientSecurity | None = None, exit_timeout_s: float = 120.0
                       ) -> SectionReport:
    """Send SIGTERM to `server` while two streams run; check the drain and the exit status."""
    report = SectionReport("shutdown")
    channel = open_channel(server.target, security)
    try:
        stub = pb_grpc.RuntimeServiceStub(channel)
        lim = await limits_of(stub)
        short_sid, long_sid = [await open_session(stub, PROMPT, len(PROMPT)) for _ in range(2)]
        streams = {
            "short": stub.Generate(pb.GenerateRequest(session_id=short_sid, max_new_tokens=SHORT_TOKENS, ignore_eos=True)),
            "long": stub.Generate(pb.GenerateRequest(session_id=long_sid, max_new_tokens=lim.max_new_tokens, ignore_eos=True)),
        }
        received: dict[str, list[int]] = {name: [] for name in streams}
        firsts = {name: await s.read() for name, s in streams.items()}  # both are streaming
        for name, first in firsts.items():
            received[name] += first.tokens
        readers = {name: asyncio.ensure_future(_drain(s, received[name])) for name, s in streams.items()}
        server.terminate()
        await asyncio.sleep(0.3)
        health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                 timeout=RPC_TIMEOUT_S)
        report.check(health.status == health_pb2.HealthCheckResponse.NOT_SERVING, "health is NOT_SERVING after SIGTERM",
                     health_pb2.HealthCheckResponse.ServingStatus.Name(health.status))
        got = (await call_outcome(stub.CreateSession(pb.CreateSessionRequest(), timeout=RPC_TIMEOUT_S)))[0]
        report.check(got.code == "UNAVAILABLE" and not typing_problem(got), "a new call is UNAVAILABLE while draining",
                     str(got))
        finals = {name: await reader for name, reader in readers.items()}
        short, long = finals["short"], finals["long"]
        report.check(short is not None and short.stop_reason == pb.STOP_REASON_MAX_TOKENS
                     and len(received["short"]) == SHORT_TOKENS, "a stream shorter than the grace finishes",
                     f"{len(received['short'])} tokens, final {short}")
        report.check(long is not None and long.stop_reason == pb.STOP_REASON_CANCELLED,
                     "a stream longer than the grace ends with its final message, stop reason CANCELLED", f"final {long}")
        for name, final in finals.items():
            if final is not None:
                report.check(final.history_length == len(PROMPT) + len(received[name]),
                             f"the {name} stream's final message counts the tokens it sent",
                             f"{final.history_length} vs {len(PROMPT)} + {len(received[name])}")
        report.numbers["tokens_received"] = {name: len(r) for name, r in received.items()}
    finally:
        await channel.close()
    status = await server.wait(exit_timeout_s)
    report.numbers["exit_status"] = status
    report.check(status == 0, "the server exits 0", f"exit status {status}")
    if status is None:
        await server.stop(1.0)
    return report.finish()
