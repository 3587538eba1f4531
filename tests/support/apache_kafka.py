"""The Apache Kafka the tests run: the one apache-kafka/pom.xml pins, or a skip saying so."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiproxy.proxy.kafka_cluster import find_kafka_home, pinned_kafka_version

ROOT = Path(__file__).resolve().parents[2]
PINNED_VERSION = pinned_kafka_version(ROOT / "apache-kafka" / "pom.xml")


def kafka_home_or_skip() -> Path:
    """``$KIPROXY_KAFKA_HOME`` or the ``make kafka`` folder; else skip, saying how to get it."""
    home = find_kafka_home(PINNED_VERSION)
    if home is None:
        pytest.skip(
            f"no Apache Kafka {PINNED_VERSION} distribution: run `make kafka` "
            "(resolves it from Maven Central) or set KIPROXY_KAFKA_HOME"
        )
    return home
