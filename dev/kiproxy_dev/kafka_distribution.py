"""Where kiproxy's tests find Apache Kafka and Java, and the checks that refuse bad ones.

``make kafka`` (apache-kafka/fetch.sh) fills ``$KIPROXY_KAFKA_CACHE`` (default
~/.cache/kiproxy/kafka) with ``kafka_2.13-<version>/`` folders laid out like an
unpacked Kafka distribution and stamps each complete one. ``find_kafka_home``
picks one (``$KIPROXY_KAFKA_HOME`` wins); ``kafka_version_of`` and ``find_java``
refuse a folder without Kafka's jars and a Java older than 17 with one message
that says what to do. Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

__all__ = [
    "KafkaClusterError",
    "default_cache_dir",
    "find_java",
    "find_kafka_home",
    "kafka_version_of",
    "pinned_kafka_version",
    "storage_tool_class",
]

MIN_JAVA = 17
STAMP = ".kiproxy-complete"  # written by apache-kafka/fetch.sh into a complete folder
STORAGE_TOOL_CLASSES = ("kafka.tools.StorageTool", "org.apache.kafka.tools.StorageTool")


class KafkaClusterError(RuntimeError):
    """A Kafka cluster could not be started or changed; the message says why and what to do."""


def default_cache_dir() -> Path:
    """Where ``make kafka`` puts Kafka: ``$KIPROXY_KAFKA_CACHE`` or ~/.cache/kiproxy/kafka."""
    env = os.environ.get("KIPROXY_KAFKA_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "kiproxy" / "kafka"


def pinned_kafka_version(pom: Path) -> str:
    """The ``kafka.version`` of ``apache-kafka/pom.xml``, the one place the version is written."""
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", pom.read_text())
    if match is None:
        raise KafkaClusterError(f"{pom} has no <kafka.version> property")
    return match.group(1)


def find_kafka_home(version: str | None = None) -> Path | None:
    """The Kafka distribution to test against, or None when there is none.

    ``$KIPROXY_KAFKA_HOME`` when set (returned as is, so a wrong value fails loudly
    in ``KafkaCluster``), else the newest complete ``make kafka`` cache folder
    (of ``version`` when given), else None.
    """
    env = os.environ.get("KIPROXY_KAFKA_HOME")
    if env:
        return Path(env)
    cache = default_cache_dir()
    if not cache.is_dir():
        return None
    found: list[tuple[tuple[int, ...], Path]] = []
    for home in cache.glob("kafka_2.13-*"):
        v = home.name.removeprefix("kafka_2.13-")
        complete = (home / STAMP).is_file() and (home / "libs" / f"kafka_2.13-{v}.jar").is_file()
        if complete and (version is None or v == version):
            found.append((tuple(int(p) for p in re.findall(r"\d+", v)), home))
    return max(found)[1] if found else None


def kafka_version_of(kafka_home: Path) -> str:
    """The Kafka version of a distribution folder, from its ``libs/kafka_2.13-<v>.jar``."""
    for jar in sorted((kafka_home / "libs").glob("kafka_2.13-*.jar")):
        v = jar.name.removeprefix("kafka_2.13-").removesuffix(".jar")
        if re.fullmatch(r"\d+\.\d+\.\d+(?:-[\w.]+)?", v) and not v.endswith(("-test", "-sources")):
            return v
    raise KafkaClusterError(
        f"{kafka_home} is not an Apache Kafka distribution: there is no libs/kafka_2.13-*.jar; "
        "run `make kafka` and pass the folder it prints (or set KIPROXY_KAFKA_HOME)"
    )


def java_major_version(java: str) -> int:
    """The major version of a ``java`` executable (8 for 1.8), read from ``java -version``."""
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=60, check=False
        )
    except OSError as e:
        raise KafkaClusterError(f"cannot run {java} -version: {e}") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        raise KafkaClusterError(
            f"cannot read the Java version from `{java} -version`: {out.stderr!r}"
        )
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def find_java(java: str | None) -> str:
    """``java``, else ``$JAVA_HOME/bin/java``, else ``java`` on PATH; Java 17+ or an error."""
    if java is None:
        java_home = os.environ.get("JAVA_HOME")
        java = str(Path(java_home) / "bin" / "java") if java_home else shutil.which("java")
    if java is None or not (Path(java).is_file() or shutil.which(java)):
        raise KafkaClusterError(
            f"no Java found ({java or 'java not on PATH'}): Apache Kafka 4 needs Java "
            f"{MIN_JAVA} or newer; install it or set JAVA_HOME"
        )
    major = java_major_version(java)
    if major < MIN_JAVA:
        raise KafkaClusterError(
            f"{java} is Java {major}, too old: Apache Kafka 4 brokers need Java {MIN_JAVA} "
            "or newer; set JAVA_HOME to a newer one"
        )
    return java


def storage_tool_class(kafka_home: Path) -> str:
    """The main class ``kafka-storage.sh`` runs: in 4.x's core jar; later releases may move it."""
    for jar in sorted((kafka_home / "libs").glob("kafka*.jar")):
        with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(jar) as z:
            names = set(z.namelist())
            for cls in STORAGE_TOOL_CLASSES:
                if cls.replace(".", "/") + ".class" in names:
                    return cls
    raise KafkaClusterError(
        f"no StorageTool ({' or '.join(STORAGE_TOOL_CLASSES)}) in {kafka_home}/libs: "
        "is this an Apache Kafka 4 distribution?"
    )
