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
import socket
import ssl
from dataclasses import dataclass

__all__ = ["UpstreamFailureLog", "connect_error"]

log = logging.getLogger("kiproxy.connection")


def connect_error(exc: BaseException, timeout: float | None = None) -> str:
    """Why a connection to a broker could not be opened, in a few plain words."""
    if isinstance(exc, socket.gaierror):
        return f"host name does not resolve ({exc.strerror or exc})"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout:g} s" if timeout is not None else "no answer"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed ({exc.reason or exc})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror[:1].lower() + exc.strerror[1:]
    return str(exc) or type(exc).__name__


@dataclass
class _Window:
    reason: str
    suppressed: int = 0


class UpstreamFailureLog:
    """Client connections that could not reach an upstream broker, logged once per interval."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        """Seconds over which failures to one address are summed into one line."""
        self._windows: dict[str, _Window] = {}

    def failed(self, address: str, reason: str, client: str, extra: dict[str, object]) -> None:
        """Client ``client``'s connection to ``address`` failed for ``reason``."""
        window = self._windows.get(address)
        if window is not None:
            window.suppressed += 1
            window.reason = reason
            return
        self._windows[address] = _Window(reason)
        log.warning("upstream %s unreachable: %s; closing client %s (further failures to it "
                    "are summed every %g s)", address, reason, client, self.interval,
                    extra=extra)
        asyncio.get_running_loop().call_later(self.interval, self._summarise, address)

    def _summarise(self, address: str) -> None:
        window = self._windows.get(address)
        if window is None or not window.suppressed:
            self._windows.pop(address, None)  # quiet for a whole interval: log the next at once
            return
        plural = "s" if window.suppressed != 1 else ""
        log.warning("upstream %s unreachable: %s (%d client connection%s failed in the "
                    "last %g s)", address, window.reason, window.suppressed, plural,
                    self.interval)
        window.suppressed = 0
        asyncio.get_running_loop().call_later(self.interval, self._summarise, address)
