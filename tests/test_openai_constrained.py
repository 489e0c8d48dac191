"""response_format and tools on the HTTP API, through the official `openai` client, on the packaged model."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.openai_helpers import http_api

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
        held = s.runtime.store.slabs_in_use  # sessions the prefix cache kept
        with pytest.raises(openai.BadRequestError) as err:
            await c.chat.completions.create(model=s.model, messages=messages, response_format={
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}})
        assert err.value.code == "invalid_constraint" and "unclosed group" in err.value.message
        assert s.runtime.store.slabs_in_use == held  # refused before any session was opened


async def test_tool_calls_named_required_auto_and_none(real_engine):
    async with http_api(real_engine, default_window=256) as s, s.client() as c:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            r = await c.chat.completions.create(model=s.model, messages=ASK, max_tokens=48, temperature=0,
                                                tools=[WEATHER, TIME], tool_choice=choice)
            (call,) = r.choices[0].message.tool_calls
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
            assert call.type == "function" and call.id.startswith("call_")
            tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])
            stream = await c.chat.completions.create(model=s.model, messages=ASK, max_tokens=48, temperature=0,
                                                     tools=[WEATHER, TIME], tool_choice=choice, stream=True)
            chunks = [ch async for ch in stream]
            deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
            assert [d.function.name for d in deltas] == [call.function.name]
            assert deltas[0].function.arguments == call.function.arguments and deltas[0].index == 0
            assert chunks[-1].choices[0].finish_reason == "tool_calls"
        auto = await c.chat.completions.create(model=s.model, messages=ASK, max_tokens=48, temperature=0,
                                               tools=[WEATHER])
        message = auto.choices[0].message
        if message.tool_calls:  # auto: the model chose a call, or text that does not start like one
            assert auto.choices[0].finish_reason == "tool_calls"
            jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])
        else:
            assert not message.content.startswith("{")
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
                           (dict(tools=[WEATHER], response_format={"type": "json_object"}), "response_format")):
            with pytest.raises(openai.BadRequestError) as err:
                await c.chat.completions.create(model=s.model, messages=ASK, **bad)
            assert err.value.param == param, err.value.message
