"""The prefix cache's fallback fork, through the official `openai` client on the tiny model (token-id prompts).

A reply of 12 tokens is beyond --max-rollback (8): a next turn that sends it back edited near its
start cannot roll the kept session back that far. The fork kept at the end of the prompt serves
the previous prompt instead, bitwise as a fresh prefill would.
"""

from __future__ import annotations

import asyncio

from inference_engine import metrics
from inference_engine.runtime.types import AppendParams, CreateSessionParams
from inference_engine.security.authenticator import Authenticator
from inference_engine.security.settings import ANONYMOUS
from inference_engine.security.tokens import TokenTable
from inference_engine.server.openai_api.fallback_fork import FallbackFork
from tests.openai_helpers import http_api

PROMPT = [5, 17, 42, 99, 3]
TOKENS = ("tenant-a-" + "a" * 32, "tenant-b-" + "b" * 32)
REPLY = 12  # tokens per reply: more than the tiny engine's --max-rollback of 8


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def _count(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def _forks_kept() -> float:
    return _count("inference_engine_prefix_cache_forks_total", outcome="taken")


def _fork_hits() -> float:
    return _count("inference_engine_prefix_cache_lookups_total", outcome="fork")


async def settled(cache) -> None:
    """Every identity's forks being built are kept or dropped (a reply's end does not wait for its fork)."""
    await asyncio.gather(*(cache.settled(owner) for owner in list(cache._building)))


def edit(prompt: list[int], reply: list[int]) -> list[int]:
    """The next turn's prompt with the reply's first token changed (re-tokenized or edited by the client)."""
    return prompt + [201 if reply[0] == 200 else 200] + reply[1:] + [10, 11]


async def _two_turns(s, token: str = "unused") -> tuple[list[list[int]], list[int], list[int]]:
    """Turn 1, then turn 2 sending turn 1's reply back edited: replies, cached_tokens, prompts."""
    async with s.client(api_key=token) as c:
        first = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0)
        second_prompt = edit(PROMPT, ids(first.choices[0]))
        second = await c.completions.create(model=s.model, prompt=second_prompt, max_tokens=REPLY, temperature=0.9,
                                            seed=3)
    replies = [ids(first.choices[0]), ids(second.choices[0])]
    return replies, [r.usage.prompt_tokens_details.cached_tokens for r in (first, second)], second_prompt


async def test_a_reply_edited_beyond_rollback_is_served_by_the_fork(tiny_engine):
    auth = Authenticator(TokenTable(list(TOKENS)))
    forks, hits = _forks_kept(), _fork_hits()
    async with http_api(tiny_engine, authenticator=auth, prefix_cache_bytes=0) as s:
        plain, plain_cached, _ = await _two_turns(s, TOKENS[0])
    assert plain_cached == [0, 0] and _forks_kept() == forks  # the cache off: no fork is ever taken
    async with http_api(tiny_engine, authenticator=auth, max_sessions=6) as s:
        cache = s.http.serving.service.cache
        replies, cached, second_prompt = await _two_turns(s, TOKENS[0])
        await settled(cache)
        assert len(replies[0]) == REPLY and replies == plain  # bitwise the completions without the cache
        assert cached == [0, len(PROMPT)]  # the whole previous prompt, from the fork
        assert _fork_hits() == hits + 1 and _forks_kept() == forks + 2  # one fork per turn; turn 2 took turn 1's
        assert (len(cache), cache.forks()) == (3, 1)  # turn 1's full session, turn 2's fork and full session
        async with s.client(api_key=TOKENS[1]) as c:  # identity B sends A's edited turn: none of A's entries
            other = await c.completions.create(model=s.model, prompt=second_prompt, max_tokens=REPLY,
                                               temperature=0.9, seed=3)
        assert other.usage.prompt_tokens_details.cached_tokens == 0 and _fork_hits() == hits + 1
        assert ids(other.choices[0]) == replies[1]
        await settled(cache)
        kept = set(cache._kept)
        assert {x.session_id for x in s.runtime.store.sessions()} == kept  # every open session is an entry
        await s.http.stop(0.5)  # shutdown closes the entries: nothing leaked, every slab free
        assert s.runtime.store.sessions() == [] and s.runtime.store.slabs_in_use == 0
        assert s.runtime.store.kv_bytes_in_use() == 0


