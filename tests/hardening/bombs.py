"""Decompression bombs and abandoned frames, built from their descriptions, sent over
bare sockets (shared by tests/hardening/test_bombs.py and bench/bombs.py)."""

from __future__ import annotations

import contextlib
import datetime
import socket
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import get_args, get_type_hints

import cramjam
import lz4.frame
import psutil
from crc32c import crc32c

from kiproxy.protocol.compression import XERIAL_MAGIC, Compression
from kiproxy.protocol.framing import encode_frame, encode_request_header
from kiproxy.protocol.messages import ApiKey, parse_response, request_type, serialize

__all__ = ["BOMBS", "RssSampler", "abandon_large_frames", "batch_around", "bomb_request",
           "produce_answer", "produce_request", "rss_of", "send_at_once"]

MiB = 2**20
PRODUCE_VERSION = 8  # zstd needs v7+; v8 answers carry error_message


def zstd_rle_bomb(blocks: int = 3072) -> bytes:
    """A zstd frame without a content size (``28 b5 2f fd 00 38``: window 128 KiB)
    followed by ``blocks`` RLE blocks of 128 KiB each, 4 bytes apiece: 384 MiB."""
    def rle(last: int) -> bytes:
        header = (131072 << 3) | (1 << 1) | last  # size, block type 1 (RLE), last bit
        return struct.pack("<I", header)[:3] + b"\x00"

    return bytes.fromhex("28b52ffd0038") + rle(0) * (blocks - 1) + rle(1)


def gzip_bomb(size: int = 300 * MiB) -> bytes:
    """``size`` zero bytes in one gzip member (300 MiB: about 306 KB)."""
    deflate = zlib.compressobj(9, zlib.DEFLATED, 31)
    chunk = bytes(MiB)
    parts = [deflate.compress(chunk) for _ in range(size // MiB)]
    return b"".join(parts) + deflate.flush()


def lz4_bomb(size: int = 64 * MiB) -> bytes:
    """An LZ4 frame of ``size`` zero bytes (about 255:1)."""
    return bytes(lz4.frame.compress(bytes(size)))


def snappy_claim_bomb() -> bytes:
    """A raw snappy stream whose length preamble claims 4 GiB, in 7 bytes."""
    return b"\xff\xff\xff\xff\x0f\x00\x01"


def snappy_xerial_bomb(blocks: int = 40) -> bytes:
    """Xerial framing around ``blocks`` honest blocks of 1 MiB of zeros each."""
    block = bytes(cramjam.snappy.compress_raw(bytes(MiB)))
    return (XERIAL_MAGIC + struct.pack(">ii", 1, 1)
            + (struct.pack(">i", len(block)) + block) * blocks)


BOMBS = {
    "zstd": (Compression.ZSTD, zstd_rle_bomb),
    "gzip": (Compression.GZIP, gzip_bomb),
    "lz4": (Compression.LZ4, lz4_bomb),
    "snappy-claim": (Compression.SNAPPY, snappy_claim_bomb),
    "snappy-xerial": (Compression.SNAPPY, snappy_xerial_bomb),
}
"""name -> (codec, builder)."""


def batch_around(block: bytes, codec: Compression, count: int = 1000) -> bytes:
    """A magic-2 record batch whose records block is ``block``, with a correct CRC."""
    after_crc = struct.pack(">hiqqqhii", int(codec), count - 1, 0, 0, -1, -1, -1, count) + block
    return struct.pack(">qiibI", 0, 49 + len(block), -1, 2, crc32c(after_crc)) + after_crc


def produce_request(topic: str, batch: bytes, correlation_id: int = 1,
                    client_id: str = "bomber") -> bytes:
    """A Produce v8 request (acks=1) of ``batch`` to partition 0, length prefix included."""
    cls = request_type(ApiKey.PRODUCE, PRODUCE_VERSION)
    topic_t = get_args(get_type_hints(cls)["topic_data"])[0]
    part_t = get_args(get_type_hints(topic_t)["partition_data"])[0]
    timeout = datetime.timedelta(seconds=30)
    message = cls(transactional_id=None, acks=1, timeout=timeout, topic_data=(
        topic_t(name=topic, partition_data=(part_t(index=0, records=batch),)),))
    header = encode_request_header(ApiKey.PRODUCE, PRODUCE_VERSION, correlation_id,
                                   client_id, 1)
    return encode_frame(header + serialize(message))


def bomb_request(topic: str, codec: Compression, block: bytes, correlation_id: int = 1,
                 client_id: str = "bomber") -> bytes:
    """A Produce request carrying one batch around the compressed ``block``."""
    return produce_request(topic, batch_around(block, codec), correlation_id, client_id)


def produce_answer(frame: bytes) -> tuple[int, str | None]:
    """(error_code, error_message) of the one partition of a Produce v8 answer."""
    response = parse_response(ApiKey.PRODUCE, PRODUCE_VERSION, frame, 4)
    part = response.responses[0].partition_responses[0]
    return int(part.error_code), part.error_message


def rss_of(pid: int, *, children: bool = False) -> int:
    """Resident memory of a process (VmRSS), in bytes; with ``children``, plus that of
    every process below it that is still there when asked (isolation workers)."""
    process = psutil.Process(pid)
    total = process.memory_info().rss
    if children:
        for child in process.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                total += child.memory_info().rss
    return int(total)


@dataclass
class RssSampler:
    """Samples a process's RSS (``rss_of``, with ``children`` as given) on a thread
    until the process is gone or the block ends; keeps the peak and counts samples."""

    pid: int
    interval: float = 0.05
    children: bool = False
    peak: int = 0
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, rss_of(self.pid, children=self.children))
                self.samples += 1
            except psutil.NoSuchProcess:
                return
            self._stop.wait(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


def abandon_large_frames(address: str, connections: int, at_once: int = 16,
                         claimed: int = 104_857_599, sent: int = 1_000_000) -> None:
    """``connections`` clients, ``at_once`` at a time, each claiming a ``claimed``-byte
    Produce request, sending ``sent`` bytes of it and closing."""
    host, port = address.rsplit(":", 1)
    header = encode_request_header(ApiKey.PRODUCE, PRODUCE_VERSION, 1, "abandoner", 1)
    payload = struct.pack(">i", claimed) + header + bytes(sent - len(header))
    for start in range(0, connections, at_once):
        socks = []
        for _ in range(min(at_once, connections - start)):
            sock = socket.create_connection((host, int(port)), 10)
            socks.append(sock)
        for sock in socks:
            with contextlib.suppress(OSError):  # the proxy may close it first
                sock.sendall(payload)
        time.sleep(0.05)
        for sock in socks:
            sock.close()


def send_at_once(address: str, frame: bytes, clients: int = 16) -> list[bytes]:
    """``clients`` connections each send ``frame`` at once; their answers, in order."""
    host, port = address.rsplit(":", 1)
    socks = [socket.create_connection((host, int(port)), 120) for _ in range(clients)]
    try:
        senders = [threading.Thread(target=s.sendall, args=(frame,)) for s in socks]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        answers = []
        for sock in socks:
            size = struct.unpack(">i", _exact(sock, 4))[0]
            answers.append(_exact(sock, size))
        return answers
    finally:
        for sock in socks:
            sock.close()


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)
