"""Incremental detokenization: the text of generated tokens as they come, never a broken character.

A token's text is emitted once the tokens not yet emitted decode to whole characters: a
character whose UTF-8 bytes are split across tokens arrives with the token that completes
it. The stream is primed with the history before the first generated token, so leading
spaces decode as they would in context. A character still incomplete at the end of the
history (a previous Generate stopped inside it) was never emitted: its tokens are fed again,
so its text arrives with the token that completes it.

Whether the pending bytes end inside a character is read from the bytes themselves where the
tokenizer is byte-level (GPT-2's alphabet, as the packaged model's): a decoded U+FFFD is then
either a real character (bytes EF BF BD, emitted at once) or bytes still incomplete (held).
Other tokenizers only show the decoded text, where both look the same: there a trailing
U+FFFD is held until the next token (as `tokenizers.decoders.DecodeStream` does).
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import decoders

from inference_engine.text.codec import TextCodec

CONTEXT_TOKENS = 8  # history tokens the stream is primed with
_MAX_CARRY = 4  # most trailing history tokens of one incomplete character (UTF-8: <= 4 bytes)
_BROKEN = "\ufffd"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    chars = {b: chr(b) for b in printable} | {b: chr(256 + n) for n, b in enumerate(others)}
    return {c: b for b, c in chars.items()}


_ALPHABET = _byte_level_alphabet()


def _ends_inside_a_character(data: bytes) -> bool:
    """The bytes end with the start of a UTF-8 character whose continuation bytes have not come yet."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # the last character's first byte: how long it should be
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return need > back
    return False  # only continuation bytes: nothing more can complete them


class IncrementalDetokenizer:
    """Streams text of tokens following `history` (special tokens' text is skipped)."""

    def __init__(self, codec: TextCodec, history: Sequence[int]):
        self._codec = codec
        self._is_byte_level = isinstance(codec.backend.decoder, decoders.ByteLevel)
        self._ids = list(history[-CONTEXT_TOKENS:])  # context, then the tokens not yet emitted
        self._prefix = 0  # self._ids[_prefix:_read]: the context the pending text is decoded after
        self._read = len(self._ids)  # self._ids[_read:]: pending, their text not emitted yet
        while self._read > 0 and len(self._ids) - self._read < _MAX_CARRY and self._is_pending(self._ids[: self._read]):
            self._read -= 1  # a character incomplete at the end of the history: emitted with its last token

    def push(self, token: int) -> str:
        """Text that `token` completes ("" while a character is still incomplete, or for special tokens)."""
        self._ids.append(token)
        if self._is_pending(self._ids[self._read :]):
            return ""
        before = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        del self._ids[: self._read]  # what was emitted before this text: no longer needed as context
        self._prefix, self._read = 0, len(self._ids)
        return text[len(before) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._codec.decode(ids, skip_special_tokens=True)

    def _is_pending(self, ids: Sequence[int]) -> bool:
        """These ids end inside a character (their text must wait for the next token)."""
        if not ids:
            return False
        if self._is_byte_level:
            tail = "".join(self._codec.backend.id_to_token(t) or "" for t in ids[-_MAX_CARRY:])
            return _ends_inside_a_character(bytes(_ALPHABET.get(c, 0x20) for c in tail))
        return self._decode(ids).endswith(_BROKEN)
