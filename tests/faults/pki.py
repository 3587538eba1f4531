"""Certificates for the registry's TLS faults, written with ``cryptography``.

:func:`fault_pki` writes a CA the proxy trusts, a server certificate for 127.0.0.1 it
signed, a valid and an expired client certificate it signed, and another CA with a
client certificate of its own (one the server does not trust).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


@dataclass(frozen=True)
class FaultPki:
    """Paths of the PEM files (``*_key`` are the private keys)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    expired_cert: Path
    expired_key: Path
    other_ca: Path
    stranger_cert: Path
    stranger_key: Path


def fault_pki(folder: Path) -> FaultPki:
    """Write every certificate of :class:`FaultPki` into ``folder``."""
    now = datetime.datetime.now(datetime.UTC)
    day = datetime.timedelta(days=1)

    def issue(stem: str, subject: str, issuer: tuple[str, Any] | None, *, ca: bool = False,
              server: bool = False, expired: bool = False) -> tuple[Path, Path, Any]:
        key = ec.generate_private_key(ec.SECP256R1())
        issuer_name, issuer_key = issuer if issuer is not None else (subject, key)
        begin, end = (now - 3 * day, now - day) if expired else (now - day, now + day)
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME,
                                                              issuer_name)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(begin).not_valid_after(end)
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        cert = builder.sign(issuer_key, hashes.SHA256())
        (folder / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return folder / f"{stem}.pem", folder / f"{stem}.key", key

    ca, _, ca_key = issue("ca", "fault test CA", None, ca=True)
    other, _, other_key = issue("other-ca", "another CA", None, ca=True)
    signer = ("fault test CA", ca_key)
    server_cert, server_key, _ = issue("server", "127.0.0.1", signer, server=True)
    client_cert, client_key, _ = issue("client", "registry reader", signer)
    expired_cert, expired_key, _ = issue("expired", "registry reader", signer, expired=True)
    stranger_cert, stranger_key, _ = issue("stranger", "registry reader",
                                           ("another CA", other_key))
    return FaultPki(ca, server_cert, server_key, client_cert, client_key, expired_cert,
                    expired_key, other, stranger_cert, stranger_key)
