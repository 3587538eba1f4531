"""A misbehaving schema registry: what the checked producer gets, what the other topics'
producers pay, and the proxy's memory, per fault.

Run from the repository root with the project's virtualenv::

    python -m bench.registry_faults                         # this tree only
    python -m bench.registry_faults --baseline /work/main   # also a baseline tree

Per tree: two ``kiproxy run`` processes (``schema_registry``, ``value: payload`` on one
topic, ``on_registry_unavailable: reject`` and ``pass``, ``timeout_ms`` 800,
``negative_ttl_s`` 1) in front of an embedded Tansu broker, against the stand-in
registry of ``tests/faults/registry_standin.py`` (in a process of its own). Per fault
phase (healthy first, as a control): a confluent-kafka producer (``retries: 0``) sends
``--lookups`` records, each framed with an id the proxies have not seen, one at a time,
to each proxy; meanwhile two producers send one small record at a time to a topic with
no contract, one through the ``reject`` proxy and one direct to the broker (its latency
is the machine's own, the baseline). Reported per phase: the checked producer's answers,
the other topic's p50/p99 produce-to-acknowledgement latency through the proxy and
direct, the ``reject`` proxy's RSS before, at its peak and 2 s after the phase, and its
WARNING/ERROR lines. Latencies on a shared 2-core machine are noisy: compare the two
columns of one row, not rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the stand-in registry of tests/faults

from faults.registry_standin import (  # type: ignore[import-not-found]  # noqa: E402
    StandInRegistry,
)
from hardening.bombs import RssSampler, rss_of  # noqa: E402

from kiproxy_dev.tansu import EmbeddedBroker, free_port  # noqa: E402

ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "double"}]}
BODY = b"\x02x" + struct.pack("<d", 1.0)
PHASES = ("healthy", "hang", "http500", "garble", "flood", "flood_chunked", "large",
          "trickle", "uncompilable", "closed")


def _serve(conn: Connection) -> None:
    """The stand-in registry in a process of its own, driven over ``conn``: sending 50 MB
    answers must not cost the measuring producers of this process their GIL."""
    registry = StandInRegistry()
    conn.send(registry.url)
    while True:
        command, *args = conn.recv()
        if command == "close":
            registry.close()
            conn.send(None)
            return
        getattr(registry, command)(*args)
        conn.send(None)


class RemoteStandIn:
    """:class:`StandInRegistry` in a child process (``register``, ``phase``, ``close``)."""

    def __init__(self) -> None:
        self._conn, child = multiprocessing.get_context("spawn").Pipe()
        self._proc = multiprocessing.get_context("spawn").Process(
            target=_serve, args=(child,), daemon=True)
        self._proc.start()
        self.url: str = self._conn.recv()

    def _call(self, *command: Any) -> None:
        self._conn.send(command)
        self._conn.recv()

    def register(self, schema_id: int, schema: dict[str, Any], subject: str) -> None:
        self._call("register", schema_id, schema, subject)

    @contextlib.contextmanager
    def phase(self, mode: str) -> Iterator[None]:
        self._call("set_mode", mode)
        try:
            yield
        finally:
            self._call("set_mode", "healthy")

    def close(self) -> None:
        self._call("close")
        self._proc.join(10)


class Proxy:
    """``kiproxy run`` from ``tree`` with the schema_registry interceptor; keeps its log."""

    def __init__(self, tree: Path, upstream: str, config: dict[str, Any]) -> None:
        listen = free_port()
        cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
               "--listen", f"127.0.0.1:{listen}", "--broker-port-start",
               str(free_port() - 111), "--interceptor", "schema_registry",
               "--interceptor-config", json.dumps(config), "--log-level", "INFO"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, cwd=tree,
                                     env={**os.environ, "PYTHONPATH": str(tree)})
        self.bootstrap = f"127.0.0.1:{listen}"
        self.lines: list[str] = []
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "bootstrap address" in line:
                break
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(15)


def produce_one(bootstrap: str, topic: str, value: bytes) -> str:
    from confluent_kafka import Producer

    report: list[Any] = []
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "retries": 0,
                         "message.timeout.ms": 30000})
    producer.produce(topic, value, partition=0, on_delivery=lambda e, _m: report.append(e))
    producer.flush(40)
    err = report[0] if report else "no report"
    return "stored" if err is None else str(getattr(err, "name", lambda: err)())


class Latencies:
    """One record at a time to ``topic``, each produce-to-acknowledgement time kept."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.times: list[float] = []
        self.errors = 0
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self._topic = topic
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._producer.produce(topic, b"warm")
        self._producer.flush(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self._producer.produce(self._topic, b"x" * 100, on_delivery=self._done)
            self._producer.flush(30)
            self.times.append(time.perf_counter() - started)
            self._stop.wait(0.01)

    def _done(self, err: Any, _msg: Any) -> None:
        if err is not None:
            self.errors += 1

    def start(self) -> None:
        self.times.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join(60)
        ms = sorted(t * 1000 for t in self.times) or [0.0]
        return statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.99))]


