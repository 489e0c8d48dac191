"""OpenAI's response objects from our chunks: chat.completion(.chunk) and text_completion.

One `ResponseWriter` per request holds what a stream needs across chunks (whether a
choice's role was sent, the text offset of completions logprobs, each reply's `CallReader`
under tools). Every choice also carries `token_ids`, the generated ids (an extension:
exactness checks and models without a tokenizer).

A tool call streams as OpenAI streams one: a chunk whose delta holds the call's `index`, `id`,
`type` and `function.name` with `arguments` "", then chunks with more of `function.arguments`
as it is generated, then a chunk with an empty delta and finish_reason `tool_calls`.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any, Callable

from inference_engine.decoding.logprobs import TokenLogprobs
from inference_engine.runtime.types import StopReason
from inference_engine.server.model_info import ModelInfo
from inference_engine.server.openai_api.completions import ChoiceChunk, CompletionUsage
from inference_engine.server.openai_api.call_reader import CallReader
from inference_engine.server.openai_api.tools import ToolCall, ToolPlan
from inference_engine.text.codec import TextCodec

FINISH_REASONS = {
    StopReason.EOS: "stop", StopReason.STOP_STRING: "stop", StopReason.MAX_TOKENS: "length",
    StopReason.CANCELLED: "abort",  # ended by a shutdown past --grace (not an OpenAI value: none fits)
    StopReason.CONSTRAINT_COMPLETE: "stop",  # the JSON (response_format) is complete; a tool call: tool_calls
}


def system_fingerprint(info: ModelInfo) -> str:
    """`fp_` + a hash of what fixes the bits: the model's fingerprint, the kernels and the block size.
    The same fingerprint, seed and request give the same completion, alone or under any load."""
    digest = hashlib.sha256(f"{info.model_fingerprint}|{info.kernels}|{info.block_size}".encode()).hexdigest()
    return f"fp_{digest[:12]}"


def token_text(codec: TextCodec | None) -> Callable[[int], str]:
    """A token id's text, or `token_id:N` on a model without a tokenizer."""
    if codec is None:
        return lambda t: f"token_id:{t}"
    return lambda t: codec.decode([t])


