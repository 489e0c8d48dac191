"""Issue 28, defect 6: the route authenticates its spawned workers before it sends anything.

Real `shard-worker` processes (a tiny 2-layer model over the packaged tokenizer, so they load
in a second), real grpc.aio servers on loopback. A rogue listener bound on a killed worker's
port receives nothing (the reliability section, with its plaintext control that does leak the
token); a relay in the middle carries a Generate, but only ciphertext: no token and no prompt
token id in what it saw, while the same relay on a plaintext route sees both (the control).
The streams and digests through the authenticated route are bitwise the single process's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
from pathlib import Path
from typing import AsyncIterator

import pytest

from inference_engine.model.loader import LoadedModel, load_model
from inference_engine.runtime.engine import Engine
from inference_engine.security.settings import ClientSecurity
from inference_engine.security.spawn_pki import make_spawn_pki
from inference_engine.shard.client.route import ShardRoute
from inference_engine.shard.client.route_backend import RouteBackend
from inference_engine.shard.client.supervisor import WorkerFlags, WorkerSupervisor
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.shard_helpers import running_workers, spawn_worker
from tests.tiny_text_model import write_tiny_text_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the battery's package

from reliabilitykit.hostile_peers import Relay, RogueListener, varint_ids  # noqa: E402
from reliabilitykit.rogue_worker import FIRST, RogueFindings, judge, layer_ranges, run_rogue_worker  # noqa: E402
from reliabilitykit.report import SectionReport  # noqa: E402

pytestmark = pytest.mark.real_model  # the packaged tokenizer
PROMPT = [31337, 4242, 27182, 16180, 14142, 17320, 22360, 26457, 1, 2, 3, 4]
TOKEN = "relay-control-token-" + "0123456789abcdef"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, real_model_path: Path) -> Path:
    return write_tiny_text_model(tmp_path_factory.mktemp("tiny-shard-model"), real_model_path)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_dir: Path) -> LoadedModel:
    return load_model(tiny_dir)


def _engine(loaded: LoadedModel) -> Engine:
    return Engine(loaded, exact=True, max_tile=16, plain_block=64, max_rollback=8)


async def _run(stub) -> tuple[list[int], str]:
    """A session through a window wrap: its Generate stream and final digest."""
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=16))).session_id
    await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=PROMPT))
    tokens: list[int] = []
    async for msg in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=12, ignore_eos=True)):
        tokens += msg.tokens
    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
    return tokens, info.state_digest


@contextlib.asynccontextmanager
async def _route_engine(loaded: LoadedModel, addresses: list[str], security: ClientSecurity) -> AsyncIterator[Engine]:
    route = ShardRoute(addresses, 5.0, retry_interval_s=0.1, channel_security=security)
    engine = _engine(loaded)
    try:
        await route.start()
        engine.use_backend(RouteBackend(route, loaded.spec, engine.block))
        yield engine
    finally:
        route.is_closed = True
        await asyncio.to_thread(engine.close)
        await route.stop()


@contextlib.asynccontextmanager
async def _relayed(upstream: str) -> AsyncIterator[Relay]:
    relay = Relay(upstream)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.stop()


@pytest.fixture(scope="module")
def single_process(tiny_loaded) -> tuple[list[int], str]:
    async def run() -> tuple[list[int], str]:
        engine = _engine(tiny_loaded)
        try:
            async with running_server(engine) as (stub, _):
                return await _run(stub)
        finally:
            engine.close()

    return asyncio.run(run())


async def test_a_relay_before_a_spawned_worker_sees_only_ciphertext(tiny_dir, tiny_loaded, single_process):
    """route -> relay -> the real head worker: the Generate goes through (bitwise the single process), and
    the bytes the relay carried hold neither the bearer token nor the prompt's token ids."""
    engine = _engine(tiny_loaded)
    flags = WorkerFlags(host="127.0.0.1", model=str(tiny_dir), block=engine.block, max_sessions=4, max_sink=64,
                        max_window=256, weights="fp32")
    engine.close()
    sup = WorkerSupervisor(tuple(layer_ranges(str(tiny_dir)).split(",")), flags)
    head, tail = await sup.start()
    try:
        security = sup.client_security
        async with _relayed(head) as relay:
            async with _route_engine(tiny_loaded, [f"127.0.0.1:{relay.port}", tail], security) as routed, \
                    running_server(routed) as (stub, _):
                assert await _run(stub) == single_process
        assert len(relay.sent) > 1000 and len(relay.answered) > 1000  # the whole session went through it
        assert relay.sent[:1] == b"\x16"  # a TLS handshake record, not HTTP/2's preface
        assert not relay.holds(security.token.encode()) and b"authorization" not in relay.sent
        assert not relay.holds(varint_ids(PROMPT))
    finally:
        await sup.stop()


