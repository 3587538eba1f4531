"""Record-batch codec benchmark: decode + re-encode, ours against aiokafka and kafka-python.

Run from the repository root with the project's virtualenv::

    python -m bench.codec            # full run (about a minute), writes bench/RESULTS.md
    python -m bench.codec --quick    # shorter repeats, for a smoke test
    python -m bench.codec --no-write # print only

For each record size (100 B and 1 KiB values) and codec (none, gzip, snappy, lz4,
zstd) one input batch of ``--records`` records is built once (16-byte keys, one or
two headers, idempotent-producer fields) and every implementation gets the same
bytes. One operation is what a produce-intercepting proxy does with a batch it
must look into: verify the CRC, decompress, decode every record, then build a new
batch with the same producer fields and codec and compress it again.

* **ours**: :func:`kiproxy.protocol.records.decode_batch` +
  :func:`kiproxy.protocol.records.encode_batch`
  (Cython record loops, cramjam codecs).
* **aiokafka C**: ``aiokafka.record._crecords`` ``DefaultRecordBatch`` (iterate the
  records) + ``DefaultRecordBatchBuilder`` (``append`` each, ``build``).
* **aiokafka C, our compressors**: the same, with aiokafka's compression functions
  swapped for ``protocol.compression`` for the duration of that column, so the
  compressed rows compare record layers rather than compression levels.
* **kafka-python**: the pure-Python ``kafka.record.default_records`` reader/builder.
  kafka-python needs python-snappy / lz4 / zstandard for those codecs; when they
  are not installed its codec functions are replaced with aiokafka's cramjam-backed
  ones (marked in the table), so its record layer can still be measured.

CPU time is ``time.process_time`` on one thread; each cell is the median of three
repeats, and each repeat runs enough iterations to take about ``--target`` seconds
(fewer for kafka-python, which is an order of magnitude slower). The repeats of the
implementations are interleaved so that drift in machine speed hits every column alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import random
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import RESULTS, write_results
from kiproxy.protocol.compression import Compression, compress, decompress
from kiproxy.protocol.records import Header, Record, build_batch, decode_batch, encode_batch

__all__ = ["Impl", "Row", "build_input", "main", "measure"]

SECTION = "## Codec: decode + re-encode"
CODECS = (Compression.NONE, Compression.GZIP, Compression.SNAPPY, Compression.LZ4,
          Compression.ZSTD)
SIZES = (100, 1024)
REPEATS = 3
BATCH_SIZE_LIMIT = 1 << 30

Op = Callable[[bytes], bytes | bytearray]
"""One decode + re-encode of a batch; returns the new batch."""
Decoded = list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]], int]]


# --------------------------------------------------------------------------- input

_WORDS = ("order", "payment", "customer", "status", "pending", "shipped", "EUR", "USD",
          "warehouse", "priority", "express", "standard", "refund", "invoice", "berlin",
          "lisbon", "tokyo", "sku", "quantity", "discount")


def _value(rng: random.Random, size: int) -> bytes:
    """A JSON-looking value of exactly ``size`` bytes, about as compressible as real events."""
    parts: list[str] = []
    length = 0
    while length < size:
        field = f'"{rng.choice(_WORDS)}":"{rng.choice(_WORDS)}-{rng.randrange(10**6)}",'
        if rng.random() < 0.3:
            field = f'"{rng.choice(_WORDS)}":{rng.random() * 1000:.2f},'
        parts.append(field)
        length += len(field)
    return ("{" + "".join(parts))[: size - 1].encode() + b"}"


def make_records(count: int, value_size: int, seed: int = 42) -> list[Record]:
    """``count`` records: 16-byte keys, ``value_size``-byte values, one or two headers."""
    rng = random.Random(seed + value_size)
    base_ts = 1_700_000_000_000
    out = []
    for i in range(count):
        headers = [Header("trace-id", rng.randbytes(8).hex().encode())]
        if i % 2:
            headers.append(Header("content-type", b"application/json"))
        out.append(Record(key=f"user-{rng.randrange(10**11):011d}".encode(),
                          value=_value(rng, value_size), headers=headers,
                          timestamp=base_ts + i * 3 + rng.randrange(3)))
    return out


def build_input(count: int, value_size: int, codec: Compression) -> bytes:
    """The batch every implementation decodes: idempotent producer fields, CreateTime."""
    return build_batch(make_records(count, value_size), compression=codec, producer_id=4242,
                       producer_epoch=3, base_sequence=1000)


# --------------------------------------------------------------------------- implementations


@dataclass
class Impl:
    """One implementation under test."""

    name: str
    """Column heading."""
    op: Op
    """Decode + re-encode one batch."""
    decode: Callable[[bytes], Decoded]
    """Decode only, as plain tuples, to check that everyone reads the same records."""
    slow: bool = False
    """Pure-Python: measured with a shorter target time."""
    note: str = ""
    """What was imported (shown under the table)."""
    substituted_codecs: frozenset[Compression] = frozenset()
    """Codecs whose compression functions had to be swapped for aiokafka's cramjam ones."""
    context: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    """Entered around everything this implementation runs (to patch and unpatch)."""


