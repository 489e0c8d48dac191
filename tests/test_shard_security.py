"""The shard route with TLS, mTLS and bearer tokens: workers check, the pipeline presents (tiny model)."""

import argparse
import contextlib

import grpc
import numpy as np
import pytest

from inference_engine.errors import RuntimeServiceError
from inference_engine.security.credentials import open_channel
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.protocol.wire import CLIENT_CHANNEL_OPTIONS
from inference_engine.shard.worker.config import add_worker_flags, worker_config_from_args
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.servicer import start_shard_server
from inference_engine.v1 import shard_runtime_pb2 as pb
from inference_engine.v1 import shard_runtime_pb2_grpc as pb_grpc
from tests.certs import TOKEN_A, token_file
from tests.shard_helpers import ref_block, reference

TOKENS = np.random.default_rng(3).integers(0, 256, 12).tolist()


@contextlib.asynccontextmanager
async def _secured_route(tiny, security):
    servers = []
    try:
        for layers in (LayerRange(0, 1), LayerRange(1, 2)):
            engine = MlxShardEngine(tiny.model, layers, block=4, max_rollback=4)
            servers.append(await start_shard_server(engine, "127.0.0.1", 0, security=security))
        yield [f"127.0.0.1:{port}" for _, port, _ in servers]
    finally:
        for server, _, servicer in servers:
            servicer.fail_sessions("test over")
            await server.stop(0.5)
            servicer.close()


async def test_route_over_mtls_with_tokens(tiny, pki, tmp_path):
    security = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca,
                              auth_token_file=token_file(tmp_path, TOKEN_A))
    client = ClientSecurity(ca_file=pki.ca, cert_file=pki.client_a.cert, key_file=pki.client_a.key, token=TOKEN_A)
    async with _secured_route(tiny, security) as addresses:
        async with ShardPipeline(addresses, channel_security=client) as pipeline:
            geometry = await pipeline.open("s", sink=2, window=5)
            got = await pipeline.forward("s", TOKENS)
            assert got.tobytes() == ref_block(reference(tiny, geometry), TOKENS).tobytes()
            await pipeline.open("t", sink=2, window=5)  # two sessions in one Batch message per hop
            both = await pipeline.forward_many([("s", TOKENS[:1], True), ("t", TOKENS, True)])
            assert both[1].tobytes() == got.tobytes() and both[0].shape == (1, got.shape[1])
        no_token = ClientSecurity(ca_file=pki.ca, cert_file=pki.client_a.cert, key_file=pki.client_a.key)
        pipeline = ShardPipeline(addresses, channel_security=no_token, connect_timeout_s=5)
        with pytest.raises(RuntimeServiceError, match="bearer token"):
            await pipeline.connect()
        await pipeline.close()
        channel = open_channel(addresses[0], no_token, CLIENT_CHANNEL_OPTIONS)
        call = pb_grpc.ShardRuntimeStub(channel).Batch()  # the Batch stream sits behind the same check
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call.write(pb.ShardBatchRequest())
            await call.read()
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await channel.close()
        pipeline = ShardPipeline(addresses, connect_timeout_s=2)  # plaintext to a TLS worker
        with pytest.raises(RuntimeServiceError, match="unavailable"):
            await pipeline.connect()
        await pipeline.close()


async def test_worker_refuses_an_unreadable_token_file(tiny, tmp_path):
    engine = MlxShardEngine(tiny.model, LayerRange(0, 1), block=4, max_rollback=4)
    with pytest.raises(OSError):
        await start_shard_server(engine, "127.0.0.1", 0, security=ServerSecurity(auth_token_file=tmp_path / "missing"))


def test_worker_security_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    cfg = worker_config_from_args(parser.parse_args(
        ["--layers", "0:10", "--host", "0.0.0.0", "--tls-cert", "c", "--tls-key", "k", "--tls-client-ca", "ca"]))
    assert cfg.security.is_mtls and cfg.security.is_authenticated
    with pytest.raises(ValueError, match="not a loopback address"):
        worker_config_from_args(parser.parse_args(["--layers", "0:10", "--host", "0.0.0.0", "--tls-cert", "c",
                                                   "--tls-key", "k"]))
