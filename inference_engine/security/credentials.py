"""grpcio credentials from the security settings: server ports and client channels."""

from __future__ import annotations

import ipaddress
import ssl
from pathlib import Path
from typing import Sequence

import grpc

from inference_engine.security.settings import ClientSecurity, ServerSecurity

ChannelOptions = Sequence[tuple[str, object]]
# grpc sets SO_REUSEPORT on its listeners by default: a second server on a port in use would then
# start, and the kernel would spread connections (and so sessions) over both. Bind exclusively.
SERVER_OPTIONS: ChannelOptions = (("grpc.so_reuseport", 0),)


def is_loopback(host: str) -> bool:
    """`host` (a bind address or a target host) only reaches this machine."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # any other name may resolve anywhere


def split_host(target: str) -> str:
    """The host part of `host:port` (IPv6 in brackets allowed)."""
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or target.startswith("[") else target
    return host.strip("[]")


def _read(path: Path | None) -> bytes | None:
    return path.read_bytes() if path is not None else None


def server_credentials(security: ServerSecurity) -> grpc.ServerCredentials | None:
    """TLS (or mTLS) credentials for a server port; None for a plaintext port.

    Raises:
        OSError: a certificate or key file cannot be read.
    """
    if not security.is_tls:
        return None
    _check_pem(security)
    return grpc.ssl_server_credentials(
        [(_read(security.tls_key), _read(security.tls_cert))],
        root_certificates=_read(security.tls_client_ca),
        require_client_auth=security.is_mtls,
    )


def _check_pem(security: ServerSecurity) -> None:
    """Load the certificate, key and client CA as a TLS server would, so a bad one is named now (grpc
    only fails the bind, as if the port were the problem, and says why on its own stderr).

    Raises:
        OSError: a file cannot be read, is not PEM, or the key does not match the certificate.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(security.tls_cert, security.tls_key)
    except ssl.SSLError as exc:
        raise OSError(f"--tls-cert {security.tls_cert} / --tls-key {security.tls_key} cannot be used: not a PEM "
                      f"certificate chain and its private key ({exc.reason or exc})") from None
    if security.tls_client_ca is not None:
        try:
            context.load_verify_locations(cafile=security.tls_client_ca)
        except ssl.SSLError as exc:
            raise OSError(f"--tls-client-ca {security.tls_client_ca} cannot be used: not a PEM CA certificate "
                          f"({exc.reason or exc})") from None


def bind(server: grpc.aio.Server, address: str, security: ServerSecurity) -> int:
    """Add a port for `address` with the configured credentials; returns the bound port.

    Raises:
        OSError: the address cannot be bound or a credential file cannot be read.
    """
    credentials = server_credentials(security)
    try:
        if credentials is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, credentials)
    except RuntimeError as exc:
        raise OSError(f"could not bind {address} (in use by another process?): {exc}") from exc
    if port == 0:
        raise OSError(f"could not bind {address} (in use by another process?)")
    return port


def channel_credentials(target: str, security: ClientSecurity) -> grpc.ChannelCredentials | None:
    """Credentials for a channel to `target`; None for a plaintext channel without a token.

    A token is sent only over TLS or to a loopback address (grpcio's local credentials:
    the connection is checked to be loopback, nothing is encrypted).

    Raises:
        OSError: a certificate or key file cannot be read.
        ValueError: a token would travel in clear to a non-loopback address.
    """
    if security.is_tls:
        channel = grpc.ssl_channel_credentials(
            root_certificates=_read(security.ca_file), private_key=_read(security.key_file),
            certificate_chain=_read(security.cert_file),
        )
    elif security.token:
        if not is_loopback(split_host(target)):
            raise ValueError(f"refusing to send a bearer token in clear to {target}: give the server's CA (TLS)")
        channel = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    else:
        return None
    if security.token:
        return grpc.composite_channel_credentials(channel, grpc.access_token_call_credentials(security.token))
    return channel


def _options(security: ClientSecurity, options: ChannelOptions) -> list[tuple[str, object]]:
    extra = [("grpc.ssl_target_name_override", security.server_name)] if security.server_name else []
    return [*options, *extra]


def open_channel(target: str, security: ClientSecurity | None = None, options: ChannelOptions = ()) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` presenting `security` (CA, client certificate, token).

    Raises:
        OSError, ValueError: as `channel_credentials`.
    """
    security = security or ClientSecurity()
    credentials = channel_credentials(target, security)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, credentials, options=_options(security, options))


def open_sync_channel(target: str, security: ClientSecurity | None = None, options: ChannelOptions = ()) -> grpc.Channel:
    """A blocking grpc channel to `target` presenting `security` (as `open_channel`)."""
    security = security or ClientSecurity()
    credentials = channel_credentials(target, security)
    if credentials is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, credentials, options=_options(security, options))
