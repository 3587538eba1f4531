"""``--workers N``: several processes serve the same listeners with SO_REUSEPORT."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

from conftest import consume, launch_proxy
from prometheus_client.parser import text_string_to_metric_families

from kiproxy.proxy.workers import CRASH_LOOP_S
from kiproxy_dev.tansu import EmbeddedBroker, free_port


def _free_port_pair_below_ephemeral() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free, below the ephemeral port range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in range(max(low - 2000, 1025), low - 1, 2):
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    return free_port()


def _connections(addr: str) -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kiproxy_connections_total":
                return float(sample.value)
    return 0.0


def test_workers_share_the_listeners(broker: EmbeddedBroker, topic: str,
                                     tmp_path: Path) -> None:
    from confluent_kafka import Producer

    # Worker 1 takes metrics_port + 1. Both lie below the kernel's ephemeral range, so
    # no outbound connection (the workers' node discovery, the clients) can take one.
    metrics_port = _free_port_pair_below_ephemeral()
    audit = tmp_path / "audit.jsonl"
    proxy = launch_proxy(broker.bootstrap, "--workers", "2", "--metrics-listen",
                         f"127.0.0.1:{metrics_port}", "--audit-log", str(audit),
                         interceptor="kiproxy.interceptors.builtin.uppercase:Uppercase")
    try:
        for i in range(24):  # separate clients, so the kernel spreads their connections
            producer = Producer({"bootstrap.servers": proxy.bootstrap, "client.id": f"p{i}"})
            producer.produce(topic, b"w%d" % i, partition=0)
            assert producer.flush(20) == 0
        got = consume(proxy.bootstrap, topic, 24)
        assert sorted(m.value() for m in got) == sorted(b"W%d" % i for i in range(24))
        per_worker = [_connections(f"127.0.0.1:{metrics_port + i}") for i in range(2)]
        assert all(n > 0 for n in per_worker), per_worker
    finally:
        assert proxy.stop() == 0
    files = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("audit"))
    assert files == ["audit.jsonl.w0", "audit.jsonl.w1"]
    events = [json.loads(line) for f in files for line in (tmp_path / f).read_text().splitlines()]
    assert sum(e["records"] for e in events if e["topic"] == topic) == 24


def _children(pid: int) -> list[int]:
    return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())


def test_a_worker_that_dies_is_started_again(broker: EmbeddedBroker, topic: str) -> None:
    """A worker killed (an out-of-memory kill, a crash) is logged and started again under
    its index, so its metrics port answers again and the listeners serve; SIGTERM then
    stops the restarted one too (a worker forked by the supervisor does not inherit its
    signal handlers) and the proxy exits 0."""
    from confluent_kafka import Producer

    metrics_port = _free_port_pair_below_ephemeral()
    proxy = launch_proxy(broker.bootstrap, "--workers", "2", "--metrics-listen",
                         f"127.0.0.1:{metrics_port}")
    try:
        workers = _children(proxy.process.pid)
        assert len(workers) == 2
        time.sleep(CRASH_LOOP_S)  # past the crash-loop window: an ordinary death
        os.kill(workers[1], signal.SIGKILL)
        line = proxy.wait_for_line("ended (signal SIGKILL): starting it again")
        assert "ERROR" in line
        deadline = time.monotonic() + 30
        while True:
            now = _children(proxy.process.pid)
            with contextlib.suppress(OSError):
                _connections(f"127.0.0.1:{metrics_port + 1}")  # its metrics port answers
                if len(now) == 2:
                    break
            assert time.monotonic() < deadline, f"no second worker again: {now}"
            time.sleep(0.2)
        for i in range(8):
            producer = Producer({"bootstrap.servers": proxy.bootstrap, "client.id": f"r{i}"})
            producer.produce(topic, b"r%d" % i, partition=0)
            assert producer.flush(20) == 0
        assert len(consume(proxy.bootstrap, topic, 8)) == 8
    finally:
        code = proxy.stop()
    assert code == 0, proxy.log[-3000:]


def test_a_worker_that_dies_right_after_its_start_stops_the_proxy(
        broker: EmbeddedBroker) -> None:
    """A crash loop is the supervisor's (systemd, Kubernetes) to see: every worker is
    stopped and the exit code is 1, rather than a process restarting in a loop."""
    proxy = launch_proxy(broker.bootstrap, "--workers", "2")
    try:
        os.kill(_children(proxy.process.pid)[0], signal.SIGKILL)
        assert proxy.process.wait(30) == 1
        proxy.wait_for_line("s after it started: stopping every worker")
        proxy.wait_for_line("1 of 2 workers exited with an error")
    finally:
        proxy.stop()
