"""A session belongs to the identity that created it; to anyone else it does not exist."""

import grpc

from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.ops_helpers import PROMPT, generate, rpc_error, serving


def _calls(stub, sid):
    return {
        "AppendTokens": lambda: stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1])),
        "Generate": lambda: generate(stub, sid, 2),
        "GetSessionInfo": lambda: stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)),
        "CloseSession": lambda: stub.CloseSession(pb.CloseSessionRequest(session_id=sid)),
    }


async def _not_found_details(stub, sid):
    out = {}
    for name, call in _calls(stub, sid).items():
        err = await rpc_error(call())
        assert err.code() == grpc.StatusCode.NOT_FOUND, name
        out[name] = err.details()
    return out


async def test_other_token_identity_sees_not_found(tiny_engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(tiny_engine, security) as served:
        a, b = served.stub(ClientSecurity(token=TOKEN_A)), served.stub(ClientSecurity(token=TOKEN_B))
        sid = (await a.CreateSession(pb.CreateSessionRequest())).session_id
        await a.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        before = await a.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        stolen = await _not_found_details(b, sid)
        # A forged id of the same shape gives exactly the same answers.
        missing_sid = sid[:-4] + ("AAAA" if not sid.endswith("AAAA") else "BBBB")
        missing = await _not_found_details(a, missing_sid)
        assert {k: v.replace(sid, "ID") for k, v in stolen.items()} == {
            k: v.replace(missing_sid, "ID") for k, v in missing.items()}
        # The owner's session is untouched by the other identity's attempts.
        after = await a.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert after.state_digest == before.state_digest and after.history_length == len(PROMPT)
        assert len(await generate(a, sid, 3)) == 3
        await a.CloseSession(pb.CloseSessionRequest(session_id=sid))


async def test_other_certificate_sees_not_found(tiny_engine, pki):
    security = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca)
    async with serving(tiny_engine, security) as served:
        a = served.stub(ClientSecurity(ca_file=pki.ca, cert_file=pki.client_a.cert, key_file=pki.client_a.key))
        b = served.stub(ClientSecurity(ca_file=pki.ca, cert_file=pki.client_b.cert, key_file=pki.client_b.key))
        sid = (await a.CreateSession(pb.CreateSessionRequest())).session_id
        await _not_found_details(b, sid)
        info = await a.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.session_id == sid


async def test_anonymous_identity_when_auth_is_off(tiny_engine):
    async with serving(tiny_engine) as served:
        a, b = served.stub(), served.stub()
        sid = (await a.CreateSession(pb.CreateSessionRequest())).session_id
        assert (await b.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).session_id == sid
        assert served.runtime.store.get(sid).owner == "anonymous"
