"""Shared fixtures: a real broker (Tansu or Apache Kafka), and kiproxy as its own process.

Brokers:

* ``broker``: one Tansu (memory storage) for the session, node id 111.
* ``apache_kafka``: one 1-node Apache Kafka cluster (KRaft, JVMs on loopback,
  node id 1) for the session, started when a test first asks for it; skipped,
  saying how to get it, when no distribution is found (``make kafka``).
* ``upstream``: module-scoped and parametrized with ids ``tansu`` and ``kafka``:
  a module whose fixtures ask for it runs all its tests on both brokers, Tansu
  first. ``tansu_gap(upstream, request, why)`` marks the Tansu variant of a test
  as an expected failure (strict) where Tansu differs from Kafka.

The proxy runs as a subprocess (``python -m kiproxy run ...``) so that the
test process's own sockets are only the Kafka clients' - which lets tests assert
that no client ever connects to the broker directly. It imports what an installed
proxy imports, not the test extra's Hypothesis (``support.processes.runtime_env``).
``--broker-port-start`` serves node N on start + N: Tansu's node 111, Kafka's nodes 1..N.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from support.apache_kafka import kafka_home_or_skip, session_cluster
from support.processes import runtime_env
from support.registry import registry_jar_or_skip

from kiproxy_dev.apicurio import ApicurioRegistry
from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.processes import stop_process
from kiproxy_dev.tansu import EmbeddedBroker, free_port, hand_out

TESTS = Path(__file__).parent
ROOT = TESTS.parent
TANSU_NODE_ID = 111

FIXED_PORTS = ("tests/docs/", "tests/containers/", "tests/integration/test_dev_")
"""Tests that listen where a user's copy would (the pages' and ``make run``'s 127.0.0.1:9192,
moto's 4566, the Compose stack's published ports): under ``pytest -n`` (``make test``)
they run one after another on one worker."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``pytest -n N``: a file's tests on one worker (its module fixtures start once), and
    every file of :data:`FIXED_PORTS` on one; the work units go to whichever worker is free."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "fixed-ports" if path.startswith(FIXED_PORTS) else path

    return ByFile(config, log)


