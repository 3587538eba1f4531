"""What the request handlers may know of the client connection a request came on.

Contract: the dispatcher and the produce pipeline see a client only through
:class:`RequestingClient`: its identity (a frozen value), its SASL
bookkeeping, the ``extra=`` fields for log lines, the routes that hold for it
(cached while its identity stays the same), and the one callback that reads a
SaslAuthenticate answer. They never hold the connection itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kiproxy.interceptors.identity import ClientIdentity
    from kiproxy.proxy.net.sasl import SaslRound, SaslTracker
    from kiproxy.proxy.routes.table import ClientRoutes, RouteTable

__all__ = ["RequestingClient"]


class RequestingClient(Protocol):
    """What the dispatcher and the produce pipeline need of the client connection."""

    @property
    def identity(self) -> ClientIdentity:
        """Who the client is, as the proxy knows it now."""

    @property
    def sasl(self) -> SaslTracker:
        """The connection's SASL bookkeeping."""

    @property
    def log_context(self) -> dict[str, object]:
        """``extra=`` fields for log lines about this client."""

    def routes(self, table: RouteTable) -> ClientRoutes:
        """The routes of ``table`` that can hold for this client (cached per identity)."""

    def sasl_answered(self, sasl_round: SaslRound | None, version: int, flexible: bool,
                      frame: bytes) -> bytes:
        """Learn (or forget) the principal from a SaslAuthenticate answer; return it."""
