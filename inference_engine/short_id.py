"""Short, stable hashes for logs: session ids, tokens and identities are never logged whole.

A session id is the only capability a client holds over its session, and a bearer token
is a credential; a 12-hex-digit SHA-256 prefix still lets an operator follow one session
or one client through the log without either appearing in it.
"""

from __future__ import annotations

import hashlib

SHORT_ID_HEX = 12  # 48 bits: collisions are unlikely among a server's live sessions


def short_id(value: str) -> str:
    """A short hash of `value` for log lines ("-" for an empty value).

    Args:
        value: a session id, an identity or a token.
    Returns:
        The first SHORT_ID_HEX hex digits of the value's SHA-256.
    """
    if not value:
        return "-"
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:SHORT_ID_HEX]
