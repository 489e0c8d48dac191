"""RuntimeService's registration: Tokenize sends its servicer's bytes as they are, every other method
serializes its message as generated; a generated layout the proxy cannot see fails at start-up."""

import grpc
import pytest

from inference_engine.server import service_registration
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc


class _Server:
    """Records what a registration adds (stands in for a grpc.aio.Server)."""

    def __init__(self):
        self.generic, self.registered = [], {}

    def add_generic_rpc_handlers(self, handlers):
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service, handlers):
        self.registered[service] = handlers


def test_tokenize_sends_bytes_and_the_rest_messages():
    server = _Server()
    service_registration.add_runtime_service(pb_grpc.RuntimeServiceServicer(), server)
    (table,) = server.registered.values()
    assert table["Tokenize"].response_serializer(b"\x0a\x01\x05") == b"\x0a\x01\x05"
    reply = pb.GetModelInfoResponse(model_name="m")
    assert table["GetModelInfo"].response_serializer(reply) == reply.SerializeToString()
    details = type("Details", (), {"method": "/inference_engine.v1.RuntimeService/Tokenize"})()
    (generic,) = server.generic
    assert generic.service(details) is table["Tokenize"]  # the generic handler serves the same table


def test_a_registration_that_bypasses_the_proxy_fails_at_start(monkeypatch):
    def generic_only(servicer, server):  # stubs of an older layout: the generic handler alone
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("inference_engine.v1.RuntimeService",
                                                                               {}),))

    monkeypatch.setattr(pb_grpc, "add_RuntimeServiceServicer_to_server", generic_only)
    with pytest.raises(RuntimeError, match="did not register anything"):
        service_registration.add_runtime_service(pb_grpc.RuntimeServiceServicer(), _Server())



def test_a_registration_without_tokenize_fails_at_start(monkeypatch):
    generated = pb_grpc.add_RuntimeServiceServicer_to_server

    def without_tokenize(servicer, server):  # a method renamed in proto/: bytes would reach a message serializer
        real = server.add_registered_method_handlers
        server.add_registered_method_handlers = lambda service, table: real(
            service, {k: v for k, v in table.items() if k != "Tokenize"})
        generated(servicer, server)

    monkeypatch.setattr(pb_grpc, "add_RuntimeServiceServicer_to_server", without_tokenize)
    with pytest.raises(RuntimeError, match="did not register Tokenize"):
        service_registration.add_runtime_service(pb_grpc.RuntimeServiceServicer(), _Server())
