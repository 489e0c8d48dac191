"""TLS, mTLS and bearer tokens on a real grpc.aio server (tiny model), and the start-up flags."""

import argparse
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from inference_engine import config as config_mod
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.security.tokens import token_identity
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, TOKEN_B, token_file
from tests.ops_helpers import rpc_error, serving


def test_security_flags(tmp_path, caplog):
    parser = argparse.ArgumentParser()
    config_mod.add_server_flags(parser)
    tokens = token_file(tmp_path, TOKEN_A)
    cfg = config_mod.config_from_args(parser.parse_args(
        ["--host", "0.0.0.0", "--tls-cert", "c.pem", "--tls-key", "k.pem", "--auth-token-file", str(tokens),
         "--shard-tls-ca", "ca.pem", "--shard-token-file", str(tokens), "--shards", "10.0.0.2:50061",
         "--metrics-port", "9100"]))
    assert cfg.security.is_tls and cfg.security.has_tokens and not cfg.security.is_mtls
    assert cfg.shard_security.is_tls and cfg.shard_security.token == TOKEN_A and TOKEN_A not in repr(cfg)
    assert cfg.metrics_port == 9100 and cfg.metrics_host == "127.0.0.1"
    assert cfg.security.describe() == "TLS, bearer tokens"
    assert ServerSecurity(tls_cert=tokens, tls_key=tokens, tls_client_ca=tokens).describe() == "mTLS, client certificates"
    for argv, fragment in ((["--tls-cert", "c.pem"], "go together"), (["--tls-client-ca", "ca.pem"], "needs --tls-cert"),
                           (["--shard-tls-cert", "c.pem"], "go together"),
                           (["--shard-tls-cert", "c", "--shard-tls-key", "k"], "needs --shard-tls-ca"),
                           (["--host", "0.0.0.0"], "not a loopback address"), (["--metrics-port", "-1"], "--metrics-port")):
        with pytest.raises(ValueError, match=fragment):
            config_mod.config_from_args(parser.parse_args(argv))
    caplog.clear()
    cfg = config_mod.config_from_args(parser.parse_args(["--host", "0.0.0.0", "--insecure-public"]))
    assert cfg.security.insecure_public
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "INSECURE" in caplog.text


@pytest.mark.parametrize("command", [["serve"], ["shard-worker", "--layers", "0:1"]])
def test_public_bind_refused_at_start_up(command):
    out = subprocess.run([sys.executable, "-m", "inference_engine", *command, "--host", "0.0.0.0", "--port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not a loopback address" in out.stderr and "--insecure-public" in out.stderr


async def test_tokens_required_health_open(tiny_engine, tmp_path):
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A, TOKEN_B))
    async with serving(tiny_engine, security) as served:
        for client in (ClientSecurity(), ClientSecurity(token="wrong-token-0123456789")):
            err = await rpc_error(served.stub(client).CreateSession(pb.CreateSessionRequest()))
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer" in err.details()
            info = rpc_status.from_call(err)
            assert info.details[0].type_url.endswith("ErrorInfo")
        stream = served.stub().Generate(pb.GenerateRequest(session_id="x", max_new_tokens=1))
        assert (await rpc_error(stream.read())).code() == grpc.StatusCode.UNAUTHENTICATED
        sid = (await served.stub(ClientSecurity(token=TOKEN_A)).CreateSession(pb.CreateSessionRequest())).session_id
        assert len(sid) >= 20
        health = health_pb2_grpc.HealthStub(served.channel())  # probes need no token
        reply = await health.Check(health_pb2.HealthCheckRequest(service=""))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_tls_and_mtls_connect(tiny_engine, pki):
    tls = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key)
    async with serving(tiny_engine, tls) as served:
        sid = (await served.stub(ClientSecurity(ca_file=pki.ca)).CreateSession(pb.CreateSessionRequest())).session_id
        assert sid
        err = await rpc_error(served.stub(ClientSecurity(ca_file=pki.other_ca)).CreateSession(
            pb.CreateSessionRequest(), timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # the server's certificate is not trusted
        err = await rpc_error(served.stub().CreateSession(pb.CreateSessionRequest(), timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # plaintext to a TLS port
    mtls = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, tls_client_ca=pki.ca)
    async with serving(tiny_engine, mtls) as served:
        a = ClientSecurity(ca_file=pki.ca, cert_file=pki.client_a.cert, key_file=pki.client_a.key)
        sid = (await served.stub(a).CreateSession(pb.CreateSessionRequest())).session_id
        assert served.runtime.store.get(sid, "cert:CN=client-a").owner == "cert:CN=client-a"
        err = await rpc_error(served.stub(ClientSecurity(ca_file=pki.ca)).CreateSession(
            pb.CreateSessionRequest(), timeout=5))
        assert err.code() == grpc.StatusCode.UNAVAILABLE  # no client certificate: the handshake fails


async def test_tls_with_tokens_sends_call_credentials(tiny_engine, pki, tmp_path):
    security = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key,
                              auth_token_file=token_file(tmp_path, TOKEN_A))
    async with serving(tiny_engine, security) as served:
        stub = served.stub(ClientSecurity(ca_file=pki.ca, token=TOKEN_A))
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        assert served.runtime.store.get(sid, token_identity(TOKEN_A))
        err = await rpc_error(served.stub(ClientSecurity(ca_file=pki.ca)).CreateSession(pb.CreateSessionRequest()))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_missing_certificate_fails_at_start(tiny_engine, tmp_path):
    with pytest.raises(OSError):
        async with serving(tiny_engine, ServerSecurity(tls_cert=tmp_path / "no.pem", tls_key=tmp_path / "no.key")):
            pass
