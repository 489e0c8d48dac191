"""No client stalls the others with text: inputs are bounded by --max-text-chars before they are
tokenized (INVALID_ARGUMENT naming the flag), and the tokenizer runs without the GIL, so other
threads (the engine's) keep running while a large text is encoded or decoded."""

import threading

import grpc
import pytest
from transformers import AutoTokenizer

from inference_engine.text.codec import TextCodec
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

LIMIT = 1000


async def _error(coro) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await coro
    return err.value


def _msg(content: str) -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=content)


async def test_text_over_the_bound_is_refused_before_tokenizing(tiny_engine):
    """The tiny model has no tokenizer: a text within the bound gets as far as needing one
    (FAILED_PRECONDITION); one over it is refused before (INVALID_ARGUMENT, the flag named)."""
    async with running_server(tiny_engine, max_text_chars=LIMIT) as (stub, runtime):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        half = "x" * (LIMIT // 2 + 1)  # two messages each within the bound, together over it
        over = [
            (stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text="x" * (LIMIT + 1))),
             f"AppendTokensRequest.text has {LIMIT + 1} characters; allowed 1..{LIMIT} (--max-text-chars)"),
            (stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[_msg(half), _msg(half)])),
             f"AppendTokensRequest.messages.content has {2 * len(half)} characters of content together; allowed "
             f"0..{LIMIT} (--max-text-chars)"),
            (stub.Tokenize(pb.TokenizeRequest(text="x" * (LIMIT + 1))),
             f"TokenizeRequest.text has {LIMIT + 1} characters; allowed 0..{LIMIT} (--max-text-chars)"),
            (stub.Tokenize(pb.TokenizeRequest(messages=[_msg(half), _msg(half)])),
             f"TokenizeRequest.messages.content has {2 * len(half)} characters of content together; allowed "
             f"0..{LIMIT} (--max-text-chars)"),
        ]
        for call, message in over:
            err = await _error(call)
            assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)
        within = [
            stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text="x" * LIMIT)),
            stub.Tokenize(pb.TokenizeRequest(messages=[_msg("x" * (LIMIT // 2)), _msg("x" * (LIMIT // 2))])),
        ]
        for call in within:
            err = await _error(call)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "no tokenizer" in err.details()
        info = await stub.GetSessionInfo(pb.GetSessionInfoRequest(session_id=sid))
        assert info.history_length == 0


@pytest.fixture(scope="module")
def codec(real_model_path) -> TextCodec:
    return TextCodec(AutoTokenizer.from_pretrained(real_model_path))


def test_encoding_and_decoding_leave_the_gil_to_other_threads(codec):
    """While one large text is encoded (and decoded), another Python thread keeps running: it counts
    its turns strictly inside the call. Holding the GIL for the call (the bindings' plain encode and
    decode) leaves it none."""
    text = "漢字かな交じり文、 hello world. " * 12_000  # ~0.3 M characters: a long call
    ids = codec.backend.encode(text, add_special_tokens=False).ids  # what the codec must give back

    def turns_during(call):
        inside, stop, turns = threading.Event(), threading.Event(), []

        def other():
            while not stop.is_set():
                if inside.is_set():
                    turns.append(1)
                stop.wait(0.001)

        thread = threading.Thread(target=other)
        thread.start()
        inside.set()
        result = call()
        inside.clear()
        stop.set()
        thread.join()
        return result, len(turns)

    encoded, encode_turns = turns_during(lambda: codec.encode(text))
    decoded, decode_turns = turns_during(lambda: codec.decode(encoded * 4))
    assert encoded == ids and decoded == codec.backend.decode(ids * 4, skip_special_tokens=False)
    # Holding the GIL leaves the other thread a turn or two at the call's edges (measured: 1-2); released,
    # it gets hundreds (measured: ~290 encoding, ~150 decoding).
    assert encode_turns >= 20 and decode_turns >= 20, (encode_turns, decode_turns)
