"""The client CLI (`chat`, `generate`) and the packaging that lets a client install only grpc + protobuf."""

import asyncio
import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
import threading
import tomllib
import zipfile
from pathlib import Path

import pytest

from inference_engine.client import cli
from inference_engine.client.client import GenerateSettings, RuntimeClient
from inference_engine.runtime.runtime import Runtime
from inference_engine.server.server import start_server
from tests.conftest import make_config

REPO = Path(__file__).resolve().parents[1]
SERVER_ONLY = ("mlx", "mlx.core", "mlx_lm", "numpy", "transformers", "tokenizers", "gguf", "crc32c")
# Runs `python -m inference_engine ARGS` with the server's packages made unimportable.
CLIENT_ONLY = (
    "import runpy, sys\n"
    f"for m in {SERVER_ONLY!r}: sys.modules[m] = None\n"
    "sys.argv = ['inference_engine', *sys.argv[1:]]\n"
    "runpy.run_module('inference_engine', run_name='__main__')\n"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client_only(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLIENT_ONLY, *args], capture_output=True, text=True, cwd=REPO,
                          timeout=60)


def test_client_commands_need_only_grpc_and_protobuf():
    port = _free_port()  # nothing listens there
    for command in ("generate --prompt hi", "chat"):
        out = _client_only(*command.split(), "--target", f"127.0.0.1:{port}")  # refused: no wait for the timeout
        assert out.returncode == 1 and f"error: connection refused: no server listens at 127.0.0.1:{port}" in out.stderr
        assert "python -m inference_engine serve" in out.stderr
    helped = _client_only("--help")
    assert helped.returncode == 0 and "chat" in helped.stdout and "needs the server install" in helped.stdout
    served = _client_only("serve")
    assert served.returncode == 2 and "pip install 'inference_engine[server]'" in served.stderr


