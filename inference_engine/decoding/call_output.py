"""What one Generate call streams besides token ids: text, the stop-string cut, and usage.

Threading contract: everything runs on the engine thread, in the call's Generate job:
`keep` inside a decoding step (it is the step's `StepOptions.keep`) with exactly the tokens
that step commits, then `step_text` for that step's text, which travels to the stream with
the step's tokens; `finish_text` and `usage` when the job ends.

Stop strings: the step that completes a match commits the tokens up to and including the
token that completed it (later tokens of a speculative block are rolled back); the stream
sends those tokens; the text sent ends where the match begins (the stop string and
anything after it are not sent; they are in the session's history).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence

from inference_engine.text.codec import TextCodec
from inference_engine.text.detokenizer import IncrementalDetokenizer
from inference_engine.text.stop import StopMatcher


@dataclass(frozen=True)
class Usage:
    """Counts and timings of one Generate call (on its last message)."""

    prompt_tokens: int  # history length when the call began (everything the model conditioned on)
    generated_tokens: int  # tokens this call generated
    time_to_first_token_ms: float  # call start to the first token handed to the stream (0 if none)
    total_time_ms: float  # call start to its last message
    tokens_per_second: float  # generated_tokens / total time


class CallOutput:
    """Per-call text stream (incremental detokenizer + stop strings) and clock."""

    def __init__(self, codec: TextCodec | None, history: Sequence[int], stop: Sequence[str],
                 clock: Callable[[], float] = time.perf_counter):
        """
        Args:
            codec: the model's tokenizer; None = no text (token ids only, no stop strings).
            history: the session's history when the call begins.
            stop: stop strings (need a codec).
        """
        self._detokenizer = IncrementalDetokenizer(codec, history) if codec is not None else None
        self._stop = StopMatcher(stop)
        self._outbox: list[str] = []
        self._clock = clock
        self.prompt_tokens = len(history)
        self.started = clock()
        self.first_token_at: float | None = None
        self.is_stopped = False  # a stop string matched

    @property
    def has_text(self) -> bool:
        """Text is streamed (the model has a tokenizer)."""
        return self._detokenizer is not None

    def keep(self, tokens: list[int]) -> int:
        """Feed the tokens a step is about to commit; returns how many to keep (>= 1).

        A token that completes a stop string is kept and nothing after it.
        """
        assert self._detokenizer is not None
        for i, token in enumerate(tokens):
            text, matched = self._stop.push(self._detokenizer.push(token))
            self._outbox.append(text)
            if matched:
                self.is_stopped = True
                return i + 1
        return len(tokens)

    def step_text(self) -> str:
        """The text of the tokens committed since the last call (held-back stop prefixes excluded)."""
        if self.first_token_at is None:
            self.first_token_at = self._clock()
        text, self._outbox = "".join(self._outbox), []
        return text

    def finish_text(self) -> str:
        """Text for the last message: what is left, held-back text included unless a stop string matched."""
        text, self._outbox = "".join(self._outbox), []
        return text + ("" if self.is_stopped else self._stop.flush())

    def usage(self, generated: int) -> Usage:
        """Usage so far, for the call's last message."""
        total = max(self._clock() - self.started, 1e-9)
        ttft = 0.0 if self.first_token_at is None else (self.first_token_at - self.started) * 1e3
        return Usage(self.prompt_tokens, generated, ttft, total * 1e3, generated / total)
