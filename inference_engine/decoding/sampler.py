"""Choosing the token at one global position: greedy argmax or a seeded, counter-based draw.

Why counter-based: the randomness of the draw at position p is `uniform(seed, p)`, a pure
function of the seed and the position (SplitMix64 of both), never a generator's running
state. With exact logits (the probed tile makes them independent of chunking, bursts and
shard routes) the token at p is then a function of (seed, p, logits bytes, parameters,
recent history) alone, so a speculative step can accept a draft token iff it equals the
target's own draw at that position and stay token-identical to plain sampling.

The draw, in this order (each filter sees the distribution the previous ones left):
1. repetition penalty over the last `PENALTY_WINDOW` history tokens before p (CTRL rule:
   a positive logit is divided by the penalty, a negative one multiplied);
2. temperature 0: argmax (without a penalty: `mx.argmax` of the logits, bitwise as plain
   greedy decoding); otherwise probabilities = softmax(logits / temperature) in float64;
3. top-k: the k most probable tokens (ties broken by lower token id);
4. top-p: the shortest run of most probable tokens (same order) whose mass reaches top_p;
5. min-p: tokens at least min_p times as probable as the most probable one;
6. inverse CDF: the kept tokens in ascending id order, cumulative mass, first token whose
   cumulative mass exceeds uniform(seed, p) times the kept mass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import mlx.core as mx
import numpy as np

PENALTY_WINDOW = 64  # history tokens before p whose logits the repetition penalty scales
_MASK64 = (1 << 64) - 1
_TOP_P_CANDIDATES = (256, 4096)  # top-p sorts this many most probable tokens first; all of them only if needed


@dataclass(frozen=True)
class SamplingParams:
    """How a token is chosen from the logits; 0 switches a filter off (see the module docstring)."""

    temperature: float = 0.0  # 0 = greedy (argmax)
    top_k: int = 0  # keep the k most probable tokens; 0 = all
    top_p: float = 0.0  # nucleus mass in (0, 1); 0 (or 1) = all
    min_p: float = 0.0  # keep tokens with p >= min_p * p_max; 0 = all
    repetition_penalty: float = 0.0  # > 0 scales recent tokens' logits; 0 (or 1) = none
    seed: int = 0  # key of the counter-based random stream (uint64)

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: the argmax, no randomness."""
        return self.temperature == 0.0

    @property
    def has_penalty(self) -> bool:
        """A repetition penalty other than the neutral 0/1 applies."""
        return self.repetition_penalty not in (0.0, 1.0)