def test_package_declares_client_dependencies_extras_and_console_script(tmp_path):
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert sorted(d.split(">")[0] for d in meta["dependencies"]) == ["grpcio", "protobuf"]
    server = " ".join(meta["optional-dependencies"]["server"])
    assert all(name in server for name in ("mlx", "mlx-lm", "tokenizers", "transformers", "numpy", "gguf"))
    assert meta["scripts"]["inference-engine"] == "inference_engine.__main__:cli"
    src = tmp_path / "src"  # build from a copy: setuptools writes build/ and *.egg-info next to the sources
    for path in ["pyproject.toml", "README.md", *map(str, (REPO / "inference_engine").rglob("*"))]:
        rel = Path(path).relative_to(REPO) if Path(path).is_absolute() else Path(path)
        if (REPO / rel).is_file() and "__pycache__" not in rel.parts:
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((REPO / rel).read_bytes())
    env = {k: v for k, v in os.environ.items() if not k.startswith("COVERAGE")}  # the build would measure the copy
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "out"), str(src)], check=True, capture_output=True, timeout=300, env=env)
    wheel = zipfile.ZipFile(next((tmp_path / "out").glob("inference_engine-*.whl")))
    names = set(wheel.namelist())
    assert {"inference_engine/client/cli.py", "inference_engine/v1/runtime_pb2.py"} <= names
    native = {f"inference_engine/native/{p.name}" for p in (REPO / "inference_engine" / "native").iterdir()}
    assert native <= names and "inference_engine/native/exact_dot.h" in native  # every source the kernels build from
    info = next(n for n in names if n.endswith(".dist-info/METADATA"))
    requires = [line for line in wheel.read(info).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert sorted(r for r in requires if "extra ==" not in r) == [
        "Requires-Dist: grpcio<2,>=1.85.1", "Requires-Dist: protobuf<8,>=7.35.1"]
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "inference-engine = inference_engine.__main__:cli" in wheel.read(entry).decode()


@contextlib.asynccontextmanager
async def _server(engine, **overrides):
    runtime = Runtime(engine, make_config(**overrides))
    server, port = await start_server(runtime, "127.0.0.1", 0)
    try:
        yield f"127.0.0.1:{port}", runtime
    finally:
        await server.stop(0.5)
        await runtime.stop()


async def _cli(*argv: str, lines: list[str] = ()) -> tuple[int, str, str]:
    """Run the CLI on a thread (the server shares this event loop); `lines` are what the user types."""
    out, err, typed = io.StringIO(), io.StringIO(), iter(lines)

    def read(prompt: str) -> str:
        out.write(prompt)
        line = next(typed, None)
        if line is None:
            raise EOFError
        if callable(line):
            return line()
        return line

    rc = await asyncio.to_thread(cli.main, list(argv), out, err, read)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.real_model
async def test_generate_and_chat_against_a_server(real_engine, tmp_path):
    async with _server(real_engine, default_window=256) as (target, runtime):
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "What is the capital of France?",
                                  "--json", "--logprobs", "2", "--max-new-tokens", "12")
        result = json.loads(out)
        assert rc == 0 and "Paris" in result["text"] and len(result["tokens"]) <= 12
        assert result["stop_reason"] in ("EOS", "MAX_TOKENS")
        assert result["usage"]["generated_tokens"] == len(result["tokens"])
        assert [lp["token"] for lp in result["logprobs"]] == result["tokens"]
        assert len(result["logprobs"][0]["top"]) == 2
        assert result["prompt_tokens"] == result["usage"]["prompt_tokens"] == len(result["prompt_token_ids"])
        assert result["history_length"] == result["prompt_tokens"] + len(result["tokens"])
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "The capital of France is", "--raw",
                                  "--stop", " is", "--max-new-tokens", "8", "--stats", "--temperature", "0.5",
                                  "--seed", "3")
        assert rc == 0 and out.endswith("\n") and " is" not in out and "STOP_STRING" in err and "seed 3" in err
        # --stats times what the user waited for: the turn's append, then the first token after it
        waited = re.search(r"first token (\d+) ms after sending the turn \(prompt appended in (\d+) ms\), "
                           r"(\d+) ms of it in Generate", err)
        assert waited is not None and int(waited[1]) >= int(waited[2]) > 0, err
        assert int(waited[1]) >= int(waited[3]), err  # the server's figure counts from the Generate call only
        schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 16}},
                  "required": ["capital"], "additionalProperties": False}
        schema_file = tmp_path / "capital.json"
        schema_file.write_text(json.dumps(schema))
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "What is the capital of France?",
                                  "--json", "--json-schema", str(schema_file), "--max-new-tokens", "24")
        result = json.loads(out)
        assert rc == 0 and result["stop_reason"] == "CONSTRAINT_COMPLETE" and set(json.loads(result["text"])) == {"capital"}
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "Pick a number.", "--regex", "[0-9]{2}")
        assert rc == 0 and re.fullmatch(r"[0-9]{2}\n", out), out
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "hi", "--regex", "[a-")
        assert rc == 1 and "INVALID_ARGUMENT: constraint.regex is invalid" in err
        rc, out, err = await _cli("generate", "--target", target, "--prompt", "hi", "--temperature", "200")
        assert rc == 1 and "error: INVALID_ARGUMENT: GenerateRequest.temperature = 200.0" in err
        rc, out, err = await _cli("chat", "--target", target, "--max-new-tokens", "16", "--system", "Be brief.",
                                  lines=["/help", "/nope", "What is the capital of France?", "", "/reset",
                                         "And of Italy?", "/quit"])
        assert rc == 0 and "Paris" in out and "[new conversation]" in err and "connected to" in err
        assert out.count("> ") == 7 and runtime.store.slabs_in_use == 0  # every session closed
        assert "/reset" in err and "start a new conversation" in err  # /help listed the commands ...
        assert "[unknown command /nope; /help lists the commands]" in err  # ... and neither went to the model
        info = runtime.engine
        assert f"(fp32), exact at block {info.block}" in err.splitlines()[0]  # the banner: weights, mode, block

        def ctrl_c() -> str:
            raise KeyboardInterrupt

        rc, out, err = await _cli("chat", "--target", target, lines=[ctrl_c])  # Ctrl-C at the prompt leaves
        assert rc == 0 and runtime.store.slabs_in_use == 0
    async with _server(real_engine, default_window=256, session_ttl_s=0.3) as (target, runtime):
        def later() -> str:
            import time

            time.sleep(1.0)  # the server expires the idle session meanwhile
            return "And of Italy?"

        rc, out, err = await _cli("chat", "--target", target, "--max-new-tokens", "6", "--stats",
                                  lines=["What is the capital of France?", later])
        assert rc == 0 and "session expired" in err and err.count("tokens, ") == 2


