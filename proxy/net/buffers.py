"""Memory held for clients: a global limit on bytes buffered from them, and giving
freed heap memory back to the system.

Contract:

* Per connection, a partial frame holds in memory at most what the client has sent
  of it (a frame of up to 1 MiB in one buffer allocated on its length prefix, whose
  pages are faulted in only as bytes arrive; a larger one in buffers that grow with
  the arriving bytes, never with the claimed length) and never more than
  ``max_frame_size``: a longer frame closes the client and counts as a
  ``max_frame_size`` limit hit.
* Across connections, :class:`ReceiveBudget` (``max_client_buffered_bytes``) bounds
  the bytes of partial frames held. Past it, a connection that keeps receiving is
  paused (its socket is not read; TCP pushes back) unless it holds more than every
  other connection still reading: that one keeps reading, completes its frame and
  frees room, so the process always makes progress, and the bytes held stay within
  the limit plus that one frame however many clients send at the same pace. Paused
  connections resume, oldest first, once the total is back under the limit. Every
  pause counts as a ``max_client_buffered_bytes`` limit hit, and one WARNING per
  interval says how full the budget is and who holds it (the rest counted).
* :class:`HeapTrimmer` returns freed heap memory to the system with glibc's
  ``malloc_trim(0)``, on a worker thread, after large frames or decoded batches
  are released and the heap holds at least :data:`TRIM_FREE_BYTES` free
  (``kiproxy.proxy.malloc`` lets glibc keep freed memory between requests for speed,
  in the one main arena so that this trim reaches all of it; without trimming, the
  heap of a burst stays resident for good). Under steady load the heap's free part
  is a few MiB and no trim runs: a trim holds the allocator's lock, so every thread
  that allocates meanwhile waits (0.1-3 ms a trim, measured), and the pages it gives
  back are faulted in again by the next requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
from collections.abc import Callable
from typing import Protocol

from kiproxy.protocol.log_limit import MORE_LIKE_IT, RateLimitedLog

__all__ = ["TRIM_FREE_BYTES", "HeapTrimmer", "ReceiveBudget", "Receiver"]

log = logging.getLogger("kiproxy.memory")
_pauses = RateLimitedLog(log)

TRIM_AFTER_BYTES = 8 * 1024 * 1024
"""Released bytes (large frames, decoded batches) after which the heap is trimmed."""
_LARGE = 64 * 1024  # frames at least this large have buffers of their own
TRIM_INTERVAL = 1.0
"""Seconds between checks; a trim runs at most this often."""
TRIM_FREE_BYTES = 16 * 1024 * 1024
"""Free heap bytes (glibc ``mallinfo2``: free chunks and the top) below which a trim
would give back too little to be worth its pause."""


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


class Receiver(Protocol):
    """A socket reader the budget can hold back (a :class:`FrameStream`)."""

    def hold_back(self) -> None:
        """Stop reading the socket until :meth:`let_go`."""

    def let_go(self) -> None:
        """Read the socket again if its owner wants to."""


class ReceiveBudget:
    """Bytes of partial client frames held across every connection of the process."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        """``max_client_buffered_bytes``."""
        self.used = 0
        """Bytes of partial frames held now."""
        self.released = 0
        """Bytes given back by frames of 64 KiB or more (read by :class:`HeapTrimmer`)."""
        self.pauses = 0
        """Connections paused because the total passed the capacity."""
        self.frames_too_large = 0
        """Connections closed for a frame above ``max_frame_size``."""
        self._held: dict[Receiver, int] = {}
        self._paused: dict[Receiver, None] = {}  # insertion order: oldest first

    def update(self, receiver: Receiver, held: int) -> None:
        """``receiver`` now holds ``held`` bytes of a partial frame; pause it if the
        total is over the capacity and it is not the largest holder."""
        before = self._held.pop(receiver, 0)
        if held:
            self._held[receiver] = held
        self.used += held - before
        if before - held >= _LARGE:
            self.released += before - held
        if held > before and self.used > self.capacity and receiver not in self._paused:
            paused = self._paused
            # Only one reads on past the capacity: the largest holder still reading. One
            # that grows to a size another reader holds already waits (a tie would let
            # every client sending at the same pace read on).
            if any(h >= held for r, h in self._held.items()
                   if r is not receiver and r not in paused):
                paused[receiver] = None
                self.pauses += 1
                receiver.hold_back()
                self._warn_paused()
        elif held < before:
            self._resume()

    def _warn_paused(self) -> None:
        held = self._held
        _pauses.warning(
            "paused", "client reads paused: partial request frames hold %d bytes on %d "
            "connections, over max_client_buffered_bytes (%d); paused now: %d; the largest "
            "holder (%d bytes) reads on. A client stalled mid-frame keeps its share until it "
            "sends the rest or idle_timeout_ms closes it", self.used, len(held),
            self.capacity, len(self._paused), max(held.values(), default=0),
            more=MORE_LIKE_IT)

    def refused_frame(self) -> None:
        """Count a connection closed for a frame above ``max_frame_size``."""
        self.frames_too_large += 1

    def forget(self, receiver: Receiver) -> None:
        """The connection is gone: drop what it held."""
        self._paused.pop(receiver, None)
        self.update(receiver, 0)

    def _resume(self) -> None:
        while self._paused and self.used <= self.capacity:
            receiver = next(iter(self._paused))
            del self._paused[receiver]
            receiver.let_go()
        if self._paused and self._held and not any(
                r not in self._paused for r in self._held):
            # Everyone holding bytes is paused: let the largest finish its frame.
            largest = max(self._paused, key=lambda r: self._held.get(r, 0))
            del self._paused[largest]
            largest.let_go()


class HeapTrimmer:
    """Calls ``malloc_trim(0)`` after enough memory was released, when enough of the heap
    is free (glibc only)."""

    def __init__(self, released: Callable[[], int]) -> None:
        self._released = released
        self._seen = 0
        self.trims = 0
        """Trims run so far."""
        self.skipped = 0
        """Checks that found too little free heap to trim."""
        self._trim: Callable[[int], int] | None = None
        self._mallinfo2: Callable[[], _MallInfo2] | None = None
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL("libc.so.6")
            self._trim = libc.malloc_trim
            with contextlib.suppress(AttributeError):  # glibc 2.33+
                mallinfo2 = libc.mallinfo2
                mallinfo2.restype = _MallInfo2
                self._mallinfo2 = mallinfo2

    @property
    def available(self) -> bool:
        """Whether the C library has ``malloc_trim``."""
        return self._trim is not None

    def free_heap_bytes(self) -> int | None:
        """Free bytes the allocator holds (``None`` where glibc cannot say)."""
        if self._mallinfo2 is None:
            return None
        return int(self._mallinfo2().fordblks)

    def trim_if_worth_it(self) -> bool:
        """``malloc_trim(0)`` if the heap holds :data:`TRIM_FREE_BYTES` free (or glibc
        cannot say); whether it ran. Blocks: call it off the event loop."""
        if self._trim is None:
            return False
        free = self.free_heap_bytes()
        if free is not None and free < TRIM_FREE_BYTES:
            self.skipped += 1
            return False
        self.trims += 1
        self._trim(0)
        return True

    async def run(self) -> None:
        """Check every :data:`TRIM_INTERVAL` seconds until cancelled."""
        if self._trim is None:
            return
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(TRIM_INTERVAL)
            released = self._released()
            if released - self._seen >= TRIM_AFTER_BYTES:
                self._seen = released
                await loop.run_in_executor(None, self.trim_if_worth_it)
