"""WorkerSupervisor's failure paths with real worker processes: no start, failed restarts, stop."""

import asyncio
import socket

import pytest

from inference_engine.shard.client.supervisor import WorkerFlags, WorkerSupervisor

pytestmark = pytest.mark.real_model


def _flags(model: str) -> WorkerFlags:
    return WorkerFlags(host="127.0.0.1", model=model, block=4, max_sessions=1, max_sink=4,
                       max_window=16)


async def test_a_worker_that_cannot_start_fails_the_start(tmp_path):
    sup = WorkerSupervisor(("0:1",), _flags(str(tmp_path / "no-such-model")))
    with pytest.raises(OSError, match=r"shard worker 0:1 did not start \(exit status \d+\)"):
        await sup.start()
    await sup.stop()


async def test_restart_retries_until_the_port_is_free_again(real_model_path):
    sup = WorkerSupervisor(("0:1",), _flags(str(real_model_path)))
    (address,) = await sup.start()
    port = int(address.rsplit(":", 1)[1])
    try:
        first = sup.procs[0]
        first.kill()
        await first.wait()
        with socket.socket() as squatter:  # the restart cannot bind the address until this goes
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            squatter.bind(("127.0.0.1", port))
            squatter.listen()
            await asyncio.sleep(8)  # at least one restart attempt fails meanwhile
            assert sup.restarts == 0
        for _ in range(600):
            if sup.restarts:
                break
            await asyncio.sleep(0.1)
        assert sup.restarts == 1 and sup.procs[0] is not first and sup.procs[0].returncode is None
        assert sup.addresses == [address]  # the same address as before
    finally:
        await sup.stop(grace_s=0)  # no grace: the kill path
    assert sup.procs[0].returncode is not None
