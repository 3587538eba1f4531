"""The Apache Kafka the tests run: the one apache-kafka/pom.xml pins, or a skip saying so.

``session_cluster`` builds the one 1-node cluster the whole session shares
(tests/conftest.py's ``apache_kafka`` fixture starts it): a PLAINTEXT listener,
what most tests use, and a SASL_PLAINTEXT listener offering PLAIN, SCRAM-SHA-256
and SCRAM-SHA-512 for ``SASL_USERS`` (SCRAM users written into the metadata log
when the storage is formatted, as ``kafka-storage format --add-scram`` does;
PLAIN users in the listener's JAAS setting). Batches of up to 8 MiB are accepted;
records are never aged out (no time retention); the log cleaner looks for work every 200 ms.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy_dev.kafka_cluster import KafkaCluster, find_kafka_home, pinned_kafka_version

ROOT = Path(__file__).resolve().parents[2]
PINNED_VERSION = pinned_kafka_version(ROOT / "apache-kafka" / "pom.xml")
SASL_LISTENER = "SASL_PLAINTEXT"
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")
SASL_USERS = {"alice": "alice-secret", "bob": "bob-secret"}
"""The same users as tests/integration/test_sasl.py's stand-in broker."""


def kafka_home_or_skip() -> Path:
    """``$KIPROXY_KAFKA_HOME`` or the ``make kafka`` folder; else skip, saying how to get it."""
    home = find_kafka_home(PINNED_VERSION)
    if home is None:
        pytest.skip(
            f"no Apache Kafka {PINNED_VERSION} distribution: run `make kafka` "
            "(resolves it from Maven Central) or set KIPROXY_KAFKA_HOME"
        )
    return home


def sasl_settings(users: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """Server properties of the SASL_PLAINTEXT listener and the ``--add-scram`` arguments."""
    prefix = f"listener.name.{SASL_LISTENER.lower()}"
    plain_users = " ".join(f'user_{name}="{password}"' for name, password in users.items())
    properties = {
        "sasl.enabled.mechanisms": ",".join(SASL_MECHANISMS),
        f"{prefix}.plain.sasl.jaas.config":
            f"org.apache.kafka.common.security.plain.PlainLoginModule required {plain_users};",
    }
    scram_arguments: list[str] = []
    for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
        properties[f"{prefix}.{mechanism.lower()}.sasl.jaas.config"] = (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;")
        for name, password in users.items():
            scram_arguments += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
    return properties, scram_arguments


def session_cluster(home: Path) -> KafkaCluster:
    """The shared 1-node cluster (not started): PLAINTEXT plus the SASL listener."""
    properties, scram_arguments = sasl_settings(SASL_USERS)
    # Batches up to 8 MiB, as Tansu takes them (the interception suite sends 1 MiB records).
    properties["message.max.bytes"] = str(8 << 20)
    # Tests write records stamped years ago (timestamps must survive to the ms); time
    # retention would delete them at the broker's first retention check, 30 s after start,
    # under whichever test happens to be reading then.
    properties["log.retention.ms"] = "-1"
    # The log cleaner looks for work every 200 ms instead of every 15 s (a compacted topic's
    # test waits for it).
    properties["log.cleaner.backoff.ms"] = "200"
    return KafkaCluster(home, nodes=1, listeners={SASL_LISTENER: "SASL_PLAINTEXT"},
                        overrides=properties, format_arguments=scram_arguments)
