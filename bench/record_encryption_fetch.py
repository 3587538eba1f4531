"""A consumer through the proxy with and without ``record_encryption``: throughput and the
proxy's CPU per GB of values fetched.

Run from the repository root with the project's virtualenv::

    python -m bench.record_encryption_fetch            # writes bench/RESULTS.md
    python -m bench.record_encryption_fetch --no-write --records 20000

One embedded broker (Tansu, memory storage) holds two copies of the same records (1 KiB
JSON-like values, 16-byte keys, uncompressed, batches of about 64 KiB): ``plain``
written straight to it, ``sealed`` written through a proxy with ``record_encryption``
(key file). A confluent-kafka consumer (``fetch.max.bytes`` 50 MB, one partition) then
reads a topic from offset 0 to the end, timed, in five ways, interleaved over
``--rounds`` rounds:

* **direct**: ``plain`` from the broker (no hop);
* **passthrough**: ``plain`` through a proxy with no interceptor (Fetch answers
  forwarded as bytes);
* **hook, nothing sealed**: ``plain`` through the ``record_encryption`` proxy (each
  batch decoded and looked at, forwarded as its bytes);
* **passthrough, sealed**: ``sealed`` through the proxy with no interceptor (the
  consumer gets the ciphertext records: what reading the larger stored records costs,
  without decrypting them);
* **decrypt**: ``sealed`` through the ``record_encryption`` proxy.

With ``--consumers N`` the topics have N partitions and N consumers, each in its own
process and reading one partition, start together: the time is until the last is done.
One consumer is bound by the time each fetch takes (it sends its next fetch once the
answer is in), so an answer's work in the proxy is added to every fetch whole; several
keep the proxy, the broker and each other busy on the shared cores, which is the
throughput ceiling the CPU sets.

With ``--pin`` the proxies run on a CPU of their own and the broker and the consumers
on another (the first two this process may use), as a proxy deployed with its own CPU
budget runs beside the cluster and its clients: the proxy's work then costs the
consumers time only where they wait for it.

Figures: the consumers' MB/s of values (wall clock: the machine is shared, so these
move with its load; medians over the rounds), "x direct" and "x passthrough" (the
median of each round's ratio, the cases of a round being read back to back, which
cancels most of the machine's drift), the proxy process's and the broker's CPU seconds
per GB of values (``/proc``, the figures that move least with the load; medians), and,
for one consumer, the CPUs the whole machine kept busy while it read: well under all of
them when the broker, the proxy and the consumer take turns on each answer, so that
each one's time per answer adds to the next fetch's wait.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.proxy.cpu import machine_busy_cpu, process_cpu
from bench.proxy.scenarios import ROOT, TANSU_NODE_ID
from bench.record_encryption import _value
from bench.results import write_results
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file
from kiproxy_dev.tansu import EmbeddedBroker, free_port

__all__ = ["main"]

VALUE_BYTES = 1024


@contextmanager
def _proxy(upstream: str, *flags: str, cpus: set[int] | None = None
           ) -> Iterator[tuple[str, int]]:
    listen = free_port()
    start = next(p - TANSU_NODE_ID for p in iter(free_port, 0) if p - TANSU_NODE_ID > 1024)
    pin = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus)))] if cpus else []
    proc = subprocess.Popen(
        [*pin, sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
         "--listen", f"127.0.0.1:{listen}", "--broker-port-start", str(start),
         "--log-level", "WARNING", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
        stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    ready, lines = threading.Event(), []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "bootstrap address" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        if not ready.wait(60) or proc.poll() is not None:
            raise RuntimeError("kiproxy did not start:\n" + "".join(lines))
        yield f"127.0.0.1:{listen}", proc.pid
    finally:
        proc.terminate()
        proc.wait(20)


def _cpu(pid: int | None) -> float:
    """CPU seconds of process ``pid`` so far (0.0 for None or where ``/proc`` says nothing)."""
    return (process_cpu(pid) or 0.0) if pid else 0.0


def _produce(bootstrap: str, topic: str, records: int, partitions: int) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                         "batch.size": 64 * 1024, "compression.type": "none"})
    for i in range(records):
        producer.produce(topic, value=_value(i, VALUE_BYTES), key=b"customer-%07d" % i,
                         partition=i % partitions)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(60) == 0


def _create_topics(bootstrap: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(t, partitions, 1)
                                       for t in ("plain", "sealed")]).values():
        future.result(30)


def _consume(bootstrap: str, topic: str, records: int, partition: int = 0,
             start_at: float | None = None) -> tuple[float, bytes]:
    """Seconds to read ``records`` records of ``topic``'s ``partition`` from offset 0,
    up to its last record (the consumer's close is not counted); the first value.
    With ``start_at`` (a ``time.time()``) the partition is assigned then, and the
    seconds are counted from it (a consumer not ready by then is an error)."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-enc",
                         "enable.auto.commit": False, "fetch.max.bytes": 50 * 1024 * 1024,
                         "max.partition.fetch.bytes": 10 * 1024 * 1024})
    try:
        if start_at is not None:
            consumer.list_topics(topic, timeout=30)  # connected before the start
            early = start_at - time.time()
            if early < 0:
                raise RuntimeError(f"consumer of {topic}-{partition} ready {-early:.2f} s "
                                   "after the common start")
            time.sleep(early)
        consumer.assign([TopicPartition(topic, partition, 0)])
        start, seen, first = time.monotonic(), 0, b""
        while seen < records:
            for msg in consumer.consume(min(1000, records - seen), 5.0):
                if msg.error():
                    raise RuntimeError(f"consumer error: {msg.error()}")
                if not seen:
                    first = msg.value() or b""
                seen += 1
            if time.monotonic() - start > 300:
                raise RuntimeError(f"read {seen} of {records} records in 300 s")
        if start_at is not None:
            return time.time() - start_at, first
        return time.monotonic() - start, first
    finally:
        consumer.close()


