"""Neighbours: does a large zstd producer through uppercase delay another connection?

The requirement measured: a ~1 MB request with a compressing plugin on one connection
must not delay other connections' requests by more than one batch's cost.

Run from the repository root with the project's virtualenv::

    python -m bench.neighbours             # 3 rounds of 10 s windows, ~3 min; writes RESULTS.md
    python -m bench.neighbours --quick     # 1 round of 4 s windows, under a minute; prints only
    python -m bench.neighbours --no-write  # full run, print only

Each run starts a fresh Tansu broker (memory storage, loopback) and, on the kiproxy
path, ``kiproxy run`` with the built-in uppercase interceptor in front of it
(``bench.proxy.run.started``, as ``bench.proxy`` does). Two confluent-kafka producers,
each in a process of its own (``--worker small|large``), each on its own topic and
connection:

* **small**: 100 B JSON values, acks=1, ``--small-linger-ms`` (0), one partition, paced
  at ``--rate`` records/s (1,000) for ``--seconds``. Every record's latency is
  librdkafka's produce-to-acknowledgement time (``Message.latency()``); the run's
  p50/p99/p99.9/max are over all of them. The CPU of the proxy, the broker and the rest
  of the machine is read from ``/proc`` over the same window.
* **large**: 1 KiB lower-case JSON values, ``compression.type=zstd``,
  ``batch.size=--batch-size`` (1,000,000: requests of about 1 MB of records before
  compression), ``linger.ms=--large-linger-ms`` (50), acks=1, ``--large-partitions`` (1),
  as fast as it can (``--large-rate`` paces it instead). It is started and warmed up
  before the small producer and stopped after it; it reports the MB/s of values
  acknowledged and librdkafka's records and bytes per batch.

Four runs per round: small alone and small beside large, through kiproxy and straight to
the broker (the broker's and the shared cores' own share of the interference). Rounds
are interleaved and rotated; the table shows medians, and "added p99" is the median of
per-round differences (beside minus alone).

**One batch's cost** is measured in this process with ``bench.intercept.measure``: the
CPU time of ``ProducePipeline.handle`` with uppercase on one Produce request holding one
batch of 1 KiB zstd records (as many as the large producer put in a batch), best of
several repeats. The requirement holds when the small producer's added p99 through
kiproxy, less the direct path's, is within that cost. Every process this bench starts is
stopped before it returns; everything binds 127.0.0.1.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import select
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from bench.neighbours_stats import (
    BatchCost,
    Run,
    batch_shape,
    cores,
    fill_run,
    latency_summary,
    reading,
    render_comparison,
    render_table,
    summarize,
)
from bench.proxy.cpu import CpuSampler
from bench.proxy.matrix import rotated
from bench.proxy.render import code_version
from bench.proxy.run import create_topic, started
from bench.proxy.scenarios import MB, ROOT, SCENARIOS
from bench.proxy.stats import json_values, median, num
from bench.results import RESULTS, write_results

__all__ = ["SECTION", "main"]

SECTION = ("## Neighbours: a large zstd producer through uppercase beside a small one "
           "(bench/neighbours.py)")
SMALL_VALUE = 100
LARGE_VALUE = 1024
RUNS = (("kiproxy", False), ("kiproxy", True), ("direct", False), ("direct", True))


@dataclass(frozen=True, slots=True, kw_only=True)
class Options:
    """What the command line asked for."""

    rounds: int
    seconds: float
    rate: float
    small_linger_ms: float
    large_linger_ms: float
    batch_size: int
    large_partitions: int
    large_rate: float
    """Large-producer records/s; 0 is as fast as it can."""
    warmup: int
    cost_seconds: float
    cost_repeats: int


# --------------------------------------------------------------------------- producers


def small_producer(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The small producer (runs in its own process: ``--worker small SPEC``)."""
    from confluent_kafka import Producer

    topic = spec["topic"]
    create_topic(spec["bootstrap"], topic, 1)
    values = json_values(SMALL_VALUE, 1000)
    latencies: list[float] = []
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(str(err))
        elif msg.latency() is not None:
            latencies.append(msg.latency() * 1000)

    producer = Producer({"bootstrap.servers": spec["bootstrap"], "client.id": "bench-small",
                         "acks": "1", "linger.ms": spec["linger_ms"],
                         "enable.idempotence": False, "on_delivery": on_delivery})
    for i in range(spec["warmup"]):
        producer.produce(topic, values[i % len(values)])
    if producer.flush(30):
        return {"error": "warm-up records were not delivered within 30 s"}
    latencies.clear()
    sampler = CpuSampler(spec["pids"])
    rate, total = spec["rate"], max(1, int(spec["rate"] * spec["seconds"]))
    before = sampler.sample()
    start = time.perf_counter()
    for i in range(total):
        ahead = start + i / rate - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)  # latency is librdkafka's own clock: polling late is harmless
        producer.produce(topic, values[i % len(values)])
        producer.poll(0)
    seconds = time.perf_counter() - start
    cpu = CpuSampler.delta(before, sampler.sample())
    left = producer.flush(60)
    summary = latency_summary(latencies)
    error = errors[0] if errors else (f"{left} records not delivered" if left else None)
    return {"records": total, "seconds": seconds, "cpu": cpu, "error": error,
            "latency": None if summary is None else asdict(summary)}


