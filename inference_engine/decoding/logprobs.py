"""Log-probabilities of chosen tokens and their top alternatives, from the exact logits.

They describe the model's own distribution at the position: the log-softmax of the raw
logits (before repetition penalty, temperature or filters), as mlx-lm reports them.
Computed in float64 from the float32 logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

MAX_TOP_LOGPROBS = 20  # most alternatives a request may ask for per position


@dataclass(frozen=True)
class TokenLogprobs:
    """One generated position's log-probabilities."""

    token: int  # the chosen token
    logprob: float  # its log-probability under the model
    top: tuple[tuple[int, float], ...]  # the N most probable (token, logprob), most probable first, ties by id


def log_softmax(logits: mx.array) -> np.ndarray:
    """(V,) float64 log-softmax of float32 logits."""
    x = np.array(logits.astype(mx.float32), dtype=np.float32).astype(np.float64).reshape(-1)
    m = x.max()
    return x - (m + np.log(np.sum(np.exp(x - m))))


def token_logprobs(logits: mx.array, token: int, top_n: int) -> TokenLogprobs:
    """Log-probability of `token` under `logits` and the `top_n` most probable tokens.

    Args:
        logits: (V,) logits of the position.
        token: the token chosen there.
        top_n: alternatives to report (0..MAX_TOP_LOGPROBS).
    """
    lp = log_softmax(logits)
    top: tuple[tuple[int, float], ...] = ()
    if top_n > 0:
        n = min(top_n, lp.size)
        threshold = np.partition(lp, lp.size - n)[lp.size - n]
        ids = np.flatnonzero(lp >= threshold)  # the n largest, plus ties at the cut
        ids = ids[np.lexsort((ids, -lp[ids]))][:n]
        top = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprobs(int(token), float(lp[token]), top)
