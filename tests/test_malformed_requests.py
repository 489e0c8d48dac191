"""Undecodable requests are INVALID_ARGUMENT with one WARNING line, never UNKNOWN or a traceback."""

import logging

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, token_file
from tests.ops_helpers import rpc_error, serving

SERVICE = "/inference_engine.v1.RuntimeService/"
BAD_UTF8_LABEL = b"\x12\x03\xff\xfe\xfd"  # CreateSessionRequest.client_label (field 2) = 3 invalid UTF-8 bytes
BAD_UTF8_SESSION = b"\x0a\x02\xc3\x28"  # session_id (field 1) = an invalid 2-byte sequence
CORRUPT = b"\x0a\x05ab"  # a length-delimited field cut short
CASES = [
    ("CreateSession", BAD_UTF8_LABEL, False),
    ("GetSessionInfo", BAD_UTF8_SESSION, False),
    ("AppendTokens", CORRUPT, False),
    ("CloseSession", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", False),
    ("Generate", BAD_UTF8_SESSION, True),
    ("RestoreSession", b"\xff\xff\xff", "client"),  # a client stream: the servicer meets it mid-iteration
]


@pytest.mark.parametrize("method,payload,is_stream", CASES)
async def test_raw_bytes_are_invalid_argument(tiny_engine, caplog, method, payload, is_stream):
    caplog.set_level(logging.DEBUG)
    async with serving(tiny_engine) as served:
        channel = served.channel()
        if is_stream == "client":
            call = channel.stream_unary(SERVICE + method, request_serializer=None,
                                        response_deserializer=None)(iter([payload]))
        else:
            factory = channel.unary_stream if is_stream else channel.unary_unary
            call = factory(SERVICE + method, request_serializer=None, response_deserializer=None)(payload)
        err = await rpc_error(call.read() if is_stream is True else call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
        assert "could not be decoded" in err.details() and method in err.details()
        status = rpc_status.from_call(err)
        info = error_details_pb2.ErrorInfo()
        assert status.details[0].Unpack(info) and info.reason == "MALFORMED_REQUEST"
        # The server is fine afterwards.
        assert (await served.stub().CreateSession(pb.CreateSessionRequest())).session_id
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "malformed request" in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage() and warnings[0].exc_info is None
    assert "Traceback" not in caplog.text and "UNKNOWN" not in caplog.text


async def test_token_is_checked_before_decoding(tiny_engine, tmp_path):
    async with serving(tiny_engine, ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A))) as served:
        raw = served.channel().unary_unary(SERVICE + "CreateSession", request_serializer=None, response_deserializer=None)
        assert (await rpc_error(raw(BAD_UTF8_LABEL))).code() == grpc.StatusCode.UNAUTHENTICATED
        authed = served.channel(ClientSecurity(token=TOKEN_A))
        raw = authed.unary_unary(SERVICE + "CreateSession", request_serializer=None, response_deserializer=None)
        assert (await rpc_error(raw(BAD_UTF8_LABEL))).code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_undecodable_stream_request_is_invalid_argument(tiny_engine):
    async with serving(tiny_engine) as served:
        call = served.channel().stream_stream(
            "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
            request_serializer=None, response_deserializer=None)()
        await call.write(b"\x3a\x02\xc3\x28")  # list_services (field 7) = invalid UTF-8
        err = await rpc_error(call.read())
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_unknown_method_is_unimplemented(tiny_engine):
    async with serving(tiny_engine) as served:
        raw = served.channel().unary_unary(SERVICE + "NoSuchMethod", request_serializer=None, response_deserializer=None)
        assert (await rpc_error(raw(b""))).code() == grpc.StatusCode.UNIMPLEMENTED


def test_synchronous_behaviors_are_left_alone():
    from inference_engine.server.handler_wrap import wrap_handler

    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    assert wrap_handler(handler, lambda request, context: None) is handler
