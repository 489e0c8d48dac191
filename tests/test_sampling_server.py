"""Sampling, logprobs, usage and the new request fields over a real grpc.aio server (tiny random model)."""

import asyncio

import grpc
import numpy as np
import pytest

from inference_engine.decoding.logprobs import log_softmax
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.exactness import chunkings
from tests.kernel_guard import tiny_drafted_engine

PROMPT = [5, 17, 33, 2, 250, 9, 9, 120, 64, 3, 5, 17, 33, 2, 250, 9]
SAMPLED = dict(temperature=0.9, top_k=60, top_p=0.95, min_p=0.01, repetition_penalty=1.2, seed=1234)


@pytest.fixture(scope="module")
def engine(tiny):
    e = tiny_drafted_engine(tiny)
    yield e
    e.close()


async def _session(stub, sizes=None, prompt=PROMPT, **kw) -> str:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(sink_tokens=3, window_tokens=8, **kw))).session_id
    i = 0
    for n in sizes or [len(prompt)]:
        await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, tokens=prompt[i : i + n]))
        i += n
    return sid


async def _generate(stub, sid, n, **kw):
    msgs = [m async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, **kw))]
    return [t for m in msgs for t in m.tokens], msgs


async def _bursts(stub, sid, n, width, **kw):
    out = []
    while len(out) < n:
        got, _ = await _generate(stub, sid, min(width, n - len(out)), ignore_eos=True, **kw)
        out += got
    return out


async def _digest(stub, sid):
    return (await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))).state_digest


async def test_seeded_sampling_is_the_same_for_every_chunking_burst_and_mode(engine):
    n = 24
    async with running_server(engine) as (stub, _):
        ref_sid = await _session(stub)
        ref = await _bursts(stub, ref_sid, n, n, **SAMPLED)
        ref_digest = await _digest(stub, ref_sid)
        greedy = await _bursts(stub, await _session(stub), n, n)
        assert ref != greedy  # a real draw, not the argmax
        other = await _bursts(stub, await _session(stub), n, n, **{**SAMPLED, "seed": 99})
        assert other != ref
        for name, sizes in list(chunkings(len(PROMPT), seeds=range(2)).items()):
            for width, mode in [(1, pb.DECODE_MODE_GREEDY), (4, pb.DECODE_MODE_SPECULATIVE_LOOKUP),
                                (32, pb.DECODE_MODE_SPECULATIVE_DRAFT), (3, pb.DECODE_MODE_SPECULATIVE_DRAFT)]:
                sid = await _session(stub, sizes)
                got = await _bursts(stub, sid, n, width, mode=mode, num_draft_tokens=4, **SAMPLED)
                assert got == ref, (name, width, mode)
                assert await _digest(stub, sid) == ref_digest, (name, width, mode)
                await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))


async def test_concurrent_companions_do_not_change_a_stream(engine):
    async with running_server(engine) as (stub, _):
        alone = {s: await _bursts(stub, await _session(stub), 30, 30, **{**SAMPLED, "seed": s}) for s in (1, 2)}
        sids = [await _session(stub), await _session(stub)]
        together = await asyncio.gather(*(_bursts(stub, sid, 30, 5, **{**SAMPLED, "seed": seed})
                                          for sid, seed in zip(sids, (1, 2))))
        assert together == [alone[1], alone[2]]


async def test_temperature_zero_is_plain_greedy_bitwise(engine):
    async with running_server(engine) as (stub, _):
        a, b = await _session(stub), await _session(stub)
        plain = await _bursts(stub, a, 12, 12)
        zero = await _bursts(stub, b, 12, 12, temperature=0.0, top_k=5, top_p=0.5, min_p=0.3, seed=7)
        assert plain == zero and await _digest(stub, a) == await _digest(stub, b)


async def test_last_message_reports_usage_and_seed(engine):
    async with running_server(engine, default_new_tokens=5) as (stub, _):
        sid = await _session(stub)
        tokens, msgs = await _generate(stub, sid, 0, ignore_eos=True, temperature=1.0)  # 0 = server default
        last = msgs[-1]
        assert len(tokens) == 5 and last.stop_reason == pb.STOP_REASON_MAX_TOKENS
        u = last.usage
        assert (u.prompt_tokens, u.generated_tokens) == (len(PROMPT), 5)
        assert 0 < u.time_to_first_token_ms <= u.total_time_ms and u.tokens_per_second > 0
        assert not any(m.HasField("usage") for m in msgs[:-1])
        again, _ = await _generate(stub, await _session(stub), 5, ignore_eos=True, temperature=1.0, seed=last.seed)
        assert again == tokens  # the reported (server-picked) seed reproduces the stream


async def test_per_request_eos_ids(engine):
    async with running_server(engine) as (stub, _):
        stream = await _bursts(stub, await _session(stub), 10, 10, **SAMPLED)
        tokens, msgs = await _generate(stub, await _session(stub, eos_token_ids=[1]), 10, eos_token_ids=[stream[4]],
                                       **SAMPLED)
        assert tokens == stream[: stream.index(stream[4]) + 1] and msgs[-1].stop_reason == pb.STOP_REASON_EOS
        sid = await _session(stub)
        tokens, _ = await _generate(stub, sid, 10, eos_token_ids=[stream[4]], ignore_eos=True, **SAMPLED)
        assert tokens == stream