@pytest.mark.parametrize("flag,value", [("--seed", "-1"), ("--max-new-tokens", "-1"), ("--top-k", "-5"),
                                        ("--logprobs", "4294967296"), ("--seed", "x"), ("--connect-timeout", "-1"),
                                        ("--connect-timeout", "0"), ("--connect-timeout", "nan")])
def test_out_of_range_numbers_are_usage_errors(capsys, flag, value):
    """A number no request field can hold is argparse's error (exit 2), never a protobuf traceback."""
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--prompt", "hi", flag, value])
    assert done.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["--json-schema", "/nonexistent/schema.json"], "argument --json-schema: cannot read /nonexistent/schema.json: "
                                                    "No such file or directory"),
    (["--json-schema", "/"], "argument --json-schema: cannot read /: Is a directory"),
    (["--logprobs", "2"], "--logprobs N needs --json"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_flags_that_cannot_work_are_usage_errors_of_the_command(capsys, argv, says):
    """Refused before connecting (exit 2, no traceback), with the command's own usage line."""
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--prompt", "hi", "--target", f"127.0.0.1:{_free_port()}", *argv])
    err = capsys.readouterr().err
    assert done.value.code == 2 and says in err and "Traceback" not in err
    assert err.startswith("usage: python -m inference_engine generate ")


@pytest.mark.real_model
async def test_chat_goes_on_after_a_refused_turn_and_checks_its_flags_first(real_engine):
    """A line the server refuses is reported and changes nothing; the next line is answered in the same
    conversation. Flags over the server's limits are refused before the first turn (exit 2)."""
    async with _server(real_engine, default_window=256, max_text_chars=64, max_new_tokens=32) as (target, runtime):
        rc, out, err = await _cli("chat", "--target", target, "--max-new-tokens", "8",
                                  lines=["x" * 65, "What is the capital of France?", "/quit"])
        assert rc == 0 and "[not sent: INVALID_ARGUMENT: " in err and "--max-text-chars" in err
        assert "Paris" in out and runtime.store.slabs_in_use == 0
        for flags, says in ((["--max-new-tokens", "33"], "--max-new-tokens 33 is over the server's limit of 32"),
                            (["--logprobs", "21", "--json", "--prompt", "hi"], "--logprobs 21 is over the server's "
                                                                               "limit of 20")):
            command = "generate" if "--prompt" in flags else "chat"
            rc, out, err = await _cli(command, "--target", target, *flags, lines=["never read"])
            assert rc == 2 and says in err and "> " not in out
        assert runtime.store.slabs_in_use == 0


@pytest.mark.real_model
async def test_an_append_waits_for_the_cancelled_reply_before_it(real_engine):
    """Ctrl-C on a reply, then the next line at once: the append finds the session still busy with the
    reply (ABORTED until its cancellation lands) and retries instead of failing the chat."""
    async with _server(real_engine, default_window=256) as (target, runtime):
        def chat_turns() -> tuple[int, int, int]:
            client = RuntimeClient(target)
            sid = client.create_session()
            first = client.append_text(sid, "Once upon a time").history_length
            stream = client.generate(sid, GenerateSettings(max_new_tokens=400, ignore_eos=True))
            got = len(next(stream).tokens)
            cancel = threading.Timer(0.5, stream.cancel)  # the user's Ctrl-C lands while the append waits
            cancel.start()
            appended = client.append_text(sid, " The end.")  # ABORTED until then: retried
            cancel.join()
            client.close_session(sid)
            client.close()
            return first, got, appended.history_length - len(appended.tokens)

        first, got, before_append = await asyncio.to_thread(chat_turns)
        assert got >= 1 and first + got <= before_append < first + 400  # the reply was cut, then the line went in
        assert runtime.store.slabs_in_use == 0
