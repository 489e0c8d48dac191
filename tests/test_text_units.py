"""Text-layer and edge units without a model: codec errors, the address variable, Tokenize's input rules."""

import subprocess
import sys
from types import SimpleNamespace

import grpc
import mlx.core as mx
import pytest

from inference_engine.address import default_address
from inference_engine.decoding.sampler import SamplingParams, choose, distribution
from inference_engine.errors import FeatureUnavailable, InvalidRequest
from inference_engine.runtime.engine import Engine
from inference_engine.text.codec import ChatMessage, TextCodec, require
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server
from tests.kernel_guard import assert_full_tile


def _codec(template: str | None, render=None) -> TextCodec:
    hf = SimpleNamespace(backend_tokenizer=None, chat_template=template, bos_token_id=None, apply_chat_template=render)
    return TextCodec(hf)


def test_codec_errors_name_what_is_missing():
    with pytest.raises(FeatureUnavailable, match="no chat template"):
        _codec(None).render([ChatMessage("user", "hi")], True)

    def refuse(*args, **kwargs):
        raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(InvalidRequest, match="refused these messages: ValueError: Conversation roles must alternate"):
        _codec("{{ x }}", refuse).render([ChatMessage("user", "hi")], True)
    assert _codec(None).bos_token_id is None
    with pytest.raises(FeatureUnavailable, match="no tokenizer"):
        require(None)


def test_sampler_edges():
    with pytest.raises(ValueError, match="greedy"):
        distribution(mx.zeros((4,)), SamplingParams(), ())
    x = mx.array([0.0, 3.0, 1.0, 2.0], dtype=mx.bfloat16)
    assert choose(x, SamplingParams(temperature=0.5, seed=1, top_k=1), 0) == 1


def test_address_variable(monkeypatch):
    monkeypatch.setenv("INFERENCE_ENGINE_ADDRESS", "10.0.0.2:6000")
    assert default_address() == ("10.0.0.2", 6000)
    monkeypatch.setenv("INFERENCE_ENGINE_ADDRESS", "nohost")
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        default_address()
    env = {"INFERENCE_ENGINE_ADDRESS": "nohost", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "inference_engine", "serve"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 2 and "INFERENCE_ENGINE_ADDRESS='nohost' is not HOST:PORT" in out.stderr


@pytest.fixture(scope="module")
def engine(tiny):
    e = assert_full_tile(Engine(tiny, exact=True, max_tile=16, plain_block=64, max_rollback=8))
    yield e
    e.close()


@pytest.mark.parametrize("request_,fragment", [
    (pb.TokenizeRequest(text="a", messages=[pb.ChatMessage(role="user")]), "exactly one of text, messages"),
    (pb.TokenizeRequest(messages=[pb.ChatMessage(role="user")], add_special_tokens=True), "applies to text only"),
    (pb.TokenizeRequest(text="a", add_generation_prompt=True), "applies to messages only"),
    (pb.TokenizeRequest(messages=[pb.ChatMessage(role="x" * 65)]), "ChatMessage.role has 65"),
])
async def test_tokenize_input_rules(engine, request_, fragment):
    async with running_server(engine) as (stub, _):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Tokenize(request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in err.value.details()