def large_producer(spec: Mapping[str, Any], stop: threading.Event) -> dict[str, Any]:
    """The large producer (``--worker large SPEC``): prints ``ready``, produces until ``stop``."""
    from confluent_kafka import Producer

    topic, partitions = spec["topic"], spec["partitions"]
    create_topic(spec["bootstrap"], topic, partitions)
    values = json_values(LARGE_VALUE, 1000)
    stats: list[dict[str, Any]] = []
    acked = [0]
    errors: list[str] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            acked[0] += 1
        elif len(errors) < 5:
            errors.append(str(err))

    producer = Producer({
        "bootstrap.servers": spec["bootstrap"], "client.id": "bench-large", "acks": "1",
        "compression.type": "zstd", "linger.ms": spec["linger_ms"],
        "batch.size": spec["batch_size"],
        "message.max.bytes": max(1_000_000, spec["batch_size"] + 100_000),
        "queue.buffering.max.kbytes": 16 * 1024,  # what is queued at the end drains fast
        "statistics.interval.ms": 1000, "stats_cb": lambda text: stats.append(json.loads(text)),
        "enable.idempotence": False, "on_delivery": on_delivery})
    for i in range(spec["warmup"]):
        producer.produce(topic, values[i % len(values)], partition=i % partitions)
    if producer.flush(60):
        return {"error": "warm-up records were not delivered within 60 s"}
    stats.clear()
    acked[0] = 0
    print("ready", flush=True)
    rate = spec["rate"]
    start = time.perf_counter()
    deadline = start + spec["max_seconds"]  # stops by itself if nobody stops it
    i = 0
    while not stop.is_set() and time.perf_counter() < deadline:
        if rate and i > (time.perf_counter() - start) * rate:
            producer.poll(0.001)
            continue
        try:
            producer.produce(topic, values[i % len(values)], partition=i % partitions)
        except BufferError:  # the queue is full: the proxy and broker set the pace
            producer.poll(0.005)
            continue
        i += 1
        if not i % 256:
            producer.poll(0)
    seconds = time.perf_counter() - start
    records, failed = acked[0], list(errors)
    producer.purge(in_queue=True)  # what is still queued is not part of the measurement
    producer.flush(30)
    shape = batch_shape(stats, topic)
    return {"records": records, "seconds": seconds,
            "mbps": records * LARGE_VALUE / MB / seconds if seconds > 0 else None,
            "batch": None if shape is None else asdict(shape),
            "error": failed[0] if failed else None}


def _worker(kind: str, spec_text: str) -> int:
    spec = json.loads(spec_text)
    if kind == "small":
        print(json.dumps(small_producer(spec)), flush=True)
        return 0
    stop = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()  # the bench closes our stdin (or exits) to stop us
        stop.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    print(json.dumps(large_producer(spec, stop)), flush=True)
    return 0


def _command(kind: str, spec: Mapping[str, Any]) -> list[str]:
    return [sys.executable, "-m", "bench.neighbours", "--worker", kind, json.dumps(spec)]


def _last_json(out: str, err: str = "") -> dict[str, Any]:
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        tail = (err or out).strip().splitlines()[-3:]
        raise RuntimeError("a producer printed no result: " + " | ".join(tail))
    result: dict[str, Any] = json.loads(lines[-1])
    return result


