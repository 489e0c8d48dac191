"""Security flags shared by `serve` and `shard-worker`, and the start-up exposure rule."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from inference_engine.security.credentials import is_loopback
from inference_engine.security.settings import ClientSecurity, ServerSecurity
from inference_engine.security.tokens import read_token_file

log = logging.getLogger(__name__)


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None


def add_server_security_flags(parser: argparse.ArgumentParser) -> None:
    """Register --tls-cert, --tls-key, --tls-client-ca, --auth-token-file, --insecure-public."""
    parser.add_argument("--tls-cert", metavar="PEM", help="serve TLS with this certificate chain (needs --tls-key)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--tls-client-ca", metavar="PEM",
                        help="mTLS: require client certificates signed by this CA (needs --tls-cert)")
    parser.add_argument("--auth-token-file", metavar="FILE",
                        help="require `authorization: Bearer <token>` with one of these tokens (one per line, "
                             "each one identity)")
    parser.add_argument("--insecure-public", action="store_true",
                        help="serve a non-loopback --host without TLS and authentication (logged as a WARNING)")


def server_security_from_args(args: argparse.Namespace) -> ServerSecurity:
    """Build a ServerSecurity from parsed flags.

    Raises:
        ValueError: an incomplete combination (a certificate without its key, mTLS without TLS).
    """
    security = ServerSecurity(
        tls_cert=_path(args.tls_cert), tls_key=_path(args.tls_key), tls_client_ca=_path(args.tls_client_ca),
        auth_token_file=_path(args.auth_token_file), insecure_public=args.insecure_public,
    )
    if (security.tls_cert is None) != (security.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if security.is_mtls and not security.is_tls:
        raise ValueError("--tls-client-ca (mTLS) needs --tls-cert and --tls-key")
    return security


def exposure_problem(host: str, security: ServerSecurity) -> str:
    """Why serving `host` with `security` exposes it; "" when it does not.

    A non-loopback address needs TLS and an authenticated caller (a token or a client
    certificate): without them anyone who reaches it reads and drives every session.
    """
    if is_loopback(host) or (security.is_tls and security.is_authenticated):
        return ""
    missing = [what for what, ok in (("TLS (--tls-cert/--tls-key)", security.is_tls),
                                     ("authentication (--auth-token-file or --tls-client-ca)",
                                      security.is_authenticated)) if not ok]
    return f"--host {host} is not a loopback address and the server has no {' and no '.join(missing)}"


def check_exposure(host: str, security: ServerSecurity) -> None:
    """Refuse an exposed bind unless --insecure-public (then log a WARNING).

    Raises:
        ValueError: `host` is not loopback, TLS or authentication is missing and
            --insecure-public was not given.
    """
    problem = exposure_problem(host, security)
    if problem and not security.insecure_public:
        raise ValueError(f"{problem}: anyone who reaches it could use every session. Give TLS and "
                         "authentication, bind 127.0.0.1, or pass --insecure-public to accept the risk")
    if problem:
        log.warning("INSECURE: %s; --insecure-public was given, so anyone who reaches this address can read, "
                    "drive and close every session and see every token sent to it", problem)


def add_client_security_flags(parser: argparse.ArgumentParser, prefix: str, what: str) -> None:
    """Register --{prefix}tls-ca, --{prefix}tls-cert, --{prefix}tls-key, --{prefix}token-file for a client role."""
    parser.add_argument(f"--{prefix}tls-ca", metavar="PEM", help=f"connect to {what} over TLS, trusting this CA")
    parser.add_argument(f"--{prefix}tls-cert", metavar="PEM", help=f"client certificate presented to {what} (mTLS)")
    parser.add_argument(f"--{prefix}tls-key", metavar="PEM", help=f"private key of --{prefix}tls-cert")
    parser.add_argument(f"--{prefix}token-file", metavar="FILE",
                        help=f"send the first bearer token of this file to {what}")


def client_security_from_args(args: argparse.Namespace, prefix: str) -> ClientSecurity:
    """Build a ClientSecurity from the flags of `add_client_security_flags`.

    Raises:
        OSError: the token file cannot be read.
        ValueError: an incomplete combination, or an empty token file.
    """
    attr = prefix.replace("-", "_")
    ca, cert, key, token_file = (getattr(args, f"{attr}{name}") for name in ("tls_ca", "tls_cert", "tls_key", "token_file"))
    if (cert is None) != (key is None):
        raise ValueError(f"--{prefix}tls-cert and --{prefix}tls-key go together")
    if cert is not None and ca is None:
        raise ValueError(f"--{prefix}tls-cert (mTLS) needs --{prefix}tls-ca")
    token = read_token_file(Path(token_file)) if token_file else ""
    return ClientSecurity(ca_file=_path(ca), cert_file=_path(cert), key_file=_path(key), token=token)
