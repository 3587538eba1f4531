"""Apache Kafka's own Java client, driven from Python tests.

``JavaClient.build(kafka_home)`` compiles tests/java/KiproxyClient.java with
``javac`` against the distribution's ``libs/*`` (the kafka-clients pinned in
apache-kafka/pom.xml) once per source and Kafka version, caching the classes under
``<make kafka cache>/java-client/<hash>/``. ``produce`` and ``consume`` run it and
return the JSON events it printed, one per delivery result, error or record (the
Java file's header comment lists them).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiproxy_dev.kafka_cluster import KafkaClusterError
from kiproxy_dev.kafka_distribution import default_cache_dir, find_java, kafka_version_of

SOURCE = Path(__file__).resolve().parents[1] / "java" / "KiproxyClient.java"
MAIN_CLASS = "KiproxyClient"


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientRun:
    """One run of the Java client: its JSON events, exit status and stderr (its log)."""

    events: list[dict[str, Any]]
    returncode: int
    stderr: str

    def of(self, event: str) -> list[dict[str, Any]]:
        """The events of one kind: ``delivered``, ``error``, ``record`` or ``done``."""
        return [e for e in self.events if e.get("event") == event]

    @property
    def done(self) -> dict[str, Any]:
        """The closing summary line; an error naming the client's stderr when it is missing."""
        found = self.of("done")
        if not found:
            raise AssertionError(
                f"the Java client ended (status {self.returncode}) without a summary; "
                f"its stderr:\n{self.stderr[-3000:]}"
            )
        return found[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class JavaClient:
    """A compiled KiproxyClient and the ``java`` and Kafka jars it runs with."""

    java: str
    kafka_home: Path
    classes: Path

    @classmethod
    def build(cls, kafka_home: Path, java: str | None = None) -> JavaClient:
        """Compile the client (or reuse the cached classes for this source and Kafka version)."""
        java = find_java(java)
        version = kafka_version_of(kafka_home)
        digest = hashlib.sha256(SOURCE.read_bytes() + version.encode()).hexdigest()[:16]
        classes = default_cache_dir() / "java-client" / digest
        if not (classes / f"{MAIN_CLASS}.class").is_file():
            javac = str(Path(java).resolve().parent / "javac")
            if not Path(javac).is_file():
                javac = shutil.which("javac") or "javac"
            libs = str(kafka_home / "libs" / "*")
            classes.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=classes.parent, prefix=".build-"))
            try:
                out = subprocess.run(
                    [javac, "--release", "17", "-d", str(staging), "-cp", libs, str(SOURCE)],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=False,
                )
                if out.returncode != 0:
                    raise KafkaClusterError(f"javac failed on {SOURCE}:\n{out.stderr}")
                # A parallel build may have won the race; either copy is the same.
                try:
                    staging.rename(classes)
                except OSError:
                    if not (classes / f"{MAIN_CLASS}.class").is_file():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return cls(java=java, kafka_home=kafka_home, classes=classes)

    def run(self, args: Sequence[str], timeout: float = 180.0) -> ClientRun:
        """Run the client with these arguments and collect its JSON lines."""
        log4j = self.kafka_home / "config" / "tools-log4j2.yaml"
        cmd = [self.java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]
        if log4j.is_file():
            cmd.append(f"-Dlog4j2.configurationFile={log4j}")
        classpath = os.pathsep.join([str(self.classes), str(self.kafka_home / "libs" / "*")])
        cmd += ["-cp", classpath, MAIN_CLASS, *args]
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            start_new_session=True,
        )
        events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return ClientRun(events=events, returncode=out.returncode, stderr=out.stderr)

    def produce(
        self,
        bootstrap: str,
        topic: str,
        count: int,
        *,
        compression: str = "none",
        acks: str = "all",
        idempotent: bool = False,
        transactional_id: str | None = None,
        abort: bool = False,
        headers: Sequence[tuple[str, str]] = (),
        value_prefix: str | None = None,
        timeout: float = 180.0,
    ) -> ClientRun:
        """Produce ``count`` records (keys ``key-<i>``, values ``<prefix><i>``)."""
        args = ["produce", "--bootstrap", bootstrap, "--topic", topic, "--count", str(count)]
        args += ["--compression", compression, "--acks", acks]
        if idempotent:
            args.append("--idempotent")
        if transactional_id is not None:
            args += ["--transactional-id", transactional_id]
            if abort:
                args.append("--abort")
        for key, value in headers:
            args += ["--header", f"{key}={value}"]
        if value_prefix is not None:
            args += ["--value-prefix", value_prefix]
        return self.run(args, timeout)

    def consume(
        self,
        bootstrap: str,
        topic: str,
        count: int,
        *,
        isolation: str = "read_uncommitted",
        group: str | None = None,
        group_protocol: str = "consumer",
        timeout_ms: int = 30_000,
    ) -> ClientRun:
        """Consume up to ``count`` records from the beginning (in a group when given)."""
        args = ["consume", "--bootstrap", bootstrap, "--topic", topic, "--count", str(count)]
        args += ["--isolation", isolation, "--timeout-ms", str(timeout_ms)]
        if group is not None:
            args += ["--group", group, "--group-protocol", group_protocol]
        return self.run(args, timeout=timeout_ms / 1000 + 60)
