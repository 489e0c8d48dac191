"""A session: its coordinator (token log + cache), its settings and its bookkeeping."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from inference_engine.errors import SessionBusy
from inference_engine.security.settings import ANONYMOUS
from inference_engine.session.coordinator import SessionCoordinator
from inference_engine.short_id import short_id
from inference_engine.text.chat import ChatLog
from inference_engine.text.constraint import ConstraintRun
from inference_engine.verifier.sink_window_verifier import SinkWindowVerifier
from inference_engine.execution.token_log import TokenLog, Watermark


@dataclass
class DraftCache:
    """A draft model's cache following the session's log by position (speculative decoding)."""

    verifier: SinkWindowVerifier  # over the draft model; keeps no tokens of its own
    followed: Watermark  # lowered when the log is cut back below `length`
    length: int = 0  # log tokens the cache held when it last synced (still valid up to followed.valid)
    drafted: list[int] = field(default_factory=list)  # tokens past those: the last step's own token and drafts


@dataclass
class Session:
    """Mutable per-session state; only the engine thread touches `coordinator` and `draft`."""

    session_id: str  # unguessable id
    coordinator: SessionCoordinator  # the session's token log and cache, and their only writer
    sink: int  # attention-sink tokens
    window: int  # window tokens
    eos_token_ids: tuple[int, ...]  # tokens that end generation
    client_label: str  # echoed back
    created_ns: int = field(default_factory=time.time_ns)  # wall clock at creation
    last_used_ns: int = field(default_factory=time.time_ns)  # wall clock of the last RPC
    last_used_mono: float = field(default_factory=time.monotonic)  # for TTL
    is_closed: bool = False  # closed or expired; no new RPCs
    is_busy: bool = False  # an AppendTokens/Generate holds it
    draft: DraftCache | None = None  # the draft model's cache, built on first SPECULATIVE_DRAFT use
    owner: str = ANONYMOUS  # identity that created it; no other identity can see it
    chat: ChatLog = field(default_factory=ChatLog)  # messages appended and replies generated (text/chat.py)
    constraint: ConstraintRun | None = None  # the constraint its last constrained Generate ran under

    @property
    def tag(self) -> str:
        """Short hash of the id, for logs."""
        return short_id(self.session_id)

    @property
    def history(self) -> TokenLog:
        """The session's token log (owned by its coordinator)."""
        return self.coordinator.log

    @property
    def kv_bytes(self) -> int:
        """K/V bytes the session holds: its slab, and the draft model's if it has one."""
        draft = self.draft.verifier.nbytes if self.draft is not None else 0
        return self.coordinator.verifier.nbytes + draft

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
                f"session {self.tag}… is busy with another AppendTokens/Generate call; "
                "calls on one session must not overlap: retry after it finishes"
            )
        self.is_busy = True
        self.touch()

    def release(self) -> None:
        """Give the session back after a call."""
        self.is_busy = False
        self.touch()

    def free(self) -> None:
        """Free its K/V (target and draft), here or on a route. Idempotent."""
        self.coordinator.close()
        if self.draft is not None:
            self.draft.verifier.executor.close()
            self.draft = None
