"""Real HAProxy bytes through our PROXY protocol parser: the client's own address comes out.

A tiny asyncio server stands behind HAProxy (``mode tcp``, ``send-proxy-v2``
with a CRC-32C TLV, or ``send-proxy`` for v1), parses the header with
:func:`parse_proxy_header`, asks :func:`accept_proxy_header` and echoes the
rest of the stream. The client's socket address must be what the server
learned, and the stream after the header must arrive intact.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Literal

import pytest

from integration.haproxy import StartHaproxy
from kiproxy.protocol.proxy_header import (
    Incomplete,
    ParsedProxyHeader,
    ProxyHeader,
    ProxyHeaderError,
    parse_proxy_header,
)
from kiproxy.proxy.net.proxy_protocol import (
    ProxyDecision,
    Refuse,
    UseHeader,
    accept_proxy_header,
    trusted_networks,
)


class EchoBehindBalancer:
    """Parses each connection's PROXY header, records it and the decision, echoes the rest."""

    def __init__(self, trusted: tuple[str, ...]) -> None:
        self.trusted = trusted_networks(trusted)
        self.seen: list[tuple[ParsedProxyHeader | ProxyHeaderError, ProxyDecision]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")[:2]
        received = b""
        parsed: ParsedProxyHeader | ProxyHeaderError = Incomplete(1)
        try:
            while isinstance(parsed, Incomplete):
                chunk = await reader.read(4096)
                if not chunk:
                    break
                received += chunk
                try:
                    parsed = parse_proxy_header(received)
                except ProxyHeaderError as exc:
                    parsed = exc
            decision = accept_proxy_header("required", self.trusted, peer, parsed)
            self.seen.append((parsed, decision))
            if isinstance(decision, Refuse):
                return
            writer.write(received[decision.length:])
            while chunk := await reader.read(4096):
                writer.write(chunk)
            await writer.drain()
        finally:
            writer.close()


@asynccontextmanager
async def echo_server(trusted: tuple[str, ...]) -> AsyncIterator[tuple[EchoBehindBalancer, int]]:
    echo = EchoBehindBalancer(trusted)
    server = await asyncio.start_server(echo.handle, "127.0.0.1", 0)
    try:
        yield echo, server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def _talk(host: str, port: int, payload: bytes) -> tuple[tuple[str, int], bytes]:
    reader, writer = await asyncio.open_connection(host, port)
    me = writer.get_extra_info("sockname")[:2]
    writer.write(payload)
    await writer.drain()
    writer.write_eof()
    echoed = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return me, echoed


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("version", ["v2", "v1"])
@pytest.mark.parametrize("bind", ["127.0.0.1", "::1"])
async def test_haproxy_names_the_real_client(haproxy: StartHaproxy, version: Literal["v1", "v2"],
                                             bind: str) -> None:
    if bind == "::1" and not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine")
    async with echo_server(trusted=("127.0.0.0/8",)) as (echo, port):
        front = haproxy(port, send_proxy=version, bind=bind)
        payload = b"\x00\x00\x00\x05kafka" * 100
        me, echoed = await _talk(front.host, front.port, payload)
    assert echoed == payload  # nothing of the header leaks into the stream, nothing lost
    mine = [(p, d) for p, d in echo.seen
            if isinstance(d, UseHeader) and d.client == (me[0], me[1])]
    assert len(mine) == 1, echo.seen
    parsed, _ = mine[0]
    assert isinstance(parsed, ProxyHeader)
    assert parsed.version == int(version[1])
    assert parsed.family == ("inet6" if ":" in bind else "inet")
    assert parsed.destination == (bind, front.port)
    if version == "v2":
        assert 0x03 in dict(parsed.tlvs)  # the CRC-32C TLV, checked by the parser


async def test_a_header_from_an_untrusted_balancer_is_refused(haproxy: StartHaproxy) -> None:
    async with echo_server(trusted=("10.0.0.0/8",)) as (echo, port):
        front = haproxy(port)
        _, echoed = await _talk(front.host, front.port, b"\x00\x00\x00\x05kafka")
    assert echoed == b""
    refused = [d for _, d in echo.seen if isinstance(d, Refuse)]
    assert refused and "not in proxy_protocol_trusted" in refused[-1].reason
    assert not any(isinstance(d, UseHeader) for _, d in echo.seen)
