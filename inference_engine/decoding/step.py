"""One decoding step: the target's next token plus verified drafts.

Greedy and speculative decoding are the same step: the block is [g0] + drafts, where g0
is the target's own choice at the next position (free: the argmax, or the seeded draw, of
the current logits). The target forwards the block once and accepts the longest draft
prefix in which every draft equals the target's own choice at its position (the argmax,
or the draw keyed by (seed, position): see sampler.py), so the output is token-identical
to plain decoding with the same sampling parameters whatever the drafter proposes.

Under a constraint (options.matcher) every choice is made from the exact logits masked by the
constraint at its position: g0 from the mask after the tokens so far, each draft checked against
the masked draw after the block's tokens before it; drafts the constraint refuses are never
proposed. Speculative constrained output therefore equals plain constrained output too.

A step is planned (`plan_step`), forwarded (batched with other sessions' blocks by the
scheduler) and finished (`finish_step`). While the forward computes, `prefetch_masks` computes the
masks finish_step and the next plan_step will read (after g0, after each draft): a mask depends
only on the tokens before it, all known once the block is planned, so the bits are the same and
only the logits' masking and the draws remain on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from inference_engine.decoding.drafter import Drafter
from inference_engine.decoding.logprobs import TokenLogprobs, token_logprobs
from inference_engine.decoding.options import PLAIN, StepOptions
from inference_engine.decoding.sampler import choose, mask_logits, recent_tokens, target_draws
from inference_engine.session.session import Session
from inference_engine.text.constraint import TokenMatcher


@dataclass(frozen=True)
class StepPlan:
    """The block a step forwards, before its logits are known."""

    block: tuple[int, ...]  # [g0] + drafts
    drafted: int  # drafts in the block
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)
    position: int  # global position of g0


@dataclass(frozen=True)
class StepResult:
    """Tokens one step committed (to cache and log) and its draft counts."""

    tokens: tuple[int, ...]  # committed tokens, in order (>= 1)
    drafted: int  # draft tokens proposed and verified
    accepted: int  # drafts accepted (tokens - 1 at most)
    prior_logits: mx.array | None  # next-token logits before the step (to retract it)
    logprobs: tuple[TokenLogprobs, ...] = ()  # per committed token, when the options ask for them


def plan_step(session: Session, drafter: Drafter | None, k: int, remaining: int, stop_ids: frozenset[int],
              options: StepOptions = PLAIN) -> StepPlan:
    """Choose the block: the target's token and up to min(k, remaining - 1) drafts. Engine thread.

    Args:
        drafter: proposer of drafts, or None for plain decoding.
        k: most drafts per step.
        remaining: tokens still allowed in this Generate call (>= 1); never exceeded,
            so nothing verified is ever left over at a burst edge.
        stop_ids: EOS ids; nothing is drafted after one.
        options: sampling, logprobs and the stop-string cut (default: plain greedy).
    """
    prior = session.coordinator.verifier.next_token_logits
    history, s, m = session.history, options.sampling, options.matcher
    position = len(history)  # == next_global_position (INV-2)
    g0 = choose(mask_logits(prior, m.allowed() if m else None), s, position,
                recent_tokens(history) if s.has_penalty else ())
    drafts: list[int] = []
    if drafter is not None and remaining > 1 and g0 not in stop_ids:
        drafts = drafter.propose(session, g0, min(k, remaining - 1))[: remaining - 1]
        if m is not None and drafts:  # only what the constraint allows after g0
            drafts = drafts[: max(0, m.valid_prefix([g0, *drafts]) - 1)]
    return StepPlan((g0, *drafts), len(drafts), prior, position)


def finish_step(session: Session, plan: StepPlan, logits: mx.array, stop_ids: frozenset[int],
                options: StepOptions = PLAIN) -> StepResult:
    """Accept the longest draft prefix the target would have chosen itself; commit it. Engine thread.

    Args:
        logits: the forwarded block's (L, V) logits (row i predicts the token after block[i]).
    """
    block, n, m = plan.block, 1, options.matcher
    if m is not None:
        n = _accept_constrained(m, session, plan, logits, stop_ids, options)
    elif plan.drafted:
        draws = target_draws(logits, block, options.sampling, plan.position, session.history)
        for draft, own in zip(block[1:], draws):
            if block[n - 1] in stop_ids or draft != own:
                break
            n += 1
    if options.keep is not None:
        kept = options.keep(list(block[:n]))
        if m is not None:
            m.rollback(n - kept)
        n = kept
    session.coordinator.accept(list(block), n)
    logprobs: tuple[TokenLogprobs, ...] = ()
    if options.top_logprobs is not None:
        rows = [plan.prior_logits, *(logits[i] for i in range(n - 1))]
        logprobs = tuple(token_logprobs(row, t, options.top_logprobs) for row, t in zip(rows, block[:n]))
    return StepResult(block[:n], plan.drafted, n - 1, plan.prior_logits, logprobs)


def prefetch_masks(matcher: TokenMatcher, plan: StepPlan, is_finished: bool) -> None:
    """Compute ahead the masks `finish_step` and the next `plan_step` read, while `plan` is forwarded. Engine thread.

    Before finish_step (not `is_finished`): a drafted block's masks after g0 and after each draft
    (finish_step checks the drafts with them; the next plan reads the one after the accepted ones).
    After it: for a block of g0 alone, the mask after g0 (finish_step needs none and reads no logits,
    so this runs once its step is handed over, the forward still computing).
    """
    if plan.drafted and not is_finished:
        matcher.prefetch(plan.block)
    elif not plan.drafted and is_finished:
        matcher.prefetch(here=True)


def _accept_constrained(m: TokenMatcher, session: Session, plan: StepPlan, logits: mx.array,
                        stop_ids: frozenset[int], options: StepOptions) -> int:
    """How many block tokens to commit under the constraint; the matcher advances past each of them."""
    block, s, n = plan.block, options.sampling, 1
    m.consume(block[0])
    for i, draft in enumerate(block[1:]):
        if block[n - 1] in stop_ids or m.is_complete:
            break
        recent = recent_tokens(session.history, block[: i + 1]) if s.has_penalty else ()
        if draft != choose(mask_logits(logits[i], m.allowed()), s, plan.position + 1 + i, recent):
            break
        m.consume(draft)
        n += 1
    return n