async def test_control_a_relay_before_a_plaintext_worker_reads_the_token_and_the_prompt(
        tiny_dir, tiny_loaded, single_process, tmp_path):
    """The same relay on a route of `--shards`-style workers that only require a token over plaintext
    (what spawned workers were before issue 28): it reads the token and the prompt's ids."""
    token_file = tmp_path / "tokens.txt"
    token_file.write_text(TOKEN + "\n")
    workers = [spawn_worker(r, "--model", str(tiny_dir), "--auth-token-file", str(token_file))
               for r in layer_ranges(str(tiny_dir)).split(",")]
    with running_workers(workers) as (_, (head, tail)):
        async with _relayed(head) as relay:
            async with _route_engine(tiny_loaded, [f"127.0.0.1:{relay.port}", tail], ClientSecurity(token=TOKEN)) \
                    as routed, running_server(routed) as (stub, _):
                assert await _run(stub) == single_process
    assert relay.holds(TOKEN.encode()) and relay.holds(varint_ids(PROMPT))


async def test_rogue_listener_on_a_killed_spawned_workers_port_receives_nothing(tiny_dir, tmp_path):
    """The battery's section with real servers: `--spawn-shards` sends the rogue nothing and recovers when it
    leaves; its control (`--shards` over plaintext with a token) shows the same rogue does get the token."""
    flags = ["--model", str(tiny_dir), "--max-sessions", "4", "--draft-model", "none"]
    report = await run_rogue_worker(flags, str(tiny_dir), tmp_path)
    assert report.passed, report.failures
    spawned, control = report.numbers["spawned"], report.numbers["plaintext_control"]
    assert spawned["code_while_held"] == "UNAVAILABLE" and spawned["rogue_calls"] == spawned["rogue_bytes"] == 0
    assert not spawned["token_leaked"] and not spawned["ids_leaked"] and spawned["recovered"]
    assert control["token_leaked"] and control["authorization_seen"] and control["rogue_calls"] > 0


def test_the_section_fails_on_a_route_that_leaks():
    """The findings of the old spawned route (issue 28's probe) fail the section; a control that leaks
    nothing fails it too (it would prove nothing)."""
    leaky = RogueFindings("spawned", code_while_held="UNAVAILABLE", rogue_calls=75, rogue_methods=["GetCapability"],
                          token_leaked=True, authorization_seen=True, recovered=True, history_after=len(FIRST) + 3)
    report = judge(SectionReport("rogue_worker"), leaky, leaky)
    assert not report.passed and report.failed == 2
    assert any("no bearer token" in f for f in report.failures)
    silent = RogueFindings("spawned", code_while_held="UNAVAILABLE", recovered=True, history_after=len(FIRST) + 3)
    report = judge(SectionReport("rogue_worker"), silent, silent)
    assert report.failed == 1 and report.failures[0].startswith("negative control")


def test_layer_ranges_split_the_model_in_two(tiny_dir):
    assert layer_ranges(str(tiny_dir)) == "0:1,1:2"
    assert layer_ranges(None) == "0:15,15:30"


def test_spawn_pki_names_the_workers_host_and_never_overwrites(tmp_path):
    from cryptography import x509

    pki = make_spawn_pki(tmp_path, "shard-host.internal")
    names = x509.load_pem_x509_certificate(pki.worker_cert.read_bytes()).extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert names == ["localhost", "shard-host.internal"]
    with pytest.raises(FileExistsError):  # a second CA in the same folder would replace the pinned one
        make_spawn_pki(tmp_path, "127.0.0.1")


async def test_rogue_listener_gives_up_on_a_port_in_use():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        rogue = RogueListener()
        with pytest.raises(OSError, match="could not bind"):
            await rogue.start(holder.getsockname()[1], wait_s=0.05)
        await rogue.stop()


async def test_relay_to_a_closed_port_drops_the_connection():
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        closed = free.getsockname()[1]
    async with _relayed(f"127.0.0.1:{closed}") as relay:
        reader, writer = await asyncio.open_connection("127.0.0.1", relay.port)
        writer.write(b"hello")
        assert await reader.read() == b""
        writer.close()
    assert relay.sent == b""