def _ours() -> Impl:
    def op(data: bytes) -> bytes:
        batch = decode_batch(data)
        return encode_batch(batch.header, batch.records)

    def decode(data: bytes) -> Decoded:
        return [(r.key, r.value, [(h.key, h.value) for h in r.headers], r.timestamp)
                for r in decode_batch(data).records]

    return Impl("ours", op, decode, note="protocol.records (Cython record loops, cramjam)")


def _generic_ops(batch_cls: Any, builder_cls: Any) -> tuple[Op, Callable[[bytes], Decoded]]:
    """decode + re-encode with a kafka-python-style ``DefaultRecordBatch``/``Builder`` pair."""

    def op(data: bytes) -> bytes | bytearray:
        batch = batch_cls(data)
        if not batch.validate_crc():
            raise ValueError("CRC mismatch")
        builder = builder_cls(2, batch.compression_type, int(batch.is_transactional),
                              batch.producer_id, batch.producer_epoch, batch.base_sequence,
                              BATCH_SIZE_LIMIT)
        append = builder.append
        for rec in batch:
            append(rec.offset, rec.timestamp, rec.key, rec.value, rec.headers)
        out: bytearray = builder.build()
        return out

    def decode(data: bytes) -> Decoded:
        return [(r.key, r.value, list(r.headers), r.timestamp) for r in batch_cls(data)]

    return op, decode


def _aiokafka() -> Impl | None:
    try:
        import aiokafka
        from aiokafka.record import _crecords
        from aiokafka.record import default_records as public
    except ImportError as exc:
        print(f"aiokafka C path not importable: {exc}", file=sys.stderr)
        return None
    ext = Path(_crecords.default_records.__file__ or "")
    is_c = ext.suffix in (".so", ".pyd")
    uses_c = public.DefaultRecordBatch is _crecords.DefaultRecordBatch
    op, decode = _generic_ops(_crecords.DefaultRecordBatch, _crecords.DefaultRecordBatchBuilder)
    note = (f"aiokafka {aiokafka.__version__}: aiokafka.record._crecords.default_records "
            f"is {'a compiled C extension (' + ext.name + ')' if is_c else 'NOT compiled'}; "
            f"aiokafka.record.default_records {'uses it' if uses_c else 'does NOT use it'}")
    return Impl("aiokafka C", op, decode, note=note)


@contextlib.contextmanager
def _ours_compression_in(module: Any) -> Iterator[None]:
    """Temporarily make ``module``'s ``<codec>_encode/_decode`` functions call ours."""
    limit = 1 << 31

    def encoder(codec: Compression) -> Callable[[Any], bytes]:
        return lambda data: compress(codec, bytes(data))

    def decoder(codec: Compression) -> Callable[[Any], bytes]:
        return lambda data: decompress(codec, data, limit)

    patches: dict[str, Callable[[Any], bytes]] = {}
    for codec in CODECS[1:]:
        name = codec.name.lower()
        patches[f"{name}_encode"] = encoder(codec)
        patches[f"{name}_decode"] = decoder(codec)
    saved = {name: getattr(module, name) for name in patches}
    for name, fn in patches.items():
        setattr(module, name, fn)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def _aiokafka_same_codecs() -> Impl | None:
    base = _aiokafka()
    if base is None:
        return None
    from aiokafka.record._crecords import default_records as cdr

    return Impl(
        "aiokafka C, our compressors", base.op, base.decode,
        note="the same aiokafka C record path, with its module-level compression functions "
             "temporarily replaced by protocol.compression.compress/decompress, so that both "
             "sides run the identical compressor and level (isolates the record layer)",
        context=lambda: _ours_compression_in(cdr),
    )


