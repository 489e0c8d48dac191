"""Copies of a chat session on the packaged SmolLM2-135M render the next chat turn as the original:
after a reply that ended on EOS and after one cut by max_new_tokens, a fork, a restore and a
`--persist-sessions` restart append the same tokens, generate the same tokens and reach the same
state_digest as the original given the same next turn (the chat log travels in the snapshot)."""

import pytest

from inference_engine.client.snapshots import restore_bytes, snapshot_bytes
from inference_engine.runtime.persistence import open_persistence
from inference_engine.runtime.session_transfer import SessionTransfer
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"  # answered in under 40 tokens, ending on EOS
NEXT = pb.ChatMessage(role="user", content="And of Italy?")


async def _generate(stub, sid: str, n: int) -> tuple[list[int], int]:
    msgs = [m async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n))]
    return [t for m in msgs for t in m.tokens], msgs[-1].stop_reason


async def _next_turn(stub, sid: str) -> tuple[list[int], list[int], str]:
    """The same next chat turn and reply on `sid`: (appended tokens, generated tokens, state digest)."""
    r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[NEXT], add_generation_prompt=True))
    generated, _ = await _generate(stub, sid, 8)
    info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
    return list(r.tokens), generated, info.state_digest


@pytest.mark.parametrize("budget,stop,closure", [
    (40, pb.STOP_REASON_EOS, "\n<|im_start|>user"),  # after an EOS the template still writes "\n"
    (4, pb.STOP_REASON_MAX_TOKENS, "<|im_end|>\n<|im_start|>user"),  # a cut reply is closed first
])
async def test_fork_restore_and_restart_continue_a_chat_as_the_original(real_engine, tmp_path, budget, stop,
                                                                         closure):
    async with running_server(real_engine, default_window=256) as (stub, runtime):
        persistence = await open_persistence(SessionTransfer(runtime), tmp_path, 1, 0)
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        await stub.AppendTokens(pb.AppendTokensRequest(
            session_id=sid, messages=[pb.ChatMessage(role="user", content=QUESTION)], add_generation_prompt=True))
        assert (await _generate(stub, sid, budget))[1] == stop
        fork = await stub.ForkSession(pb.ForkSessionRequest(session_id=sid))
        restored = await restore_bytes(stub, await snapshot_bytes(stub, sid))
        assert fork.state_digest == restored.state_digest
        await persistence.close()  # every file holds its session as it is now, before the next turn
        want = await _next_turn(stub, sid)
        text = (await stub.Detokenize(pb.DetokenizeRequest(tokens=want[0]))).text
        assert text.startswith(closure) and want[2] != fork.state_digest
        assert await _next_turn(stub, fork.session_id) == want
        assert await _next_turn(stub, restored.session_id) == want
    async with running_server(real_engine, default_window=256) as (stub, runtime):  # a restart
        persistence = await open_persistence(SessionTransfer(runtime), tmp_path, 1, 0)
        assert len(runtime.store.sessions()) == 3
        assert await _next_turn(stub, sid) == want
        await persistence.close()
