"""Bearer tokens: a file of one token per line, each token one identity.

Tokens are kept only as SHA-256 digests; an identity is named after a prefix of its
token's digest, so neither a token nor anything that compares equal to it is ever logged.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

MIN_TOKEN_CHARS = 16  # a guessable token would make ownership meaningless
BEARER = "bearer "


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_identity(token: str) -> str:
    """The identity a token stands for: `token:` + 16 hex digits of its SHA-256."""
    return "token:" + _digest(token).hex()[:16]


def parse_bearer(value: str) -> str:
    """The token of an `authorization` metadata value (`Bearer <token>`), "" if it is not one."""
    if value[: len(BEARER)].lower() != BEARER:
        return ""
    return value[len(BEARER):].strip()


class TokenTable:
    """Known tokens (as digests) and the identity of each."""

    def __init__(self, tokens: list[str]):
        """
        Args:
            tokens: the accepted tokens (at least one, each MIN_TOKEN_CHARS or more, no blanks).
        Raises:
            ValueError: no tokens, a short or blank-containing token, or a duplicate.
        """
        if not tokens:
            raise ValueError("the token file holds no tokens; put one bearer token per line")
        self._identities: dict[bytes, str] = {}
        for i, token in enumerate(tokens, 1):
            if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
                raise ValueError(f"token {i} is shorter than {MIN_TOKEN_CHARS} characters or contains blanks; "
                                 "use long random tokens (e.g. `openssl rand -hex 32`)")
            digest = _digest(token)
            if digest in self._identities:
                raise ValueError(f"token {i} appears twice; each token is one identity")
            self._identities[digest] = token_identity(token)

    @classmethod
    def load(cls, path: Path) -> "TokenTable":
        """Read a token file: one token per line; blank lines and lines starting with `#` are skipped.

        Raises:
            OSError: the file cannot be read.
            ValueError: as the constructor (messages give the token's position, never its text).
        """
        lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
        return cls([line for line in lines if line and not line.startswith("#")])

    def __len__(self) -> int:
        return len(self._identities)

    def identity_of(self, token: str) -> str | None:
        """The identity of `token`, None if the token is not known."""
        digest = _digest(token)
        for known, identity in self._identities.items():  # compare every digest in constant time
            if hmac.compare_digest(known, digest):
                return identity
        return None


def read_token_file(path: Path) -> str:
    """The first token of a token file (what a client presents).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file holds no token.
    """
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    raise ValueError(f"{path} holds no token")
