"""Fetch-side hook benchmark: a consumer's throughput and the proxy's CPU per GB read.

Run from the repository root with the project's virtualenv::

    python -m bench.fetch_hook            # writes bench/RESULTS.md
    python -m bench.fetch_hook --no-write # print only

One Tansu broker (memory storage) holds one topic per value size and codec (100 B and
1 KiB values, none and zstd, ``--mb`` MB of values each, written straight to the
broker). A confluent-kafka consumer reads each topic from the start, by assignment:

* **direct**: to the broker;
* **no hook**: through a proxy with no fetch-side hook (answers pass as bytes);
* **other topic hooked**: through a proxy whose only route hooks another topic (the
  answer's layout is read, nothing decoded);
* **identity hook**: a hook that returns each batch as it is (every batch decoded);
* **reverse hook**: a hook that reverses every value (decoded and re-encoded);
* any ``--plugin NAME=SPEC[:JSON]`` given (e.g. ``record_encryption`` with a key file).

Figures per case: the consumer's MB/s of values (wall clock; the median of
``--repeats`` reads, cases interleaved), its ratio to direct, and the proxy's CPU
seconds per GB of values (user + system, from /proc, the median). The machine is
shared: compare within a run.
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
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.proxy.cpu import process_cpu
from bench.results import write_results
from kiproxy_dev.tansu import EmbeddedBroker, free_port

ROOT = Path(__file__).resolve().parents[1]
PLUGINS = ROOT / "bench" / "plugins"
SIZES = (100, 1024)
CODECS = ("none", "zstd")


def _launch(upstream: str, routes: list[dict[str, Any]] | None, workdir: Path
            ) -> tuple[subprocess.Popen[str], str]:
    listen = free_port()
    cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
           "--listen", f"127.0.0.1:{listen}", "--broker-port-start", str(free_port()),
           "--plugins-dir", str(PLUGINS), "--log-level", "WARNING"]
    if routes is not None:
        config = workdir / f"routes-{uuid.uuid4().hex[:6]}.json"
        config.write_text(json.dumps({"routes": routes}))
        cmd += ["--config", str(config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "bootstrap address" in line:
            break
    else:
        raise RuntimeError(f"proxy did not start: {' '.join(cmd)}")
    return proc, f"127.0.0.1:{listen}"


def _fill(bootstrap: str, topic: str, size: int, codec: str, mb: int) -> int:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "compression.type": codec,
                         "linger.ms": 50, "batch.size": 1_000_000})
    count = mb * 1_000_000 // size
    value = os.urandom(size // 2).hex().encode()[:size]
    for i in range(count):
        while True:
            try:
                producer.produce(topic, value=value, key=str(i % 100).encode(), partition=0)
                break
            except BufferError:
                producer.poll(0.1)
    assert producer.flush(60) == 0
    return count


def _read(bootstrap: str, topic: str, count: int) -> float:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False, "fetch.max.bytes": 52_428_800})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        seen = 0
        start = time.perf_counter()
        while seen < count:
            for m in consumer.consume(10_000, 1.0):
                if m.error() is None:
                    seen += 1
            if time.perf_counter() - start > 300:
                raise RuntimeError(f"{topic}: {seen} of {count} records in 300 s")
        return time.perf_counter() - start
    finally:
        consumer.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=50, help="MB of values per topic")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--plugin", action="append", default=[],
                        help="NAME=SPEC or NAME=SPEC=JSON: one more hooked case")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    hooked: dict[str, tuple[str, dict[str, Any]]] = {
        "identity hook": ("fetch_hooks:Identity", {}),
        "reverse hook": ("fetch_hooks:Reverse", {})}
    for item in args.plugin:
        name, spec, *config = item.split("=", 2)
        hooked[name] = (spec, json.loads(config[0]) if config else {})
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        broker = EmbeddedBroker(log_path=workdir / "broker.log")
        broker.start()
        proxies: dict[str, tuple[subprocess.Popen[str], str]] = {}
        try:
            topics: dict[tuple[int, str], tuple[str, int]] = {}
            for size in SIZES:
                for codec in CODECS:
                    name = f"bench-{size}-{codec}-{uuid.uuid4().hex[:6]}"
                    topics[size, codec] = (name, _fill(broker.bootstrap, name, size, codec,
                                                       args.mb))
            proxies["no hook"] = _launch(broker.bootstrap, None, workdir)
            proxies["other topic hooked"] = _launch(broker.bootstrap, [
                {"match": {"topic": "elsewhere"},
                 "interceptors": [{"class": "fetch_hooks:Identity"}]}], workdir)
            for name, (spec, config) in hooked.items():
                proxies[name] = _launch(broker.bootstrap, [
                    {"match": {"topic": "bench-.*"},
                     "interceptors": [{"class": spec, "config": config}]}], workdir)
            cases = ["direct", *proxies]
            rows = []
            for (size, codec), (topic, count) in topics.items():
                walls: dict[str, list[float]] = {c: [] for c in cases}
                cpus: dict[str, list[float]] = {c: [] for c in cases}
                for _ in range(args.repeats):
                    for case in cases:
                        if case == "direct":
                            walls[case].append(_read(broker.bootstrap, topic, count))
                            continue
                        proc, bootstrap = proxies[case]
                        before = process_cpu(proc.pid) or 0.0
                        walls[case].append(_read(bootstrap, topic, count))
                        cpus[case].append((process_cpu(proc.pid) or 0.0) - before)
                gb = count * size / 1e9
                direct = statistics.median(walls["direct"])
                for case in cases:
                    wall = statistics.median(walls[case])
                    cpu = statistics.median(cpus[case]) / gb if cpus[case] else None
                    rows.append(f"| {size} B | {codec} | {case} | {gb * 1000 / wall:.0f} | "
                                f"{direct / wall:.2f} | "
                                f"{'—' if cpu is None else f'{cpu:.1f}'} |")
                    print(rows[-1], flush=True)
        finally:
            for proc, _ in proxies.values():
                proc.terminate()
                proc.wait(10)
            broker.stop()
    command = "python -m bench.fetch_hook " + " ".join(argv if argv is not None else sys.argv[1:])
    text = "\n".join([
        "<!-- bench:fetch-hook -->",
        "## Fetch-side hook: a consumer's throughput and the proxy's CPU per GB",
        "",
        f"Command: `{command.strip()}` (from the repository root, project virtualenv)",
        "",
        f"- {datetime.date.today()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}; one Tansu broker; "
        f"{args.mb} MB of values per topic, medians of {args.repeats} reads.",
        "",
        "| values | codec | case | consumer MB/s | vs direct | proxy CPU s/GB |",
        "|---|---|---|---|---|---|",
        *rows,
        "<!-- /bench:fetch-hook -->",
    ])
    if not args.no_write:
        write_results(text, "fetch-hook")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
