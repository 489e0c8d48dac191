"""Every mapped error carries a google.rpc.Status: ErrorInfo, BadRequest, RetryInfo (tiny model)."""


import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_engine import errors
from inference_engine.server.error_details import rich_status
from inference_engine.status_codes import ERROR_SPECS, spec_of, status_of
from inference_engine.v1 import runtime_pb2 as pb
from tests.ops_helpers import PROMPT, generate, rpc_error, serving


def _details(err: grpc.aio.AioRpcError) -> dict[str, object]:
    """The Status's details by type name, unpacked (and the Status checked against the call)."""
    status = rpc_status.from_call(err)  # raises if its code or message differ from the call's
    assert status is not None and status.code == err.code().value[0] and status.message == err.details()
    out = {}
    for packed in status.details:
        for cls in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
            msg = cls()
            if packed.Unpack(msg):
                out[cls.__name__] = msg
    assert out["ErrorInfo"].domain == "inference_engine"
    return out


@pytest.mark.parametrize("call,field,fragment", [
    (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 256])), "tokens[1]", "vocab size 256"),
    (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[])), "tokens,text,messages",
     "exactly one of tokens, text, messages"),
    (lambda s, sid: s.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1] * 8193)), "tokens", "allowed 1..8192"),
    (lambda s, sid: generate(s, sid, 5000), "max_new_tokens", "max_new_tokens = 5000"),
    (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(sink_tokens=65)), "sink_tokens", "sink_tokens = 65"),
    (lambda s, sid: s.CreateSession(pb.CreateSessionRequest(client_label="x" * 257)), "client_label", "client_label"),
    (lambda s, sid: s.GetSessionInfo(pb.GetSessionInfoRequest(session_id="")), "session_id", "session_id"),
])
async def test_invalid_argument_names_the_field(tiny_engine, call, field, fragment):
    async with serving(tiny_engine) as served:
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        err = await rpc_error(call(stub, sid))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.details()
        d = _details(err)
        assert d["ErrorInfo"].reason == "INVALID_REQUEST" and "RetryInfo" not in d
        (violation,) = d["BadRequest"].field_violations
        assert violation.field == field and violation.description == err.details()


async def test_status_details_per_code(tiny_engine):
    async with serving(tiny_engine, max_sessions=1) as served:
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        err = await rpc_error(stub.CreateSession(pb.CreateSessionRequest()))
        d = _details(err)
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and d["ErrorInfo"].reason == "POOL_EXHAUSTED"
        assert d["RetryInfo"].retry_delay.seconds == 1 and "BadRequest" not in d
        err = await rpc_error(generate(stub, sid, 1))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _details(err)["ErrorInfo"].reason == "FAILED_PRECONDITION" and "RetryInfo" not in _details(err)
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=200, ignore_eos=True))
        await stream.read()
        err = await rpc_error(stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1])))
        d = _details(err)
        assert err.code() == grpc.StatusCode.ABORTED and d["ErrorInfo"].reason == "SESSION_BUSY"
        assert d["RetryInfo"].retry_delay.ToMilliseconds() == 100
        stream.cancel()
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        err = await rpc_error(stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)))
        assert err.code() == grpc.StatusCode.NOT_FOUND and sid in err.details()
        assert _details(err)["ErrorInfo"].reason == "SESSION_NOT_FOUND"


async def test_unavailable_while_loading_and_internal(tiny_engine, monkeypatch):
    async with serving(tiny_engine, attach=False) as served:
        err = await rpc_error(served.stub().CreateSession(pb.CreateSessionRequest()))
        d = _details(err)
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "model is still loading" in err.details()
        assert d["ErrorInfo"].reason == "ENGINE_UNAVAILABLE" and d["RetryInfo"].retry_delay.seconds == 1
        await served.frontend.attach(served.runtime)

        async def explode(*args):
            raise KeyError("boom")

        monkeypatch.setattr(served.runtime, "create_session", explode)
        err = await rpc_error(served.stub().CreateSession(pb.CreateSessionRequest()))
        assert err.code() == grpc.StatusCode.INTERNAL and "KeyError" in err.details()
        assert _details(err)["ErrorInfo"].reason == "INTERNAL"


def test_error_table_is_complete():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.RuntimeServiceError)]
    assert set(classes) - {errors.RuntimeServiceError} == set(ERROR_SPECS)
    reasons = [s.reason for s in ERROR_SPECS.values()]
    assert len(set(reasons)) == len(reasons) and all(r.isupper() for r in reasons)
    assert spec_of(errors.MalformedRequest("x")).reason == "MALFORMED_REQUEST"
    assert status_of(errors.Unauthenticated("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert len(rich_status(errors.InvalidRequest("no field"), "m").details) == 1
    retry = {s.code for s in ERROR_SPECS.values() if s.retry_after_s}
    assert retry == {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE}
