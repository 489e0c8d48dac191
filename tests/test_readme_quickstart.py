"""The README's quick start, run as typed: set-up, `serve`, `chat` (its transcript), the `generate` examples.

Only the environment differs: $INFERENCE_ENGINE_ADDRESS points `serve` and the client at a free
port, so the test never collides with a server already on 127.0.0.1:50051.
"""

import json
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.real_model
REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _fenced_after(marker: str, lang: str) -> list[str]:
    """Lines of the first ```lang block after the `<!-- marker` comment."""
    start = README.index(f"<!-- {marker}")
    block = re.search(rf"```{lang}\n(.*?)```", README[start:], re.S)
    assert block is not None, marker
    return block.group(1).rstrip("\n").split("\n")


def _transcript() -> tuple[str, list[tuple[str, str]]]:
    """The chat transcript under the quick start: its banner and (typed line, reply) pairs."""
    lines = _fenced_after("quick-start", "text")
    assert lines[0].startswith("$ ") and lines[-1] == "> /quit"
    turns: list[tuple[str, list[str]]] = []
    for line in lines[2:-1]:
        if line.startswith("> "):
            turns.append((line[2:], []))
        else:
            turns[-1][1].append(line)
    return lines[1], [(typed, "\n".join(reply)) for typed, reply in turns]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_quick_start_runs_as_typed(tmp_path):
    setup, serve, chat = _fenced_after("quick-start", "bash")
    banner, turns = _transcript()
    assert chat.split("#")[0].strip() == _fenced_after("quick-start", "text")[0][2:]
    address = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, INFERENCE_ENGINE_ADDRESS=address)
    run = dict(shell=True, cwd=REPO, env=env, capture_output=True, text=True, executable="/bin/bash")
    done = subprocess.run(setup, **run, timeout=900)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(serve, shell=True, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                              executable="/bin/bash", start_new_session=True)
    try:
        assert server.stdout.readline().strip() == f"listening on {address}", (tmp_path / "serve.log").read_text()
        typed = "".join(f"{t}\n" for t, _ in turns) + "/quit\n"
        talk = subprocess.run(chat, input=typed, **run, timeout=600)
        assert talk.returncode == 0, talk.stderr
        assert talk.stdout == "".join(f"> {reply}\n" for _, reply in turns) + "> "
        assert talk.stderr.strip() == banner.replace("127.0.0.1:50051", address)
        plain, sampled = _fenced_after("cli-example", "bash")
        once = subprocess.run(plain, **run, timeout=600)
        assert once.returncode == 0 and once.stdout.strip() and once.stdout.endswith("\n"), once.stderr
        one = json.loads(subprocess.run(sampled, **run, timeout=600).stdout)
        again = json.loads(subprocess.run(sampled, **run, timeout=600).stdout)
        assert one["seed"] == 42 and one["tokens"] == again["tokens"] and one["text"] == again["text"]
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the group this test started: bash and the server
        rc = server.wait(timeout=60)
        log.close()
    assert rc == 0, (tmp_path / "serve.log").read_text()
