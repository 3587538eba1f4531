"""FrameStream's PROXY header phase, fed bytes as a socket would (no network), and which
route configurations take the single-interceptor path."""

from __future__ import annotations

import asyncio
import struct
from typing import Any

import pytest

from kiproxy.protocol.proxy_header import (
    Incomplete,
    NotProxy,
    ProxyHeader,
    ProxyHeaderError,
)
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.net.frame_stream import FrameStream
from kiproxy.proxy.routes.runtime import load_routes

V2_HEADER = (b"\r\n\r\n\x00\r\nQUIT\n" + bytes([0x21, 0x11]) + struct.pack("!H", 12)
             + bytes([203, 0, 113, 9]) + bytes([10, 0, 0, 1]) + struct.pack("!HH", 40001, 9092))
FRAMES = [b"first request", b"x" * 20_000]
KAFKA = b"".join(struct.pack(">i", len(f)) + f for f in FRAMES)


class FakeTransport:
    """What FrameStream asks of a transport."""

    def __init__(self) -> None:
        self.reading = True
        self.aborted = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("10.0.0.1", 5555)}.get(name, default)

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def set_write_buffer_limits(self, **_: int) -> None:
        pass


def _stream(mode: Any) -> FrameStream:
    stream = FrameStream(1 << 20, proxy_header=mode)
    stream.connection_made(FakeTransport())  # type: ignore[arg-type]
    return stream


def _feed(stream: FrameStream, data: bytes, step: int) -> None:
    for i in range(0, len(data), step):
        piece = data[i:i + step]
        while piece:
            buffer = stream.get_buffer(len(piece))
            n = min(len(buffer), len(piece))
            buffer[:n] = piece[:n]
            stream.buffer_updated(n)
            piece = piece[n:]


async def _frames(stream: FrameStream, count: int) -> list[bytes]:
    out: list[bytes] = []
    while len(out) < count:
        out.extend(bytes(f) for f in await asyncio.wait_for(stream.read(), 1))
    return out


@pytest.mark.parametrize("step", [1, 7, 4096, 100_000])
async def test_a_v2_header_names_the_client_and_the_frames_after_it_arrive_intact(
        step: int) -> None:
    stream = _stream("read")
    _feed(stream, V2_HEADER + KAFKA, step)
    parsed = await stream.read_proxy_header(1)
    assert isinstance(parsed, ProxyHeader) and parsed.source == ("203.0.113.9", 40001)
    assert await _frames(stream, 2) == FRAMES


@pytest.mark.parametrize("step", [1, 4096])
async def test_without_a_header_every_byte_is_kafka(step: int) -> None:
    stream = _stream("read")
    _feed(stream, KAFKA, step)
    assert isinstance(await stream.read_proxy_header(1), NotProxy)
    assert await _frames(stream, 2) == FRAMES


async def test_a_malformed_header_is_handed_to_the_owner() -> None:
    stream = _stream("read")
    _feed(stream, b"PROXY TCP4 not-an-address 10.0.0.1 1 2\r\n" + KAFKA, 4096)
    assert isinstance(await stream.read_proxy_header(1), ProxyHeaderError)


async def test_a_silent_client_gives_incomplete_after_the_timeout() -> None:
    stream = _stream("read")
    assert isinstance(await stream.read_proxy_header(0.05), Incomplete)
    _feed(stream, b"PROX", 4)  # a header begun but never finished: the same
    assert isinstance(await stream.read_proxy_header(0.05), Incomplete)


async def test_on_a_listener_with_it_off_a_header_fails_the_stream() -> None:
    stream = _stream("refuse")
    _feed(stream, V2_HEADER + KAFKA, 4096)
    with pytest.raises(ProxyHeaderError, match="proxy_protocol: off"):
        await stream.read()


async def test_on_a_listener_with_it_off_kafka_bytes_pass() -> None:
    stream = _stream("refuse")
    _feed(stream, KAFKA, 3)
    assert await _frames(stream, 2) == FRAMES


def _config(**settings: Any) -> ProxyConfig:
    return ProxyConfig.model_validate(settings)


def test_the_shorthand_and_one_catch_all_link_take_the_single_path() -> None:
    shorthand = load_routes(_config(interceptor={"class": "uppercase"}))
    assert shorthand is not None and shorthand.single is not None
    assert shorthand.single.name == "default"
    written_out = load_routes(_config(routes=[
        {"name": "all", "interceptors": [{"class": "uppercase"}]}]))
    assert written_out is not None and written_out.single is not None
    # One catch-all route needs no selection whatever its chain's length.
    two_links = load_routes(_config(routes=[
        {"interceptors": [{"class": "uppercase"}, {"class": "uppercase"}]}]))
    assert two_links is not None and two_links.single is not None
    assert len(two_links.single.links) == 2


def test_routes_that_select_do_not_take_the_single_path() -> None:
    assert load_routes(_config()) is None  # nothing to run: every batch passes
    for settings in (
        {"routes": [{"match": {"topic": "a"}, "interceptors": [{"class": "uppercase"}]}]},
        {"default": {"interceptors": [{"class": "uppercase"}]}},
    ):
        loaded = load_routes(_config(**settings))
        assert loaded is not None and loaded.single is None, settings
