"""Learning the principal of a SASL-authenticated client from the traffic it sends.

The proxy forwards SASL exchanges unchanged (the broker authenticates); it
only reads the user name as it passes: from a PLAIN token
(``authzid NUL authcid NUL password``: the principal is the authorization id
when given, else the authentication id) or from a SCRAM client-first message
(``n,,n=user,r=nonce``). Other mechanisms (GSSAPI, OAUTHBEARER) leave the
principal unknown.

When the name becomes the connection's principal depends on the mechanism:

* PLAIN has one round: a SaslAuthenticate response with error_code 0 means
  the broker accepted the password.
* SCRAM-SHA-256/512 (RFC 5802) has two rounds. The answer to the first (the
  server-first-message ``r=...,s=...,i=...``) comes *before* the broker has
  checked anything, so it decides nothing. Only the server-final-message
  decides: ``v=`` (the server's verifier) with error_code 0 is success;
  ``e=...`` (some brokers send it with error_code 0) or any error code is
  failure. The proxy cannot check the verifier itself (it does not know the
  password); it relies on the broker, which only sends ``v=`` after the
  client's proof verified.

Any SaslAuthenticate response with an error code, or a SCRAM message with
``e=``, ends the exchange as a failure. The verdict of one round is bound to
that round's request (see :meth:`SaslTracker.on_authenticate`), so a client
that sends its next round early cannot make an earlier answer count twice.

The legacy flow (SaslHandshake v0, then raw tokens outside Kafka framing) is
not carried: the server refuses SaslHandshake v0 before it reaches the tracker.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.protocol.framing import parse_response_header
from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.protocol.messages import ApiKey, parse_request, parse_response

__all__ = ["SaslRound", "SaslTracker", "SaslVerdict", "identity_after_sasl", "user_from_token"]

log = logging.getLogger("kiproxy.connection")
_failures = RateLimitedLog(log)
"""Failed logins: one line per client host, client id and user per 10 s (a client
retries its login every few milliseconds), with the count of the others."""


def _scram_unescape(name: str) -> str:
    return name.replace("=2C", ",").replace("=3D", "=")


def user_from_token(mechanism: str | None, token: bytes) -> str | None:
    """The user a SASL client token names, for PLAIN and SCRAM; else ``None``."""
    mech = (mechanism or "").upper()
    if mech == "PLAIN":
        parts = token.split(b"\x00")
        if len(parts) != 3:
            return None
        authzid, authcid = parts[0], parts[1]
        name = authzid or authcid
        return name.decode("utf-8", "replace") or None
    if mech.startswith("SCRAM-"):
        text = token.decode("utf-8", "replace")
        # gs2-header "n,," or "n,a=authzid," then "n=user,r=nonce"
        fields = text.split(",")
        for field in fields[2:]:
            if field.startswith("n="):
                return _scram_unescape(field[2:]) or None
        return None
    return None


def _scram_attribute(message: bytes, name: str) -> str | None:
    """The value of attribute ``name`` (``v``, ``e``, ...) of a SCRAM message, if present."""
    text = message.decode("utf-8", "replace")
    prefix = name + "="
    for field in text.split(","):
        if field.startswith(prefix):
            return field[len(prefix):]
    return None


@dataclass(frozen=True, slots=True)
class SaslRound:
    """One SaslAuthenticate request: what its answer will decide.

    ``step`` is ``"plain"`` (the only PLAIN round), ``"scram-first"`` (the
    client-first-message, whose answer decides nothing unless it is an error),
    ``"scram-final"`` (the client-final-message, whose answer decides) or
    ``"other"`` (a mechanism whose user the proxy cannot read).
    """

    mechanism: str | None
    user: str | None
    step: str
    exchange: int = 0
    """Which exchange on the connection the round belongs to (counts from 1)."""


@dataclass(frozen=True, slots=True)
class SaslVerdict:
    """The end of a SASL exchange, as the broker's answer tells it."""

    user: str
    succeeded: bool
    reason: str = ""
    """Why it failed (empty on success)."""


