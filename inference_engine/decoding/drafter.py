"""Drafters propose the tokens greedy decoding is likely to produce next.

Two real implementations: a draft model (a smaller or quantized model sharing the
tokenizer, with its own sink-window cache per session) and prompt lookup (copies the
continuation of the latest n-gram match in the session's own history; no model).
Proposals only affect speed: the target model verifies every token.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import mlx.core as mx

from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier


class Drafter(ABC):
    """Per-session proposer of draft tokens."""

    @abstractmethod
    def propose(self, context: list[int], k: int) -> list[int]:
        """Propose up to `k` tokens to follow `context`.

        Args:
            context: the session's committed history followed by the target's next
                greedy token (so it is never empty).
            k: most tokens to propose (>= 1).
        Returns:
            0..k proposed tokens; fewer (or none) when the drafter has no good guess.
        """


class PromptLookupDrafter(Drafter):
    """Copy what followed the latest earlier occurrence of the context's last n-gram."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, search_window: int = 8192):
        # Single-token matches are mostly noise in free text: each wrong draft costs a
        # verification row, so they are not proposed by default.
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.search_window = search_window

    def propose(self, context: list[int], k: int) -> list[int]:
        """Longest suffix n-gram (n = max_ngram..min_ngram) matched most recently wins."""
        tail = context[-self.search_window :]
        for n in range(min(self.max_ngram, len(tail) - 1), self.min_ngram - 1, -1):
            suffix = tail[-n:]
            for j in range(len(tail) - n - 1, -1, -1):
                if tail[j : j + n] == suffix:
                    return tail[j + n : j + n + k]
        return []


class ModelDrafter(Drafter):
    """Greedy tokens of a draft model whose cache follows the session's history lazily.

    The draft cache holds a prefix of `context` plus at most k-1 drafted tokens; on each
    call it drops tokens that diverge from `context` (a rollback of at most k-1) and
    computes only the tokens it has not seen.
    """

    def __init__(self, make_verifier: Callable[[], SinkWindowVerifier]):
        self._make_verifier = make_verifier
        self.verifier = make_verifier()
        self._fed: list[int] = []  # tokens in the draft cache, in order

    def _sync(self, context: list[int]) -> None:
        common = len(self._fed)
        start = max(0, common - self.verifier.geometry.max_rollback - 1)
        for i in range(start, min(common, len(context))):
            if self._fed[i] != context[i]:
                common = i
                break
        else:
            common = min(common, len(context))
        if common < start or len(self._fed) - common > self.verifier.geometry.max_rollback:
            self.verifier, self._fed, common = self._make_verifier(), [], 0  # too far apart: rebuild
        if len(self._fed) > common:
            self.verifier.rollback(len(self._fed) - common)
            del self._fed[common:]
        if common == len(context):  # need logits after the last context token
            self.verifier.rollback(1)
            self._fed.pop()
        self._feed(context[len(self._fed) :])

    def _feed(self, tokens: list[int]) -> None:
        self.verifier.forward_block(tokens, all_logits=False)
        self.verifier.commit_or_truncate(len(tokens), len(tokens))
        self._fed.extend(tokens)

    def propose(self, context: list[int], k: int) -> list[int]:
        """k greedy tokens of the draft model after `context`."""
        self._sync(context)
        out: list[int] = []
        for i in range(k):
            token = int(mx.argmax(self.verifier.next_token_logits).item())
            out.append(token)
            if i < k - 1:
                self._feed([token])
        return out
