"""The Apicurio Registry the tests run (built by ``make registry``, started by
:class:`kiproxy_dev.apicurio.ApicurioRegistry`), and an HTTPS front for it.

``registry_jar_or_skip`` returns the jar, building it first when the cache lacks it
(apicurio-registry/build.sh, about a minute cold); the tests skip only when Java or
Maven is missing, and fail when the build itself fails. ``HttpsFront`` is a stdlib
HTTPS server in front of a registry (TLS with a throwaway CA, optionally requiring a
client certificate, basic auth or a bearer token) that forwards GETs to it: the
registry client's TLS and credentials are tested against real registry answers.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import shutil
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiproxy_dev.apicurio import find_registry_jar

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "apicurio-registry" / "build.sh"


def registry_jar_or_skip() -> Path:
    """The registry's ``quarkus-run.jar``, built (and cached) when missing."""
    jar = find_registry_jar()
    if jar is not None:
        return jar
    missing = [tool for tool in ("java", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"Apicurio Registry is not built and {' and '.join(missing)} is missing: "
                    "install Java 17+ and Maven (`.ci/run` does), then run `make registry`")
    done = subprocess.run([str(BUILD)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(f"`make registry` failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True)
class Pki:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_pki(folder: Path) -> Pki:
    """Write a CA and two certificates it signed (``cryptography``) into ``folder``."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def cert(subject: str, key: Any, issuer: str, issuer_key: Any, *, ca: bool,
             san: list[x509.GeneralName] | None = None) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(name(subject)).issuer_name(name(issuer))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, crt: x509.Certificate, key: Any) -> tuple[Path, Path]:
        (folder / f"{stem}.pem").write_bytes(crt.public_bytes(serialization.Encoding.PEM))
        (folder / f"{stem}.key").write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        return folder / f"{stem}.pem", folder / f"{stem}.key"

    ca_key, server_key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = cert("kiproxy registry test CA", ca_key, "kiproxy registry test CA", ca_key, ca=True)
    server = cert("127.0.0.1", server_key, "kiproxy registry test CA", ca_key, ca=False,
                  san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client = cert("registry reader", client_key, "kiproxy registry test CA", ca_key, ca=False)
    ca_path, _ = write("ca", ca, ca_key)
    server_cert, server_key_path = write("server", server, server_key)
    client_cert, client_key_path = write("client", client, client_key)
    return Pki(ca_path, server_cert, server_key_path, client_cert, client_key_path)


class HttpsFront:
    """An HTTPS server on 127.0.0.1 forwarding GETs to ``upstream`` (a registry API URL).

    ``require_client_cert``: the TLS handshake needs a certificate the CA signed;
    ``basic``/``bearer``: requests without those credentials get 401. ``seen`` lists
    the Authorization headers received; ``delay`` holds each answer that many seconds,
    and ``peak`` is the most requests the front held at once (received, not yet
    answered)."""

    def __init__(self, upstream: str, pki: Pki, *, require_client_cert: bool = False,
                 basic: tuple[str, str] | None = None, bearer: str | None = None,
                 delay: float = 0.0) -> None:
        self.seen: list[str | None] = []
        self.peak = 0
        answering = 0
        lock = threading.Lock()
        front = self
        want = None
        if basic is not None:
            want = "Basic " + base64.b64encode(f"{basic[0]}:{basic[1]}".encode()).decode()
        elif bearer is not None:
            want = f"Bearer {bearer}"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                nonlocal answering
                with lock:
                    answering += 1
                    front.peak = max(front.peak, answering)
                try:
                    time.sleep(delay)
                    status, body = self._get()
                finally:
                    # Counted down before the answer goes out: once the client has it,
                    # it may send its next request while this thread is still here.
                    with lock:
                        answering -= 1
                self._answer(status, body)

            def _get(self) -> tuple[int, bytes]:
                auth = self.headers.get("Authorization")
                front.seen.append(auth)
                if want is not None and auth != want:
                    return 401, b'{"error_code":401,"message":"Unauthorized"}'
                try:
                    with urllib.request.urlopen(upstream + self.path, timeout=10) as resp:
                        return resp.status, resp.read()
                except urllib.error.HTTPError as exc:
                    return exc.code, exc.read()

            def _answer(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca))
        ctx.load_cert_chain(pki.server_cert, pki.server_key)
        ctx.verify_mode = ssl.CERT_REQUIRED if require_client_cert else ssl.CERT_NONE
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.socket = ctx.wrap_socket(self._server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()
