"""Upstream brokers that cannot be reached: the words for why, and a log that does not flood.

A wrong ``--upstream`` or a cluster that is down makes every client connection
fail the same way, many times a second per client (clients reconnect with
short backoffs). :class:`UpstreamFailureLog` writes the first failure to a
broker address at once, then counts the rest and writes one summary line per
interval while they go on (``upstream 127.0.0.1:1 unreachable: connection
refused (37 client connections failed in the last 10 s)``), never a line per
attempt.

:func:`connect_error` turns the exceptions of a failed connect into the words
an operator reads: ``connection refused``, ``host name does not resolve``,
``no answer within 10 s``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import ssl

from kiproxy.protocol.log_limit import RateLimitedLog

__all__ = ["UpstreamFailureLog", "connect_error"]

log = logging.getLogger("kiproxy.connection")


_NO_TLS = " (does the broker speak TLS on this port?)"


def connect_error(exc: BaseException, timeout: float | None = None, tls: bool = False) -> str:
    """Why a connection to a broker could not be opened, in a few plain words; ``tls``:
    it was opened with TLS (a reset or a silence then most often means a plaintext
    port)."""
    if isinstance(exc, socket.gaierror):
        return f"host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        within = f" within {round(timeout, 1):g} s" if timeout is not None else ""
        return f"no answer{within}" + (_NO_TLS if tls else "")
    if isinstance(exc, ConnectionResetError) and not exc.strerror:
        return "connection reset" + (_NO_TLS if tls else "")
    if isinstance(exc, ssl.SSLCertVerificationError) and exc.verify_message:
        # The reason OpenSSL gives (a host name the certificate does not name, an unknown
        # CA, an expired certificate), not only CERTIFICATE_VERIFY_FAILED.
        return f"TLS handshake failed ({exc.reason or exc}: {exc.verify_message})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed ({exc.reason or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


class UpstreamFailureLog:
    """Client connections that could not reach an upstream broker, logged once per interval."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        """Seconds over which failures to one address are summed into one line."""
        # The summary timer, not the clock, ends a window: it closes when one finds none.
        self._limit = RateLimitedLog(log, math.inf)
        self._reasons: dict[str, str] = {}

    def failed(self, address: str, reason: str, client: str, extra: dict[str, object]) -> None:
        """Client ``client``'s connection to ``address`` failed for ``reason``."""
        self._reasons[address] = reason
        if self._limit.allow(address) is None:
            return
        log.warning("upstream %s unreachable: %s; closing client %s (further failures to it "
                    "are summed every %g s)", address, reason, client, self.interval,
                    extra=extra)
        asyncio.get_running_loop().call_later(self.interval, self._summarise, address)

    def _summarise(self, address: str) -> None:
        failed = self._limit.summary(address)
        if not failed:  # quiet for a whole interval: the next is logged at once
            self._reasons.pop(address, None)
            return
        plural = "s" if failed != 1 else ""
        log.warning("upstream %s unreachable: %s (%d client connection%s failed in the "
                    "last %g s)", address, self._reasons[address], failed, plural,
                    self.interval)
        asyncio.get_running_loop().call_later(self.interval, self._summarise, address)
