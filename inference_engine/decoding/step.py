"""One decoding step: the target's next greedy token plus verified drafts.

Greedy and speculative decoding are the same step: the block is [g0] + drafts, where g0
is the target's greedy token (free: it is the argmax of the current logits). The target
forwards the block once and accepts the longest draft prefix greedy would have produced,
so the output is token-identical to plain greedy whatever the drafter proposes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from inference_engine.decoding.drafter import Drafter
from inference_engine.runtime.coordinator import AppendTokensCoordinator


@dataclass(frozen=True)
class StepResult:
    """Tokens one step committed (to cache and history) and its draft counts."""

    tokens: tuple[int, ...]  # committed tokens, in order (>= 1)
    drafted: int  # draft tokens proposed and verified
    accepted: int  # drafts accepted (tokens - 1 at most)
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)


def decode_step(
    coord: AppendTokensCoordinator, drafter: Drafter | None, k: int, remaining: int, stop_ids: frozenset[int]
) -> StepResult:
    """Produce 1..min(k+1, remaining) greedy tokens, committing them. Runs on the engine thread.

    Args:
        coord: the session's coordinator (target verifier + history).
        drafter: proposer of drafts, or None for plain greedy.
        k: most drafts per step.
        remaining: tokens still allowed in this Generate call (>= 1); never exceeded,
            so nothing verified is ever left over at a burst edge.
        stop_ids: EOS ids; no token is accepted after one.
    """
    v = coord.session.verifier
    prior = v.next_token_logits
    g0 = int(mx.argmax(prior).item())
    drafts: list[int] = []
    if drafter is not None and remaining > 1 and g0 not in stop_ids:
        drafts = drafter.propose(coord.session.history + [g0], min(k, remaining - 1))[: remaining - 1]
    block = [g0, *drafts]
    logits = coord.verify(block)
    greedy = mx.argmax(logits, axis=-1).tolist() if drafts else []
    n = 1
    while n < len(block) and block[n] == greedy[n - 1] and block[n - 1] not in stop_ids:
        n += 1
    coord.accept(block, n)
    return StepResult(tuple(block[:n]), len(drafts), n - 1, prior)
