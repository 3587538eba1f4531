"""Decoding record batches off the event loop, within a process-wide memory budget.

Contract:

* A partition's ``records`` bytes of at most ``inline_bytes`` are decoded on the event
  loop with each records block's output capped at ``inline_output_bytes``: ordinary
  batches never pay for a thread hop. Uncompressed records of at most
  ``inline_plain_bytes`` holding at most ``inline_records`` records (as their batch
  headers declare) are decoded on the loop too: decoding them is a validity pass and
  one small object per record (fields are built when read), cheaper than the hop.
* Anything larger, and a small block that decompresses past the inline cap, is decoded
  on a worker thread of :class:`BatchOffload` after its worst case (stored bytes plus
  each block's decompression bound) is reserved from :class:`MemoryBudget`
  (``max_decode_memory``). Concurrent bombs therefore queue against the budget
  instead of multiplying memory, and a connection waiting for the budget reads
  nothing more (its requests are handled one at a time), so only it slows down.
* Once decoded, the reservation shrinks to what the batches hold and stays until the
  partition is done (interceptor, re-encoding): :meth:`DecodeLease.release`.
  A reservation above the whole budget is cut to the budget: it waits to run alone.
* Re-encoding a transformed batch runs on the loop when it is expected to take at
  most ``inline_encode_seconds`` of CPU (1 ms), and on the same threads otherwise.
  The expectation is :class:`EncodeCost`'s: per codec and level, the CPU seconds a
  decoded byte took to re-encode in the batches seen so far (on the loop or on a
  thread). A codec and level not yet seen is compressed on a thread; a batch of at
  most 16 KiB decoded (:data:`ENCODE_FLOOR`), and an uncompressed one of at most
  ``inline_plain_bytes`` (a copy and a CRC), always on the loop. A threaded encode
  need not be awaited at once (:meth:`DecodeLease.start_encode`): a request's next
  partition is decoded and intercepted while the previous one compresses.
* Order is untouched: a connection awaits its own decode before it handles anything
  else, exactly as it awaits the interceptor.

The decompressors (cramjam, zlib, python-lz4, python-zstandard) release the GIL; the
record decoder holds it, in slices of the interpreter's switch interval, so the
event loop keeps turning while a large batch is decoded. The worker threads run at a
lower scheduling priority than the event loop's thread (Linux: a thread's own nice
value, :data:`WORKER_NICE` above the process's), so when the cores are busy the
kernel runs the loop, which serves every connection, before one connection's large
batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kiproxy.protocol.compression import Compression, CompressionLevels, DecompressionLimits
from kiproxy.protocol.errors import DecompressionLimitExceeded
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.protocol.records import (
    DecodedBatch,
    Record,
    RecordBatchHeader,
    decode_batches,
    decompress_block,
    encode_batch,
)
from kiproxy.proxy.config.model import DEFAULT_INLINE_ENCODE_SECONDS

__all__ = ["BatchOffload", "DecodeLease", "EncodeCost", "MemoryBudget"]

log = logging.getLogger("kiproxy.offload")

_T = TypeVar("_T")

DEFAULT_INLINE_BYTES = 64 * 1024
"""Records bytes decoded on the loop (measured in bench/bombs.py: below this a thread
hop costs more than the decode)."""
DEFAULT_INLINE_OUTPUT_BYTES = 1024 * 1024
"""Decompressed bytes a block may produce on the loop before it moves to a thread."""
DEFAULT_INLINE_PLAIN_BYTES = 1024 * 1024
"""Uncompressed records bytes decoded on the loop (bench/intercept.py: a hop to a thread
cost more CPU than decoding 1 MiB of records, about 0.15 ms)."""
ENCODE_FLOOR = 16 * 1024
"""Decoded bytes up to which a transformed batch is always re-encoded on the loop (and
its cost not learnt from: a compressor's set-up dominates there)."""
DEFAULT_INLINE_RECORDS = 4096
"""Records an uncompressed partition decoded on the loop may declare (bounds the
objects and time of one inline decode)."""
DEFAULT_MAX_DECODE_MEMORY = 256 * 1024 * 1024
"""Process-wide bytes of batches being decoded or held decoded (``max_decode_memory``)."""
WORKER_NICE = 5
"""How much lower the worker threads' priority is than the event loop's (nice steps)."""
_RECORD_OVERHEAD = 160
"""Bytes a decoded Record object costs beyond its key and value (measured, CPython 3.11)."""


def _lower_priority() -> None:
    """Make the calling thread yield to the event loop's thread (Linux; elsewhere, and
    where the process may not change it, the thread keeps the process's priority)."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(19, os.getpriority(os.PRIO_PROCESS, tid) + WORKER_NICE))


class MemoryBudget:
    """Bytes shared by every connection; waiters are served first come, first served."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        """The budget, in bytes."""
        self.used = 0
        """Bytes reserved now."""
        self.waits = 0
        """Reservations that had to wait (each is a limit hit)."""
        self.released = 0
        """Bytes given back by reservations of 1 MiB or more (read by the heap trimmer)."""
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    async def acquire(self, nbytes: int) -> int:
        """Reserve ``nbytes`` (cut to the capacity), waiting for room; return what was
        reserved, to be given back with :meth:`release`."""
        nbytes = min(nbytes, self.capacity)
        if not self._waiters and self.used + nbytes <= self.capacity:
            self.used += nbytes
            return nbytes
        self.waits += 1
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)  # granted just as it was cancelled
            else:
                self._waiters.remove(entry)
                self._grant()
            raise
        return nbytes

    def try_acquire(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` now when there is room and nobody waits (True), else
        reserve nothing (False)."""
        if self._waiters or self.used + nbytes > self.capacity:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` of a reservation."""
        self.used -= nbytes
        if nbytes >= 1024 * 1024:
            self.released += nbytes
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.capacity:
            nbytes, waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self.used += nbytes
            waiter.set_result(None)


class BatchOffload:
    """Where and within what memory a partition's batches are decoded and re-encoded."""

    def __init__(self, limits: DecompressionLimits, *,
                 max_decode_memory: int = DEFAULT_MAX_DECODE_MEMORY,
                 inline_bytes: int = DEFAULT_INLINE_BYTES,
                 inline_output_bytes: int = DEFAULT_INLINE_OUTPUT_BYTES,
                 inline_plain_bytes: int = DEFAULT_INLINE_PLAIN_BYTES,
                 inline_records: int = DEFAULT_INLINE_RECORDS,
                 inline_encode_seconds: float = DEFAULT_INLINE_ENCODE_SECONDS,
                 threads: int | None = None) -> None:
        self.limits = limits
        """Decompression bounds of every records block."""
        self.budget = MemoryBudget(max_decode_memory)
        """The process-wide budget of decoded data."""
        self.inline_bytes = inline_bytes
        """Partitions of at most this many records bytes are tried on the loop."""
        self.inline_plain_bytes = inline_plain_bytes
        """Uncompressed partitions of at most this many bytes are decoded on the loop..."""
        self.inline_records = inline_records
        """...when their batches declare at most this many records in all."""
        self.inline_limits = DecompressionLimits(
            max_bytes=min(limits.max_bytes, inline_output_bytes), max_ratio=limits.max_ratio)
        """The bounds of an inline attempt: past them the block moves to a thread."""
        self.encode_cost = EncodeCost(inline_encode_seconds,
                                      plain_bytes=max(inline_bytes, inline_plain_bytes))
        """What re-encoding costs, learnt per codec and level; decides where it runs."""
        self.threads = threads or min(4, os.cpu_count() or 1)
        """Worker threads decoding and encoding large batches."""
        self._pool: ThreadPoolExecutor | None = None

    def lease(self) -> DecodeLease:
        """A lease for one partition; release it when the partition is done."""
        return DecodeLease(self)

    async def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` on a worker thread."""
        return await self.submit(fn, *args, **kwargs)

    def submit(self, fn: Any, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        """Start ``fn(*args, **kwargs)`` on a worker thread; its result, to be awaited."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kiproxy-decode",
                                            initializer=_lower_priority)
        loop = asyncio.get_running_loop()
        return loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def decodes_inline(self, batches: PartitionBatches) -> bool:
        """Whether a partition is decoded on the loop, from its headers alone (else on a
        worker thread, once :meth:`reservation` is reserved)."""
        size = batches.end - batches.start
        return size <= self.inline_bytes or (
            size <= self.inline_plain_bytes and batches.error is None  # unreadable: as ever
            and batches.records <= self.inline_records and not batches.compressed_blocks)

    def reservation(self, batches: PartitionBatches) -> int:
        """The bytes a thread's decode of a partition reserves from the budget: its size
        plus each compressed block's bound (asked only when a thread decodes it, so a
        partition decoded on the loop never computes a bound)."""
        size = batches.end - batches.start
        blocks = batches.compressed_blocks
        if not blocks:
            return size
        bound = self.limits.bound
        return size + sum(bound(block)[0] for block in blocks)

    def close(self) -> None:
        """Stop the worker threads (after the work they hold)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


class EncodeCost:
    """Where a transformed batch is re-encoded: the CPU seconds per decoded byte each
    codec and level took, learnt from the batches re-encoded so far."""

    def __init__(self, budget: float, *, plain_bytes: int = DEFAULT_INLINE_PLAIN_BYTES,
                 weight: float = 0.25) -> None:
        self.budget = budget
        """CPU seconds a batch may be expected to take to be re-encoded on the loop."""
        self.plain_bytes = plain_bytes
        """Uncompressed batches of at most this many bytes are re-encoded on the loop (a
        copy and a CRC; nothing to learn)."""
        self.weight = weight
        """How much each new batch moves the estimate (an exponential moving average)."""
        self._per_byte: dict[tuple[int, CompressionLevels], float] = {}

    def per_byte(self, codec: int, levels: CompressionLevels) -> float | None:
        """The estimate for ``codec`` at ``levels`` (seconds per decoded byte), or None."""
        return self._per_byte.get((codec, levels))

    def inline(self, codec: int, levels: CompressionLevels, size: int) -> bool:
        """Whether a batch of ``size`` decoded bytes is re-encoded on the loop."""
        if codec == Compression.NONE:
            return size <= self.plain_bytes
        if size <= ENCODE_FLOOR:
            return True
        per_byte = self._per_byte.get((codec, levels))
        return per_byte is not None and size * per_byte <= self.budget

    def observe(self, codec: int, levels: CompressionLevels, size: int,
                seconds: float) -> None:
        """Learn from one batch of ``size`` decoded bytes that took ``seconds`` of CPU."""
        if not _learns(codec, size):
            return
        key = (codec, levels)
        seen = seconds / size
        old = self._per_byte.get(key)
        self._per_byte[key] = seen if old is None else old + self.weight * (seen - old)

    def encode(self, header: RecordBatchHeader, records: tuple[Record, ...],
               levels: CompressionLevels, size: int) -> bytes:
        """:func:`~kiproxy.protocol.records.encode_batch` (renumbered), timed in the
        calling thread's CPU time and learnt from when it can be (no clock read for the
        small and uncompressed batches most requests hold)."""
        codec = header.attributes & 0x07
        if not _learns(codec, size):
            return encode_batch(header, records, renumber=True, levels=levels)
        started = time.thread_time()
        out = encode_batch(header, records, renumber=True, levels=levels)
        self.observe(codec, levels, size, time.thread_time() - started)
        return out


def _learns(codec: int, size: int) -> bool:
    """Whether re-encoding a batch of ``codec`` and ``size`` decoded bytes says anything
    about the codec's cost (not below the floor, not uncompressed)."""
    return size > ENCODE_FLOOR and codec != Compression.NONE


