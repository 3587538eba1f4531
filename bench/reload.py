"""Produce latency while the proxy reloads, against the same paced stream without reloads.

Run: ``python -m bench.reload [--rate 2000] [--seconds 20] [--reloads 20]``.

An embedded broker, ``kiproxy run`` with a plugin that appends a suffix, and a
confluent-kafka producer sending at a fixed rate (1 KiB values, acks=1,
linger.ms=5). Two rounds of the same stream: one without reloads, one with
``--reloads`` reloads by ``POST /reload`` evenly spread, each rewriting the
plugin to the other suffix. Reported: p50/p99/max produce latency of each
round, how long each reload took (trigger to applied), and the time from a
trigger to the first record that carries the new suffix (read back from the
topic). Written to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from bench.results import write_results
from kiproxy_dev.tansu import EmbeddedBroker, free_port

HEADING = "## Hot reload: produce latency during 20 reloads"
PLUGIN = '''
from kiproxy.interceptors import ProduceRequestInterceptor

SUFFIX = {suffix!r}


class Suffix(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(r.with_value(r.value + SUFFIX) for r in batch.records)
'''


def _write_plugin(plugins: Path, suffix: bytes) -> None:
    tmp = plugins / ".suffix.tmp"
    tmp.write_text(PLUGIN.format(suffix=suffix))
    tmp.replace(plugins / "suffix.py")


def _reload(metrics: str) -> float:
    started = time.monotonic()
    request = urllib.request.Request(f"http://{metrics}/reload", method="POST", data=b"")
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert json.loads(answer.read())["ok"] is True
    return time.monotonic() - started


def _round(bootstrap: str, topic: str, rate: int, seconds: float, plugins: Path,
           metrics: str, reloads: int) -> dict[str, Any]:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": 1})
    latencies: list[float] = []
    sent_at: dict[int, float] = {}
    triggers: list[tuple[float, bytes]] = []
    durations: list[float] = []

    def report(err: Any, msg: Any) -> None:
        if err is None:
            latencies.append(time.monotonic() - sent_at[int(msg.key())])

    stop = threading.Event()

    def reloader() -> None:
        gap = seconds / (reloads + 2)  # every reload lands inside the stream
        for i in range(reloads):
            if stop.wait(gap):
                return
            suffix = b"-B" if i % 2 == 0 else b"-A"
            _write_plugin(plugins, suffix)
            triggers.append((time.monotonic(), suffix))
            durations.append(_reload(metrics))

    thread = threading.Thread(target=reloader, daemon=True)
    if reloads:
        thread.start()
    value = b"x" * 1024
    total = int(rate * seconds)
    start = time.monotonic()
    for i in range(total):
        due = start + i / rate
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        sent_at[i] = time.monotonic()
        producer.produce(topic, key=b"%d" % i, value=value, partition=0, on_delivery=report)
        producer.poll(0)
    producer.flush(60)
    stop.set()
    if reloads:
        thread.join(60)
    switch = _switch_delays(bootstrap, topic, total, sent_at, triggers) if reloads else []
    ordered = sorted(latencies)
    return {"records": len(latencies), "p50": statistics.median(ordered) * 1000,
            "p99": ordered[int(len(ordered) * 0.99) - 1] * 1000, "max": ordered[-1] * 1000,
            "reload_ms": [d * 1000 for d in durations], "switch_ms": switch}


def _switch_delays(bootstrap: str, topic: str, total: int, sent_at: dict[int, float],
                   triggers: list[tuple[float, bytes]]) -> list[float]:
    """Per reload: trigger to the send time of the first later record with the new suffix."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": uuid.uuid4().hex,
                         "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, 0, 0)])
    suffix_of: dict[int, bytes] = {}
    deadline = time.monotonic() + 120
    while len(suffix_of) < total and time.monotonic() < deadline:
        msg = consumer.poll(1)
        if msg is None or msg.error() is not None:
            continue
        key, value = msg.key(), msg.value()
        if key is not None and value is not None:
            suffix_of[int(key)] = bytes(value)[-2:]
    consumer.close()
    delays = []
    for at, suffix in triggers:
        first = next((sent_at[k] for k in sorted(sent_at) if sent_at[k] >= at
                      and suffix_of.get(k) == suffix), None)
        if first is not None:
            delays.append((first - at) * 1000)
    return delays


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reload")
    parser.add_argument("--rate", type=int, default=2000, help="records per second")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reloads", type=int, default=20)
    args = parser.parse_args(argv)
    broker = EmbeddedBroker()
    broker.start()
    work = Path(tempfile.mkdtemp(prefix="kiproxy-bench-reload-"))
    plugins = work / "plugins"
    plugins.mkdir()
    _write_plugin(plugins, b"-A")
    metrics = f"127.0.0.1:{free_port()}"
    listen = free_port()
    config = work / "proxy.yaml"
    config.write_text(f"upstream: [{broker.bootstrap}]\nplugins_dir: {plugins}\n"
                      f"metrics_listen: {metrics}\nlisten: 127.0.0.1:{listen}\n"
                      "interceptor:\n  class: suffix:Suffix\nlog_level: WARNING\n")
    proxy = subprocess.Popen([sys.executable, "-m", "kiproxy", "run", "--config", str(config)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proxy.stdout is not None
        seen = []
        for line in proxy.stdout:
            seen.append(line)
            if "bootstrap address" in line:
                break
        else:
            raise SystemExit("kiproxy did not start:\n" + "".join(seen))
        bootstrap = f"127.0.0.1:{listen}"
        rounds = {}
        for name, reloads in (("without reloads", 0), (f"with {args.reloads} reloads",
                                                       args.reloads)):
            topic = f"bench-reload-{uuid.uuid4().hex[:8]}"
            rounds[name] = _round(bootstrap, topic, args.rate, args.seconds, plugins,
                                  metrics, reloads)
    finally:
        proxy.terminate()
        proxy.wait(30)
        broker.stop()
    load = os.getloadavg()[0]
    lines = [HEADING, "",
             f"Command: `python -m bench.reload --rate {args.rate} --seconds {args.seconds:g} "
             f"--reloads {args.reloads}`", "",
             f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; 1-minute load average "
             f"{load:.1f} on {os.cpu_count()} cores (a shared machine: read the ratios).",
             f"- A paced stream of {args.rate} records/s (1 KiB, acks=1, linger.ms=5) for "
             f"{args.seconds:g} s through a transforming plugin; the reloads rewrite the "
             "plugin file and `POST /reload`, evenly spread.", "",
             "| round | records | p50 ms | p99 ms | max ms |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for name, r in rounds.items():
        lines.append(f"| {name} | {r['records']} | {r['p50']:.2f} | {r['p99']:.2f} | "
                     f"{r['max']:.1f} |")
    with_reloads = rounds[f"with {args.reloads} reloads"]
    if with_reloads["reload_ms"]:
        d, s = with_reloads["reload_ms"], with_reloads["switch_ms"]
        lines += ["", f"- Trigger to applied (`POST /reload` answered): median "
                  f"{statistics.median(d):.0f} ms, max {max(d):.0f} ms, over {len(d)} reloads."]
        if s:
            lines.append(f"- Trigger to the first record sent that carries the new suffix: "
                         f"median {statistics.median(s):.0f} ms, max {max(s):.0f} ms "
                         f"({len(s)} of {len(d)} reloads seen in the stream).")
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(text, "reload")
    return 0


if __name__ == "__main__":
    sys.exit(main())
