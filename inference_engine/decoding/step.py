"""One decoding step: the target's next token plus verified drafts.

Greedy and speculative decoding are the same step: the block is [g0] + drafts, where g0
is the target's own choice at the next position (free: the argmax, or the seeded draw, of
the current logits). The target forwards the block once and accepts the longest draft
prefix in which every draft equals the target's own choice at its position (the argmax,
or the draw keyed by (seed, position): see sampler.py), so the output is token-identical
to plain decoding with the same sampling parameters whatever the drafter proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from inference_engine.decoding.drafter import Drafter
from inference_engine.decoding.logprobs import TokenLogprobs, token_logprobs
from inference_engine.decoding.options import PLAIN, StepOptions
from inference_engine.decoding.sampler import choose, recent_tokens, target_draws
from inference_engine.runtime.coordinator import AppendTokensCoordinator


@dataclass(frozen=True)
class StepResult:
    """Tokens one step committed (to cache and history) and its draft counts."""

    tokens: tuple[int, ...]  # committed tokens, in order (>= 1)
    drafted: int  # draft tokens proposed and verified
    accepted: int  # drafts accepted (tokens - 1 at most)
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)
    logprobs: tuple[TokenLogprobs, ...] = ()  # per committed token, when the options ask for them


def decode_step(
    coord: AppendTokensCoordinator, drafter: Drafter | None, k: int, remaining: int, stop_ids: frozenset[int],
    options: StepOptions = PLAIN,
) -> StepResult:
    """Produce 1..min(k+1, remaining) tokens, committing them. Runs on the engine thread.

    Args:
        coord: the session's coordinator (target verifier + history).
        drafter: proposer of drafts, or None for plain decoding.
        k: most drafts per step.
        remaining: tokens still allowed in this Generate call (>= 1); never exceeded,
            so nothing verified is ever left over at a burst edge.
        stop_ids: EOS ids; no token is accepted after one.
        options: sampling, logprobs and the stop-string cut (default: plain greedy).
    """
    v = coord.session.verifier
    prior = v.next_token_logits
    history, s = coord.session.history, options.sampling
    position = len(history)  # == next_global_position (INV-2)
    g0 = choose(prior, s, position, recent_tokens(history) if s.has_penalty else ())
    drafts: list[int] = []
    if drafter is not None and remaining > 1 and g0 not in stop_ids:
        drafts = drafter.propose(coord.session.history + [g0], min(k, remaining - 1))[: remaining - 1]
    block = [g0, *drafts]
    logits = coord.verify(block)
    n = 1
    if drafts:
        for draft, own in zip(drafts, target_draws(logits, block, s, position, history)):
            if block[n - 1] in stop_ids or draft != own:
                break
            n += 1
    if options.keep is not None:
        n = options.keep(block[:n])
    coord.accept(block, n)
    logprobs = ()
    if options.top_logprobs is not None:
        rows = [prior, *(logits[i] for i in range(n - 1))]
        logprobs = tuple(token_logprobs(row, t, options.top_logprobs) for row, t in zip(rows, block[:n]))
    return StepResult(tuple(block[:n]), len(drafts), n - 1, prior, logprobs)
