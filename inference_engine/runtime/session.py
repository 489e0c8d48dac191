"""A session: its token history, its verifier (KV slab) and its bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from inference_engine.errors import SessionBusy
from inference_engine.text.chat import ChatLog
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier


@dataclass
class Session:
    """Mutable per-session state; only the engine thread touches `verifier`."""

    session_id: str  # unguessable id
    verifier: SinkWindowVerifier  # cache + next-token logits
    sink: int  # attention-sink tokens
    window: int  # window tokens
    eos_token_ids: tuple[int, ...]  # tokens that end generation
    client_label: str  # echoed back
    created_ns: int = field(default_factory=time.time_ns)  # wall clock at creation
    last_used_ns: int = field(default_factory=time.time_ns)  # wall clock of the last RPC
    last_used_mono: float = field(default_factory=time.monotonic)  # for TTL
    history: list[int] = field(default_factory=list)  # append-only token history (INV-1)
    is_closed: bool = False  # closed or expired; no new RPCs
    is_busy: bool = False  # an AppendTokens/Generate holds it
    drafters: dict[Any, Any] = field(default_factory=dict)  # DecodeMode -> Drafter, built on first use
    chat: ChatLog = field(default_factory=ChatLog)  # messages appended and replies generated (text/chat.py)

    def touch(self) -> None:
        """Record use now (TTL restarts)."""
        self.last_used_ns = time.time_ns()
        self.last_used_mono = time.monotonic()

    def acquire(self, what: str) -> None:
        """Take the session for one Append/Generate call.

        Raises:
            SessionBusy: another call holds it.
        """
        if self.is_busy:
            raise SessionBusy(
                f"session {self.session_id} is busy with another AppendTokens/Generate call; "
                "calls on one session must not overlap: retry after it finishes"
            )
        self.is_busy = True
        self.touch()

    def release(self) -> None:
        """Give the session back after a call."""
        self.is_busy = False
        self.touch()
