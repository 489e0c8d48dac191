"""Binding the front: a port another server holds is refused (grpc's default SO_REUSEPORT would let a
second server share it, the kernel spreading connections and sessions over both), and a certificate,
key or client CA that TLS cannot use is named at start-up, not reported as a port problem."""

import pytest

from inference_engine.security.settings import ServerSecurity
from inference_engine.server.frontend import open_frontend
from inference_engine.shard.protocol.types import LayerRange
from inference_engine.shard.worker.mlx_engine import MlxShardEngine
from inference_engine.shard.worker.servicer import start_shard_server
from tests.conftest import make_config
from tests.ops_helpers import serving
from tests.shard_helpers import shard_server


async def test_a_port_in_use_is_refused(tiny_engine):
    async with serving(tiny_engine) as served:
        with pytest.raises(OSError, match=f"could not bind 127.0.0.1:{served.frontend.port}"):
            await open_frontend(make_config(), "127.0.0.1", served.frontend.port)


async def test_a_shard_workers_port_in_use_is_refused(tiny):
    engine = MlxShardEngine(tiny.model, LayerRange(0, 1), block=4, max_rollback=4)
    async with shard_server(engine) as (_, address, _):
        with pytest.raises(OSError, match=f"could not bind {address}"):
            await start_shard_server(engine, "127.0.0.1", int(address.rsplit(":", 1)[1]))


@pytest.mark.parametrize("case,flag", [("not PEM", "--tls-cert"), ("key of another certificate", "--tls-cert"),
                                       ("client CA not PEM", "--tls-client-ca")])
async def test_unusable_tls_files_are_named(pki, tmp_path, case, flag):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    security = {
        "not PEM": ServerSecurity(tls_cert=junk, tls_key=pki.server.key),
        "key of another certificate": ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.client_a.key),
        "client CA not PEM": ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=junk),
    }[case]
    with pytest.raises(OSError, match=f"^{flag} .* cannot be used"):
        await open_frontend(make_config(security=security), "127.0.0.1", 0)
