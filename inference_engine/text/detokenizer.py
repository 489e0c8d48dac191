"""Incremental detokenization: the text of generated tokens as they come, never a broken character.

`tokenizers.decoders.DecodeStream` holds back tokens whose bytes do not yet form complete
UTF-8 characters (a character split across tokens) and yields the text once they do. It
is primed with the history before the first generated token, so leading spaces decode as
they would in context. A character still incomplete at the end of the history (a previous
Generate stopped inside it) was never emitted: its tokens are fed again, so its text
arrives with the token that completes it.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

from inference_engine.text.codec import TextCodec

CONTEXT_TOKENS = 8  # history tokens the stream is primed with
_MAX_CARRY = 4  # most trailing history tokens of one incomplete character (UTF-8: <= 4 bytes)
_BROKEN = "\ufffd"


class IncrementalDetokenizer:
    """Streams text of tokens following `history` (special tokens' text is skipped)."""

    def __init__(self, codec: TextCodec, history: Sequence[int]):
        self._backend = codec.backend
        prime = list(history[-CONTEXT_TOKENS:])
        carry: list[int] = []
        while prime and len(carry) < _MAX_CARRY and codec.decode(prime, skip_special_tokens=True).endswith(_BROKEN):
            carry.insert(0, prime.pop())
        self._stream = DecodeStream(ids=prime, skip_special_tokens=True)
        for t in carry:
            self._stream.step(self._backend, t)  # incomplete: yields nothing yet

    def push(self, token: int) -> str:
        """Text that `token` completes ("" while a character is still incomplete, or for special tokens)."""
        return self._stream.step(self._backend, token) or ""
