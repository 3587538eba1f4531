"""The SASL principal is learned only when the broker has really accepted the client.

The SCRAM exchanges here are genuine RFC 5802 conversations: a small SCRAM
server in this file checks the client's proof against a stored credential and
answers ``v=ServerSignature`` or ``e=invalid-proof``, and every message goes
through :meth:`ProxyServer.handle_request` and the response callback it
returns, as on a live connection.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

import pytest
from hardening.sasl_gateway import ScramCredential
from kio.schema.errors import ErrorCode
from support.client import Client

from kiproxy.protocol.errors import SaslStateError, UnsupportedVersion
from kiproxy.protocol.framing import (
    encode_request_header,
    encode_response_header,
    parse_request_header,
    request_header_version,
)
from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.protocol.messages import ApiKey, request_type, response_type, serialize
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.net import sasl as sasl_module
from kiproxy.proxy.produce.disposition import Forward
from kiproxy.proxy.server import ProxyServer

# ---------------------------------------------------------------------- RFC 5802


def _hash(mechanism: str) -> str:
    return {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}[mechanism]


def _hmac(name: str, key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, name).digest()


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass
class ScramServer:
    """The broker side of SCRAM, with one stored credential (as Kafka stores it)."""

    mechanism: str
    user: str
    password: str
    iterations: int = 4096
    salt: bytes = field(default_factory=lambda: secrets.token_bytes(16))
    nonce: str = field(default_factory=lambda: _b64(secrets.token_bytes(18)))

    def __post_init__(self) -> None:
        # The keys Kafka stores, derived as the SASL gateway of the integration tests does.
        credential = ScramCredential.create(self.mechanism, self.password, self.iterations,
                                            self.salt)
        self.stored_key, self.server_key = credential.stored_key, credential.server_key
        self.client_first_bare = ""
        self.server_first = ""

    def first(self, client_first: bytes) -> bytes:
        text = client_first.decode()
        assert text.startswith("n,,")
        self.client_first_bare = text[3:]
        attrs = dict(f.split("=", 1) for f in self.client_first_bare.split(","))
        assert attrs["n"] == self.user
        self.server_first = f"r={attrs['r']}{self.nonce},s={_b64(self.salt)},i={self.iterations}"
        return self.server_first.encode()

    def final(self, client_final: bytes) -> bytes:
        h = _hash(self.mechanism)
        text = client_final.decode()
        without_proof, _, proof = text.rpartition(",p=")
        auth_message = f"{self.client_first_bare},{self.server_first},{without_proof}".encode()
        client_signature = _hmac(h, self.stored_key, auth_message)
        client_key = _xor(base64.b64decode(proof), client_signature)
        if not hmac.compare_digest(hashlib.new(h, client_key).digest(), self.stored_key):
            return b"e=invalid-proof"
        return f"v={_b64(_hmac(h, self.server_key, auth_message))}".encode()


@dataclass
class ScramClient:
    """The client side of SCRAM, as a Kafka client speaks it (no channel binding)."""

    mechanism: str
    user: str
    password: str
    nonce: str = field(default_factory=lambda: _b64(secrets.token_bytes(18)))

    def first(self) -> bytes:
        self.bare = f"n={self.user},r={self.nonce}"
        return f"n,,{self.bare}".encode()

    def final(self, server_first: bytes) -> bytes:
        h = _hash(self.mechanism)
        self.server_first = server_first.decode()
        attrs = dict(f.split("=", 1) for f in self.server_first.split(","))
        assert attrs["r"].startswith(self.nonce)
        salted = hashlib.pbkdf2_hmac(h, self.password.encode(), base64.b64decode(attrs["s"]),
                                     int(attrs["i"]))
        client_key = _hmac(h, salted, b"Client Key")
        stored_key = hashlib.new(h, client_key).digest()
        without_proof = f"c={_b64(b'n,,')},r={attrs['r']}"
        self.auth_message = f"{self.bare},{self.server_first},{without_proof}".encode()
        proof = _xor(client_key, _hmac(h, stored_key, self.auth_message))
        self.server_key = _hmac(h, salted, b"Server Key")
        return f"{without_proof},p={_b64(proof)}".encode()

    def verify(self, server_final: bytes) -> bool:
        expected = _hmac(_hash(self.mechanism), self.server_key, self.auth_message)
        return server_final.decode() == f"v={_b64(expected)}"


# ---------------------------------------------------------------------- the proxy side


_Client = Client

@pytest.fixture
def server() -> ProxyServer:
    return ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"]))


_correlation = iter(range(1, 1_000_000))


def _request(server: ProxyServer, conn: _Client, api_key: int, version: int,
             **fields: Any) -> Forward:
    header_version = request_header_version(api_key, version)
    assert header_version is not None
    body = serialize(request_type(api_key, version)(**fields))
    frame = encode_request_header(api_key, version, next(_correlation), "unit",
                                  header_version) + body
    outcome = asyncio.run(server.dispatcher.dispatch(
        conn, server.generation, parse_request_header(frame), frame))  # type: ignore[arg-type]
    assert isinstance(outcome, Forward)
    assert outcome.frame == frame            # SASL passes through byte for byte
    return outcome


def _response(version: int, auth_bytes: bytes = b"", code: ErrorCode = ErrorCode.none,
              message: str | None = None) -> bytes:
    kwargs: dict[str, Any] = {"error_code": code, "error_message": message,
                              "auth_bytes": auth_bytes}
    if version >= 1:
        kwargs["session_lifetime"] = datetime.timedelta(0)
    cls = response_type(ApiKey.SASL_AUTHENTICATE, version)
    return encode_response_header(7, 1 if version >= 2 else 0) + serialize(cls(**kwargs))


def _answer(outcome: Forward, frame: bytes) -> None:
    assert outcome.on_response is not None
    assert outcome.on_response(frame) == frame   # the answer is never changed


def _handshake(server: ProxyServer, conn: _Client, mechanism: str, version: int = 1) -> None:
    _request(server, conn, ApiKey.SASL_HANDSHAKE, version, mechanism=mechanism)


def _authenticate(server: ProxyServer, conn: _Client, version: int, token: bytes) -> Forward:
    return _request(server, conn, ApiKey.SASL_AUTHENTICATE, version, auth_bytes=token)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.fixture(autouse=True)
def _fresh_failure_log(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no failed login logged lately (the limit is process-wide)."""
    monkeypatch.setattr(sasl_module, "_failures", RateLimitedLog(sasl_module.log))


