"""A local Apache Kafka cluster in KRaft mode, as plain JVM processes on 127.0.0.1.

Contract:

- ``KafkaCluster(kafka_home, nodes=N)`` runs N brokers and one dedicated KRaft
  controller from an unpacked Kafka distribution (``make kafka`` builds one from
  Maven Central: ``<home>/libs/*.jar``, ``<home>/config/log4j2.yaml``). Every
  listener binds 127.0.0.1; brokers are node ids 1..N, the controller is node id
  0. ``start(timeout)`` returns once every broker answers Metadata listing all
  running brokers and a controller; ``bootstrap`` is then the clients' list.
- ``kill_node`` (SIGKILL), ``restart_node`` (same data, no reformat) and
  ``add_broker`` (a new broker joining the running cluster) change it while it
  runs; ``partition_leader`` says which broker to kill.
- ``stop()`` ends every JVM (SIGTERM to its process group, then SIGKILL), also
  when ``start`` failed; a JVM still alive when the Python process exits is
  killed by an ``atexit`` hook. No JVM is ever left running.
- Bad input is refused before any JVM starts, with one ``KafkaClusterError``
  naming the problem: a folder without Kafka's jars, Java missing or older than
  17, a port already taken. A node that exits or never becomes ready raises
  ``KafkaClusterError`` with the tail of its log.

Why one dedicated controller rather than combined broker+controller nodes: the
tests kill and restart partition leaders. With a separate controller, killing a
broker never touches the metadata quorum: no controller election, no voter
catching up after a restart, and a single voter cannot lose its majority when a
2-core machine stalls a JVM. The controller fences a killed broker after
``broker.session.timeout.ms`` (4 s here) and moves its leaderships, the path a
real multi-broker cluster takes. Its price is one more, small, JVM.

Settings are the test-friendly ones: replication factor of internal topics and
auto-created topics min(3, N), ``min.insync.replicas`` one less (at least 1) so
acks=all survives one killed broker, auto topic creation on, no initial
rebalance delay. The group protocols are Kafka 4.4's defaults: classic, consumer
(KIP-848), share and streams, switched on by the feature versions that storage
formatting writes (``group.coordinator.rebalance.protocols`` is deprecated and
setting it would switch streams off). JVMs run
with a small heap, the serial collector and C1 only: light on two cores, not
tuned for throughput.

It uses the standard library and three siblings only: ``kafka_distribution``
(finding Kafka and Java, refusing bad ones), ``processes`` (the process registry) and
``metadata_probe`` (the readiness check's Metadata request).
"""

from __future__ import annotations

import base64
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from kiproxy_dev.kafka_distribution import (
    KafkaClusterError,
    find_java,
    find_kafka_home,
    kafka_version_of,
    pinned_kafka_version,
    storage_tool_class,
)
from kiproxy_dev.metadata_probe import MetadataView, probe_metadata
from kiproxy_dev.processes import (
    HOST,
    end_process,
    free_ports,
    port_free,
    register,
    signal_group,
    tail,
)

__all__ = [
    "DEFAULT_JVM_OPTIONS",
    "KafkaCluster",
    "KafkaClusterError",
    "MetadataView",
    "find_kafka_home",
    "pinned_kafka_version",
    "probe_metadata",
]

CONTROLLER_ID = 0
DEFAULT_JVM_OPTIONS: tuple[str, ...] = (
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    "-XX:-UsePerfData",
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
)


def _new_cluster_id() -> str:
    # Kafka's Uuid.toString(): URL-safe base64 of 16 bytes, never starting with '-'.
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


class _Node:
    """One JVM of the cluster: its config, data and log live in ``directory``."""

    def __init__(
        self,
        *,
        node_id: int,
        port: int,
        directory: Path,
        heap: str,
        listener_ports: Mapping[str, int] | None = None,
    ) -> None:
        self.node_id = node_id
        self.port = port
        self.listener_ports = dict(listener_ports or {})
        self.directory = directory
        self.heap = heap
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def is_controller(self) -> bool:
        return self.node_id == CONTROLLER_ID

    @property
    def config_path(self) -> Path:
        return self.directory / "server.properties"

    @property
    def log_path(self) -> Path:
        return self.directory / "server.log"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def describe(self) -> str:
        return "controller (node 0)" if self.is_controller else f"broker {self.node_id}"


