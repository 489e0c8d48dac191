"""The sampler, logprobs, stop strings and the per-call text output as pure functions (no model)."""

import dataclasses
import math

import mlx.core as mx
import numpy as np
import pytest

from inference_engine.decoding.call_output import CallOutput
from inference_engine.decoding.logprobs import log_softmax, token_logprobs
from inference_engine.decoding.options import GenerationOptions
from inference_engine.decoding.sampler import (
    PENALTY_WINDOW,
    SamplingParams,
    _top_p_mask,
    choose,
    distribution,
    kept_tokens,
    penalize,
    recent_tokens,
    target_draws,
    uniform,
)
from inference_engine.text.stop import StopMatcher

V = 300


def _logits(seed: int, scale: float = 3.0) -> mx.array:
    return mx.array(np.random.default_rng(seed).normal(size=V).astype(np.float32) * scale)


def test_uniform_is_a_function_of_seed_and_position_only():
    a = [uniform(7, p) for p in range(2000)]
    assert a == [uniform(7, p) for p in range(2000)]
    assert all(0.0 <= u < 1.0 for u in a)
    assert abs(np.mean(a) - 0.5) < 0.02 and abs(np.var(a) - 1 / 12) < 0.01
    assert a != [uniform(8, p) for p in range(2000)]
    assert uniform(2**64 - 1, 2**40) != uniform(0, 2**40)


def test_greedy_is_mx_argmax_bitwise():
    for s in range(20):
        x = _logits(s)
        assert choose(x, SamplingParams(), 5, ()) == int(mx.argmax(x).item())


def test_draw_depends_on_seed_position_logits_only():
    x = _logits(1, scale=0.5)  # flat enough that draws vary
    p = SamplingParams(temperature=1.0, seed=42)
    draws = [choose(x, p, pos) for pos in range(200)]
    assert draws == [choose(x, p, pos) for pos in range(200)]
    assert len(set(draws)) > 50
    assert draws != [choose(x, SamplingParams(temperature=1.0, seed=43), pos) for pos in range(200)]


def test_draws_follow_the_distribution():
    x = mx.array(np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32))
    p = SamplingParams(temperature=0.7, seed=3)
    want = distribution(x, p, ())
    n = 20000
    counts = np.bincount([choose(x, p, pos) for pos in range(n)], minlength=6)
    chi2 = float(np.sum((counts - n * want) ** 2 / (n * want)))
    assert chi2 < 25.0, (counts, want)  # 5 degrees of freedom; p < 1e-4


def test_temperature_sharpens():
    x = _logits(2)
    cold = distribution(x, SamplingParams(temperature=0.1), ())
    hot = distribution(x, SamplingParams(temperature=2.0), ())
    assert cold.max() > hot.max() and int(np.argmax(cold)) == int(np.argmax(hot))
    assert math.isclose(cold.sum(), 1.0) and math.isclose(hot.sum(), 1.0)


def test_top_k_keeps_k_with_ties_to_lower_ids():
    probs = np.array([0.1, 0.3, 0.2, 0.2, 0.2])
    keep = kept_tokens(probs, SamplingParams(temperature=1.0, top_k=3))
    assert keep.tolist() == [False, True, True, True, False]
    assert kept_tokens(probs, SamplingParams(temperature=1.0, top_k=5)).all()


def _top_p_reference(probs: np.ndarray, top_p: float) -> np.ndarray:
    order = sorted(range(probs.size), key=lambda i: (-probs[i], i))
    mass, keep = 0.0, np.zeros(probs.size, dtype=bool)
    for i in order:
        keep[i] = True
        mass += probs[i]
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0])  # flat: the candidate prefix does not reach top_p
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.999])
def test_top_p_equals_the_full_sort(scale, top_p):
    rng = np.random.default_rng(int(scale * 100 + top_p * 1000))
    z = rng.normal(size=2000) * scale
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    assert (_top_p_mask(probs, top_p) == _top_p_reference(probs, top_p)).all()


def test_filters_compose_and_the_top_token_always_survives():
    x = _logits(4)
    top = int(mx.argmax(x).item())
    for params in [SamplingParams(temperature=1.0, top_k=5, top_p=0.5, min_p=0.2),
                   SamplingParams(temperature=1.0, min_p=1.0), SamplingParams(temperature=1.0, top_p=1e-9)]:
        d = distribution(x, params, ())
        assert d[top] > 0 and math.isclose(d.sum(), 1.0)
        assert choose(x, params, 9) in set(np.flatnonzero(d).tolist())
    assert np.count_nonzero(distribution(x, SamplingParams(temperature=1.0, top_k=5), ())) == 5
    assert np.count_nonzero(distribution(x, SamplingParams(temperature=1.0, min_p=1.0), ())) == 1


def test_repetition_penalty():
    x = np.array([2.0, -2.0, 1.0, 0.5])
    assert penalize(x, [0, 1, 1], 2.0).tolist() == [1.0, -4.0, 1.0, 0.5]
    logits = mx.array(np.array([2.0, 1.9, 0.0], dtype=np.float32))
    p = SamplingParams(repetition_penalty=1.5)  # temperature 0: argmax of the penalised logits
    assert choose(logits, p, 0, [0]) == 1 and choose(logits, p, 0, [1]) == 0
    assert SamplingParams(repetition_penalty=1.0).has_penalty is False
    assert recent_tokens(list(range(100)), [7, 8]) == list(range(38, 100)) + [7, 8]
    assert len(recent_tokens(list(range(100)))) == PENALTY_WINDOW


