"""What a Generate call asks of decoding beyond its token budget, and what one step needs of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from inference_engine.decoding.sampler import GREEDY, SamplingParams
from inference_engine.text.constraint import Constraint, TokenMatcher


@dataclass(frozen=True)
class GenerationOptions:
    """Sampling, stop conditions and logprobs of one validated Generate request."""

    sampling: SamplingParams = GREEDY  # how each token is chosen
    stop: tuple[str, ...] = ()  # stop strings, matched on the streamed text across tokens
    eos_token_ids: tuple[int, ...] = ()  # EOS ids of this call; () = the session's
    logprobs: bool = False  # report each generated token's logprob
    top_logprobs: int = 0  # and this many alternatives per position (0..20)
    constraint: Constraint | None = None  # every generated token keeps the output matching it; None = free

    def stop_ids(self, session_eos: Sequence[int], ignore_eos: bool) -> frozenset[int]:
        """Tokens that end this call: none with ignore_eos, else this call's EOS ids or the session's."""
        if ignore_eos:
            return frozenset()
        return frozenset(self.eos_token_ids or session_eos)


@dataclass(frozen=True)
class StepOptions:
    """Per-step knobs of a decoding step (`plan_step`/`finish_step`; the defaults are plain greedy decoding)."""

    sampling: SamplingParams = GREEDY  # how g0 and the target's checks of the drafts are chosen
    top_logprobs: int | None = None  # None: no logprobs; N: logprobs with N alternatives
    # Given the tokens a step would commit, how many of them to keep (>= 1): a stop string
    # completed by token i keeps i + 1. Called once per step with exactly those tokens.
    keep: Callable[[list[int]], int] | None = None
    # The call's constraint, advanced past every committed token (the step masks the logits with it).
    matcher: TokenMatcher | None = None


PLAIN = StepOptions()
