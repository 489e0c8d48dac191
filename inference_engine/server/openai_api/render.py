"""OpenAI's response objects from our chunks: chat.completion(.chunk) and text_completion.

One `ResponseWriter` per request holds what a stream needs across chunks (whether a
choice's role was sent, the text offset of completions logprobs). Every choice also
carries `token_ids`, the generated ids (an extension: exactness checks and models
without a tokenizer).
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
from inference_engine.server.openai_api.tools import ToolCall, ToolPlan, parse_call
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
    """How a token id is shown in logprobs: its text, or `token_id:N` on a model without a tokenizer."""
    if codec is None:
        return lambda t: f"token_id:{t}"
    return lambda t: codec.decode([t])


def usage_object(u: CompletionUsage) -> dict[str, Any]:
    """OpenAI's `usage`, with the prefix cache's share."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


class ResponseWriter:
    """The response objects of one request (streamed chunks or the one final object)."""

    def __init__(self, is_chat: bool, model: str, fingerprint: str, codec: TextCodec | None, n: int,
                 tools: ToolPlan | None = None):
        self.is_chat = is_chat
        self.tools = tools  # a reply may be a tool call: its text is held until it is known not to be one
        self._is_call: list[bool | None] = [None] * n  # per choice: a call, text, or not known yet
        self.model = model
        self.fingerprint = fingerprint
        self.text_of = token_text(codec)
        self.id = ("chatcmpl-" if is_chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self._role_sent = [False] * n
        self._offset = [0] * n  # completions logprobs: text offset of the next token
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
        tokens = [self.text_of(lp.token) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(self._offset[index])
            self._offset[index] += len(t)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self.text_of(t): x for t, x in lp.top} for lp in lps], "text_offset": offsets}

    def _chat_logprob(self, lp: TokenLogprobs) -> dict[str, Any]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.text_of(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "surrogatepass"))}

        return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, x) for t, x in lp.top]}

    def chunk(self, c: ChoiceChunk, wants_logprobs: bool) -> dict[str, Any]:
        """The streamed chunk of one piece of one choice."""
        i, ch = c.index, c.chunk
        finish = FINISH_REASONS[ch.stop_reason] if ch.stop_reason else None
        logprobs = self._logprobs_object(i, list(ch.logprobs)) if wants_logprobs and ch.logprobs else None
        choice: dict[str, Any] = {"index": i, "logprobs": logprobs, "finish_reason": finish,
                                  "token_ids": list(ch.tokens)}
        if self.is_chat:
            delta: dict[str, Any] = {"content": ch.text} if ch.text or not finish else {}
            if self.tools is not None:
                delta, finish = self._tool_delta(i, ch.text, finish)
                choice["finish_reason"] = finish
            if not self._role_sent[i]:
                delta["role"] = "assistant"
                self._role_sent[i] = True
            choice["delta"] = delta
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice["text"] = ch.text
        return {**self._head("text_completion"), "choices": [choice]}

    def _tool_delta(self, i: int, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """A streamed piece of a reply that may be a tool call: text goes out once the reply's first character
        shows it is no call (`{` starts every call); a call goes out whole, with its arguments, when it ends."""
        self._text[i] += text
        if self._is_call[i] is None and self._text[i]:
            self._is_call[i] = self._text[i].startswith("{")
            if not self._is_call[i]:
                text = self._text[i]  # the held text goes out now
        if self._is_call[i] is False:
            return ({"content": text} if text or not finish else {}), finish
        if finish is None:
            return {}, None
        call = parse_call(self._text[i], self.tools.names)  # type: ignore[union-attr]
        if call is None:  # cut short (length) before the call was complete: its text as content
            return {"content": self._text[i]}, finish
        return {"tool_calls": [_call_object(call, index=0)]}, "tool_calls"

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
            call = parse_call(text, self.tools.names) if self.tools is not None else None
            if call is not None:
                choice["message"] = {"role": "assistant", "content": None, "tool_calls": [_call_object(call)]}
                choice["finish_reason"] = "tool_calls"
            elif self.is_chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        head = self._head("chat.completion" if self.is_chat else "text_completion")
        return {**head, "choices": choices, "usage": usage_object(u)}


def _call_object(call: ToolCall, **extra: int) -> dict[str, Any]:
    """OpenAI's tool_calls entry (`index` when streamed)."""
    return {**extra, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