class KafkaCluster:
    """N Apache Kafka brokers and one KRaft controller on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        kafka_home: str | os.PathLike[str],
        nodes: int = 1,
        workdir: str | os.PathLike[str] | None = None,
        heap: str = "512m",
        *,
        controller_heap: str = "256m",
        broker_ports: Sequence[int] | None = None,
        controller_port: int | None = None,
        overrides: Mapping[str, str] | None = None,
        listeners: Mapping[str, str] | None = None,
        format_arguments: Sequence[str] = (),
        java: str | None = None,
        jvm_options: Sequence[str] = DEFAULT_JVM_OPTIONS,
        stop_timeout: float = 15.0,
    ) -> None:
        """Check the input and plan the nodes; nothing runs until ``start``.

        ``overrides`` are server properties set on every node after the defaults.
        ``broker_ports``/``controller_port`` pin ports (default: free ones).
        ``listeners`` adds client listeners to every broker beside PLAINTEXT (name ->
        security protocol, e.g. ``{"SASL_PLAINTEXT": "SASL_PLAINTEXT"}``), each on its
        own free port (``listener_bootstrap``); their settings go in ``overrides``.
        ``format_arguments`` are added to ``kafka-storage format`` (``--add-scram ...``).
        """
        if nodes < 1:
            raise KafkaClusterError(f"nodes must be at least 1, not {nodes}")
        if broker_ports is not None and len(broker_ports) != nodes:
            raise KafkaClusterError(
                f"broker_ports has {len(broker_ports)} ports for {nodes} brokers"
            )
        self.kafka_home = Path(kafka_home)
        self.kafka_version = kafka_version_of(self.kafka_home)
        self.java = find_java(java)
        ports = list(broker_ports) if broker_ports is not None else free_ports(nodes)
        controller_port = controller_port if controller_port is not None else free_ports(1)[0]
        for what, port in [("the controller", controller_port)] + [
            (f"broker {i}", p) for i, p in enumerate(ports, start=1)
        ]:
            if not port_free(port):
                raise KafkaClusterError(
                    f"port {HOST}:{port} for {what} is already in use; "
                    "stop what listens there or choose another port"
                )
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="kiproxy-kafka-"))
        self.replication = min(3, nodes)
        self.cluster_id = _new_cluster_id()
        self.stop_timeout = stop_timeout
        self._heap = heap
        self._jvm_options = tuple(jvm_options)
        self._overrides = dict(overrides or {})
        self._listeners = dict(listeners or {})
        self._format_arguments = tuple(format_arguments)
        self._controller = _Node(
            node_id=CONTROLLER_ID,
            port=controller_port,
            directory=self.workdir / "controller",
            heap=controller_heap,
        )
        self._brokers = {i: self._new_broker(i, p) for i, p in enumerate(ports, start=1)}

    # --- what tests read

    @property
    def bootstrap(self) -> str:
        """The brokers as a client's ``bootstrap.servers``: ``127.0.0.1:p1,127.0.0.1:p2``."""
        return ",".join(f"{HOST}:{b.port}" for b in self._brokers.values())

    def listener_bootstrap(self, listener: str) -> str:
        """The brokers' ports of one of the ``listeners`` given, as ``bootstrap.servers``."""
        if listener not in self._listeners:
            raise KafkaClusterError(f"no listener {listener!r}: the extra listeners are "
                                    f"{sorted(self._listeners) or 'none'}")
        return ",".join(f"{HOST}:{b.listener_ports[listener]}" for b in self._brokers.values())

    @property
    def broker_ids(self) -> list[int]:
        """Node ids of all brokers, running or not."""
        return list(self._brokers)

    def port(self, node_id: int) -> int:
        """The PLAINTEXT port of a broker (or the controller's port for node 0)."""
        return self._node(node_id).port

    def log_path(self, node_id: int) -> Path:
        """The log file of a node."""
        return self._node(node_id).log_path

    def pid(self, node_id: int) -> int:
        """The process id of a node's JVM (its process group id too)."""
        process = self._node(node_id).process
        if process is None:
            raise KafkaClusterError(f"node {node_id} has not been started")
        return process.pid

    def nodes_alive(self) -> list[int]:
        """Node ids whose JVM is running now (the controller is 0)."""
        return [n.node_id for n in [self._controller, *self._brokers.values()] if n.running]

    def partition_leader(self, topic: str, partition: int = 0, timeout: float = 30.0) -> int:
        """The node id leading ``topic``-``partition``, waiting until it has a leader."""
        deadline = time.monotonic() + timeout
        while True:
            for node in self._running_brokers():
                with contextlib.suppress(OSError):
                    leader = probe_metadata(node.port, [topic]).leaders.get((topic, partition), -1)
                    if leader >= 0:
                        return leader
            if time.monotonic() > deadline:
                raise KafkaClusterError(f"{topic}-{partition} has no leader after {timeout:g}s")
            time.sleep(0.2)

    # --- lifecycle

    def start(self, timeout: float = 120.0) -> None:
        """Format storage, start every node, and wait until all brokers are ready."""
        try:
            self._format([self._controller, *self._brokers.values()])
            for node in [self._controller, *self._brokers.values()]:
                self._spawn(node)
            self._wait_ready(list(self._brokers.values()), timeout)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every node (brokers first, then the controller) and remove a temporary workdir."""
        brokers = [b for b in self._brokers.values() if b.process is not None]
        for b in brokers:  # SIGTERM all at once: controlled shutdowns overlap
            if b.process is not None and b.process.poll() is None:
                signal_group(b.process, signal.SIGTERM)
        for b in brokers:
            if b.process is not None:
                end_process(b.process, self.stop_timeout)
        if self._controller.process is not None:
            end_process(self._controller.process, self.stop_timeout)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL one node (a broker, or the controller as node 0), as a crash would."""
        node = self._node(node_id)
        if node.process is not None:
            end_process(node.process, grace=0)

    def restart_node(self, node_id: int, timeout: float = 120.0) -> None:
        """Start a node again on its data (stopping it first if it runs) and wait until ready."""
        node = self._node(node_id)
        if node.process is not None:
            end_process(node.process, self.stop_timeout)
        self._spawn(node)
        self._wait_ready(self._running_brokers() if node.is_controller else [node], timeout)

    def add_broker(self, timeout: float = 120.0) -> int:
        """Start a new broker that joins the running cluster; its node id is returned."""
        node_id = max(self._brokers) + 1
        node = self._new_broker(node_id, free_ports(1)[0])
        self._brokers[node_id] = node
        self._format([node])
        self._spawn(node)
        self._wait_ready([node], timeout)
        return node_id

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- internals

    def _new_broker(self, node_id: int, port: int) -> _Node:
        extra = dict(zip(self._listeners, free_ports(len(self._listeners)), strict=True))
        return _Node(
            node_id=node_id,
            port=port,
            directory=self.workdir / f"broker-{node_id}",
            heap=self._heap,
            listener_ports=extra,
        )

    def _node(self, node_id: int) -> _Node:
        if node_id == CONTROLLER_ID:
            return self._controller
        try:
            return self._brokers[node_id]
        except KeyError:
            raise KafkaClusterError(
                f"no node {node_id}: the brokers are {self.broker_ids}, the controller is 0"
            ) from None

    def _log_name(self, node: _Node) -> str:
        # A temporary workdir is gone once stop() has run: name the log, not a dead path.
        where = "" if self._own_workdir else f" ({node.log_path})"
        return f"{node.describe()}'s log{where}"

    def _running_brokers(self) -> list[_Node]:
        return [b for b in self._brokers.values() if b.running]

    def _properties(self, node: _Node) -> dict[str, str]:
        rf = str(self.replication)
        min_isr = str(max(1, self.replication - 1))
        props = {
            "node.id": str(node.node_id),
            "controller.quorum.voters": f"{CONTROLLER_ID}@{HOST}:{self._controller.port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "log.dirs": str(node.directory / "data"),
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.recovery.threads.per.data.dir": "1",
            "log.cleaner.threads": "1",
            # A killed broker is fenced (and its leaderships move) after this long.
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "500",
            # Topic defaults: the controller creates auto-created topics, brokers read them too.
            "num.partitions": "1",
            "default.replication.factor": rf,
            "min.insync.replicas": min_isr,
        }
        if node.is_controller:
            props |= {
                "process.roles": "controller",
                "listeners": f"CONTROLLER://{HOST}:{node.port}",
            }
        else:
            addresses = ",".join(
                [f"PLAINTEXT://{HOST}:{node.port}"]
                + [f"{name}://{HOST}:{port}" for name, port in node.listener_ports.items()]
            )
            protocols = "".join(f",{name}:{proto}" for name, proto in self._listeners.items())
            props |= {
                "process.roles": "broker",
                "listeners": addresses,
                "advertised.listeners": addresses,
                "listener.security.protocol.map": props["listener.security.protocol.map"]
                + protocols,
                "inter.broker.listener.name": "PLAINTEXT",
                "auto.create.topics.enable": "true",
                "offsets.topic.replication.factor": rf,
                "offsets.topic.num.partitions": "4",
                "transaction.state.log.replication.factor": rf,
                "transaction.state.log.min.isr": min_isr,
                "transaction.state.log.num.partitions": "4",
                "share.coordinator.state.topic.replication.factor": rf,
                "share.coordinator.state.topic.min.isr": min_isr,
                "share.coordinator.state.topic.num.partitions": "4",
                "group.initial.rebalance.delay.ms": "0",
            }
        return props | self._overrides

    def _java_command(self, node: _Node | None, heap: str, log4j: str) -> list[str]:
        config = self.kafka_home / "config" / log4j
        logs_dir = node.directory if node is not None else self.workdir
        cmd = [self.java, f"-Xmx{heap}", "-Xms32m", *self._jvm_options]
        if config.is_file():
            cmd.append(f"-Dlog4j2.configurationFile={config}")
        cmd += [f"-Dkafka.logs.dir={logs_dir}", "-cp", str(self.kafka_home / "libs" / "*")]
        return cmd

    def _format(self, nodes: Sequence[_Node]) -> None:
        """Write each node's properties and format its storage, as ``kafka-storage format`` does."""
        tool = storage_tool_class(self.kafka_home)
        runs: list[tuple[_Node, subprocess.Popen[bytes], Path]] = []
        try:
            for node in nodes:  # one short JVM per node, all at once
                node.directory.mkdir(parents=True, exist_ok=True)
                lines = [f"{k}={v}" for k, v in self._properties(node).items()]
                node.config_path.write_text("\n".join(lines) + "\n")
                out = node.directory / "format.log"
                cmd = self._java_command(None, "256m", "tools-log4j2.yaml")
                cmd += [tool, "format", "-t", self.cluster_id, "-c", str(node.config_path)]
                cmd += self._format_arguments
                with out.open("wb") as f:
                    proc = subprocess.Popen(
                        cmd,
                        stdin=subprocess.DEVNULL,
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                register(proc)
                runs.append((node, proc, out))
            for node, proc, out in runs:
                try:
                    code = proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    code = None
                if code != 0:
                    raise KafkaClusterError(
                        f"formatting the storage of {node.describe()} failed "
                        f"({'timed out' if code is None else f'exit status {code}'}):\n"
                        + tail(out)
                    )
        finally:
            for _, proc, _ in runs:
                end_process(proc, grace=0)

    def _spawn(self, node: _Node) -> None:
        cmd = self._java_command(node, node.heap, "log4j2.yaml")
        cmd += ["kafka.Kafka", str(node.config_path)]
        with node.log_path.open("ab") as log:
            node.process = subprocess.Popen(
                cmd,
                cwd=node.directory,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        register(node.process)

    def _wait_ready(self, nodes: Sequence[_Node], timeout: float) -> None:
        """Wait until each node answers Metadata naming a controller and every running broker."""
        deadline = time.monotonic() + timeout
        pending = list(nodes)
        while pending:
            for node in [self._controller, *pending]:
                if node.process is not None and node.process.poll() is not None:
                    raise KafkaClusterError(
                        f"{node.describe()} exited with status {node.process.returncode} "
                        f"before the cluster was ready; the end of {self._log_name(node)}:\n"
                        + tail(node.log_path)
                    )
            expected = {b.node_id for b in self._running_brokers()}
            for node in list(pending):
                with contextlib.suppress(OSError):
                    view = probe_metadata(node.port)
                    if view.controller_id >= 0 and expected <= set(view.brokers):
                        pending.remove(node)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(
                    f"--- the end of {self._log_name(n)}:\n{tail(n.log_path)}" for n in pending
                )
                names = ", ".join(n.describe() for n in pending)
                raise KafkaClusterError(f"{names} not ready after {timeout:g}s\n{tails}")
            if pending:
                time.sleep(0.2)
