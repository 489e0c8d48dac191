"""RuntimeService's registration, with the methods whose servicer answers already-serialized bytes.

The generated `add_RuntimeServiceServicer_to_server` serializes every response with its message
class. Tokenize answers its response's bytes instead (a large text's ids are serialized in a
tokenizer process: servicer.Tokenize), so its handler sends them as they are.
"""

from __future__ import annotations

from typing import Any, Mapping

import grpc

from inference_engine.v1 import runtime_pb2_grpc as pb_grpc

PRESERIALIZED = ("Tokenize",)  # RuntimeService methods whose servicer answers the response's bytes


def _as_is(response: bytes) -> bytes:
    """A PRESERIALIZED method's response: already its wire bytes."""
    return response


class _Registrar:
    """The server as the generated registration sees it: the handlers it adds pass through here."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server
        self.methods: set[str] = set()  # the methods registered through `add_registered_method_handlers`

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Ignored: `add_registered_method_handlers` below adds the generic handler of the same table
        (`add_runtime_service` fails when the generated code did not call it)."""

    def add_registered_method_handlers(self, service: str, handlers: Mapping[str, grpc.RpcMethodHandler]) -> None:
        table = {name: h._replace(response_serializer=_as_is) if name in PRESERIALIZED else h
                 for name, h in handlers.items()}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, table),))
        self._server.add_registered_method_handlers(service, table)
        self.methods |= set(table)


def add_runtime_service(servicer: pb_grpc.RuntimeServiceServicer, server: grpc.aio.Server) -> None:
    """Register `servicer` on `server` as the generated code does, PRESERIALIZED methods sending their bytes.

    Raises:
        RuntimeError: the generated registration no longer hands its table to `add_registered_method_handlers`,
            or lacks a PRESERIALIZED method (stubs regenerated differently: the server would answer nothing).
    """
    registrar = _Registrar(server)
    pb_grpc.add_RuntimeServiceServicer_to_server(servicer, registrar)
    missing = ", ".join(sorted(set(PRESERIALIZED) - registrar.methods)) if registrar.methods else "anything"
    if missing:
        raise RuntimeError(f"the generated RuntimeService registration did not register {missing} through "
                           "add_registered_method_handlers; update server/service_registration.py")
