"""A Java producer using Apicurio Registry's own Avro serde, driven from Python tests.

``ApicurioProducer.build(kafka_home)`` resolves the serde's jars (apicurio-registry/serdes.sh,
`make registry-serdes`: Maven Central, cached, a few seconds cold) and compiles
tests/java/ApicurioProducer.java with ``javac`` against them and the Kafka distribution's
``libs/*``, once per source, serde and Kafka version (classes cached under
``<make kafka cache>/apicurio-producer/<hash>/``). ``produce`` runs it and returns its JSON
events (the Java file's header comment lists them). Skips only where Java, javac or Maven is
missing; fails when Maven or javac fails.
"""

from __future__ import annotations

import base64
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

import pytest

from kiproxy_dev.kafka_distribution import default_cache_dir, kafka_version_of

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "java" / "ApicurioProducer.java"
SERDES = ROOT / "apicurio-registry" / "serdes.sh"
MAIN_CLASS = "ApicurioProducer"


def serde_libs_or_skip() -> Path:
    """The folder of the serde's jars, resolved (and cached) when missing."""
    missing = [tool for tool in ("java", "javac", "mvn") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} missing: the Apicurio serde producer needs a "
                    "JDK 17+ and Maven (`make registry-serdes` resolves the serde)")
    done = subprocess.run([str(SERDES)], capture_output=True, text=True, check=False,
                          timeout=600)
    if done.returncode != 0:
        pytest.fail(f"`make registry-serdes` failed:\n{done.stderr[-3000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


@dataclass(frozen=True, slots=True)
class Sent:
    """One record as the producer sent it: the serde's value bytes and headers."""

    kind: str
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerRun:
    """One run: what was sent, each record's delivery result, exit status and stderr."""

    events: list[dict[str, Any]]
    returncode: int
    stderr: str

    @property
    def sent(self) -> list[Sent]:
        """The records sent, in order."""
        return [Sent(e["kind"], base64.b64decode(e["value"]),
                     [(k, base64.b64decode(v)) for k, v in e["headers"]])
                for e in self.events if e["event"] == "sent"]

    def result(self, index: int) -> dict[str, Any]:
        """The delivery result (``delivered`` or ``error``) of record ``index``."""
        found = [e for e in self.events
                 if e["event"] in ("delivered", "error") and e["index"] == index]
        if not found:
            raise AssertionError(f"no delivery result for record {index} (status "
                                 f"{self.returncode}); stderr:\n{self.stderr[-3000:]}")
        return found[0]


@dataclass(frozen=True, slots=True, kw_only=True)
class ApicurioProducer:
    """The compiled producer and the class path it runs with."""

    java: str
    kafka_home: Path
    classpath: str

    @classmethod
    def build(cls, kafka_home: Path) -> ApicurioProducer:
        """Resolve the serde and compile the producer (or reuse the cached classes)."""
        libs = serde_libs_or_skip()
        java, javac = shutil.which("java") or "java", shutil.which("javac") or "javac"
        jars = sorted(p.name for p in libs.glob("*.jar"))
        digest = hashlib.sha256(SOURCE.read_bytes() + kafka_version_of(kafka_home).encode()
                                + "\n".join(jars).encode()).hexdigest()[:16]
        classes = default_cache_dir() / "apicurio-producer" / digest
        # The serde's jars first: its Avro and registry client are not in Kafka's libs.
        deps = os.pathsep.join([str(libs / "*"), str(kafka_home / "libs" / "*")])
        if not (classes / f"{MAIN_CLASS}.class").is_file():
            classes.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=classes.parent, prefix=".build-"))
            try:
                out = subprocess.run([javac, "--release", "17", "-d", str(staging), "-cp", deps,
                                      str(SOURCE)], capture_output=True, text=True,
                                     timeout=300, check=False)
                if out.returncode != 0:
                    pytest.fail(f"javac failed on {SOURCE}:\n{out.stderr}")
                try:
                    staging.rename(classes)
                except OSError:  # a parallel build won the race; either copy is the same
                    if not (classes / f"{MAIN_CLASS}.class").is_file():
                        raise
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        return cls(java=java, kafka_home=kafka_home,
                   classpath=os.pathsep.join([str(classes), deps]))

    def produce(self, bootstrap: str, topic: str, registry: str, schema: Path,
                records: Sequence[tuple[str, dict[str, Any]]], *,
                serde: Sequence[tuple[str, str]] = (), timeout: float = 120.0) -> ProducerRun:
        """Serialize and send each ``(kind, value)`` (kinds: good, unknown-id, cut) in order,
        one batch each; ``registry`` is Apicurio's native API URL (``.../apis/registry/v2``)."""
        cmd = [self.java, "-Xmx256m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1"]
        log4j = self.kafka_home / "config" / "tools-log4j2.yaml"
        if log4j.is_file():
            cmd.append(f"-Dlog4j2.configurationFile={log4j}")
        cmd += ["-cp", self.classpath, MAIN_CLASS, "--bootstrap", bootstrap, "--topic", topic,
                "--registry", registry, "--schema", str(schema)]
        for key, value in serde:
            cmd += ["--serde", f"{key}={value}"]
        cmd += [f"{kind}:{json.dumps(value)}" for kind, value in records]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False,
                             start_new_session=True)
        events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return ProducerRun(events=events, returncode=out.returncode, stderr=out.stderr)
