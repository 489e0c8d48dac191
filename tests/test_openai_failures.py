"""The HTTP API when things go wrong underneath: errors mid-stream, sessions vanishing from the prefix
cache, a server still loading, a port in use. Faults are injected into a real runtime (labelled)."""

from __future__ import annotations

import argparse
import asyncio
import json
import re

import httpx
import openai
import pytest

from inference_engine.config import add_server_flags, config_from_args
from inference_engine.errors import SessionBusy, SessionNotFound
from inference_engine.runtime.types import CreateSessionParams, GenerateChunk
from inference_engine.security.authenticator import Authenticator
from inference_engine.server.openai_api.http_server import HttpFrontend
from tests.conftest import make_config
from tests.openai_helpers import close_every_session, forks_settled, http_api

PROMPT = [5, 17, 42, 99, 3]


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


@pytest.fixture
def failing_generate(monkeypatch):
    """Fault injection: the runtime's Generate streams one token, then fails (SessionBusy)."""

    def install(runtime):
        async def generate(params, emit):
            await emit(GenerateChunk((7,)))
            raise SessionBusy("injected: busy")

        monkeypatch.setattr(runtime, "generate", generate)

    return install


async def test_an_error_mid_stream_is_sent_in_the_stream(tiny_engine, failing_generate):
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url) as h:
        failing_generate(s.runtime)
        async with h.stream("POST", "/completions", json={"model": s.model, "prompt": PROMPT, "stream": True}) as r:
            lines = [line async for line in r.aiter_lines() if line]
        assert r.status_code == 200 and json.loads(lines[0][6:])["choices"][0]["token_ids"] == [7]
        assert json.loads(lines[-1][6:])["error"]["code"] == "session_busy"
        plain = await h.post("/completions", json={"model": s.model, "prompt": PROMPT})
        assert plain.status_code == 409 and plain.json()["error"]["type"] == "conflict_error"
        await forks_settled(s)  # both requests' fallback forks (16-token replies), discarded as they land
        assert [x.is_busy for x in s.runtime.store.sessions()] == [False]  # given back to the cache, idle


async def test_unexpected_errors_are_500_without_a_traceback(tiny_engine, monkeypatch):
    async with http_api(tiny_engine) as s, s.client() as c:
        async def explode(*args, **kwargs):
            raise KeyError("boom")

        monkeypatch.setattr(s.runtime, "create_session", explode)  # fault injection
        with pytest.raises(openai.InternalServerError) as err:
            await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 500 and err.value.body["message"] == "internal error: KeyError"
        assert err.value.body["type"] == "server_error" and "boom" not in err.value.message


async def test_a_cached_session_gone_meanwhile_is_prefilled_again(tiny_engine, monkeypatch):
    async with http_api(tiny_engine) as s, s.client() as c:
        first = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=3, temperature=0)
        history = PROMPT + ids(first.choices[0]) + [1]
        real_append = s.runtime.append_tokens
        calls = []

        async def vanish_once(p):  # fault injection: the taken session disappears before its append
            calls.append(p.session_id)
            if len(calls) == 1:
                s.runtime.store.close(p.session_id, p.owner)
                raise SessionNotFound("injected: gone")
            return await real_append(p)

        monkeypatch.setattr(s.runtime, "append_tokens", vanish_once)
        again = await c.completions.create(model=s.model, prompt=history, max_tokens=3, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0 and len(calls) == 2
        monkeypatch.undo()
        async with http_api(tiny_engine, prefix_cache_bytes=0) as fresh, fresh.client() as c2:
            plain = await c2.completions.create(model=fresh.model, prompt=history, max_tokens=3, temperature=0)
        assert ids(again.choices[0]) == ids(plain.choices[0])


async def test_expired_and_oversized_sessions_are_not_kept(tiny_engine):
    async with http_api(tiny_engine, prefix_cache_bytes=1) as s, s.client() as c:  # every session over the bound
        await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2)
        assert len(s.http.serving.service.cache) == 0 and s.runtime.store.slabs_in_use == 0
    async with http_api(tiny_engine, session_ttl_s=0.001) as s, s.client() as c:
        r = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, temperature=0)
        await asyncio.sleep(0.01)  # past the TTL: the kept session expires
        again = await c.completions.create(model=s.model, prompt=PROMPT + ids(r.choices[0]), max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 0


async def test_n_choices_that_do_not_fit_the_pool_leave_nothing_open(tiny_engine):
    async with http_api(tiny_engine, max_sessions=3, prefix_cache_bytes=0) as s, s.client() as c:
        with pytest.raises(openai.BadRequestError) as err:  # never servable: 400, not a 429 retried for ever
            await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, n=4)
        assert err.value.param == "n" and "--max-sessions" in err.value.message
        other = await s.runtime.create_session(CreateSessionParams((), "other", 0, 0))  # another client's
        with pytest.raises(openai.RateLimitError):  # fits the pool, not what is free of it now
            await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, n=3)
        assert s.runtime.store.slabs_in_use == 1
        s.runtime.store.close(other.session_id, "anonymous")


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"user": "u" * 300}, "user"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": "f"}]}]}, "messages.0.tool_calls.0.function"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 5}}]}]},
     "messages.0.tool_calls.0.function.arguments.str"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * (1 << 20)}, {"type": "text",
                                                                                          "text": "y"}]}]}, "content"),
])
async def test_bad_chat_fields_are_400(tiny_engine, fields, param):
    async with http_api(tiny_engine) as s, s.client() as c:
        body = {"model": s.model, "messages": [{"role": "user", "content": "hi"}], **fields}
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(**body)
        assert err.value.param == param


