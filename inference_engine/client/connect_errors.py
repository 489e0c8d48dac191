"""What a failed call to the server means, in words: nothing listening, a TLS handshake that failed, a
connection closed during set-up (a TLS server reached in plaintext, or mTLS without a certificate),
credentials refused, or the server's own answer."""

from __future__ import annotations

import grpc

from inference_engine.security.settings import ClientSecurity

START_HINT = ("start one with `inference-engine serve` (or `python -m inference_engine serve`), or pass --target "
              "HOST:PORT / set INFERENCE_ENGINE_ADDRESS")


def is_connection_failure(exc: grpc.RpcError) -> bool:
    """The call never reached a server (grpc could not connect); anything else is the server's answer."""
    details = (exc.details() or "").lower()
    return exc.code() == grpc.StatusCode.UNAVAILABLE and ("failed to connect" in details or "errors resolving" in details)


def explain(target: str, exc: grpc.RpcError, security: ClientSecurity) -> str:
    """One line saying what went wrong with a call to `target` and what to try."""
    code, details = exc.code(), exc.details() or ""
    low = details.lower()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        hint = ("pass the right token (--token-file FILE, --token, or $INFERENCE_ENGINE_TOKEN)" if security.token else
                "the server requires a bearer token: pass --token-file FILE, --token, or set $INFERENCE_ENGINE_TOKEN")
        return f"UNAUTHENTICATED: {target} refused the call ({details}); {hint}"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"PERMISSION_DENIED: {details}"
    if not is_connection_failure(exc):
        return f"{code.name}: {details}"
    if "connection refused" in low:
        return f"connection refused: no server listens at {target}; {START_HINT}"
    if "errors resolving" in low:
        return f"cannot resolve {target}: {details}"
    if "handshake" in low or "ssl" in low or "certificate" in low:
        if "wrong_version_number" in low:
            why = "the server does not speak TLS (drop --tls-ca to connect in plaintext)"
        elif "certificate_verify_failed" in low:
            why = ("the server's certificate is not signed by --tls-ca, or does not name the host of --target "
                   "(--tls-server-name NAME checks another name)")
        else:
            why = "check --tls-ca, --tls-cert/--tls-key and the server's TLS flags"
        return f"TLS handshake with {target} failed: {why} [{details.rsplit(': ', 1)[0]}]"
    if "socket closed" in low or "connection reset" in low:
        why = ("the server may require TLS: pass --tls-ca PEM (the CA of its certificate)" if not security.is_tls else
               "the server may require a client certificate (mTLS): pass --tls-cert and --tls-key")
        return f"{target} closed the connection while it was being set up: {why}"
    return f"cannot connect to {target}: {details}"
