"""Metrics endpoint, one log line per RPC, JSON logs, and no secrets in any log (tiny model)."""

import asyncio
import io
import json
import logging
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from inference_engine import metrics
from inference_engine.log_setup import JsonFormatter, add_logging_flags, configure_logging
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.security.tokens import token_identity
from inference_engine.server import call_record
from inference_engine.server.metrics_http import MetricsEndpoint
from inference_engine.short_id import short_id
from inference_engine.v1 import runtime_pb2 as pb
from tests.certs import TOKEN_A, token_file
from tests.ops_helpers import PROMPT, generate, rpc_error, serving


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _delta(before, after, name, **labels):
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def _rpc(method, code="OK"):
    return {"grpc_service": "inference_engine.v1.RuntimeService", "grpc_method": method, "grpc_code": code}


async def test_metrics_endpoint_shows_counters_that_moved(tiny_engine):
    endpoint = MetricsEndpoint("127.0.0.1", 0)
    try:
        async with serving(tiny_engine) as served:
            stub = served.stub()
            before = await asyncio.to_thread(_scrape, endpoint.port)
            sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
            assert len(await generate(stub, sid, 5)) == 5
            await rpc_error(stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id="missing")))
            for _ in range(100):  # an aborted call's status reaches the client before the server records it
                after = await asyncio.to_thread(_scrape, endpoint.port)
                if _delta(before, after, "grpc_server_handled_total", **_rpc("GetSessionInfo", "NOT_FOUND")):
                    break
                await asyncio.sleep(0.02)
    finally:
        endpoint.close()
    assert _delta(before, after, "grpc_server_handled_total", **_rpc("CreateSession")) == 1
    assert _delta(before, after, "grpc_server_handled_total", **_rpc("Generate")) == 1
    assert _delta(before, after, "grpc_server_handled_total", **_rpc("GetSessionInfo", "NOT_FOUND")) == 1
    latency = {"grpc_service": "inference_engine.v1.RuntimeService", "grpc_method": "AppendTokens"}
    assert _delta(before, after, "grpc_server_handling_seconds_count", **latency) == 1
    assert _delta(before, after, "inference_engine_tokens_appended_total") == len(PROMPT)
    assert _delta(before, after, "inference_engine_tokens_generated_total") == 5
    assert _delta(before, after, "inference_engine_time_to_first_token_seconds_count") == 1
    assert _delta(before, after, "inference_engine_decode_step_seconds_count") == 4
    assert after[("inference_engine_sessions_in_use", ())] == 1
    assert after[("inference_engine_session_slots", ())] == 4
    assert after[("inference_engine_kv_pool_bytes_in_use", ())] > 0
    assert _delta(before, after, "inference_engine_batch_rows_count") >= 5  # the append, then a forward per step
    assert _delta(before, after, "inference_engine_queue_wait_seconds_count") == 2  # the append's and the stream's


async def test_one_log_line_per_rpc_without_secrets(tiny_engine, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    security = ServerSecurity(auth_token_file=token_file(tmp_path, TOKEN_A))
    async with serving(tiny_engine, security) as served:
        stub = served.stub(ClientSecurity(token=TOKEN_A))
        sid = (await stub.CreateSession(pb.CreateSessionRequest(client_label="log"))).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        await generate(stub, sid, 3)
        await rpc_error(served.stub().GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)))  # no token
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    lines = [r for r in caplog.records if r.name == "inference_engine.rpc"]
    assert [(r.rpc["method"], r.rpc["code"]) for r in lines] == [
        ("CreateSession", "OK"), ("AppendTokens", "OK"), ("Generate", "OK"), ("GetSessionInfo", "UNAUTHENTICATED"),
        ("CloseSession", "OK")]
    assert all(r.levelno == logging.INFO and r.rpc["duration_ms"] >= 0 for r in lines)
    create, append, gen, _, close = (r.rpc for r in lines)
    assert create["session"] == append["session"] == gen["session"] == close["session"] == short_id(sid)
    assert append["tokens_in"] == len(PROMPT) and gen["tokens_out"] == 3 and gen["stop_reason"] == "MAX_TOKENS"
    assert create["peer"] == gen["peer"] == short_id(token_identity(TOKEN_A))
    message = next(r.getMessage() for r in lines if r.rpc["method"] == "Generate")
    assert message.startswith("rpc Generate OK ") and f"session={short_id(sid)}" in message and "tokens_out=3" in message
    created = next(r.getMessage() for r in caplog.records if "created by" in r.getMessage())
    assert short_id(sid) in created
    # The full session id and the token appear nowhere (runtime, server or grpc logs).
    assert sid not in caplog.text and TOKEN_A not in caplog.text