@pytest.mark.parametrize("path,fields", [
    ("/chat/completions", '"messages": [{"role": "user", "content": "hi \\ud800"}]'),
    ("/chat/completions", '"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]'),
    ("/chat/completions", '"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800x"]'),
    ("/completions", '"prompt": "hi \\ud800"'),
])
async def test_a_lone_surrogate_is_a_400_not_a_500(tiny_engine, path, fields):
    """JSON may escape half a UTF-16 pair ("\\ud800"); Python decodes it to a string no tokenizer takes."""
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url) as h:
        r = await h.post(path, content=f'{{"model": "{s.model}", {fields}, "max_tokens": 2}}',
                         headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert "holds a lone UTF-16 surrogate" in r.json()["error"]["message"]


async def test_a_body_of_another_content_type_is_told_to_be_json(tiny_engine):
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url) as h:
        body = json.dumps({"model": s.model, "prompt": PROMPT, "max_tokens": 2})
        r = await h.post("/completions", content=body, headers={"content-type": "text/plain"})
        assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]
        r = await h.post("/completions", content=body)  # no content type: not read as JSON either
        assert r.status_code == 400 and "'no content type'; send it as JSON" in r.json()["error"]["message"]
        r = await h.post("/completions", content=body, headers={"content-type": "application/json; charset=utf-8"})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2


async def test_loading_server_and_port_in_use(tiny_engine):
    http = HttpFrontend(make_config(), Authenticator())
    port = await http.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as h:
            assert (await h.get("/health")).json() == {"status": "loading"}
            r = await h.post("/v1/completions", json={"model": "m", "prompt": [1]})
            assert r.status_code == 503 and "loading" in r.json()["error"]["message"]
        with pytest.raises(OSError):
            await HttpFrontend(make_config(), Authenticator()).start("127.0.0.1", port)
    finally:
        await http.stop(0.1)
    await http.stop(0.1)  # a second stop is a no-op


def test_http_with_client_certificates_needs_tokens(pki):
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    args = parser.parse_args(["--http-port", "8080", "--tls-cert", str(pki.server.cert), "--tls-key",
                              str(pki.server.key), "--tls-client-ca", str(pki.ca)])
    with pytest.raises(ValueError, match="--auth-token-file"):
        config_from_args(args)
    args = parser.parse_args(["--http-port", "70000"])
    with pytest.raises(ValueError, match="--http-port"):
        config_from_args(args)


@pytest.mark.parametrize("is_hit", [True, False])
async def test_a_failed_append_leaves_nothing_open(tiny_engine, monkeypatch, is_hit):
    from inference_engine.errors import InvalidRequest

    async with http_api(tiny_engine) as s, s.client() as c:
        first = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, temperature=0)
        prompt = PROMPT + ids(first.choices[0]) + [9] if is_hit else [8, 8, 8]

        async def refuse(p):  # fault injection
            raise InvalidRequest("injected: refused", "tokens")

        monkeypatch.setattr(s.runtime, "append_tokens", refuse)
        with pytest.raises(openai.BadRequestError):
            await c.completions.create(model=s.model, prompt=prompt, max_tokens=2)
        assert len(s.runtime.store.sessions()) == len(s.http.serving.service.cache) == 1  # the first one, kept


@pytest.mark.parametrize("prompt", ["", ["a", "b"], [1, "a"]])
async def test_one_nonempty_prompt_per_request(tiny_engine, prompt):
    async with http_api(tiny_engine) as s, s.client() as c:
        with pytest.raises(openai.BadRequestError) as err:
            await c.completions.create(model=s.model, prompt=prompt)
        assert err.value.param.startswith("prompt")  # a schema error names the union member: prompt.str


