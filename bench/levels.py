"""What a re-encoding compression level costs and saves: CPU per record and batch size.

Run from the repository root with the project's virtualenv::

    python -m bench.levels                       # zstd and lz4, 100 B and 1 KiB values
    python -m bench.levels --codecs zstd --levels zstd=1,2,3,6

A batch the interceptor changed is compressed again at the level set in
``interceptor.compression`` (Kafka's defaults: zstd 3, lz4 1 (fast mode), gzip 6).
For each codec, value size and level this re-encodes one batch of ``--records``
records of the end-to-end benchmark's values (``bench.proxy.stats.json_values``,
upper-cased, as the ``uppercase`` built-in leaves them) with
:func:`kiproxy.protocol.records.encode_batch` and prints the CPU time per record
(median of ``--repeats``, each about ``--seconds`` of CPU) and the encoded batch's
bytes per record, against the codec's default level. ``--write`` also puts the
table, with the command, the date and the machine, in its section of
``bench/RESULTS.md`` (``levels``).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Sequence

from bench.proxy.stats import json_values
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression
from kiproxy.protocol.records import Record, build_batch, decode_batches, encode_batch

__all__ = ["encode_cost", "main", "parse_levels"]

_CODECS = {f.name: Compression[f.name.upper()] for f in dataclasses.fields(DEFAULT_LEVELS)}
"""The codecs that have levels: those of ``interceptor.compression``."""
_DEFAULT_SWEEP = {"gzip": (1, 6), "lz4": (1, 3), "zstd": (-1, 1, 2, 3)}


def parse_levels(text: str) -> dict[str, tuple[int, ...]]:
    """``zstd=1,3;lz4=1`` -> ``{"zstd": (1, 3), "lz4": (1,)}``; raises ValueError."""
    out: dict[str, tuple[int, ...]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        codec, sep, levels = part.partition("=")
        if not sep or codec not in _CODECS:
            raise ValueError(f"--levels wants CODEC=L1,L2;... with CODEC one of "
                             f"{', '.join(_CODECS)}, not {part!r}")
        out[codec] = tuple(int(x) for x in levels.split(","))
    return out


def encode_cost(codec: Compression, level: int, values: Sequence[bytes], records: int,
                seconds: float, repeats: int) -> tuple[float, float]:
    """(CPU microseconds per record, encoded bytes per record) of re-encoding one batch."""
    batch = build_batch([Record(key=b"key-%08d" % i, value=values[i % len(values)].upper(),
                                timestamp=1_700_000_000_000 + i) for i in range(records)],
                        compression=codec, producer_id=1, producer_epoch=0, base_sequence=0)
    [decoded] = decode_batches(batch)
    levels = dataclasses.replace(DEFAULT_LEVELS, **{codec.name.lower(): level})
    size = len(encode_batch(decoded.header, decoded.records, levels=levels))
    samples = []
    for _ in range(repeats):
        n = 0
        start = time.process_time()
        while True:  # at least once
            encode_batch(decoded.header, decoded.records, levels=levels)
            n += 1
            if (elapsed := time.process_time() - start) >= seconds:
                break
        samples.append(elapsed / (n * records) * 1e6)
    return statistics.median(samples), size / records


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.levels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--codecs", default="zstd,lz4", help="of gzip, lz4, zstd")
    p.add_argument("--sizes", default="100,1024", help="value sizes in bytes")
    p.add_argument("--levels", default="", help="CODEC=L1,L2;... (default: a sweep)")
    p.add_argument("--records", type=int, default=300, help="records per batch")
    p.add_argument("--seconds", type=float, default=0.5, help="CPU seconds per repeat")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    args = p.parse_args(argv)
    try:
        sweep = {**_DEFAULT_SWEEP, **parse_levels(args.levels)}
        codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
        unknown = [c for c in codecs if c not in _CODECS]
        if unknown:
            raise ValueError(f"unknown codec {unknown[0]!r}: use {', '.join(_CODECS)}")
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError as exc:
        p.error(str(exc))
    setup = f"{args.records} records a batch, median of {args.repeats} x {args.seconds} s CPU"
    print(setup)
    table = ["| codec | value | level | us/record | bytes/record | CPU vs default | "
             "size vs default |", "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(table))
    for name in codecs:
        codec = _CODECS[name]
        default: int = getattr(DEFAULT_LEVELS, name)
        levels = sorted(set(sweep[name]) | {default})
        for size in sizes:
            values = json_values(size, 1000)
            rows = {level: encode_cost(codec, level, values, args.records, args.seconds,
                                       args.repeats) for level in levels}
            base_us, base_bytes = rows[default]
            for level, (us, nbytes) in rows.items():
                mark = " (default)" if level == default else ""
                table.append(f"| {name} | {size} B | {level}{mark} | {us:.2f} | "
                             f"{nbytes:.1f} | {us / base_us:.2f} | {nbytes / base_bytes:.2f} |")
                print(table[-1])
    if args.write:
        _write(table, setup, argv)
    return 0


def _write(table: list[str], setup: str, argv: Sequence[str] | None) -> None:
    import datetime
    import os
    import platform
    import sys

    from bench.results import write_results

    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    command = " ".join(["python -m bench.levels", *(sys.argv[1:] if argv is None else argv)])
    machine = (f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, Python "
               f"{platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    write_results("\n".join([
        "## Re-encoding levels: CPU and size per level (`bench/levels.py`)", "",
        f"Command: `{command}` ({when}; {machine}; no broker). One batch of upper-cased "
        f"benchmark values re-encoded at each level: {setup}; batch bytes per record.", "",
        *table]), "levels")


if __name__ == "__main__":
    raise SystemExit(main())
