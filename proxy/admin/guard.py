"""Who may use the metrics listener's admin actions (``POST /reload``).

The metrics listener is open to whatever can scrape it (in a pod: the whole
cluster network), so its read-only endpoints (``/metrics``, ``/healthz``,
``/livez``, ``/readyz``, ``/config``) stay open and its admin actions need one of:

* a bearer token, when ``admin.token_file`` is set: ``Authorization: Bearer
  <token>`` where the token is the file's content with surrounding whitespace
  removed; the file is read on every attempt, so a rotated secret takes effect
  at once. Every caller, local or not, must present it;
* without a token file, a caller on this host: a loopback peer, or a peer
  whose address is the listener's own address (another worker of the same
  proxy connecting to a non-loopback ``metrics_listen``).

A refused attempt is answered 401 (no or wrong token) or 403 (not local, or the
token file is unreadable), counted in ``kiproxy_admin_refused_total{reason}``
and logged at most once per :data:`LOG_INTERVAL` seconds with the count since
the last line, so a flood of attempts cannot flood the log.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from pathlib import Path

from prometheus_client import Counter

from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, MORE_LIKE_IT, RateLimitedLog

log = logging.getLogger("kiproxy.admin")

__all__ = ["LOG_INTERVAL", "AdminGuard", "Refusal"]

LOG_INTERVAL = 10.0
"""Seconds between two log lines about refused admin attempts."""

Refusal = tuple[int, str]
"""An HTTP status (401 or 403) and the reason given to the caller."""


class AdminGuard:
    """Decides whether one admin request may run; counts and logs the refusals."""

    def __init__(self, token_file: str | None, refused: Counter | None = None) -> None:
        self.token_file = token_file
        self._refused = refused
        self._log = RateLimitedLog(log, LOG_INTERVAL)

    def check(self, peer: str, local: str, authorization: str | None) -> Refusal | None:
        """``None`` when the request from ``peer`` (to ``local``) may run, else the refusal."""
        refusal = self._decide(peer, local, authorization)
        if refusal is not None:
            self._count(peer, refusal)
        return refusal

    def authorization(self) -> str | None:
        """The header value this process sends to its sibling workers (None: no token)."""
        token = self._token() if self.token_file is not None else None
        return f"Bearer {token}" if token else None

    def _decide(self, peer: str, local: str, authorization: str | None) -> Refusal | None:
        if self.token_file is None:
            if _is_local(peer, local):
                return None
            return 403, ("admin actions are served to this host only; set admin.token_file "
                         "to allow remote callers with a bearer token")
        token = self._token()
        if not token:
            return 403, "the admin token file cannot be read or is empty (see the proxy's log)"
        scheme, _, given = (authorization or "").strip().partition(" ")
        if scheme.lower() != "bearer" or not given.strip():
            return 401, "an Authorization: Bearer <token> header is required"
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            return 401, "the bearer token is not the admin token"
        return None

    def _token(self) -> str | None:
        assert self.token_file is not None
        try:
            token = Path(self.token_file).read_text(encoding="utf-8").strip() or None
            problem = None if token else "it is empty"
        except (OSError, UnicodeDecodeError) as exc:
            token, problem = None, str(exc)
        if problem is not None:  # asked once a request: at most one line an interval
            self._log.warning(("token_file", problem),
                              "admin.token_file %s cannot be read (%s); admin actions are "
                              "refused until it can", self.token_file, problem,
                              more=MORE_IN_INTERVAL)
        return token

    def _count(self, peer: str, refusal: Refusal) -> None:
        status, _ = refusal
        reason = "not_local" if status == 403 and self.token_file is None else (
            "no_token_file" if status == 403 else "bad_token")
        if self._refused is not None:
            self._refused.labels(reason).inc()
        self._log.warning("refused", "refused an admin request from %s (%d, %s)", peer,
                          status, reason, more=MORE_LIKE_IT)


def _is_local(peer: str, local: str) -> bool:
    try:
        address = ipaddress.ip_address(peer.partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or peer == local
