"""Plugin isolation benchmark: the uppercase interceptor inline and in worker processes.

Run from the repository root with the project's virtualenv::

    python -m bench.isolation             # about half a minute; writes bench/RESULTS.md
    python -m bench.isolation --quick     # short repeats, for a smoke test
    python -m bench.isolation --no-write  # print only

The interceptor is ``kiproxy.interceptors.builtin.uppercase:Uppercase``; the records have
16-byte keys, 100-byte values and one header. No proxy and no broker: this times
only what ``interceptor.isolation`` changes, the call itself.

* **inline**: ``Uppercase().intercept(batch, ctx)`` in this process, as the
  produce pipeline calls a plain ``intercept`` on its event loop.
* **process, 1 in flight**: ``await pool.intercept(batch, ctx)`` on a
  :class:`kiproxy.proxy.isolation.pool.IsolatedInterceptor` with one worker, one batch at a
  time: the latency of a batch's round trip (encode, send, rebuild in the
  worker, upper-case, send back, rebuild in the proxy).
* **process, 2 in flight**: two workers and two concurrent callers (as two
  client connections would be), so the workers' share of the work runs in
  parallel with the proxy's.

Throughput is records per second of wall-clock time (the work spans processes),
median of three repeats of about ``--target`` seconds; the modes' repeats are
interleaved so drift in machine speed hits every column alike.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from bench.results import RESULTS, write_results
from kiproxy.interceptors import InterceptContext, Record, RecordBatch
from kiproxy.interceptors.builtin.uppercase import Uppercase
from kiproxy.proxy.isolation.pool import IsolatedInterceptor

SECTION = "## Plugin isolation: inline against worker processes"
SPEC = "kiproxy.interceptors.builtin.uppercase:Uppercase"
REPEATS = 3
SIZES = (1, 10, 100, 500)
MODES = ("inline", "process, 1 in flight", "process, 2 in flight")


def _batch(n: int) -> RecordBatch:
    records = tuple(
        Record(key=b"key-%012d" % i, value=b"value %d " % i + b"x" * (100 - len(b"value %d " % i)),
               headers=[("trace", b"t-%d" % i)], timestamp=1_763_848_800_000 + i,
               offset_delta=i)
        for i in range(n)
    )
    return RecordBatch(topic="bench", partition=0, records=records, producer_id=7,
                       producer_epoch=0, base_sequence=0)


def _ctx() -> InterceptContext:
    return InterceptContext(client_id="bench", client_address="127.0.0.1:1", principal=None,
                            api_version=11, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + 3600)


async def _timed(call: Callable[[], Awaitable[int]], target: float) -> float:
    """Records/s of repeated ``call()`` (each returns the records it handled) for ~target s."""
    records = 0
    started = time.perf_counter()
    while True:
        records += await call()
        elapsed = time.perf_counter() - started
        if elapsed >= target:
            return records / elapsed


async def run(target: float) -> dict[tuple[int, str], float]:
    """Median records/s per (batch size, mode)."""
    uppercase = Uppercase()
    one = IsolatedInterceptor(SPEC, workers=1)
    two = IsolatedInterceptor(SPEC, workers=2)
    one.start()
    two.start()
    try:
        samples: dict[tuple[int, str], list[float]] = {}
        for size in SIZES:
            batch, ctx = _batch(size), _ctx()
            expected = uppercase.intercept(batch, ctx).records
            assert (await one.intercept(batch, ctx)).records == expected

            async def inline(batch: RecordBatch = batch, ctx: InterceptContext = ctx) -> int:
                for _ in range(10):
                    uppercase.intercept(batch, ctx)
                return 10 * len(batch)

            async def serial(batch: RecordBatch = batch, ctx: InterceptContext = ctx) -> int:
                await one.intercept(batch, ctx)
                return len(batch)

            async def parallel(batch: RecordBatch = batch, ctx: InterceptContext = ctx) -> int:
                await asyncio.gather(two.intercept(batch, ctx), two.intercept(batch, ctx))
                return 2 * len(batch)

            for _ in range(REPEATS):
                for mode, call in zip(MODES, (inline, serial, parallel), strict=True):
                    samples.setdefault((size, mode), []).append(await _timed(call, target))
        return {key: statistics.median(values) for key, values in samples.items()}
    finally:
        await one.close()
        await two.close()


def table(results: dict[tuple[int, str], float]) -> str:
    """The results as a Markdown table with ratios against inline."""
    head = ["records per batch", *(f"{m} (rec/s)" for m in MODES),
            "µs per batch, 1 in flight", *(f"{m} / inline" for m in MODES[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for size in SIZES:
        inline = results[(size, MODES[0])]
        cells = [str(size), *(f"{results[(size, m)]:,.0f}" for m in MODES),
                 f"{1e6 * size / results[(size, MODES[1])]:,.0f}",
                 *(f"{results[(size, m)] / inline:.2f}x" for m in MODES[1:])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loop_name() -> str:
    """The event loop the benchmark runs on."""
    try:
        return f"uvloop {version('uvloop')}"
    except PackageNotFoundError:
        return "the asyncio default loop"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def section(results: dict[tuple[int, str], float], command: str, target: float,
            elapsed: float) -> str:
    """This benchmark's section of RESULTS.md."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv)

- Date: {now}; machine: {os.cpu_count()} CPUs, {_cpu_model()}, {platform.system()} \
{platform.release()}; Python: {platform.python_implementation()} {platform.python_version()}
- 1-minute load average at the end: {os.getloadavg()[0]:.1f} (other jobs share the machine \
when it exceeds the CPU count; compare the ratios, not the absolute figures)
- Interceptor: `{SPEC}` on records with 16-byte keys, 100-byte values and one header. \
Throughput is records/s of wall-clock time, median of {REPEATS} repeats of ~{target:g} s, \
modes interleaved. Total run: {elapsed:.0f} s. No proxy, no broker: the call only.
- inline: `intercept()` in this process. process: `IsolatedInterceptor.intercept()` \
(one worker, one batch at a time; or two workers and two concurrent callers), on \
{loop_name()}.

{table(results)}

The ratio columns are process mode's throughput over inline's (below 1.00x: slower). \
The round trip copies every record to the worker and back (Kafka's record encoding \
over a socketpair, rebuilt into `Record`s on both sides) and wakes two processes, so a \
cheap interceptor pays that several times over; an expensive one (or one that must be \
killable) hides it. Inline stays the default.
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print its section, and update bench/RESULTS.md."""
    parser = argparse.ArgumentParser(prog="python -m bench.isolation", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=float, default=0.7, help="seconds per repeat")
    parser.add_argument("--quick", action="store_true", help="short repeats (smoke test)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    target = 0.05 if args.quick else args.target
    command = " ".join(["python -m bench.isolation",
                        *(argv if argv is not None else sys.argv[1:])])
    started = time.monotonic()
    try:  # the proxy runs on uvloop when it is installed; so does this
        import uvloop

        results = uvloop.run(run(target))
    except ImportError:
        results = asyncio.run(run(target))
    text = section(results, command, target, time.monotonic() - started)
    print(text)
    if not args.no_write:
        write_results(text, "isolation")
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