async def test_https_with_the_grpc_ports_certificate_and_tokens(tiny_engine, pki, tmp_path):
    import ssl

    from inference_engine.runtime.runtime import Runtime
    from inference_engine.security.settings import ServerSecurity

    token = "tls-tenant-" + "t" * 32
    (tmp_path / "tokens").write_text(token + "\n")
    security = ServerSecurity(tls_cert=pki.server.cert, tls_key=pki.server.key, auth_token_file=tmp_path / "tokens")
    runtime = Runtime(tiny_engine, make_config(security=security))
    http = HttpFrontend(runtime.config)  # the authenticator from the config's token file, as serve builds it
    port = await http.start("127.0.0.1", 0)
    http.attach(runtime)
    trust = ssl.create_default_context(cafile=str(pki.ca))
    try:
        async with openai.AsyncOpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=token, max_retries=0,
                                      http_client=httpx.AsyncClient(verify=trust)) as c:
            r = await c.completions.create(model="random-0", prompt=PROMPT, max_tokens=2)
            assert r.usage.completion_tokens == 2
        async with httpx.AsyncClient() as plain:
            with pytest.raises(httpx.HTTPError):  # plaintext HTTP on the TLS port
                await plain.get(f"http://127.0.0.1:{port}/health")
    finally:
        await http.stop(0.1)
        close_every_session(runtime)


@pytest.mark.parametrize("stream,stuck", [(False, "generate"), (True, "append_tokens"), (False, "append_tokens")])
async def test_a_client_that_hangs_up_cancels_its_request(tiny_engine, monkeypatch, caplog, stream, stuck):
    """A client gone before its answer (a timeout mid-generation, or mid-prefill of a stream) stops the
    work at once and frees its session, logged as 499; the server then serves the next request."""
    async with http_api(tiny_engine, prefix_cache_bytes=0, prefix_cache_forks=False) as s:
        real, cancelled = getattr(s.runtime, stuck), asyncio.Event()

        async def never_ends(params, *rest):  # fault injection: the call runs until cancelled
            if stuck == "generate":
                await rest[0](GenerateChunk((7,)))
            try:
                await asyncio.Event().wait()
            finally:
                cancelled.set()

        monkeypatch.setattr(s.runtime, stuck, never_ends)
        caplog.set_level("INFO", "inference_engine.http")
        body = {"model": s.model, "prompt": PROMPT, "max_tokens": 8, "stream": stream}
        async with httpx.AsyncClient(base_url=s.base_url, timeout=0.5) as h:
            with pytest.raises(httpx.ReadTimeout):
                await h.post("/completions", json=body)
        await asyncio.wait_for(cancelled.wait(), 10)  # before: the work ran on for nobody
        for _ in range(100):
            if s.runtime.store.slabs_in_use == 0 and any(" 499 " in r.message for r in caplog.records):
                break
            await asyncio.sleep(0.05)
        assert s.runtime.store.slabs_in_use == 0
        assert any(r.message.startswith("http POST /v1/completions 499 ") for r in caplog.records)
        monkeypatch.setattr(s.runtime, stuck, real)
        async with s.client() as c:
            assert len(ids((await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=3)).choices[0])) == 3


async def test_web_pages_of_allowed_origins_only_may_call_it(tiny_engine):
    """CORS is off by default (a browser page of any origin is refused its preflight); --http-allow-origin
    opens the API to the pages of the origins it names, Authorization header included."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    async with http_api(tiny_engine) as s, httpx.AsyncClient(base_url=s.base_url) as h:
        r = await h.options("/completions", headers={"Origin": "http://localhost:3000", **preflight})
        assert r.status_code == 405 and "access-control-allow-origin" not in r.headers
    async with http_api(tiny_engine, http_allow_origins=("http://localhost:3000",)) as s, \
            httpx.AsyncClient(base_url=s.base_url) as h:
        r = await h.options("/completions", headers={"Origin": "http://localhost:3000", **preflight})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        r = await h.options("/completions", headers={"Origin": "http://evil.example", **preflight})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers
        r = await h.post("/completions", json={"model": s.model, "prompt": PROMPT, "max_tokens": 2},
                         headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"


@pytest.mark.parametrize("argv,says", [
    (["--http-port", "8000", "--http-allow-origin", "localhost:3000"], "--http-allow-origin 'localhost:3000'"),
    (["--http-allow-origin", "*"], "without --http-port there is none"),
])
def test_allowed_origins_are_checked_at_start(argv, says):
    parser = argparse.ArgumentParser()
    add_server_flags(parser)
    with pytest.raises(ValueError, match=re.escape(says)):
        config_from_args(parser.parse_args(argv))
