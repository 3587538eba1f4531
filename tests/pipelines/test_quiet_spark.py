"""``kiproxy replay`` keeps Spark's own start-up messages out of the terminal unless
``--verbose``: the user sees kiproxy's lines, not the JVM's and log4j's."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from support.processes import runtime_env

from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(300)

PLUGINS = Path(__file__).parent / "plugins"
ROOT = Path(__file__).parents[2]
SPARK_BANNER = ("Using Spark's default log4j profile", "Setting default log level",
                "To adjust logging level", "NativeCodeLoader", "Using incubator modules")


@pytest.fixture(scope="module")
def topic(broker: EmbeddedBroker) -> str:
    from confluent_kafka import Producer

    name = f"quiet-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(3):
        producer.produce(name, b'{"n": %d}' % i, partition=0)
    assert producer.flush(15) == 0
    return name


def _replay(broker: EmbeddedBroker, topic: str, report: Path, *extra: str
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiproxy", "replay", "--bootstrap", broker.bootstrap,
         "--topic", topic, "--interceptor", "replay_rules:RejectBad", "--plugins-dir",
         str(PLUGINS), "--report", str(report), "--no-progress", *extra],
        capture_output=True, text=True, timeout=240, cwd=ROOT, env=runtime_env())


def test_a_replay_prints_no_spark_banner(broker: EmbeddedBroker, topic: str,
                                         tmp_path: Path) -> None:
    done = _replay(broker, topic, tmp_path / "report")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("kiproxy replay: 3 records in 1 batches")


def test_verbose_shows_what_spark_says(broker: EmbeddedBroker, topic: str,
                                       tmp_path: Path) -> None:
    done = _replay(broker, topic, tmp_path / "report", "--verbose")
    assert done.returncode == 0, done.stderr
    assert any(line in done.stderr for line in SPARK_BANNER), done.stderr
