"""Text in, text out on the packaged SmolLM2-135M: tokenizer RPCs, chat continuation, streamed
text, stop strings across tokens, logprobs against the exact logits and against mlx-lm."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from inference_engine.decoding.logprobs import log_softmax
from inference_engine.text.chat import ChatInput, ChatLog, TextInput, resolve_input
from inference_engine.text.codec import ChatMessage, TextCodec
from inference_engine.text.detokenizer import IncrementalDetokenizer
from inference_engine.v1 import runtime_pb2 as pb
from tests.conftest import running_server

pytestmark = pytest.mark.real_model
EOS = 2  # <|im_end|>


def _user(text: str) -> pb.ChatMessage:
    return pb.ChatMessage(role="user", content=text)


async def _chat_session(stub, question: str, **kw) -> tuple[str, pb.AppendTokensResponse]:
    sid = (await stub.CreateSession(pb.CreateSessionRequest(**kw))).session_id
    r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[_user(question)],
                                                       add_generation_prompt=True))
    return sid, r


async def _generate(stub, sid: str, n: int, **kw) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(pb.GenerateRequest(session_id=sid, max_new_tokens=n, **kw))]


def _tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.tokens]


def _render(tok, conversation: list[dict], add_generation_prompt: bool) -> list[int]:
    text = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


async def test_model_info_and_tokenizer_rpcs(real_model, real_engine):
    tok = real_model.tokenizer
    async with running_server(real_engine) as (stub, _):
        info = await stub.GetModelInfo(pb.GetModelInfoRequest())
        assert (info.model_name, info.vocab_size, list(info.eos_token_ids), info.bos_token_id) == (
            "smollm2-135m (fp32)", 49152, [EOS], 1)
        assert info.has_tokenizer and info.has_chat_template and info.exact and info.kernels
        text = "Héllo wörld, 日本語 🎉 <|im_start|>"
        r = await stub.Tokenize(pb.TokenizeRequest(text=text))
        assert list(r.tokens) == tok.encode(text, add_special_tokens=False) and r.text == text
        assert list(r.tokens)[-1] == 1  # special-token text becomes its id
        conv = [{"role": "user", "content": "Hi"}]
        r = await stub.Tokenize(pb.TokenizeRequest(messages=[_user("Hi")], add_generation_prompt=True))
        assert list(r.tokens) == _render(tok, conv, True)
        assert r.text == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
        d = await stub.Detokenize(pb.DetokenizeRequest(tokens=r.tokens))
        assert d.text == r.text
        d = await stub.Detokenize(pb.DetokenizeRequest(tokens=r.tokens, skip_special_tokens=True))
        assert "<|im_start|>" not in d.text and "Hi" in d.text
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        a = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, text=text))
        assert list(a.tokens) == tok.encode(text, add_special_tokens=False) and a.history_length == len(a.tokens)


async def test_three_turn_chat_equals_the_template_rendering(real_model, real_engine):
    """Turn 1 ends on EOS, turn 2 is cut by max_new_tokens; each new turn continues the history."""
    tok = real_model.tokenizer
    turns = [("What is the capital of France?", 40), ("And of Italy?", 6), ("Which of the two cities is older?", 12)]
    async with running_server(real_engine, default_window=256) as (stub, runtime):
        sid = (await stub.CreateSession(pb.CreateSessionRequest())).session_id
        conversation: list[dict] = []
        stops = []
        for question, n in turns:
            conversation.append({"role": "user", "content": question})
            r = await stub.AppendTokens(pb.AppendTokensRequest(session_id=sid, messages=[_user(question)],
                                                               add_generation_prompt=True))
            history = list(runtime.store.get(sid).history)
            assert history == _render(tok, conversation, True) and r.history_length == len(history)
            msgs = await _generate(stub, sid, n)
            reply = _tokens(msgs)
            stops.append(msgs[-1].stop_reason)
            content = tok.decode(reply[:-1] if reply[-1] == EOS else reply)
            assert tok.encode(content, add_special_tokens=False) == [t for t in reply if t != EOS]  # round trip
            assert "".join(m.text for m in msgs) == content
            conversation.append({"role": "assistant", "content": content})
        assert stops[:2] == [pb.STOP_REASON_EOS, pb.STOP_REASON_MAX_TOKENS]
        history = list(runtime.store.get(sid).history)
        whole = _render(tok, conversation, False)
        assert history == whole[: len(history)] and len(whole) - len(history) <= 2  # the last "<|im_end|>\n"


def test_chat_fallback_when_a_reply_does_not_retokenize(real_model):
    """A reply held as non-canonical tokens: the new turn is rendered after it as the template would."""
    codec, tok = TextCodec(real_model.tokenizer), real_model.tokenizer
    first = ChatInput((ChatMessage("user", "Say hello"),), True)
    r1 = resolve_input(codec, ChatLog(), [], first, (EOS,), 8192)
    reply = codec.encode("He") + codec.encode("llo")  # "Hello" re-tokenizes to other ids
    assert codec.encode("Hello") != reply
    second = ChatInput((ChatMessage("user", "Again"),), True)
    for ended in (True, False):
        history = list(r1.tokens) + reply + ([EOS] if ended else [])
        r2 = resolve_input(codec, r1.chat, history, second, (EOS,), 8192)
        assert not r2.is_continuation and r2.chat.reply_from == len(history) + len(r2.tokens)
        conversation = [{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello"},
                        {"role": "user", "content": "Again"}]
        whole = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert codec.decode(history + list(r2.tokens)) == whole  # the same text, whatever the reply's ids
    # A history built from raw text: the turn follows it without the template's system preamble.
    turn = ChatInput((ChatMessage("user", "Hi"),), False)
    r3 = resolve_input(codec, ChatLog(), codec.encode("notes"), turn, (EOS,), 99)
    assert codec.decode(list(r3.tokens)) == "<|im_start|>user\nHi<|im_end|>\n" and r3.chat.reply_from is None
    with pytest.raises(Exception, match=r"encodes to 5 tokens; allowed 1..4 \(--max-tokens-per-request\)"):
        resolve_input(codec, ChatLog(), [], TextInput("one two three four five"), (EOS,), 4)


async def test_streamed_text_never_breaks_a_character(real_model, real_engine):
    """Emoji and Japanese replies split characters across tokens, and bursts split them across calls."""
    tok = real_model.tokenizer
    async with running_server(real_engine) as (stub, _):
        for question in ("Give me three emojis about the sea.", "Translate 'thank you' into Japanese."):
            sid, _ = await _chat_session(stub, question)
            msgs = []
            for _ in range(7):
                msgs += await _generate(stub, sid, 3, ignore_eos=True)
            tokens, texts = _tokens(msgs), [m.text for m in msgs]
            assert all("\ufffd" not in t for t in texts)
            assert any(m.tokens and not m.text for m in msgs)  # a token that ended inside a character
            assert "".join(texts) == tok.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")


def test_a_real_replacement_character_is_text_like_any_other(real_model):
    """U+FFFD is a character of its own (bytes EF BF BD, one token here): streamed with its token, never
    held back as if it were bytes of a split character, nor sent again after a history ending with it;
    a character split across tokens still waits for its last byte, across calls too."""
    codec = TextCodec(real_model.tokenizer)
    for text in ("a\ufffd", "x \ufffd is it", "\u65e5\u672c\u8a9e \U0001F642\U0001F44D\U0001F3FD ok \ufffd\ufffd"):
        ids = codec.encode(text)
        for cut in range(len(ids)):  # history ids[:cut], then a Generate streaming the rest token by token
            detok = IncrementalDetokenizer(codec, ids[:cut])
            pieces = [detok.push(t) for t in ids[cut:]]
            before = codec.decode(ids[:cut])
            emitted = before.removesuffix("\ufffd") if _splits_a_character(codec, ids, cut) else before
            assert "".join(pieces) == codec.decode(ids)[len(emitted):], (text, cut, pieces)
    ids = codec.encode("a\ufffd")
    assert [IncrementalDetokenizer(codec, ids[:1]).push(ids[1])] == ["\ufffd"]  # the last token's text: now


def _splits_a_character(codec: TextCodec, ids: list[int], cut: int) -> bool:
    """Whether ids[:cut] ends inside a character (its text then arrives with the rest)."""
    whole, head = codec.decode(ids), codec.decode(ids[:cut])
    return head.endswith("\ufffd") and not whole.startswith(head)


async def test_stop_string_across_tokens(real_model, real_engine):
    tok = real_model.tokenizer
    async with running_server(real_engine) as (stub, runtime):
        sid, r = await _chat_session(stub, "Write a short poem about the sea.")
        greedy = _tokens(await _generate(stub, sid, 24, ignore_eos=True))
        pieces = [tok.decode([t]) for t in greedy]
        text = "".join(pieces)
        i = next(i for i in range(4, 20) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
                 and text.find(pieces[i][-2:] + pieces[i + 1][:2]) == len("".join(pieces[:i + 1])) - 2)
        stop = pieces[i][-2:] + pieces[i + 1][:2]  # spans the boundary between tokens i and i+1
        for mode in (pb.DECODE_MODE_GREEDY, pb.DECODE_MODE_SPECULATIVE_LOOKUP):
            sid, _ = await _chat_session(stub, "Write a short poem about the sea.")
            msgs = await _generate(stub, sid, 24, ignore_eos=True, stop=["no such text", stop], mode=mode)
            assert msgs[-1].stop_reason == pb.STOP_REASON_STOP_STRING
            assert _tokens(msgs) == greedy[: i + 2]  # up to and including the token that completed the match
            assert "".join(m.text for m in msgs) == text[: text.index(stop)]
            assert runtime.store.get(sid).history[len(r.tokens):] == greedy[: i + 2]
            rest = _tokens(await _generate(stub, sid, 4, ignore_eos=True))
            assert rest == greedy[i + 2 : i + 6]  # the session continues from there
        sid, _ = await _chat_session(stub, "Write a short poem about the sea.")
        last = (await _generate(stub, sid, 24, ignore_eos=True, stop=[text[-3:] + "zzz"]))[-1]
        assert last.stop_reason == pb.STOP_REASON_MAX_TOKENS and last.text == text[-3:]  # held back, then released


async def test_logprobs_match_exact_logits_and_mlx_lm(real_model, real_engine):
    async with running_server(real_engine) as (stub, _):
        sid, r = await _chat_session(stub, "What is the capital of France?", sink_tokens=4, window_tokens=64)
        msgs = await _generate(stub, sid, 8, ignore_eos=True, logprobs=True, top_logprobs=5)
    tokens = _tokens(msgs)
    lps = [lp for m in msgs for lp in m.logprobs]
    v = real_engine.make_verifier(4, 64)
    v.prefill(list(r.tokens))
    ours = []
    for t, lp in zip(tokens, lps):
        ref = log_softmax(v.next_token_logits)
        top = sorted(range(ref.size), key=lambda j: -ref[j])[:5]
        assert lp.token == t and lp.logprob == np.float32(ref[t])
        assert [a.token for a in lp.top] == top and [a.logprob for a in lp.top] == [np.float32(ref[j]) for j in top]
        ours.append(lp)
        v.forward_block([t])
        v.commit_or_truncate(1, 1)
    steps = zip(generate_step(mx.array(list(r.tokens)), real_model.model, max_tokens=8), range(8))
    for ((token, logprobs), _), lp in zip(steps, ours):  # same weights, other kernels: float tolerance
        theirs = np.array(logprobs)
        assert int(token) == lp.token and abs(float(theirs[lp.token]) - lp.logprob) < 1e-3
        assert np.allclose([theirs[a.token] for a in lp.top], [a.logprob for a in lp.top], atol=1e-3)