# Property tests assert what holds, never how fast: no per-example deadline and no
# health check on generation speed (either failed a passing test on a loaded machine).
settings.register_profile("kiproxy", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kiproxy")


@pytest.fixture(scope="session")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """One Tansu broker (memory storage) for the session; tests use unique topics."""
    log = tmp_path_factory.mktemp("broker") / "broker.log"
    b = EmbeddedBroker(log_path=log)
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def apache_kafka() -> Iterator[KafkaCluster]:
    """One 1-node Apache Kafka cluster for the session (PLAINTEXT and SASL listeners)."""
    cluster = session_cluster(kafka_home_or_skip())
    cluster.start()
    yield cluster
    cluster.stop()


@dataclass(frozen=True)
class Upstream:
    """The broker behind the proxy in a test: its name, bootstrap and node ids."""

    name: str
    """``tansu`` or ``kafka``."""
    bootstrap: str
    node_ids: tuple[int, ...]
    kafka: KafkaCluster | None = None
    """The Apache Kafka cluster, when it is one."""


BROKERS = ("tansu", "kafka")


@pytest.fixture(scope="module", params=BROKERS)
def upstream(request: pytest.FixtureRequest) -> Upstream:
    """The module's broker: Tansu, then Apache Kafka (every test of the module runs on both)."""
    if request.param == "tansu":
        tansu: EmbeddedBroker = request.getfixturevalue("broker")
        return Upstream("tansu", tansu.bootstrap, (TANSU_NODE_ID,))
    kafka: KafkaCluster = request.getfixturevalue("apache_kafka")
    return Upstream("kafka", kafka.bootstrap, tuple(kafka.broker_ids), kafka)


def tansu_gap(upstream: Upstream, request: pytest.FixtureRequest, why: str,
              run: bool = True) -> None:
    """Expect this test to fail on Tansu (strict: a Tansu that closes the gap is noticed).

    ``run=False`` does not run it there at all (for a gap that shows as a long wait).
    """
    if upstream.name == "tansu" and not run:
        pytest.xfail(f"Tansu gap (not run): {why}")
    if upstream.name == "tansu":
        request.applymarker(pytest.mark.xfail(reason=f"Tansu gap: {why}", strict=True))


@pytest.fixture
def topic() -> str:
    """A fresh topic name (the broker auto-creates topics on first use)."""
    return f"t-{uuid.uuid4().hex[:10]}"


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def broker_port_start(node_ids: tuple[int, ...] = (TANSU_NODE_ID,)) -> int:
    """A ``--broker-port-start`` under which every node of ``node_ids`` gets a free port,
    none handed out before (a metrics port chosen earlier and not bound yet looks free)."""
    for _ in range(50):
        first = free_port()
        start = first - min(node_ids)
        others = [start + n for n in node_ids if start + n != first]
        if start > 1024 and all(_port_free(p) for p in others) and all(map(hand_out, others)):
            return start
    raise RuntimeError("no free port found")


@dataclass
class ProxyProcess:
    """A running ``kiproxy run`` process."""

    process: subprocess.Popen[str]
    bootstrap: str
    broker_port_start: int
    lines: list[str] = field(default_factory=list)
    node_ids: tuple[int, ...] = (TANSU_NODE_ID,)

    @property
    def log(self) -> str:
        """Everything the proxy printed so far."""
        return "\n".join(self.lines)

    @property
    def ports(self) -> set[int]:
        """The bootstrap port and the ports of the nodes (Tansu's 111 unless told)."""
        return {int(self.bootstrap.rsplit(":", 1)[1]),
                *(self.broker_port_start + n for n in self.node_ids)}

    def alive(self) -> bool:
        """Whether the process is still running."""
        return self.process.poll() is None

    def wait_for_line(self, *needles: str, timeout: float = 30) -> str:
        """The first line holding every one of ``needles``, waiting for it to be read
        (the proxy's output reaches ``lines`` through a thread, a little after it is
        written); AssertionError with the log after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            for line in list(self.lines):
                if all(n in line for n in needles):
                    return line
            assert time.monotonic() < deadline, f"no log line with {needles}:\n{self.log}"
            time.sleep(0.05)

    def stop(self, sig: int = 15, timeout: float = 15) -> int:
        """Send ``sig`` and wait for the exit code (SIGKILL after ``timeout`` s)."""
        return stop_process(self.process, timeout, sig)


def launch_proxy(upstream: str, *extra: str, interceptor: str | None = None,
                 interceptor_config: dict[str, Any] | None = None,
                 plugins_dir: str | Path | None = None,
                 config_file: str | Path | None = None,
                 node_ids: tuple[int, ...] = (TANSU_NODE_ID,)) -> ProxyProcess:
    """Start ``kiproxy run`` in front of ``upstream`` (``host:port[,host:port...]``) and
    wait for its bootstrap line.

    ``node_ids`` are the broker's node ids (Tansu's by default): their proxy ports
    are chosen free and make up ``ProxyProcess.ports``.
    """
    listen = free_port()
    start = broker_port_start(node_ids)
    upstreams = [arg for server in upstream.split(",") for arg in ("--upstream", server)]
    cmd = [sys.executable, "-m", "kiproxy", "run", *upstreams,
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
                            cwd=ROOT, env=runtime_env())
    handle = ProxyProcess(proc, f"127.0.0.1:{listen}", start, node_ids=node_ids)
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


def high_watermark(bootstrap: str, topic: str, partition: int = 0, **conf: Any) -> int:
    """The partition's high watermark, asked of the broker at once (ListOffsets); 0 when the
    partition does not exist; ``conf``: more client settings (SASL). A check that nothing
    (more) was stored compares it with what was, instead of waiting out a consumer that
    reads nothing: the broker's log end counts whatever any request appended, read or not.
    (On Tansu only compared with 0: it answers ListOffsets(latest) with its last batch's
    base offset + 1; Apache Kafka's is the offset after the last record.)"""
    from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"wm-{uuid.uuid4().hex[:6]}",
                  **conf})
    try:
        _low, high = c.get_watermark_offsets(TopicPartition(topic, partition), timeout=10,
                                             cached=False)
        return int(high)
    except KafkaException as exc:
        if exc.args[0].code() in (KafkaError._UNKNOWN_PARTITION,
                                  KafkaError.UNKNOWN_TOPIC_OR_PART):
            return 0
        raise
    finally:
        c.close()