class SaslTracker:
    """Per-connection state of a SASL exchange."""

    __slots__ = ("_decided", "_exchange", "_pending", "candidate", "failed", "mechanism",
                 "principal")

    def __init__(self) -> None:
        self.mechanism: str | None = None
        self.candidate: str | None = None
        """The user the exchange in progress names (from its first client message)."""
        self.principal: str | None = None
        """The principal the last decided exchange confirmed (kept by the server)."""
        self.failed = False
        """The last decided exchange failed (a broker then closes the connection)."""
        self._exchange = 0
        self._decided = 0
        self._pending = False

    @property
    def awaiting_verdict(self) -> bool:
        """A PLAIN or SCRAM exchange began on this connection and none has succeeded yet.

        A broker then accepts only ApiVersions, SaslHandshake and SaslAuthenticate.
        Other mechanisms (GSSAPI, OAUTHBEARER), and PLAIN or SCRAM messages the proxy
        cannot read, are not judged by the proxy, so they leave this false: the broker
        alone decides for them.
        """
        return self._pending

    def on_handshake(self, api_version: int, frame: bytes, body_offset: int) -> None:
        """Remember the mechanism a SaslHandshake request names; a new exchange starts."""
        try:
            request = parse_request(ApiKey.SASL_HANDSHAKE, api_version, frame, body_offset)
        except Exception:
            return
        self.mechanism = request.mechanism
        self.candidate = None
        self._exchange += 1
        # A first login (not a KIP-368 re-authentication) with a mechanism the proxy judges.
        self._pending = self.principal is None and _judged(self.mechanism)

    def on_authenticate(self, api_version: int, frame: bytes,
                        body_offset: int) -> SaslRound | None:
        """Note one SaslAuthenticate request; the round its answer is to be judged by.

        ``None`` when the request cannot be read (the broker will refuse it).
        """
        try:
            request = parse_request(ApiKey.SASL_AUTHENTICATE, api_version, frame, body_offset)
        except Exception:
            return None
        token = bytes(request.auth_bytes)
        mech = (self.mechanism or "").upper()
        if mech == "PLAIN":
            self.candidate = user_from_token(mech, token)
            self._exchange += 1
            step = "plain"
        elif mech.startswith("SCRAM-"):
            user = user_from_token(mech, token)
            if user is not None:        # client-first-message: a new exchange
                self.candidate = user
                self._exchange += 1
                step = "scram-first"
            elif _scram_attribute(token, "p") is not None:   # client-final-message
                step = "scram-final"
            else:
                step = "other"
        else:
            step = "other"
        if step == "other" or (step in ("plain", "scram-first") and self.candidate is None):
            self._pending = False       # unreadable: leave the verdict to the broker alone
        return SaslRound(self.mechanism, self.candidate, step, self._exchange)

    def on_response(self, round_: SaslRound | None, api_version: int, flexible: bool,
                    frame: bytes) -> SaslVerdict | None:
        """Judge the broker's answer to ``round_``; ``None`` while nothing is decided.

        A verdict is given once per exchange: after it, the exchange is over and
        only a new client-first (or PLAIN) message starts another.
        """
        if round_ is None or round_.user is None or round_.exchange <= self._decided:
            return None
        try:
            _, body_offset = parse_response_header(frame, 1 if flexible else 0)
            response = parse_response(ApiKey.SASL_AUTHENTICATE, api_version, frame, body_offset)
        except Exception:
            self._pending = False       # unreadable: leave the verdict to the broker alone
            return None
        code = int(response.error_code)
        auth_bytes = bytes(response.auth_bytes or b"")
        if code != 0:
            name = _error_name(code)
            detail = f": {response.error_message}" if response.error_message else ""
            verdict = SaslVerdict(round_.user, False, f"error_code {code} ({name}){detail}")
        elif round_.step == "plain":
            verdict = SaslVerdict(round_.user, True)
        elif round_.step.startswith("scram-") and (err := _scram_attribute(auth_bytes, "e")):
            which = "final" if round_.step == "scram-final" else "first"
            verdict = SaslVerdict(round_.user, False, f"server-{which}-message e={err}")
        elif round_.step == "scram-first":
            return None                 # server-first-message: the proof is yet to come
        elif round_.step == "scram-final":
            if _scram_attribute(auth_bytes, "v"):
                verdict = SaslVerdict(round_.user, True)
            else:
                verdict = SaslVerdict(round_.user, False,
                                      "server-final-message has no verifier (v=)")
        else:
            return None
        self._decided = round_.exchange     # this exchange is over: no second verdict
        self.failed = not verdict.succeeded
        if verdict.succeeded:
            self._pending = False
        if round_.exchange == self._exchange:
            self.candidate = None
        return verdict


def _judged(mechanism: str | None) -> bool:
    """Whether the proxy can tell from the exchange when this mechanism's login succeeded."""
    mech = (mechanism or "").upper()
    return mech == "PLAIN" or mech.startswith("SCRAM-")


def _error_name(code: int) -> str:
    try:
        from kio.schema.errors import ErrorCode

        return ErrorCode(code).name.upper()
    except ValueError:
        return "UNKNOWN"


def identity_after_sasl(identity: ClientIdentity, sasl: SaslTracker,
                        sasl_round: SaslRound | None, version: int, flexible: bool,
                        frame: bytes, log_context: dict[str, object]) -> ClientIdentity:
    """The client's identity once a SaslAuthenticate answer (``frame``) has been read.

    The principal is set only when the exchange is decided in the client's
    favour (PLAIN: error_code 0; SCRAM: the server-final-message's ``v=``),
    never on the first SCRAM round. A failed exchange clears the principal
    SASL had given the connection (a failed KIP-368 re-authentication: the
    broker no longer vouches for it; the mTLS subject, if any, is the
    principal again) and is logged once.
    """
    verdict = sasl.on_response(sasl_round, version, flexible, frame)
    if verdict is None:
        return identity
    mechanism = sasl_round.mechanism if sasl_round is not None else sasl.mechanism
    if verdict.succeeded:
        sasl.principal = verdict.user
        if verdict.user == identity.principal:
            return identity
        log.info("client %s (client_id %r) authenticated as %r (SASL %s)",
                 identity.client_address, identity.client_id, verdict.user, mechanism,
                 extra=log_context)
        return dataclasses.replace(identity, principal=verdict.user, sasl_mechanism=mechanism)
    _failures.warning(
        (identity.client_host, identity.client_id, verdict.user),
        "SASL authentication of client %s (client_id "
        "%r) as %r failed: %s (SASL %s)", identity.client_address, identity.client_id,
        verdict.user, verdict.reason, mechanism, more=MORE_IN_INTERVAL, extra=log_context)
    if sasl.principal is not None and identity.principal == sasl.principal:
        identity = dataclasses.replace(identity, principal=identity.tls_subject,
                                       sasl_mechanism=None)
    sasl.principal = None
    return identity