@pytest.mark.parametrize("mode", [pb.DECODE_MODE_GREEDY, pb.DECODE_MODE_SPECULATIVE_LOOKUP])
async def test_logprobs_are_the_log_softmax_of_the_exact_logits(engine, mode):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub)
        tokens, msgs = await _generate(stub, sid, 12, ignore_eos=True, mode=mode, logprobs=True, top_logprobs=3,
                                       **SAMPLED)
    lps = [lp for m in msgs for lp in m.logprobs]
    assert [lp.token for lp in lps] == tokens and all(len(m.logprobs) == len(m.tokens) for m in msgs)
    v = engine.make_verifier(3, 8)
    v.prefill(PROMPT)
    for i, lp in enumerate(lps):
        ref = log_softmax(v.next_token_logits)
        assert lp.logprob == np.float32(ref[tokens[i]])
        order = sorted(range(ref.size), key=lambda t: (-ref[t], t))[:3]
        assert [a.token for a in lp.top] == order and [a.logprob for a in lp.top] == [np.float32(ref[t]) for t in order]
        v.forward_block([tokens[i]])
        v.commit_or_truncate(1, 1)


async def _code(coro):
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("fields,fragment", [
    (dict(temperature=-1.0), "GenerateRequest.temperature = -1.0 is out of range; allowed 0.0..100.0"),
    (dict(temperature=float("nan")), "temperature = nan"),
    (dict(top_p=1.5), "top_p = 1.5"),
    (dict(min_p=-0.1), "min_p"),
    (dict(repetition_penalty=11.0), "repetition_penalty = 11.0"),
    (dict(top_k=257), "top_k = 257 is out of range; allowed 1..256 (or 0"),
    (dict(logprobs=True, top_logprobs=21), "top_logprobs = 21"),
    (dict(top_logprobs=2), "needs logprobs = true"),
    (dict(stop=["a"] * 9), "GenerateRequest.stop has 9 elements"),
    (dict(stop=[""]), "GenerateRequest.stop[0] has 0 characters; allowed 1..256"),
    (dict(eos_token_ids=[256]), "eos_token_ids[0] = 256"),
])
async def test_invalid_generate_fields(engine, fields, fragment):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub)
        before = await _digest(stub, sid)
        code, details = await _code(_generate(stub, sid, 4, **fields))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details
        assert await _digest(stub, sid) == before


@pytest.mark.parametrize("request_,fragment", [
    (pb.AppendTokensRequest(tokens=[1], text="x"), "exactly one of tokens, text, messages; got tokens and text"),
    (pb.AppendTokensRequest(tokens=[1], add_generation_prompt=True), "add_generation_prompt applies to messages only"),
    (pb.AppendTokensRequest(messages=[pb.ChatMessage(role="", content="x")]), "ChatMessage.role has 0"),
])
async def test_invalid_append_inputs(engine, request_, fragment):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub)
        request_.session_id = sid
        code, details = await _code(stub.AppendTokens(request_))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and fragment in details, details


async def test_text_features_need_a_tokenizer(engine):
    async with running_server(engine) as (stub, _):
        sid = await _session(stub)
        for call in (stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text="hello")),
                     stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[pb.ChatMessage(role="user")])),
                     _generate(stub, sid, 3, stop=["x"]),
                     stub.Tokenize(pb.TokenizeRequest(text="hello")),
                     stub.Detokenize(pb.DetokenizeRequest(tokens=[1, 2]))):
            code, details = await _code(call)
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer" in details
        tokens, msgs = await _generate(stub, sid, 3, ignore_eos=True)
        assert len(tokens) == 3 and all(m.text == "" for m in msgs)  # token ids only
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == len(PROMPT) + 3


async def test_model_info(engine):
    async with running_server(engine, default_new_tokens=7) as (stub, runtime):
        i = await stub.GetModelInfo(pb.GetModelInfoRequest())
    assert (i.model_name, i.vocab_size, list(i.eos_token_ids)) == ("random-0", 256, [1])
    assert not i.has_tokenizer and not i.has_chat_template and not i.HasField("bos_token_id")
    assert i.exact and i.block_size == engine.block and i.kernels and len(i.model_fingerprint) == 64
    assert i.has_draft_model
    lim = i.limits
    assert (lim.default_sink_tokens, lim.max_sink_tokens) == (4, 64)
    assert (lim.default_window_tokens, lim.max_window_tokens) == (64, 8192)
    assert (lim.default_new_tokens, lim.max_new_tokens, lim.max_tokens_per_request) == (7, 4096, 8192)
    assert (lim.max_draft_tokens, lim.max_top_logprobs, lim.max_sessions) == (8, 20, 4)
