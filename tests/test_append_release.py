"""An append's undo point dies with its reply (issue 33's memory transient).

An AppendTokens call of more tokens than the rollback room copies the session's whole K/V (and
its next-token logits) as the point to undo to if the caller goes away before taking the result.
Once the caller has taken it, nothing may keep that copy alive: it lived on in the ended job,
which the engine loop drops only at its next iteration, so a read of the process's MLX memory
just after the reply (test_real_model's flat-memory test, under a CPU hog) saw the session's slab
twice: 3,007,488 bytes on the packaged model (61 slots x 30 layers of K/V, and a logits row).
"""

import mlx.core as mx
import numpy as np

from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

APPEND = 32  # tokens per call: past the tiny engine's --max-rollback of 8, so every call copies the slab


async def test_an_appends_reply_leaves_no_copy_of_the_slab_alive(tiny_engine):
    rng = np.random.default_rng(5)
    async with running_server(tiny_engine) as (stub, _):
        sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=4, window_tokens=256))).session_id

        async def append() -> None:
            tokens = rng.integers(0, 256, APPEND).tolist()
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=tokens))

        async def engine_round() -> pb.GetSessionInfoResponse:
            return await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))

        await append()  # an empty session is rebuilt for free: the first call copies nothing
        slab = (await engine_round()).kv_bytes
        for _ in range(3):
            await append()
            at_reply = mx.get_active_memory()
            await engine_round()  # the engine loop has gone round after the append ...
            await engine_round()  # ... and after that round (each call runs in a later iteration)
            settled = mx.get_active_memory()
            assert at_reply - settled < slab, (at_reply, settled, slab)
