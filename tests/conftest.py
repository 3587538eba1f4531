"""Shared fixtures: a real broker (Tansu), and kiproxy started as its own process.

The proxy runs as a subprocess (``python -m kiproxy run ...``) so that the
test process's own sockets are only the Kafka clients' - which lets tests assert
that no client ever connects to the broker directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kiproxy.proxy.embedded import EmbeddedBroker, free_port

TESTS = Path(__file__).parent
ROOT = TESTS.parent
TANSU_NODE_ID = 111


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One Tansu broker (memory storage) for the session; tests use unique topics."""
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    b = EmbeddedBroker(log_path=log)
    b.start()
    yield b
    b.stop()


@pytest.fixture
def topic() -> str:
    """A fresh topic name (the broker auto-creates topics on first use)."""
    return f"t-{uuid.uuid4().hex[:10]}"


def _broker_port_start() -> int:
    # Node N is served on start + N; pick start so that Tansu's node 111 gets a free port.
    for _ in range(50):
        port = free_port()
        if port - TANSU_NODE_ID > 1024:
            return port - TANSU_NODE_ID
    raise RuntimeError("no free port found")


@dataclass
class ProxyProcess:
    """A running ``kiproxy run`` process."""

    process: subprocess.Popen[str]
    bootstrap: str
    broker_port_start: int
    lines: list[str] = field(default_factory=list)

    @property
    def log(self) -> str:
        """Everything the proxy printed so far."""
        return "\n".join(self.lines)

    @property
    def ports(self) -> set[int]:
        """The bootstrap port and the port of Tansu's node."""
        return {int(self.bootstrap.rsplit(":", 1)[1]), self.broker_port_start + TANSU_NODE_ID}

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def stop(self, sig: int = 15, timeout: float = 15) -> int:
        """Send ``sig`` and wait for the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait(5)


def launch_proxy(upstream: str, *extra: str, interceptor: str | None = None,
                 interceptor_config: dict[str, Any] | None = None,
                 plugins_dir: str | Path | None = None,
                 config_file: str | Path | None = None) -> ProxyProcess:
    """Start ``kiproxy run`` in front of ``upstream`` and wait for its bootstrap line."""
    listen = free_port()
    start = _broker_port_start()
    cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
           "--listen", f"127.0.0.1:{listen}", "--broker-port-start", str(start),
           "--log-level", "INFO", *extra]
    if interceptor:
        cmd += ["--interceptor", interceptor]
    if interceptor_config is not None:
        cmd += ["--interceptor-config", json.dumps(interceptor_config)]
    if plugins_dir is not None:
        cmd += ["--plugins-dir", str(plugins_dir)]
    if config_file is not None:
        cmd += ["--config", str(config_file)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    handle = ProxyProcess(proc, f"127.0.0.1:{listen}", start)
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            handle.lines.append(line.rstrip("\n"))
            if "bootstrap address" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(30) or proc.poll() is not None:
        handle.stop()
        raise RuntimeError(f"kiproxy did not start:\n{handle.log}")
    return handle


@pytest.fixture
def start_proxy(broker: EmbeddedBroker) -> Iterator[Any]:
    """Factory: ``start_proxy(interceptor=..., interceptor_config=..., plugins_dir=...)``."""
    started: list[ProxyProcess] = []

    def start(*extra: str, upstream: str | None = None, **kwargs: Any) -> ProxyProcess:
        p = launch_proxy(upstream or broker.bootstrap, *extra, **kwargs)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def wait_for_port(host: str, port: int, timeout: float = 10) -> None:
    """Wait until something listens on ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((host, port), 0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port}")


def consume(bootstrap: str, topic: str, count: int, partitions: int = 1,
            timeout: float = 30) -> list[Any]:
    """Read ``count`` records from ``topic`` (partitions 0..n-1, from the start) with
    confluent-kafka, by explicit assignment (no group join needed)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error():
                continue
            out.append(msg)
        return out
    finally:
        c.close()
