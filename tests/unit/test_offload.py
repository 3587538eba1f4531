"""Where a partition's batches are decoded: on the event loop or on a decode thread.

Small partitions and uncompressed ones up to ``inline_plain_bytes`` with at most
``inline_records`` records are decoded on the loop (no thread pool is ever started);
a compressed partition above ``inline_bytes``, and an uncompressed one with more
records or bytes than that, goes to a thread within the memory budget. A transformed
batch is re-compressed on the loop when its codec and level are known to re-encode it
within ``inline_encode_seconds`` of CPU (or it is small, or uncompressed), on a thread
otherwise.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression, CompressionLevels
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    Record,
    build_batch,
    decode_batches,
    encode_batch,
)
from kiproxy.proxy.produce.offload import ENCODE_FLOOR, WORKER_NICE, BatchOffload, EncodeCost


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


def _transform(offload: BatchOffload, data: bytes) -> tuple[bool, bytes]:
    """Decode ``data`` (one batch), upper-case its values and re-encode it through
    ``offload``: (whether the re-encoding ran on a thread, the batch it wrote)."""
    async def transform() -> tuple[bool, bytes]:
        lease = offload.lease()
        try:
            [decoded] = await lease.decode(data)
            records = tuple(r.with_value((r.value or b"").upper()) for r in decoded.records)
            piece = lease.start_encode(decoded.header, records, DEFAULT_LEVELS,
                                       decoded.block_size)
            out = piece if isinstance(piece, bytes) else await piece
            return not isinstance(piece, bytes), out
        finally:
            lease.release()

    return asyncio.run(transform())


def _upper_cased(data: bytes) -> bytes:
    [decoded] = decode_batches(data)
    return encode_batch(decoded.header, tuple(
        r.with_value((r.value or b"").upper()) for r in decoded.records), levels=DEFAULT_LEVELS)


@pytest.mark.parametrize("codec", [Compression.ZSTD, Compression.LZ4, Compression.GZIP,
                                   Compression.SNAPPY])
def test_a_codec_is_re_encoded_on_a_thread_until_its_cost_is_known(codec: Compression) -> None:
    data = build_batch(_records(48, 1024), compression=codec)  # 48 KiB decoded
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS, inline_bytes=1 << 20,
                           inline_encode_seconds=1.0)
    try:
        first, first_out = _transform(offload, data)
        learnt = offload.encode_cost.per_byte(codec, DEFAULT_LEVELS)
        second, second_out = _transform(offload, data)
    finally:
        offload.close()
    assert first  # not seen yet: on a thread, timed there
    assert learnt is not None and 0 < learnt * 48 * 1024 < 1.0
    assert not second  # known to take well under a second: on the loop
    assert first_out == second_out == _upper_cased(data)
    assert offload.budget.used == 0


@pytest.mark.parametrize(("codec", "count", "threaded"), [
    (Compression.ZSTD, 12, False),   # 12 KiB decoded: at most ENCODE_FLOOR, on the loop
    (Compression.ZSTD, 48, True),    # above it, with no CPU to spend on the loop
    (Compression.LZ4, 48, True),
    (Compression.NONE, 200, False),  # uncompressed: a copy and a CRC, on the loop
])
def test_with_no_time_to_spend_only_small_batches_stay_on_the_loop(
        codec: Compression, count: int, threaded: bool) -> None:
    data = build_batch(_records(count, 1024), compression=codec)
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS, inline_encode_seconds=0.0)
    try:
        for _ in range(2):  # learning the cost changes nothing at a budget of 0
            on_thread, out = _transform(offload, data)
            assert on_thread is threaded
            assert out == _upper_cased(data)
    finally:
        offload.close()


def test_encode_cost_is_learnt_per_codec_and_level() -> None:
    cost = EncodeCost(budget=0.001, weight=0.5)
    zstd, fast = Compression.ZSTD, CompressionLevels(zstd=1)
    assert cost.inline(zstd, DEFAULT_LEVELS, ENCODE_FLOOR)  # small: always on the loop
    assert not cost.inline(zstd, DEFAULT_LEVELS, ENCODE_FLOOR + 1)  # not seen yet
    cost.observe(zstd, DEFAULT_LEVELS, 100_000, 0.0005)  # 5 ns a byte
    assert cost.per_byte(zstd, DEFAULT_LEVELS) == pytest.approx(5e-9)
    assert cost.inline(zstd, DEFAULT_LEVELS, 200_000)  # 1 ms: within the budget
    assert not cost.inline(zstd, DEFAULT_LEVELS, 200_001)
    cost.observe(zstd, DEFAULT_LEVELS, 100_000, 0.0015)  # 15 ns: the average moves half way
    assert cost.per_byte(zstd, DEFAULT_LEVELS) == pytest.approx(10e-9)
    assert not cost.inline(zstd, DEFAULT_LEVELS, 200_000)
    cost.observe(zstd, DEFAULT_LEVELS, ENCODE_FLOOR, 1.0)  # too small to learn from
    assert cost.per_byte(zstd, DEFAULT_LEVELS) == pytest.approx(10e-9)
    assert cost.per_byte(zstd, fast) is None  # another level: its own estimate
    assert cost.per_byte(Compression.LZ4, DEFAULT_LEVELS) is None


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
