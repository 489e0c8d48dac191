"""Small units: the token log and its watermarks; the readiness line helpers."""

import asyncio
import subprocess
import sys

import pytest

from inference_engine.readiness import address_of, wait_ready, wait_ready_async
from inference_engine.execution.token_log import TokenLog


def test_token_log_extends_truncates_and_lowers_watermarks():
    log = TokenLog([1, 2, 3])
    mark = log.watermark()
    assert mark.valid == 0
    mark.valid = 3
    log.extend([4, 5])
    assert len(log) == 5 and log[1:3] == [2, 3] and log.tail(2) == [4, 5] and log.tail(0) == []
    assert log == [1, 2, 3, 4, 5] and log == TokenLog([1, 2, 3, 4, 5]) and log != TokenLog([1])
    assert repr(log) == "TokenLog(5 tokens)" and list(log) == [1, 2, 3, 4, 5]
    log.truncate(2)
    assert list(log) == [1, 2] and mark.valid == 2
    log.truncate(2)
    with pytest.raises(ValueError, match="cannot truncate a log of 2 tokens to 3"):
        log.truncate(3)


def test_readiness_line():
    assert address_of("listening on 127.0.0.1:5\n") == "127.0.0.1:5" and address_of("loading...") is None
    ok = subprocess.Popen([sys.executable, "-c", "print('warming up'); print('listening on h:1', flush=True)"],
                          stdout=subprocess.PIPE, text=True)
    assert wait_ready(ok) == "h:1"
    ok.wait()
    silent = subprocess.Popen([sys.executable, "-c", "print('no line')"], stdout=subprocess.PIPE, text=True)
    with pytest.raises(OSError, match="did not become ready"):
        wait_ready(silent)


async def test_readiness_line_async():
    ok = await asyncio.create_subprocess_exec(sys.executable, "-c", "print('listening on h:2', flush=True)",
                                              stdout=asyncio.subprocess.PIPE)
    assert await wait_ready_async(ok) == "h:2"
    await ok.wait()
    hung = await asyncio.create_subprocess_exec(sys.executable, "-c", "import time; time.sleep(30)",
                                                stdout=asyncio.subprocess.PIPE)
    with pytest.raises(OSError, match="exit status"):
        await wait_ready_async(hung, timeout_s=0.5)