class LargeProducer:
    """The large producer's process: started and warmed up on entry, stopped on exit.

    Its stderr (librdkafka's log) goes to ``log_path``, quoted when it fails.
    """

    def __init__(self, spec: Mapping[str, Any], log_path: Path) -> None:
        self.spec = dict(spec)
        self.log_path = log_path
        self.proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> LargeProducer:
        with open(self.log_path, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(_command("large", self.spec), cwd=ROOT, text=True,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 90)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "ready":
            self._end()
            said = line.strip() or self._log_tail() or "nothing"
            raise RuntimeError(f"the large producer did not start: {said[-300:]}")
        return self

    @property
    def pid(self) -> int:
        """The producer process's pid (its CPU is kept out of "other")."""
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> dict[str, Any]:
        """Stop producing and return the producer's report."""
        assert self.proc is not None and self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()
        self.proc.wait(90)  # its one line of output fits in the pipe
        return _last_json(self.proc.stdout.read(), self._log_tail())

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-3:])
        return ""

    def _end(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.kill()
        self.proc.wait(10)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._end()


# --------------------------------------------------------------------------- runs


def run_once(path: str, large: bool, round_: int, options: Options) -> Run:
    """One run: a fresh broker (and proxy), the large producer if asked, the small one."""
    run = Run(path=path, large=large, round=round_, load=os.getloadavg()[0])
    scenario = SCENARIOS["uppercase" if path == "kiproxy" else "direct"]
    large_out: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="bench-neighbours-") as tmp:
        try:
            with started(scenario, Path(tmp), []) as setup, contextlib.ExitStack() as stack:
                pids = dict(setup.pids)
                producer = None
                if large:
                    producer = stack.enter_context(LargeProducer({
                        "bootstrap": setup.bootstrap, "topic": f"large-{uuid.uuid4().hex[:8]}",
                        "partitions": options.large_partitions, "batch_size": options.batch_size,
                        "linger_ms": options.large_linger_ms, "rate": options.large_rate,
                        "warmup": 2000, "max_seconds": options.seconds + 120},
                        Path(tmp) / "large.log"))
                    pids["large"] = producer.pid
                small = subprocess.run(_command("small", {
                    "bootstrap": setup.bootstrap, "topic": f"small-{uuid.uuid4().hex[:8]}",
                    "linger_ms": options.small_linger_ms, "rate": options.rate,
                    "seconds": options.seconds, "warmup": options.warmup, "pids": pids}),
                    cwd=ROOT, capture_output=True, text=True, timeout=options.seconds + 180,
                    stdin=subprocess.DEVNULL, check=False)
                small_out = _last_json(small.stdout, small.stderr)
                if producer is not None:
                    large_out = producer.stop()
        except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
            run.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return run
    fill_run(run, small_out, large_out)
    return run


def run_rounds(options: Options, log: Callable[[str], None]) -> list[Run]:
    """Every run of :data:`RUNS`, ``options.rounds`` times, rotated each round."""
    runs: list[Run] = []
    names = [f"{path}/{int(large)}" for path, large in RUNS]
    for round_ in range(options.rounds):
        for name in rotated(names, round_):
            path, large = name.split("/")
            run = run_once(path, large == "1", round_, options)
            runs.append(run)
            log(_progress(run))
    return runs


def _progress(run: Run) -> str:
    head = f"  round {run.round + 1} {run.label:15}"
    if not run.ok or run.latency is None:
        return f"{head} FAILED: {run.error}"
    lat = run.latency
    large = ""
    if run.large:
        shape = run.large_batch
        large = (f"  large {num(run.large_mbps, '.1f')} MB/s, "
                 f"{num(shape.records if shape else None)} rec/batch, "
                 f"{num(shape.wire_bytes / 1000 if shape else None)} kB/batch")
    return (f"{head} small p50 {lat.p50_ms:.2f} p99 {lat.p99_ms:.2f} p99.9 {lat.p999_ms:.2f} "
            f"max {lat.max_ms:.1f} ms ({lat.count:,} records){large}  cores: "
            f"proxy {num(cores(run.proxy_cpu, run.seconds), '.2f')} "
            f"broker {num(cores(run.broker_cpu, run.seconds), '.2f')} "
            f"other {num(cores(run.other_cpu, run.seconds), '.2f')} "
            f"(load {num(run.load, '.2f')})")


def batch_cost(runs: Sequence[Run], options: Options) -> BatchCost:
    """CPU time of one large request through uppercase, in this process, no sockets.

    The batch holds as many records as the large producer's batches did through kiproxy
    (median), or as many 1 KiB records as ``batch.size`` holds if none was seen.
    """
    from bench.intercept import measure

    seen = median(r.large_batch.records for r in runs
                  if r.ok and r.path == "kiproxy" and r.large_batch is not None)
    records = round(seen) if seen else options.batch_size // (LARGE_VALUE + 8)
    out = measure(f"uppercase/{LARGE_VALUE}/zstd", records, 1, options.cost_seconds,
                  options.cost_repeats)
    return BatchCost(records=records, request_bytes=int(out["request_bytes"]),
                     ms=float(out["ms_per_request"]))


