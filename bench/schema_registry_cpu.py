"""The proxy's CPU per GB with the ``schema_registry`` check, against passthrough, in one run.

Run from the repository root with the project's virtualenv (``make registry``
builds Apicurio Registry; the bench starts it, and Tansu, itself)::

    .venv/bin/python -m bench.schema_registry_cpu              # writes bench/RESULTS.md
    .venv/bin/python -m bench.schema_registry_cpu --no-write   # print only

For each value size (100 B and 1 KiB), a ``kiproxy run`` process in front of
Tansu is started per case: ``passthrough`` (no interceptor), ``id`` (``value:
id``) and ``avro`` (``value: payload``: every record's Avro payload checked
against its registered 10-field schema). One confluent-kafka producer sends
``--megabytes`` of Confluent-framed Avro values (written once with
confluent-kafka's ``AvroSerializer``, uncompressed, ``linger.ms=5``) as fast as
the proxy takes them; the figure is the proxy process's CPU seconds (utime +
stime from ``/proc``) per 10^9 bytes of values, over the produce alone. Each
case runs ``--rounds`` times, rotated; the median is reported with the spread.
The ratio to passthrough is the issue's measure (the Avro check at 1 KiB within
3x passthrough's CPU per GB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.proxy.cpu import process_cpu
from bench.schema_registry import AVRO, registry, sized

HEADING = ("## schema_registry in the proxy: CPU per GB against passthrough "
           "(bench/schema_registry_cpu.py)")
CASES = ("passthrough", "id", "avro")


def start_proxy(upstream: str, case: str, url: str, topic: str) -> tuple[subprocess.Popen[str],
                                                                         str]:
    from kiproxy_dev.tansu import free_port

    listen = free_port()
    command = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
               "--listen", f"127.0.0.1:{listen}",
               "--broker-port-start", str(free_port() - 111)]
    if case != "passthrough":
        level = "id" if case == "id" else "payload"
        command += ["--interceptor", "schema_registry", "--interceptor-config", json.dumps(
            {"registry": {"url": url}, "topics": {topic: {"value": level}}})]
    proxy = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    assert proxy.stdout is not None
    for line in proxy.stdout:
        if "bootstrap address" in line:
            return proxy, f"127.0.0.1:{listen}"
    raise RuntimeError(f"the proxy did not start ({case}): exit {proxy.wait()}")


def produce(bootstrap: str, topic: str, values: list[bytes], total: int) -> None:
    from confluent_kafka import Producer

    failed: list[Any] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(err)

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1,
                         "batch.size": 1_000_000, "queue.buffering.max.kbytes": 262144,
                         "compression.type": "none"})
    for i in range(total):
        while True:
            try:
                producer.produce(topic, values[i % len(values)], partition=0,
                                 on_delivery=delivered)
                break
            except BufferError:
                producer.poll(0.005)
        if i % 1000 == 0:
            producer.poll(0)
    if producer.flush(60):
        raise RuntimeError("records were not acknowledged in 60 s")
    if failed:
        raise RuntimeError(f"{len(failed)} records were refused, first: {failed[0]}")


def measure(url: str, megabytes: int, rounds: int) -> dict[tuple[str, int], list[float]]:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    from kiproxy_dev.tansu import EmbeddedBroker

    run = str(int(time.time()))[-6:]
    topic = f"cpu{run}"
    serializer = AvroSerializer(SchemaRegistryClient({"url": url}), json.dumps(AVRO))
    out: dict[tuple[str, int], list[float]] = {}
    with EmbeddedBroker() as broker:
        admin = AdminClient({"bootstrap.servers": broker.bootstrap})
        for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
            future.result(15)
        for size in (100, 1024):
            values = [sized(lambda d: bytes(serializer(d, SerializationContext(
                topic, MessageField.VALUE))), size, i) for i in range(64)]
            total = megabytes * 1_000_000 // size
            volume = sum(len(values[i % len(values)]) for i in range(total))
            for n in range(rounds):
                for case in CASES[n % len(CASES):] + CASES[:n % len(CASES)]:
                    proxy, bootstrap = start_proxy(broker.bootstrap, case, url, topic)
                    try:
                        produce(bootstrap, topic, values[:8], 2000)  # connections, metadata
                        before = process_cpu(proxy.pid, tree=False)
                        produce(bootstrap, topic, values, total)
                        after = process_cpu(proxy.pid, tree=False)
                    finally:
                        proxy.terminate()
                        proxy.wait(30)
                    assert before is not None and after is not None
                    out.setdefault((case, size), []).append((after - before) / volume * 1e9)
    return out


def render(figures: dict[tuple[str, int], list[float]], command: str) -> str:
    lines = [HEADING, "",
             f"{datetime.date.today().isoformat()}, {platform.machine()} "
             f"({os.cpu_count()} cores, shared with other work), Python "
             f"{platform.python_version()}. Command: `{command}`. Proxy process CPU per 10^9 "
             "bytes of values, median of the rounds (min-max); one producer, uncompressed "
             "batches, Tansu upstream.", "",
             "| check | value | proxy CPU s/GB | x passthrough | rounds (min-max) |",
             "|---|---|---:|---:|---|"]
    for size in (100, 1024):
        base = statistics.median(figures[("passthrough", size)])
        for case in CASES:
            runs = figures[(case, size)]
            med = statistics.median(runs)
            lines.append(f"| {case} | {size} B | {med:.2f} | {med / base:.2f} | "
                         f"{len(runs)} ({min(runs):.2f}-{max(runs):.2f}) |")
    ratio = (statistics.median(figures[("avro", 1024)])
             / statistics.median(figures[("passthrough", 1024)]))
    lines += ["", f"Against the issue's target: the Avro payload check at 1 KiB costs "
              f"{ratio:.2f}x passthrough's CPU per GB (target: within 3x)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Run the cases, print the table, record it (unless ``--no-write``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--registry-url")
    parser.add_argument("--megabytes", type=int, default=200, help="of values, per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    with registry(args.registry_url) as url:
        figures = measure(url, args.megabytes, args.rounds)
    command = (f"python -m bench.schema_registry_cpu --megabytes {args.megabytes} "
               f"--rounds {args.rounds}")
    text = render(figures, command)
    print(text)
    if not args.no_write:
        from bench.results import write_results
        write_results(text, "schema-registry-cpu")


if __name__ == "__main__":
    main()
