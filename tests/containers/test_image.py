"""The project's container image, built by ``make image`` and run as a sidecar would run it.

The image is built once per session (and reused across sessions while the
Dockerfile and the sources are unchanged: its tag is a hash of them) with
docker, or podman where no Docker engine answers; these tests skip, with the
reason, only where neither can run. Each container runs with ``--network host``
in front of the session's Tansu broker (tests/conftest.py's ``broker``), with a
transforming plugin from a host folder mounted at ``/plugins``:

* the proxy's process runs as the image's non-root user (uid 10001);
* ``/readyz``, ``/livez`` and ``/metrics`` answer on the metrics port, and the
  image keeps its HEALTHCHECK;
* a real producer and consumer (confluent-kafka) go through it: what the broker
  stores is what the plugin made of the records;
* SIGHUP sent to the container reloads the changed plugin, the next records
  show it;
* SIGTERM (``<engine> stop``, a grace period longer than the proxy's own) stops
  it cleanly, exit status 0, with every record the producer saw acknowledged
  stored in the broker.

The image's size and the time from ``<engine> run`` to ``/readyz`` answering 200
are printed (``-s`` or ``-rA`` shows them); docs/deployment.md records them.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import TANSU_NODE_ID, broker_port_start, consume

from kiproxy_dev.tansu import EmbeddedBroker, free_port

from .engine import Image

pytestmark = pytest.mark.timeout(900)  # a cold run builds the base image and the image

PLUGIN = '''
from kiproxy.interceptors import ProduceRequestInterceptor

SUFFIX = {suffix!r}


class Suffix(ProduceRequestInterceptor):
    def intercept(self, batch, ctx):
        return batch.with_records(r.with_value(r.value + SUFFIX) for r in batch.records)
'''
GRACE_SECONDS = 15
"""``<engine> stop``'s grace period: longer than the proxy's shutdown_grace_ms (10 s)."""


@dataclass
class Sidecar:
    """One running container of the image."""

    image: Image
    name: str
    bootstrap: str
    metrics: str
    plugins: Path
    ready_seconds: float

    def logs(self) -> str:
        """What the proxy printed so far."""
        done = self.image.run("logs", self.name, check=False)
        return done.stdout + done.stderr

    def wait_for_log(self, needle: str, timeout: float = 30) -> None:
        """Wait until ``needle`` is in the logs; AssertionError with them otherwise."""
        deadline = time.monotonic() + timeout
        while needle not in self.logs():
            assert time.monotonic() < deadline, f"no {needle!r} in:\n{self.logs()}"
            time.sleep(0.2)

    def state(self) -> dict[str, object]:
        """``<engine> inspect``'s State of the container."""
        out = self.image.run("inspect", "--format", "{{json .State}}", self.name).stdout
        state: dict[str, object] = json.loads(out)
        return state


def _http(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def _write_plugin(plugins: Path, suffix: bytes) -> None:
    tmp = plugins / ".suffix.py.tmp"
    tmp.write_text(PLUGIN.format(suffix=suffix))
    tmp.chmod(0o644)  # the container's user is not this file's owner
    tmp.replace(plugins / "suffix.py")


@contextmanager
def _running(image: Image, broker: EmbeddedBroker, plugins: Path,
             *flags: str) -> Iterator[Sidecar]:
    """The image in front of Tansu with ``flags``, ``/readyz`` answering 200; removed after."""
    listen, metrics = free_port(), free_port()
    start = broker_port_start((TANSU_NODE_ID,))
    name = f"kiproxy-test-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    image.run("run", "-d", "--name", name, "--network", "host",
              "-v", f"{plugins}:/plugins:ro", image.ref,
              "--upstream", broker.bootstrap, "--listen", f"127.0.0.1:{listen}",
              "--broker-port-start", str(start), "--metrics-listen", f"127.0.0.1:{metrics}",
              *flags)
    car = Sidecar(image, name, f"127.0.0.1:{listen}", f"127.0.0.1:{metrics}", plugins, 0.0)
    try:
        deadline, checked = time.monotonic() + 60, time.monotonic()
        while _http(f"http://{car.metrics}/readyz")[0] != 200:
            assert time.monotonic() < deadline, f"never ready:\n{car.logs()}"
            if time.monotonic() - checked > 1:  # asking the engine costs more than a poll
                assert car.state().get("Running"), f"the container exited:\n{car.logs()}"
                checked = time.monotonic()
            time.sleep(0.02)
        car.ready_seconds = time.monotonic() - started
        yield car
    finally:
        image.run("rm", "-f", "-t", "0", name, check=False)


@pytest.fixture
def sidecar(image: Image, broker: EmbeddedBroker, tmp_path: Path) -> Iterator[Sidecar]:
    """The image in front of Tansu with the ``suffix`` plugin mounted."""
    plugins = tmp_path / "plugins"
    plugins.mkdir(mode=0o755)
    plugins.chmod(0o755)
    _write_plugin(plugins, b" [A]")
    with _running(image, broker, plugins, "--interceptor", "suffix:Suffix") as car:
        yield car


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    from confluent_kafka import Producer

    errors: list[object] = []
    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "linger.ms": 5})
    for value in values:
        producer.produce(topic, value=value, partition=0,
                         on_delivery=lambda err, _m: errors.append(err) if err else None)
    assert producer.flush(30) == 0
    assert errors == []


def _end_offset(broker: EmbeddedBroker, topic: str) -> int:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": broker.bootstrap, "group.id": "end-offset"})
    try:
        return int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        consumer.close()


