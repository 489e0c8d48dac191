"""One decoding step: the target's next token plus verified drafts.

Greedy and speculative decoding are the same step: the block is [g0] + drafts, where g0
is the target's greedy token (free: it is the argmax of the current logits). The target
forwards the block once and accepts the longest draft prefix greedy would have produced,
so the output is token-identical to plain greedy whatever the drafter proposes.

A step is planned (`plan_step`), forwarded (alone, or batched with other sessions' blocks
by the scheduler) and finished (`finish_step`); `decode_step` does all three alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from inference_engine.decoding.drafter import Drafter
from inference_engine.session.session import Session


@dataclass(frozen=True)
class StepPlan:
    """The block a step forwards, before its logits are known."""

    block: tuple[int, ...]  # [g0] + drafts
    drafted: int  # drafts in the block
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)


@dataclass(frozen=True)
class StepResult:
    """Tokens one step committed (to cache and log) and its draft counts."""

    tokens: tuple[int, ...]  # committed tokens, in order (>= 1)
    drafted: int  # draft tokens proposed and verified
    accepted: int  # drafts accepted (tokens - 1 at most)
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)


def plan_step(session: Session, drafter: Drafter | None, k: int, remaining: int, stop_ids: frozenset[int]) -> StepPlan:
    """Choose the block: the target's token and up to min(k, remaining - 1) drafts. Engine thread.

    Args:
        remaining: tokens still allowed in this Generate call (>= 1); never exceeded,
            so nothing verified is ever left over at a burst edge.
        stop_ids: EOS ids; nothing is drafted after one.
    """
    prior = session.coordinator.verifier.next_token_logits
    g0 = int(mx.argmax(prior).item())
    drafts: list[int] = []
    if drafter is not None and remaining > 1 and g0 not in stop_ids:
        drafts = drafter.propose(session, g0, min(k, remaining - 1))[: remaining - 1]
    return StepPlan((g0, *drafts), len(drafts), prior)


def finish_step(session: Session, plan: StepPlan, logits: mx.array, stop_ids: frozenset[int]) -> StepResult:
    """Accept the longest draft prefix greedy would have produced; commit it. Engine thread.

    Args:
        logits: the forwarded block's (L, V) logits (row i predicts the token after block[i]).
    """
    block = plan.block
    greedy = mx.argmax(logits, axis=-1).tolist() if plan.drafted else []
    n = 1
    while n < len(block) and block[n] == greedy[n - 1] and block[n - 1] not in stop_ids:
        n += 1
    session.coordinator.accept(list(block), n)
    return StepResult(block[:n], plan.drafted, n - 1, plan.prior_logits)


def decode_step(session: Session, drafter: Drafter | None, k: int, remaining: int, stop_ids: frozenset[int]) -> StepResult:
    """Produce 1..min(k+1, remaining) tokens for one session alone, committing them. Engine thread."""
    plan = plan_step(session, drafter, k, remaining, stop_ids)
    return finish_step(session, plan, session.coordinator.verify(list(plan.block)), stop_ids)
