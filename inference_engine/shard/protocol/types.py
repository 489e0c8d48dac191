"""Typed data at the shard engine's boundary (no protobuf below the servicer and client)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class LayerRange:
    """Transformer blocks [start, end) computed by one worker."""

    start: int  # first block (0 = the head: it embeds token ids)
    end: int  # one past the last block (num_layers = the tail: it applies norm + LM head)

    @classmethod
    def parse(cls, text: str) -> "LayerRange":
        """Parse `A:B`.

        Raises:
            ValueError: not two integers with 0 <= A < B.
        """
        parts = text.split(":")
        try:
            start, end = (int(p) for p in parts)
        except ValueError:
            raise ValueError(f"layer range {text!r} must be START:END, e.g. 0:10") from None
        if not 0 <= start < end:
            raise ValueError(f"layer range {text!r} must satisfy 0 <= START < END")
        return cls(start, end)

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardCapabilities:
    """What one worker computes and the limits it enforces."""

    model_name: str  # folder name or test label
    model_fingerprint: str  # hex SHA-256 of shapes + embedding weights; equal along a route
    num_layers: int  # blocks in the whole model
    layers: LayerRange  # the blocks this worker runs
    hidden_size: int  # width of the activations between workers
    vocab_size: int  # logits width (tail) and token-id bound (head)
    activation_dtype: str  # numpy dtype name of activations between workers ("float32")
    max_block: int  # largest rows-per-chunk a session may use (the probed exact tile)
    max_rollback: int  # largest max_rollback a session may use
    max_sessions: int  # sessions held at once
    max_sink: int  # largest sink a session may use
    max_window: int  # largest window a session may use
    kernels: str = ""  # what computes its products (serving_path.kernels_in_use()); equal along a route

    @property
    def is_head(self) -> bool:
        """This worker embeds token ids."""
        return self.layers.start == 0

    @property
    def is_tail(self) -> bool:
        """This worker returns logits."""
        return self.layers.end == self.num_layers


@dataclass(frozen=True, eq=False)
class ShardWork:
    """One block of rows for a session (prefill/append/verify block, or one decode row)."""

    work_id: int  # the frame's idempotency_step: the handle `cancel` uses
    position: int  # global position of the first row; must equal the session's position
    tokens: tuple[int, ...]  # the rows' token ids (required by the head, optional elsewhere)
    hidden: np.ndarray | None  # (rows, hidden) activations from the previous worker; None at the head
    all_logits: bool = False  # tail: logits for every row, else for the last row only

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return self.hidden.shape[0] if self.hidden is not None else len(self.tokens)


@dataclass(frozen=True, eq=False)
class ShardOutput:
    """The result of one block on one worker."""

    work_id: int  # echoes ShardWork.work_id
    position: int  # global position of the first row
    next_position: int  # the session's position after the block
    tensor: np.ndarray  # (rows, hidden) activations, or at the tail (rows or 1, vocab) float32 logits


@dataclass(frozen=True)
class ShardHealth:
    """Liveness of a worker's engine."""

    is_serving: bool  # work is accepted
    detail: str  # why not, or a short summary
    sessions: int  # sessions held


@dataclass(frozen=True)
class ShardMetrics:
    """Counters of a worker's engine since start."""

    sessions: int  # sessions held now
    kv_bytes: int  # KV storage held by them
    steps: int  # prefill/decode calls completed
    rows: int  # rows computed by them
    busy_s: float  # seconds spent computing them
    forwards: int = 0  # forwards that computed them (one forward may carry several sessions' steps)


def never_cancelled() -> bool:
    """`StepItem.is_cancelled` of an item no stream can cancel."""
    return False


@dataclass(frozen=True, eq=False)
class StepItem:
    """One session's prefill or decode block, as a worker queues it for its engine."""

    session_id: str
    work: ShardWork
    is_decode: bool  # a DecodeStep frame: exactly one row
    # The session stream's say (read on the engine thread): stop before the block, or at its next chunk boundary.
    is_cancelled: Callable[[], bool] = never_cancelled
