"""The address `serve` binds by default and the client CLI reaches (stdlib only: the client imports it)."""

from __future__ import annotations

import os

DEFAULT_ADDRESS = "127.0.0.1:50051"
ADDRESS_ENV = "INFERENCE_ENGINE_ADDRESS"


def default_address() -> tuple[str, int]:
    """(HOST, PORT) from $INFERENCE_ENGINE_ADDRESS, else 127.0.0.1:50051.

    Raises:
        ValueError: the variable is set but is not HOST:PORT.
    """
    address = os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{ADDRESS_ENV}={address!r} is not HOST:PORT")
    return host, int(port)
