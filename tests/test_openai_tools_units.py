"""The HTTP API's tools and response_format as plans and constraints (server/openai_api/tools.py), no model."""

import json

import pytest

from inference_engine.errors import InvalidRequest
from inference_engine.runtime.types import GenerateChunk, StopReason
from inference_engine.server.openai_api.call_reader import CallReader
from inference_engine.server.openai_api.completions import ChoiceChunk, CompletionUsage
from inference_engine.server.openai_api.render import ResponseWriter
from inference_engine.server.openai_api.schema import ChatCompletionRequest, MessageFunction, MessageToolCall, ResponseFormat
from inference_engine.server.openai_api.tools import (
    MAX_TOOLS,
    message_text,
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
    for name in ("", "x" * 65, "a b"):  # OpenAI's rule: 1..64 letters, digits, '_' or '-'
        with pytest.raises(InvalidRequest, match="json_schema.name"):
            response_constraint(ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": name}}))


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
    calls = [MessageToolCall(function=MessageFunction(name="f", arguments='{"a": 1}')),
             MessageToolCall(function=MessageFunction(name="f", arguments="{oops"))]
    assert message_text("assistant", "", calls, None) == ("assistant", '{"name":"f","arguments":{"a":1}}\n'
                                                                      '{"name":"f","arguments":"{oops"}')
    assert message_text("assistant", "ok", calls[:1], None)[1].startswith("ok\n")
    city = [MessageToolCall(function=MessageFunction(name="f", arguments='{"city":"河南"}'))]  # a reply's call, as written
    assert message_text("assistant", "", city, None)[1] == '{"name":"f","arguments":{"city":"河南"}}'
    as_object = [MessageToolCall(function=MessageFunction(name="f", arguments={"city": "河南"}))]  # a common client slip
    assert message_text("assistant", "", as_object, None)[1] == '{"name":"f","arguments":{"city":"河南"}}'
    assert message_text("tool", "18 C", None, "call_1") == ("user", "Tool result (call_1): 18 C")
    assert message_text("user", "x", None, None) == ("user", "x")


def _read(pieces: list[str], names: tuple[str, ...] = ("f",)) -> tuple[CallReader, list]:
    reader = CallReader(names)
    return reader, [*(reader.read(p) for p in pieces), reader.end()]


def test_a_call_read_piece_by_piece_is_the_call_read_whole():
    text = '{"name":"f","arguments":{"a":{"b":"}"},"c":"é"}}'
    whole, _ = _read([text])
    assert whole.is_complete and whole.call.name == "f" and whole.arguments == '{"a":{"b":"}"},"c":"é"}'
    for cut in range(1, len(text)):  # every split: the fragments concatenate to the same arguments
        reader, pieces = _read([text[:cut], text[cut:]])
        starts = [p.call for p in pieces if p.call is not None]
        assert len(starts) == 1 and starts[0].arguments == "" and starts[0].id.startswith("call_")
        assert "".join(p.arguments for p in pieces) == whole.arguments == reader.arguments and reader.is_complete
        assert not any(p.content for p in pieces)
    _, pieces = _read(['{"name":"f","arguments":{"a":1}', "}"])
    assert [p.arguments for p in pieces] == ["{\"a\":1", "}", ""]  # a last `}` is held until more comes


def test_text_calls_cut_short_and_unknown_names():
    reader, pieces = _read(["", "Hel", "lo {x}"])
    assert [p.content for p in pieces] == ["", "Hel", "lo {x}", ""] and reader.call is None
    reader, pieces = _read(['{"name":"f","argu', 'ments":{"a"'])  # cut short: keeps what it has
    assert reader.call.name == "f" and not reader.is_complete and reader.arguments == '{"a"'
    reader, pieces = _read(['{"name":"f","argu'])  # cut before the name is known: its text as content
    assert reader.call is None and pieces[-1].content == '{"name":"f","argu'
    reader, pieces = _read(['{"name":"g","arguments":{}}'])  # not among the names: text
    assert reader.call is None and pieces[-1].content == '{"name":"g","arguments":{}}'
    reader, _ = _read(['{"name":"f","arguments":{"a":1}  '])  # no call's closing `}`: cut short
    assert reader.call is not None and not reader.is_complete
    reader, _ = _read(['{"name":"f","arguments":{"a":{}}'])  # the `}` closes the arguments: cut short
    assert not reader.is_complete and reader.arguments == '{"a":{}}'


def test_streamed_replies_under_tools():
    plan = tool_plan(_body(tools=[_tool("f")]))
    writer = ResponseWriter(True, "m", "fp", None, 3, plan)

    def pieces(i: int, text: str, stop: StopReason | None = None) -> list[dict]:
        return [c["choices"][0] for c in writer.chunks(ChoiceChunk(i, GenerateChunk((1,), stop, text=text)), False)]

    assert [p["delta"] for p in pieces(0, "")] == [{"role": "assistant"}]  # nothing known yet
    assert [p["delta"] for p in pieces(0, "Hel")] == [{"content": "Hel"}]  # not a call: the text goes out
    (end,) = pieces(0, "lo", StopReason.EOS)
    assert end["finish_reason"] == "stop" and end["delta"] == {"content": "lo"}
    assert [p["delta"] for p in pieces(1, '{"name":"f",')] == [{"role": "assistant"}]  # a call: held
    start, first = pieces(1, '"arguments":{"a"')  # the name is known: the call, then its first fragment
    (call,) = start["delta"]["tool_calls"]
    assert call["index"] == 0 and call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": ""} and start["token_ids"] == [1]
    assert first["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]}
    assert first["token_ids"] == [] and first["finish_reason"] is None
    (more,) = pieces(1, ':1}}')
    assert more["delta"]["tool_calls"][0]["function"] == {"arguments": ":1}"}
    (last,) = pieces(1, "", StopReason.CONSTRAINT_COMPLETE)
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    pieces(2, '{"name":"f","argu')
    (cut,) = pieces(2, "ments", StopReason.MAX_TOKENS)  # cut short before the name: its text, finish length
    assert cut["finish_reason"] == "length" and cut["delta"] == {"content": '{"name":"f","arguments'}


def test_the_final_object_reads_a_reply_as_the_stream_does():
    plan = tool_plan(_body(tools=[_tool("f")], parallel_tool_calls=False))
    writer = ResponseWriter(True, "m", "fp", None, 3, plan)
    for i, (text, stop) in enumerate((('{"name":"f","arguments":{"a":"é"}}', StopReason.CONSTRAINT_COMPLETE),
                                      ('{"name":"f","arguments":{"a', StopReason.MAX_TOKENS),
                                      ("Hi", StopReason.EOS))):
        writer.add(ChoiceChunk(i, GenerateChunk((1,), None, text=text)))
        writer.add(ChoiceChunk(i, GenerateChunk((), stop, text="")))
    done, cut, text = writer.final(CompletionUsage(1, 3, 0), False)["choices"]
    (call,) = done["message"]["tool_calls"]
    assert done["finish_reason"] == "tool_calls" and done["message"]["content"] is None
    assert call["function"] == {"name": "f", "arguments": '{"a":"é"}'}  # the model's text, not re-serialized
    assert cut["finish_reason"] == "length" and cut["message"]["tool_calls"][0]["function"]["arguments"] == '{"a'
    assert text["message"] == {"role": "assistant", "content": "Hi"} and text["finish_reason"] == "stop"
    for bad in ("yes", 1):
        with pytest.raises(ValueError, match="parallel_tool_calls"):
            _body(tools=[_tool("f")], parallel_tool_calls=bad)
