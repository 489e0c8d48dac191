"""Defects the reliability battery (issue 15) found, each pinned by a deterministic test (tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from inference_engine.errors import InvalidRequest
from inference_engine.runtime.engine import Engine
from inference_engine.runtime.runtime import Runtime
from inference_engine.runtime.types import AppendParams, CreateSessionParams
from inference_engine.text.chat import ChatLog, TextInput, resolve_input
from inference_engine.text.codec import ChatMessage, TextCodec
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import make_config, running_server
from tests.kernel_guard import assert_full_tile
from tests.ops_helpers import rpc_error, serving
from tests.tiny_models import random_model

PROMPT = (5, 17, 33, 2, 250, 9, 9, 120, 64, 3)


def _captured_jobs(engine, monkeypatch) -> list:
    """Every job the engine's scheduler starts from now on (the test's own handle on it)."""
    jobs: list = []
    start = engine.scheduler.start

    def capture(job) -> None:
        jobs.append(job)
        start(job)

    monkeypatch.setattr(engine.scheduler, "start", capture)
    return jobs


async def test_info_never_shows_an_append_whose_caller_left_as_it_completed(tiny_engine, monkeypatch):
    """The caller is cancelled in the instant its append completes: the append is undone, and a
    GetSessionInfo issued right then must not show it (it used to run between the two)."""
    runtime = Runtime(tiny_engine, make_config())
    jobs = _captured_jobs(tiny_engine, monkeypatch)
    sid = (await runtime.create_session(CreateSessionParams((), "", 2, 32))).session_id
    await runtime.append_tokens(AppendParams(sid, PROMPT))
    before = await runtime.session_info(sid)
    task = asyncio.ensure_future(runtime.append_tokens(AppendParams(sid, tuple(range(3, 40)))))
    while len(jobs) < 2 or not jobs[-1].future.done():
        await asyncio.sleep(0)
    task.cancel()  # the caller goes away before it sees the result
    info = await runtime.session_info(sid)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    later = await runtime.session_info(sid)
    assert (info.history_length, info.state_digest) == (before.history_length, before.state_digest)
    assert (later.history_length, later.state_digest) == (before.history_length, before.state_digest)
    await runtime.close_session(sid)


BAD_REQUEST_FIELDS = [  # INVALID_ARGUMENT used to come without a BadRequest for these
    ("AppendTokens", pb.AppendTokensRequest(tokens=[1], add_generation_prompt=True), "add_generation_prompt"),
    ("Generate", pb.GenerateRequest(top_logprobs=1), "top_logprobs"),
    ("Tokenize", pb.TokenizeRequest(text="x", messages=[pb.ChatMessage(role="user")]), "text,messages"),
    ("Tokenize", pb.TokenizeRequest(messages=[pb.ChatMessage(role="user")], add_special_tokens=True),
     "add_special_tokens"),
    ("Tokenize", pb.TokenizeRequest(text="x", add_generation_prompt=True), "add_generation_prompt"),
]


@pytest.mark.parametrize("method,request_,field", BAD_REQUEST_FIELDS)
async def test_every_invalid_argument_names_its_field(tiny_engine, method, request_, field):
    async with serving(tiny_engine) as served:
        stub = served.stub()
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        if hasattr(request_, "session_id"):
            request_.session_id = sid
        call = getattr(stub, method)(request_)
        err = await rpc_error(call.read() if method == "Generate" else call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        bad = error_details_pb2.BadRequest()
        assert any(d.Unpack(bad) for d in rpc_status.from_call(err).details if d.Is(bad.DESCRIPTOR)), err.details()
        assert [v.field for v in bad.field_violations] == [field]


def test_resolved_inputs_name_their_field():
    """Text or messages that encode to too many tokens, or a template that refuses them, name the field."""
    many = SimpleNamespace(encode=lambda text, *a: [7] * 10, has_chat_template=True)
    with pytest.raises(InvalidRequest) as err:
        resolve_input(many, ChatLog(), [], TextInput("x"), (), limit=4)
    assert err.value.field == "text"

    def refuse(*args, **kwargs):
        raise ValueError("roles must alternate")

    codec = TextCodec(SimpleNamespace(backend_tokenizer=None, chat_template="{{ x }}", bos_token_id=None,
                                      apply_chat_template=refuse))
    with pytest.raises(InvalidRequest) as err:
        codec.render([ChatMessage("user", "hi")], True)
    assert err.value.field == "messages"


@pytest.fixture(scope="module")
def draft_engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8,
                                draft=random_model(seed=1)))
    yield e
    e.close()


async def test_a_draft_cache_far_behind_catches_up_a_share_per_step(draft_engine, monkeypatch):
    """The first SPECULATIVE_DRAFT call on a long session computed the whole history into the draft cache in one
    step: every other session's stream stalled meanwhile (297 s for 2,000 tokens on the packaged Q4 draft, found by
    the battery's fuzz as deadlines) and a cancel could not land. It now catches up as an append would, a share of
    a batch per step; the tokens are plain decoding's, and once level it drafts again."""
    rows: list[int] = []
    forward = draft_engine.draft_backend.forward

    def counting(blocks, *args, **kwargs):
        rows.append(sum(len(b.tokens) for b in blocks))
        return forward(blocks, *args, **kwargs)

    monkeypatch.setattr(draft_engine.draft_backend, "forward", counting)
    history = [(7 * i) % 250 + 3 for i in range(80)]
    streams, last = {}, None
    async with running_server(draft_engine) as (stub, _):
        for mode in (pb.DECODE_MODE_GREEDY, pb.DECODE_MODE_SPECULATIVE_DRAFT):
            sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=2, window_tokens=32))).session_id
            await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=history))
            streams[mode] = []
            async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=60, ignore_eos=True, mode=mode,
                                                            num_draft_tokens=4)):
                streams[mode] += m.tokens
                last = m
    assert streams[pb.DECODE_MODE_SPECULATIVE_DRAFT] == streams[pb.DECODE_MODE_GREEDY]
    assert last.drafted_tokens > 0
    assert rows and max(rows) <= (draft_engine.scheduler.append_rows or draft_engine.scheduler.max_rows) < len(history)