def _splitmix64(x: int) -> int:  # the published SplitMix64 finaliser (Steele et al.)
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def _reference_draw(logits: mx.array, p: SamplingParams, position: int, recent: list[int]) -> int:
    """The documented draw (sampler.py's module docstring), written independently in float64 Python:
    filters over the probabilities sorted most probable first (ties: lower id), then the inverse CDF of
    the kept tokens in ascending id order."""
    x = [float(v) for v in np.array(logits, dtype=np.float32)]  # the float32 bits, widened
    if p.repetition_penalty not in (0.0, 1.0):
        for t in set(recent):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    if p.temperature == 0.0:
        return min(range(len(x)), key=lambda i: (-x[i], i))  # argmax, first of equals
    z = [v / p.temperature for v in x]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    probs = [v / sum(e) for v in e]
    ranked = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    if 0 < p.top_k < len(ranked):
        ranked = ranked[: p.top_k]
    if 0 < p.top_p < 1:
        total, mass, n = sum(probs[i] for i in ranked), 0.0, 0
        while n < len(ranked) and mass < p.top_p:  # shortest prefix whose (renormalised) mass reaches top_p
            mass += probs[ranked[n]] / total
            n += 1
        ranked = ranked[:n]
    if p.min_p > 0:
        ranked = [i for i in ranked if probs[i] >= p.min_p * probs[ranked[0]]]
    kept = sorted(ranked)
    u = (_splitmix64(_splitmix64(p.seed) ^ position) >> 11) / 2.0**53
    target, cumulative = u * sum(probs[i] for i in kept), 0.0
    for i in kept:
        cumulative += probs[i]
        if cumulative > target:
            return i
    return kept[-1]


ORACLE_PARAMS = [
    SamplingParams(temperature=1.0, seed=1),
    SamplingParams(temperature=0.7, top_k=20, seed=2),
    SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    SamplingParams(temperature=0.9, min_p=0.05, seed=4),
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repetition_penalty=1.3, seed=2**64 - 5),
    SamplingParams(repetition_penalty=1.3),  # greedy over penalised logits
]


@pytest.mark.parametrize("params", ORACLE_PARAMS)
def test_choose_matches_an_independent_inverse_cdf(params):
    rows = [_logits(30, scale=0.7), _logits(31, scale=2.0), mx.array(np.round(np.array(_logits(32)), 0))]  # last: ties
    recent = list(range(0, V, 7))
    draws, want = [], []
    for r, row in enumerate(rows):
        for seed in (params.seed, params.seed ^ 0x5DEECE66D):
            p = dataclasses.replace(params, seed=seed)
            for pos in (0, 1, 2, 63, 64, 1000, 2**32 + r, 2**63 + 17):
                draws.append(choose(row, p, pos, recent))
                want.append(_reference_draw(row, p, pos, recent))
    assert draws == want
    assert len(set(draws)) > (1 if params.is_greedy else 10)  # the draws vary: the comparison can see a difference


@pytest.mark.parametrize("params", [SamplingParams(), ORACLE_PARAMS[4], SamplingParams(repetition_penalty=1.3)])
def test_target_draws_follow_the_reference_per_row(params):
    rows = mx.stack([_logits(10 + i, scale=0.7) for i in range(4)])
    history, block = [3, 4, 5], [6, 7, 8, 9]
    want = [_reference_draw(rows[i], params, 20 + 1 + i, recent_tokens(history, block[: i + 1])) for i in range(4)]
    assert list(target_draws(rows, block, params, 20, history)) == want


def test_logprobs_are_the_log_softmax():
    x = _logits(5)
    lp = token_logprobs(x, 17, 5)
    ref = np.array(x, dtype=np.float64) - np.log(np.sum(np.exp(np.array(x, dtype=np.float64))))
    assert math.isclose(lp.logprob, ref[17], rel_tol=1e-12, abs_tol=1e-12)
    assert [t for t, _ in lp.top] == sorted(range(V), key=lambda i: -ref[i])[:5]
    assert np.allclose([v for _, v in lp.top], sorted(ref, reverse=True)[:5])
    assert token_logprobs(x, 0, 0).top == ()
    assert math.isclose(float(np.exp(log_softmax(x)).sum()), 1.0)


def test_stop_matcher_across_pieces():
    m = StopMatcher(["</s>", "STOP"])
    assert m.push("hello <") == ("hello ", False)  # "<" may begin "</s>": held back
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)  # cannot match any more: released
    assert m.push("ST") == ("", False)
    assert m.push("OP and more") == ("", True)  # text ends where the match begins
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False) and m.flush() == "a" and m.flush() == ""
    assert StopMatcher(["b", "abc"]).push("zabc") == ("z", True)  # the earliest-starting match cuts
    assert StopMatcher([]).push("anything") == ("anything", False)


def test_generation_options_stop_ids():
    o = GenerationOptions(eos_token_ids=(5,))
    assert o.stop_ids((2,), False) == {5} and o.stop_ids((2,), True) == set()
    assert GenerationOptions().stop_ids((2, 3), False) == {2, 3}


def test_call_output_without_tokenizer_has_no_text():
    ticks = iter([1.0, 1.5, 3.0])
    out = CallOutput(None, [1, 2, 3], (), clock=lambda: next(ticks))
    assert not out.has_text and out.step_text() == "" and out.finish_text() == ""
    u = out.usage(4)
    assert (u.prompt_tokens, u.generated_tokens, u.time_to_first_token_ms, u.total_time_ms, u.tokens_per_second) == (
        3, 4, 500.0, 2000.0, 2.0)
