"""glibc's allocator tuned for the proxy's traffic: keep freed memory between requests.

:func:`keep_freed_memory` runs once, before the event loop starts; a no-op where
the C library is not glibc or with ``KIPROXY_KEEP_FREED_MEMORY=0``.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8


def keep_freed_memory() -> None:
    """Let glibc keep freed heap memory instead of returning it after every request,
    in one arena that ``malloc_trim(0)`` can give back whole.

    A produce request is typically a few hundred KiB to a few MiB; with glibc's
    defaults such blocks are mapped and unmapped (or the heap trimmed) per request,
    and every page of the next one is faulted in again: measured (bench/RESULTS.md,
    "Keeping freed memory"), ~440,000 minor faults and about 1 CPU s more per GB of
    records on every proxied path. Blocks up to 32 MiB now come from the heap, and up
    to 128 MiB of free heap is kept for reuse between requests; after a burst of large
    frames or decoded batches :class:`kiproxy.proxy.net.buffers.HeapTrimmer` gives it back
    with ``malloc_trim(0)``. Every thread allocates from the one main arena: the
    decode threads' own arenas would keep their free top (up to 64 MiB each) resident
    for good, since ``malloc_trim`` trims only the main arena's top and the trim
    threshold stops the threads' arenas from shrinking themselves; measured, this
    costs nothing on the bench. A no-op where the C library is not glibc, or with
    ``KIPROXY_KEEP_FREED_MEMORY=0`` in the environment (glibc's own tuning then
    applies, e.g. through ``GLIBC_TUNABLES``).
    """
    if os.environ.get("KIPROXY_KEEP_FREED_MEMORY", "1") == "0":
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_ARENA_MAX, 1)
    mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
    mallopt(_M_TRIM_THRESHOLD, 128 * 1024 * 1024)
