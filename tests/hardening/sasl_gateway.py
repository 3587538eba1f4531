"""The authentication layer of a Kafka broker, in front of a real (Tansu) broker.

What this is, and what it is not
--------------------------------
:class:`SaslGateway` plays **only the SASL authentication part** of a Kafka
broker: it listens where clients (or kiproxy) connect, runs the SASL exchange
itself (PLAIN, SCRAM-SHA-256 and SCRAM-SHA-512, server side, with real
credential checks), and once a connection has authenticated relays its frames
byte for byte to a real broker and back. Every record is stored, fetched and
acknowledged by that broker (Tansu, the test broker of this project); the
gateway never answers a Produce, Fetch or Metadata request itself.

Why it exists: the SASL tests need a broker that *requires* PLAIN or SCRAM and
holds users, and none is available on these machines. Tansu cannot store SCRAM
users on any of its storage engines while it requires authentication (``tansu
user create`` fails) and it has no PLAIN mechanism; no Apache Kafka
distribution can be obtained offline; and there is no Docker engine for the
``apache/kafka`` image (tests/containers/test_apache_kafka_sasl.py runs the
same scenarios against real Apache Kafka wherever Docker answers).

How closely it follows Apache Kafka (``SaslServerAuthenticator``,
``PlainSaslServer``, ``ScramSaslServer``, ``KafkaApis``):

* Before authentication only ApiVersions (once, until it succeeds; forwarded to
  the broker, with SaslHandshake and SaslAuthenticate added if missing) and
  SaslHandshake are accepted. Any other request closes the connection without
  an answer (Kafka's ``IllegalSaslStateException``). After a SaslHandshake v1,
  anything but SaslAuthenticate closes it too (Kafka first sends that request
  type's error response with ILLEGAL_SASL_STATE; building an error response for
  an arbitrary API is out of scope here, so the gateway only closes). Frames
  before authentication are limited to 512 KiB (``sasl.server.max.receive.size``).
* SaslHandshake v0/v1: a mechanism that is not enabled gets
  UNSUPPORTED_SASL_MECHANISM (33) with the enabled list, then the connection
  closes. v0 starts the legacy flow (raw SASL tokens, length-prefixed, no Kafka
  header; a failure simply closes); v1 the SaslAuthenticate flow.
* SaslAuthenticate v0-v2: PLAIN (RFC 4616) and SCRAM (RFC 5802 / RFC 7677,
  salted password by PBKDF2 with 4096 iterations, client proof verified, the
  server-final-message ``v=ServerSignature``). A failure answers
  SASL_AUTHENTICATION_FAILED (58) and closes the connection. The message is
  Kafka's: for SCRAM "Authentication failed during authentication due to
  invalid credentials with SASL mechanism SCRAM-SHA-256" (wrong password and
  unknown user alike); for PLAIN "Authentication failed: Invalid username or
  password" and PlainSaslServer's other messages.
* After authentication: SaslHandshake/SaslAuthenticate answer ILLEGAL_SASL_STATE
  (34), as Kafka's ``KafkaApis`` does when re-authentication is off. With
  ``session_lifetime_ms`` set, the successful SaslAuthenticate (v1+) carries
  that session lifetime and a SaslHandshake on the authenticated connection
  starts a KIP-368 re-authentication (same mechanism and principal only); a
  request other than SaslHandshake after the session expired closes the
  connection, as Kafka does.
* Responses that name broker addresses (Metadata, FindCoordinator,
  DescribeCluster, and the KIP-951 ``node_endpoints`` of Produce/Fetch) are
  rewritten, with :func:`kiproxy.proxy.brokers.addresses.rewrite_response_frame`, to name the
  gateway's own ``host:port`` for every node (Tansu has one, node id 111), so a
  client that follows the metadata comes back through the gateway and
  authenticates again: nothing ever names the broker's real port.

Used in-process (it runs its own asyncio loop on a daemon thread), or as a
script for manual checks::

    .venv/bin/python tests/hardening/sasl_gateway.py --user alice=alice-secret
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import enum
import hashlib
import hmac
import logging
import re
import secrets
import struct
import threading
import time
import typing
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kio.schema.errors import ErrorCode

from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import (
    encode_response_header,
    parse_request_header,
    parse_response_header,
    response_header_version,
)
from kiproxy.protocol.messages import ApiKey, api_name, parse_request, parse_response, response_type
from kiproxy.protocol.messages import serialize as serialize_message
from kiproxy.protocol.produce_request import read_acks
from kiproxy.proxy.brokers.addresses import needs_rewrite, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import known_version_range

__all__ = [
    "MECHANISMS",
    "GatewayStats",
    "SaslGateway",
    "ScramCredential",
    "kafka_failure_message",
    "sasl_broker",
]

log = logging.getLogger("sasl_gateway")

MECHANISMS: tuple[str, ...] = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
"""The mechanisms the gateway enables by default, in the order it names them."""

SCRAM_ITERATIONS = 4096
"""Kafka's minimum (and kafka-configs' default) SCRAM iteration count."""

MAX_RECEIVE_BEFORE_AUTH = 524288
"""Kafka's ``sasl.server.max.receive.size`` default: the largest frame before authentication."""

