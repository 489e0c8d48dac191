"""Large texts are tokenized in tokenizer processes (issue 28, defect 3), on the packaged tokenizer:
the same ids and text as in this process, on both sides of --text-process-chars; only large inputs
go there (the metric counts them); a dead worker is a typed error and then a new worker; closing
joins the workers, and a worker whose server was killed exits by itself."""

import argparse
import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from transformers import AutoTokenizer

from inference_engine import metrics
from inference_engine.config import add_server_flags, config_from_args
from inference_engine.errors import TokenizerUnavailable
from inference_engine.text.codec import TextCodec
from inference_engine.text.tokenizer_processes import TokenizerProcesses
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.fixtures.failing_worker_call import fail_in_the_worker

THRESHOLD = 256
CJK = "漢字かな交じり文、日本語のテキスト。"
MIXED = "Héllo wörld, <|im_start|>user 🎉 naïve café\n\t  spaces " + CJK


def _calls(op: str) -> float:
    return metrics.TOKENIZER_PROCESS_CALLS.labels(op)._value.get()


def _is_gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for a reaper that is not us counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat[stat.rindex(")") + 2] == "Z"


@pytest.fixture(scope="module")
def tokenizer(real_model_path):
    return AutoTokenizer.from_pretrained(real_model_path)


@pytest.fixture(scope="module")
def codecs(tokenizer):
    """The codec with tokenizer processes over THRESHOLD characters, and the in-process one."""
    pooled = TextCodec(tokenizer, THRESHOLD)
    yield pooled, TextCodec(tokenizer)
    pooled.close()


def test_same_ids_and_text_across_the_threshold(codecs):
    pooled, local = codecs
    assert pooled.processes is not None and pooled.processes.pids == ()  # nothing started before a large text
    texts = [(CJK * 40)[:n] for n in (THRESHOLD - 1, THRESHOLD, THRESHOLD + 1)]
    texts += [(MIXED * 400)[:20_000], (CJK * 4000)[:65_536], "short " + CJK]
    large = sum(len(t) >= THRESHOLD for t in texts)
    before = _calls("encode"), _calls("decode")
    for text in texts:
        for special in (False, True):
            ids = pooled.encode(text, add_special_tokens=special)
            assert ids == local.encode(text, add_special_tokens=special)
            for skip in (False, True):
                assert pooled.decode(ids, skip_special_tokens=skip) == local.decode(ids, skip_special_tokens=skip)
    long_ids = local.encode(texts[-2])
    assert len(long_ids) > 100_000 and pooled.decode(long_ids) == texts[-2]  # CJK round trip, ~120 K tokens
    decoded_large = sum(len(local.encode(t, add_special_tokens=s)) >= THRESHOLD for t in texts for s in (False, True))
    assert (_calls("encode") - before[0], _calls("decode") - before[1]) == (2 * large, 2 * decoded_large + 1)
    assert pooled.processes.pids  # the large ones started a worker


def test_small_inputs_stay_in_process(tokenizer):
    codec = TextCodec(tokenizer, THRESHOLD)
    before = _calls("encode"), _calls("decode")
    ids = codec.encode(CJK * 3)
    assert codec.decode(ids) == CJK * 3
    assert (_calls("encode"), _calls("decode")) == before and codec.processes.pids == ()
    codec.close()
    assert TextCodec(tokenizer, 0).processes is None  # 0: everything in this process


def test_a_dead_worker_is_a_typed_error_then_a_new_worker(tokenizer):
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    try:
        text = CJK * 100
        expected = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        assert processes.encode(text, False) == expected
        (dead,) = processes.pids
        os.kill(dead, signal.SIGKILL)
        with pytest.raises(TokenizerUnavailable, match="tokenizer process ended during the call; retry"):
            processes.encode(text, False)
        assert processes.encode(text, False) == expected
        assert processes.pids and dead not in processes.pids
    finally:
        processes.close()


