"""Smoke constants and result types (prompts go to the server as text: it tokenizes and renders)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 49152  # SmolLM2; the first out-of-vocab id
RPC_TIMEOUT_S = 120.0  # deadline of every RPC, so a hung server fails the run instead of stalling it
READY_TIMEOUT_S = 300.0  # the first start may convert the packaged model
PROMPT = "What is the capital of France? Answer in one sentence."
FOLLOW_UP = "And of Italy?"
# The seeded-sampling scenario: SmolLM2 copies this list for a while under this seed (prompt lookup then has
# drafts accepted: 7 of 9), and the draws depart from greedy.
COPY = "Copy this list exactly: red, green, blue, red, green, blue, red, green, blue"
SAMPLING = {"temperature": 1.0, "top_p": 0.95, "seed": 1234}


class CheckFailed(Exception):
    """A scenario got the expected code but a property of the result was wrong."""

    def __init__(self, message: str, observed: str = "OK"):
        super().__init__(message)
        self.observed = observed  # gRPC code name the scenario did observe


@dataclass
class ScenarioResult:
    """One line of the report."""

    name: str  # scenario name
    expected: str  # gRPC code name expected (or an exit status for server_exit)
    observed: str  # gRPC code name observed
    details: str  # server's status details, or what the scenario saw
    duration_ms: float  # wall time of the whole scenario
    passed: bool  # observed == expected and every extra check held
    data: dict[str, Any] = field(default_factory=dict)  # scenario-specific evidence


@dataclass
class Generated:
    """What one Generate stream delivered."""

    tokens: list[int]  # tokens received, in order
    stop_reason: str  # StopReason name of the last message ("" if the stream ended without one)
    history_length: int  # history length reported by the last message
    seconds: float  # wall time of the stream
    text: str = ""  # the streamed text, concatenated
    logprobs: int = 0  # TokenLogprob entries received
    usage: dict[str, Any] = field(default_factory=dict)  # the last message's usage
    drafted: int = 0  # draft tokens verified in the call (last message)
    accepted: int = 0  # of those, accepted

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0
