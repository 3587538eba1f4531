"""When the heap trimmer gives memory back (kiproxy.proxy.net.buffers.HeapTrimmer)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kiproxy.proxy.net.buffers import TRIM_FREE_BYTES, HeapTrimmer

MiB = 1024 * 1024


def _trimmer(free: int | None) -> tuple[HeapTrimmer, list[int]]:
    """A trimmer whose allocator reports ``free`` bytes free and records its trims."""
    trimmer = HeapTrimmer(lambda: 0)
    calls: list[int] = []

    def trim(pad: int) -> int:
        calls.append(pad)
        return 1

    trimmer._trim = trim
    trimmer.free_heap_bytes = lambda: free  # type: ignore[method-assign]
    return trimmer, calls


glibc = pytest.mark.skipif(HeapTrimmer(lambda: 0).free_heap_bytes() is None,
                           reason="the C library has no mallinfo2 (glibc 2.33+ only)")


def test_a_heap_with_little_free_is_left_alone() -> None:
    # Steady load: requests' buffers come and go, a few MiB are free at any time.
    trimmer, calls = _trimmer(TRIM_FREE_BYTES - 1)
    assert trimmer.trim_if_worth_it() is False
    assert calls == []
    assert (trimmer.trims, trimmer.skipped) == (0, 1)


def test_a_heap_left_large_by_a_burst_is_trimmed() -> None:
    trimmer, calls = _trimmer(200 * MiB)
    assert trimmer.trim_if_worth_it() is True
    assert calls == [0]
    assert (trimmer.trims, trimmer.skipped) == (1, 0)


def test_where_the_free_heap_is_unknown_it_trims_as_before() -> None:
    trimmer, calls = _trimmer(None)
    assert trimmer.trim_if_worth_it() is True
    assert calls == [0]


# In a fresh interpreter (a test process's heap may already hold any amount free, and
# new blocks would come out of it): 8,192 blocks of 4 KiB (below glibc's mmap threshold),
# then every other one freed, 16 MiB of holes the allocator keeps and cannot give back
# at the top (the last block stays).
_PROBE = textwrap.dedent("""
    import json
    from kiproxy.proxy.net.buffers import HeapTrimmer
    trimmer = HeapTrimmer(lambda: 0)
    blocks = [bytearray(4096) for _ in range(8192)]
    allocated = trimmer.free_heap_bytes()
    del blocks[::2]
    print(json.dumps([allocated, trimmer.free_heap_bytes()]))
""")


@glibc
def test_free_heap_is_what_glibc_holds_free() -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                         check=True, timeout=60)
    allocated, freed = json.loads(out.stdout)
    assert allocated >= 0
    assert freed - allocated >= 12 * MiB
