"""Constrained output: a JSON schema, JSON object, regex or grammar compiled by llguidance.

We write no parser: llguidance (the token-mask engine llama.cpp, vLLM and SGLang use) compiles
the constraint against the model's own tokenizer and answers, for the tokens produced so far,
which token ids may come next. The decoder masks the exact logits with that answer before its
greedy or seeded draw (decoding/step.py), so a constrained token is still a pure function of
(seed, position, logits, constraint, the tokens since the constraint began).

A `Constraint` is the request's plain data; `ConstraintCompiler` turns it into a fresh
`TokenMatcher` (one per Generate call, re-derived from the session's tokens when a call
continues a constraint: see `ConstraintRun`).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Literal, Sequence

import llguidance
import llguidance.hf
import numpy as np

from inference_engine.errors import FeatureUnavailable, InvalidConstraint, InvariantViolation
from inference_engine.text.codec import TextCodec

ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]
CONSTRAINT_KINDS: tuple[ConstraintKind, ...] = ("json_schema", "json_object", "regex", "grammar")
ANY_JSON_OBJECT = '{"type": "object"}'  # json_object: any object, as llguidance reads a schema
# JSON is compact (`,` and `:`, no whitespace between tokens): with whitespace allowed a small model
# can pad an object with newlines until max_new_tokens. A schema's own "x-guidance" options override it.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class Constraint:
    """What every generated token must keep the output matching."""

    kind: ConstraintKind  # which language `source` is written in
    source: str  # the schema (JSON text), regex or Lark grammar; ANY_JSON_OBJECT for json_object

    @property
    def field(self) -> str:
        """The request field that carries it, for error messages (`constraint.regex`)."""
        return f"constraint.{self.kind}"


@dataclass(frozen=True)
class ConstraintRun:
    """A constraint a session's output is under: the tokens from `start` on were produced under it."""

    constraint: Constraint  # the constraint
    start: int  # history length when its first token was generated


