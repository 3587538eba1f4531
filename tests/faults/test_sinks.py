"""The side-copy sinks' broker gone, hanging, slow or refusing, under real producers.

One ``kiproxy run`` per fault, in front of the session's Tansu, with:

* route ``guard`` on the checked topic: ``my_policy:MyPolicy`` refuses batches holding a
  ``bad`` value, and the refused records are copied to a dead-letter topic;
* a plain topic no route touches;
* ``audit.topic``: every produce response's events go to an audit topic.

Both sinks (``dead_letter_sink``, ``audit_sink``) write to a second Tansu reached through
a :class:`~faults.kafka_standin.FaultyFront` (or to a port where nothing listens), which
is put into the fault before the proxy starts. Two confluent-kafka producers then send
rounds of records - good and bad on the checked topic, good on the plain one - and the
test checks, for every fault:

* every record's answer is what it is with a healthy sink: good records stored, bad ones
  refused (INVALID_RECORD: the rule names each bad record), the plain topic untouched;
* what the sinks could not write is counted in ``kiproxy_sink_dropped_total`` and
  named in a WARNING line (sink, topic, count); no ERROR line and no traceback;
* the proxy's resident memory stays within a generous bound of where it started
  (memory, never time, is asserted);
* once the fault is lifted, the sinks write again.
"""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from conftest import ROOT, launch_proxy

from faults.kafka_standin import FaultyFront, Mode, TansuBehind, broker_behind, free_port
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(240)

ROUNDS = 30
GOOD = 40
BAD = 40
VALUE_BYTES = 20_000
INVALID_RECORD = 87
"""What a bad record's producer gets: the rule names each bad record (a record error)."""
RSS_GROWTH_BOUND = 150 * 2**20
"""Resident memory the proxy may gain under a fault: a sanity bound far above the sinks'
queue bounds (4 MiB and 64 KiB here) and the 128 MiB of freed heap the allocator may keep
(``kiproxy.proxy.malloc``); the queues' own bound is checked on their gauges."""

SINK = {"request_timeout_ms": 1000, "close_timeout_ms": 2000, "topic_check_interval_ms": 500,
        "linger_ms": 5}
DEAD_LETTER_SINK = {**SINK, "queue_records": 400, "queue_bytes": 4 * 2**20}
AUDIT_SINK = {**SINK, "queue_records": 20, "queue_bytes": 64 * 2**10}
"""Small, so that a fault fills it at once. The healthy run, which checks that nothing is
dropped, gets :data:`HEALTHY_AUDIT_SINK`: a healthy sink behind a loaded machine can
fall 20 events behind for a moment, and dropping them then is the bound at work."""
HEALTHY_AUDIT_SINK = {**SINK, "queue_records": 10_000, "queue_bytes": 16 * 2**20}


def audit_sink(fault: str) -> dict[str, int]:
    return HEALTHY_AUDIT_SINK if fault == "healthy" else AUDIT_SINK

FAULTS: dict[str, Mode | None] = {
    "healthy": "forward",
    "gone": None,          # nothing listens on the sinks' bootstrap port
    "hang": "hang",        # accepts, reads, never answers
    "slow": "trickle",     # answers 64 bytes every 0.1 s
    "close": "close",      # accepts and closes at once
    "garble": "garble",    # answers with random frames
    "topic_missing": "forward",  # the dead-letter topic does not exist (never created)
    "sasl_refused": "forward",   # the sinks authenticate; the broker has no SASL
}
UNRECOVERABLE = {"sasl_refused"}
"""Faults in the sinks' own settings, read once per process: nothing to lift at run time."""
SASL = {"mechanism": "PLAIN", "username": "sink", "password": "secret"}


def create_topic(bootstrap: str, name: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])[name].result(15)


