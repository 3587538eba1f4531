"""TLS and mTLS on the client side, TLS to the broker, with real clients.

A throwaway CA is made per module with ``cryptography``. The embedded broker
(Tansu 0.6) cannot serve TLS itself (its ``--cert`` and ``--key`` flags refuse
to be combined), so the upstream tests put a TLS-terminating relay, made here,
in front of a dedicated broker that advertises the relay's address: the proxy
then speaks TLS to every broker connection, bootstrap and node alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import json
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, launch_proxy, wait_for_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from support.processes import runtime_env

from kiproxy_dev.tansu import EmbeddedBroker, broker_binary, free_port


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(cn: str, org: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        attrs.insert(0, x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(attrs)


def _cert(subject: x509.Name, key: Any, issuer: x509.Name, issuer_key: Any, *, ca: bool,
          san: list[x509.GeneralName] | None = None) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if san:
        builder = builder.add_extension(x509.SubjectAlternativeName(san), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert: x509.Certificate | None = None, key: Any = None) -> Path:
    if cert is not None:
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    else:
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    d = tmp_path_factory.mktemp("pki")
    ca_key = _key()
    ca_name = _name("kiproxy test CA")
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = _key()
    server = _cert(_name("localhost"), server_key, ca_name, ca_key, ca=False, san=[
        x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client_key = _key()
    client = _cert(_name("writer", "Example"), client_key, ca_name, ca_key, ca=False)
    other_key = _key()
    other = _cert(_name("someone else"), other_key, _name("someone else"), other_key, ca=True)
    return Pki(_write(d / "ca.pem", ca), _write(d / "server.pem", server),
               _write(d / "server.key", key=server_key), _write(d / "client.pem", client),
               _write(d / "client.key", key=client_key), _write(d / "other-ca.pem", other))


def _roundtrip(bootstrap: str, topic: str, n: int = 20, **conf: Any) -> list[bytes]:
    from confluent_kafka import Consumer, Producer, TopicPartition

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", **conf})
    errors: list[Any] = []
    for i in range(n):
        producer.produce(topic, b"tls-%d" % i, partition=0,
                         on_delivery=lambda err, msg: errors.append(err) if err else None)
    remaining = producer.flush(20)
    assert remaining == 0 and not errors, errors
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "auto.offset.reset": "earliest", **conf})
    consumer.assign([TopicPartition(topic, 0, 0)])
    out: list[bytes] = []
    deadline = time.monotonic() + 20
    while len(out) < n and time.monotonic() < deadline:
        msg = consumer.poll(0.5)
        if msg is not None and not msg.error():
            out.append(msg.value())
    consumer.close()
    return out


def _tls_client_conf(pki: Pki, *, cert: bool = False) -> dict[str, str]:
    conf = {"security.protocol": "SSL", "ssl.ca.location": str(pki.ca),
            "ssl.endpoint.identification.algorithm": "https"}
    if cert:
        conf |= {"ssl.certificate.location": str(pki.client_cert),
                 "ssl.key.location": str(pki.client_key)}
    return conf


def test_clients_speak_tls_to_every_proxy_listener(pki: Pki, broker: EmbeddedBroker,
                                                   topic: str) -> None:
    proxy = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                         "--tls-key", str(pki.server_key))
    try:
        got = _roundtrip(proxy.bootstrap, topic, **_tls_client_conf(pki))
        assert got == [b"tls-%d" % i for i in range(20)]
        # A plaintext client gets nowhere: the listener only speaks TLS.
        with socket.create_connection(("127.0.0.1", int(proxy.bootstrap.rsplit(":")[1]))) as s:
            s.sendall(b"\x00\x00\x00\x0b\x00\x12\x00\x00\x00\x00\x00\x01\x00\x01x")
            s.settimeout(5)
            assert s.recv(100)[:1] in (b"", b"\x15")  # closed, or a TLS alert record
    finally:
        assert proxy.stop() == 0


def _talk_without_certificate(ctx: ssl.SSLContext, host: str, port: int) -> None:
    with socket.create_connection((host, port), 5) as raw, \
            ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        s.sendall(b"\x00\x00\x00\x00")
        if not s.recv(1):
            raise ConnectionError("closed by the proxy")


def test_mtls_requires_a_certificate_and_names_the_principal(
        pki: Pki, broker: EmbeddedBroker, topic: str, tmp_path: Path) -> None:
    audit = tmp_path / "audit.jsonl"
    proxy = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                         "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
                         "--audit-log", str(audit))
    try:
        got = _roundtrip(proxy.bootstrap, topic, **_tls_client_conf(pki, cert=True))
        assert len(got) == 20
        # Without a client certificate the handshake fails.
        ctx = ssl.create_default_context(cafile=str(pki.ca))
        host, port = proxy.bootstrap.rsplit(":", 1)
        with pytest.raises((ssl.SSLError, ConnectionError)):
            _talk_without_certificate(ctx, host, int(port))
    finally:
        assert proxy.stop() == 0
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    assert events and {e["principal"] for e in events} == {"CN=writer,O=Example"}


def test_minimum_tls_version_is_enforced(pki: Pki, broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                         "--tls-key", str(pki.server_key), "--tls-min-version", "TLSv1.3")
    try:
        host, port = proxy.bootstrap.rsplit(":", 1)
        old = ssl.create_default_context(cafile=str(pki.ca))
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        with pytest.raises(ssl.SSLError), socket.create_connection((host, int(port)), 5) as raw:
            old.wrap_socket(raw, server_hostname="127.0.0.1")
        new = ssl.create_default_context(cafile=str(pki.ca))
        with socket.create_connection((host, int(port)), 5) as raw, \
                new.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            assert s.version() == "TLSv1.3"
    finally:
        assert proxy.stop() == 0


def _refused_handshake(host: str, port: int, ctx: ssl.SSLContext | None) -> None:
    """A client whose handshake the proxy refuses (or a plaintext one, ``ctx`` None)."""
    with socket.create_connection((host, port), 5) as raw:
        if ctx is None:
            raw.sendall(b"\x00\x00\x00\x0b\x00\x12\x00\x00\x00\x00\x00\x01\x00\x01x")
            raw.settimeout(5)
            with contextlib.suppress(OSError):
                raw.recv(100)
            return
        with contextlib.suppress(ssl.SSLError, OSError), \
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
            s.sendall(b"\x00\x00\x00\x00")
            s.recv(1)  # TLS 1.3: the refusal of the client's certificate comes after


def _tls_failures(metrics: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("kiproxy_client_tls_failures_total{")}


def test_refused_client_handshakes_are_logged_by_reason_and_counted(
        pki: Pki, broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The event loop closes a refused handshake before the proxy has a connection for
    it, and without an alert: the reason is logged (once per reason and interval) and
    counted, so an operator sees why mTLS clients cannot connect."""
    metrics = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(broker.bootstrap, "--tls-cert", str(pki.server_cert),
                         "--tls-key", str(pki.server_key), "--tls-client-ca", str(pki.ca),
                         "--tls-min-version", "TLSv1.3", "--metrics-listen", metrics)
    rogue_key = _key()
    rogue = _cert(_name("rogue"), rogue_key, _name("rogue"), rogue_key, ca=False)
    rogue_ctx = ssl.create_default_context(cafile=str(pki.ca))
    rogue_ctx.load_cert_chain(_write(tmp_path / "rogue.pem", rogue),
                              _write(tmp_path / "rogue.key", key=rogue_key))
    old = ssl.create_default_context(cafile=str(pki.ca))
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    no_cert = ssl.create_default_context(cafile=str(pki.ca))
    host, port = proxy.bootstrap.rsplit(":", 1)
    try:
        for ctx in (no_cert, no_cert, rogue_ctx, old, None):
            _refused_handshake(host, int(port), ctx)
        expected = {"PEER_DID_NOT_RETURN_A_CERTIFICATE": 2.0,
                    "CERTIFICATE_VERIFY_FAILED": 1.0, "UNSUPPORTED_PROTOCOL": 1.0,
                    "WRONG_VERSION_NUMBER": 1.0}
        deadline = time.monotonic() + 10
        while _tls_failures(metrics) != expected and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _tls_failures(metrics) == expected
        deadline = time.monotonic() + 5
        while sum("TLS handshake was refused" in line for line in proxy.lines) < 4 \
                and time.monotonic() < deadline:
            time.sleep(0.05)  # the log is read by a thread
        refused = [line for line in proxy.lines if "TLS handshake was refused" in line]
        assert len(refused) == 4, refused  # the second missing certificate held back
        for words in ("the client sent no certificate, and tls.client_ca requires one",
                      "does not verify against tls.client_ca: self-signed certificate",
                      "offers only TLS versions below tls.min_version",
                      "does not speak TLS"):
            assert any(words in line and "WARNING" in line for line in refused), refused
        # A client with a good certificate is still served.
        got = _roundtrip(proxy.bootstrap, f"tls-{uuid.uuid4().hex[:8]}", n=3,
                         **_tls_client_conf(pki, cert=True))
        assert len(got) == 3
    finally:
        assert proxy.stop() == 0


