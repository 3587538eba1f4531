"""The PROXY protocol (v1 text, v2 binary): the real client behind a TCP load balancer.

Contract: :func:`parse_proxy_header` is fed the first bytes a client
connection received (all of them so far, from the start) and answers with one of

* :class:`Incomplete` - not enough bytes to decide; read more and call again
  with everything received so far;
* :class:`NotProxy` - the bytes do not start with a PROXY signature: they are
  the application's (Kafka) and nothing is consumed;
* :class:`ProxyHeader` - a PROXY header of ``length`` bytes; the Kafka stream
  starts right after it. ``source`` is None when the balancer could not name
  the client (v1 ``UNKNOWN``, v2 ``AF_UNSPEC`` or ``AF_UNIX``): use the peer;
* :class:`Local` - a v2 ``LOCAL`` header (the balancer's own health check):
  use the peer address;

or raises :class:`ProxyHeaderError` (malformed, truncated v1 line, unknown
version or command, a length above the bound, TLVs that overrun, a CRC-32C TLV
that does not match). It never reads past ``length``, never allocates from the
header's length field beyond ``max_v2_length``, and never raises anything else.

Bounds: a v1 line is at most 107 bytes including CRLF (the spec's maximum); a
v2 header at most ``max_v2_length`` bytes (16 + address + TLVs; 4096 by
default, far above what HAProxy or cloud balancers send). Unknown TLV types
are kept in ``tlvs`` and otherwise ignored; ``PP2_TYPE_NOOP`` is kept too.

Why not the PyPI package ``proxy-protocol`` (0.11.3): its v1 reader waits for
a newline with no length bound (the caller must frame the line), its errors
are a mix of its own, ``ValueError``, ``struct.error`` and
``UnicodeDecodeError``, and a v2 header shorter than its address block raises
``struct.error``; wrapping it safely would mean re-doing its framing, bounds
and error mapping, which is most of this module. The spec is
https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt.
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from typing import Literal

from crc32c import crc32c

from kiproxy.protocol.errors import ProtocolError

__all__ = [
    "DEFAULT_MAX_V2_LENGTH",
    "PP2_TYPE_CRC32C",
    "V1_MAX_LENGTH",
    "V1_SIGNATURE",
    "V2_SIGNATURE",
    "Family",
    "Incomplete",
    "Local",
    "NotProxy",
    "ParsedProxyHeader",
    "ProxyHeader",
    "ProxyHeaderError",
    "parse_proxy_header",
]

V1_SIGNATURE = b"PROXY "
"""A v1 header starts with these six bytes."""
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
"""A v2 header starts with these twelve bytes."""
V1_MAX_LENGTH = 107
"""The longest v1 line, CRLF included (``PROXY TCP6`` with two full IPv6 addresses)."""
DEFAULT_MAX_V2_LENGTH = 4096
"""Default bound of a whole v2 header (16-byte preamble, addresses and TLVs)."""
PP2_TYPE_CRC32C = 0x03
"""The TLV type of a CRC-32C of the whole header (checked when present)."""

Family = Literal["inet", "inet6", "unix", "unspec"]
"""The address family the balancer reported."""

_V2_PREAMBLE = 16
_ADDRESS_BLOCK = {0x1: 12, 0x2: 36, 0x3: 216}  # AF_INET, AF_INET6, AF_UNIX
_FAMILY_NAMES: dict[int, Family] = {0x0: "unspec", 0x1: "inet", 0x2: "inet6", 0x3: "unix"}
_TRANSPORTS = {0x0: "unspec", 0x1: "stream", 0x2: "dgram"}


class ProxyHeaderError(ProtocolError):
    """A PROXY header that is malformed, truncated, too long or of an unknown version."""


@dataclass(frozen=True, slots=True)
class Incomplete:
    """More bytes are needed before the header can be judged."""

    needed: int
    """At least this many more bytes (a hint; a v1 line may need more)."""


@dataclass(frozen=True, slots=True)
class NotProxy:
    """The stream does not start with a PROXY header; no byte is consumed."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProxyHeader:
    """A PROXY header naming (or declining to name) the original connection."""

    version: Literal[1, 2]
    """1 (text) or 2 (binary)."""
    family: Family
    """``inet``, ``inet6``, ``unix`` or ``unspec`` (v1 ``UNKNOWN``)."""
    source: tuple[str, int] | None
    """The original client's ``(address, port)``; None when unknown (use the peer)."""
    destination: tuple[str, int] | None
    """The address and port the client connected to on the balancer."""
    tlvs: tuple[tuple[int, bytes], ...] = ()
    """v2 type-length-value extensions, in order, unknown types included."""
    length: int
    """Bytes of the stream the header took; the application's bytes start here."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Local:
    """A v2 ``LOCAL`` header: the balancer speaking for itself (use the peer address)."""

    tlvs: tuple[tuple[int, bytes], ...] = ()
    """Extensions it carried, if any."""
    length: int
    """Bytes of the stream the header took."""


ParsedProxyHeader = Incomplete | NotProxy | ProxyHeader | Local
"""Everything :func:`parse_proxy_header` may return."""


def parse_proxy_header(data: bytes | bytearray | memoryview, *,
                       max_v2_length: int = DEFAULT_MAX_V2_LENGTH) -> ParsedProxyHeader:
    """Judge the first bytes of a connection; see the module docstring."""
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    head = bytes(view[:12])
    if not head:
        return Incomplete(1)
    if head.startswith(V1_SIGNATURE):
        return _parse_v1(view)
    if head == V2_SIGNATURE:
        return _parse_v2(view, max_v2_length)
    if V1_SIGNATURE.startswith(head) or V2_SIGNATURE.startswith(head):
        wanted = V1_SIGNATURE if V1_SIGNATURE.startswith(head) else V2_SIGNATURE
        return Incomplete(len(wanted) - len(head))
    return NotProxy()


def _parse_v1(view: memoryview) -> ParsedProxyHeader:
    window = bytes(view[:V1_MAX_LENGTH])
    end = window.find(b"\r\n")
    if end < 0:
        if len(window) >= V1_MAX_LENGTH or b"\n" in window:
            raise ProxyHeaderError(
                f"PROXY v1 header has no CRLF within {V1_MAX_LENGTH} bytes")
        return Incomplete(1)
    line = window[len(V1_SIGNATURE):end]
    length = end + 2
    try:
        text = line.decode("ascii")
    except UnicodeDecodeError:
        raise ProxyHeaderError("PROXY v1 header is not ASCII") from None
    if text == "UNKNOWN" or text.startswith("UNKNOWN "):
        return ProxyHeader(version=1, family="unspec", source=None, destination=None,
                           length=length)
    parts = text.split(" ")
    if len(parts) != 5:
        raise ProxyHeaderError(
            f"PROXY v1 header {text!r} is not 'TCP4|TCP6 SRC DST SPORT DPORT'")
    protocol, src, dst, sport, dport = parts
    kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]
    family: Family
    if protocol == "TCP4":
        kind, family = ipaddress.IPv4Address, "inet"
    elif protocol == "TCP6":
        kind, family = ipaddress.IPv6Address, "inet6"
    else:
        raise ProxyHeaderError(f"PROXY v1 header names protocol {protocol!r}, not TCP4, "
                               "TCP6 or UNKNOWN")
    source = (_v1_address(kind, src, protocol), _v1_port(sport))
    destination = (_v1_address(kind, dst, protocol), _v1_port(dport))
    return ProxyHeader(version=1, family=family, source=source, destination=destination,
                       length=length)


def _v1_address(kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address], text: str,
                protocol: str) -> str:
    try:
        return str(kind(text))
    except ValueError:
        raise ProxyHeaderError(f"PROXY v1 header: {text!r} is not a {protocol} address") \
            from None


def _v1_port(text: str) -> int:
    if not (text.isdigit() and text.isascii() and 1 <= len(text) <= 5) or int(text) > 65535:
        raise ProxyHeaderError(f"PROXY v1 header: {text!r} is not a port (0-65535)")
    return int(text)


def _parse_v2(view: memoryview, max_length: int) -> ParsedProxyHeader:
    if len(view) < _V2_PREAMBLE:
        return Incomplete(_V2_PREAMBLE - len(view))
    version_command, family_transport, declared = struct.unpack_from("!BBH", view, 12)
    version, command = version_command >> 4, version_command & 0x0F
    if version != 2:
        raise ProxyHeaderError(f"PROXY header has the v2 signature but version {version}")
    if command not in (0x0, 0x1):
        raise ProxyHeaderError(f"PROXY v2 header has unknown command {command:#x}")
    family_code, transport_code = family_transport >> 4, family_transport & 0x0F
    if family_code not in _FAMILY_NAMES or transport_code not in _TRANSPORTS:
        raise ProxyHeaderError(
            f"PROXY v2 header has unknown address family/protocol byte {family_transport:#04x}")
    length = _V2_PREAMBLE + declared
    if length > max_length:
        raise ProxyHeaderError(
            f"PROXY v2 header declares {length} bytes, above the bound of {max_length}")
    if len(view) < length:
        return Incomplete(length - len(view))
    body = bytes(view[_V2_PREAMBLE:length])
    block = _ADDRESS_BLOCK.get(family_code, 0) if command == 0x1 else 0
    if len(body) < block:
        raise ProxyHeaderError(
            f"PROXY v2 header length {declared} is too short for its "
            f"{_FAMILY_NAMES[family_code]} addresses ({block} bytes)")
    tlvs = _tlvs(body[block:])
    _check_crc(bytes(view[:length]), tlvs, block)
    if command == 0x0:
        return Local(tlvs=tlvs, length=length)
    family = _FAMILY_NAMES[family_code]
    source, destination = _v2_addresses(family_code, body)
    return ProxyHeader(version=2, family=family, source=source, destination=destination,
                       tlvs=tlvs, length=length)


def _v2_addresses(family_code: int, body: bytes
                  ) -> tuple[tuple[str, int] | None, tuple[str, int] | None]:
    if family_code == 0x1:
        src, dst, sport, dport = struct.unpack_from("!4s4sHH", body)
        return ((str(ipaddress.IPv4Address(src)), sport),
                (str(ipaddress.IPv4Address(dst)), dport))
    if family_code == 0x2:
        src, dst, sport, dport = struct.unpack_from("!16s16sHH", body)
        return ((str(ipaddress.IPv6Address(src)), sport),
                (str(ipaddress.IPv6Address(dst)), dport))
    return None, None  # AF_UNSPEC, or AF_UNIX paths: not a network client address


def _tlvs(data: bytes) -> tuple[tuple[int, bytes], ...]:
    found: list[tuple[int, bytes]] = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < 3:
            raise ProxyHeaderError(
                f"PROXY v2 header: {len(data) - offset} stray bytes after the last TLV")
        kind, size = struct.unpack_from("!BH", data, offset)
        end = offset + 3 + size
        if end > len(data):
            raise ProxyHeaderError(
                f"PROXY v2 header: TLV type {kind:#04x} of {size} bytes overruns the header")
        found.append((kind, data[offset + 3:end]))
        offset = end
    return tuple(found)


def _check_crc(header: bytes, tlvs: tuple[tuple[int, bytes], ...], block: int) -> None:
    """A ``PP2_TYPE_CRC32C`` TLV must match the header with its value zeroed."""
    offset = _V2_PREAMBLE + block
    for kind, value in tlvs:
        if kind == PP2_TYPE_CRC32C:
            if len(value) != 4:
                raise ProxyHeaderError("PROXY v2 header: CRC32C TLV is not 4 bytes")
            zeroed = header[:offset + 3] + b"\0\0\0\0" + header[offset + 7:]
            if crc32c(zeroed) != int.from_bytes(value, "big"):
                raise ProxyHeaderError("PROXY v2 header: CRC32C does not match")
        offset += 3 + len(value)
