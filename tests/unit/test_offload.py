"""Where a partition's batches are decoded: on the event loop or on a decode thread.

Small partitions and uncompressed ones up to ``inline_plain_bytes`` with at most
``inline_records`` records are decoded on the loop (no thread pool is ever started);
a compressed partition above ``inline_bytes``, and an uncompressed one with more
records or bytes than that, goes to a thread within the memory budget. A transformed
batch is re-compressed on a thread above ``inline_encode_bytes`` (zstd, gzip) or
``inline_bytes`` (LZ4, snappy).
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    Record,
    build_batch,
    decode_batches,
    encode_batch,
)
from kiproxy.proxy.offload import WORKER_NICE, BatchOffload


def _records(count: int, size: int) -> list[Record]:
    return [Record(key=b"k%d" % i, value=bytes([97 + i % 26]) * size, timestamp=i)
            for i in range(count)]


def _decoded_where(data: bytes, **settings: int) -> tuple[bool, list[list[Record]]]:
    """(whether a decode thread was started, the decoded records per batch)."""
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS, inline_bytes=1024, **settings)

    async def decode() -> list[list[Record]]:
        lease = offload.lease()
        try:
            return [list(b.records) for b in await lease.decode(data)]
        finally:
            lease.release()

    try:
        batches = asyncio.run(decode())
        return offload._pool is not None, batches
    finally:
        offload.close()


@pytest.mark.parametrize(("codec", "count", "threaded"), [
    (Compression.NONE, 200, False),   # 200 KiB uncompressed, 200 records: on the loop
    (Compression.NONE, 5000, True),   # more records than inline_records
    (Compression.LZ4, 200, True),     # compressed and above inline_bytes
])
def test_where_a_partition_is_decoded(codec: Compression, count: int, threaded: bool) -> None:
    size = 1024 if count <= 200 else 8
    data = build_batch(_records(count, size), compression=codec)
    started, batches = _decoded_where(data, inline_records=4096)
    assert started is threaded
    assert batches == [list(b.records) for b in decode_batches(data)]


def test_uncompressed_above_inline_plain_bytes_goes_to_a_thread() -> None:
    data = build_batch(_records(100, 1024))
    started, _ = _decoded_where(data, inline_plain_bytes=64 * 1024)
    assert started


@pytest.mark.parametrize(("codec", "count", "threaded"), [
    (Compression.ZSTD, 24, False),   # 24 KiB decoded: re-compressed on the loop
    (Compression.ZSTD, 48, True),    # 48 KiB: on a thread (zstd is a slow compressor)
    (Compression.GZIP, 48, True),
    (Compression.LZ4, 48, False),    # LZ4 compresses 48 KiB in less than a hop costs
    (Compression.LZ4, 96, True),     # above inline_bytes
    (Compression.NONE, 200, False),  # uncompressed: a copy and a CRC, on the loop
])
def test_where_a_transformed_batch_is_re_encoded(codec: Compression, count: int,
                                                 threaded: bool) -> None:
    data = build_batch(_records(count, 1024), compression=codec)
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS)  # the proxy's defaults

    async def transform() -> tuple[bool, bool, bytes]:
        lease = offload.lease()
        try:
            [decoded] = await lease.decode(data)
            decoded_on_loop = offload._pool is None
            records = tuple(r.with_value((r.value or b"").upper()) for r in decoded.records)
            piece = lease.start_encode(decoded.header, records, DEFAULT_LEVELS,
                                       decoded.block_size)
            out = piece if isinstance(piece, bytes) else await piece
            return decoded_on_loop, not isinstance(piece, bytes), out
        finally:
            lease.release()

    try:
        decoded_on_loop, on_thread, out = asyncio.run(transform())
    finally:
        offload.close()
    assert decoded_on_loop  # each compresses to well under inline_bytes
    assert on_thread is threaded
    [decoded] = decode_batches(data)
    assert out == encode_batch(decoded.header, tuple(
        r.with_value((r.value or b"").upper()) for r in decoded.records), levels=DEFAULT_LEVELS)
    assert offload.budget.used == 0


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_decode_threads_run_below_the_event_loop_thread() -> None:
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS)

    def own_nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    async def both() -> tuple[int, int]:
        return own_nice(), await offload.run(own_nice)

    try:
        loop_nice, worker_nice = asyncio.run(both())
    finally:
        offload.close()
    assert worker_nice == min(19, loop_nice + WORKER_NICE)
    assert WORKER_NICE > 0