# ---------------------------------------------------------------------- upstream TLS


class TlsRelay:
    """Terminates TLS on ``port`` and relays plaintext to ``target``."""

    def __init__(self, pki: Pki, target: tuple[str, int]) -> None:
        self.port = free_port()
        self.target = target
        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(str(pki.server_cert), str(pki.server_key))
        self.loop = asyncio.new_event_loop()
        self.handshakes = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())
        self.loop.run_forever()

    async def _serve(self) -> None:
        await asyncio.start_server(self._handle, "127.0.0.1", self.port, ssl=self.ctx)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handshakes += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def start(self) -> None:
        self._thread.start()
        wait_for_port("127.0.0.1", self.port)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def tls_broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRelay]:
    """A broker reachable only through TLS: it advertises the relay's address."""
    port = free_port()
    relay = TlsRelay(pki, ("127.0.0.1", port))
    log = tmp_path_factory.mktemp("tls-broker") / "broker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{relay.port}",
             "--storage-engine", "memory://tansu/"], stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for_port("127.0.0.1", port, 20)
        relay.start()
        yield relay
    finally:
        relay.stop()
        proc.kill()
        proc.wait()


def test_upstream_tls_with_hostname_verification(pki: Pki, tls_broker: TlsRelay,
                                                 topic: str) -> None:
    before = tls_broker.handshakes
    proxy = launch_proxy(f"127.0.0.1:{tls_broker.port}", "--upstream-tls-ca", str(pki.ca))
    try:
        got = _roundtrip(proxy.bootstrap, topic)
        assert got == [b"tls-%d" % i for i in range(20)]
        assert tls_broker.handshakes > before
    finally:
        assert proxy.stop() == 0


