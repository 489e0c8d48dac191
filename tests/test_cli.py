"""`python -m inference_engine` as a real process: readiness line, BLAS log, SIGTERM drain."""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from inference_engine.readiness import wait_ready
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.blas_env import linux_openblas

pytestmark = pytest.mark.real_model


def _start(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "serve", "--port", "0", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )
    return proc, wait_ready(proc)


def test_serve_readiness_drain_and_sigterm(real_model_path):
    proc, target = _start("--max-sessions", "2", "--grace", "30")
    try:
        stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(target))
        sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2, 3, 4]))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=24, ignore_eos=True))
        first = next(stream)
        proc.send_signal(signal.SIGTERM)  # in-flight Generate must be drained, not cut
        rest = list(stream)
        tokens = list(first.tokens) + [t for m in rest for t in m.tokens]
        assert len(tokens) == 24 and rest[-1].stop_reason == pb.STOP_REASON_MAX_TOKENS
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "BLAS in use: " in err and "exact mode: block size" in err and "stopped" in err
    if sys.platform.startswith("linux"):  # every product on the exact kernels, started without LD_PRELOAD
        assert "on MLX's CPU stream" in err and "INFERENCE_ENGINE_BLAS_REEXEC" not in os.environ
    frozen = int(err.split("froze ")[1].split()[0])  # start-up objects out of the full collections' way
    assert frozen > 10_000


def test_stream_longer_than_grace_gets_its_final_message(real_model_path):
    """SIGTERM: new calls are refused, and a stream that outlives --grace ends with CANCELLED, not a cut connection."""
    proc, target = _start("--max-sessions", "2", "--grace", "2")
    try:
        stub = pb_grpc.RuntimeServiceStub(grpc.insecure_channel(target))
        sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=[1, 2, 3, 4]))
        stream = stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=4000, ignore_eos=True))
        first = next(stream)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(grpc.RpcError) as refused:
            stub.CreateSession(pb.CreateSessionRequest())
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(stream)
        produced = len(first.tokens) + sum(len(m.tokens) for m in rest)
        assert rest[-1].stop_reason == pb.STOP_REASON_CANCELLED and produced < 4000
        assert rest[-1].history_length == 4 + produced  # the final message counts exactly what was sent
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


@linux_openblas
def test_forced_reexec_preloads_openblas(real_model_path):
    """INFERENCE_ENGINE_OPENBLAS=1: the launcher re-execs with OpenBLAS (and the exact-gemm interposer) preloaded."""
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    env["INFERENCE_ENGINE_OPENBLAS"] = "1"
    proc, _ = _start("--no-exact", env=env)
    try:
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "BLAS in use: openblas" in err and "plain mode" in err


@linux_openblas
def test_unknown_kernel_is_a_usage_error():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "INFERENCE_ENGINE_NO_ROW_GEMV")}
    env["INFERENCE_ENGINE_KERNEL"] = "fast"
    out = subprocess.run([sys.executable, "-m", "inference_engine", "serve"], env=env, capture_output=True, text=True)
    assert out.returncode == 2 and "INFERENCE_ENGINE_KERNEL='fast' is not a kernel" in out.stderr


def test_bad_flag_is_a_usage_error():
    out = subprocess.run([sys.executable, "-m", "inference_engine", "serve", "--max-sessions", "0"], capture_output=True, text=True)
    assert out.returncode == 2 and "--max-sessions" in out.stderr


def test_a_folder_flag_that_cannot_hold_files_is_a_usage_error(tmp_path):
    """Refused before the model loads, naming the flag, the folder and the cause (even as root)."""
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"x")
    for flag in ("--persist-sessions", "--snapshot-dir"):
        out = subprocess.run([sys.executable, "-m", "inference_engine", "serve", "--port", "0", flag,
                              str(a_file / "sub")], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2, out.stderr
        assert f"{flag}: {a_file / 'sub'} is not a writable folder (Not a directory)" in out.stderr


def test_prepare_model_prints_folders(real_model_path):
    out = subprocess.run([sys.executable, "-m", "inference_engine", "prepare-model"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0
    fp32, q4 = out.stdout.split()
    assert fp32 == str(real_model_path) and q4.endswith("q4")


def test_sigterm_while_the_model_loads_exits_cleanly(real_model_path):
    """The stop signal is handled from the start: SIGTERM during the load ends the process with status 0
    and its log lines, at once (it was killed by the signal's default action: status -15, no log)."""
    proc = subprocess.Popen([sys.executable, "-m", "inference_engine", "serve", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # bound, NOT_SERVING: the model load starts right after this line
            if "health NOT_SERVING until the model is loaded" in line:
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert "shutting down while the model loads" in err and "stopped" in err and "listening" not in proc.stdout.read()
