"""Where a partition's batches are decoded: on the event loop or on a decode thread.

Small partitions and uncompressed ones up to ``inline_plain_bytes`` with at most
``inline_records`` records are decoded on the loop (no thread pool is ever started);
a compressed partition above ``inline_bytes``, and an uncompressed one with more
records or bytes than that, goes to a thread within the memory budget.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kiproxy.protocol.compression import Compression
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    Record,
    build_batch,
    decode_batches,
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
