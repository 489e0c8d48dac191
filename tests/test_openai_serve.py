"""`serve --http-port` as a process: the HTTP API beside gRPC on the real model, and its drain on SIGTERM
(a running stream finishes with [DONE], the process exits 0)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from tests.test_readme_quickstart import _free_port

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[1]


def test_serve_with_http_port_answers_and_drains(tmp_path):
    grpc_port, http_port = _free_port(), _free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "inference_engine", "serve", "--port", str(grpc_port), "--http-port", str(http_port),
         "--default-window", "256", "--max-sessions", "4", "--grace", "30", "--draft-model", "none"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        assert server.stdout.readline().strip() == f"listening on 127.0.0.1:{grpc_port}", \
            (tmp_path / "serve.log").read_text()
        base = f"http://127.0.0.1:{http_port}"
        assert httpx.get(f"{base}/health").json() == {"status": "ok"}
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                           max_tokens=4, temperature=0)
        assert r.choices[0].message.content and r.usage.completion_tokens <= 4
        body = {"model": model, "messages": [{"role": "user", "content": "Count to 20."}], "max_tokens": 24,
                "temperature": 0, "stream": True}
        lines = []
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as stream:
            for line in stream.iter_lines():
                if line and not lines:
                    os.killpg(server.pid, signal.SIGTERM)  # drain while the stream runs
                lines.append(line)
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "OpenAI-compatible API on http://127.0.0.1:" in text and "http POST /v1/chat/completions 200" in text