class DecodeLease:
    """One partition's share of the budget, from decode to release."""

    __slots__ = ("_held", "_kept", "_offload")

    def __init__(self, offload: BatchOffload) -> None:
        self._offload = offload
        self._held = 0
        self._kept = 0

    async def decode(self, data: bytes, batches: PartitionBatches | None = None
                     ) -> list[DecodedBatch]:
        """Decode every batch of a partition's ``records`` in ``data``: where ``batches``
        (its headers, read once) says they lie, or all of ``data``
        (:meth:`decode_partition`).
        """
        return await self.decode_partition(
            data, PartitionBatches.read(data) if batches is None else batches)

    async def decode_partition(self, data: bytes, batches: PartitionBatches
                               ) -> list[DecodedBatch]:
        """Decode the batches ``batches`` (a partition's headers, read once) says lie in
        ``data``, where :meth:`BatchOffload.decodes_inline` puts them (see the module
        contract): one call into :func:`~kiproxy.protocol.records.decode_batches`, on
        the loop or on a worker thread once the worst case
        (:meth:`BatchOffload.reservation`) is reserved; a small block that decompresses
        past the inline cap is decoded again on a thread.

        Raises what :func:`~kiproxy.protocol.records.decode_batches` raises.
        """
        offload = self._offload
        if offload.decodes_inline(batches):  # no await on the loop's path: most end here
            try:
                return decode_batches(data, batches.start, batches.end,
                                      limits=offload.inline_limits, headers=batches.headers)
            except DecompressionLimitExceeded as exc:
                self._past_inline_cap(exc)
        decoded = await self._threaded(batches, decode_batches, data, batches.start,
                                       batches.end, headers=batches.headers)
        self._shrink(batches.size + sum(b.block_size + _RECORD_OVERHEAD * len(b.records)
                                        for b in decoded))
        return decoded

    async def decompress(self, data: bytes, batches: PartitionBatches) -> bytes:
        """The records block of the one compressed batch ``batches`` names in ``data``,
        decompressed (:func:`~kiproxy.protocol.records.decompress_block`: CRC checked, no
        record decoded), where :meth:`decode_partition` would decode it and within the
        same budget; the reservation then shrinks to the batch and its block.

        Raises what :func:`~kiproxy.protocol.records.decompress_block` raises.
        """
        on_loop = self._on_loop(data, batches)
        if on_loop is not None:
            return on_loop
        block = await self._threaded(batches, decompress_block, data, batches.start,
                                     batches.headers[0], origin=batches.start)
        self._shrink(batches.size + len(block))
        return block

    def _on_loop(self, data: bytes, batches: PartitionBatches) -> bytes | None:
        """The block of the one compressed batch ``batches`` names, decompressed on the
        loop when it is small enough and within the loop's cap; else None (a worker
        thread must). Raises what ``decompress_block`` raises for the real bounds."""
        offload = self._offload
        if not offload.decodes_inline(batches):
            return None
        try:
            return decompress_block(data, batches.start, batches.headers[0],
                                    origin=batches.start, limits=offload.inline_limits)
        except DecompressionLimitExceeded as exc:
            self._past_inline_cap(exc)
            return None

    def _past_inline_cap(self, exc: DecompressionLimitExceeded) -> None:
        """Return when work on the loop passed only the inline cap (it runs again on a
        thread, within the real bounds: :meth:`_threaded`); else raise ``exc``."""
        if not (exc.setting == "max_decompressed_batch_bytes"
                and exc.limit < self._offload.limits.max_bytes):
            raise exc  # the real bound, not the inline one

    async def _threaded(self, batches: PartitionBatches, fn: Callable[..., _T], *args: Any,
                        **kwargs: Any) -> _T:
        """``fn(*args, limits=..., **kwargs)`` on a worker thread within the real limits,
        once the worst case (:meth:`BatchOffload.reservation`, cut to the capacity) is
        reserved (held until :meth:`_shrink` or :meth:`release`).

        What the lease holds already counts towards it. A lease never waits while it
        holds anything: when the rest is not there now, what it holds is given back
        first and the whole reservation waited for. The fetch path decodes a
        partition's batches one at a time, so what a lease holds then is the batch
        before, done with; and a lease that waited holding it could wait for ever
        behind one that waits for it (the budget serves its waiters in order)."""
        offload = self._offload
        budget = offload.budget
        want = min(offload.reservation(batches), budget.capacity)
        if want > self._held:
            if budget.try_acquire(want - self._held):
                self._held = want
            else:
                if self._held:
                    budget.release(self._held)
                    self._held = 0
                self._held = await budget.acquire(want)
        result: _T = await offload.run(fn, *args, limits=offload.limits, **kwargs)
        return result

    def _shrink(self, used: int) -> None:
        """Cut the reservation down to ``used``, what the decoded batches hold."""
        if used < self._held:
            self._offload.budget.release(self._held - used)
            self._held = used

    def start_encode(self, header: RecordBatchHeader, records: tuple[Record, ...],
                     levels: CompressionLevels, size_hint: int) -> bytes | asyncio.Future[bytes]:
        """:func:`~kiproxy.protocol.records.encode_batch`: the bytes when the batch is
        re-encoded on the loop (the module contract; ``size_hint`` is its decoded
        size), else a worker thread's future, which the caller awaits when it
        needs the bytes (the loop goes on meanwhile, e.g. with the request's next
        partition). Raises what ``encode_batch`` raises on the loop; the future holds
        what it raises on a thread."""
        cost = self._offload.encode_cost
        if cost.inline(header.attributes & 0x07, levels, size_hint):
            return cost.encode(header, records, levels, size_hint)
        return self._offload.submit(cost.encode, header, records, levels, size_hint)

    async def decompress_held(self, data: bytes, batches: PartitionBatches) -> bytes | None:
        """:meth:`decompress` without waiting for the budget: the block, held (reserved
        until :meth:`release_kept` or :meth:`release`), when the budget has room now -
        for the block itself when it is decompressed on the loop, for the worst case
        (:meth:`BatchOffload.reservation`) while a worker thread decompresses it - else
        None, nothing reserved (the caller then takes :meth:`decompress`). Raises what
        :func:`~kiproxy.protocol.records.decompress_block` raises for the real bounds."""
        offload = self._offload
        budget = offload.budget
        (header,) = batches.headers
        block = self._on_loop(data, batches)
        if block is not None:
            if not budget.try_acquire(len(block)):
                return None
            self._kept += len(block)
            return block
        reserved = min(offload.reservation(batches), budget.capacity)
        if not budget.try_acquire(reserved):
            return None
        try:
            threaded: bytes = await offload.run(decompress_block, data, batches.start,
                                                header, origin=batches.start,
                                                limits=offload.limits)
        except BaseException:
            budget.release(reserved)
            raise
        held = min(len(threaded), reserved)
        budget.release(reserved - held)  # the worst case, cut to the block
        self._kept += held
        return threaded

    def release_kept(self) -> None:
        """Give back what :meth:`decompress_held` reserved."""
        if self._kept:
            self._offload.budget.release(self._kept)
            self._kept = 0

    def release(self) -> None:
        """Give the partition's reservation back."""
        if self._held or self._kept:
            self._offload.budget.release(self._held + self._kept)
            self._held = self._kept = 0
