"""One session's coordinator driven alone, a whole operation per call (test helpers: nothing outside
tests/ may import them). The runtime stages blocks (`begin`) for the scheduler, which forwards
them with other sessions' blocks and commits them (`end`, `accept`); these do the same for one."""

from __future__ import annotations

import mlx.core as mx

from inference_engine.session.coordinator import SessionCoordinator


def append_alone(coord: SessionCoordinator, tokens: list[int]) -> None:
    """Append `tokens` to the log and the cache (the first append is the prefill).

    Raises:
        InvariantViolation: the cache and the log disagree (before or after).
        RuntimeServiceError or any compute error: nothing was appended; the cache is rebuilt.
    """
    block = coord.begin(tokens, all_logits=False)
    coord.end(coord.backend.forward([block])[0])
    coord.accept(list(block.tokens), len(block.tokens))


def verify_alone(coord: SessionCoordinator, block: list[int]) -> mx.array:
    """Forward a generation block (next token + drafts), pending `coord.accept`.

    Returns:
        (L, V) logits, possibly still computing; row i predicts the token after block[i].
    """
    staged = coord.begin(block, all_logits=True)
    return coord.end(coord.backend.forward([staged], wait=False)[0])