GREEDY = SamplingParams()


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, position: int) -> float:
    """The random number of global position `position` under `seed`, in [0, 1) (53 bits).

    A pure function of (seed, position): no state, so any chunking, burst, batch or
    route that reaches position p with the same logits draws the same token.
    """
    bits = _splitmix64(_splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (bits >> 11) * 2.0**-53


def recent_tokens(history: Sequence[int], extra: Sequence[int] = ()) -> list[int]:
    """The penalty window at the position after `history` + `extra`: its last PENALTY_WINDOW tokens."""
    tail = list(history[-PENALTY_WINDOW:]) + list(extra)
    return tail[-PENALTY_WINDOW:]


def penalize(logits: np.ndarray, recent: Sequence[int], penalty: float) -> np.ndarray:
    """Logits with each distinct recent token scaled by the repetition penalty (a copy)."""
    out = logits.copy()
    ids = np.unique(np.asarray(recent, dtype=np.int64))
    if ids.size:
        x = out[ids]
        out[ids] = np.where(x > 0, x / penalty, x * penalty)
    return out


def _top_k_mask(probs: np.ndarray, k: int) -> np.ndarray:
    """The k most probable tokens; ties at the boundary go to the lower ids."""
    threshold = np.partition(probs, probs.size - k)[probs.size - k]  # k-th largest value
    keep = probs > threshold
    ties = np.flatnonzero(probs == threshold)
    keep[ties[: k - int(keep.sum())]] = True
    return keep


def _top_p_mask(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Shortest most-probable-first run (ties by lower id) whose mass reaches top_p (probs sum to 1).

    Sorting only the most probable m tokens (all tokens tied at the cut included) gives the
    full sort's prefix, and tied tokens permuted among themselves leave the running sums the
    same numbers, so the cut is the full sort's; m grows through `_TOP_P_CANDIDATES` and the
    whole vocabulary is sorted only when no smaller prefix reaches top_p.
    """
    live = np.flatnonzero(probs > 0)
    for m in (*(m for m in _TOP_P_CANDIDATES if m < live.size), live.size):
        ids = live
        if m < live.size:
            threshold = np.partition(probs[live], live.size - m)[live.size - m]  # m-th largest
            ids = live[probs[live] >= threshold]
        order = ids[np.argsort(-probs[ids])]
        mass = np.cumsum(probs[order])
        if mass[-1] >= top_p:
            break
    cut = min(int(np.searchsorted(mass, top_p, side="left")), order.size - 1)
    last = probs[order[cut]]
    keep = probs > last
    ties = np.flatnonzero(probs == last)
    keep[ties[: cut + 1 - int(keep.sum())]] = True  # the tied tokens the run needs: lower ids first
    return keep


def kept_tokens(probs: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Boolean mask of the tokens top-k, top-p and min-p keep (in that order)."""
    keep = np.ones(probs.size, dtype=bool)
    if 0 < params.top_k < probs.size:
        keep = _top_k_mask(probs, params.top_k)
    if 0 < params.top_p < 1:
        kept = np.where(keep, probs, 0.0)
        keep &= _top_p_mask(kept / kept.sum(), params.top_p)
    if params.min_p > 0:
        keep &= probs >= params.min_p * probs.max()  # the most probable token is always kept
    return keep


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def distribution(logits: mx.array, params: SamplingParams, recent: Sequence[int]) -> np.ndarray:
    """Float64 probabilities the draw uses (after penalty, temperature and every filter; sums to 1).

    Raises:
        ValueError: params are greedy (no distribution).
    """
    if params.is_greedy:
        raise ValueError("greedy decoding has no sampling distribution")
    x = _as_float64(logits)
    if params.has_penalty:
        x = penalize(x, recent, params.repetition_penalty)
    probs = _softmax(x / params.temperature)
    kept = np.where(kept_tokens(probs, params), probs, 0.0)
    return kept / kept.sum()


def _as_float64(logits: mx.array) -> np.ndarray:
    if logits.dtype != mx.float32:
        logits = logits.astype(mx.float32)
    return np.array(logits, dtype=np.float32).astype(np.float64).reshape(-1)  # (V,) exact float32 bits widened


def mask_logits(logits: mx.array, allowed: np.ndarray | None) -> mx.array:
    """The logits with every token `allowed` does not hold set to -inf (a constraint's mask); as given if None.

    The allowed tokens keep their exact bits, so the argmax and the seeded draw over them are the
    plain ones restricted to the allowed set.
    """
    if allowed is None:
        return logits
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))  # (V,)


def choose(logits: mx.array, params: SamplingParams, position: int, recent: Sequence[int] = ()) -> int:
    """The token at global position `position` given its exact next-token logits.

    Args:
        logits: (V,) logits predicting position `position`.
        params: the request's sampling parameters.
        position: the global position the token will take (the key of its random number).
        recent: the penalty window at `position` (`recent_tokens`); ignored without a penalty.
    Returns:
        The chosen token id. Greedy without a penalty is `mx.argmax`, bitwise as plain greedy.
    """
    if params.is_greedy and not params.has_penalty:
        return int(mx.argmax(logits).item())
    if params.is_greedy:
        return int(np.argmax(penalize(_as_float64(logits), recent, params.repetition_penalty)))
    probs = distribution(logits, params, recent)
    mass = np.cumsum(probs)
    token = int(np.searchsorted(mass, uniform(params.seed, position) * mass[-1], side="right"))
    return min(token, probs.size - 1)


def target_draws(
    logits: mx.array, block: Sequence[int], params: SamplingParams, position: int, history: Sequence[int]
) -> Iterator[int]:
    """The target's own choices after each token of a verified block, computed lazily.

    Args:
        logits: (L, V) block logits; row i predicts the token after block[i].
        block: the verified block, block[0] at global position `position`.
        params: sampling parameters.
        position: global position of block[0].
        history: the session's history before the block.
    Yields:
        choose(row i) at position + 1 + i, for i = 0, 1, ...
    """
    if params.is_greedy and not params.has_penalty:
        yield from mx.argmax(logits, axis=-1).tolist()  # one sync for the whole block
        return
    for i in range(logits.shape[0]):
        yield choose(logits[i], params, position + 1 + i, recent_tokens(history, block[: i + 1]))