def _read(pool: Any, bootstrap: str, topic: str, records: int, consumers: int
          ) -> tuple[float, bytes]:
    """Seconds for ``consumers`` consumers at once (one partition each) to read
    ``records`` records of ``topic`` between them, from their common start to the last
    one's last record; the first value of partition 0."""
    if consumers == 1:
        return _consume(bootstrap, topic, records)
    start_at = time.time() + 3.0
    done = pool.starmap(_consume, [(bootstrap, topic, records // consumers, p, start_at)
                                   for p in range(consumers)])
    return max(seconds for seconds, _ in done), done[0][1]


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=100_000,
                        help="records of 1 KiB per topic (default 100000)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    parser.add_argument("--consumers", type=int, default=1,
                        help="consumers at once, a partition each (default 1)")
    parser.add_argument("--pin", action="store_true",
                        help="the proxies on a CPU of their own (taskset), the rest on "
                        "another")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    n = args.consumers
    proxy_cpus: set[int] | None = None
    if args.pin:
        usable = sorted(os.sched_getaffinity(0))
        if len(usable) < 2:
            parser.error("--pin needs two CPUs")
        os.sched_setaffinity(0, {usable[0]})  # the broker and consumers started from here
        proxy_cpus = {usable[1]}
    records = args.records - args.records % n
    gb = records * VALUE_BYTES / 1e9
    results: dict[str, list[tuple[float, float]]] = {}
    others: dict[str, list[tuple[float, float]]] = {}  # broker CPU s/GB, busy CPUs
    with tempfile.TemporaryDirectory() as tmp, EmbeddedBroker() as broker, \
            (multiprocessing.get_context("spawn").Pool(n) if n > 1
             else contextlib.nullcontext()) as pool:
        keys = Path(tmp) / "keys.yaml"
        write_key_file(keys, {"KEK": (1, {1: os.urandom(32)})})
        config = json.dumps({"kms": {"type": "key_file", "path": str(keys)}, "key": "KEK",
                             "topics": ["sealed"]})
        if n > 1:
            _create_topics(broker.bootstrap, n)
        with _proxy(broker.bootstrap, "--interceptor", "record_encryption",
                    "--interceptor-config", config, cpus=proxy_cpus) as (hooked, hooked_pid), \
                _proxy(broker.bootstrap, cpus=proxy_cpus) as (plain_proxy, plain_pid):
            _produce(broker.bootstrap, "plain", records, n)
            _produce(hooked, "sealed", records, n)
            cases: dict[str, tuple[str, str, int | None]] = {
                "direct": (broker.bootstrap, "plain", None),
                "passthrough": (plain_proxy, "plain", plain_pid),
                "hook, nothing sealed": (hooked, "plain", hooked_pid),
                "passthrough, sealed": (plain_proxy, "sealed", plain_pid),
                "decrypt": (hooked, "sealed", hooked_pid),
            }
            for _ in range(args.rounds):
                for name, (bootstrap, topic, pid) in cases.items():
                    before = process_cpu(pid) if pid else None
                    broker_before, busy_before = _cpu(broker.pid), machine_busy_cpu()
                    started = time.monotonic()
                    seconds, first = _read(pool, bootstrap, topic, records, n)
                    wall = time.monotonic() - started
                    busy_after = machine_busy_cpu()
                    # (several consumers wait for a common start inside the read: their
                    # start-up would count, so the figure is one consumer's only)
                    busy = float("nan") if busy_before is None or busy_after is None \
                        or n > 1 else (busy_after - busy_before) / wall
                    others.setdefault(name, []).append(
                        ((_cpu(broker.pid) - broker_before) / gb, busy))
                    if name != "passthrough, sealed":
                        assert first == _value(0, VALUE_BYTES), f"{name}: not the plaintext"
                    else:
                        assert first != _value(0, VALUE_BYTES), f"{name}: the plaintext"
                    after = process_cpu(pid) if pid else None
                    cpu = (after - before) if before is not None and after is not None \
                        else float("nan")
                    results.setdefault(name, []).append((seconds, cpu))
    rows = []
    for name, runs in results.items():
        seconds = statistics.median(s for s, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        cpu_text = "—" if cpu != cpu else f"{cpu / gb:.1f}"
        paired = [statistics.median(against[i][0] / runs[i][0] for i in range(len(runs)))
                  for against in (results["direct"], results["passthrough"])]
        broker_cpu = statistics.median(b for b, _ in others[name])
        busy = statistics.median(c for _, c in others[name])
        busy_text = "—" if busy != busy else f"{busy:.2f}"
        rows.append(f"| {name} | {gb * 1000 / seconds:.0f} | {paired[0]:.2f} | "
                    f"{paired[1]:.2f} | {cpu_text} | {broker_cpu:.1f} | {busy_text} |")
    load = os.getloadavg()
    text = "\n".join([
        "## record_encryption: a consumer's throughput through the proxy, with and without "
        "decryption",
        "",
        "Command: `python -m bench.record_encryption_fetch"
        f"{f' --consumers {n}' if n > 1 else ''}{' --pin' if args.pin else ''} "
        f"--rounds {args.rounds}` (from the repository root, project virtualenv)",
        "",
        f"- Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; machine: "
        f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}; "
        f"shared with other work (load average {load[0]:.2f} / {load[1]:.2f} / "
        f"{load[2]:.2f}); "
        + ("the proxy on a CPU of its own, the broker and the consumers on another."
           if args.pin else "broker, proxy and consumers on the same cores."),
        f"- {records:,} records of 1 KiB values (uncompressed, batches of about 64 "
        "KiB) read from offset 0 by "
        + ("a confluent-kafka consumer" if n == 1 else
           f"{n} confluent-kafka consumers at once, in processes of their own, one "
           f"partition of {records // n:,} records each")
        + f"; {args.rounds} interleaved rounds; MB/s of values (wall clock, median), "
        "x direct and x passthrough (median of the rounds' ratios), proxy and broker "
        "CPU s per GB of values (`/proc`, medians), and the CPUs the whole machine kept "
        f"busy while the consumers read (of {len(os.sched_getaffinity(0))}; median).",
        "",
        "| case | MB/s | x direct | x passthrough | proxy CPU s/GB | broker CPU s/GB "
        "| busy CPUs |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
    ])
    print(text)
    if not args.no_write:
        write_results(text, "record-encryption-fetch" + ("" if n == 1 else "-consumers")
                      + ("-pinned" if args.pin else ""))
    return text


if __name__ == "__main__":
    main()
