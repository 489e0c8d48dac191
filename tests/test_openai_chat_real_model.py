"""The HTTP API's chat endpoint on the packaged SmolLM2-135M (real text), with the official client:
chat streamed and not, stop strings, logprobs, and the exact prefix cache over a 6-turn conversation."""

from __future__ import annotations

import pytest

from inference_engine import metrics
from tests.openai_helpers import http_api

pytestmark = pytest.mark.real_model
QUESTIONS = ("Name a fruit.", "What colour is it?", "Is it sweet?", "Where does it grow?", "Name another one.",
             "Thanks!")


def _reuse(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("inference_engine_chat_reply_reuse_total", {"outcome": outcome}) or 0.0


async def test_chat_plain_streamed_stop_and_logprobs(real_engine):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Count from 1 to 9."}]
    async with http_api(real_engine, default_window=256) as s, s.client() as c:
        r = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=16, temperature=0,
                                            logprobs=True, top_logprobs=2)
        text = r.choices[0].message.content
        assert r.object == "chat.completion" and r.choices[0].message.role == "assistant" and text
        assert "<|im_end|>" not in text and r.usage.completion_tokens == len(r.choices[0].model_extra["token_ids"])
        content = r.choices[0].logprobs.content
        assert "".join(lp.token for lp in content) == text if r.choices[0].finish_reason == "length" else True
        assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob == lp.logprob for lp in content)
        stream = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=16, temperature=0,
                                                 stream=True)
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
        cut = text[len(text) // 2:].strip()[:1] or "3"  # a character of the reply's second half
        stopped = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=16, temperature=0,
                                                  stop=[cut])
        assert stopped.choices[0].finish_reason == "stop" and cut not in stopped.choices[0].message.content
        assert text.startswith(stopped.choices[0].message.content)
        parts = [{"role": "system", "content": [{"type": "text", "text": "Answer "}, {"type": "text", "text": "briefly."}]},
                 messages[1], {"role": "assistant", "content": None}, {"role": "user", "content": "Again."}]
        assert (await c.chat.completions.create(model=s.model, messages=parts, max_tokens=2)).usage.completion_tokens
        done = await c.completions.create(model=s.model, prompt="The capital of France is", max_tokens=4, temperature=0)
        assert done.choices[0].text and done.usage.prompt_tokens == 5


async def test_logprobs_carry_each_tokens_own_bytes(real_engine):
    """A token holding part of a UTF-8 character is named `bytes:\\x..` with its own bytes, so the bytes of a
    reply's tokens rebuild its text; completions' top_logprobs always hold the chosen token, and their text
    offsets count characters."""
    messages = [{"role": "user", "content": "Repeat exactly: 🦄🦄 日本語"}]
    async with http_api(real_engine, default_window=256) as s, s.client() as c:
        r = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, top_logprobs=2)
        content, text = r.choices[0].logprobs.content, r.choices[0].message.content
        assert "🦄" in text and any(lp.token.startswith("bytes:\\x") for lp in content)  # SmolLM2 splits the emoji
        joined = b"".join(bytes(lp.bytes) for lp in content)  # a character cut by max_tokens is not in the text:
        assert joined.decode("utf-8", "ignore") == text and joined.startswith(text.encode())
        assert all(lp.token.startswith("bytes:") == ("\ufffd" in bytes(lp.bytes).decode("utf-8", "replace"))
                   for lp in content)
        done = await c.completions.create(model=s.model, prompt="Unicorns: 🦄🦄🦄", max_tokens=8, temperature=0.9,
                                          seed=5, logprobs=0)
        lp = done.choices[0].logprobs
        assert [list(top) for top in lp.top_logprobs] == [[t] for t in lp.tokens]  # logprobs 0: the chosen only
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert lp.text_offset[-1] <= len(done.choices[0].text)


def _forks(outcome: str) -> float:
    return metrics.REGISTRY.get_sample_value("inference_engine_prefix_cache_forks_total", {"outcome": outcome}) or 0.0


async def _converse(served, seed: int) -> tuple[list[str], list[int]]:
    messages, replies, cached = [], [], []
    async with served.client() as c:
        for turn, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            r = await c.chat.completions.create(model=served.model, messages=messages, max_tokens=8,
                                                temperature=0.7, seed=seed + turn)
            reply = r.choices[0].message.content
            replies.append(reply)
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply})
    return replies, cached


async def test_six_turn_chat_is_identical_with_the_prefix_cache(real_engine):
    async with http_api(real_engine, default_window=512, prefix_cache_bytes=0) as s:
        plain, none_cached = await _converse(s, 11)
    reused, retokenized = _reuse("reused"), _reuse("retokenized")
    async with http_api(real_engine, default_window=512) as s:
        replies, cached = await _converse(s, 11)
    assert replies == plain
    assert none_cached == [0] * 6
    assert cached[0] == 0 and all(b > a for a, b in zip(cached, cached[1:])), cached
    assert _reuse("reused") - reused == 6 and _reuse("retokenized") == retokenized  # every reply was reusable


async def _edited_turns(served) -> tuple[list, list[str]]:
    """Turn 1 asks for a long reply; turn 2 sends it back edited (it no longer renders to the tokens the model
    generated, from its first token: beyond --max-rollback) and asks for a one-word reply."""
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "Count from 1 to 20, separated by commas."}]
    async with served.client() as c:
        first = await c.chat.completions.create(model=served.model, messages=messages, max_tokens=24, temperature=0)
        messages += [{"role": "assistant", "content": "Sure! " + first.choices[0].message.content},
                     {"role": "user", "content": "Is seven a prime number? Answer yes or no."}]
        second = await c.chat.completions.create(model=served.model, messages=messages, max_tokens=24, temperature=0)
    return [first, second], [r.choices[0].message.content for r in (first, second)]


async def test_an_edited_reply_is_served_by_the_fallback_fork(real_engine):
    async with http_api(real_engine, default_window=512, prefix_cache_bytes=0) as s:
        _, plain = await _edited_turns(s)
    taken, discarded = _forks("taken"), _forks("discarded")
    async with http_api(real_engine, default_window=512, max_sessions=6) as s:
        (first, second), replies = await _edited_turns(s)
        cache = s.http.serving.service.cache
        assert replies == plain  # bitwise the replies without the cache
        assert first.usage.completion_tokens > 8  # a reply no rollback undoes: turn 1 kept a fork of its prompt
        assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens  # served by that fork
        assert second.usage.completion_tokens <= 8, replies[1]  # a short reply: its own fork was discarded
        assert (_forks("taken"), _forks("discarded")) == (taken + 2, discarded + 1)
        assert (len(cache), cache.forks()) == (2, 0)  # turn 1's and turn 2's full sessions
