"""Whether to believe a PROXY protocol header: the listener's policy as one pure function.

Contract: the runtime feeds a new client connection's first bytes to
:func:`kiproxy.protocol.proxy_header.parse_proxy_header` until it answers
something other than ``Incomplete`` (or the listener's
``proxy_protocol_timeout_ms`` passes, or the client closes), then asks
:func:`accept_proxy_header` and acts on the :data:`ProxyDecision`:

* :class:`UseHeader` - the client is ``client``; drop ``length`` bytes, the
  Kafka stream starts after them;
* :class:`UsePeer` - the client is the TCP peer; drop ``length`` bytes (0 when
  no header was sent, the length of a ``LOCAL``/``UNKNOWN`` header otherwise);
* :class:`Refuse` - close the connection and log ``reason`` once (it names
  the peer and what to change); nothing is forwarded to a broker.

The rules: a header from a peer outside ``proxy_protocol_trusted`` is refused
whatever the mode (anyone could claim any address); ``off`` refuses any header;
``required`` refuses a connection without one; ``optional`` takes a trusted
peer's header and treats a connection without one as a direct client. A
malformed header, or none complete within the timeout, is refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kiproxy.protocol.proxy_header import (
    Incomplete,
    Local,
    NotProxy,
    ProxyHeader,
    ProxyHeaderError,
)
from kiproxy.proxy.config.networks import Network, in_networks, network

__all__ = [
    "ProxyDecision",
    "ProxyProtocolMode",
    "Refuse",
    "UseHeader",
    "UsePeer",
    "accept_proxy_header",
    "trusted_networks",
]

ProxyProtocolMode = Literal["off", "optional", "required"]
"""A listener's ``proxy_protocol`` setting."""


@dataclass(frozen=True, slots=True)
class UseHeader:
    """The header names the client: use ``client`` as its address."""

    client: tuple[str, int]
    """The original client's ``(host, port)``."""
    length: int
    """Bytes of the header, to drop before the Kafka stream."""


@dataclass(frozen=True, slots=True)
class UsePeer:
    """The TCP peer is the client (no header, or a header that names no client)."""

    length: int = 0
    """Bytes of the header, if any, to drop before the Kafka stream."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """Close the connection; log ``reason`` once."""

    reason: str
    kind: str = ""
    """What went wrong, without the client (``no_header``, ``header_off``, ``malformed``,
    ``incomplete``, ``untrusted``): with the peer host, the key the log is limited by."""


ProxyDecision = UseHeader | UsePeer | Refuse
"""What to do with a connection's first bytes."""


def trusted_networks(cidrs: tuple[str, ...]) -> tuple[Network, ...]:
    """The ``proxy_protocol_trusted`` setting (validated CIDR strings) as networks."""
    return tuple(network(cidr) for cidr in cidrs)


def accept_proxy_header(
    mode: ProxyProtocolMode, trusted: tuple[Network, ...], peer: tuple[str, int],
    parsed: Incomplete | NotProxy | ProxyHeader | Local | ProxyHeaderError,
) -> ProxyDecision:
    """The decision for one connection; see the module docstring.

    ``parsed`` is the parser's answer, or the :class:`ProxyHeaderError` it raised;
    ``Incomplete`` means the runtime stopped waiting (timeout or the client closed).
    """
    host, port = peer
    who = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(parsed, NotProxy):
        if mode == "required":
            return Refuse(f"client {who} sent no PROXY header and the listener has "
                          "proxy_protocol: required; connect through the load balancer, "
                          "or set proxy_protocol: optional", "no_header")
        return UsePeer()
    if mode == "off":
        return Refuse(f"client {who} sent a PROXY header but the listener has "
                      "proxy_protocol: off; set proxy_protocol: optional or required with "
                      "proxy_protocol_trusted naming the load balancer", "header_off")
    if isinstance(parsed, ProxyHeaderError):
        return Refuse(f"client {who}: {parsed}", "malformed")
    if isinstance(parsed, Incomplete):
        return Refuse(f"client {who} sent no complete PROXY header in time", "incomplete")
    if not in_networks(host, trusted):
        return Refuse(f"client {who} sent a PROXY header but is not in "
                      "proxy_protocol_trusted; add the load balancer's address there",
                      "untrusted")
    if isinstance(parsed, ProxyHeader) and parsed.source is not None:
        return UseHeader(parsed.source, parsed.length)
    return UsePeer(parsed.length)
