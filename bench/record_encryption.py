"""The ``record_encryption`` built-in on both hooks: CPU per GB against re-encoding alone.

Run from the repository root with the project's virtualenv::

    python -m bench.record_encryption            # writes bench/RESULTS.md
    python -m bench.record_encryption --no-write # print only

What one partition's batch costs the proxy, in process, no sockets: the batch as a
producer sends it (JSON-looking values of 100 B or 1 KiB, 16-byte keys, one header,
about 64 KiB of values per batch, codec none or zstd) is decoded
(``decode_batch``), handed to the hook, and the answer encoded again (``encode_batch``
with the batch's codec), as the proxy does with a changed batch:

* **produce, passthrough**: decode, then encode the same records (the cost of any
  transforming plugin before it does anything: the baseline);
* **produce, encrypt**: decode, ``RecordEncryption.intercept``, encode;
* **fetch, passthrough**: the stored (encrypted) batch decoded and encoded again;
* **fetch, decrypt**: as the proxy runs the hook: the batch's records block (where it
  lies, its CRC checked, when uncompressed; decompressed when compressed; not decoded)
  to ``on_consume_block`` (which opens this batch, every value sealed
  under one data key, as its records block) and the batch written around the new
  block (``on_consume`` and ``encode_batch`` for a batch it hands back);
* **fetch, plaintext batch**: a batch without sealed records handed to
  ``on_consume_block`` the same way, which returns its block unchanged (the proxy then
  forwards its bytes).

Data keys come from a key file and are cached after the first batch, so no KMS call
is measured (rotation makes one call per ``max_encryptions_per_key`` sealed values).
CPU time is ``time.process_time`` on one thread: each cell is the median of five
repeats of about ``--target`` seconds, the cases interleaved; "x passthrough" divides by
the same hook's passthrough measured in the same run. GB are of values (10^9 bytes).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.results import write_results
from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    Header,
    Record,
    RecordBatch,
)
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file
from kiproxy.interceptors.testing import load, make_context
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    Compression,
    RecordBatchHeader,
    build_batch,
    decode_batch,
    decompress_block,
    encode_batch,
    encode_block_parts,
    verify_batch_crc,
)

__all__ = ["main"]

SIZES = (100, 1024)
CODECS = {"none": Compression.NONE, "zstd": Compression.ZSTD}
BATCH_VALUE_BYTES = 64 * 1024
WORDS = (b"order", b"shipped", b"customer", b"amount", b"currency", b"warehouse", b"note")


def _value(i: int, size: int) -> bytes:
    head = b'{"id":%d,"kind":"%s","note":"' % (i, WORDS[i % len(WORDS)])
    words, n = b"", i
    while len(head) + len(words) + 2 < size:
        words += WORDS[n % len(WORDS)] + b" "
        n = n * 7 + 3
    return (head + words)[:size - 2] + b'"}'


def _cpu_s(loop: asyncio.AbstractEventLoop, op: Callable[[], Awaitable[Any]],
           target: float) -> float:
    """CPU seconds of one ``await op()``, timed over enough calls to take ``target``
    seconds, all awaited in one coroutine (as the proxy awaits a hook in its task: no
    event-loop round trip per call)."""
    async def repeat(n: int) -> None:
        for _ in range(n):
            await op()

    n = 1
    while True:
        start = time.process_time()
        loop.run_until_complete(repeat(n))
        spent = time.process_time() - start
        if spent >= target:
            return spent / n
        n = max(n * 2, int(n * target / max(spent, 1e-6)))


def _cases(loop: asyncio.AbstractEventLoop, plugin: Any, size: int, codec: Compression,
           ) -> tuple[dict[str, Callable[[], Awaitable[bytes]]], int, int, int]:
    count = BATCH_VALUE_BYTES // size
    records = [Record(key=b"customer-%07d" % i, value=_value(i, size), timestamp=1_700_000_000,
                      headers=[Header("source", b"web")], offset_delta=i)
               for i in range(count)]
    produced = build_batch(records, compression=codec, producer_id=7, producer_epoch=0,
                           base_sequence=0)
    ctx = make_context(deadline=float("inf"))
    consume_ctx = ConsumeContext(client_id="bench", client_address="127.0.0.1:1",
                                 principal=None, api_version=16, deadline=float("inf"))
    interceptor = plugin.interceptor
    def decode_produce() -> tuple[Any, RecordBatch]:
        decoded = decode_batch(produced)
        return decoded, RecordBatch(topic="orders", partition=0, records=decoded.records,
                                    compression=codec.name.lower())

    async def produce_passthrough() -> bytes:
        decoded, batch = decode_produce()
        return encode_batch(decoded.header, batch.records)

    async def produce_encrypt() -> bytes:
        decoded, batch = decode_produce()
        out = await interceptor.intercept(batch, ctx)
        return encode_batch(decoded.header, out.records)

    stored = loop.run_until_complete(produce_encrypt())  # asks the KMS for a data key

    def consumed(data: bytes) -> tuple[Any, ConsumedBatch]:
        decoded = decode_batch(data)
        return decoded, ConsumedBatch(topic="orders", partition=0, base_offset=0,
                                      records=decoded.records)

    async def fetch_passthrough() -> bytes:
        decoded, batch = consumed(stored)
        return encode_batch(decoded.header, batch.records, renumber=False, keep_extent=True)

    def as_block(data: bytes) -> tuple[RecordBatchHeader, ConsumedBlock]:
        """The batch as the proxy hands it to a block hook: an uncompressed one where it
        lies (its CRC checked), a compressed one decompressed; neither decoded."""
        (batch,) = split_fetched_records(data).batches
        header = batch.header
        assert header is not None
        if header.compression is Compression.NONE:
            verify_batch_crc(data, 0, header)
            block = memoryview(data)[BATCH_HEADER_SIZE:]
        else:
            block = memoryview(decompress_block(data, 0, header))
        return header, ConsumedBlock(topic="orders", partition=0, base_offset=0,
                                     base_timestamp=header.base_timestamp,
                                     record_count=header.record_count, data=block)

    async def fetch_decrypt() -> bytes:
        header, block = as_block(stored)  # as the proxy runs it: the block first
        opened = await interceptor.on_consume_block(block, consume_ctx)
        if opened is not None:
            return b"".join(encode_block_parts(header, opened))
        decoded, batch = consumed(stored)
        out = await interceptor.on_consume(batch, consume_ctx)
        return encode_batch(decoded.header, out.records, renumber=False, keep_extent=True)

    async def fetch_plaintext() -> bytes:
        _, block = as_block(produced)
        out = await interceptor.on_consume_block(block, consume_ctx)
        assert out is block.data
        return produced

    assert decode_batch(loop.run_until_complete(fetch_decrypt())).records == \
        decode_batch(produced).records
    return ({"produce, passthrough": produce_passthrough, "produce, encrypt": produce_encrypt,
             "fetch, passthrough": fetch_passthrough, "fetch, decrypt": fetch_decrypt,
             "fetch, plaintext batch": fetch_plaintext},
            count, len(produced), len(stored))


BASELINE = {"produce, encrypt": "produce, passthrough", "fetch, decrypt": "fetch, passthrough",
            "fetch, plaintext batch": "fetch, passthrough"}


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.3,
                        help="seconds of CPU per repeat (default 0.3)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    loop = asyncio.new_event_loop()
    rows, sizes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.yaml"
        write_key_file(keys, {"KEK_orders": (1, {1: os.urandom(32)})})
        with load("record_encryption", config={
                "kms": {"type": "key_file", "path": str(keys)}, "key": "KEK_${topic}"}) as plugin:
            for size in SIZES:
                for codec_name, codec in CODECS.items():
                    ops, count, produced, stored = _cases(loop, plugin, size, codec)
                    sizes.append(f"{size:,} B values, {codec_name}: {count} records, "
                                 f"{produced:,} bytes as produced, {stored:,} as stored")
                    samples: dict[str, list[float]] = {name: [] for name in ops}
                    for _ in range(5):
                        for name, op in ops.items():
                            samples[name].append(_cpu_s(loop, op, args.target))
                    gb = count * size / 1e9
                    per_gb = {name: statistics.median(v) / gb for name, v in samples.items()}
                    for name, seconds in per_gb.items():
                        base = BASELINE.get(name)
                        ratio = f"{seconds / per_gb[base]:.2f}" if base else "1.00"
                        rows.append(f"| {size:,} B | {codec_name} | {name} | {seconds:.1f} | "
                                    f"{seconds * gb / count * 1e6:.2f} | "
                                    f"{ratio} |")
    loop.close()
    load_avg = os.getloadavg()
    text = "\n".join([
        "## record_encryption on both hooks: CPU per GB of values against re-encoding alone",
        "",
        "Command: `python -m bench.record_encryption` (from the repository root, project "
        "virtualenv)",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; "
        f"shared with other work (load average {load_avg[0]:.2f} / {load_avg[1]:.2f} / "
        f"{load_avg[2]:.2f}).",
        "- One partition's batch, in process: decode, hook, encode with the batch's codec "
        "(as the proxy handles a changed batch; on fetch, a batch's block is handed to the "
        "hook where it lies or decompressed, its CRC checked, not decoded); about 64 KiB "
        "of JSON-like values per batch; data keys from a key file, cached (no KMS call "
        "measured).",
        "- CPU seconds per GB of values (`time.process_time`, one thread), median of 5 "
        f"repeats of about {args.target} s; µs per record; \"x passthrough\" against the same "
        "hook's decode and re-encode alone, same run.",
        *(f"- {line}." for line in sizes),
        "",
        "| value | codec | case | CPU s/GB | CPU µs/record | x passthrough |",
        "|---:|---|---|---:|---:|---:|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        write_results(text, "record-encryption")
    return text


if __name__ == "__main__":
    main()
