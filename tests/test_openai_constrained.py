"""response_format and tools on the HTTP API, through the official `openai` client, on the packaged model."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.openai_helpers import forks_settled, http_api

pytestmark = pytest.mark.real_model
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
AGAIN = [{"role": "user", "content": "Weather in Paris?"},  # a call before: the small model calls again
         {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
         {"role": "user", "content": "Weather in 東京?"}]  # greedy: a call whose city has characters of several tokens


async def test_response_format_json_schema_and_json_object(real_engine):
    messages = [{"role": "user", "content": "Invent a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    async with http_api(real_engine, default_window=256) as s, s.client() as c:
        for seed in (None, 3):
            r = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=48, seed=seed,
                                                temperature=0 if seed is None else 0.7, response_format=fmt)
            assert r.choices[0].finish_reason == "stop"
            jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
        stream = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=48, temperature=0,
                                                 response_format=fmt, stream=True)
        chunks = [ch async for ch in stream]
        streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        jsonschema.validate(json.loads(streamed), PERSON)
        r = await c.chat.completions.create(model=s.model, messages=messages, max_tokens=64, temperature=0,
                                            response_format={"type": "json_object"})
        text = r.choices[0].message.content  # any object: the model may go on past max_tokens
        assert isinstance(json.loads(text), dict) if r.choices[0].finish_reason == "stop" else text.startswith("{")
        await forks_settled(s)  # the replies' fallback forks, kept or closed
        held = s.runtime.store.slabs_in_use  # sessions the prefix cache kept
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=s.model, messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}})
        assert err.value.code == "invalid_constraint" and "unclosed group" in err.value.message
        assert err.value.param == "response_format" and err.value.body["message"].startswith("response_format is invalid")
        assert s.runtime.store.slabs_in_use == held  # refused before any session was opened


async def _streamed(c: openai.AsyncOpenAI, **kw) -> tuple[object, list, list[str]]:
    """A streamed request through the client's streaming helper: its accumulated completion, raw chunks and
    argument fragments."""
    chunks, fragments = [], []
    async with c.chat.completions.stream(stream_options={"include_usage": True}, **kw) as stream:
        async for event in stream:
            if event.type == "chunk":
                chunks.append(event.chunk)
            elif event.type == "tool_calls.function.arguments.delta" and event.arguments_delta:
                fragments.append(event.arguments_delta)
        try:
            final = await stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:  # the helper's parsing refuses a reply cut by max_tokens
            final = cut.completion
        return final, chunks, fragments


def _same_reply(streamed, plain) -> None:
    """The streamed completion, as the client accumulated it, is the non-streamed one."""
    a, b = streamed.choices[0], plain.choices[0]
    assert (a.finish_reason, a.message.content) == (b.finish_reason, b.message.content)
    calls = lambda m: [(t.type, t.function.name, t.function.arguments) for t in m.tool_calls or []]  # noqa: E731
    assert calls(a.message) == calls(b.message)
    assert streamed.usage.completion_tokens == plain.usage.completion_tokens


async def test_tool_calls_named_required_auto_and_none(real_engine):
    async with http_api(real_engine, default_window=256) as s, s.client() as c:
        for choice, parallel in (({"type": "function", "function": {"name": "get_weather"}}, False),
                                 ("required", True)):
            ask = dict(model=s.model, messages=ASK, max_tokens=48, temperature=0, tools=[WEATHER, TIME],
                       tool_choice=choice, parallel_tool_calls=parallel)
            r = await c.chat.completions.create(**ask)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
            assert call.type == "function" and call.id.startswith("call_")
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            streamed, chunks, fragments = await _streamed(c, **ask)
            _same_reply(streamed, r)  # bitwise the same arguments text
            assert len(fragments) > 1 and "".join(fragments) == call.function.arguments
            deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
            first = deltas[0]  # OpenAI's shape: id, type and name first, then argument fragments
            assert first.id.startswith("call_") and first.type == "function" and first.index == 0
            assert (first.function.name, first.function.arguments) == (call.function.name, "")
            assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
            assert [d.function.arguments for d in deltas[1:]] == fragments
            last, usage = chunks[-2:]
            assert last.choices[0].finish_reason == "tool_calls" and last.choices[0].delta.tool_calls is None
            assert usage.choices == [] and usage.usage.completion_tokens == r.usage.completion_tokens
        replies = set()
        for messages, max_tokens in ((ASK, 8), (AGAIN, 32)):  # greedy, the packaged model answers ASK in text,
            ask = dict(model=s.model, messages=messages, max_tokens=max_tokens, temperature=0,  # AGAIN with a call
                       tools=[WEATHER, TIME])
            auto = await c.chat.completions.create(**ask)  # auto: a call, or text that does not start like one
            message = auto.choices[0].message
            streamed, _, fragments = await _streamed(c, **ask)
            _same_reply(streamed, auto)
            if message.tool_calls:
                arguments = message.tool_calls[0].function.arguments
                assert auto.choices[0].finish_reason == "tool_calls" and message.content is None
                jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
                assert not arguments.isascii() and "".join(fragments) == arguments
                assert not any("\ufffd" in f for f in fragments)  # no fragment splits a character
            else:
                assert not message.content.startswith("{")
            replies.add("call" if message.tool_calls else "text")
        assert replies == {"text", "call"}  # both kinds of auto reply were streamed
        none = await c.chat.completions.create(model=s.model, messages=ASK, max_tokens=8, temperature=0,
                                               tools=[WEATHER], tool_choice="none")
        assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason in ("stop", "length")
        result = [*ASK, {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                      "name": "get_weather", "arguments": '{"city":"Paris","unit":"celsius"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
        answer = await c.chat.completions.create(model=s.model, messages=result, max_tokens=16, temperature=0,
                                                 tools=[WEATHER], tool_choice="none")
        assert answer.choices[0].message.content
        for bad, param in ((dict(tool_choice="required"), "tool_choice"),
                           (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
                            "tool_choice"),
                           (dict(tools=[WEATHER, WEATHER]), "tools"),
                           (dict(tools=[WEATHER], parallel_tool_calls="yes"), "parallel_tool_calls"),
                           (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format")):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=s.model, messages=ASK, **bad)
            assert err.value.param == param, err.value.message
            assert err.value.status_code == 400 and err.value.body["type"] == "invalid_request_error"