async def _slab_bytes(engine) -> int:
    """K/V bytes of one session as the HTTP API creates them."""
    async with http_api(engine) as s:
        made = await s.runtime.create_session(CreateSessionParams((), "probe", 0, 0))
        return s.runtime.store.get(made.session_id).kv_bytes


async def test_forks_count_in_the_byte_bound_and_go_least_recently_used(tiny_engine):
    slab = await _slab_bytes(tiny_engine)
    evictions = _count("inference_engine_prefix_cache_evictions_total")
    async with http_api(tiny_engine, prefix_cache_bytes=3 * slab, max_sessions=8) as s, s.client() as c:
        cache = s.http.serving.service.cache
        first = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0)
        await settled(cache)
        assert (len(cache), cache.forks(), cache.kept_bytes()) == (2, 1, 2 * slab)  # A's fork and full session
        assert list(cache._kept.values())[0].is_fork  # the fork just before its full session, in LRU order
        await c.completions.create(model=s.model, prompt=[7, 7, 7, 7], max_tokens=REPLY, temperature=0)
        await settled(cache)
        assert (len(cache), cache.forks(), cache.kept_bytes()) == (3, 1, 3 * slab)  # A's fork went: the oldest
        assert _count("inference_engine_prefix_cache_evictions_total") == evictions + 1
        again = await c.completions.create(model=s.model, prompt=edit(PROMPT, ids(first.choices[0])),
                                           max_tokens=2, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens == 0  # no fork left for A's edited reply
        assert cache.kept_bytes() <= 3 * slab


async def test_no_fork_in_a_pool_live_sessions_fill(tiny_engine):
    forks = _forks_kept()
    async with http_api(tiny_engine, max_sessions=3) as s, s.client() as c:
        cache = s.http.serving.service.cache
        await s.runtime.create_session(CreateSessionParams((), "live", 0, 0))  # 1 live + the request's own
        await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0)
        await settled(cache)
        assert _forks_kept() == forks and (len(cache), cache.forks()) == (1, 0)  # the last slab stays free
        await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, temperature=0)  # short: no fork asked
        assert _forks_kept() == forks
    async with http_api(tiny_engine, max_sessions=8, prefix_cache_bytes=await _slab_bytes(tiny_engine)) as s, \
            s.client() as c:  # room for one kept session only: no fork beside it
        await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0)
        assert _forks_kept() == forks and len(s.http.serving.service.cache) == 1
    async with http_api(tiny_engine, max_sessions=8, prefix_cache_forks=False) as s, s.client() as c:
        await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0)
        cache = s.http.serving.service.cache  # --no-prefix-cache-forks: the full session only
        assert _forks_kept() == forks and (len(cache), cache.forks()) == (1, 0)


async def test_a_fork_that_fails_or_is_not_wanted_is_never_kept(tiny_engine):
    """FallbackFork over the real runtime: a session closed before its fork (the fork fails, quietly), a fork
    built while draining, and one no longer wanted before it is built: none is kept, none is left open."""
    async with http_api(tiny_engine, max_sessions=6) as s:
        service = s.http.serving.service
        made = await s.runtime.create_session(CreateSessionParams((), "probe", 0, 0))
        await s.runtime.append_tokens(AppendParams(made.session_id, tuple(PROMPT)))
        gone = FallbackFork(service.cache, service.transfer, ANONYMOUS, lambda: False)
        await gone.start("no-such-session")
        await gone.built()
        draining = FallbackFork(service.cache, service.transfer, ANONYMOUS, lambda: True)
        await draining.start(made.session_id)
        await draining.built()
        discarded = _count("inference_engine_prefix_cache_forks_total", outcome="discarded")
        unwanted = FallbackFork(service.cache, service.transfer, ANONYMOUS, lambda: False)
        await unwanted.start(made.session_id)
        unwanted.finish(is_wanted=False)  # before it is built: closed when it is
        await unwanted.built()
        assert _count("inference_engine_prefix_cache_forks_total", outcome="discarded") == discarded + 1
        assert (gone.session_id, draining.session_id, unwanted.session_id) == (None, None, None)
        assert len(service.cache) == 0 and [x.session_id for x in s.runtime.store.sessions()] == [made.session_id]


