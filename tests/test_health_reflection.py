"""grpc.health.v1 transitions and server reflection on a real server (tiny model)."""

import asyncio

import grpc
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from inference_engine.security.credentials import open_sync_channel
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from tests.certs import TOKEN_A, token_file
from tests.ops_helpers import rpc_error, serving

SERVICE = "inference_engine.v1.RuntimeService"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _status(stub, service):
    return (await stub.Check(health_pb2.HealthCheckRequest(service=service))).status


async def test_health_not_serving_until_attached_and_while_draining(tiny_engine):
    async with serving(tiny_engine, attach=False) as served:
        health = health_pb2_grpc.HealthStub(served.channel())
        assert [await _status(health, s) for s in ("", SERVICE)] == [NOT_SERVING, NOT_SERVING]
        watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
        assert (await watch.read()).status == NOT_SERVING
        await served.frontend.attach(served.runtime)
        assert (await watch.read()).status == SERVING
        assert [await _status(health, s) for s in ("", SERVICE)] == [SERVING, SERVING]
        assert (await rpc_error(health.Check(health_pb2.HealthCheckRequest(service="nope")))).code() == \
            grpc.StatusCode.NOT_FOUND
        unknown = health.Watch(health_pb2.HealthCheckRequest(service="nope"))
        assert (await unknown.read()).status == health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        drain = asyncio.create_task(served.frontend.drain(30.0))
        assert (await watch.read()).status == NOT_SERVING  # watchers learn it before the port closes
        while (msg := await watch.read()) is not grpc.aio.EOF:
            assert msg.status == NOT_SERVING
        assert await watch.code() == grpc.StatusCode.OK  # ... and their streams end: they do not hold the drain
        assert await unknown.read() is grpc.aio.EOF
        await asyncio.wait_for(drain, 5.0)
        await served.frontend.health.set_serving(True)  # ignored once draining
        assert served.frontend.health._status[SERVICE] == NOT_SERVING


async def test_reflection_lists_services_and_builds_requests(tiny_engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A))
    async with serving(tiny_engine, security) as served:
        # The descriptor database takes a blocking channel.
        channel, authed = grpc.insecure_channel(served.target), open_sync_channel(served.target, ClientSecurity(token=TOKEN_A))
        try:
            db = ProtoReflectionDescriptorDatabase(authed)
            services = await asyncio.to_thread(db.get_services)
            assert set(services) >= {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
            pool = descriptor_pool.DescriptorPool(db)
            method = (await asyncio.to_thread(pool.FindServiceByName, SERVICE)).methods_by_name["CreateSession"]
            request_cls = message_factory.GetMessageClass(method.input_type)
            response_cls = message_factory.GetMessageClass(method.output_type)
            call = served.channel(ClientSecurity(token=TOKEN_A)).unary_unary(
                f"/{SERVICE}/CreateSession", request_serializer=request_cls.SerializeToString,
                response_deserializer=response_cls.FromString)
            reply = await call(request_cls(client_label="dynamic", window_tokens=32))
            assert reply.window_tokens == 32 and len(reply.session_id) >= 20
            # Reflection is behind the token like RuntimeService; only health is open.
            bare = ProtoReflectionDescriptorDatabase(channel)
            try:
                await asyncio.to_thread(bare.get_services)
                raise AssertionError("reflection answered without a token")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()
            authed.close()
