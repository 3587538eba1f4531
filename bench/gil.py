"""Which codec calls release the GIL: a Python thread's progress while the main thread
compresses or decompresses.

Run from the repository root with the project's virtualenv::

    python -m bench.gil

A spinner thread counts loop iterations while the main thread calls one codec
function on a 600 KB records-like block again and again for ``--seconds``. A call
that releases the GIL leaves the spinner running at about its idle rate (it has a
core of its own); a call that holds it stops the spinner for as long as it runs.
That is what matters on a decode thread: a codec call that holds the GIL stalls
the event loop, and with it every connection, for as long as it takes. Pure Python
code (sharing the GIL, switching every 0.5 ms) shows what "held" looks like.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import zlib
from collections.abc import Callable

import cramjam
import lz4.frame
import zstandard

from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression, compress, decompress


def _block(size: int = 600_000) -> bytes:
    rng = random.Random(1)
    words = [b"order", b"payment", b"status", b"lisbon", b"sku", b"x"]
    text = b" ".join(rng.choice(words) + str(rng.randrange(10**6)).encode()
                     for _ in range(size // 8))
    return text[:size]


def spinner_rate(call: Callable[[], object], seconds: float) -> tuple[float, float]:
    """(spinner iterations per ms, ms per call) while ``call`` runs in a loop."""
    stop = [False]
    count = [0]

    def spin() -> None:
        n = 0
        while not stop[0]:
            n += 1
        count[0] = n

    thread = threading.Thread(target=spin)
    thread.start()
    started = time.perf_counter()
    calls = 0
    while time.perf_counter() - started < seconds:
        call()
        calls += 1
    elapsed = time.perf_counter() - started
    stop[0] = True
    thread.join()
    return count[0] / elapsed / 1000, elapsed / calls * 1000


def main() -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5)
    args = parser.parse_args()
    # A thread that wants the GIL back gets it within 0.5 ms (default 5 ms), so the
    # time per call stays close to the call's own.
    sys.setswitchinterval(0.0005)
    data = _block()
    lz4_frame = compress(Compression.LZ4, data, DEFAULT_LEVELS)
    zstd_frame = bytes(cramjam.zstd.compress(data, level=3))
    gzip_data = bytes(cramjam.gzip.compress(data, level=6))
    snappy_raw = bytes(cramjam.snappy.compress_raw(data))

    def cramjam_lz4() -> bytes:
        compressor = cramjam.lz4.Compressor(level=1, content_checksum=False,
                                            block_linked=False)
        compressor.compress(data)
        return bytes(compressor.finish())

    calls: list[tuple[str, Callable[[], object]]] = [
        ("idle (time.sleep(0.001))", lambda: time.sleep(0.001)),
        ("pure Python (sum(range(20000)))", lambda: sum(range(20_000))),
        ("kiproxy compress lz4", lambda: compress(Compression.LZ4, data, DEFAULT_LEVELS)),
        ("kiproxy compress zstd", lambda: compress(Compression.ZSTD, data, DEFAULT_LEVELS)),
        ("kiproxy compress gzip", lambda: compress(Compression.GZIP, data, DEFAULT_LEVELS)),
        ("kiproxy compress snappy", lambda: compress(Compression.SNAPPY, data, DEFAULT_LEVELS)),
        ("cramjam.lz4.Compressor (before)", cramjam_lz4),
        ("kiproxy decompress lz4",
         lambda: decompress(Compression.LZ4, lz4_frame, 32 << 20)),
        ("cramjam.lz4.decompress", lambda: cramjam.lz4.decompress(lz4_frame)),
        ("lz4.frame.decompress", lambda: lz4.frame.decompress(lz4_frame)),
        ("cramjam.zstd.decompress", lambda: cramjam.zstd.decompress(zstd_frame)),
        ("zstandard decompress", lambda: zstandard.ZstdDecompressor().decompress(zstd_frame)),
        ("cramjam.gzip.decompress", lambda: cramjam.gzip.decompress(gzip_data)),
        ("zlib.decompress", lambda: zlib.decompress(gzip_data, 31)),
        ("cramjam.snappy.decompress_raw", lambda: cramjam.snappy.decompress_raw(snappy_raw)),
    ]
    print("| call (600 KB block) | spinner k-iterations/ms | ms per call |")
    print("|---|---:|---:|")
    for name, call in calls:
        rate, per_call = spinner_rate(call, args.seconds)
        print(f"| {name} | {rate:,.0f} | {per_call:.3f} |")


if __name__ == "__main__":
    main()