def test_the_image_runs_as_a_non_root_user_and_answers_its_endpoints(
        image: Image, sidecar: Sidecar) -> None:
    print(f"\n{image.ref}: /readyz 200 {sidecar.ready_seconds:.2f} s after `{image.engine} run`")
    status = sidecar.image.run("exec", sidecar.name, "cat", "/proc/1/status").stdout
    uids = next(line.split()[1:] for line in status.splitlines() if line.startswith("Uid:"))
    assert uids == ["10001"] * 4, status
    assert "kiproxy" in sidecar.image.run("exec", sidecar.name, "cat", "/proc/1/cmdline").stdout

    assert _http(f"http://{sidecar.metrics}/livez") == (200, "ok\n")
    assert _http(f"http://{sidecar.metrics}/readyz") == (200, "ready\n")
    status_code, text = _http(f"http://{sidecar.metrics}/metrics")
    assert status_code == 200 and "kiproxy_config_generation 1.0" in text

    inspected = json.loads(image.run("image", "inspect", image.ref).stdout)[0]
    health = inspected.get("Config", {}).get("Healthcheck") or inspected.get("Healthcheck")
    assert health and "/healthz" in " ".join(health["Test"]), inspected.get("Config")


def test_records_go_through_the_mounted_plugin_and_sighup_reloads_it(
        sidecar: Sidecar, broker: EmbeddedBroker) -> None:
    topic = f"image-{uuid.uuid4().hex[:8]}"
    _produce(sidecar.bootstrap, topic, [b"one", b"two"])

    _write_plugin(sidecar.plugins, b" [B]")
    sidecar.image.run("kill", "--signal", "HUP", sidecar.name)
    sidecar.wait_for_log("reload (signal) applied")
    _produce(sidecar.bootstrap, topic, [b"three"])

    expected = [b"one [A]", b"two [A]", b"three [B]"]
    assert [m.value() for m in consume(broker.bootstrap, topic, 3)] == expected
    assert [m.value() for m in consume(sidecar.bootstrap, topic, 3)] == expected


def test_sigterm_stops_it_cleanly_and_keeps_every_acknowledged_record(
        sidecar: Sidecar, broker: EmbeddedBroker) -> None:
    from confluent_kafka import Producer

    topic = f"image-stop-{uuid.uuid4().hex[:8]}"
    acked: list[bytes] = []
    stop = threading.Event()

    def produce() -> None:
        # Records still queued when the proxy has gone fail after 6 s (never acknowledged).
        producer = Producer({"bootstrap.servers": sidecar.bootstrap, "acks": "all",
                             "linger.ms": 2, "message.timeout.ms": 6000})
        i = 0
        while not stop.is_set():
            producer.produce(topic, value=f"r{i}".encode(), partition=0, on_delivery=lambda
                             err, msg: acked.append(msg.value()) if err is None else None)
            producer.poll(0.002)
            i += 1
        producer.flush(15)

    thread = threading.Thread(target=produce, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while len(acked) < 200:
        assert time.monotonic() < deadline, sidecar.logs()
        time.sleep(0.05)
    sidecar.image.run("stop", "-t", str(GRACE_SECONDS), sidecar.name, timeout=GRACE_SECONDS + 30)
    stop.set()
    thread.join(40)

    state = sidecar.state()
    assert state.get("ExitCode") == 0, f"{state}\n{sidecar.logs()}"  # 137: killed at the grace
    assert "kiproxy stopped" in sidecar.logs()
    assert acked, "the producer saw no acknowledgement"
    # Every acknowledged record, and whatever else the broker holds (Tansu's high
    # watermark can lag its last record by one, right after the write).
    count = max(_end_offset(broker, topic), len(acked))
    stored = {m.value() for m in consume(broker.bootstrap, topic, count, timeout=10)}
    missing = [v for v in acked if v + b" [A]" not in stored]
    assert missing == [], (f"{len(missing)} acknowledged record(s) not stored: {missing[:5]}; "
                           f"acked {len(acked)}, stored {len(stored)}, last acked {acked[-3:]}, "
                           f"stored {sorted(stored)[-3:]}")


def test_the_schema_registry_check_runs_in_the_image(
        image: Image, broker: EmbeddedBroker, registry_url: str, tmp_path: Path) -> None:
    """The image carries the ``schema_registry`` built-in (its extra and the compiled Avro
    check): a confluent-kafka AvroSerializer's record is stored, a record framed with an
    unregistered id is refused with its record error."""
    from confluent_kafka import KafkaError, Producer
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.avro import AvroSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topic = f"image-contract-{uuid.uuid4().hex[:8]}"
    schema = {"type": "record", "name": "Order", "namespace": "image",
              "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "double"}]}
    serialize = AvroSerializer(SchemaRegistryClient({"url": registry_url}), json.dumps(schema))
    good = bytes(serialize({"id": "o-1", "amount": 2.5},
                           SerializationContext(topic, MessageField.VALUE)))
    unregistered = b"\x00" + (987_654).to_bytes(4, "big") + good[5:]
    config = {"registry": {"url": registry_url}, "topics": {topic: {"value": "payload"}}}
    plugins = tmp_path / "plugins"
    plugins.mkdir(mode=0o755)
    with _running(image, broker, plugins, "--interceptor", "schema_registry",
                  "--interceptor-config", json.dumps(config)) as car:
        _produce(car.bootstrap, topic, [good])
        reports: list[KafkaError | None] = []
        producer = Producer({"bootstrap.servers": car.bootstrap, "acks": "all", "retries": 0})
        producer.produce(topic, value=unregistered, partition=0,
                         on_delivery=lambda err, _m: reports.append(err))
        assert producer.flush(30) == 0
    assert len(reports) == 1 and reports[0] is not None, reports
    assert reports[0].code() == KafkaError.INVALID_RECORD, reports[0]
    assert [m.value() for m in consume(broker.bootstrap, topic, 1)] == [good]