async def test_health_calls_log_at_debug(tiny_engine, caplog):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    caplog.set_level(logging.DEBUG, logger="inference_engine.rpc")
    async with serving(tiny_engine) as served:
        await health_pb2_grpc.HealthStub(served.channel()).Check(health_pb2.HealthCheckRequest())
    (line,) = [r for r in caplog.records if r.name == "inference_engine.rpc"]
    assert line.levelno == logging.DEBUG and line.rpc["method"] == "Check"


async def test_cancelled_stream_is_logged_cancelled(tiny_engine, caplog):
    caplog.set_level(logging.INFO, logger="inference_engine.rpc")
    async with serving(tiny_engine) as served:
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4000, ignore_eos=True))
        await stream.read()
        stream.cancel()
        for _ in range(100):
            if any(r.rpc["method"] == "Generate" for r in caplog.records if r.name == "inference_engine.rpc"):
                break
            await asyncio.sleep(0.02)
    (gen,) = [r.rpc for r in caplog.records if r.name == "inference_engine.rpc" and r.rpc["method"] == "Generate"]
    assert gen["code"] == "CANCELLED" and gen["tokens_out"] >= 1


def test_json_formatter_and_flags(capsys):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    log = logging.getLogger("test.json")
    log.addHandler(handler)
    try:
        log.warning("hello %s", "world", extra={"rpc": {"method": "X", "code": "OK"}})
        try:
            raise ValueError("bad")
        except ValueError:
            log.exception("failed\nacross lines")
    finally:
        log.removeHandler(handler)
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "hello world" and first["level"] == "WARNING" and first["rpc"]["method"] == "X"
    assert "T" in first["ts"] and first["logger"] == "test.json"
    assert second["message"] == "failed\nacross lines" and "ValueError: bad" in second["exc"]
    import argparse

    parser = argparse.ArgumentParser()
    add_logging_flags(parser)
    args = parser.parse_args(["--log-level", "debug", "--log-format", "json"])
    assert (args.log_level, args.log_format) == ("DEBUG", "json")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(args.log_level, args.log_format)
        logging.getLogger("test.cfg").debug("visible")
        assert json.loads(capsys.readouterr().err.splitlines()[-1])["message"] == "visible"
        configure_logging("WARNING", "text")
        logging.getLogger("test.cfg").info("hidden")
        logging.getLogger("test.cfg").warning("shown")
        err = capsys.readouterr().err
        assert "hidden" not in err and "WARNING test.cfg: shown" in err
    finally:
        root.handlers[:], root.level = saved


def test_call_record_outside_a_call():
    record = call_record.current()
    record.session_id = "x"  # a throwaway: nothing to observe
    assert call_record.current().session_id == ""


def test_pool_gauges_read_the_live_store_at_scrape_time():
    held = {"slabs": 3, "bytes": 4096}
    metrics.track_pool(lambda: held["slabs"], 8, lambda: held["bytes"])
    value = metrics.REGISTRY.get_sample_value
    assert (value("inference_engine_sessions_in_use"), value("inference_engine_session_slots"),
            value("inference_engine_kv_pool_bytes_in_use")) == (3, 8, 4096)
    held.update(slabs=5, bytes=0)  # read again at the next scrape, not copied
    assert (value("inference_engine_sessions_in_use"), value("inference_engine_kv_pool_bytes_in_use")) == (5, 0)


def test_short_id_and_metrics_host_warning(caplog):
    assert short_id("") == "-" and len(short_id("abc")) == 12 and short_id("abc") != short_id("abd")
    endpoint = MetricsEndpoint("0.0.0.0", 0)
    try:
        assert endpoint.port > 0 and "without authentication" in caplog.text
    finally:
        endpoint.close()


def test_cli_log_flags_and_insecure_public_warning(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "inference_engine", "serve", "--host", "0.0.0.0", "--port", "0", "--insecure-public",
         "--model", str(tmp_path / "no-model"), "--draft-model", "none", "--log-format", "json", "--log-level", "warning"],
        capture_output=True, text=True, timeout=120)
    records = [json.loads(line) for line in out.stderr.splitlines()]  # one JSON object per line
    assert out.returncode == 2
    assert records[0]["level"] == "WARNING" and records[0]["message"].startswith("INSECURE: --host 0.0.0.0")
    assert records[-1]["level"] == "ERROR" and "cannot serve" in records[-1]["message"]
    assert not any(r["level"] == "INFO" for r in records)  # --log-level warning
