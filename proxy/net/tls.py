"""TLS contexts for the client-facing listeners and the broker connections.

Client side: the proxy presents ``tls.cert``; with ``tls.client_ca`` it
requires a client certificate signed by that CA (mTLS), and the certificate's
subject becomes the connection's principal (``CN=app,O=Example`` — RFC 2253
order, as Kafka names SSL principals). Upstream: certificates are verified
against ``upstream_tls.ca`` (or the system store) with host-name checking on
unless turned off; an optional client certificate is presented to brokers that
require mTLS. The minimum version defaults to TLS 1.2.

A client handshake the proxy refuses (no client certificate where one is required,
one ``tls.client_ca`` did not sign, TLS versions below ``min_version``, a plaintext
client) is closed by the event loop before any connection object exists, without a
TLS alert: the client is not told why. The listeners' handshakes report each such
refusal (:class:`ListenerTls`): a WARNING once per reason and interval, saying
what to fix, and ``kiproxy_client_tls_failures_total{reason}``. The client's address
is not known there.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Callable
from functools import partial
from typing import Any

from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.proxy.config.clients import TlsFiles
from kiproxy.proxy.config.model import ConfigError, TlsSettings, UpstreamTlsSettings

__all__ = ["ListenerTls", "client_context", "handshake_refusal", "principal_from_peercert",
           "upstream_context"]

log = logging.getLogger("kiproxy.tls")
_refusals = RateLimitedLog(log)

_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST",
                      "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE"})
_HINTS = {
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the client sent no certificate, and "
                                         "tls.client_ca requires one",
    "UNSUPPORTED_PROTOCOL": "the client offers only TLS versions below tls.min_version",
    "NO_SHARED_CIPHER": "the client offers no cipher the proxy accepts",
}

_VERSIONS = {"TLSv1.2": ssl.TLSVersion.TLSv1_2, "TLSv1.3": ssl.TLSVersion.TLSv1_3}
_SHORT = {
    "commonName": "CN", "organizationName": "O", "organizationalUnitName": "OU",
    "countryName": "C", "localityName": "L", "stateOrProvinceName": "ST",
    "streetAddress": "STREET", "domainComponent": "DC", "userId": "UID",
    "emailAddress": "EMAILADDRESS",
}


def _load(action: str, fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{action}: {exc}") from None


def client_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """The server-side context of the listeners, or ``None`` when TLS is off."""
    if settings.cert is None or settings.key is None:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _VERSIONS[settings.min_version]
    _load(f"tls.cert/tls.key ({settings.cert}, {settings.key})", ctx.load_cert_chain,
          settings.cert, settings.key)
    if settings.client_ca is not None:
        _load(f"tls.client_ca ({settings.client_ca})", ctx.load_verify_locations,
              settings.client_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


class ListenerTls:
    """The listeners' TLS, with a certificate that can change while they stay open.

    The listeners are opened with :attr:`front`, whose SNI callback (which
    OpenSSL runs for every handshake, with or without SNI) hands the handshake
    to the current context. A reload builds a whole new context first
    (:func:`client_context`: the certificate, its key and the client CA must
    load and match) and only then switches to it with :meth:`use`: handshakes after
    that see the new certificate and the new ``min_version``; established connections
    keep theirs. (The protocol versions a handshake may use are fixed when its
    connection is accepted, from :attr:`front`, before the SNI callback runs: so
    :meth:`use` sets them there.)
    """

    def __init__(self, context: ssl.SSLContext,
                 count: Callable[[str], None] | None = None) -> None:
        self.current = context
        self.front = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.front.minimum_version = context.minimum_version
        self.front.verify_mode = context.verify_mode
        self.front.sni_callback = self._hand_over
        self.front.sslobject_class = _watched(partial(_refused, count))

    def use(self, context: ssl.SSLContext) -> None:
        """Serve new handshakes with ``context``."""
        self.front.minimum_version = context.minimum_version
        self.current = context

    def _hand_over(self, sslobj: ssl.SSLObject, _name: str | None,
                   _ctx: ssl.SSLContext) -> None:
        sslobj.context = self.current


def handshake_refusal(exc: ssl.SSLError) -> tuple[str, str]:
    """The reason code of a refused client handshake and what it means, in plain words."""
    reason = exc.reason or type(exc).__name__
    if isinstance(exc, ssl.SSLCertVerificationError):
        return reason, ("the client's certificate does not verify against tls.client_ca: "
                        f"{exc.verify_message}")
    if reason in _NOT_TLS:
        return reason, "the client does not speak TLS (a plaintext client on a TLS listener?)"
    return reason, _HINTS.get(reason, str(exc))


def _refused(count: Callable[[str], None] | None, exc: ssl.SSLError) -> None:
    reason, what = handshake_refusal(exc)
    if count is not None:
        count(reason)
    _refusals.warning(reason, "a client's TLS handshake was refused: %s (%s); the client is "
                      "closed without being told why", what, reason, more=MORE_IN_INTERVAL)


def _watched(refused: Callable[[ssl.SSLError], None]) -> type[ssl.SSLObject]:
    """An ``SSLObject`` class whose failed handshakes are handed to ``refused`` (the
    listener's context makes its handshakes' objects of it)."""

    class Watched(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise  # more bytes to come: not a failure
            except ssl.SSLError as exc:
                refused(exc)
                raise

    return Watched


def upstream_context(settings: UpstreamTlsSettings | TlsFiles,
                     key: str = "upstream_tls") -> ssl.SSLContext | None:
    """The client-side context for broker connections, or ``None`` when TLS is off.

    ``key`` names the settings in errors (``dead_letter_sink.tls`` for the sink's)."""
    if not settings.active:
        return None
    try:
        ctx = ssl.create_default_context(cafile=settings.ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{key}.ca ({settings.ca}): {exc}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = settings.verify_hostname
    if settings.cert is not None and settings.key is not None:
        _load(f"{key}.cert/key ({settings.cert}, {settings.key})",
              ctx.load_cert_chain, settings.cert, settings.key)
    return ctx


def principal_from_peercert(cert: dict[str, Any] | None) -> str | None:
    """``CN=...,O=...`` from ``SSLObject.getpeercert()``, most specific first."""
    if not cert or "subject" not in cert:
        return None
    parts = []
    for rdn in reversed(cert["subject"]):
        for name, value in rdn:
            parts.append(f"{_SHORT.get(name, name)}={value}")
    return ",".join(parts) or None
