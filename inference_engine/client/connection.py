"""How the CLI reaches a server: --target, --connect-timeout, TLS (--tls-ca, mTLS) and a bearer token.

The token comes from --token-file, else --token, else $INFERENCE_ENGINE_TOKEN (a flag's value is
visible to other users in the process list; the file and the variable are not).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from inference_engine.address import ADDRESS_ENV, DEFAULT_ADDRESS
from inference_engine.security.settings import ClientSecurity
from inference_engine.security.tokens import read_token_file

TOKEN_ENV = "INFERENCE_ENGINE_TOKEN"


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{value:g} is out of range; allowed above 0 seconds")
    return value


def add_connection_flags(parser: argparse.ArgumentParser) -> None:
    """Register --target, --connect-timeout, --tls-ca, --tls-cert, --tls-key, --tls-server-name, --token(-file)."""
    parser.add_argument("--target", default=os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS,
                        help=f"server HOST:PORT (default ${ADDRESS_ENV}, else {DEFAULT_ADDRESS})")
    parser.add_argument("--connect-timeout", type=positive_seconds, default=5.0,
                        help="seconds to wait for a server that answers but is not ready yet (a refused "
                             "connection fails at once; default %(default)s)")
    parser.add_argument("--tls-ca", metavar="PEM", help="connect over TLS, trusting the CA that signed the server's "
                        "certificate (the server's --tls-cert)")
    parser.add_argument("--tls-cert", metavar="PEM", help="client certificate for a server with --tls-client-ca (mTLS)")
    parser.add_argument("--tls-key", metavar="PEM", help="private key of --tls-cert")
    parser.add_argument("--tls-server-name", metavar="NAME", default="",
                        help="name to check in the server's certificate when --target's host is not in it")
    token = parser.add_mutually_exclusive_group()
    token.add_argument("--token-file", metavar="FILE", help="send the first bearer token of this file")
    token.add_argument("--token", help=f"send this bearer token (visible in the process list: prefer --token-file "
                                       f"or ${TOKEN_ENV})")


def client_security(args: argparse.Namespace) -> ClientSecurity:
    """What the CLI presents to the server, from its flags and $INFERENCE_ENGINE_TOKEN.

    Raises:
        ValueError: --tls-cert without --tls-key (or the reverse), mTLS without --tls-ca, an empty token file.
        OSError: the token file cannot be read.
    """
    if (args.tls_cert is None) != (args.tls_key is None):
        raise ValueError("--tls-cert and --tls-key go together")
    if args.tls_cert is not None and args.tls_ca is None:
        raise ValueError("--tls-cert (mTLS) needs --tls-ca: the CA that signed the server's certificate")
    for flag, value in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
        if value is not None and not Path(value).is_file():
            raise ValueError(f"{flag} {value}: no such file")
    token = read_token_file(Path(args.token_file)) if args.token_file else args.token or os.environ.get(TOKEN_ENV, "")
    path = lambda value: Path(value) if value else None  # noqa: E731
    return ClientSecurity(ca_file=path(args.tls_ca), cert_file=path(args.tls_cert), key_file=path(args.tls_key),
                          token=token.strip(), server_name=args.tls_server_name)
