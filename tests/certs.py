"""Test credentials: bearer-token files, and the throwaway PKI of scripts/reliabilitykit/pki.py
(a CA, a server certificate for 127.0.0.1/localhost, client certificates)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))  # the battery's package

from reliabilitykit.pki import Pair, TestPki, make_pki  # noqa: E402,F401  (re-exported for the tests)

TOKEN_A = "token-a-" + "0123456789abcdef"
TOKEN_B = "token-b-" + "fedcba9876543210"


def token_file(folder: Path, *tokens: str) -> Path:
    """A token file holding `tokens` (with a comment and a blank line, as operators write them)."""
    path = folder / "tokens.txt"
    path.write_text("# one bearer token per line\n\n" + "\n".join(tokens) + "\n")
    return path
