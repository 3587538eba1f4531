"""Who is producing: what the proxy knows of a client connection, as one frozen value.

Stable plugin API. The runtime builds one :class:`ClientIdentity` per client
connection when it accepts it (after the PROXY header, if any, and the TLS
handshake) and a new one when something about the client is learned later (a
SASL exchange decided, the first request's ``client.id``); every
:class:`~kiproxy.interceptors.InterceptContext` carries the one in force
(``ctx.identity``), and routes match on it.

Where each fact comes from:

* ``client_host``/``client_port``: the original client - the source address of
  a PROXY protocol header from a trusted load balancer when there was one,
  else the TCP peer. ``peer_host``/``peer_port`` is always the TCP peer (the
  balancer, when behind one); ``via_proxy_protocol`` says which case holds.
* ``listener``: the name of the listener the client connected to.
* ``tls_subject``/``tls_sans``: the verified client certificate (mTLS), subject
  in RFC 2253 order (``CN=app,O=Example``) and subjectAltName entries as
  Python's ``ssl`` reports them (``("DNS", "app.example")``, ``("URI", ...)``).
* ``sasl_mechanism``/``principal``: the principal is the SASL user name
  (``alice``) once the broker accepted the exchange, else the mTLS subject,
  else None - the same value the proxy logs and audits as ``principal``.
* ``client_id``: the ``client.id`` of the connection's latest request header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["UNKNOWN_CLIENT", "ClientIdentity"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientIdentity:
    """What the proxy knows of one client connection; see the module docstring."""

    client_host: str
    """The original client's IP address (from the PROXY header when present)."""
    client_port: int
    """The original client's port (from the PROXY header when present)."""
    peer_host: str = ""
    """The TCP peer's IP address: the load balancer when behind one; else the client."""
    peer_port: int = 0
    """The TCP peer's port."""
    via_proxy_protocol: bool = False
    """True when ``client_host``/``client_port`` came from a PROXY protocol header."""
    listener: str = "default"
    """The name of the listener the client connected to."""
    tls_subject: str | None = None
    """The verified client certificate's subject (``CN=app,O=Example``), with mTLS."""
    tls_sans: tuple[tuple[str, str], ...] = ()
    """The client certificate's subjectAltName entries, e.g. ``(("DNS", "app.example"),)``."""
    sasl_mechanism: str | None = None
    """The SASL mechanism the client authenticated with (``PLAIN``, ``SCRAM-SHA-512``)."""
    principal: str | None = None
    """The SASL user name once accepted, else the mTLS subject, else None."""
    client_id: str | None = None
    """The ``client.id`` of the latest request header."""

    @property
    def client_address(self) -> str:
        """``host:port`` of the original client (``[v6]:port`` for IPv6)."""
        host = f"[{self.client_host}]" if ":" in self.client_host else self.client_host
        return f"{host}:{self.client_port}"


UNKNOWN_CLIENT: Final = ClientIdentity(client_host="", client_port=0, listener="")
"""The identity of a context built without one (tests, replay of stored records)."""
