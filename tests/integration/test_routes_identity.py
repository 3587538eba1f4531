"""Routes by identity end to end: SASL principals, mTLS certificates, and the real client
address behind HAProxy (PROXY protocol v2).

* SASL (SCRAM-SHA-512 and PLAIN) through the project's gateway in front of Tansu:
  ``alice``'s batches are upper-cased, ``bob``'s rejected, by ``principal`` routes.
* mTLS: two client certificates of one CA, ``CN=alpha`` and ``CN=beta``, get
  different routes by certificate subject.
* PROXY protocol: a real HAProxy (``mode tcp``, ``send-proxy-v2``) listens on ``::1``
  in front of every kiproxy listener (same port numbers, kiproxy on 127.0.0.1,
  advertising ``::1``). The client connects over IPv6, HAProxy reaches kiproxy over
  IPv4, so the client's own address (``::1``) can only come from the header: it is in
  the audit log and matches a ``client_address: ::1/128`` route. The same listener
  refuses a header from an untrusted peer, a client without a header and a client
  that sends nothing, each with one log line.
"""

from __future__ import annotations

import ipaddress
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import TANSU_NODE_ID, ProxyProcess, launch_proxy
from cryptography import x509
from hardening.sasl_gateway import SaslGateway

from integration.haproxy import StartHaproxy
from integration.test_routes import audit_events, produce, read
from integration.test_tls import _cert, _key, _name, _write
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:(read|open)_text is deprecated:DeprecationWarning"),
]

POLICY_VIOLATION = 44
USERS = {"alice": "alice-secret", "bob": "bob-secret"}


def _topic(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _config(path: Path, **settings: Any) -> Path:
    path.write_text(yaml.safe_dump(settings))
    return path


# ---------------------------------------------------------------------------- SASL


@pytest.fixture(scope="module")
def sasl_proxy(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[ProxyProcess, Path]]:
    gateway = SaslGateway(broker.bootstrap, USERS).start()
    d = tmp_path_factory.mktemp("sasl-routes")
    audit = d / "audit.jsonl"
    config = _config(d / "kiproxy.yaml", routes=[
        {"name": "alice-upper", "match": {"principal": "alice"},
         "interceptors": [{"class": "uppercase"}]},
        {"name": "bob-refused", "match": {"principal_regex": "b.b"},
         "interceptors": [{"class": "kiproxy.interceptors.builtin.pii:PiiMasker",
                           "config": {"rules": {"all": {"pattern": ".", "action": "reject"}},
                                      "topics": {"*": ["all"]}}}]},
    ], audit={"path": str(audit), "flush_interval_ms": 50})
    proxy = launch_proxy(gateway.address, config_file=config)
    yield proxy, audit
    proxy.stop()
    gateway.stop()


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_two_sasl_users_get_different_routes(sasl_proxy: tuple[ProxyProcess, Path],
                                             mechanism: str) -> None:
    proxy, audit = sasl_proxy
    topic = _topic("sasl")

    def sasl(user: str) -> dict[str, Any]:
        return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mechanism,
                "sasl.username": user, "sasl.password": USERS[user]}

    assert produce(proxy.bootstrap, topic, [b"from alice"], **sasl("alice")) == [None]
    refused = produce(proxy.bootstrap, topic, [b"from bob"], **sasl("bob"))
    assert refused[0] is not None and refused[0].code() == POLICY_VIOLATION

    assert [m.value() for m in read(proxy.bootstrap, topic, 1, **sasl("alice"))] == [
        b"FROM ALICE"]
    events = audit_events(audit, topic, 2)
    assert [(e["principal"], e["route"], e["outcome"]) for e in events] == [
        ("alice", "alice-upper", "transformed"), ("bob", "bob-refused", "rejected")]


# ---------------------------------------------------------------------------- mTLS


