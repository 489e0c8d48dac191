"""Smoke constants, result types and the prompt tokenizer."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VOCAB_SIZE = 49152  # SmolLM2; the first out-of-vocab id
RPC_TIMEOUT_S = 120.0  # deadline of every RPC, so a hung server fails the run instead of stalling it
READY_TIMEOUT_S = 300.0  # the first start may convert the packaged model
PROMPT = "What is the capital of France? Answer in one sentence."
FOLLOW_UP = "And of Italy?"
# SmolLM2 chat-template ids of PROMPT and FOLLOW_UP, used when the tokenizer cannot be loaded.
FALLBACK_PROMPT_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
    8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 19842, 281, 582, 6330, 30, 2, 198,
    1, 520, 9531, 198,
]
FALLBACK_FOLLOW_UP_IDS = [1, 4093, 198, 3528, 282, 7158, 47, 2, 198, 1, 520, 9531, 198]
IM_END_IDS = [2, 198]  # "<|im_end|>\n", closing an assistant turn that did not end on EOS


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

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0


class Tokenizer:
    """The packaged model's tokenizer, or fixed ids when it cannot be loaded."""

    def __init__(self) -> None:
        self.hf: Any = None
        self.source = "fixed token ids (tokenizer unavailable)"
        try:
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer

            from inference_engine.config import default_cache_dir
            from inference_engine.model.packaged import ensure_packaged_model

            folder = ensure_packaged_model(default_cache_dir())
            self.hf = AutoTokenizer.from_pretrained(str(folder))
            self.source = str(folder)
        except Exception as exc:  # noqa: BLE001 - any failure falls back to fixed ids
            self.source += f": {type(exc).__name__}: {exc}"

    def chat_prompt(self, text: str) -> list[int]:
        """Ids of a one-turn conversation ending with the assistant's header."""
        if self.hf is None:
            return list(FALLBACK_PROMPT_IDS)
        rendered = self.hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return list(self.hf.encode(rendered, add_special_tokens=False))

    def follow_up(self, text: str, ended_turn: bool) -> list[int]:
        """Ids of a further user turn; closes the assistant's turn first unless it ended on EOS."""
        prefix = [] if ended_turn else list(IM_END_IDS)
        if self.hf is None:
            return prefix + list(FALLBACK_FOLLOW_UP_IDS)
        turn = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        return prefix + list(self.hf.encode(turn, add_special_tokens=False))

    def decode(self, tokens: list[int]) -> str | None:
        return None if self.hf is None else self.hf.decode(tokens)