MECHANISMS = ["SCRAM-SHA-256", "SCRAM-SHA-512"]
VERSIONS = [0, 1, 2]


# ---------------------------------------------------------------------- SCRAM


@dataclass
class _Login:
    """A SCRAM login through the proxy up to the client-final-message."""

    broker: ScramServer
    client: ScramClient
    client_final: bytes
    final: Forward
    """The proxy's outcome of the client-final-message, awaiting the broker's answer."""


def _scram_login(server: ProxyServer, conn: _Client, mechanism: str, version: int,
                 password: str) -> _Login:
    """Handshake, client-first and its (real) answer, then client-final: the caller
    answers the last round. The first round's answer must decide nothing."""
    broker = ScramServer(mechanism, "alice", "alice-secret")
    client = ScramClient(mechanism, "alice", password)
    had = conn.principal
    _handshake(server, conn, mechanism)
    first = _authenticate(server, conn, version, client.first())
    server_first = broker.first(client.first())
    _answer(first, _response(version, server_first))
    assert conn.principal == had, "server-first-message proves nothing"
    client_final = client.final(server_first)
    return _Login(broker, client, client_final,
                  _authenticate(server, conn, version, client_final))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_scram_success_sets_the_principal_on_the_verifier_only(
        server: ProxyServer, caplog: pytest.LogCaptureFixture, mechanism: str,
        version: int) -> None:
    caplog.set_level(logging.INFO, "kiproxy")
    conn = _Client()
    login = _scram_login(server, conn, mechanism, version, "alice-secret")
    server_final = login.broker.final(login.client_final)
    assert server_final.startswith(b"v=") and login.client.verify(server_final)
    _answer(login.final, _response(version, server_final))
    assert conn.principal == "alice"
    assert any("authenticated as 'alice'" in r.getMessage() for r in caplog.records)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_scram_invalid_proof_at_error_code_0_is_a_failure(
        server: ProxyServer, caplog: pytest.LogCaptureFixture, mechanism: str,
        version: int) -> None:
    caplog.set_level(logging.INFO, "kiproxy")
    conn = _Client()
    login = _scram_login(server, conn, mechanism, version, "wrong-password")
    final = login.final
    server_final = login.broker.final(login.client_final)
    assert server_final == b"e=invalid-proof"
    _answer(final, _response(version, server_final))   # error_code 0, as some brokers do
    assert conn.principal is None
    assert not any("authenticated as" in r.getMessage() for r in caplog.records)
    assert _warnings(caplog) == [
        f"SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'alice' failed: "
        f"server-final-message e=invalid-proof (SASL {mechanism})"]
    # The same answer again (a confused broker) is not logged a second time.
    _answer(final, _response(version, server_final))
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_scram_error_code_on_the_final_round_is_a_failure(
        server: ProxyServer, caplog: pytest.LogCaptureFixture, mechanism: str,
        version: int) -> None:
    conn = _Client()
    login = _scram_login(server, conn, mechanism, version, "wrong-password")
    final = login.final
    assert login.broker.final(login.client_final) == b"e=invalid-proof"
    # What Apache Kafka answers: SASL_AUTHENTICATION_FAILED with a message, no auth bytes.
    message = ("Authentication failed during authentication due to invalid credentials "
               f"with SASL mechanism {mechanism}")
    _answer(final, _response(version, b"", ErrorCode.sasl_authentication_failed, message))
    assert conn.principal is None
    assert _warnings(caplog) == [
        f"SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'alice' failed: "
        f"error_code 58 (SASL_AUTHENTICATION_FAILED): {message} (SASL {mechanism})"]


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_scram_error_on_the_first_round_is_a_failure(
        server: ProxyServer, caplog: pytest.LogCaptureFixture, mechanism: str) -> None:
    conn = _Client()
    _handshake(server, conn, mechanism)
    first = _authenticate(server, conn, 2, ScramClient(mechanism, "nobody", "x").first())
    _answer(first, _response(2, b"", ErrorCode.sasl_authentication_failed, "unknown user"))
    assert conn.principal is None
    assert _warnings(caplog) == [
        "SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'nobody' failed: "
        f"error_code 58 (SASL_AUTHENTICATION_FAILED): unknown user (SASL {mechanism})"]