MAX_FRAME = 100 * 1024 * 1024

_INT32 = struct.Struct(">i")
_INT16 = struct.Struct(">h")
_HASHES = {"SCRAM-SHA-256": "sha256", "SCRAM-SHA-512": "sha512"}


def kafka_failure_message(mechanism: str, reauthentication: bool = False) -> str:
    """The message Kafka sends when a SASL exchange fails on a ``SaslException``.

    (Every SCRAM failure: wrong password, unknown user, bad nonce or format.)
    """
    which = "re-authentication" if reauthentication else "authentication"
    return (f"Authentication failed during {which} due to invalid credentials with "
            f"SASL mechanism {mechanism}")


# ---------------------------------------------------------------------------- mechanisms


class _SaslError(Exception):
    """Kafka's ``SaslException``: the client sees only the generic failure message."""


class _SaslAuthenticationError(Exception):
    """Kafka's ``SaslAuthenticationException``: its message goes to the client."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _hmac(hash_name: str, key: bytes, message: bytes) -> bytes:
    return hmac.new(key, message, hash_name).digest()


@dataclass(frozen=True)
class ScramCredential:
    """What a Kafka broker stores for a SCRAM user (never the password)."""

    mechanism: str
    salt: bytes
    iterations: int
    stored_key: bytes
    server_key: bytes

    @classmethod
    def create(cls, mechanism: str, password: str, iterations: int = SCRAM_ITERATIONS,
               salt: bytes | None = None) -> ScramCredential:
        """The credential of ``password`` (RFC 5802: SaltedPassword = Hi(password, salt, i))."""
        h = _HASHES[mechanism]
        salt = salt if salt is not None else secrets.token_bytes(16)
        salted = hashlib.pbkdf2_hmac(h, password.encode(), salt, iterations)
        client_key = _hmac(h, salted, b"Client Key")
        return cls(mechanism, salt, iterations, hashlib.new(h, client_key).digest(),
                   _hmac(h, salted, b"Server Key"))


class _Exchange:
    """One server-side SASL exchange (``step`` until ``principal`` is set)."""

    mechanism: str
    principal: str | None = None
    user: str | None = None
    """The user the client named, once known (for the gateway's records)."""

    def step(self, token: bytes) -> bytes:
        raise NotImplementedError


class _Plain(_Exchange):
    """PlainSaslServer: ``authzid NUL authcid NUL password``, one round."""

    mechanism = "PLAIN"

    def __init__(self, passwords: Mapping[str, str]) -> None:
        self._passwords = passwords

    def step(self, token: bytes) -> bytes:
        tokens = token.decode("utf-8", "replace").split("\x00")
        if len(tokens) != 3:
            raise _SaslAuthenticationError(
                f"Invalid SASL/PLAIN response: expected 3 tokens, got {len(tokens)}")
        authzid, username, password = tokens
        self.user = username or None
        if not username:
            raise _SaslAuthenticationError("Authentication failed: username not specified")
        if not password:
            raise _SaslAuthenticationError("Authentication failed: password not specified")
        expected = self._passwords.get(username)
        if expected is None or not hmac.compare_digest(expected.encode(), password.encode()):
            raise _SaslAuthenticationError("Authentication failed: Invalid username or password")
        if authzid and authzid != username:
            raise _SaslAuthenticationError("Authentication failed: Client requested an "
                                           "authorization id that is different from username")
        self.principal = username
        return b""


_SASLNAME = re.compile(r"(?:[\x01-\x2b\x2d-\x3c\x3e-\x7f]|=2C|=3D)+")
_CLIENT_FIRST = re.compile(
    r"(?P<gs2>(?P<cb>[ny]),(?:a=(?P<authzid>[^,]*))?,)"
    r"(?P<bare>n=(?P<name>[^,]*),r=(?P<nonce>[\x21-\x2b\x2d-\x7e]+)(?P<ext>(?:,[a-zA-Z]=[^,]*)*))$")
_CLIENT_FINAL = re.compile(
    r"(?P<without_proof>c=(?P<cbind>[A-Za-z0-9+/=]+),r=(?P<nonce>[\x21-\x2b\x2d-\x7e]+)"
    r"(?:,[a-zA-Z]=[^,]*)*),p=(?P<proof>[A-Za-z0-9+/=]+)$")


class _Scram(_Exchange):
    """ScramSaslServer (RFC 5802 with SHA-256 or SHA-512, no channel binding)."""

    def __init__(self, mechanism: str, credentials: Mapping[str, ScramCredential]) -> None:
        self.mechanism = mechanism
        self._credentials = credentials
        self._hash = _HASHES[mechanism]
        self._stage = "client-first"
        self._credential: ScramCredential | None = None
        self._gs2 = ""
        self._client_first_bare = ""
        self._server_first = ""
        self._nonce = ""

    def step(self, token: bytes) -> bytes:
        try:
            text = token.decode("utf-8")
        except UnicodeDecodeError:
            raise _SaslError("SCRAM message is not UTF-8") from None
        if self._stage == "client-first":
            return self._first(text)
        if self._stage == "client-final":
            return self._final(text)
        raise _SaslError(f"unexpected SCRAM message after the exchange ({self._stage})")

    def _first(self, text: str) -> bytes:
        match = _CLIENT_FIRST.match(text)
        if match is None:
            raise _SaslError(f"invalid SCRAM client-first-message {text!r}")
        if match["cb"] != "n" and match["cb"] != "y":
            raise _SaslError("channel binding is not supported")
        name = match["name"]
        if not _SASLNAME.fullmatch(name):
            raise _SaslError(f"invalid saslname {name!r}")
        username = name.replace("=2C", ",").replace("=3D", "=")
        self.user = username
        authzid = match["authzid"]
        if authzid and authzid.replace("=2C", ",").replace("=3D", "=") != username:
            raise _SaslAuthenticationError("Authentication failed: Client requested an "
                                           "authorization id that is different from username")
        credential = self._credentials.get(username)
        if credential is None:
            raise _SaslError("Authentication failed: Invalid user credentials")
        self._credential = credential
        self._gs2 = match["gs2"]
        self._client_first_bare = match["bare"]
        self._nonce = match["nonce"] + _b64(secrets.token_bytes(18))
        self._server_first = (f"r={self._nonce},s={_b64(credential.salt)},"
                              f"i={credential.iterations}")
        self._stage = "client-final"
        return self._server_first.encode()

    def _final(self, text: str) -> bytes:
        credential = self._credential
        assert credential is not None
        self._stage = "done"
        match = _CLIENT_FINAL.match(text)
        if match is None:
            raise _SaslError(f"invalid SCRAM client-final-message {text!r}")
        if match["nonce"] != self._nonce:
            raise _SaslError("Invalid client nonce in the final client message.")
        try:
            cbind = base64.b64decode(match["cbind"], validate=True)
            proof = base64.b64decode(match["proof"], validate=True)
        except ValueError:
            raise _SaslError("invalid base64 in the SCRAM client-final-message") from None
        if cbind.decode("utf-8", "replace") != self._gs2:
            raise _SaslError("channel binding data does not match the gs2 header")
        auth_message = (f"{self._client_first_bare},{self._server_first},"
                        f"{match['without_proof']}").encode()
        client_signature = _hmac(self._hash, credential.stored_key, auth_message)
        if len(proof) != len(client_signature):
            raise _SaslError("Invalid client credentials")
        client_key = bytes(a ^ b for a, b in zip(proof, client_signature, strict=True))
        if not hmac.compare_digest(hashlib.new(self._hash, client_key).digest(),
                                   credential.stored_key):
            raise _SaslError("Invalid client credentials")
        self.principal = self.user
        server_signature = _hmac(self._hash, credential.server_key, auth_message)
        return f"v={_b64(server_signature)}".encode()


# ---------------------------------------------------------------------------- records


@dataclass
class GatewayStats:
    """What the gateway did, for the tests' assertions (appended from the gateway's thread)."""

    accepted: int = 0
    """Connections accepted."""
    authenticated: list[tuple[str, str]] = field(default_factory=list)
    """``(mechanism, principal)`` of every successful authentication."""
    reauthenticated: list[tuple[str, str]] = field(default_factory=list)
    """``(mechanism, principal)`` of every successful KIP-368 re-authentication."""
    failures: list[tuple[str, str | None, str]] = field(default_factory=list)
    """``(mechanism, user named, message sent or reason)`` of every failed exchange."""
    refused: list[str] = field(default_factory=list)
    """Why connections were closed before authenticating without an exchange failing
    (e.g. ``"Metadata before authentication"``)."""
    relayed: Counter[str] = field(default_factory=Counter)
    """How many requests of each API (by name) were relayed to the broker."""


# ---------------------------------------------------------------------------- connections


class _Close(Exception):
    """Close the client connection (after what was already written); the reason is logged.

    ``refusal``: counted in :attr:`GatewayStats.refused` when it happens before
    authentication (a failed exchange is counted in ``failures`` instead).
    """

    def __init__(self, reason: str, refusal: bool = True) -> None:
        super().__init__(reason)
        self.refusal = refusal


class _Fail(Exception):
    """A SASL step failed: send ``frame`` (the error answer), then close."""

    def __init__(self, frame: bytes, reason: str) -> None:
        super().__init__(reason)
        self.frame = frame
        self.reason = reason


class _Stage(enum.Enum):
    VERSIONS = "before SaslHandshake"
    HANDSHAKE = "after ApiVersions"
    AUTHENTICATE = "SaslAuthenticate expected"
    LEGACY = "raw SASL tokens expected"
    AUTHENTICATED = "authenticated"


class _Slot:
    """A place in the response order (filled by the broker's answer or the gateway's)."""

    __slots__ = ("close_after", "frame")

    def __init__(self, frame: bytes | None = None, close_after: bool = False) -> None:
        self.frame = frame
        self.close_after = close_after


async def _read_frame(reader: asyncio.StreamReader, limit: int) -> bytes | None:
    """One frame (without its length prefix); ``None`` at a clean end of stream."""
    try:
        head = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise _Close("connection closed inside a frame length") from None
        return None
    (size,) = _INT32.unpack(head)
    if size < 0 or size > limit:
        raise _Close(f"frame of {size} bytes (limit {limit})")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise _Close("connection closed inside a frame") from None


def _produce_acks(frame: bytes, api_version: int, body_offset: int) -> int:
    """The ``acks`` of a Produce request (0 means the broker sends no response)."""
    if api_version < 3:  # no transactional_id before acks
        return int(_INT16.unpack_from(frame, body_offset)[0])
    return read_acks(frame, body_offset, flexible=api_version >= 9)


class _Connection:
    """One client connection: authenticate, then relay to the broker."""

    def __init__(self, gateway: SaslGateway, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.gw = gateway
        self.reader = reader
        self.writer = writer
        peer = writer.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "unknown"
        self.up_reader: asyncio.StreamReader | None = None
        self.up_writer: asyncio.StreamWriter | None = None
        self.stage = _Stage.VERSIONS
        self.mechanism: str | None = None
        self.exchange: _Exchange | None = None
        self.principal: str | None = None
        self.reauthenticating = False
        self.authenticate_version = 0
        self.session_expires: float | None = None
        self.slots: deque[_Slot] = deque()
        self.pending: deque[tuple[int, int, int, _Slot]] = deque()
        self.done = asyncio.Event()

    # ---------------------------------------------------------------- plumbing

    async def upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.up_reader is None or self.up_writer is None:
            self.up_reader, self.up_writer = await asyncio.open_connection(
                *self.gw.upstream, limit=2**20)
        return self.up_reader, self.up_writer

    def send(self, frame: bytes) -> None:
        self.writer.writelines((_INT32.pack(len(frame)), frame))

    def answer(self, header: Any, message: Any) -> bytes:
        version = response_header_version(header.api_key, header.api_version)
        assert version is not None
        return encode_response_header(header.correlation_id, version) + serialize_message(message)

    async def close(self) -> None:
        for w in (self.up_writer, self.writer):
            if w is not None:
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()

    async def run(self) -> None:
        try:
            await self.authenticate()
            await self.relay()
        except _Close as exc:
            log.info("gateway: closing %s (%s): %s", self.peer, self.stage.value, exc)
            if self.stage is not _Stage.AUTHENTICATED and exc.refusal and str(exc):
                self.gw.stats.refused.append(str(exc))
        except (ConnectionError, OSError, ProtocolError) as exc:
            log.info("gateway: connection %s ended: %r", self.peer, exc)
        except Exception:
            log.exception("gateway: connection %s failed", self.peer)
        finally:
            with contextlib.suppress(Exception):
                await self.writer.drain()
            await self.close()

    # ---------------------------------------------------------------- authentication

    async def authenticate(self) -> None:
        """Run the pre-authentication state machine until the client is authenticated."""
        while self.stage is not _Stage.AUTHENTICATED:
            frame = await _read_frame(self.reader, MAX_RECEIVE_BEFORE_AUTH)
            if frame is None:
                raise _Close("")
            if self.stage is _Stage.LEGACY:
                self.legacy_token(frame)
            else:
                await self.pre_auth_request(frame)
            await self.writer.drain()

    async def pre_auth_request(self, frame: bytes) -> None:
        try:
            header = parse_request_header(frame)
        except ProtocolError as exc:
            raise _Close(f"unreadable request before authentication: {exc}") from None
        key = header.api_key
        if self.stage is _Stage.AUTHENTICATE:
            if key != ApiKey.SASL_AUTHENTICATE:
                raise _Close(f"{api_name(key)} during SASL authentication "
                             "(ILLEGAL_SASL_STATE)")
            self.send_or_close(self.authenticate_request, header, frame)
            return
        if key == ApiKey.API_VERSIONS and self.stage is _Stage.VERSIONS:
            response = await self.forward_api_versions(header, frame)
            self.send(response)
            return
        if key == ApiKey.SASL_HANDSHAKE:
            self.send_or_close(self.handshake, header, frame)
            return
        raise _Close(f"{api_name(key)} before authentication (ILLEGAL_SASL_STATE)")

    def send_or_close(self, step: Callable[[Any, bytes], bytes], header: Any,
                      frame: bytes) -> None:
        """Send the answer of ``step``; if it failed, send its answer and close."""
        try:
            self.send(step(header, frame))
        except _Fail as fail:
            self.send(fail.frame)
            raise _Close(fail.reason, refusal=False) from None

    async def forward_api_versions(self, header: Any, frame: bytes) -> bytes:
        """ApiVersions, answered by the broker; SaslHandshake/SaslAuthenticate ensured in it."""
        reader, writer = await self.upstream()
        writer.writelines((_INT32.pack(len(frame)), frame))
        await writer.drain()
        response = await _read_frame(reader, MAX_FRAME)
        if response is None:
            raise _Close("the broker closed the connection")
        patched, ok = self.gw.advertise_sasl(header.api_version, response)
        if ok:
            self.stage = _Stage.HANDSHAKE
        return patched

    def handshake(self, header: Any, frame: bytes) -> bytes:
        """A SaslHandshake: the answer, or :class:`_Fail` with it."""
        version = header.api_version
        if version > self.gw.handshake_max_version or header.body_offset is None:
            raise _Close(f"SaslHandshake v{version} is not supported")
        request = parse_request(ApiKey.SASL_HANDSHAKE, version, frame, header.body_offset)
        mechanism = str(request.mechanism)
        cls = response_type(ApiKey.SASL_HANDSHAKE, version)
        enabled = self.gw.mechanisms
        if mechanism not in enabled:
            self.gw.stats.failures.append((mechanism, None, "UNSUPPORTED_SASL_MECHANISM"))
            raise _Fail(self.answer(header, cls(error_code=ErrorCode(33), mechanisms=enabled)),
                        f"Unsupported SASL mechanism {mechanism}")
        if self.reauthenticating and mechanism != self.mechanism:
            self.gw.stats.failures.append((mechanism, None, "mechanism changed on re-auth"))
            raise _Fail(self.answer(header, cls(error_code=ErrorCode(33), mechanisms=enabled)),
                        f"SASL mechanism changed from {self.mechanism} to {mechanism} "
                        "during re-authentication")
        self.mechanism = mechanism
        self.exchange = self.gw.new_exchange(mechanism)
        self.stage = _Stage.AUTHENTICATE if version >= 1 else _Stage.LEGACY
        return self.answer(header, cls(error_code=ErrorCode(0), mechanisms=enabled))

    def authenticate_request(self, header: Any, frame: bytes) -> bytes:
        """One SaslAuthenticate round: the answer, or :class:`_Fail` with it."""
        assert self.exchange is not None and self.mechanism is not None
        version = header.api_version
        if header.body_offset is None or version > 2:
            raise _Close(f"SaslAuthenticate v{version} is not supported")
        self.authenticate_version = version
        request = parse_request(ApiKey.SASL_AUTHENTICATE, version, frame, header.body_offset)
        cls = response_type(ApiKey.SASL_AUTHENTICATE, version)

        def failed(message: str, user: str | None) -> _Fail:
            extra = {"session_lifetime": _timedelta(0)} if version >= 1 else {}
            self.gw.stats.failures.append((str(self.mechanism), user, message))
            return _Fail(self.answer(header, cls(error_code=ErrorCode(58), error_message=message,
                                                 auth_bytes=b"", **extra)),
                         f"SASL {self.mechanism} failed for {user!r}: {message}")

        try:
            token = self.exchange.step(bytes(request.auth_bytes))
        except _SaslAuthenticationError as exc:
            raise failed(str(exc), self.exchange.user) from None
        except _SaslError as exc:
            log.info("gateway: SASL %s for %r: %s", self.mechanism, self.exchange.user, exc)
            raise failed(kafka_failure_message(self.mechanism, self.reauthenticating),
                         self.exchange.user) from None
        principal = self.exchange.principal
        if principal is not None and self.reauthenticating and principal != self.principal:
            raise failed(f"Cannot change principals during re-authentication from "
                         f"User:{self.principal}: User:{principal}", principal)
        extra: dict[str, Any] = {}
        if version >= 1:
            ms = self.gw.session_lifetime_ms if principal is not None else 0
            extra["session_lifetime"] = _timedelta(ms)
        answer = self.answer(header, cls(error_code=ErrorCode(0), error_message=None,
                                         auth_bytes=token, **extra))
        if principal is not None:
            self.authenticated(principal)
        return answer

    def legacy_token(self, token: bytes) -> None:
        """SaslHandshake v0: raw tokens both ways; a failure closes without a word."""
        assert self.exchange is not None and self.mechanism is not None
        try:
            answer = self.exchange.step(token)
        except (_SaslError, _SaslAuthenticationError) as exc:
            self.gw.stats.failures.append((self.mechanism, self.exchange.user, str(exc)))
            raise _Close(f"legacy SASL {self.mechanism} failed: {exc}", refusal=False) from None
        self.send(answer)
        if self.exchange.principal is not None:
            self.authenticated(self.exchange.principal)

    def authenticated(self, principal: str) -> None:
        assert self.mechanism is not None
        record = (self.mechanism, principal)
        if self.reauthenticating:
            self.gw.stats.reauthenticated.append(record)
        else:
            self.gw.stats.authenticated.append(record)
        log.info("gateway: %s authenticated as %r (SASL %s)%s", self.peer, principal,
                 self.mechanism, " again" if self.reauthenticating else "")
        self.principal = principal
        self.reauthenticating = False
        self.exchange = None
        self.stage = _Stage.AUTHENTICATED
        lifetime = self.gw.session_lifetime_ms
        can_reauthenticate = self.authenticate_version >= 1
        self.session_expires = (time.monotonic() + lifetime / 1000
                                if lifetime and can_reauthenticate else None)

    # ---------------------------------------------------------------- relay

    async def relay(self) -> None:
        await self.upstream()
        tasks = [asyncio.ensure_future(self.client_to_broker()),
                 asyncio.ensure_future(self.broker_to_client()),
                 asyncio.ensure_future(self.done.wait())]
        try:
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in finished:
            if not task.cancelled() and (exc := task.exception()) is not None:
                raise exc

    def flush(self) -> None:
        """Write every answer at the head of the response order."""
        while self.slots and self.slots[0].frame is not None:
            slot = self.slots.popleft()
            assert slot.frame is not None
            self.send(slot.frame)
            if slot.close_after:
                self.done.set()
                return

    def own_answer(self, frame: bytes, close_after: bool = False) -> None:
        self.slots.append(_Slot(frame, close_after))
        self.flush()

    async def client_to_broker(self) -> None:
        assert self.up_writer is not None
        while not self.done.is_set():
            frame = await _read_frame(self.reader, MAX_FRAME)
            if frame is None:
                return
            header = parse_request_header(frame)
            key = header.api_key
            if self.reauthenticating:
                if key != ApiKey.SASL_AUTHENTICATE:
                    raise _Close(f"{api_name(key)} during SASL re-authentication")
                self.reauth_round(header, frame)
            elif key in (ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE):
                self.after_authentication(header, frame)
            else:
                if self.session_expires is not None and time.monotonic() > self.session_expires:
                    raise _Close("the SASL session expired (no re-authentication)")
                expects = not (key == ApiKey.PRODUCE and header.body_offset is not None
                               and _produce_acks(frame, header.api_version,
                                                 header.body_offset) == 0)
                if expects:
                    slot = _Slot()
                    self.slots.append(slot)
                    self.pending.append((header.correlation_id, key, header.api_version, slot))
                self.gw.stats.relayed[api_name(key)] += 1
                self.up_writer.writelines((_INT32.pack(len(frame)), frame))
                await self.up_writer.drain()
            await self.writer.drain()

    def after_authentication(self, header: Any, frame: bytes) -> None:
        """SASL requests on an authenticated connection: re-authentication or refusal."""
        if (header.api_key == ApiKey.SASL_HANDSHAKE and self.session_expires is not None
                and header.api_version >= 1):
            self.reauthenticating = True
            self.reauth_round(header, frame)
            return
        # KafkaApis without re-authentication: ILLEGAL_SASL_STATE.
        known = known_version_range(header.api_key)
        if header.body_offset is None or known is None or header.api_version > known[1]:
            raise _Close(f"{api_name(header.api_key)} v{header.api_version} is not supported")
        if header.api_key == ApiKey.SASL_HANDSHAKE:
            cls = response_type(ApiKey.SASL_HANDSHAKE, header.api_version)
            message = cls(error_code=ErrorCode(34), mechanisms=())
        else:
            cls = response_type(ApiKey.SASL_AUTHENTICATE, header.api_version)
            extra: dict[str, Any] = {}
            if header.api_version >= 1:
                extra["session_lifetime"] = _timedelta(0)
            message = cls(error_code=ErrorCode(34), auth_bytes=b"", error_message=(
                "SaslAuthenticate request received after successful authentication"), **extra)
        self.own_answer(self.answer(header, message))

    def reauth_round(self, header: Any, frame: bytes) -> None:
        """A SaslHandshake or SaslAuthenticate of a KIP-368 re-authentication, in order."""
        step = self.handshake if header.api_key == ApiKey.SASL_HANDSHAKE \
            else self.authenticate_request
        try:
            self.own_answer(step(header, frame))
        except _Fail as fail:
            log.info("gateway: re-authentication of %s failed: %s", self.peer, fail.reason)
            self.own_answer(fail.frame, close_after=True)

    async def broker_to_client(self) -> None:
        assert self.up_reader is not None
        while not self.done.is_set():
            frame = await _read_frame(self.up_reader, MAX_FRAME)
            if frame is None:
                raise _Close("the broker closed the connection")
            if len(frame) < 4:
                raise _Close("the broker sent a response without a correlation id")
            (correlation_id,) = _INT32.unpack_from(frame, 0)
            if not self.pending:
                raise _Close(f"the broker answered correlation id {correlation_id} unasked")
            expected, key, version, slot = self.pending.popleft()
            if correlation_id != expected:
                raise _Close(f"the broker answered {correlation_id} where {expected} was next")
            if key == ApiKey.API_VERSIONS:
                frame, _ = self.gw.advertise_sasl(version, frame)
            elif needs_rewrite(key, version):
                frame = rewrite_response_frame(key, version, frame, seen=self.gw.seen)
            slot.frame = frame
            self.flush()
            await self.writer.drain()


def _timedelta(ms: int) -> Any:
    import datetime

    return datetime.timedelta(milliseconds=ms)


# ---------------------------------------------------------------------------- the gateway


class SaslGateway:
    """A SASL-authenticating front for a real broker at ``upstream`` (see the module doc).

    ``users`` maps user name to password; every user gets a PLAIN password and
    SCRAM-SHA-256/512 credentials (stored as Kafka stores them: salt, iteration
    count, StoredKey, ServerKey). ``handshake_max_version`` 0 makes the gateway
    advertise and accept SaslHandshake v0 only (the legacy raw-token flow).
    """

    def __init__(self, upstream: tuple[str, int] | str, users: Mapping[str, str], *,
                 host: str = "127.0.0.1", port: int = 0,
                 mechanisms: Sequence[str] = MECHANISMS, session_lifetime_ms: int = 0,
                 handshake_max_version: int = 1, iterations: int = SCRAM_ITERATIONS) -> None:
        if isinstance(upstream, str):
            up_host, up_port = upstream.rsplit(":", 1)
            upstream = (up_host, int(up_port))
        self.upstream = upstream
        self.host = host
        self.port = port
        self.mechanisms = tuple(mechanisms)
        unknown = set(self.mechanisms) - set(MECHANISMS)
        if unknown:
            raise ValueError(f"mechanisms {sorted(unknown)} are not implemented")
        self.session_lifetime_ms = session_lifetime_ms
        self.handshake_max_version = handshake_max_version
        self._passwords = dict(users)
        self._scram = {
            mechanism: {user: ScramCredential.create(mechanism, password, iterations)
                        for user, password in users.items()}
            for mechanism in _HASHES
        }
        self.stats = GatewayStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        """``host:port`` to use as ``bootstrap.servers`` (or kiproxy's ``--upstream``)."""
        return f"{self.host}:{self.port}"

    def seen(self, node_id: int, host: str, port: int) -> tuple[str, int]:
        """Every broker node is reached through the gateway (the ``seen`` of the rewriter)."""
        return self.host, self.port

    def set_password(self, user: str, password: str) -> None:
        """Add a user or change a password (new exchanges see it; sessions keep going)."""
        credentials = {mechanism: ScramCredential.create(mechanism, password)
                       for mechanism in _HASHES}
        self._passwords[user] = password
        for mechanism, credential in credentials.items():
            self._scram[mechanism][user] = credential

    def new_exchange(self, mechanism: str) -> _Exchange:
        if mechanism == "PLAIN":
            return _Plain(self._passwords)
        return _Scram(mechanism, self._scram[mechanism])

    def advertise_sasl(self, api_version: int, frame: bytes) -> tuple[bytes, bool]:
        """The broker's ApiVersions answer with SaslHandshake (0..``handshake_max_version``)
        and SaslAuthenticate (0-2) in it; and whether it reports success."""
        _, body_offset = parse_response_header(frame, 0)
        known = known_version_range(ApiKey.API_VERSIONS)
        version = api_version if known is not None and api_version <= known[1] else 0
        try:
            message = parse_response(ApiKey.API_VERSIONS, version, frame, body_offset)
        except ProtocolError:
            if version == 0:
                raise
            message = parse_response(ApiKey.API_VERSIONS, 0, frame, body_offset)
        if int(message.error_code) != 0:
            return frame, False
        entry_type = typing.get_args(typing.get_type_hints(type(message))["api_keys"])[0]
        wanted = {ApiKey.SASL_HANDSHAKE: (0, self.handshake_max_version),
                  ApiKey.SASL_AUTHENTICATE: (0, 2)}
        entries = [e for e in message.api_keys if e.api_key not in wanted]
        entries += [entry_type(api_key=key, min_version=low, max_version=high)
                    for key, (low, high) in wanted.items()]
        patched = dataclasses.replace(message, api_keys=tuple(entries))
        return frame[:body_offset] + serialize_message(patched), True

    # ---------------------------------------------------------------- lifecycle

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.stats.accepted += 1
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await _Connection(self, reader, writer).run()
        finally:
            self._connections.discard(task)

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  reuse_address=True)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)

    def start(self) -> SaslGateway:
        """Listen (on a daemon thread with its own event loop) and return at once."""
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name="sasl-gateway",
                                        daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), loop).result(10)
        log.info("gateway: listening on %s in front of %s:%d (%s)", self.address,
                 *self.upstream, ", ".join(self.mechanisms))
        return self

    def stop(self) -> None:
        """Close the listener and every connection; stop the thread."""
        loop, self._loop = self._loop, None
        if loop is None:
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(10)
        loop.close()

    def __enter__(self) -> SaslGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def sasl_broker(users: Mapping[str, str], **gateway_options: Any) -> Iterator[SaslGateway]:
    """A Tansu broker (advertising its own port) with a :class:`SaslGateway` in front."""
    from kiproxy_dev.tansu import EmbeddedBroker

    with EmbeddedBroker() as broker, SaslGateway(broker.bootstrap, users,
                                                 **gateway_options) as gateway:
        yield gateway


def main(argv: Sequence[str] | None = None) -> None:
    """Start Tansu and a gateway in front of it; run until interrupted."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--user", action="append", default=[], metavar="NAME=PASSWORD",
                        help="a user (repeatable); default alice=alice-secret")
    parser.add_argument("--port", type=int, default=0, help="the gateway's port")
    parser.add_argument("--session-lifetime-ms", type=int, default=0)
    args = parser.parse_args(argv)
    users = dict(u.split("=", 1) for u in args.user) or {"alice": "alice-secret"}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    with sasl_broker(users, port=args.port,
                     session_lifetime_ms=args.session_lifetime_ms) as gateway:
        print(f"SASL gateway on {gateway.address} (users {', '.join(users)}); Ctrl-C stops",
              flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


if __name__ == "__main__":
    import pathlib
    import sys

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
    main()
