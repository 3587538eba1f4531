"""What a new user meets in the first hour: ``kiproxy dev`` with a group consumer,
a wrong ``--upstream``, and ``kiproxy dev --help``.

The embedded broker (Tansu) holds a consumer's first JoinGroup for half the
group's session timeout (see docs/troubleshooting.md): the consumer here uses
``session.timeout.ms`` 6000, the lowest a Kafka broker accepts, and is answered
after about 3 s instead of confluent-kafka's default 45000 / 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, TANSU_NODE_ID, launch_proxy
from support.dev_mode import running_dev
from support.processes import runtime_env

from kiproxy.proxy.brokers.failures import UpstreamFailureLog
from kiproxy_dev.tansu import EmbeddedBroker, free_port

_ENV = runtime_env()


@pytest.fixture
def dev_proxy() -> Iterator[str]:
    """``kiproxy dev`` as a user starts it; yields its bootstrap address."""
    listen = free_port()
    with running_dev("--listen", f"127.0.0.1:{listen}",
                     "--broker-port-start", str(free_port() - TANSU_NODE_ID)) as dev:
        try:
            dev.wait_bootstrap(60)
            yield f"127.0.0.1:{listen}"
        finally:
            dev.stop()


def test_a_group_consumer_gets_its_first_record_through_kiproxy_dev(dev_proxy: str) -> None:
    from confluent_kafka import Consumer, Producer

    topic = f"first-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": dev_proxy})
    producer.produce(topic, key=b"k", value=b"hello")
    assert producer.flush(15) == 0
    consumer = Consumer({"bootstrap.servers": dev_proxy, "group.id": f"g-{topic}",
                         "auto.offset.reset": "earliest", "session.timeout.ms": 6000})
    try:
        consumer.subscribe([topic])
        record = None
        for _ in range(60):  # poll in a loop, as a consumer does; gives up after a minute
            record = consumer.poll(1)
            if record is not None and record.error() is None:
                break
        assert record is not None and record.error() is None
        assert (record.key(), record.value()) == (b"k", b"hello")
    finally:
        consumer.close()


# ---------------------------------------------------------------------------- wrong upstream


def _closed_port() -> int:
    """A loopback port nothing listens on (connections are refused)."""
    return free_port()


def test_a_wrong_upstream_exits_with_one_line_naming_it() -> None:
    port = _closed_port()
    result = subprocess.run(
        [sys.executable, "-m", "kiproxy", "run", "--upstream", f"127.0.0.1:{port}",
         "--listen", f"127.0.0.1:{free_port()}", "--upstream-startup-timeout-ms", "1500"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=_ENV)
    assert result.returncode == 1
    assert result.stderr == (
        f"kiproxy: upstream 127.0.0.1:{port}: connection refused (tried for 1.5 s); "
        "start the cluster, fix --upstream, or pass --wait-for-upstream\n")
    assert "bootstrap address" not in result.stdout


def test_every_address_tried_is_named() -> None:
    first, second = _closed_port(), _closed_port()
    result = subprocess.run(
        [sys.executable, "-m", "kiproxy", "run", "--upstream", f"127.0.0.1:{first}",
         "--upstream", f"127.0.0.1:{second}", "--upstream-startup-timeout-ms", "1000"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=_ENV)
    assert result.returncode == 1
    assert result.stderr == (
        f"kiproxy: upstream 127.0.0.1:{first}: connection refused; 127.0.0.1:{second}: "
        "connection refused (tried for 1 s); start the cluster, fix --upstream (or the "
        "config's upstream list), or pass --wait-for-upstream\n")


def _readyz(address: str) -> int:
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=5) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def test_wait_for_upstream_keeps_trying_and_is_not_ready_until_the_cluster_answers(
        tmp_path: Path) -> None:
    broker_port = _closed_port()
    metrics = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(f"127.0.0.1:{broker_port}", "--wait-for-upstream",
                         "--metrics-listen", metrics)
    late = EmbeddedBroker(port=broker_port, log_path=tmp_path / "late.log")
    try:
        assert _readyz(metrics) == 503
        # Clients that connect meanwhile are closed; the log sums them up.
        for _ in range(20):
            with socket.create_connection(proxy.bootstrap.split(":"), timeout=5) as sock:
                sock.settimeout(5)
                with contextlib.suppress(OSError):
                    sock.recv(1)  # returns once the proxy has closed this client
        late.start()
        for _ in range(100):
            if _readyz(metrics) == 200:
                break
            time.sleep(0.1)
        assert _readyz(metrics) == 200
        assert proxy.alive()
        unreachable = [ln for ln in proxy.lines if "unreachable: connection refused" in ln]
        assert len(unreachable) == 1, proxy.log
        assert f"upstream 127.0.0.1:{broker_port} unreachable: connection refused; " \
               "closing client 127.0.0.1:" in unreachable[0]
    finally:
        proxy.stop()
        late.stop()


async def test_client_connection_failures_are_logged_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    failures = UpstreamFailureLog(interval=0.2)
    with caplog.at_level(logging.WARNING, logger="kiproxy.connection"):
        for n in range(37):
            failures.failed("127.0.0.1:1", "connection refused", f"127.0.0.1:{5000 + n}", {})
        await asyncio.sleep(0.3)
        await asyncio.sleep(0.3)  # a quiet interval: nothing more is logged
    assert [r.getMessage() for r in caplog.records] == [
        "upstream 127.0.0.1:1 unreachable: connection refused; closing client 127.0.0.1:5000 "
        "(further failures to it are summed every 0.2 s)",
        "upstream 127.0.0.1:1 unreachable: connection refused (36 client connections failed "
        "in the last 0.2 s)",
    ]


# ---------------------------------------------------------------------------- dev --help


def test_dev_help_shows_only_flags_that_apply_to_the_embedded_broker() -> None:
    result = subprocess.run([sys.executable, "-m", "kiproxy", "dev", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    for flag in ("--upstream", "--upstream-tls", "--upstream-tls-ca", "--wait-for-upstream",
                 "--workers"):
        assert f"{flag} " not in result.stdout and f"{flag}\n" not in result.stdout, flag
    assert "--interceptor " in result.stdout and "--tls-cert" in result.stdout
    run_help = subprocess.run([sys.executable, "-m", "kiproxy", "run", "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=30).stdout
    assert "--upstream-tls-ca" in run_help and "--wait-for-upstream" in run_help