def _kafka_python() -> Impl | None:
    try:
        import kafka
        import kafka.codec as kcodec
        from kafka.record import default_records as kdr
    except ImportError as exc:
        print(f"kafka-python not importable: {exc}", file=sys.stderr)
        return None
    import aiokafka.codec as acodec

    substituted: set[Compression] = set()
    for codec, name in ((Compression.SNAPPY, "snappy"), (Compression.LZ4, "lz4"),
                        (Compression.ZSTD, "zstd")):
        if getattr(kcodec, f"has_{name}")():
            continue
        # kafka-python imported these names into default_records; patch both places.
        for fn in (f"{name}_encode", f"{name}_decode"):
            setattr(kdr, fn, getattr(acodec, fn))
            setattr(kcodec, fn, getattr(acodec, fn))
        setattr(kcodec, f"has_{name}", lambda: True)
        substituted.add(codec)
    op, decode = _generic_ops(kdr.DefaultRecordBatch, kdr.DefaultRecordBatchBuilder)
    note = f"kafka-python {kafka.__version__}: kafka.record.default_records (pure Python)"
    if substituted:
        names = ", ".join(c.name.lower() for c in sorted(substituted))
        note += (f"; its {names} libraries are not installed, so aiokafka's cramjam codec "
                 "functions were patched in for those (cells marked †)")
    return Impl("kafka-python", op, decode, slow=True, note=note,
                substituted_codecs=frozenset(substituted))


# --------------------------------------------------------------------------- measuring


def calibrate(op: Op, data: bytes, target: float) -> int:
    """Iterations of ``op`` that take about ``target`` CPU seconds (after one warm-up)."""
    op(data)
    start = time.process_time()
    op(data)
    once = max(time.process_time() - start, 1e-6)
    return max(1, round(target / once))


def timed(op: Op, data: bytes, iterations: int) -> float:
    """CPU seconds for ``iterations`` calls of ``op``."""
    start = time.process_time()
    for _ in range(iterations):
        op(data)
    return time.process_time() - start


def measure(impls: Sequence[Impl], data: bytes, records: int, target: float,
            slow_target: float) -> dict[str, tuple[float, int]]:
    """Median records/s and iterations per repeat of each implementation.

    Repeats are interleaved (every implementation once, then again, ...), so a
    machine that speeds up or slows down during the run affects all columns alike.
    """
    iterations: dict[str, int] = {}
    for impl in impls:
        with impl.context():
            iterations[impl.name] = calibrate(impl.op, data,
                                              slow_target if impl.slow else target)
    rates: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for _ in range(REPEATS):
        for impl in impls:
            n = iterations[impl.name]
            with impl.context():
                elapsed = timed(impl.op, data, n)
            rates[impl.name].append(records * n / elapsed)
    return {name: (statistics.median(r), iterations[name]) for name, r in rates.items()}


@dataclass
class Row:
    """Results for one record size and codec."""

    value_size: int
    codec: Compression
    input_size: int
    rates: dict[str, float | None]
    output_sizes: dict[str, int]

    @property
    def label(self) -> str:
        """``100 B`` / ``1 KiB``."""
        return "1 KiB" if self.value_size == 1024 else f"{self.value_size} B"


def _check_same_records(reference: Impl, impl: Impl, data: bytes) -> None:
    """``impl`` reads the records ``reference`` reads, and its output reads back the same."""
    expected = reference.decode(data)
    if impl.decode(data) != expected:
        raise AssertionError(f"{impl.name} decodes different records than {reference.name}")
    if reference.decode(bytes(impl.op(data))) != expected:
        raise AssertionError(f"{impl.name}'s re-encoded batch decodes differently")


def run(impls: Sequence[Impl], count: int, target: float, slow_target: float) -> list[Row]:
    """Measure every implementation on every (record size, codec) input."""
    rows = []
    for size in SIZES:
        for codec in CODECS:
            data = build_input(count, size, codec)
            outputs: dict[str, int] = {}
            for impl in impls:
                with impl.context():
                    _check_same_records(impls[0], impl, data)
                    outputs[impl.name] = len(impl.op(data))
            results = measure(impls, data, count, target, slow_target)
            rates: dict[str, float | None] = {}
            for name, (rate, iterations) in results.items():
                rates[name] = rate
                print(f"  {size:>5} B {codec.name.lower():7} {name:28} "
                      f"{rate:>12,.0f} rec/s  ({iterations} it x {REPEATS})", file=sys.stderr)
            rows.append(Row(size, codec, len(data), rates, outputs))
    return rows


