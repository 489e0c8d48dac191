"""Real `shard-worker` processes: a head/middle/tail route of the packaged SmolLM2-135M is
bitwise the single-process verifier (chunk edges, window wrap, a trim); SIGTERM exits 0."""

import signal
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.shard.client.pipeline import ShardPipeline
from inference_engine.execution.kv_cache import CacheGeometry
from inference_engine.verifier.sink_window_verifier import state_digest
from tests.shard_helpers import ref_block, reference, running_workers, spawn_worker

pytestmark = pytest.mark.real_model
SINK, WINDOW, ROLLBACK = 4, 24, 8


def _spawn(layers: str, *flags: str, module: str = "inference_engine") -> subprocess.Popen:
    return spawn_worker(layers, *flags, rollback=ROLLBACK, stderr=subprocess.PIPE, module=module)


@pytest.fixture(scope="module")
def workers(real_model_path):
    middle = _spawn("10:20", "--inject-faults", "delay=0", module="tests.fixtures.fault_worker")
    with running_workers([_spawn("0:10"), middle, _spawn("20:30")]) as w:
        yield w


async def test_three_worker_route_is_bitwise_the_single_process(workers, real_model, real_engine):
    _, addresses = workers
    tokens = np.random.default_rng(5).integers(0, real_model.spec.vocab_size, 100).tolist()
    async with ShardPipeline(addresses) as route:
        assert [str(c.layers) for c in route.capabilities] == ["0:10", "10:20", "20:30"]
        assert real_engine.block <= route.max_block
        geometry = await route.open("exact", SINK, WINDOW, max_block=real_engine.block)
        assert geometry == CacheGeometry(SINK, WINDOW, real_engine.block, ROLLBACK)
        ref, position = reference(real_model, geometry), 0
        # (block, keep): a prefill, decode rows, blocks longer than the tile, and a draft of 8
        # of which 3 are kept (trim 5) after the window has wrapped.
        plan = [(20, None), (1, None), (1, None), (13, None), (16, None), (8, 3), (1, None), (12, None), (1, None)]
        for n, keep in plan:
            block = tokens[position : position + n]
            all_logits = position > 0
            got = await route.forward("exact", block, all_logits=all_logits)
            want = ref_block(ref, block, all_logits, keep=keep)
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (position, n)
            if keep is not None:
                assert await route.trim("exact", n - keep) == position + keep
            position += n if keep is None else keep
        assert position > SINK + WINDOW + real_engine.block + ROLLBACK  # the ring wrapped
        assert route.position("exact") == ref.next_global_position == position
        digests = await route.layer_digests("exact")
        assert len(digests) == 30 and digests == ref.executor.layer_digests()
        route_digest = state_digest(mx.array(got[-1]), ref.cached_token_sequence, position, digests)
        assert route_digest == ref.state_digest()
        assert await route.release("exact")


def test_workers_exit_0_on_sigterm_and_refuse_bad_ranges(workers, real_model_path):
    procs, _ = workers
    bad = _spawn("25:40")
    for p in procs:
        p.send_signal(signal.SIGTERM)
    errs = []
    for p in procs:
        assert p.wait(timeout=60) == 0
        errs.append(p.stderr.read())
    assert all("BLAS in use" in e and "listening" not in e and "stopped" in e for e in errs)
    assert "TEST FIXTURE" in errs[1] and "TEST FIXTURE" not in errs[0]
    assert bad.wait(timeout=120) == 2
    assert "exceeds the model's 30 layers" in bad.stderr.read()


@pytest.mark.parametrize("command,flags,match", [
    (["inference_engine", "shard-worker"], ["--layers", "5"], "START:END"),
    (["inference_engine", "shard-worker"], ["--layers", "0:2", "--inject-faults", "delay=0"], "unrecognized arguments"),
    (["tests.fixtures.fault_worker"], ["--layers", "0:2", "--inject-faults", "boom=1"], "unknown fault"),
    (["inference_engine", "shard-worker"], ["--layers", "0:2", "--max-credits", "0"], "--max-credits"),
])
def test_bad_flags_are_usage_errors(command, flags, match):
    out = subprocess.run([sys.executable, "-m", *command, *flags], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and match in out.stderr


# A parent that starts a worker tied to it, reports the worker's pid, then dies outright.
_ORPHANING_PARENT = """
import os, subprocess, sys
w = subprocess.Popen([sys.executable, "-m", "inference_engine", "shard-worker", "--layers", "0:1", "--port", "0",
                      "--parent-pid", str(os.getpid())], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
print(w.stdout.readline().strip(), w.pid, flush=True)
os.kill(os.getpid(), 9)
"""


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\tZ" not in next(line for line in f if line.startswith("State:"))  # a zombie has exited
    except (FileNotFoundError, StopIteration):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_worker_tied_to_a_parent_stops_when_the_parent_is_killed(real_model_path):
    import time

    parent = subprocess.run([sys.executable, "-c", _ORPHANING_PARENT], capture_output=True, text=True, timeout=120)
    assert parent.returncode == -signal.SIGKILL
    line, pid = parent.stdout.split()[:-1], int(parent.stdout.split()[-1])
    assert line[:2] == ["listening", "on"], parent.stdout
    deadline = time.monotonic() + 30
    while _is_running(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _is_running(pid), "the worker outlived its killed parent"


def test_parent_pid_must_not_be_negative():
    import argparse

    from inference_engine.shard.worker.config import add_worker_flags, worker_config_from_args

    parser = argparse.ArgumentParser()
    add_worker_flags(parser)
    with pytest.raises(ValueError, match="--parent-pid"):
        worker_config_from_args(parser.parse_args(["--layers", "0:1", "--parent-pid", "-1"]))