def metrics_text(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        return str(answer.read().decode())


def samples(address: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of every sample of ``name``."""
    out = {}
    for line in metrics_text(address).splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line[len(name) + 1:].rpartition("} ")
            out[labels] = float(value)
    return out


def total(address: str, name: str, **labels: str) -> float:
    """The sum of ``name`` over the samples carrying every one of ``labels``."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples(address, name).items()
               if all(w in k.split(",") for w in want))


class RssWatch:
    """The proxy's resident memory: at start, the peak while watching, and now."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.before = self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:  # the proxy stopped
                return

    def now(self) -> int:
        rss = self.process.memory_info().rss
        self.peak = max(self.peak, rss)
        return rss

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def produce_rounds(bootstrap: str, checked: str, plain: str, rounds: int) -> dict[str, Any]:
    """Each round: ``GOOD`` good then ``BAD`` bad records to ``checked`` (each group flushed
    alone, so a batch is all good or all bad), and ``GOOD`` records to ``plain``; every
    record's delivery error code (0: stored), by topic and kind."""
    from confluent_kafka import Producer

    def producer(name: str) -> Any:
        return Producer({"bootstrap.servers": bootstrap, "client.id": name, "linger.ms": 5,
                         "message.timeout.ms": 30000, "enable.idempotence": False})

    on_checked, on_plain = producer("checked-producer"), producer("plain-producer")
    codes: dict[str, list[int]] = {"good": [], "bad": [], "plain": []}

    def report(kind: str) -> Any:
        return lambda err, _msg: codes[kind].append(0 if err is None else err.code())

    for r in range(rounds):
        for kind, target, p in (("good", checked, on_checked), ("bad", checked, on_checked),
                                ("plain", plain, on_plain)):
            for i in range(BAD if kind == "bad" else GOOD):
                value = f"{kind}-{r}-{i}-".encode().ljust(VALUE_BYTES, b"x")
                p.produce(target, value, key=b"k%d" % i, on_delivery=report(kind))
            p.flush(60)
    return codes


@pytest.fixture
def sink_stack() -> Iterator[ExitStack]:
    """What a test starts for its sinks (fronts, brokers, the proxy), stopped after it."""
    with ExitStack() as stack:
        yield stack


def start_sink_cluster(stack: ExitStack, tmp_path: Path, fault: str
                       ) -> tuple[str, FaultyFront | None, TansuBehind | None]:
    """The sinks' bootstrap address, and the front and broker behind it (None when gone)."""
    if FAULTS[fault] is None:
        return f"127.0.0.1:{free_port()}", None, None
    front = stack.enter_context(FaultyFront(trickle_bytes=64, trickle_delay=0.1))
    broker = stack.enter_context(broker_behind(front, tmp_path / "sink-broker.log"))
    return front.address, front, broker


def recover(stack: ExitStack, tmp_path: Path, bootstrap: str, front: FaultyFront | None
            ) -> tuple[FaultyFront, TansuBehind | None]:
    """Lift the fault: a healthy front (and broker) on ``bootstrap``."""
    if front is None:  # gone: a broker comes up where nothing listened
        port = int(bootstrap.rsplit(":", 1)[1])
        front = stack.enter_context(FaultyFront(port=port))
        broker = stack.enter_context(broker_behind(front, tmp_path / "sink-broker.log"))
        return front, broker
    front.set_mode("forward")
    return front, None


def sink_config(path: Path, metrics: str, bootstrap: str, fault: str,
                names: dict[str, str]) -> Path:
    sasl = {"sasl": SASL} if fault == "sasl_refused" else {}
    path.write_text(yaml.safe_dump({
        "plugins_dir": str(ROOT / "tests" / "plugins"), "metrics_listen": metrics,
        "routes": [{"name": "guard", "match": {"topic": names["checked"]},
                    "dead_letter": {"topic": names["dlq"]},
                    "interceptors": [{"class": "my_policy:MyPolicy"}]}],
        "audit": {"topic": names["audit"]},
        "dead_letter_sink": {**DEAD_LETTER_SINK, "bootstrap": [bootstrap], **sasl},
        "audit_sink": {**audit_sink(fault), "bootstrap": [bootstrap], **sasl},
    }))
    return path


def by_sink(metrics: str, name: str) -> dict[str, float]:
    return {s: total(metrics, name, sink=s) for s in ("dead_letter", "audit")}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_sink_fault_changes_no_answer_and_memory_stays_bounded(
        fault: str, broker: EmbeddedBroker, tmp_path: Path, sink_stack: ExitStack) -> None:
    stack = sink_stack
    run = uuid.uuid4().hex[:8]
    names = {kind: f"{kind}-{run}" for kind in ("checked", "plain", "dlq", "audit")}
    bootstrap, front, _ = start_sink_cluster(stack, tmp_path, fault)
    if front is not None and fault != "topic_missing":
        create_topic(front.address, names["dlq"])  # through the front while it forwards
    if front is not None:
        front.set_mode(FAULTS[fault] or "forward")
    metrics = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(broker.bootstrap, config_file=sink_config(
        tmp_path / "kiproxy.yaml", metrics, bootstrap, fault, names))
    stack.callback(proxy.stop)
    rss = RssWatch(proxy.process.pid)
    stack.callback(rss.stop)

    codes = produce_rounds(proxy.bootstrap, names["checked"], names["plain"], ROUNDS)
    # Every answer is what it is with a healthy sink.
    assert codes == {"good": [0] * (ROUNDS * GOOD), "bad": [INVALID_RECORD] * (ROUNDS * BAD),
                     "plain": [0] * (ROUNDS * GOOD)}, fault
    dropped = by_sink(metrics, "kiproxy_sink_dropped_total")
    reasons = samples(metrics, "kiproxy_sink_dropped_total")
    if fault == "healthy":
        assert dropped == {"dead_letter": 0, "audit": 0}, reasons
    if fault not in ("healthy", "slow"):
        assert dropped["dead_letter"] > 0, proxy.log
        proxy.wait_for_line("level=WARNING", "dead_letter sink: dropped",
                            f"for topic {names['dlq']}")
    if fault not in ("healthy", "slow", "topic_missing"):
        assert dropped["audit"] > 0, proxy.log
        proxy.wait_for_line("level=WARNING", "audit sink: dropped",
                            f"for topic {names['audit']}")
    queued = by_sink(metrics, "kiproxy_sink_queued_bytes")
    assert queued["dead_letter"] <= DEAD_LETTER_SINK["queue_bytes"], queued
    assert queued["audit"] <= audit_sink(fault)["queue_bytes"], queued
    assert rss.peak - rss.before < RSS_GROWTH_BOUND, (rss.before, rss.peak)

    if fault not in UNRECOVERABLE:  # the fault is lifted: both sinks write again
        written_before = by_sink(metrics, "kiproxy_sink_written_total")
        front, _ = recover(stack, tmp_path, bootstrap, front)
        if fault == "topic_missing" or FAULTS[fault] is None:
            create_topic(front.address, names["dlq"])
        deadline = time.monotonic() + 60
        while True:
            answers = produce_rounds(proxy.bootstrap, names["checked"], names["plain"], 1)
            assert answers["bad"] == [INVALID_RECORD] * BAD
            written = by_sink(metrics, "kiproxy_sink_written_total")
            if all(written[s] > written_before[s] for s in written):
                break
            assert time.monotonic() < deadline, (fault, written, proxy.log)
            time.sleep(0.5)
    after = rss.now()
    assert rss.peak - rss.before < RSS_GROWTH_BOUND, (rss.before, rss.peak)

    # A clean stop; no ERROR line, no traceback; the sinks' warnings rate-limited.
    assert proxy.alive()
    assert proxy.stop() == 0
    errors = [line for line in proxy.lines if "level=ERROR" in line or "Traceback" in line
              or " exc=" in line]
    assert errors == [], "\n".join(errors)
    warnings = [line for line in proxy.lines if "level=WARNING" in line and " sink: " in line]
    assert len(warnings) <= 12, "\n".join(warnings)  # a few per sink, topic and reason
    print(f"\nFAULT {fault}: checked good/bad={set(codes['good'])}/{set(codes['bad'])} "
          f"plain={set(codes['plain'])} dropped={ {k: v for k, v in reasons.items() if v} } "
          f"rss MiB before/peak/after={rss.before / 2**20:.0f}/{rss.peak / 2**20:.0f}/"
          f"{after / 2**20:.0f} sink warnings={len(warnings)} errors={len(errors)}")
    for line in warnings:
        print("   ", line[:260])