def test_a_worker_that_died_idle_is_replaced_after_one_refused_call(tokenizer):
    """A worker killed between calls, its death seen by the pool before the next submit: that call is
    UNAVAILABLE and the one after works (the old code kept the broken pool: every later call refused)."""
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    try:
        text = CJK * 100
        expected = processes.encode(text, False)
        pool = processes._pool
        (dead,) = processes.pids
        os.kill(dead, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not pool._broken and time.monotonic() < deadline:  # the pool's own thread notices the death
            time.sleep(0.01)
        assert pool._broken
        with pytest.raises(TokenizerUnavailable, match="tokenizer process ended during the call; retry"):
            processes.encode(text, False)  # refused by the broken pool's submit
        assert processes.encode(text, False) == expected
        assert processes.pids and dead not in processes.pids
    finally:
        processes.close()


def test_close_joins_the_workers_and_refuses_later_calls(tokenizer):
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    processes.encode(CJK * 100, False)
    pids = processes.pids
    assert pids and not any(_is_gone(p) for p in pids)
    processes.close()
    assert all(_is_gone(p) for p in pids) and processes.pids == ()
    with pytest.raises(TokenizerUnavailable, match="shutting down"):
        processes.encode(CJK * 100, False)
    processes.close()  # idempotent


def test_close_lets_a_running_call_finish(tokenizer):
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    text = CJK * 20_000  # ~0.3 M characters: the call is still running when close() starts
    expected = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    with concurrent.futures.ThreadPoolExecutor(1) as caller:
        call = caller.submit(processes.encode, text, False)
        while not call.done() and not getattr(processes._pool, "_pending_work_items", None):
            time.sleep(0.005)  # until the text is in a worker
        pids = processes.pids
        processes.close()
        assert call.result() == expected
    assert all(_is_gone(p) for p in pids)


def test_a_call_racing_close_is_refused(tokenizer):
    """A call that got the pool just before close() submits to a shut pool: refused, typed."""
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    pool = processes._executor()
    processes.close()
    processes._executor = lambda: pool  # the race's interleaving, made certain
    with pytest.raises(TokenizerUnavailable, match="shutting down"):
        processes.encode(CJK * 100, False)


def test_a_call_racing_a_discarded_pool_is_unavailable(tokenizer):
    """A call that got the pool just before another call discarded it (broken) submits to a shut pool:
    TokenizerUnavailable, not the pool's RuntimeError; the next call gets a new pool."""
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    try:
        pool = processes._executor()
        processes._discard(pool)
        executor = processes._executor
        processes._executor = lambda: pool  # the race's interleaving, made certain
        with pytest.raises(TokenizerUnavailable, match="ended during the call; retry"):
            processes.encode(CJK * 100, False)
        processes._executor = executor
        text = CJK * 100
        assert processes.encode(text, False) == tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        processes.close()


def test_a_workers_own_runtime_error_is_not_taken_for_a_lost_pool(tokenizer):
    """A RuntimeError raised by the worker's code stays itself, even when the pool was replaced meanwhile
    (the old mapping read that as a shut pool: TokenizerUnavailable)."""
    processes = TokenizerProcesses(tokenizer.backend_tokenizer, THRESHOLD)
    try:
        pool = processes._executor()
        processes._executor = lambda: pool
        processes._pool = None  # another call replaced it while this one ran
        with pytest.raises(RuntimeError, match="the worker's own failure"):
            processes._call("encode", fail_in_the_worker)
    finally:
        pool.shutdown()
        processes.close()


WORKER_OF_A_KILLED_SERVER = """
import os, signal, sys
from tokenizers import Tokenizer
from inference_engine.text.tokenizer_processes import TokenizerProcesses
if __name__ == "__main__":
    processes = TokenizerProcesses(Tokenizer.from_file(sys.argv[1]), 1)
    processes.encode("x" * 10, False)
    print(*processes.pids, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # no shutdown, no atexit
"""


def test_a_worker_outlives_no_killed_server(real_model_path, tmp_path):
    script = tmp_path / "killed_server.py"
    script.write_text(WORKER_OF_A_KILLED_SERVER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, str(script), str(real_model_path / "tokenizer.json")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == -signal.SIGKILL, out.stderr
    (pid,) = (int(p) for p in out.stdout.split())
    deadline = time.monotonic() + 120  # a bound on the wait, not a timing verdict: it exits within PARENT_POLL_S
    while not _is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _is_gone(pid)


async def test_tokenize_rpcs_through_the_processes(real_engine, tokenizer):
    """A served Tokenize/Detokenize of a large text goes through a worker (same ids); a dead worker is
    UNAVAILABLE and the next call works; the server's stop joins the workers."""
    text = (CJK * 200)[:2000]
    expected = tokenizer.encode(text, add_special_tokens=False)
    async with running_server(real_engine, text_process_chars=THRESHOLD) as (stub, runtime):
        before = _calls("encode")
        assert list((await stub.Tokenize(pb.TokenizeRequest(text=text))).tokens) == expected
        assert _calls("encode") == before + 1
        assert (await stub.Detokenize(pb.DetokenizeRequest(tokens=expected))).text == text
        (dead,) = runtime.text.processes.pids
        os.kill(dead, signal.SIGKILL)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(pb.TokenizeRequest(text=text))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "tokenizer process ended" in err.value.details()
        info = next(d for d in rpc_status.from_call(err.value).details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR))
        reason = error_details_pb2.ErrorInfo()
        info.Unpack(reason)
        assert reason.reason == "TOKENIZER_UNAVAILABLE"
        assert list((await stub.Tokenize(pb.TokenizeRequest(text=text))).tokens) == expected
        pids = runtime.text.processes.pids
        assert pids
    assert all(_is_gone(p) for p in pids)


async def test_a_large_tokenize_never_holds_its_ids_in_the_server(real_engine, tokenizer, monkeypatch):
    """A large text's Tokenize response is serialized in the worker: the server builds no ids list
    (the old servicer called `encode`, then built the message from the list, on its own GIL)."""
    text = (CJK * 200)[:2000]
    expected = tokenizer.encode(text, add_special_tokens=True)

    def no_ids(*args):
        raise AssertionError("the server built a large text's ids")

    async with running_server(real_engine, text_process_chars=THRESHOLD) as (stub, runtime):
        monkeypatch.setattr(TokenizerProcesses, "encode", no_ids)
        before = _calls("encode")
        reply = await stub.Tokenize(pb.TokenizeRequest(text=text, add_special_tokens=True))
        assert list(reply.tokens) == expected and reply.text == text
        assert _calls("encode") == before + 1
        small = await stub.Tokenize(pb.TokenizeRequest(text=text[:50]))  # in-process, a message as before
        assert list(small.tokens) == tokenizer.encode(text[:50], add_special_tokens=False) and small.text == text[:50]


def test_the_threshold_flag():
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    assert config_from_args(parser.parse_args([])).text_process_chars == 8192
    assert config_from_args(parser.parse_args(["--text-process-chars", "0"])).text_process_chars == 0
    with pytest.raises(ValueError, match="--text-process-chars"):
        config_from_args(parser.parse_args(["--text-process-chars", "-1"]))
