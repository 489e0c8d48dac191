"""TLS, bearer tokens, mTLS and session ownership, checked from the outside.

Against a server with TLS and two bearer tokens: plaintext and a wrong CA fail the
handshake (UNAVAILABLE), a missing or unknown token is UNAUTHENTICATED (typed), health
answers without a token, and a session of token A does not exist for token B: every
session call answers NOT_FOUND with exactly the message of a forged id, and A's session
is untouched. Against an mTLS server: no client certificate fails the handshake, and
certificate B cannot see certificate A's session.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from reliabilitykit.outcomes import Outcome, call_outcome, typing_problem
from reliabilitykit.report import SectionReport
from reliabilitykit.sessions import RPC_TIMEOUT_S, close_quietly, open_session, state_of
from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)
HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class SecuredTargets:
    """Servers with security on, and the credentials they accept."""

    tls_tokens: str  # HOST:PORT of a server with TLS and bearer tokens (`token_a`, `token_b`)
    mtls: str  # HOST:PORT of a server requiring client certificates signed by `ca`
    ca: Path  # the CA that signed the servers' and the clients' certificates
    other_ca: Path  # a CA that signed nothing here
    token_a: str
    token_b: str
    client_a: tuple[Path, Path]  # certificate and key of identity A
    client_b: tuple[Path, Path]  # certificate and key of identity B


class _Checker:
    def __init__(self, report: SectionReport):
        self.report = report
        self.channels: list[grpc.aio.Channel] = []

    def channel(self, target: str, security: ClientSecurity) -> grpc.aio.Channel:
        self.channels.append(open_channel(target, security))
        return self.channels[-1]

    def stub(self, target: str, security: ClientSecurity) -> pb_grpc.RuntimeServiceStub:
        return pb_grpc.RuntimeServiceStub(self.channel(target, security))

    async def expect(self, what: str, call: object, code: str) -> Outcome:
        got = (await call_outcome(call))[0]
        self.report.check(got.code == code, f"{what}: {code}", str(got))
        self.report.check(not typing_problem(got), f"{what}: typed", typing_problem(got))
        return got

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()


def _session_calls(stub: pb_grpc.RuntimeServiceStub, sid: str) -> dict[str, object]:
    return {
        "AppendTokens": lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1]), timeout=RPC_TIMEOUT_S),
        "Generate": lambda: stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=2), timeout=RPC_TIMEOUT_S).read(),
        "GetSessionInfo": lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid), timeout=RPC_TIMEOUT_S),
        "CloseSession": lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=RPC_TIMEOUT_S),
    }


async def _ownership(c: _Checker, owner: pb_grpc.RuntimeServiceStub, other: pb_grpc.RuntimeServiceStub, who: str) -> None:
    """`other` must not see `owner`'s session: NOT_FOUND, the same message as a forged id, nothing changed."""
    sid = await open_session(owner, PROMPT, len(PROMPT))
    try:
        before = await state_of(owner, sid)
        forged = sid[:-4] + ("AAAA" if not sid.endswith("AAAA") else "BBBB")
        for method, call in _session_calls(other, sid).items():
            stolen = await c.expect(f"{who}: {method} on another identity's session", call(), "NOT_FOUND")
            missing = (await call_outcome(_session_calls(owner, forged)[method]()))[0]
            c.report.check(stolen.message.replace(sid, "ID") == missing.message.replace(forged, "ID"),
                           f"{who}: {method} says exactly what it says of a session that does not exist",
                           f"{stolen.message!r} vs {missing.message!r}")
        c.report.check(await state_of(owner, sid) == before, f"{who}: the owner's session is untouched")
        tokens = [t async for m in owner.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=2, ignore_eos=True))
                  for t in m.tokens]
        c.report.check(len(tokens) == 2, f"{who}: the owner still generates")
    finally:
        await close_quietly(owner, sid)


async def run_security(t: SecuredTargets) -> SectionReport:
    """Every check above against the two servers of `t`."""
    report = SectionReport("security")
    c = _Checker(report)
    create = pb.CreateSessionRequest()
    try:
        await c.expect("plaintext to a TLS port", c.stub(t.tls_tokens, ClientSecurity()).CreateSession(
            create, timeout=HANDSHAKE_TIMEOUT_S), "UNAVAILABLE")
        await c.expect("TLS trusting another CA", c.stub(t.tls_tokens, ClientSecurity(ca_file=t.other_ca)).CreateSession(
            create, timeout=HANDSHAKE_TIMEOUT_S), "UNAVAILABLE")
        for what, token in (("no token", ""), ("an unknown token", "unknown-token-0123456789abcdef")):
            stub = c.stub(t.tls_tokens, ClientSecurity(ca_file=t.ca, token=token))
            got = await c.expect(f"TLS with {what}", stub.CreateSession(create, timeout=RPC_TIMEOUT_S), "UNAUTHENTICATED")
            report.check("authorization: Bearer" in got.message, f"TLS with {what}: the message says what to send")
            await c.expect(f"TLS with {what}: Generate", stub.Generate(pb.GenerateRequest(session_id="x")).read(),
                           "UNAUTHENTICATED")
        probe = health_pb2_grpc.HealthStub(c.channel(t.tls_tokens, ClientSecurity(ca_file=t.ca)))
        reply = await probe.Check(health_pb2.HealthCheckRequest(service=""), timeout=RPC_TIMEOUT_S)
        report.check(reply.status == health_pb2.HealthCheckResponse.SERVING, "health answers without a token")
        a = c.stub(t.tls_tokens, ClientSecurity(ca_file=t.ca, token=t.token_a))
        b = c.stub(t.tls_tokens, ClientSecurity(ca_file=t.ca, token=t.token_b))
        await _ownership(c, a, b, "tokens")
        await c.expect("mTLS without a client certificate", c.stub(t.mtls, ClientSecurity(ca_file=t.ca)).CreateSession(
            create, timeout=HANDSHAKE_TIMEOUT_S), "UNAVAILABLE")
        cert_a = c.stub(t.mtls, ClientSecurity(ca_file=t.ca, cert_file=t.client_a[0], key_file=t.client_a[1]))
        cert_b = c.stub(t.mtls, ClientSecurity(ca_file=t.ca, cert_file=t.client_b[0], key_file=t.client_b[1]))
        await _ownership(c, cert_a, cert_b, "mTLS")
    finally:
        await c.close()
    return report.finish()