class TokenMatcher:
    """One output's position in its constraint (llguidance's LLMatcher); engine thread only.

    A mask is a pure function of the tokens consumed, so it can be computed before it is needed:
    `prefetch` computes masks while a forward runs (after the tokens of a planned block, or here),
    and `allowed` answers from them while the tokens consumed since follow that block.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int):
        self._m = matcher
        self._vocab = vocab_size
        self._ahead: tuple[int, ...] = ()  # the tokens `prefetch` computed masks after
        self._masks: dict[int, np.ndarray] = {}  # _masks[d]: the mask after _ahead[:d]
        self._depth: int | None = None  # consumed since `prefetch`, all along _ahead; None: left it

    def allowed(self) -> np.ndarray:
        """(V,) bool: the tokens that may come next (EOS only once the output is complete).

        Raises:
            InvariantViolation: the matcher failed (llguidance's reason).
        """
        if self._depth in self._masks:
            return self._masks[self._depth]
        return self._compute()

    def prefetch(self, tokens: Sequence[int] = (), here: bool = False) -> None:
        """Compute ahead of need the masks after each token of `tokens`, and here too if `here`.

        The matcher ends where it began; `allowed` then answers from these masks for as long as the
        tokens consumed follow `tokens`. The prefetch stops before a token the constraint refuses
        and before one that completes the output (no mask follows it).
        """
        self._ahead, self._masks, self._depth = (), {}, None
        masks: dict[int, np.ndarray] = {}
        if here and not self._m.is_stopped():
            masks[0] = self._compute()
        depth = 0
        try:
            for t in tokens[: self._m.validate_tokens(list(tokens))]:
                self._m.consume_token(t)
                if self._m.is_stopped():
                    self._m.rollback(1)
                    break
                depth += 1
                masks[depth] = self._compute()
        finally:  # also when a mask fails: the matcher ends where it began
            self._m.rollback(depth)
        for mask in masks.values():
            mask.setflags(write=False)  # shared by every `allowed` that answers from it
        self._ahead, self._masks, self._depth = tuple(tokens[:depth]), masks, 0

    def consume(self, token: int) -> None:
        """Advance past `token` (one the mask allowed).

        Raises:
            InvariantViolation: the constraint does not allow it.
        """
        self._m.consume_token(token)
        self._check()
        if self._depth is not None:
            is_ahead = self._depth < len(self._ahead) and self._ahead[self._depth] == token
            self._depth = self._depth + 1 if is_ahead else None

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order from here, the constraint allows (nothing consumed)."""
        return self._m.validate_tokens(list(tokens))

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens."""
        if n:
            self._m.rollback(n)
            if self._depth is not None:
                self._depth = self._depth - n if n <= self._depth else None

    @property
    def is_complete(self) -> bool:
        """The output is complete: the constraint admits no further token (EOS included)."""
        return self._m.is_stopped()

    def _compute(self) -> np.ndarray:
        """(V,) bool: llguidance's mask for the tokens consumed so far (compute_bitmask, unpacked)."""
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._check()
        return np.unpackbits(bits, bitorder="little")[: self._vocab].astype(bool)  # (V,)

    def _check(self) -> None:
        if self._m.is_error():
            raise InvariantViolation(f"the output left its constraint: {self._m.get_error()}")


class ConstraintCompiler:
    """Compiles constraints against the model's tokenizer (thread-safe; the tokenizer is built once)."""

    def __init__(self, codec: TextCodec | None, vocab_size: int, eos_token_ids: Sequence[int]):
        """
        Args:
            codec: the model's tokenizer; None when it has none (constraints then unavailable).
            vocab_size: rows of the model's logits (the mask's length).
            eos_token_ids: the model's EOS ids (allowed once the output is complete).
        """
        self._codec = codec
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the model's tokenizer (built on first use: about half a second).

        Raises:
            FeatureUnavailable: the model has no tokenizer.
        """
        if self._codec is None:
            raise FeatureUnavailable("the served model has no tokenizer: constrained output needs one")
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(self._codec.hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos or None)
            return self._tokenizer

    @staticmethod
    def grammar(c: Constraint) -> str:
        """llguidance's grammar text for `c` (not yet checked).

        Raises:
            InvalidConstraint: a JSON schema that is not JSON, or not an object.
        """
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.source)
        if c.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(c.source)
        try:
            schema = json.loads(c.source)
        except ValueError as exc:
            raise InvalidConstraint(f"{c.field} is not JSON: {exc}", c.field) from None
        if not isinstance(schema, dict):
            raise InvalidConstraint(f"{c.field} must be a JSON object (a schema); got {type(schema).__name__}", c.field)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)  # checked by `matcher`

    def matcher(self, c: Constraint, produced: Sequence[int] = ()) -> TokenMatcher:
        """A matcher for `c` that has consumed `produced` (the tokens already generated under it).

        Raises:
            InvalidConstraint: the schema, regex or grammar does not compile (llguidance's message names where).
            InvariantViolation: `produced` does not match it.
            FeatureUnavailable: the model has no tokenizer.
        """
        tokenizer = self.tokenizer()
        grammar = self.grammar(c)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidConstraint(f"{c.field} is invalid: {messages[0].strip()}", c.field)
        raw = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if raw.is_error():
            raise InvalidConstraint(f"{c.field} is invalid: {raw.get_error().strip()}", c.field)
        m = TokenMatcher(raw, self.vocab_size)
        for t in produced:
            m.consume(t)
        return m

    def resume(self, c: Constraint, run: ConstraintRun | None, history: Sequence[int]) -> tuple[ConstraintRun,
                                                                                             TokenMatcher]:
        """The run a call with constraint `c` continues, or a new one at the end of `history`, and its matcher.

        A call continues the session's run when it passes the same constraint and the session's tokens
        since the run began still match it without completing it (so a constrained output split across
        calls, bursts or a fork is the output of one call); otherwise the constraint starts afresh.

        Raises:
            InvalidConstraint, FeatureUnavailable: as `matcher`.
        """
        if run is not None and run.constraint == c and run.start <= len(history):
            try:
                m = self.matcher(c, history[run.start:])
            except InvariantViolation:
                m = None  # the tokens since no longer match: start afresh (a compile error repeats below)
            if m is not None and not m.is_complete:
                return run, m
        return ConstraintRun(c, len(history)), self.matcher(c)