def consume(bootstrap: str, topic: str, count: int, partitions: int = 1,
            timeout: float = 30) -> list[Any]:
    """Read ``count`` records from ``topic`` (partitions 0..n-1, from the start) with
    confluent-kafka, by explicit assignment (no group join needed)."""
    with _reader(bootstrap, topic, partitions) as c:
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            msg = c.poll(0.5)
            if msg is None or msg.error():
                continue
            out.append(msg)
        return out


@contextlib.contextmanager
def _reader(bootstrap: str, topic: str, partitions: int) -> Iterator[Any]:
    """A confluent-kafka consumer assigned partitions 0..n-1 of ``topic`` from the start."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        yield c
    finally:
        c.close()


def consume_until(bootstrap: str, topic: str, done: Callable[[list[Any]], bool],
                  partitions: int = 1, timeout: float = 30, extra_look: float = 0.5
                  ) -> list[Any]:
    """Read ``topic`` (partitions 0..n-1, from the start) until ``done(records)`` holds, then
    ``extra_look`` seconds more for any records that follow it (a duplicate, one too many);
    what was read by ``timeout`` otherwise. For a topic whose writer has finished (an audit
    topic after the proxy stopped): the read stops at what is expected instead of waiting
    out a fixed time for records that are not coming."""
    with _reader(bootstrap, topic, partitions) as c:
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while not done(out) and time.monotonic() < deadline:
            out.extend(m for m in c.consume(10_000, 0.2) if not m.error())
        until = time.monotonic() + extra_look
        while (left := until - time.monotonic()) > 0:
            out.extend(m for m in c.consume(10_000, left) if not m.error())
        return out


@pytest.fixture(scope="session")
def extension_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The ``KIPROXY_EXT_CACHE`` of every build of the checkout in the session (the
    fresh-checkout pages' installs, the wheel the packaging tests build): ``setup.py``
    compiles each Cython extension once, for real, and later builds copy that result
    (keyed by a hash of what the compiler reads). The environment's own, when it names one."""
    return os.environ.get("KIPROXY_EXT_CACHE") or str(tmp_path_factory.mktemp("extensions"))


@pytest.fixture(scope="session")
def extism_plugins() -> dict[str, Path]:
    """The Extism test plugins (AssemblyScript, compiled once and cached; see
    ``support.extism_plugins``); skipped when Node.js or npm is missing."""
    from support.extism_plugins import NoToolchain, build

    try:
        return build()
    except NoToolchain as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def apicurio_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApicurioRegistry]:
    """One Apicurio Registry (in-memory, BACKWARD compatibility) for the session, built by
    `make registry` when missing; tests register subjects with names of their own. Never
    stopped by a test: an outage test starts its own (integration's ``start_registry``)."""
    registry = ApicurioRegistry(registry_jar_or_skip(),
                                workdir=tmp_path_factory.mktemp("registry"))
    registry.start()
    yield registry
    registry.stop()


@pytest.fixture(scope="session")
def registry_url(apicurio_registry: ApicurioRegistry) -> str:
    """The shared registry's Confluent-compatible API URL (``.../apis/ccompat/v7``)."""
    return apicurio_registry.url
