"""Who is calling: a bearer token's identity, a client certificate's subject, or anonymous."""

from __future__ import annotations

from typing import Iterable

import grpc

from inference_engine.errors import Unauthenticated
from inference_engine.security.settings import ANONYMOUS, ServerSecurity
from inference_engine.security.tokens import TokenTable, parse_bearer

AUTHORIZATION = "authorization"  # metadata key of the bearer token
_SUBJECT_KEYS = ("x509_subject", "x509_common_name")  # auth-context properties naming the client certificate


class Authenticator:
    """Maps a call to its identity.

    With tokens, the identity is the token's (a client certificate under mTLS only admits
    the connection); with mTLS alone, the certificate subject; otherwise every caller is
    the one anonymous identity.
    """

    def __init__(self, tokens: TokenTable | None = None, is_mtls: bool = False):
        self.tokens = tokens
        self.is_mtls = is_mtls

    @classmethod
    def from_security(cls, security: ServerSecurity) -> "Authenticator":
        """Read the token file, if any.

        Raises:
            OSError, ValueError: the token file cannot be read or is malformed.
        """
        tokens = TokenTable.load(security.auth_token_file) if security.auth_token_file else None
        return cls(tokens, security.is_mtls)

    def identity_of_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
        """The identity of the bearer token in `metadata`; None when missing or unknown (or no tokens)."""
        if self.tokens is None:
            return None
        for key, value in metadata or ():
            if key == AUTHORIZATION and isinstance(value, str):
                token = parse_bearer(value)
                if token:
                    return self.tokens.identity_of(token)
        return None

    def identity_of(self, context: grpc.aio.ServicerContext) -> str:
        """The caller's identity (the owner of the sessions it creates).

        Raises:
            Unauthenticated: tokens are required and the call has no known one (the
                interceptor normally rejects such calls before they get here).
        """
        if self.tokens is not None:
            identity = self.identity_of_metadata(context.invocation_metadata())
            if identity is None:
                raise Unauthenticated(MISSING_TOKEN)
            return identity
        if self.is_mtls:
            auth = context.auth_context()
            for key in _SUBJECT_KEYS:
                if auth.get(key):
                    return "cert:" + auth[key][0].decode("utf-8", "replace")
            raise Unauthenticated("the client certificate names no subject")
        return ANONYMOUS


MISSING_TOKEN = ("this server requires a bearer token: send metadata `authorization: Bearer <token>` "
                 "with a token from its --auth-token-file")