def test_scram_server_final_without_verifier_is_not_success(
        server: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    conn = _Client()
    login = _scram_login(server, conn, "SCRAM-SHA-256", 1, "alice-secret")
    _answer(login.final, _response(1, b""))
    assert conn.principal is None
    assert len(_warnings(caplog)) == 1
    assert "has no verifier (v=)" in _warnings(caplog)[0]


def test_scram_answer_to_the_first_round_decides_nothing_even_when_pipelined(
        server: ProxyServer) -> None:
    """A client that sends its final message early cannot make round 1 count as success."""
    mechanism = "SCRAM-SHA-256"
    broker = ScramServer(mechanism, "alice", "alice-secret")
    client = ScramClient(mechanism, "alice", "wrong-password")
    conn = _Client()
    _handshake(server, conn, mechanism)
    first = _authenticate(server, conn, 2, client.first())
    server_first = broker.first(client.first())
    final = _authenticate(server, conn, 2, client.final(server_first))
    _answer(first, _response(2, server_first))
    assert conn.principal is None
    _answer(final, _response(2, b"e=invalid-proof"))
    assert conn.principal is None


def test_failed_reauthentication_clears_the_sasl_principal(
        server: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    mechanism = "SCRAM-SHA-512"
    conn = _Client()
    for password, expected in [("alice-secret", "alice"), ("wrong-password", None)]:
        login = _scram_login(server, conn, mechanism, 2, password)
        _answer(login.final, _response(2, login.broker.final(login.client_final)))
        assert conn.principal == expected
    assert len(_warnings(caplog)) == 1


def test_a_failed_sasl_login_leaves_a_tls_principal_alone(
        server: ProxyServer) -> None:
    conn = _Client(principal="CN=app,O=Example")
    _handshake(server, conn, "PLAIN")
    outcome = _authenticate(server, conn, 2, b"\x00alice\x00wrong")
    _answer(outcome, _response(2, b"", ErrorCode.sasl_authentication_failed, "bad password"))
    assert conn.principal == "CN=app,O=Example"


# ---------------------------------------------------------------------- PLAIN


@pytest.mark.parametrize("version", VERSIONS)
def test_plain_error_code_0_authenticates(server: ProxyServer, version: int) -> None:
    conn = _Client()
    _handshake(server, conn, "PLAIN")
    outcome = _authenticate(server, conn, version, b"\x00alice\x00alice-secret")
    _answer(outcome, _response(version))
    assert conn.principal == "alice"


@pytest.mark.parametrize("version", VERSIONS)
def test_plain_error_code_fails(server: ProxyServer, caplog: pytest.LogCaptureFixture,
                                version: int) -> None:
    conn = _Client()
    _handshake(server, conn, "PLAIN")
    outcome = _authenticate(server, conn, version, b"\x00alice\x00wrong")
    _answer(outcome, _response(version, b"", ErrorCode.sasl_authentication_failed,
                               "Authentication failed: Invalid username or password"))
    assert conn.principal is None
    assert _warnings(caplog) == [
        "SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'alice' failed: "
        "error_code 58 (SASL_AUTHENTICATION_FAILED): Authentication failed: Invalid "
        "username or password (SASL PLAIN)"]


def test_failed_logins_of_one_client_and_user_are_one_line_per_interval(
        server: ProxyServer, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A client retries its login every few milliseconds (117 lines in 6 s from one
    wrong password): one line per client host and user per 10 s, then the count."""
    now = [0.0]
    monkeypatch.setattr(sasl_module, "_failures",
                        RateLimitedLog(sasl_module.log, clock=lambda: now[0]))
    for user in (b"alice", b"alice", b"alice", b"bob"):
        conn = _Client()
        _handshake(server, conn, "PLAIN")
        outcome = _authenticate(server, conn, 2, b"\x00" + user + b"\x00wrong")
        _answer(outcome, _response(2, b"", ErrorCode.sasl_authentication_failed, "no"))
    assert [w.split(" failed:")[0] for w in _warnings(caplog)] == [
        "SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'alice'",
        "SASL authentication of client 127.0.0.1:9 (client_id 'unit') as 'bob'"]
    now[0] = 10.0
    conn = _Client()
    _handshake(server, conn, "PLAIN")
    _answer(_authenticate(server, conn, 2, b"\x00alice\x00wrong"),
            _response(2, b"", ErrorCode.sasl_authentication_failed, "no"))
    assert _warnings(caplog)[-1].endswith("(SASL PLAIN) (2 more in the last 10 s)")


# ---------------------------------------------------------------------- others


def test_legacy_handshake_v0_is_refused(server: ProxyServer) -> None:
    """SaslHandshake v0 (raw tokens follow outside Kafka framing) is not carried: the
    request is refused with an error that says what to use instead; no principal."""
    conn = _Client()
    with pytest.raises(UnsupportedVersion, match=r"SaslHandshake v0 .* SaslHandshake v1"):
        _handshake(server, conn, "PLAIN", version=0)
    assert conn.sasl.mechanism is None
    assert conn.principal is None


@pytest.mark.parametrize("mechanism", ["PLAIN", "SCRAM-SHA-256"])
def test_requests_other_than_sasl_are_refused_until_the_login_succeeds(
        server: ProxyServer, mechanism: str) -> None:
    """A broker accepts only ApiVersions, SaslHandshake and SaslAuthenticate while a
    login is under way; so does the proxy, which must not answer for the broker."""
    conn = _Client()
    _handshake(server, conn, mechanism)
    assert conn.sasl.awaiting_verdict
    with pytest.raises(SaslStateError, match="Metadata request before its SASL"):
        _request(server, conn, ApiKey.METADATA, 9, **_METADATA_V9)
    assert isinstance(_request(server, conn, ApiKey.API_VERSIONS, 3,
                               client_software_name="unit", client_software_version="1"),
                      Forward)


def test_an_unjudged_mechanism_leaves_the_verdict_to_the_broker(server: ProxyServer) -> None:
    conn = _Client()
    _handshake(server, conn, "OAUTHBEARER")
    assert not conn.sasl.awaiting_verdict
    assert isinstance(_request(server, conn, ApiKey.METADATA, 9, **_METADATA_V9), Forward)


_METADATA_V9: dict[str, Any] = {
    "topics": None, "allow_auto_topic_creation": False,
    "include_cluster_authorized_operations": False, "include_topic_authorized_operations": False}


def test_unknown_mechanism_leaves_the_principal_unknown(
        server: ProxyServer, caplog: pytest.LogCaptureFixture) -> None:
    conn = _Client()
    _handshake(server, conn, "OAUTHBEARER")
    outcome = _authenticate(server, conn, 2, b"n,,\x01auth=Bearer xyz\x01\x01")
    _answer(outcome, _response(2))
    assert conn.principal is None
    assert _warnings(caplog) == []


def test_an_unreadable_broker_answer_leaves_the_verdict_to_the_broker(
        server: ProxyServer) -> None:
    """If the proxy cannot read the SaslAuthenticate answer it cannot know the outcome,
    so it must not go on refusing the client's requests: the broker decides."""
    conn = _Client()
    _handshake(server, conn, "SCRAM-SHA-256")
    first = _authenticate(server, conn, 2, ScramClient("SCRAM-SHA-256", "alice", "x").first())
    assert conn.sasl.awaiting_verdict
    _answer(first, b"\x00\x00\x00\x07\x00\xff")  # cut short
    assert not conn.sasl.awaiting_verdict
    assert isinstance(_request(server, conn, ApiKey.METADATA, 9, **_METADATA_V9), Forward)
    assert conn.principal is None
