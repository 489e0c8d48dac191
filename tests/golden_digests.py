"""Golden digests: what the packaged model and the native kernels compute, committed once.

tests/golden/digests.json holds, for the packaged SmolLM2-135M served as q4_1 (the server's
default, bitwise its fp32 weights), fixed token feeds in several chunkings: the state_digest,
the first 32 greedy tokens and the first 32 seeded tokens; and for every kernel variant
(x86-64 AVX-512, AVX2+FMA, portable; arm64 NEON and portable under qemu) the digest of the
kernel harness's outputs (tests/kernel_harness.py), with the per-tensor digests they share.
tests/test_golden_digests.py checks them on whatever CPU runs the tests; only
tests/write_golden_digests.py writes the table, and it refuses to replace one without
--overwrite (a golden value changes only in a commit that says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from inference_engine.decoding.sampler import SamplingParams, choose
from inference_engine.runtime.engine import Engine
from tests.exactness import feed

GOLDEN = Path(__file__).resolve().parent / "golden" / "digests.json"
SINK, WINDOW = 4, 32
FEEDS = {"random120": (7, 120), "random70": (11, 70)}  # name: (numpy seed, tokens), ids from the model's vocab
CHUNKINGS = {"1xN": None, "uneven": [11, 12, 13, 1, 24], "Nx1-tail": [40, 1, 1, 1]}  # None: one block; else padded to N
GENERATED = 32
SEEDED = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=1234)


def feed_tokens(name: str, vocab: int) -> list[int]:
    """The fixed token ids of feed `name` (numpy's PCG64 with a fixed seed: the same ids everywhere)."""
    seed, n = FEEDS[name]
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def chunk_sizes(name: str, n: int) -> list[int]:
    """Chunk sizes summing to n: CHUNKINGS[name], its last chunk grown to cover the feed."""
    sizes = CHUNKINGS[name]
    if sizes is None:
        return [n]
    return [*sizes, n - sum(sizes)]


def generate(engine: Engine, tokens: list[int], params: SamplingParams) -> list[int]:
    """The first GENERATED tokens after `tokens` (fed whole), one forward per token, as a session decodes."""
    v = feed(engine, tokens, [len(tokens)], SINK, WINDOW)
    out: list[int] = []
    for _ in range(GENERATED):
        token = choose(v.next_token_logits, params, v.next_global_position)
        out.append(token)
        v.forward_block([token])
        v.commit_or_truncate(1, 1)
    return out


def model_table(engine: Engine) -> dict[str, dict]:
    """{feed: {"state_digest": {chunking: digest}, "greedy": [...], "seeded": [...]}} for `engine`."""
    vocab = engine.loaded.spec.vocab_size
    table: dict[str, dict] = {}
    for name in FEEDS:
        tokens = feed_tokens(name, vocab)
        digests = {c: feed(engine, tokens, chunk_sizes(c, len(tokens)), SINK, WINDOW).state_digest() for c in CHUNKINGS}
        table[name] = {"state_digest": digests, "greedy": generate(engine, tokens, SamplingParams()),
                       "seeded": generate(engine, tokens, SEEDED)}
    return table


def load() -> dict:
    """The committed table."""
    return json.loads(GOLDEN.read_text())
