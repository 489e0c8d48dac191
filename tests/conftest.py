"""Shared fixtures: a tiny random model, the packaged real model, in-process servers."""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import AsyncIterator, Iterator

import grpc
import pytest

from inference_engine.config import ServerConfig, default_cache_dir
from inference_engine.model.loader import LoadedModel, load_model
from inference_engine.model.packaged import ensure_packaged_model
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.runtime import Runtime
from inference_engine.server.server import start_server
from inference_engine.v1 import runtime_pb2_grpc as pb_grpc
from tests.kernel_guard import assert_full_tile, bind_test_kernels
from tests.tiny_models import random_model

_ARITHMETIC: dict[str, str] = {}  # which path this run tests (pytest_report_header shows it)


def pytest_configure(config: pytest.Config) -> None:
    """Bind the native kernels before any forward, as servers and workers do at start (so in-process
    references and servers compute the same bits); on Linux a kernel that does not bind stops the run.

    Raises:
        pytest.UsageError: on Linux, the native kernels (or the exact-gemm kernel they compute with) did not bind.
    """
    path, problem = bind_test_kernels()
    if problem:
        raise pytest.UsageError(problem)
    _ARITHMETIC["path"] = path


# A test (setup, call and teardown) still running after this long has hung: the run's stderr gets its
# name and every thread's stack, the main thread a SIGINT (pytest stops there, teardowns run: servers
# are stopped), and the process exits WATCHDOG_GRACE_S later if it is still there, instead of holding
# CI until its own limit with nothing said. Above every test's own inner timeouts (the install tests
# chain 600 s steps); the slowest tests take a few minutes beside two busy loops.
TEST_TIMEOUT_S = float(os.environ.get("INFERENCE_ENGINE_TEST_TIMEOUT_S", "1800"))
WATCHDOG_GRACE_S = 60.0  # after the SIGINT, for teardowns
BACKSTOP_S = 30.0  # faulthandler's own C timer, later still: it fires even while a hung C call holds the GIL


def _run_stderr(config: pytest.Config) -> int:
    """The stderr the run started with (pytest's fd capture holds fd 2 while a test runs)."""
    capman = config.pluginmanager.getplugin("capturemanager")
    saved = getattr(getattr(getattr(capman, "_global_capturing", None), "err", None), "targetfd_save", None)
    return saved if isinstance(saved, int) else 2


def _hung(nodeid: str, fd: int) -> None:
    """The watchdog's end of a hung test: say which, print every thread's stack, interrupt the run."""
    os.write(fd, f"\n[watchdog] {nodeid} still running after {TEST_TIMEOUT_S:g} s "
                 "(INFERENCE_ENGINE_TEST_TIMEOUT_S); every thread's stack:\n".encode())
    faulthandler.dump_traceback(fd, all_threads=True)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    time.sleep(WATCHDOG_GRACE_S)
    os.write(fd, b"[watchdog] the run did not stop after the interrupt; exiting\n")
    os._exit(1)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Arm the hang watchdog (`TEST_TIMEOUT_S`) around one test (its setup, call and teardown); not
    under --pdb, where a developer may sit at a breakpoint."""
    timer = None
    if TEST_TIMEOUT_S > 0 and not item.config.option.usepdb:
        fd = _run_stderr(item.config)
        timer = threading.Timer(TEST_TIMEOUT_S, _hung, (item.nodeid, fd))
        timer.daemon, timer.name = True, "test-watchdog"
        timer.start()
        faulthandler.dump_traceback_later(TEST_TIMEOUT_S + WATCHDOG_GRACE_S + BACKSTOP_S, exit=True, file=fd)
    try:
        return (yield)
    finally:
        if timer is not None:
            timer.cancel()
            faulthandler.cancel_dump_traceback_later()


def pytest_report_header(config: pytest.Config) -> str:
    """Say which arithmetic the batteries test (native kernels, or MLX ops and why)."""
    return f"inference_engine arithmetic: {_ARITHMETIC.get('path', 'not decided')}"


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    """A 2-layer random-weight llama (vocab 256)."""
    return random_model(seed=0)


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """mlx-lm folder of the packaged SmolLM2-135M (fp32), converted once."""
    return ensure_packaged_model(default_cache_dir())


@pytest.fixture(scope="session")
def real_model(real_model_path: Path) -> LoadedModel:
    """The packaged SmolLM2-135M in fp32."""
    return load_model(real_model_path)


@pytest.fixture(scope="session")
def real_engine(real_model: LoadedModel) -> Iterator[Engine]:
    """Exact engine over the real model (shared: probing costs ~0.5 s)."""
    e = assert_full_tile(Engine(real_model, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


def make_config(**overrides: object) -> ServerConfig:
    """A test ServerConfig (port 0, small limits)."""
    base = ServerConfig(port=0, max_sessions=4, default_window=64, session_ttl_s=600.0, grace_s=1.0)
    return dataclasses.replace(base, **overrides)


@contextlib.asynccontextmanager
async def running_server(engine: Engine, **overrides: object) -> AsyncIterator[tuple[pb_grpc.RuntimeServiceStub, Runtime]]:
    """A real grpc.aio server on 127.0.0.1:0 over `engine`; yields an aio stub and the runtime."""
    runtime = Runtime(engine, make_config(**overrides))
    server, port = await start_server(runtime, "127.0.0.1", 0)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield pb_grpc.RuntimeServiceStub(channel), runtime
    finally:
        await channel.close()
        await server.stop(0.5)
        await runtime.stop()


@pytest.fixture(scope="session")
def tiny_engine(tiny: LoadedModel) -> Iterator[Engine]:
    """Exact engine over the tiny model, shared by the server-surface tests."""
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory):
    """A throwaway CA with a server certificate (127.0.0.1, localhost) and two client certificates."""
    from tests.certs import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))
_FINISHED: dict[str, pytest.Session] = {}


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    _FINISHED["session"] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave without C++ static destructors once every report is written, as the server does.

    MLX used from worker threads (the engine's, the shard workers') can abort at interpreter
    exit ("terminate called without an active exception", ml-explore/mlx#3126); by now the
    results, the JUnit XML and the coverage data are all written, so skipping the
    destructors loses nothing, and the exit status is pytest's own.
    """
    session = _FINISHED.get("session")
    if session is None:
        return
    status = int(session.exitstatus)
    if status == 0 and session.testsfailed:  # e.g. coverage under --cov-fail-under
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