def test_two_client_certificates_get_different_routes(broker: EmbeddedBroker,
                                                      tmp_path: Path) -> None:
    ca_key, ca_name = _key(), _name("routes test CA")
    ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = _key()
    server = _cert(_name("localhost"), server_key, ca_name, ca_key, ca=False,
                   san=[x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    files: dict[str, Path] = {"ca": _write(tmp_path / "ca.pem", ca),
                              "server": _write(tmp_path / "server.pem", server),
                              "server_key": _write(tmp_path / "server.key", key=server_key)}
    for who in ("alpha", "beta"):
        key = _key()
        files[who] = _write(tmp_path / f"{who}.pem",
                            _cert(_name(who, "Example"), key, ca_name, ca_key, ca=False))
        files[f"{who}_key"] = _write(tmp_path / f"{who}.key", key=key)
    audit = tmp_path / "audit.jsonl"
    config = _config(
        tmp_path / "kiproxy.yaml",
        tls={"cert": str(files["server"]), "key": str(files["server_key"]),
             "client_ca": str(files["ca"])},
        routes=[{"name": "alpha", "match": {"principal": "CN=alpha,O=Example"},
                 "interceptors": [{"class": "uppercase"}]},
                {"name": "beta", "match": {"principal_regex": "CN=beta,.*"},
                 "interceptors": [{"class": "stamp_headers",
                                   "config": {"headers": {"seen-by": "beta"},
                                              "stamp": False}}]}],
        audit={"path": str(audit), "flush_interval_ms": 50})
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    bootstrap = proxy.bootstrap

    def tls(who: str) -> dict[str, Any]:
        return {"security.protocol": "SSL", "ssl.ca.location": str(files["ca"]),
                "ssl.certificate.location": str(files[who]),
                "ssl.key.location": str(files[f"{who}_key"])}

    try:
        topic = _topic("mtls")
        assert produce(bootstrap, topic, [b"from alpha"], **tls("alpha")) == [None]
        assert produce(bootstrap, topic, [b"from beta"], **tls("beta")) == [None]
        stored = read(bootstrap, topic, 2, **tls("alpha"))
        assert [(m.value(), m.headers()) for m in stored] == [
            (b"FROM ALPHA", None), (b"from beta", [("seen-by", b"beta")])]
        events = audit_events(audit, topic, 2)
        assert [(e["principal"], e["route"]) for e in events] == [
            ("CN=alpha,O=Example", "alpha"), ("CN=beta,O=Example", "beta")]
    finally:
        assert proxy.stop() == 0, proxy.log


# ---------------------------------------------------------------------------- PROXY protocol


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _closed_without_answer(sock: socket.socket, timeout: float = 10) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_client_behind_haproxy_is_known_by_its_own_address(
        broker: EmbeddedBroker, haproxy: StartHaproxy, tmp_path: Path) -> None:
    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    audit = tmp_path / "audit.jsonl"
    config = _config(
        tmp_path / "kiproxy.yaml", advertised_host="::1",
        listener={"name": "external", "proxy_protocol": "required",
                  "proxy_protocol_trusted": ["127.0.0.1/32"],
                  "proxy_protocol_timeout_ms": 500},
        routes=[{"name": "outside", "match": {"client_address": ["::1/128"],
                                              "listener": "external"},
                 "interceptors": [{"class": "uppercase"}]}],
        audit={"path": str(audit), "flush_interval_ms": 50})
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        listen = int(proxy.bootstrap.rsplit(":", 1)[1])
        node = proxy.broker_port_start + TANSU_NODE_ID
        for port in (listen, node):  # the balancer in front of every listener
            haproxy(port, send_proxy="v2", bind="::1", port=port)

        topic = _topic("behind")
        assert produce(f"[::1]:{listen}", topic, [b"through the balancer"]) == [None]
        assert [m.value() for m in read(f"[::1]:{listen}", topic, 1)] == [
            b"THROUGH THE BALANCER"]
        (event,) = audit_events(audit, topic, 1)
        assert event["client_address"].startswith("[::1]:")  # not 127.0.0.1, the balancer
        assert event["route"] == "outside"

        # A PROXY header from a peer outside proxy_protocol_trusted: closed, one line.
        with socket.socket() as liar:
            liar.bind(("127.0.0.2", 0))
            liar.connect(("127.0.0.1", listen))
            liar.sendall(b"PROXY TCP4 198.51.100.7 127.0.0.1 4000 9092\r\n")
            assert _closed_without_answer(liar)
        proxy.wait_for_line("closing connection on listener external", "127.0.0.2",
                            "not in proxy_protocol_trusted")
        # No header on a required listener, and a client that sends nothing: closed too.
        with socket.create_connection(("127.0.0.1", listen)) as direct:
            direct.sendall(b"\x00\x00\x00\x0a")
            assert _closed_without_answer(direct)
        proxy.wait_for_line("sent no PROXY header", "proxy_protocol: required")
        with socket.create_connection(("127.0.0.1", listen)) as silent:
            assert _closed_without_answer(silent)
        proxy.wait_for_line("sent no complete PROXY header in time")
    finally:
        assert proxy.stop() == 0, proxy.log


def test_a_proxy_header_on_a_listener_with_it_off_closes_that_connection(
        broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap)
    try:
        host, port = proxy.bootstrap.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(b"PROXY TCP4 198.51.100.7 127.0.0.1 4000 9092\r\n")
            assert _closed_without_answer(sock)
        line = proxy.wait_for_line("closing client", "proxy_protocol: off")
        assert "198.51.100.7" not in line  # the header is not believed, only refused
        topic = _topic("after")
        assert produce(proxy.bootstrap, topic, [b"still served"]) == [None]
    finally:
        assert proxy.stop() == 0, proxy.log
