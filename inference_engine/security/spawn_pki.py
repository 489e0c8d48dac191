"""A certificate authority that lives for one `serve --spawn-shards`: mTLS between the route and its workers.

A spawned worker's port is free from the moment the worker dies until its restart binds it
again, and any local process can bind it meanwhile. So the route must know that it talks to
the workers this server spawned, whatever holds the port, before it sends anything (the bearer
token, token ids, activations). At start-up the supervisor makes a CA, signs one certificate
for its workers and one for the route, and forgets the CA's key: no other certificate will
ever chain to it. The workers require the route's certificate and the route trusts only that
CA, so a listener on a worker's port cannot complete a handshake (it receives a TLS
ClientHello, nothing else), and a relay between the two forwards ciphertext it cannot read.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID_FOR = datetime.timedelta(days=3650)  # a server may run for years; its workers restart with the same files
CLOCK_SKEW = datetime.timedelta(hours=1)  # valid from a little before now


@dataclass(frozen=True)
class SpawnPki:
    """The PEM files of one supervisor's CA (its key was never written), in a private folder."""

    ca: Path  # the CA certificate: the workers check the route's certificate and the route the workers' against it
    worker_cert: Path  # every worker's certificate (names the workers' host)
    worker_key: Path  # its private key (mode 0600)
    route_cert: Path  # the route's client certificate
    route_key: Path  # its private key (mode 0600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def subject_alt_names(host: str) -> list[x509.GeneralName]:
    """The names a certificate for `host` answers to: localhost, and `host` as an IP address or a DNS name.

    Args:
        host: a host name, an IPv4 address, or an IPv6 address (bracketed or not).
    Returns:
        The subject alternative names to put in the certificate.
    """
    names: list[x509.GeneralName] = [x509.DNSName("localhost")]
    try:
        names.append(x509.IPAddress(ipaddress.ip_address(host.strip("[]"))))
    except ValueError:
        names.append(x509.DNSName(host))
    return names


def _certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, signer: ec.EllipticCurvePrivateKey,
                 *extensions: tuple[x509.ExtensionType, bool]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - CLOCK_SKEW).not_valid_after(now + VALID_FOR))
    for extension, critical in extensions:
        builder = builder.add_extension(extension, critical=critical)
    return builder.sign(signer, hashes.SHA256())


def make_ca(common_name: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed CA certificate (signs leaves only) and its key.

    Args:
        common_name: the CA's subject (and issuer) common name.
    Returns:
        (certificate, private key), a new P-256 key.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(common_name, key, _name(common_name), key, (x509.BasicConstraints(ca=True, path_length=0), True),
                        (x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), True),
                        (x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False))
    return cert, key


def sign_leaf(subject: str, ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, usage: x509.ObjectIdentifier,
              *extensions: tuple[x509.ExtensionType, bool]) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its certificate for `usage` (server or client auth), signed by `ca`.

    Args:
        subject: the leaf's common name.
        ca, ca_key: the signing CA's certificate and key (`make_ca`).
        usage: the extended key usage (ExtendedKeyUsageOID.SERVER_AUTH or CLIENT_AUTH).
        extensions: more (extension, critical) pairs, e.g. the subject alternative names.
    Returns:
        (certificate, private key), a new P-256 key.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate(subject, key, ca.subject, ca_key,
                        (x509.BasicConstraints(ca=False, path_length=None), True),
                        (x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False),
                        (x509.ExtendedKeyUsage([usage]), False), *extensions)
    return cert, key


def _write_private(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, whatever the umask
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def make_spawn_pki(folder: Path, host: str) -> SpawnPki:
    """Make a CA, sign a worker certificate for `host` and a route certificate, write them under `folder`.

    Args:
        folder: a private folder (mode 0700) that holds no such files yet.
        host: the address the workers bind (an IP address or a name), named in their certificate.
    Returns:
        The files' paths. The CA's private key exists only during this call.
    Raises:
        OSError: a file cannot be written (or exists already).
    """
    ca, ca_key = make_ca("inference-engine spawned shard route CA")
    worker, worker_key = sign_leaf("inference-engine shard worker", ca, ca_key, ExtendedKeyUsageOID.SERVER_AUTH,
                                   (x509.SubjectAlternativeName(subject_alt_names(host)), False))
    route, route_key = sign_leaf("inference-engine shard route", ca, ca_key, ExtendedKeyUsageOID.CLIENT_AUTH)
    del ca_key  # nothing else will ever be signed by it

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    return SpawnPki(
        ca=_write_private(folder / "ca.pem", pem(ca)),
        worker_cert=_write_private(folder / "worker.pem", pem(worker)),
        worker_key=_write_private(folder / "worker.key", pem_key(worker_key)),
        route_cert=_write_private(folder / "route.pem", pem(route)),
        route_key=_write_private(folder / "route.key", pem_key(route_key)),
    )