def test_upstream_tls_refuses_an_untrusted_broker(pki: Pki, tls_broker: TlsRelay,
                                                  topic: str) -> None:
    # --wait-for-upstream: without it the proxy would not start (see the next test).
    proxy = launch_proxy(f"127.0.0.1:{tls_broker.port}", "--upstream-tls-ca",
                         str(pki.other_ca), "--wait-for-upstream")
    try:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": proxy.bootstrap, "message.timeout.ms": 3000})
        errors: list[Any] = []
        producer.produce(topic, b"x", on_delivery=lambda err, msg: errors.append(err))
        producer.flush(10)
        assert len(errors) == 1 and errors[0] is not None
        assert "CERTIFICATE_VERIFY_FAILED" in proxy.log or "certificate verify failed" in \
            proxy.log
    finally:
        assert proxy.stop() == 0


def test_an_untrusted_upstream_stops_the_proxy_at_start(pki: Pki, tls_broker: TlsRelay) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kiproxy", "run", "--upstream", f"127.0.0.1:{tls_broker.port}",
         "--upstream-tls-ca", str(pki.other_ca), "--listen", f"127.0.0.1:{free_port()}",
         "--upstream-startup-timeout-ms", "1000"],
        capture_output=True, text=True, timeout=60, cwd=ROOT, env=runtime_env())
    assert done.returncode == 1
    assert done.stderr == (
        f"kiproxy: upstream 127.0.0.1:{tls_broker.port}: TLS handshake failed "
        "(CERTIFICATE_VERIFY_FAILED: unable to get local issuer certificate) (tried for 1 s); "
        "start the cluster, fix --upstream, or pass --wait-for-upstream\n")


async def test_a_broker_certificate_for_another_host_is_named_as_such(
        pki: Pki, tls_broker: TlsRelay) -> None:
    """A certificate from a trusted CA that does not name the host dialled reads as a host
    name mismatch, not as the bare CERTIFICATE_VERIFY_FAILED of an unknown CA."""
    from kiproxy.proxy.brokers.failures import connect_error

    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with pytest.raises(ssl.SSLCertVerificationError) as failed:
        _, writer = await asyncio.open_connection("127.0.0.1", tls_broker.port, ssl=ctx,
                                                  server_hostname="broker-1.example")
        writer.close()
    assert connect_error(failed.value) == (
        "TLS handshake failed (CERTIFICATE_VERIFY_FAILED: Hostname mismatch, certificate "
        "is not valid for 'broker-1.example'.)")


def test_tls_settings_are_validated(tmp_path: Path, broker: EmbeddedBroker) -> None:
    from kiproxy.proxy.config.model import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"tls\.cert and tls\.key"):
        load_config(None, {"upstream": ["h:1"], "tls.cert": "c.pem"})
    missing = subprocess.run(
        [sys.executable, "-m", "kiproxy", "run", "--upstream", broker.bootstrap, "--listen",
         f"127.0.0.1:{free_port()}", "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key",
         str(tmp_path / "nope.key")], capture_output=True, text=True, timeout=60, cwd=ROOT,
        env=runtime_env())
    assert missing.returncode == 2
    assert "config error: tls.cert/tls.key" in missing.stderr