def run_tree(tree: Path, broker: EmbeddedBroker, standin: RemoteStandIn,
             lookups: int, first_id: int) -> list[dict[str, Any]]:
    run = uuid.uuid4().hex[:6]
    topics = {"reject": f"bf{run}-strict", "pass": f"bf{run}-lenient"}
    plain = f"bf{run}-plain"
    proxies = {policy: Proxy(tree, broker.bootstrap, {
        "registry": {"url": standin.url, "timeout_ms": 800, "negative_ttl_s": 1},
        "on_registry_unavailable": policy, "topics": {topic: {"value": "payload"}}})
        for policy, topic in topics.items()}
    ids = iter(range(first_id, first_id + 100_000))
    via, direct = Latencies(proxies["reject"].bootstrap, plain), Latencies(broker.bootstrap,
                                                                           plain)
    rows = []
    try:
        for phase in PHASES:
            pid = proxies["reject"].proc.pid
            before, seen = rss_of(pid), len(proxies["reject"].lines)
            answers: dict[str, list[str]] = {"reject": [], "pass": []}
            with standin.phase(phase), RssSampler(pid) as rss:
                via.start()
                direct.start()
                for _ in range(lookups):
                    for policy, topic in topics.items():
                        standin.register(sid := next(ids), ORDER, f"{topic}-value")
                        answers[policy].append(produce_one(
                            proxies[policy].bootstrap, topic,
                            b"\x00" + struct.pack(">I", sid) + BODY))
                via_ms, direct_ms = via.stop(), direct.stop()
            time.sleep(2)
            logged = [line for line in proxies["reject"].lines[seen:]
                      if "level=WARNING" in line or "level=ERROR" in line or "Traceback" in line]
            rows.append({"phase": phase, "reject": sorted(set(answers["reject"])),
                         "pass": sorted(set(answers["pass"])), "via_ms": via_ms,
                         "direct_ms": direct_ms, "rss_before": before, "rss_peak": rss.peak,
                         "rss_after": rss_of(pid), "log": logged})
    finally:
        for proxy in proxies.values():
            proxy.stop()
    return rows


def table(tree: Path, rows: list[dict[str, Any]]) -> str:
    mib = 1024 * 1024
    out = [f"### {tree}", "",
           "| fault | reject | pass | other topic p50/p99 via proxy (ms) | direct p50/p99 (ms) "
           "| RSS before / peak / after (MiB) | log lines |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        levels = [("ERROR" if "level=ERROR" in line or "Traceback" in line else "WARNING")
                  for line in r["log"]]
        log = ", ".join(f"{levels.count(k)} {k}" for k in ("WARNING", "ERROR")
                        if levels.count(k)) or "-"
        out.append(f"| {r['phase']} | {'/'.join(r['reject'])} | {'/'.join(r['pass'])} "
                   f"| {r['via_ms'][0]:.1f} / {r['via_ms'][1]:.1f} "
                   f"| {r['direct_ms'][0]:.1f} / {r['direct_ms'][1]:.1f} "
                   f"| {r['rss_before'] / mib:.0f} / {r['rss_peak'] / mib:.0f} / "
                   f"{r['rss_after'] / mib:.0f} | {log} |")
    firsts = {r["phase"]: r["log"][0] for r in rows if r["log"]}
    out += ["", "First log line per fault:", ""]
    out += [f"- {phase}: `{line[line.find('level='):][:240]}`" for phase, line in firsts.items()]
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, help="another tree, run in the same way")
    parser.add_argument("--lookups", type=int, default=3,
                        help="new ids sent per phase and proxy (default 3)")
    args = parser.parse_args()
    broker = EmbeddedBroker()
    broker.start()
    standin = RemoteStandIn()
    try:
        trees = [ROOT, *([args.baseline] if args.baseline else [])]
        for n, tree in enumerate(trees):
            rows = run_tree(tree, broker, standin, args.lookups, 10_000 + 100_000 * n)
            print(table(tree, rows), flush=True)
    finally:
        standin.close()
        broker.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
