"""Client networks: CIDR settings parsed, and whether a client address lies in one.

Shared by the route ``match.client_address`` key, the listener's PROXY-protocol
``proxy_protocol_trusted`` networks and the PROXY-protocol edge; it imports
nothing of the proxy.
"""

from __future__ import annotations

import ipaddress
import socket

__all__ = ["IPAddress", "Network", "client_ip", "in_networks", "network"]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def network(text: str) -> Network:
    """``10.0.0.0/8``, ``2001:db8::/32`` or a single address; ``ValueError`` names the text."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        hint = " (host bits set: write the network address)" if "host bits" in str(exc) else ""
        raise ValueError(f"{text!r} is not a CIDR{hint}") from None


def client_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address (IPv4-mapped IPv6 unmapped), or None when it is not one."""
    # inet_pton: ten times faster than ipaddress's parser, and this runs once per client.
    try:
        return ipaddress.IPv4Address(socket.inet_pton(socket.AF_INET, host))
    except OSError:
        pass
    try:
        address = ipaddress.IPv6Address(
            socket.inet_pton(socket.AF_INET6, host.partition("%")[0]))
    except OSError:
        return None  # no IP known (e.g. a Unix socket peer): no CIDR holds it
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    return address


def in_networks(host: str, networks: tuple[Network, ...]) -> bool:
    """``host`` (an IP address as text) lies in one of ``networks``; False for a non-IP."""
    address = client_ip(host)
    return address is not None and any(address in net for net in networks)