async def test_a_reply_ends_without_its_fork_and_the_next_turn_waits_for_it(tiny_engine):
    """The fork's build held open: the reply still ends (it does not wait for its fork), and the identity's
    next turn waits for the fork, then is served from it; another identity's request does not wait."""
    auth = Authenticator(TokenTable(list(TOKENS)))
    async with http_api(tiny_engine, authenticator=auth, max_sessions=8) as s:
        service = s.http.serving.service
        real_fork, gate, built = service.transfer.fork, asyncio.Event(), asyncio.Event()

        async def held_fork(*args, **kwargs):
            made = await real_fork(*args, **kwargs)
            built.set()
            await gate.wait()
            return made

        service.transfer.fork = held_fork
        async with s.client(api_key=TOKENS[0]) as a, s.client(api_key=TOKENS[1]) as b:
            first = await asyncio.wait_for(  # a bound on a hang (an end that waited for its fork), not a measure
                a.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0), 60)
            await built.wait()
            assert service.cache.forks() == 0 and service.cache._building  # the reply ended, its fork is held
            service.transfer.fork = real_fork
            second = asyncio.ensure_future(a.completions.create(
                model=s.model, prompt=edit(PROMPT, ids(first.choices[0])), max_tokens=2, temperature=0))
            other = await b.completions.create(model=s.model, prompt=PROMPT, max_tokens=2, temperature=0)
            assert other.usage.prompt_tokens_details.cached_tokens == 0 and not second.done()  # B did not wait
            gate.set()
            assert (await second).usage.prompt_tokens_details.cached_tokens == len(PROMPT)  # from A's fork


async def test_a_fork_landing_late_goes_just_before_its_session_only(tiny_engine):
    """A's fork built after A's and then B's request ended: LRU order is [A's fork, A, B], B still the newest."""
    async with http_api(tiny_engine, max_sessions=8) as s:
        cache = s.http.serving.service.cache
        made = [(await s.runtime.create_session(CreateSessionParams((), "t", 0, 0))).session_id for _ in range(3)]
        session_a, session_b, fork_a = made
        assert cache.keep(session_a, ANONYMOUS) and cache.keep(session_b, ANONYMOUS)
        assert cache.keep(fork_a, ANONYMOUS, is_fork=True, before=session_a)
        assert list(cache._kept) == [fork_a, session_a, session_b]


async def test_only_an_ended_requests_fork_holds_the_next_lookup_and_not_for_ever(tiny_engine, monkeypatch):
    """A fork of a request still decoding holds no other request of its identity (every unauthenticated
    client shares one); once its request ended it does, for at most SETTLE_TIMEOUT_S."""
    async with http_api(tiny_engine, max_sessions=8) as s:
        service = s.http.serving.service
        real_fork, gate = service.transfer.fork, asyncio.Event()

        async def held_fork(*args, **kwargs):
            made = await real_fork(*args, **kwargs)
            await gate.wait()
            return made

        service.transfer.fork = held_fork
        async with s.client() as c:
            stream = await c.completions.create(model=s.model, prompt=PROMPT, max_tokens=REPLY, temperature=0,
                                                stream=True)
            chunks = stream.__aiter__()
            await chunks.__anext__()  # the reply decodes, its fork is held
            assert not service.cache._building  # nobody waits for it yet
            other = await asyncio.wait_for(  # a bound on a hang, not a measure
                c.completions.create(model=s.model, prompt=[9, 9, 9], max_tokens=2, temperature=0), 60)
            assert other.usage.completion_tokens == 2
            async for _ in chunks:  # the reply ends: now its fork holds the identity's next lookup
                pass
            assert service.cache._building
            monkeypatch.setattr("inference_engine.server.openai_api.prefix_cache.SETTLE_TIMEOUT_S", 0.05)
            late = await asyncio.wait_for(  # the fork never lands in time: the lookup goes on without it
                c.completions.create(model=s.model, prompt=[9, 9, 9, 9], max_tokens=2, temperature=0), 60)
            assert late.usage.completion_tokens == 2 and service.cache._building
            gate.set()
            await settled(service.cache)
        assert service.cache.forks() <= 1
