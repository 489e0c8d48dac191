"""Text and chat input for AppendTokens: what tokens a request appends to a session.

A chat in one session is rendered turn by turn as a continuation of what the session
already holds. The session keeps a `ChatLog`: the messages clients sent and, for each
assistant reply the server generated, its span of history positions (the reply's text is
decoded from the history when needed, never copied). For new messages the whole
conversation so far (replies included) is rendered with the chat template and tokenized;
if the session's history is a prefix of that, only the tokens beyond it are appended, so
the history equals the template's rendering of the whole conversation. When the prefix
does not match (a reply that does not re-tokenize to itself, a history not built from
messages), the new turn is rendered alone the way the template renders a turn after a
completed one, preceded by whatever the template puts after an assistant reply's content
that the history does not already end with (e.g. "\n" after an EOS `<|im_end|>`, or
`<|im_end|>\n` after a reply cut by max_new_tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from inference_engine.errors import InvalidRequest
from inference_engine.text.codec import ChatMessage, TextCodec

# Placeholder contents for rendering a turn "after a completed one"; never sent to the model.
_USER_MARK, _REPLY_MARK = "\u2063user\u2063", "\u2063reply\u2063"


@dataclass(frozen=True)
class ReplySpan:
    """An assistant reply generated in the session: its history positions [start, end)."""

    start: int  # first position after the generation prompt
    end: int  # history length when the next messages arrived


@dataclass(frozen=True)
class ChatLog:
    """A session's conversation: client messages and generated replies, in order."""

    turns: tuple[ChatMessage | ReplySpan, ...] = ()  # everything rendered so far
    reply_from: int | None = None  # where an open assistant reply starts (after add_generation_prompt)


@dataclass(frozen=True)
class TextInput:
    """AppendTokens given text: its tokens are appended as they are (no template)."""

    text: str  # non-empty


@dataclass(frozen=True)
class ChatInput:
    """AppendTokens given messages: rendered with the chat template as a continuation."""

    messages: tuple[ChatMessage, ...]  # the new turn(s), non-empty
    add_generation_prompt: bool  # end with the template's assistant header (a reply follows)


@dataclass(frozen=True)
class ResolvedInput:
    """The tokens a text/chat input appends and the session's chat log afterwards."""

    tokens: tuple[int, ...]  # to append (1..limit)
    chat: ChatLog  # the log once they are appended
    is_continuation: bool  # chat: the whole conversation re-rendered to history + tokens


def resolve_input(
    codec: TextCodec, chat: ChatLog, history: Sequence[int], request: TextInput | ChatInput,
    eos_token_ids: Sequence[int], limit: int,
) -> ResolvedInput:
    """Tokens to append for a text or chat input. Pure; runs off the event loop.

    Args:
        codec: the model's tokenizer.
        chat: the session's chat log.
        history: the session's token history.
        request: the input.
        eos_token_ids: the session's EOS ids (a reply ending on one ended its turn).
        limit: most tokens one AppendTokens may append.
    Raises:
        InvalidRequest: the input resolves to no tokens or more than `limit`; the template refused it.
        FeatureUnavailable: messages on a tokenizer without a chat template.
    """
    if isinstance(request, TextInput):
        # A session's first text starts a sequence: what the tokenizer puts first (a BOS, as Gemma's) goes in too.
        tokens, chat, field, is_continuation = codec.encode(request.text, not history), chat, "text", False
    else:
        tokens, chat, is_continuation = _continue_chat(codec, chat, history, request, set(eos_token_ids))
        field = "messages"
    if not 1 <= len(tokens) <= limit:
        raise InvalidRequest(f"AppendTokensRequest.{field} encodes to {len(tokens)} tokens; allowed 1..{limit} "
                             "(--max-tokens-per-request)", field)
    return ResolvedInput(tuple(tokens), chat, is_continuation)


def _continue_chat(
    codec: TextCodec, chat: ChatLog, history: Sequence[int], request: ChatInput, eos: set[int]
) -> tuple[list[int], ChatLog, bool]:
    turns = chat.turns
    if chat.reply_from is not None:
        turns += (ReplySpan(chat.reply_from, len(history)),)
    turns += request.messages
    conversation = [_message(codec, t, history, eos) for t in turns]
    full = codec.encode(codec.render(conversation, request.add_generation_prompt))
    n = len(history)
    if len(full) > n and full[:n] == list(history):
        tokens, is_continuation = full[n:], True
    else:
        tail = _reply_closure(codec, chat, history, eos) + _turn_alone(codec, request)
        tokens, is_continuation = codec.encode(tail), False
    reply_from = n + len(tokens) if request.add_generation_prompt else None
    return tokens, ChatLog(turns, reply_from), is_continuation


def _message(codec: TextCodec, turn: ChatMessage | ReplySpan, history: Sequence[int], eos: set[int]) -> ChatMessage:
    if isinstance(turn, ChatMessage):
        return turn
    reply = list(history[turn.start : turn.end])
    if reply and reply[-1] in eos:
        reply.pop()  # the template writes the end of the turn itself
    return ChatMessage("assistant", codec.decode(reply))


def _turn_alone(codec: TextCodec, request: ChatInput) -> str:
    """The template's text for the new messages after a completed exchange."""
    before: list[ChatMessage] = [ChatMessage("user", _USER_MARK)]
    if request.messages[0].role != "assistant":
        before.append(ChatMessage("assistant", _REPLY_MARK))
    head = codec.render(before, False)
    whole = codec.render([*before, *request.messages], request.add_generation_prompt)
    if not whole.startswith(head):
        raise InvalidRequest("the chat template does not render these messages as a continuation of a conversation; "
                             "start a new session for them", "messages")
    return whole[len(head) :]


def _reply_closure(codec: TextCodec, chat: ChatLog, history: Sequence[int], eos: set[int]) -> str:
    """What the template writes after an assistant reply's content that the history lacks."""
    if chat.reply_from is None:
        return ""
    exchange = codec.render([ChatMessage("user", _USER_MARK), ChatMessage("assistant", _REPLY_MARK)], False)
    end = exchange[exchange.rindex(_REPLY_MARK) + len(_REPLY_MARK) :]  # e.g. "<|im_end|>\n"
    reply = history[chat.reply_from :]
    if reply and reply[-1] in eos:
        eos_text = codec.decode([reply[-1]])
        i = end.find(eos_text)
        return end[i + len(eos_text) :] if i >= 0 else ""
    return end
