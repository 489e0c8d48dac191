"""Text <-> token ids with the model's own tokenizer, and its chat template.

Everything goes through the tokenizer the model was loaded with (`LoadedModel.tokenizer`,
a transformers tokenizer over a `tokenizers.Tokenizer`): encoding and decoding use the
`tokenizers` backend, the same one `tokenizers.decoders.DecodeStream` streams with, so
streamed text and Detokenize agree; the chat template is the tokenizer's own (jinja).

Encoding and decoding go through the batch entry points with a batch of one: `encode` and
`decode` of the `tokenizers` bindings hold the GIL for the whole call (a 1 Mi-character text
froze every other session's stream for 2 s), `encode_batch` and `decode_batch` release it
while the Rust code runs, so the engine thread keeps its time (same ids, same text). Texts of
at least --text-process-chars characters (token lists of that many tokens) are encoded and
decoded in tokenizer processes instead (tokenizer_processes.py): building their ids and text
would still hold this process's GIL.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from inference_engine.errors import FeatureUnavailable, InvalidRequest
from inference_engine.text.tokenizer_processes import TokenizerProcesses


@dataclass(frozen=True)
class ChatMessage:
    """One message of a conversation."""

    role: str  # "system", "user", "assistant", ... as the chat template knows them
    content: str  # the message text


class TextCodec:
    """The model's tokenizer: encode, decode and render chats (thread-safe, no MLX)."""

    def __init__(self, tokenizer: Any, process_chars: int = 0):
        """
        Args:
            tokenizer: a transformers fast tokenizer (`LoadedModel.tokenizer`).
            process_chars: texts of at least this many characters (token lists of this many tokens)
                go to tokenizer processes (0 = every text stays in this process).
        """
        self.hf = tokenizer
        self.backend = tokenizer.backend_tokenizer  # tokenizers.Tokenizer
        self.processes = TokenizerProcesses(self.backend, process_chars) if process_chars > 0 else None

    @property
    def has_chat_template(self) -> bool:
        """The tokenizer ships a chat template (messages input is servable)."""
        return bool(getattr(self.hf, "chat_template", None))

    @property
    def bos_token_id(self) -> int | None:
        """The beginning-of-sequence id, if the tokenizer has one."""
        bos = getattr(self.hf, "bos_token_id", None)
        return None if bos is None else int(bos)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token strings in it (e.g. `<|im_start|>`) become their ids.

        Args:
            add_special_tokens: also add what the tokenizer adds around a sequence (e.g. a BOS).

        Raises:
            TokenizerUnavailable: a large text's tokenizer process died (retry) or is shut down.
        """
        if self.processes is not None and self.processes.is_large(len(text)):
            return self.processes.encode(text, add_special_tokens)
        (encoding,) = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)  # GIL released
        return list(encoding.ids)

    def encode_serialized(self, text: str, add_special_tokens: bool, message: type, field: str) -> bytes:
        """`message(field=encode(text))`, serialized: for a caller that only sends the ids on.

        A large text's message is built in a tokenizer process, so this process never holds its ids.

        Raises:
            TokenizerUnavailable: a large text's tokenizer process died (retry) or is shut down.
        """
        if self.processes is not None and self.processes.is_large(len(text)):
            return self.processes.encode_serialized(text, add_special_tokens, message, field)
        return message(**{field: self.encode(text, add_special_tokens)}).SerializeToString()

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `tokens` (special tokens as their text unless skipped).

        Raises:
            TokenizerUnavailable: a long list's tokenizer process died (retry) or is shut down.
        """
        if self.processes is not None and self.processes.is_large(len(tokens)):
            return self.processes.decode(tokens, skip_special_tokens)
        (text,) = self.backend.decode_batch([list(tokens)], skip_special_tokens=skip_special_tokens)  # GIL released
        return text

    def render(self, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
        """The chat template applied to `messages`, as text.

        Raises:
            FeatureUnavailable: the tokenizer has no chat template.
            InvalidRequest: the template refused the messages (its own message says why).
        """
        if not self.has_chat_template:
            raise FeatureUnavailable(
                "the model's tokenizer has no chat template: send text or tokens instead of messages")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.hf.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja's errors (raise_exception, undefined) are the client's
            raise InvalidRequest(f"the chat template refused these messages: {type(exc).__name__}: {exc}",
                                 "messages") from exc

    def close(self) -> None:
        """Shut the tokenizer processes down (running calls finish first; idempotent)."""
        if self.processes is not None:
            self.processes.close()


def text_codec(tokenizer: Any | None, process_chars: int = 0) -> TextCodec | None:
    """The codec of a loaded model's tokenizer; None when the model has none (random test models).

    Args:
        process_chars: see TextCodec (--text-process-chars).
    """
    return None if tokenizer is None else TextCodec(tokenizer, process_chars)


def require(codec: TextCodec | None) -> TextCodec:
    """The codec, or the error a text request gets on a model without a tokenizer.

    Raises:
        FeatureUnavailable: no tokenizer.
    """
    if codec is None:
        raise FeatureUnavailable("the served model has no tokenizer: send token ids (text, messages, stop strings "
                                 "and Tokenize/Detokenize need one)")
    return codec
