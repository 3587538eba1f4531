"""Fetch response layout benchmark: reading, splitting and splicing a 1 MiB response.

Run from the repository root with the project's virtualenv::

    python -m bench.fetch_layout            # writes bench/RESULTS.md
    python -m bench.fetch_layout --no-write # print only

One Fetch v17 response of about 1 MiB of records is built with kio for 1 partition
and for 100 partitions (batches of 16 records, as a broker returns them: 64 batches of
1 KiB values for 1 partition, one batch of about 600 B values per partition for 100).
For each, CPU microseconds per operation of:

* **layout**: :func:`~kiproxy.protocol.fetch_response.read_fetch_response`;
* **layout + split**: that, and
  :func:`~kiproxy.protocol.fetch_batches.split_fetched_records` for every partition;
* **splice, no replacement**: :func:`~kiproxy.protocol.fetch_splice.splice_fetch_response`
  with nothing to replace (the frame itself comes back);
* **identity splice**: every partition's records replaced by the same bytes (the
  whole frame written anew);
* baselines measured in the same run: **kio parse** (``parse_response``, which copies
  every records field into the message) and **copy** (``bytearray(frame)``, one
  memcpy of the frame).

CPU time is ``time.process_time`` on one thread; each cell is the median of five
repeats of about ``--target`` seconds each, the operations interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from bench.results import write_results
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.fetch_response import read_fetch_response
from kiproxy.protocol.fetch_splice import splice_fetch_response
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.protocol.records import Record, build_batch

__all__ = ["build_response", "main"]

VERSION = 17
HEAD = b"\x00\x00\x00\x07\x00"  # correlation id, empty tagged fields (header v1)
TOTAL = 1 << 20
BATCH_RECORDS = 16
VALUE = 1024
RECORD_OVERHEAD = 24  # a record's bytes besides its value, and the batch header's share


def build_response(partitions: int) -> bytes:
    """A Fetch v17 frame (no size prefix) with about 1 MiB of records over ``partitions``."""
    types = __import__(response_type(ApiKey.FETCH, VERSION).__module__, fromlist=["x"])
    per_partition = TOTAL // partitions
    batches = max(1, per_partition // (BATCH_RECORDS * (VALUE + RECORD_OVERHEAD)))
    value = per_partition // batches // BATCH_RECORDS - RECORD_OVERHEAD
    parts = []
    for index in range(partitions):
        records = b"".join(_batch(n * BATCH_RECORDS, value) for n in range(batches))
        parts.append(types.PartitionData(
            partition_index=index, error_code=ErrorCode.none, high_watermark=10**6,
            last_stable_offset=10**6, log_start_offset=0, aborted_transactions=None,
            records=records))
    topic = types.FetchableTopicResponse(topic_id=uuid.UUID(int=1), partitions=tuple(parts))
    response = types.FetchResponse(throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
                                   error_code=ErrorCode.none, session_id=1,
                                   responses=(topic,))
    return HEAD + serialize(response)


def _batch(offset: int, value: int) -> bytes:
    return build_batch([Record(key=b"key-%06d" % i, value=bytes([97 + i % 26]) * value,
                               timestamp=1_700_000_000_000 + i)
                        for i in range(BATCH_RECORDS)], base_offset=offset)


def _operations(frame: bytes) -> dict[str, Callable[[], Any]]:
    body = len(HEAD)
    layout = read_fetch_response(frame, body, VERSION)
    same = {(0, pj): frame[p.data_start:p.data_end]
            for pj, p in enumerate(layout.topics[0].partitions)}

    def split() -> None:
        for p in read_fetch_response(frame, body, VERSION).topics[0].partitions:
            split_fetched_records(frame, p.data_start, p.data_end)

    return {
        "layout": lambda: read_fetch_response(frame, body, VERSION),
        "layout + split": split,
        "splice, no replacement": lambda: splice_fetch_response(frame, body, VERSION, {},
                                                                layout),
        "identity splice": lambda: splice_fetch_response(frame, body, VERSION, same, layout),
        "kio parse (baseline)": lambda: parse_response(ApiKey.FETCH, VERSION, frame, body),
        "copy (baseline)": lambda: bytearray(frame),
    }


def _cpu_us(op: Callable[[], Any], target: float) -> float:
    n = 1
    while True:
        start = time.process_time()
        for _ in range(n):
            op()
        spent = time.process_time() - start
        if spent >= target:
            return spent / n * 1e6
        n = max(n * 2, int(n * target / max(spent, 1e-6)))


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=float, default=0.3,
                        help="seconds of CPU per repeat (default 0.3)")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    rows = []
    for partitions in (1, 100):
        frame = build_response(partitions)
        ops = _operations(frame)
        samples: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(5):
            for name, op in ops.items():
                samples[name].append(_cpu_us(op, args.target))
        kio = statistics.median(samples["kio parse (baseline)"])
        for name, values in samples.items():
            us = statistics.median(values)
            rows.append(f"| {partitions} | {len(frame):,} | {name} | {us:,.1f} | "
                        f"{us / kio:.3f} |")
    load = os.getloadavg()
    text = "\n".join([
        "## Fetch response: layout, batch split and splice (1 MiB)",
        "",
        "Command: `python -m bench.fetch_layout` (from the repository root, project "
        "virtualenv)",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; "
        f"shared with other work (load average {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f}).",
        f"- Fetch v{VERSION}, one topic (by id); uncompressed batches of {BATCH_RECORDS} "
        "records (the layout never looks inside them): 64 batches of 1 KiB values for 1 "
        "partition, one batch of about 600 B values per partition for 100.",
        "- CPU µs per operation (`time.process_time`, one thread), median of 5 repeats of "
        f"about {args.target} s; \"x kio\" is against kio's `parse_response` of the same "
        "frame.",
        "",
        "| partitions | frame bytes | operation | CPU µs | x kio |",
        "|---:|---:|---|---:|---:|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        write_results(text, "fetch-layout")
    return text


if __name__ == "__main__":
    main()
