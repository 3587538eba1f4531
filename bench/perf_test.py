"""Apache Kafka's own load tool against Apache Kafka, direct and through kiproxy.

Run from the repository root with the project's virtualenv, after ``make kafka``::

    python -m bench.perf_test              # about two minutes; writes bench/RESULTS.md
    python -m bench.perf_test --no-write   # print the table only

It starts a 1-node Apache Kafka cluster (the launcher of ``kiproxy_dev.kafka_cluster``,
JVMs on 127.0.0.1) and two proxies in front of it, ``kiproxy run`` with no
interceptor (**passthrough**) and with ``--interceptor uppercase`` (**uppercase**:
every batch decoded, every value upper-cased, re-encoded), and runs
``org.apache.kafka.tools.ProducerPerformance`` (what ``kafka-producer-perf-test.sh``
runs, from the same jars) against each of **direct**, passthrough and uppercase, in
two phases: as fast as it can (``--throughput -1``) and paced at a fixed rate.
Every run has a topic of its own (3 partitions). The numbers are the tool's own
final line: records/s, MB/s (its MB: 2^20 bytes of record values), and its
latency average and percentiles (send to acknowledgement, ms). Scenarios of one
phase run back to back, so that drift on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.results import RESULTS, write_results
from kiproxy_dev.kafka_cluster import KafkaCluster, find_kafka_home
from kiproxy_dev.kafka_distribution import kafka_version_of
from kiproxy_dev.tansu import free_port

SECTION = "## Apache Kafka: kafka-producer-perf-test, direct and through kiproxy"
ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ("direct", "passthrough", "uppercase")
PRODUCER_PROPS = ("acks=all", "linger.ms=5", "compression.type=none")
FINAL = re.compile(
    r"(?P<records>\d+) records sent, (?P<rps>[\d.]+) records/sec \((?P<mbps>[\d.]+) MB/sec\), "
    r"(?P<avg>[\d.]+) ms avg latency, (?P<max>[\d.]+) ms max latency, (?P<p50>\d+) ms 50th, "
    r"(?P<p95>\d+) ms 95th, (?P<p99>\d+) ms 99th, (?P<p999>\d+) ms 99.9th")


@dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """The tool's final line for one scenario and phase."""

    scenario: str
    phase: str
    records: int
    records_per_s: float
    mb_per_s: float
    avg_ms: float
    p50_ms: int
    p95_ms: int
    p99_ms: int
    p999_ms: int
    max_ms: float


@contextmanager
def proxy(upstream: str, *flags: str) -> Iterator[str]:
    """``kiproxy run`` in front of ``upstream``; yields its bootstrap address."""
    listen = free_port()
    cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream, "--listen",
           f"127.0.0.1:{listen}", "--log-level", "WARNING", *flags]
    process = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert process.stdout is not None
        for line in process.stdout:
            if "bootstrap address" in line:
                break
        else:
            raise RuntimeError(f"kiproxy did not start: {' '.join(cmd)}")
        yield f"127.0.0.1:{listen}"
    finally:
        process.terminate()
        process.wait(30)


