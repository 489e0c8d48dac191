"""A server started with a clean environment serves exact: no LD_PRELOAD, no launcher re-exec, the exact kernels.

Every exact product goes through the exact kernels' MLX primitives (quant_kernel.py), which load
the exact-gemm library by path. So a server whose environment holds no LD_PRELOAD and none of
the engine's variables must say in GetModelInfo and its log that the exact kernels serve, at the
full probed tile, with no OpenBLAS mapped; and it must compute bitwise what a server the launcher
re-execs with OpenBLAS and the exact-gemm interposer preloaded (INFERENCE_ENGINE_OPENBLAS=1)
computes: the same state digests and tokens for the same feed in other chunkings.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from inference_engine.readiness import wait_ready
from inference_engine.serving_path import EXACT_SUFFIX
from inference_engine.v1 import runtime_pb2 as pb
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.blas_env import linux_openblas
from tests.tiny_text_model import write_tiny_text_model

ROOT = Path(__file__).resolve().parent.parent
FEED = [(7 * i + 3) % 4000 for i in range(150)]  # more than two tiles of 64 rows
CHUNKINGS = ([150], [1, 63, 64, 22], [65, 85])


def clean_env(**extra: str) -> dict[str, str]:
    """PATH, HOME and the coverage hooks only (no LD_PRELOAD, no INFERENCE_ENGINE_*), plus `extra`."""
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "TMPDIR") or k.startswith("COV_CORE_")}
    return {**keep, **extra}


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, real_model_path) -> Path:
    return write_tiny_text_model(tmp_path_factory.mktemp("tiny-no-preload"), real_model_path)


def serve_and_feed(model: Path, env: dict[str, str], log: Path) -> tuple[pb.GetModelInfoResponse, list, str]:
    """Start `serve` with `env`, feed FEED in each of CHUNKINGS and generate 12 greedy tokens after each.

    Returns:
        (GetModelInfo, [(state digest, tokens) per chunking], the server's log).
    """
    cmd = [sys.executable, "-m", "inference_engine", "serve", "--port", "0", "--model", str(model),
           "--weights", "fp32", "--draft-model", "none", "--max-sessions", "2", "--default-window", "256"]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            with grpc.insecure_channel(wait_ready(proc)) as channel:
                stub = pb_grpc.RuntimeServiceStub(channel)
                info = stub.GetModelInfo(pb.GetModelInfoRequest())
                results = []
                for sizes in CHUNKINGS:
                    sid = stub.CreateSession(pb.CreateSessionRequest()).session_id
                    at = 0
                    for n in sizes:
                        stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=FEED[at : at + n]))
                        at += n
                    digest = stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid)).state_digest
                    tokens = [t for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=12,
                                                                          ignore_eos=True)) for t in m.tokens]
                    results.append((digest, tokens))
                    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return info, results, log.read_text()


@linux_openblas
def test_a_clean_environment_serves_exact_and_equals_a_preloaded_run(tiny_model_dir, tmp_path):
    info, clean, log = serve_and_feed(tiny_model_dir, clean_env(), tmp_path / "clean.log")
    assert info.exact and info.block_size == 64, (info, log)
    assert info.kernels.startswith("exact-gemm kernel 3 (") and info.kernels.endswith(EXACT_SUFFIX), info.kernels
    assert "exact mode: block size 64" in log and f"exact at block size 64, {info.kernels}" in log
    assert "BLAS in use: reference" in log  # nothing preloaded, no re-exec: MLX's own BLAS is the one mapped
    assert len({r[0] for r in clean}) == 1 and len({tuple(r[1]) for r in clean}) == 1  # every chunking, one state

    preloaded_info, preloaded, plog = serve_and_feed(tiny_model_dir, clean_env(INFERENCE_ENGINE_OPENBLAS="1"),
                                                     tmp_path / "preloaded.log")
    assert "BLAS in use: openblas" in plog and "+ exact-gemm kernel 3" in plog  # the launcher re-exec'd, preloaded
    assert preloaded_info.kernels == info.kernels and preloaded_info.block_size == 64
    assert preloaded == clean  # the same digests and tokens, bit for bit
