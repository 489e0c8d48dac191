"""Bench plan, timing loop, prompts and the bandwidth limit."""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# A prompt whose answer copies it back (prompt lookup's best case; bench_speculative and the concurrency bench).
COPY_BACK = '''def fibonacci(n):
    """Return the first n Fibonacci numbers."""
    out = [0, 1]
    while len(out) < n:
        out.append(out[-1] + out[-2])
    return out[:n]


def is_prime(k):
    if k < 2:
        return False
    for d in range(2, int(k ** 0.5) + 1):
        if k % d == 0:
            return False
    return True
'''
CHAT_PROMPT = "Explain how a hash table works, and when you would use one instead of a sorted list."
# Real English prose for long prompts: docstrings of standard-library modules (~6k tokens).
CORPUS_MODULES = ("argparse", "csv", "json", "re", "heapq", "unittest", "pydoc", "doctest", "subprocess", "typing")


@dataclass(frozen=True)
class Plan:
    """Sizes of one bench run."""

    new_tokens: int  # decoded tokens per decode repetition
    prefill_tokens: int  # prompt length of the prefill figure
    reps: int  # repetitions per figure (after one warm-up)
    append_reps: int  # AppendTokens calls per history length
    short_history: int  # history before the short-history appends
    long_history: int  # history before the long-history appends (> window: wrapped)
    filled_history: int  # just past sink + window: attention reads every slot from here on
    window: int  # server default window (sink stays the server default)
    sessions: int  # sessions open for the second RSS figure (also the server's pool)
    bandwidth_bytes: int  # buffer size of the bandwidth probe
    append_tokens: int = 16  # tokens per timed AppendTokens
    hol_append_tokens: int = 1500  # the long append another session's stream must not stall behind


FULL = Plan(new_tokens=128, prefill_tokens=512, reps=5, append_reps=10, short_history=100, long_history=4000,
            filled_history=1100, window=1024, sessions=8, bandwidth_bytes=2 << 30)
QUICK = Plan(new_tokens=8, prefill_tokens=32, reps=1, append_reps=2, short_history=20, long_history=200,
             filled_history=80, window=64, sessions=8, bandwidth_bytes=256 << 20, hol_append_tokens=64)


@dataclass
class Trace:
    """Timestamps of one decode repetition."""

    start: float  # perf_counter when the prompt was sent
    times: list[float] = field(default_factory=list)  # arrival time of each generated token
    tokens: list[int] = field(default_factory=list)  # the generated tokens
    counters: tuple = ()  # (before, after) of the caller's counters around the Generate alone, if asked

    @property
    def ttft_ms(self) -> float:
        """Prompt sent to first token received."""
        return (self.times[0] - self.start) * 1e3

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first over the time since the first (prefill excluded)."""
        return (len(self.times) - 1) / (self.times[-1] - self.times[0])


@dataclass
class EngineResult:
    """The raw measurements of one engine."""

    available: bool  # False: the engine could not run; see reason
    reason: str = ""  # why it is unavailable
    decode: list[Trace] = field(default_factory=list)  # decode repetitions
    prefill_s: list[float] = field(default_factory=list)  # prefill wall times
    extra: dict[str, Any] = field(default_factory=dict)  # engine-specific facts


@dataclass
class Contender:
    """An engine ready to be measured."""

    decode: Callable[[int], Trace]  # greedy decode of n tokens after the chat prompt
    prefill: Callable[[], float]  # seconds to prefill the prefill prompt into an empty context
    extra: dict[str, Any] = field(default_factory=dict)  # engine facts for the JSON


def run_interleaved(contenders: dict[str, Contender], plan: Plan) -> dict[str, EngineResult]:
    """A short warm-up each, then every repetition round-robin over the engines.

    Interleaving spreads load from elsewhere on the machine over all engines alike, so
    the ratios stay fair even when absolute figures are noisy.
    """
    results = {name: EngineResult(True, extra=dict(c.extra)) for name, c in contenders.items()}
    for c in contenders.values():
        c.decode(min(plan.new_tokens, 16))
    for _ in range(plan.reps):
        for name, c in contenders.items():
            results[name].decode.append(c.decode(plan.new_tokens))
    for _ in range(plan.reps):
        for name, c in contenders.items():
            results[name].prefill_s.append(c.prefill())
    return results


def summary(values: list[float]) -> dict[str, float] | None:
    """Median, min, max and count of a list of measurements (None when empty)."""
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


# ---------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompts:
    """Token ids of the real prompts, from the model's own tokenizer."""

    chat: list[int]  # chat-template prompt for decode and TTFT
    corpus: list[int]  # long prose; prefixes serve as prefill prompts and histories
    tokenizer: Any  # the transformers tokenizer (to show generated text)

    def text(self, n: int, start: int = 0) -> list[int]:
        """n corpus tokens from `start` (wrapping around if the corpus is short)."""
        return [self.corpus[(start + i) % len(self.corpus)] for i in range(n)]


def load_prompts(model_dir: Path) -> Prompts:
    """Tokenize the chat prompt and the prose corpus with transformers' AutoTokenizer."""
    import importlib

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    chat = [{"role": "user", "content": CHAT_PROMPT}]
    chat_text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    corpus_text = "\n\n".join(importlib.import_module(m).__doc__ or "" for m in CORPUS_MODULES)
    encode = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    return Prompts(encode(chat_text), encode(corpus_text), tok)


# ---------------------------------------------------------------------------- the limit


def memory_bandwidth(nbytes: int, reps: int) -> dict[str, float]:
    """Streaming-read bandwidth in GB/s: best time of a numpy sum over `nbytes`, 1 and all threads."""
    buf = np.ones(nbytes // 8, dtype=np.float64)  # written once so every page is resident
    threads = os.cpu_count() or 1
    out: dict[str, float] = {"buffer_bytes": float(buf.nbytes)}
    for n in sorted({1, threads}):
        parts = np.array_split(buf, n)
        with ThreadPoolExecutor(n) as pool:  # numpy reductions release the GIL
            best = float("inf")
            for _ in range(reps):
                t = time.perf_counter()
                list(pool.map(np.sum, parts))
                best = min(best, time.perf_counter() - t)
        out[f"gb_s_{n}_threads"] = buf.nbytes / best / 1e9
    out["gb_s"] = max(v for k, v in out.items() if k.startswith("gb_s_"))
    return out


def weight_bytes(path: Path) -> dict[str, int]:
    """Bytes one decoded token reads, per weight storage: "gguf" (the GGUF's tensors: llama.cpp and
    --weights q4_1 read these blocks) and "fp32" (every parameter in fp32, the tied embedding once)."""
    from inference_engine.model.gguf_blocks import read_gguf_tensors

    tensors = read_gguf_tensors(path)
    return {"fp32": 4 * sum(int(np.prod(t.shape)) for t in tensors),
            "gguf": sum(t.row_bytes * int(np.prod(t.shape[:-1])) for t in tensors)}