def shown_token(text: str, raw: bytes | None) -> str:
    """How a token is named in logprobs: its text, or, for a token holding part of a UTF-8 character (its
    text alone would be U+FFFD, the same for many tokens), `bytes:` and its bytes escaped, as OpenAI names it."""
    if raw is None:
        return text
    try:
        raw.decode("utf-8")
        return text
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage_object(u: CompletionUsage) -> dict[str, Any]:
    """OpenAI's `usage`, with the prefix cache's share."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class ResponseWriter:
    """The response objects of one request (streamed chunks or the one final object)."""

    def __init__(self, is_chat: bool, model: str, fingerprint: str, codec: TextCodec | None, n: int,
                 tools: ToolPlan | None = None, token_bytes: Callable[[int], bytes] | None = None):
        """
        Args:
            token_bytes: a token's own bytes (logprobs' `bytes`; None: its text's UTF-8).
        """
        self.is_chat = is_chat
        self.tools = tools  # a reply may be a tool call: each choice's reply is read by a CallReader
        self._readers = [CallReader(tools.names) for _ in range(n)] if tools is not None else []
        self.model = model
        self.fingerprint = fingerprint
        self.text_of = token_text(codec)
        self.token_bytes = token_bytes
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self._role_sent = [False] * n
        self._emitted = [b""] * n  # completions logprobs: the bytes of the tokens so far (their text offsets)
        self._text = [""] * n
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[TokenLogprobs]] = [[] for _ in range(n)]
        self._finish: list[str | None] = [None] * n

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    def _logprobs_object(self, index: int, lps: list[TokenLogprobs]) -> dict[str, Any] | None:
        if self.is_chat:
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        tokens, offsets = [], []
        for lp in lps:  # characters before the token (one it completes counts from its start)
            shown, raw = self._token(lp.token)
            tokens.append(shown)
            offsets.append(len(self._emitted[index].decode("utf-8", "ignore")))
            self._emitted[index] += raw
        tops = [{**{self._token(t)[0]: x for t, x in lp.top}, name: lp.logprob} for name, lp in zip(tokens, lps)]
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}  # as OpenAI's: the chosen token is always in its top

    def _token(self, token: int) -> tuple[str, bytes]:
        """The token's name in logprobs (`shown_token`) and its bytes."""
        text = self.text_of(token)
        raw = self.token_bytes(token) if self.token_bytes is not None else None
        return shown_token(text, raw), text.encode("utf-8", "surrogatepass") if raw is None else raw

    def _chat_logprob(self, lp: TokenLogprobs) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            shown, raw = self._token(token)
            return {"token": shown, "logprob": logprob, "bytes": list(raw)}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top]}

    def chunks(self, c: ChoiceChunk, wants_logprobs: bool) -> list[dict[str, Any]]:
        """The streamed chunks of one piece of one choice (one, or a tool call's several: see the module)."""
        i, ch = c.index, c.chunk
        finish = FINISH_REASONS[ch.stop_reason] if ch.stop_reason else None
        logprobs = self._logprobs_object(i, list(ch.logprobs)) if wants_logprobs and ch.logprobs else None
        choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": finish,
                                  "token_ids": list(ch.tokens)}
        if not self.is_chat:
            choice["text"] = ch.text
            return [{**self._head("text_completion"), "choices": [choice]}]
        deltas: list[dict[str, Any]] = [{"content": ch.text} if ch.text or not finish else {}]
        if self.tools is not None:
            deltas, finish = self._tool_deltas(i, ch.text, finish)
        if not self._role_sent[i]:
            deltas[0]["role"] = "assistant"
            self._role_sent[i] = True
        out = []
        for n, delta in enumerate(deltas):  # the piece's tokens and logprobs ride on its first chunk
            is_last = n == len(deltas) - 1
            extra = choice if n == 0 else {"index": i, "logprobs": None, "token_ids": []}
            out.append({**self._head("chat.completion.chunk"),
                        "choices": [{**extra, "finish_reason": finish if is_last else None, "delta": delta}]})
        return out

    def _tool_deltas(self, i: int, text: str, finish: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas of a piece of a reply that may be a tool call, and the choice's finish_reason."""
        reader = self._readers[i]
        pieces = [reader.read(text)]
        if finish is not None:
            pieces.append(reader.end())
            if reader.is_complete:
                finish = "tool_calls"
        deltas: list[dict[str, Any]] = []
        for p in pieces:
            if p.content:
                deltas.append({"content": p.content})
            if p.call is not None:
                deltas.append({"tool_calls": [_call_object(p.call, index=0)]})
            if p.arguments:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": p.arguments}}]})
        if not deltas or (finish is not None and reader.call is not None):
            deltas.append({})  # a call's finish_reason comes in a chunk of its own, as OpenAI's does
        return deltas, finish

    def usage_chunk(self, u: CompletionUsage) -> dict[str, Any]:
        """The last streamed chunk when stream_options.include_usage: no choices, the usage."""
        head = self._head("chat.completion.chunk" if self.is_chat else "text_completion")
        return {**head, "choices": [], "usage": usage_object(u)}

    def add(self, c: ChoiceChunk) -> None:
        """Collect a piece for the one final object (not streamed)."""
        i, ch = c.index, c.chunk
        self._text[i] += ch.text
        self._tokens[i].extend(ch.tokens)
        self._logprobs[i].extend(ch.logprobs)
        if ch.stop_reason:
            self._finish[i] = FINISH_REASONS[ch.stop_reason]

    def final(self, u: CompletionUsage, wants_logprobs: bool) -> dict[str, Any]:
        """The one response object of a request that did not stream."""
        choices = []
        for i, text in enumerate(self._text):
            logprobs = self._logprobs_object(i, self._logprobs[i]) if wants_logprobs else None
            choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": self._finish[i],
                                      "token_ids": self._tokens[i]}
            reader = _read_whole(text, self.tools.names) if self.tools is not None else None
            if reader is not None and reader.call is not None:  # as streamed: cut short, it keeps its finish
                call = ToolCall(reader.call.id, reader.call.name, reader.arguments)
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [_call_object(call)]}
                if reader.is_complete:
                    choice["finish_reason"] = "tool_calls"
            elif self.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        head = self._head("chat.completion" if self.is_chat else "text_completion")
        return {**head, "choices": choices, "usage": usage_object(u)}


def _read_whole(text: str, names: tuple[str, ...]) -> CallReader:
    """A reply read as the stream reads it, in one piece."""
    reader = CallReader(names)
    reader.read(text)
    reader.end()
    return reader


def _call_object(call: ToolCall, **extra: int) -> dict[str, Any]:
    """OpenAI's tool_calls entry (`index` when streamed)."""
    return {**extra, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