# --------------------------------------------------------------------------- report


def section(runs: Sequence[Run], cost: BatchCost, *, command: str, options: Options,
            load_before: tuple[float, float, float], elapsed: float) -> str:
    """The RESULTS.md section: how it was run, the table, the comparison, the reading."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    after = os.getloadavg()
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    large_pace = (f"paced at {options.large_rate:,.0f} records/s" if options.large_rate
                  else "as fast as it can")
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv)

- Date: {now}; code: {code_version()}; Python {platform.python_version()}
- Machine: {nproc} CPUs, {platform.system()} {platform.release()}; shared with other work: \
load average (1/5/15 min) {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} \
before, {after[0]:.2f} / {after[1]:.2f} / {after[2]:.2f} after; {elapsed / 60:.1f} min in all
- Setup (in full in the module docstring of `bench/neighbours.py`): a fresh Tansu broker \
(memory storage) per run, on the kiproxy path a fresh `kiproxy run --interceptor \
kiproxy.interceptors.builtin.uppercase:Uppercase`; loopback; each producer is confluent-kafka \
in its own process. Small: 100 B JSON values, acks=1, linger.ms={options.small_linger_ms:g}, \
one partition, paced at {options.rate:,.0f} records/s for {options.seconds:g} s; latency is \
librdkafka's produce-to-acknowledgement time of every record. Large: 1 KiB lower-case JSON \
values, zstd, batch.size={options.batch_size:,}, linger.ms={options.large_linger_ms:g}, acks=1, \
{options.large_partitions} partition(s), {large_pace}, own topic; MB/s are values acknowledged \
(before compression).
- {options.rounds} round(s) of the four runs, interleaved and rotated; medians. Cores are CPU \
seconds over the small producer's window, from /proc ("other": the rest of the machine). \
One batch's cost: `bench.intercept.measure`, `ProducePipeline.handle` with uppercase on one \
Produce v9 request of one batch, best of {options.cost_repeats} repeats.

{render_table(summarize(runs))}

```
{render_comparison(runs, cost)}
```

{reading(runs, cost)}
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.neighbours", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 round of 4 s windows (under a minute); prints without writing")
    p.add_argument("--rounds", type=int, help="rounds of the four runs (default 3, quick 1)")
    p.add_argument("--seconds", type=float,
                   help="the small producer's window (default 10, quick 4)")
    p.add_argument("--rate", type=float, default=1000.0, help="small producer records/s")
    p.add_argument("--small-linger-ms", type=float, default=0.0)
    p.add_argument("--large-linger-ms", type=float, default=50.0)
    p.add_argument("--batch-size", type=int, default=1_000_000,
                   help="the large producer's batch.size in bytes (records before compression)")
    p.add_argument("--large-partitions", type=int, default=1)
    p.add_argument("--large-rate", type=float, default=0.0,
                   help="large producer records/s (default 0: as fast as it can)")
    p.add_argument("--warmup", type=int, default=200, help="small producer warm-up records")
    p.add_argument("--write", action="store_true", help="update RESULTS.md even with --quick")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    p.add_argument("--worker", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the rounds and the batch cost, print the section, and update bench/RESULTS.md."""
    args = _parser().parse_args(argv)
    if args.worker:
        return _worker(*args.worker)

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    quick = args.quick
    options = Options(
        rounds=args.rounds or (1 if quick else 3), seconds=args.seconds or (4.0 if quick else 10.0),
        rate=args.rate, small_linger_ms=args.small_linger_ms,
        large_linger_ms=args.large_linger_ms, batch_size=args.batch_size,
        large_partitions=args.large_partitions, large_rate=args.large_rate, warmup=args.warmup,
        cost_seconds=0.1 if quick else 0.3, cost_repeats=3 if quick else 5)
    load_before = os.getloadavg()
    log(f"{options.rounds} round(s) x {len(RUNS)} runs of {options.seconds:g} s; load average "
        f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    began = time.monotonic()
    runs = run_rounds(options, log)
    cost = batch_cost(runs, options)
    log(f"  one batch's cost: {cost.ms:.2f} ms CPU ({cost.records:,} records, "
        f"{cost.request_bytes:,} bytes)")
    command = " ".join(["python -m bench.neighbours",
                        *(argv if argv is not None else sys.argv[1:])])
    text = section(runs, cost, command=command, options=options, load_before=load_before,
                   elapsed=time.monotonic() - began)
    print(text)
    if args.write or not (quick or args.no_write):
        write_results(text, "neighbours")
        log(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