# --------------------------------------------------------------------------- reporting


def _fmt_rate(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate:,.0f}"


def table(rows: Sequence[Row], impls: Sequence[Impl]) -> str:
    """The markdown results table (records/s; higher is better)."""
    names = [i.name for i in impls]
    ratios = [n for n in names if n.startswith("aiokafka C")]
    head = ["records", "codec", *[f"{n} (rec/s)" for n in names],
            *[f"ours / {n}" for n in ratios]]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 2 + ["---:"] *
                                                          (len(head) - 2)) + "|"]
    for row in rows:
        cells = [row.label, row.codec.name.lower()]
        for impl in impls:
            cell = _fmt_rate(row.rates.get(impl.name))
            if row.codec in impl.substituted_codecs:
                cell += " †"
            cells.append(cell)
        ours = row.rates.get("ours")
        for name in ratios:
            other = row.rates.get(name)
            cells.append(f"{ours / other:.2f}x" if ours and other else "n/a")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def size_table(rows: Sequence[Row], impls: Sequence[Impl]) -> str:
    """Input batch size and each implementation's re-encoded batch size, in bytes."""
    names = [i.name for i in impls]
    head = ["records", "codec", "input", *names]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for row in rows:
        cells = [row.label, row.codec.name.lower(), f"{row.input_size:,}",
                 *[f"{row.output_sizes[n]:,}" for n in names]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    match = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return match.group(1).strip() if match else "unknown"


def _nproc() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("aiokafka", "kafka-python", "cramjam", "crc32c"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            out.append(f"{dist} (not installed)")
    return ", ".join(out)


def section(rows: Sequence[Row], impls: Sequence[Impl], command: str, count: int,
            target: float, slow_target: float, elapsed: float) -> str:
    """The ``## Codec: decode + re-encode`` section of RESULTS.md."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    notes = "; ".join(f"{i.name}: {i.note}" for i in impls)
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv)

- Date: {now}; machine: {_nproc()} CPUs (nproc), {_cpu_model()}, {platform.system()} \
{platform.release()}
- Python: {platform.python_implementation()} {platform.python_version()}; libraries: {_versions()}
- Input: one batch of {count} records per row (16-byte keys, values of the given size, \
1-2 headers, producer id/epoch/sequence set), built once; all implementations get the \
same bytes and are checked to decode the same records.
- One operation: verify CRC, decompress, decode every record, build a new batch with the \
same producer fields and codec, compress. Throughput is records/s of CPU time \
(`time.process_time`, one thread), median of {REPEATS} repeats of ~{target:g} s each \
(~{slow_target:g} s for kafka-python), the implementations' repeats interleaved. \
Total run: {elapsed:.0f} s.
- Implementations: {notes}

{table(rows, impls)}

Ratio columns: our throughput over aiokafka's C path, first with each library's own \
compressors, then with aiokafka running our compressors; above 1.00x means ours is faster. \
Compression levels are each library's defaults and differ, which dominates the \
compressed rows (ours: gzip 6, lz4 1, zstd 3; aiokafka and kafka-python: gzip 9, lz4 9, \
zstd 3); the bench prints the re-encoded batch sizes that show it.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, and update bench/RESULTS.md."""
    parser = argparse.ArgumentParser(prog="python -m bench.codec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=500, help="records per batch")
    parser.add_argument("--target", type=float, default=0.5,
                        help="CPU seconds per repeat for ours and aiokafka")
    parser.add_argument("--slow-target", type=float, default=0.3,
                        help="CPU seconds per repeat for kafka-python")
    parser.add_argument("--quick", action="store_true", help="short repeats (smoke test)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    target, slow_target = args.target, args.slow_target
    if args.quick:
        target, slow_target = 0.05, 0.02
    command = " ".join(["python -m bench.codec", *(argv if argv is not None else sys.argv[1:])])

    impls = [i for i in (_ours(), _aiokafka(), _aiokafka_same_codecs(), _kafka_python())
             if i is not None]
    for impl in impls:
        print(f"{impl.name}: {impl.note}", file=sys.stderr)
    started = time.monotonic()
    rows = run(impls, args.records, target, slow_target)
    elapsed = time.monotonic() - started
    text = section(rows, impls, command, args.records, target, slow_target, elapsed)
    print(text)
    print("Re-encoded batch sizes (bytes):\n\n" + size_table(rows, impls))
    if not args.no_write:
        write_results(text, "codec")
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
