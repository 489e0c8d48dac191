"""What a server accepts and what a client presents: two frozen dataclasses built from flags."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ANONYMOUS = "anonymous"  # the identity of every client when authentication is off


@dataclass(frozen=True)
class ServerSecurity:
    """How a gRPC server (RuntimeService or a shard worker) accepts connections."""

    tls_cert: Path | None = None  # PEM certificate chain of the server; TLS is on when set
    tls_key: Path | None = None  # PEM private key of `tls_cert`
    tls_client_ca: Path | None = None  # PEM CA that signs client certificates: mTLS (a client certificate is required)
    auth_token_file: Path | None = None  # bearer tokens, one per line, each one identity; None = no token check
    insecure_public: bool = False  # serve a non-loopback address without TLS and authentication anyway

    @property
    def is_tls(self) -> bool:
        """Connections are encrypted."""
        return self.tls_cert is not None

    @property
    def is_mtls(self) -> bool:
        """Clients must present a certificate signed by `tls_client_ca`."""
        return self.tls_client_ca is not None

    @property
    def has_tokens(self) -> bool:
        """Calls must carry a known bearer token."""
        return self.auth_token_file is not None

    @property
    def is_authenticated(self) -> bool:
        """Every caller proves an identity (a token or a client certificate)."""
        return self.has_tokens or self.is_mtls

    def describe(self) -> str:
        """One line for the start-up log (file names only, never a token)."""
        tls = "mTLS" if self.is_mtls else "TLS" if self.is_tls else "no TLS"
        auth = "bearer tokens" if self.has_tokens else "client certificates" if self.is_mtls else "no authentication"
        return f"{tls}, {auth}"


@dataclass(frozen=True)
class ClientSecurity:
    """What a client presents to a server (the route's workers, tests, scripts, a CLI)."""

    ca_file: Path | None = None  # PEM CA that signed the server's certificate; TLS is on when set
    cert_file: Path | None = None  # PEM client certificate (mTLS)
    key_file: Path | None = None  # PEM private key of `cert_file`
    token: str = field(default="", repr=False)  # bearer token sent on every call; "" = none (never in repr or logs)
    server_name: str = ""  # name to check in the server certificate when the target address is not in it

    @property
    def is_tls(self) -> bool:
        """The channel is encrypted."""
        return self.ca_file is not None
