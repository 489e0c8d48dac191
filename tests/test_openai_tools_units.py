"""The HTTP API's tools and response_format as plans and constraints (server/openai_api/tools.py), no model."""

import json

import pytest

from inference_engine.errors import InvalidRequest
from inference_engine.runtime.types import GenerateChunk, StopReason
from inference_engine.server.openai_api.completions import ChoiceChunk
from inference_engine.server.openai_api.render import ResponseWriter
from inference_engine.server.openai_api.schema import ChatCompletionRequest, ResponseFormat
from inference_engine.server.openai_api.tools import (
    MAX_TOOLS,
    message_text,
    parse_call,
    response_constraint,
    tool_plan,
    with_tools,
)
from inference_engine.text.codec import ChatMessage


def _body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


def test_response_formats():
    assert response_constraint(None) is None and response_constraint(ResponseFormat(type="text")) is None
    assert response_constraint(ResponseFormat(type="json_object")).kind == "json_object"
    schema = {"type": "array"}
    c = response_constraint(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {
        "name": "a", "schema": schema}}))
    assert (c.kind, json.loads(c.source)) == ("json_schema", schema)
    default = response_constraint(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "a"}}))
    assert json.loads(default.source) == {"type": "object"}
    with pytest.raises(InvalidRequest, match="json_schema is required"):
        response_constraint(ResponseFormat(type="json_schema"))


def test_tool_plans():
    assert tool_plan(_body()) is None and tool_plan(_body(tools=[_tool("f")], tool_choice="none")) is None
    auto = tool_plan(_body(tools=[_tool("f"), _tool("g", {"type": "object"})]))
    assert auto.constraint.kind == "grammar" and "%json" in auto.constraint.source and auto.names == ("f", "g")
    named = tool_plan(_body(tools=[_tool("f"), _tool("g")], tool_choice={"type": "function", "function": {"name": "g"}}))
    schema = json.loads(named.constraint.source)
    assert named.names == ("g",) and [c["properties"]["name"] for c in schema["anyOf"]] == [{"const": "g"}]
    assert '"name": "g"' in named.system and '"name": "f"' not in named.system
    for fields, words in (({"tools": [_tool("f")] * (MAX_TOOLS + 1)}, "allowed 1..64"),
                          ({"tools": [_tool("bad name")]}, "is not 1..64"),
                          ({"tool_choice": "auto"}, "needs tools")):
        with pytest.raises(InvalidRequest, match=words):
            tool_plan(_body(**fields))


def test_rendering_and_parsing():
    plan = tool_plan(_body(tools=[_tool("f")], tool_choice="required"))
    user = [ChatMessage("user", "hi")]
    assert with_tools(user, None) == user
    assert with_tools(user, plan) == [ChatMessage("system", plan.system), *user]
    merged = with_tools([ChatMessage("system", "Be brief."), *user], plan)
    assert merged[0].content.startswith("Be brief.\n\n") and len(merged) == 2
    calls = [{"function": {"name": "f", "arguments": '{"a": 1}'}}, {"function": {"name": "f", "arguments": "{oops"}}]
    assert message_text("assistant", "", calls, None) == ("assistant", '{"name":"f","arguments":{"a":1}}\n'
                                                                      '{"name":"f","arguments":"{oops"}')
    assert message_text("assistant", "ok", calls[:1], None)[1].startswith("ok\n")
    assert message_text("tool", "18 C", None, "call_1") == ("user", "Tool result (call_1): 18 C")
    assert message_text("user", "x", None, None) == ("user", "x")
    call = parse_call('{"name":"f","arguments":{"a":1}}', ("f",))
    assert call.name == "f" and call.arguments == '{"a":1}' and call.id.startswith("call_")
    assert parse_call('{"name":"g","arguments":{}}', ("f",)) is None
    assert parse_call('{"name":"f","arguments":{"a"', ("f",)) is None


def test_streamed_replies_under_tools():
    plan = tool_plan(_body(tools=[_tool("f")]))
    writer = ResponseWriter(True, "m", "fp", None, 3, plan)

    def piece(i: int, text: str, stop: StopReason | None = None) -> dict:
        return writer.chunk(ChoiceChunk(i, GenerateChunk((1,), stop, text=text)), False)["choices"][0]

    assert piece(0, "")["delta"] == {"role": "assistant"}  # nothing known yet
    assert piece(0, "Hel")["delta"] == {"content": "Hel"}  # not a call: the text goes out
    assert piece(0, "lo", StopReason.EOS)["finish_reason"] == "stop"
    assert piece(1, '{"name":"f",')["delta"] == {"role": "assistant"}  # a call: held
    last = piece(1, '"arguments":{}}', StopReason.CONSTRAINT_COMPLETE)
    assert last["finish_reason"] == "tool_calls"
    (call,) = last["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "f", "arguments": "{}"}
    piece(2, '{"name":"f","argu')
    cut = piece(2, "ments", StopReason.MAX_TOKENS)  # cut short: its text, finish_reason length
    assert cut["finish_reason"] == "length" and cut["delta"] == {"content": '{"name":"f","arguments'}
