"""A throwaway PKI for TLS checks: a CA, a server certificate for 127.0.0.1/localhost, two client
certificates and a CA that signed nothing. The reliability battery's TLS section and the tests use it
(cryptography, a dev dependency); operators make real ones as docs/safety.md shows."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from inference_engine.security.spawn_pki import make_ca, sign_leaf, subject_alt_names


@dataclass(frozen=True)
class Pair:
    """A certificate and its key, as PEM files."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class TestPki:
    """A CA and what it signed."""

    ca: Path  # CA certificate (PEM)
    server: Pair  # CN=localhost, SAN localhost + 127.0.0.1
    client_a: Pair  # CN=client-a
    client_b: Pair  # CN=client-b
    other_ca: Path  # a CA that signed nothing here (a client trusting it must fail)


def _write(path: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return path


def make_pki(folder: Path) -> TestPki:
    """Write a fresh CA, server and client certificates under `folder`."""
    ca, ca_key = make_ca("inference-engine test CA")
    other, _ = make_ca("some other CA")
    pairs = {}
    for name, is_server in (("server", True), ("client-a", False), ("client-b", False)):
        if is_server:  # CN=localhost, SAN localhost + 127.0.0.1
            cert, key = sign_leaf("localhost", ca, ca_key, ExtendedKeyUsageOID.SERVER_AUTH,
                                  (x509.SubjectAlternativeName(subject_alt_names("127.0.0.1")), False))
        else:
            cert, key = sign_leaf(name, ca, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
        path = _write(folder / f"{name}.pem", cert, key)
        pairs[name] = Pair(path, path.with_suffix(".key"))
    return TestPki(_write(folder / "ca.pem", ca), pairs["server"], pairs["client-a"], pairs["client-b"],
                   _write(folder / "other-ca.pem", other))
