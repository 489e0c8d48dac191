"""`serve` as a real process with TLS, tokens, metrics and JSON logs: health while loading, drain, no secrets logged."""

import json
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inference_engine.security.credentials import open_sync_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.certs import TOKEN_A, token_file

pytestmark = pytest.mark.real_model
NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(lines: list[str], fragment: str, timeout_s: float = 120) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(lines):
            if fragment in line:
                return line
        time.sleep(0.01)
    raise AssertionError(f"{fragment!r} not logged: {lines[-5:]}")


def test_secured_serve_end_to_end(real_model_path, pki, tmp_path):
    metrics_port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--max-sessions", "2",
         "--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
         "--auth-token-file", str(token_file(tmp_path, TOKEN_A)), "--metrics-port", str(metrics_port),
         "--log-format", "json", "--grace", "30"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_lines: list[str] = []
    pump = threading.Thread(target=lambda: err_lines.extend(iter(proc.stderr.readline, "")), daemon=True)
    pump.start()
    try:
        bound = json.loads(_wait_for(err_lines, "health NOT_SERVING until"))["message"]
        target = bound.split()[1]
        channel = open_sync_channel(target, ClientSecurity(ca_file=pki.ca, token=TOKEN_A))
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == NOT_SERVING  # model still loading
        assert proc.stdout.readline().startswith("listening on 127.0.0.1:")
        assert health.Check(health_pb2.HealthCheckRequest(service="inference_engine.v1.RuntimeService")).status == SERVING
        stub = pb_grpc.RuntimeServiceStub(channel)
        sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2, 3, 4]))
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RuntimeServiceStub(open_sync_channel(target, ClientSecurity(ca_file=pki.ca))).CreateSession(
                pb.CreateSessionRequest())
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        watch = health.Watch(health_pb2.HealthCheckRequest())
        assert next(watch).status == SERVING
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=12, ignore_eos=True))
        first = next(stream)
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        assert 'grpc_server_handled_total{grpc_code="OK",grpc_method="AppendTokens"' in text
        assert "inference_engine_tokens_appended_total 4.0" in text
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING  # draining
        rest = list(stream)  # the in-flight Generate is drained, not cut
        assert len(first.tokens) + sum(len(m.tokens) for m in rest) == 12
        assert proc.wait(timeout=60) == 0
        channel.close()
    finally:
        proc.kill()
    pump.join(timeout=10)
    records = [json.loads(line) for line in err_lines]  # every line is one JSON object
    rpc = [r["rpc"] for r in records if r["logger"] == "inference_engine.rpc"]
    assert {"CreateSession", "AppendTokens", "Generate"} <= {r["method"] for r in rpc}
    assert any(r["code"] == "UNAUTHENTICATED" for r in rpc)
    assert records[-1]["message"] == "stopped"
    text = "".join(err_lines)
    assert sid not in text and TOKEN_A not in text
