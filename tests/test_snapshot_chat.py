"""The chat log in the snapshot file (format versions 2 and 3): exact round trips, version 1 files read
with an empty log, and every chat section a forged file could carry checked against the history."""

import json

import pytest

from inference_engine.errors import SnapshotCorrupt
from inference_engine.session import snapshot_format as fmt
from inference_engine.text.chat import ChatLog, ReplySpan
from inference_engine.text.codec import ChatMessage
from tests.test_snapshot_format import _build, _parts, _round_trip, _snapshot

N = 7  # `_snapshot()`'s history length
CHAT = ChatLog((ChatMessage("system", "Be brief."), ChatMessage("user", "2+2? é 日本 \"q\" \\ <|im_end|>"),
                ReplySpan(3, 5), ChatMessage("user", "")), reply_from=6)


def _with_chat(chat_bytes: bytes | None, version: int = fmt.FORMAT_VERSION, shape: list | None = None) -> bytes:
    """`_snapshot()`'s file with its chat section replaced (None: left out)."""
    header, body = _parts(fmt.encode(_snapshot()))
    section = header["sections"].pop()
    assert section["name"] == "chat"
    body = body[: len(body) - section["shape"][0]]
    if chat_bytes is not None:
        header["sections"].append({"name": "chat", "dtype": "|u1", "shape": shape or [len(chat_bytes)]})
        body += chat_bytes
    return _build(header, body, version=version)


def _chat(turns: list, reply_from: object = None) -> bytes:
    return json.dumps({"reply_from": reply_from, "turns": turns}).encode()


@pytest.mark.parametrize("chat", [ChatLog(), ChatLog((ChatMessage("user", "hi"),), 2), CHAT])
def test_the_chat_log_round_trips_exactly(chat):
    data, back = _round_trip(chat=chat)
    assert back.chat == chat
    assert data[8:12] == fmt.FORMAT_VERSION.to_bytes(4, "little") == b"\3\0\0\0"


def test_a_version_1_file_reads_with_an_empty_chat_log():
    back = fmt.decode(_with_chat(None, version=1))
    assert back.chat == ChatLog() and back.history_length == N and back.state_digest == "c" * 64
    with pytest.raises(SnapshotCorrupt, match="unexpected snapshot section 'chat'"):
        fmt.decode(_with_chat(_chat([]), version=1))  # version 1 never had one
    with pytest.raises(SnapshotCorrupt, match="KeyError: 'chat'"):
        fmt.decode(_with_chat(None))  # version 2 always has one


@pytest.mark.parametrize("chat_bytes,fragment", [
    (_chat([{"start": 3, "end": 8}]), r"reply span \[3, 8\) outside \[0, 7\]"),
    (_chat([{"start": 4, "end": 3}]), r"reply span \[4, 3\)"),
    (_chat([{"start": 2, "end": 5}, {"start": 4, "end": 6}]), r"reply span \[4, 6\) outside \[5, 7\]"),
    (_chat([], 8), "reply_from 8 outside"),
    (_chat([{"start": 2, "end": 5}], 4), r"reply_from 4 outside \[5, 7\]"),
    (_chat([{"start": 10**30, "end": 10**30}]), "outside"),
    (_chat([{"start": -1, "end": 3}]), "non-negative integer"),
    (_chat([], -1), "non-negative integer"),
    (_chat([], True), "non-negative integer"),
    (_chat([{"start": 1, "end": 2, "role": "user"}]), "neither"),
    (_chat([{"role": "user"}]), "neither"),
    (_chat(["user"]), "neither"),
    (_chat([{"role": 5, "content": "x"}]), "expected a string"),
    (json.dumps({"turns": []}).encode(), "not an object"),
    (json.dumps({"reply_from": None, "turns": {}}).encode(), "not an object"),
    (json.dumps([]).encode(), "not an object"),
    (b"{not json", "malformed"),
    (b"\xff\xfe", "UnicodeDecodeError"),
    (b"[" * 100000 + b"]" * 100000, "malformed"),
])
def test_a_forged_chat_section_is_corrupt(chat_bytes, fragment):
    with pytest.raises(SnapshotCorrupt, match=fragment):
        fmt.decode(_with_chat(chat_bytes))


def test_a_chat_section_of_another_shape_is_corrupt():
    chat = _chat([]) + b" "  # an even length, viewed as two rows
    with pytest.raises(SnapshotCorrupt, match="expected one dimension"):
        fmt.decode(_with_chat(chat, shape=[2, len(chat) // 2]))
    header, body = _parts(_with_chat(_chat([])))
    header["sections"][-1]["dtype"] = "<u4"  # bytes under another dtype
    with pytest.raises(SnapshotCorrupt, match="unexpected snapshot section 'chat' of dtype <u4"):
        fmt.decode(_build(header, body))
