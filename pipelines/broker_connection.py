"""One blocking connection to one broker: TCP, then TLS and SASL as :class:`ClientSecurity` asks.

Contract: a :class:`BrokerConnection` is ready for requests once constructed,
or construction raises :class:`BrokerError` with one message that names the
broker, the cause and the setting to change: an untrusted certificate, a TLS
port spoken to in plaintext (or the reverse), a client certificate the broker
requires, a SASL mechanism the broker does not enable, a wrong password. One
request is in flight at a time; messages are kio dataclasses.

SASL follows Kafka's own client: SaslHandshake v1 naming the mechanism, then
SaslAuthenticate v1 rounds - one for PLAIN (RFC 4616), two for SCRAM-SHA-256/512
(RFC 5802/7677, through the ``scramp`` library, which also checks the broker's
server signature). A session lifetime the broker sets (KIP-368) is honoured by
reconnecting before it ends (:meth:`BrokerConnection.expired`), not by
re-authenticating in place. No message ever holds a password.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Any

from kiproxy.pipelines.client_security import PLAINTEXT, ClientSecurity
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import (
    encode_frame,
    encode_request_header,
    parse_response_header,
    request_header_version,
    response_header_version,
)
from kiproxy.protocol.messages import ApiKey, parse_response, request_type, serialize

__all__ = ["BrokerConnection", "BrokerError"]

SASL_HANDSHAKE_VERSION = 1
SASL_AUTHENTICATE_VERSION = 1
UNSUPPORTED_SASL_MECHANISM = 33
HANDSHAKE_TIMEOUT = 10.0
"""Seconds to wait for a TLS handshake (at most the client's request timeout)."""
_TLS_RECORD_TYPES = (b"\x15\x03", b"\x16\x03")  # an alert or a handshake record, TLS 1.x
_NOT_TLS = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG",
            "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "RECORD_TOO_LARGE")
_PLAINTEXT_HINT = ("if the port speaks TLS, set security.protocol=SSL (or SASL_SSL); if the "
                   "broker requires SASL, set security.protocol=SASL_PLAINTEXT (or SASL_SSL) "
                   "and sasl.mechanism")


class BrokerError(Exception):
    """A broker could not be reached, or answered with an error for a partition."""

    def __init__(self, message: str, error_code: int = -1) -> None:
        super().__init__(message)
        self.error_code = error_code


def _tls_failure(address: str, exc: ssl.SSLError | OSError) -> BrokerError:
    """What a TLS error means for the user, with the setting to change."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        detail = exc.verify_message or str(exc)
        if "hostname" in detail.lower() or "ip address mismatch" in detail.lower():
            return BrokerError(
                f"TLS: the certificate of broker {address} does not name that host "
                f"({detail}); connect to a name the certificate holds, or set "
                "ssl.endpoint.identification.algorithm= (empty) to not check host names")
        return BrokerError(
            f"TLS: the certificate of broker {address} is not trusted ({detail}); set "
            "ssl.truststore.location (or ssl.ca.location) to the CA that signed it")
    reason = str(getattr(exc, "reason", None) or exc)
    if "CERTIFICATE_REQUIRED" in reason:
        return BrokerError(
            f"TLS: broker {address} requires a client certificate ({reason}); set "
            "ssl.keystore.location, or ssl.certificate.location and ssl.key.location")
    if any(r in reason for r in ("UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN")):
        return BrokerError(
            f"TLS: broker {address} refused the client certificate ({reason}); use a "
            "certificate signed by a CA the broker trusts")
    if any(r in reason for r in _NOT_TLS):
        return BrokerError(
            f"TLS: broker {address} does not speak TLS on this port ({reason}); set "
            "security.protocol=PLAINTEXT (or SASL_PLAINTEXT), or use the broker's TLS port")
    if isinstance(exc, ssl.SSLEOFError | ConnectionResetError):
        return BrokerError(
            f"TLS: broker {address} closed the connection during the TLS handshake; it may "
            "require a client certificate (ssl.keystore.location) or not speak TLS here")
    return BrokerError(f"TLS with broker {address} failed: {reason}")


class BrokerConnection:
    """One connection to one broker, authenticated as ``security`` says."""

    def __init__(self, host: str, port: int, client_id: str, timeout: float,
                 security: ClientSecurity = PLAINTEXT,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.address = f"{host}:{port}"
        self.client_id = client_id
        self.security = security
        self._correlation_id = 0
        self._answered = False
        self._expires_at: float | None = None
        try:
            raw = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise BrokerError(f"cannot connect to broker {self.address}: {exc}") from None
        raw.settimeout(timeout)
        self.sock: socket.socket = raw
        if security.tls:
            context = ssl_context or security.ssl_context()
            # A plaintext broker may read a ClientHello as the start of a huge request
            # and wait for the rest: wait for the handshake less long than for a Fetch.
            raw.settimeout(min(timeout, HANDSHAKE_TIMEOUT))
            try:
                self.sock = context.wrap_socket(raw, server_hostname=host)
            except TimeoutError:
                raw.close()
                raise BrokerError(f"TLS: broker {self.address} does not speak TLS on this port "
                                  f"(no answer to the TLS handshake within "
                                  f"{min(timeout, HANDSHAKE_TIMEOUT):.0f} s); set "
                                  "security.protocol=PLAINTEXT (or SASL_PLAINTEXT), or use "
                                  "the broker's TLS port") from None
            except OSError as exc:
                raw.close()
                raise _tls_failure(self.address, exc) from None
            self.sock.settimeout(timeout)
        if security.sasl:
            try:
                self._authenticate()
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Close the socket."""
        self.sock.close()

    def expired(self) -> bool:
        """Whether the SASL session the broker granted is (nearly) over."""
        return self._expires_at is not None and time.monotonic() >= self._expires_at

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(min(n - len(out), 1 << 20))
            if not chunk:
                raise BrokerError(f"broker {self.address} closed the connection"
                                  + ("" if self._answered else self._unanswered_hint()))
            out += chunk
        return bytes(out)

    def _unanswered_hint(self) -> str:
        """Why a broker may close a new connection without answering, and what to set."""
        if not self.security.tls:
            return f" without answering; {_PLAINTEXT_HINT}"
        cert = ("it may require a client certificate (set ssl.keystore.location, or "
                "ssl.certificate.location and ssl.key.location)"
                if self.security.certificate_pem is None else
                "it may not trust the client certificate")
        sasl = "" if self.security.sasl else \
            "; if it requires SASL, set security.protocol=SASL_SSL and sasl.mechanism"
        return f" after the TLS handshake without answering: {cert}{sasl}"

    def request(self, api_key: int, version: int, message: Any) -> Any:
        """Send one request and return its parsed response."""
        self._correlation_id += 1
        cid = self._correlation_id
        header_version = request_header_version(api_key, version)
        response_version = response_header_version(api_key, version)
        assert header_version is not None and response_version is not None
        frame = encode_frame(
            encode_request_header(api_key, version, cid, self.client_id, header_version)
            + serialize(message)
        )
        try:
            self.sock.sendall(frame)
            head = self._exact(4)
            if not self._answered and not self.security.tls and head[:2] in _TLS_RECORD_TYPES:
                raise BrokerError(f"broker {self.address} answered with TLS: the port speaks "
                                  "TLS; set security.protocol=SSL (or SASL_SSL)")
            (size,) = struct.unpack(">i", head)
            if size < 0 or size > 1 << 30:
                raise BrokerError(f"broker {self.address} sent a frame of {size} bytes")
            data = self._exact(size)
        except ssl.SSLError as exc:
            raise _tls_failure(self.address, exc) from None
        except OSError as exc:
            raise BrokerError(f"broker {self.address}: {exc}") from None
        self._answered = True
        try:
            got, offset = parse_response_header(data, response_version)
            if got != cid:
                raise BrokerError(f"broker {self.address} answered correlation id {got}, "
                                  f"expected {cid}")
            return parse_response(api_key, version, data, offset)
        except ProtocolError as exc:
            raise BrokerError(f"broker {self.address} sent a response that does not "
                              f"parse: {exc}") from None

    # ------------------------------------------------------------------ SASL

    def _authenticate(self) -> None:
        mechanism = self.security.sasl_mechanism
        assert mechanism is not None
        cls = request_type(ApiKey.SASL_HANDSHAKE, SASL_HANDSHAKE_VERSION)
        response = self.request(ApiKey.SASL_HANDSHAKE, SASL_HANDSHAKE_VERSION,
                                cls(mechanism=mechanism))
        code = int(response.error_code)
        if code == UNSUPPORTED_SASL_MECHANISM:
            enabled = ", ".join(response.mechanisms) or "none"
            raise BrokerError(f"SASL: broker {self.address} does not enable mechanism "
                              f"{mechanism} (it enables: {enabled}); set sasl.mechanism to "
                              "one of them", code)
        if code != 0:
            raise BrokerError(f"SASL: broker {self.address} refused the SaslHandshake for "
                              f"{mechanism}: error {code} ({response.error_code.name})", code)
        username = self.security.sasl_username or ""
        password = self.security.sasl_password or ""
        if mechanism == "PLAIN":
            self._round(b"\x00" + username.encode() + b"\x00" + password.encode())
            return
        try:
            import scramp
        except ImportError:
            raise BrokerError(f"SASL {mechanism} needs the scramp package: pip install "
                              "'.[pipelines]' (from a kiproxy checkout)") from None
        try:
            client = scramp.ScramClient([mechanism], username, password)
            server_first = self._round(client.get_client_first().encode())
            client.set_server_first(server_first.decode())
            server_final = self._round(client.get_client_final().encode())
            client.set_server_final(server_final.decode())
        except scramp.ScramException as exc:
            raise BrokerError(f"SASL: the {mechanism} exchange with broker {self.address} "
                              f"as {username!r} failed: {exc}") from None

    def _round(self, token: bytes) -> bytes:
        mechanism, user = self.security.sasl_mechanism, self.security.sasl_username
        cls = request_type(ApiKey.SASL_AUTHENTICATE, SASL_AUTHENTICATE_VERSION)
        try:
            response = self.request(ApiKey.SASL_AUTHENTICATE, SASL_AUTHENTICATE_VERSION,
                                    cls(auth_bytes=token))
        except BrokerError as exc:
            raise BrokerError(f"SASL: authentication as {user!r} with {mechanism} at broker "
                              f"{self.address} failed: {exc}") from None
        code = int(response.error_code)
        if code != 0:
            said = response.error_message or response.error_code.name
            raise BrokerError(f"SASL: authentication as {user!r} with {mechanism} failed at "
                              f"broker {self.address}: {said}; check sasl.username and "
                              "sasl.password (or sasl.jaas.config)", code)
        lifetime_ms = response.session_lifetime.total_seconds() * 1000 \
            if response.session_lifetime else 0
        if lifetime_ms > 0:
            self._expires_at = time.monotonic() + lifetime_ms * 0.9 / 1000
        return bytes(response.auth_bytes)