def create_topic(bootstrap: str, name: str) -> None:
    """Create ``name`` with 3 partitions and wait until its partitions are led."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})  # alive until the answer is in
    admin.create_topics([NewTopic(name, 3, 1)])[name].result(30)
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-wait"})
    try:
        deadline = time.monotonic() + 30
        for p in range(3):
            while True:
                try:
                    consumer.get_watermark_offsets(TopicPartition(name, p), timeout=5)
                    break
                except KafkaException:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
    finally:
        consumer.close()


def perf_test(kafka_home: Path, java: str, bootstrap: str, *, records: int, record_size: int,
              throughput: int, warmup: int) -> re.Match[str]:
    """Run ProducerPerformance once and return its final line, parsed."""
    topic = f"perf-{uuid.uuid4().hex[:8]}"
    create_topic(bootstrap, topic)
    log4j = kafka_home / "config" / "tools-log4j2.yaml"
    cmd = [java, "-Xmx512m", f"-Dlog4j2.configurationFile={log4j}",
           "-cp", str(kafka_home / "libs" / "*"), "org.apache.kafka.tools.ProducerPerformance",
           "--bootstrap-server", bootstrap, "--topic", topic, "--num-records", str(records),
           "--record-size", str(record_size), "--throughput", str(throughput),
           "--warmup-records", str(warmup), "--producer-props", *PRODUCER_PROPS]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    lines = [m for line in out.stdout.splitlines() if (m := FINAL.search(line))]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"ProducerPerformance failed ({out.returncode}):\n"
                           f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return lines[-1]  # with warm-up records, the last line covers the steady state


def run(kafka_home: Path, records: int, record_size: int, paced: int,
        warmup: int) -> tuple[list[Result], float]:
    """Every scenario in both phases; returns the results and the run's seconds."""
    started = time.monotonic()
    results: list[Result] = []
    with KafkaCluster(kafka_home, nodes=1, heap="1g") as cluster, \
            proxy(cluster.bootstrap) as passthrough, \
            proxy(cluster.bootstrap, "--interceptor", "uppercase") as uppercase:
        targets = {"direct": cluster.bootstrap, "passthrough": passthrough,
                   "uppercase": uppercase}
        # One discarded run first: the broker's JIT and page cache warm up before the
        # first measured scenario (direct), not during it.
        perf_test(kafka_home, cluster.java, cluster.bootstrap, records=records // 2,
                  record_size=record_size, throughput=-1, warmup=0)
        for phase, throughput, count in (("max", -1, records), ("paced", paced, records // 4)):
            for scenario in SCENARIOS:
                m = perf_test(kafka_home, cluster.java, targets[scenario], records=count,
                              record_size=record_size, throughput=throughput, warmup=warmup)
                results.append(Result(
                    scenario=scenario, phase=phase, records=int(m["records"]),
                    records_per_s=float(m["rps"]), mb_per_s=float(m["mbps"]),
                    avg_ms=float(m["avg"]), p50_ms=int(m["p50"]), p95_ms=int(m["p95"]),
                    p99_ms=int(m["p99"]), p999_ms=int(m["p999"]), max_ms=float(m["max"])))
                print(f"{phase:6} {scenario:12} {m[0]}", file=sys.stderr)
    return results, time.monotonic() - started


def table(results: Sequence[Result]) -> str:
    """The Markdown table; ``x direct`` is records/s against direct in the same phase."""
    direct = {r.phase: r.records_per_s for r in results if r.scenario == "direct"}
    rows = ["| phase | scenario | rec/s | MB/s | x direct | avg ms | p50 ms | p95 ms | "
            "p99 ms | p99.9 ms | max ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        rows.append(
            f"| {r.phase} | {r.scenario} | {r.records_per_s:,.0f} | {r.mb_per_s:.1f} | "
            f"{r.records_per_s / direct[r.phase]:.2f} | {r.avg_ms:.1f} | {r.p50_ms} | "
            f"{r.p95_ms} | {r.p99_ms} | {r.p999_ms} | {r.max_ms:.0f} |")
    return "\n".join(rows)


def section(results: Sequence[Result], seconds: float, args: argparse.Namespace, version: str,
            load_before: tuple[float, ...], load_after: tuple[float, ...]) -> str:
    """This benchmark's section of RESULTS.md."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True, check=False).stdout.strip()
    loads = " / ".join(f"{x:.2f}" for x in load_before)
    after = " / ".join(f"{x:.2f}" for x in load_after)
    command = "python -m bench.perf_test"
    if args.records != 200_000 or args.paced != 10_000:
        command += f" --records {args.records} --paced {args.paced}"
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv, after `make kafka`)

- Date: {now}; code: commit {commit or "unknown"}
- Machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, \
{platform.system()} {platform.release()}; shared with other work: load average {loads} \
(1/5/15 min) before the run, {after} after. Total run: {seconds:.0f} s.
- Broker: Apache Kafka {version}, 1 broker + 1 KRaft controller (JVMs on 127.0.0.1, \
broker heap 1 GiB, serial GC, C1 only: the test launcher's settings, not tuned for \
throughput); topics of 3 partitions, replication factor 1.
- Tool: `org.apache.kafka.tools.ProducerPerformance` (kafka-producer-perf-test) of the \
same release, one JVM per run; `--record-size {args.record_size}` (random upper-case \
letters), `--warmup-records {args.warmup}`, `--producer-props {" ".join(PRODUCER_PROPS)}`.
- Phases: one discarded run of {args.records // 2:,} records straight to the broker \
(warms the broker's JIT and page cache); then **max** `--num-records {args.records} \
--throughput -1`; **paced** `--num-records {args.records // 4} --throughput {args.paced}`. \
Scenarios of a phase run back to back, each once: a single run each, on a shared machine, \
so differences of some 10-20% between scenarios are within the noise.
- Scenarios: **direct** (the tool to the broker), **passthrough** (`kiproxy run`, no \
interceptor), **uppercase** (`kiproxy run --interceptor uppercase`: decode, transform, \
re-encode every batch).
- Figures are the tool's final line (after warm-up): MB/s in its units (2^20 bytes of \
record values), latency from send to acknowledgement in ms.

{table(results)}
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table, and update bench/RESULTS.md."""
    parser = argparse.ArgumentParser(prog="python -m bench.perf_test", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kafka-home", type=Path, default=None,
                        help="Apache Kafka distribution (default: the `make kafka` folder)")
    parser.add_argument("--records", type=int, default=200_000,
                        help="records of the max phase (the paced phase sends a quarter)")
    parser.add_argument("--record-size", type=int, default=1024)
    parser.add_argument("--paced", type=int, default=10_000,
                        help="records/s of the paced phase")
    parser.add_argument("--warmup", type=int, default=10_000, help="warm-up records per run")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    home = args.kafka_home or find_kafka_home()
    if home is None:
        print("no Apache Kafka found: run `make kafka` (or pass --kafka-home)", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    results, seconds = run(home, args.records, args.record_size, args.paced, args.warmup)
    text = section(results, seconds, args, kafka_version_of(home), load_before,
                   os.getloadavg())
    print(text)
    if not args.no_write:
        write_results(text, "perf-test")
        print(f"wrote {RESULTS}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
