"""The OpenAI-compatible HTTP API with the official `openai` client, on the tiny model (token-id prompts).

A real uvicorn server on 127.0.0.1:0 over a real runtime; every error class the API maps is
asserted as the client sees it (exception class, status, OpenAI error body).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from inference_engine.runtime.types import CreateSessionParams
from inference_engine.security.authenticator import Authenticator
from inference_engine.security.tokens import TokenTable
from inference_engine.server.openai_api.observer import MAX_BODY_BYTES
from tests.openai_helpers import forks_settled, http_api

PROMPT = [5, 17, 42, 99, 3]
TOKENS = ("tenant-a-" + "a" * 32, "tenant-b-" + "b" * 32)


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


async def test_models_health_docs(tiny_engine):
    async with http_api(tiny_engine) as s:
        async with s.client() as c:
            models = await c.models.list()
        assert [m.id for m in models.data] == [s.model] == ["random-0"]
        async with s.client() as c:
            assert (await c.models.retrieve(s.model)).id == s.model
            with pytest.raises(openai.NotFoundError) as err:
                await c.models.retrieve("gpt-4o")
            assert err.value.body["code"] == "model_not_found"
        async with httpx.AsyncClient(base_url=s.base_url.removesuffix("/v1")) as h:
            assert (await h.get("/health")).json() == {"status": "ok"}
            assert (await h.head("/health")).status_code == 200  # load balancers' probes
            schema = (await h.get("/openapi.json")).json()
            assert {"/v1/chat/completions", "/v1/completions", "/v1/models", "/health"} <= set(schema["paths"])
            assert (await h.get("/docs")).status_code == 200


async def test_completion_plain_streamed_and_usage_agree(tiny_engine):
    async with http_api(tiny_engine, prefix_cache_bytes=0) as s, s.client() as c:
        r = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=6, temperature=0)
        assert r.object == "text_completion" and r.system_fingerprint.startswith("fp_")
        assert len(ids(r.choices[0])) == 6 and r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (5, 6, 11)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        stream = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        streamed = [t for ch in chunks for choice in ch.choices for t in ids(choice)]
        assert streamed == ids(r.choices[0])
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
        assert [ch.choices[0].finish_reason for ch in chunks[:-1]][-1] == "length"


async def test_logprobs_are_the_models(tiny_engine):
    async with http_api(tiny_engine) as s, s.client() as c:
        r = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        assert lp.tokens == [f"token_id:{t}" for t in ids(r.choices[0])]
        for chosen, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert len(top) == 3 and logprob <= 0
            assert max(top.values()) == logprob == top[chosen]  # greedy: the chosen token is the most probable


async def test_seed_temperature_and_n(tiny_engine):
    async with http_api(tiny_engine, max_sessions=8) as s, s.client() as c:
        ask = dict(model=s.model, prompt=PROMPT, max_tokens=12, temperature=1.5, seed=7)
        one = await c.completions.create(**ask)
        again = await c.completions.create(**ask)
        other = await c.completions.create(**{**ask, "seed": 8})
        two = await c.completions.create(**ask, n=2)
        assert ids(one.choices[0]) == ids(again.choices[0]) != ids(other.choices[0])
        assert [ch.index for ch in two.choices] == [0, 1]
        assert ids(two.choices[0]) == ids(one.choices[0])  # choice 0 samples with the request's seed
        assert ids(two.choices[1]) != ids(two.choices[0])  # choice 1 with seed + 1
        assert two.usage.completion_tokens == 24 and two.usage.prompt_tokens == 5
        streamed: dict[int, list[int]] = {0: [], 1: []}
        async for chunk in await c.completions.create(**ask, n=2, stream=True):
            for choice in chunk.choices:
                streamed[choice.index] += ids(choice)
        assert streamed == {0: ids(two.choices[0]), 1: ids(two.choices[1])}  # interleaved, each choice whole


async def test_seeded_copies_under_load_equal_solo(tiny_engine):
    async with http_api(tiny_engine, max_sessions=16, prefix_cache_bytes=0) as s, s.client() as c:
        ask = dict(model=s.model, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
        solo = ids((await c.completions.create(**ask)).choices[0])
        noise = [c.completions.create(model=s.model, prompt=[i + 1] * (3 + i), max_tokens=10 + i, temperature=1.0)
                 for i in range(4)]
        copies = [c.completions.create(**ask) for _ in range(8)]
        results = await asyncio.gather(*copies, *noise)
        assert [ids(r.choices[0]) for r in results[:8]] == [solo] * 8


async def test_prefix_cache_is_exact_and_per_identity(tiny_engine):
    """A 6-turn token conversation: identical with the cache and without; cached_tokens grows; identity B
    sending A's exact conversation never hits A's sessions."""
    auth = Authenticator(TokenTable(list(TOKENS)))

    async def converse(s, token: str) -> tuple[list[list[int]], list[int]]:
        history, replies, cached = list(PROMPT), [], []
        async with s.client(api_key=token) as c:
            for turn in range(6):
                r = await c.completions.create(model=s.model, prompt=history, max_tokens=5, temperature=0.8,
                                               seed=turn)
                reply = ids(r.choices[0])
                replies.append(reply)
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                history += reply + [10 + turn, 11 + turn]
        return replies, cached

    async with http_api(tiny_engine, authenticator=auth, prefix_cache_bytes=0) as s:
        plain, none_cached = await converse(s, TOKENS[0])
    async with http_api(tiny_engine, authenticator=auth, max_sessions=4) as s:
        cached_replies, cached = await converse(s, TOKENS[0])
        other, other_cached = await converse(s, TOKENS[1])
        assert len(s.http.serving.service.cache) == 2  # one kept session per identity
    assert none_cached == [0] * 6
    assert cached_replies == plain == other
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:]))
    assert other_cached == cached  # B's own sessions only: the same growth, never A's


async def test_prefix_cache_rolls_back_a_divergent_tail(tiny_engine):
    async with http_api(tiny_engine) as s, s.client() as c:
        first = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=6, temperature=0)
        history = PROMPT + ids(first.choices[0])  # kept: 11 tokens
        edited = history[:-2] + [200, 201, 202]  # differs in the last 2: rolled back, 9 reused
        cached = await c.completions.create(model=s.model, prompt=edited, max_tokens=6, temperature=0)
        assert cached.usage.prompt_tokens_details.cached_tokens == 9
    async with http_api(tiny_engine, prefix_cache_bytes=0) as s, s.client() as c:
        fresh = await c.completions.create(model=s.model, prompt=edited, max_tokens=6, temperature=0)
    assert ids(cached.choices[0]) == ids(fresh.choices[0])


async def test_kept_sessions_make_room_for_live_ones(tiny_engine):
    async with http_api(tiny_engine, max_sessions=2) as s, s.client() as c:
        for i in range(3):  # three different prompts: at most two kept, then evicted
            await c.completions.create(model=s.model, prompt=[i + 1] * 4, max_tokens=2, temperature=0)
        assert len(s.http.serving.service.cache) == 2
        for _ in range(2):  # live gRPC-style sessions take the slabs: the kept ones go first
            await s.runtime.create_session(CreateSessionParams((), "live", 0, 0))
        assert len(s.http.serving.service.cache) == 0
        with pytest.raises(openai.RateLimitError) as err:  # a full pool of live sessions: 429
            await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 429 and err.value.code == "pool_exhausted"


async def test_auth(tiny_engine):
    async with http_api(tiny_engine, authenticator=Authenticator(TokenTable([TOKENS[0]]))) as s:
        async with s.client(api_key="not-a-known-token") as c:
            with pytest.raises(openai.AuthenticationError) as err:
                await c.models.list()
        assert err.value.status_code == 401 and "Authorization: Bearer" in err.value.message
        async with httpx.AsyncClient(base_url=s.base_url) as h:  # no header at all
            r = await h.post("/completions", json={"model": s.model, "prompt": PROMPT})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        async with s.client(api_key=TOKENS[0]) as c:
            assert (await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=1)).usage.completion_tokens == 1


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"n": 9}, "n"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"),
    ({"echo": True}, "echo"),
    ({"best_of": 2}, "best_of"),
    ({"prompt": [1, 999]}, "prompt[1]"),
    ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1] * 9000}, "prompt"),
    ({"seed": -(1 << 64)}, "seed"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stop": ["x"]}, None),  # stop strings need a tokenizer: the tiny model has none
])
async def test_bad_fields_are_400(tiny_engine, fields, param):
    async with http_api(tiny_engine) as s, s.client() as c:
        body = {"model": s.model, "prompt": PROMPT, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(**body)
        assert err.value.status_code == 400 and err.value.param == param
        assert err.value.body["type"] == "invalid_request_error" and err.value.message
        assert s.runtime.store.slabs_in_use == 0  # nothing left open


async def test_chat_only_fields_are_400(tiny_engine):
    async with http_api(tiny_engine) as s, s.client() as c:
        for name, value in (("functions", [{"name": "f"}]), ("function_call", "auto")):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "hi"}],
                                                **{name: value})
            assert err.value.param == name and "not supported" in err.value.message
        for fields in ({"tools": [{"type": "function", "function": {"name": "f"}}]},
                       {"response_format": {"type": "json_object"}}):  # constraints need a tokenizer
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "hi"}], **fields)
            assert err.value.code == "feature_unavailable" and "constrained output" in err.value.message
            assert s.runtime.store.slabs_in_use == 0
        with pytest.raises(openai.BadRequestError) as err:  # the tiny model has no tokenizer
            await c.chat.completions.create(model=s.model, messages=[{"role": "user", "content": "hi"}])
        assert err.value.code == "feature_unavailable"


async def test_unknown_model_body_size_draining_and_routes(tiny_engine):
    async with http_api(tiny_engine) as s, s.client() as c:
        with pytest.raises(openai.NotFoundError) as err:
            await c.completions.create(model="gpt-4o", prompt=PROMPT)
        assert err.value.code == "model_not_found" and s.model in err.value.message
        port = int(s.base_url.rsplit(":", 1)[1].split("/")[0])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # refused before the body is sent
        writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % (MAX_BODY_BYTES + 1))
        await writer.drain()
        answer = await reader.read()
        writer.close()
        assert answer.startswith(b"HTTP/1.1 413") and b'"code":"request_too_large"' in answer.replace(b" ", b"")
        async with httpx.AsyncClient(base_url=s.base_url) as h:
            for raw in (b"{not json", b"[]", b'{"model": 1}', b'{"model": "random-0", "prompt": {"a": 1}}', b""):
                r = await h.post("/completions", content=raw, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", raw
            missing = await h.get("/v1/nothing-here")
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
            assert (await h.get("/completions")).status_code == 405
        s.http.begin_drain()
        with pytest.raises(openai.InternalServerError) as err:
            await c.completions.create(model=s.model, prompt=PROMPT)
        assert err.value.status_code == 503 and err.value.code == "engine_unavailable"
        async with httpx.AsyncClient(base_url=s.base_url.removesuffix("/v1")) as h:
            assert (await h.get("/health")).status_code == 503


async def test_a_stream_ends_with_done(tiny_engine):
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url) as h:
        async with h.stream("POST", "/completions", json={"model": s.model, "prompt": PROMPT, "max_tokens": 3,
                                                           "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert r.headers["content-type"].startswith("text/event-stream")
        assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
        assert json.loads(lines[0][6:])["object"] == "text_completion"


_json = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_fields = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["random-0", "x"]) | _json, "prompt": st.lists(st.integers(-2, 300), max_size=4) | _json,
    "messages": _json, "max_tokens": st.integers(-1, 3) | _json, "n": st.integers(0, 3) | _json,
    "temperature": st.floats() | _json, "stop": _json, "logprobs": _json, "seed": _json, "stream": st.booleans(),
})


async def test_fuzzed_bodies_never_500(tiny_engine):
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url, timeout=30) as h:
        statuses = set()

        async def post(path, body):
            r = await h.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
            assert r.status_code < 500, (body, r.text)
            assert "Traceback" not in r.text
            return r.status_code

        examples = []  # hypothesis drives sync functions: draw the bodies, then send them from this loop

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
        @given(path=st.sampled_from(["/completions", "/chat/completions"]), body=_fields)
        def collect(path, body):
            examples.append((path, body))

        collect()
        for path, body in examples:
            statuses.add(await post(path, body))
        assert 400 in statuses
        r = await h.post("/completions", json={"model": s.model, "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200  # the pool is intact
        await forks_settled(s)  # bodies asking for more than --max-rollback tokens took fallback forks
        sessions = s.runtime.store.sessions()  # only kept sessions remain, none busy, nothing reserved
        assert len(sessions) == len(s.http.serving.service.cache) == s.runtime.store.slabs_in_use
        assert not any(x.is_busy for x in sessions)
