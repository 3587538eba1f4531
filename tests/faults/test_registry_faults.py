"""A misbehaving schema registry, through a real proxy with real producers.

Two ``kiproxy run`` processes in front of Tansu check one topic each against the
stand-in registry (``registry_standin.py``), one with ``on_registry_unavailable:
reject``, one with ``pass``; a third topic has no contract. For each fault (hang, HTTP
500, garble, flood with and without a length, trickle, uncompilable schema, closed
port), a confluent-kafka producer (``retries: 0``, so its delivery report carries the
proxy's own answer) sends a record framed with an id neither proxy has seen:

* under ``reject`` it gets REQUEST_TIMED_OUT (7), which every client retries (but for
  3.5 MB answers, under the 4 MiB bound: three are looked up and stored);
* under ``pass`` it is delivered;
* meanwhile a producer on the uncontracted topic, through the same proxy, has every
  record delivered;
* once the registry is healthy again, the refused record is delivered within a few
  retries (after ``negative_ttl_s``);

and, over the whole run, the proxy's RSS grows by less than 64 MiB (ten 50 MB answers
once added ~100 MiB each), its log holds no ERROR line or traceback, and each fault
that needs a person left its WARNING. No latency is asserted (``bench/registry_faults.py``
measures the other topic's p99).
"""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, launch_proxy
from integration.test_interception import _create_topics

from kiproxy_dev.tansu import EmbeddedBroker

from .registry_standin import StandInRegistry

pytestmark = pytest.mark.timeout(300)

ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "double"}]}
BODY = b"\x02x" + struct.pack("<d", 1.0)  # {"id": "x", "amount": 1.0}
FAULTS = ("hang", "http500", "garble", "flood", "flood_chunked", "large", "trickle",
          "uncompilable", "closed")
REQUEST_TIMED_OUT = 7
INVALID_RECORD = 87
TIMEOUT_MS = 800
NEGATIVE_TTL_S = 1.0
CACHE_TTL_S = 2.0


def framed(schema_id: int, payload: bytes = BODY) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


def rss_bytes(pid: int) -> int:
    """The process's resident set size (``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def produce_one(bootstrap: str, topic: str, value: bytes) -> Any:
    """Send one record (no retries); the delivery report's error, None when stored."""
    from confluent_kafka import Producer

    report: list[Any] = []
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "retries": 0,
                         "message.timeout.ms": 20000})
    producer.produce(topic, value, partition=0, on_delivery=lambda err, _m: report.append(err))
    assert producer.flush(30) == 0, "no delivery report"
    return report[0]


class OtherTopic:
    """A producer on a topic with no contract, one record at a time, in a thread."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.errors: list[Any] = []
        self.delivered = 0
        self._stop = threading.Event()
        self._producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self._topic = topic
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._producer.produce(self._topic, b"plain", on_delivery=self._report)
            self._producer.flush(30)
            time.sleep(0.02)

    def _report(self, err: Any, _msg: Any) -> None:
        if err is None:
            self.delivered += 1
        else:
            self.errors.append(err)

    def __enter__(self) -> OtherTopic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


@pytest.fixture
def proxies(broker: EmbeddedBroker, standin: StandInRegistry
            ) -> Iterator[tuple[dict[str, ProxyProcess], dict[str, str], str]]:
    run = uuid.uuid4().hex[:6]
    topics = {"reject": f"rf{run}-strict", "pass": f"rf{run}-lenient"}
    plain = f"rf{run}-plain"
    _create_topics(broker.bootstrap, *topics.values(), plain)
    started = {}
    for policy, topic in topics.items():
        config = {"registry": {"url": standin.url, "timeout_ms": TIMEOUT_MS,
                               "cache_ttl_s": CACHE_TTL_S, "negative_ttl_s": NEGATIVE_TTL_S},
                  "on_registry_unavailable": policy,
                  "topics": {topic: {"value": "payload"}}}
        started[policy] = launch_proxy(broker.bootstrap, interceptor="schema_registry",
                                       interceptor_config=config)
    yield started, topics, plain
    for p in started.values():
        p.stop()


def delivered_eventually(bootstrap: str, topic: str, value: bytes) -> Any:
    """Send until delivered, as a retrying producer would: the last error (None: stored)."""
    deadline = time.monotonic() + 20
    err = produce_one(bootstrap, topic, value)
    while err is not None and time.monotonic() < deadline:
        assert err.code() == REQUEST_TIMED_OUT, err
        time.sleep(0.3)
        err = produce_one(bootstrap, topic, value)
    return err


def test_every_registry_fault_is_a_retriable_answer_or_a_pass_and_never_a_stall(
        proxies: tuple[dict[str, ProxyProcess], dict[str, str], str],
        standin: StandInRegistry) -> None:
    procs, topics, plain = proxies
    next_id = iter(range(1000, 2000))
    for topic in topics.values():
        standin.register(999, ORDER, f"{topic}-value")
    for policy, topic in topics.items():  # warm up: one id cached per proxy
        standin.register(sid := next(next_id), ORDER, f"{topic}-value")
        assert produce_one(procs[policy].bootstrap, topic, framed(sid)) is None
    rss_before = {p: rss_bytes(proc.process.pid) for p, proc in procs.items()}
    peak = dict(rss_before)

    for fault in FAULTS:
        ids = {}
        for policy, topic in topics.items():
            ids[policy] = next(next_id)
            standin.register(ids[policy], ORDER, f"{topic}-value")
        with standin.phase(fault), OtherTopic(procs["reject"].bootstrap, plain) as other:
            if fault == "large":  # 3.5 MB answers, under the limit: served
                for _ in range(3):
                    standin.register(sid := next(next_id), ORDER, f"{topics['reject']}-value")
                    assert produce_one(procs["reject"].bootstrap, topics["reject"],
                                       framed(sid)) is None
            for _ in range(5 if fault.startswith("flood") else 1 if fault != "large" else 0):
                err = produce_one(procs["reject"].bootstrap, topics["reject"],
                                  framed(ids["reject"]))
                assert err is not None and err.code() == REQUEST_TIMED_OUT, (fault, err)
            assert produce_one(procs["pass"].bootstrap, topics["pass"],
                               framed(ids["pass"])) is None, fault
            for p, proc in procs.items():
                peak[p] = max(peak[p], rss_bytes(proc.process.pid))
        assert other.errors == [] and other.delivered > 0, (fault, other.errors)
        # Healthy again: the refused record is stored once negative_ttl_s has passed.
        assert delivered_eventually(procs["reject"].bootstrap, topics["reject"],
                                    framed(ids["reject"])) is None, fault

    rss_after = {p: rss_bytes(proc.process.pid) for p, proc in procs.items()}
    for p in procs:
        assert peak[p] - rss_before[p] < 64 * 1024 * 1024, (p, rss_before[p], peak[p])
    for proc in procs.values():
        assert proc.alive()
        bad = [line for line in proc.lines if "level=ERROR" in line or "Traceback" in line]
        assert bad == [], "\n".join(bad)
        proc.wait_for_line("level=WARNING", "registry.max_response_bytes")
        proc.wait_for_line("level=WARNING", "cannot be compiled by the proxy", "NoSuchType")
        proc.wait_for_line("level=WARNING", "not JSON")
        proc.wait_for_line("level=WARNING", "HTTP 500")
    print(json.dumps({"rss_before": rss_before, "rss_peak": peak, "rss_after": rss_after}))


def test_a_schema_is_asked_again_after_cache_ttl_s_and_a_fixed_schema_after_negative_ttl_s(
        proxies: tuple[dict[str, ProxyProcess], dict[str, str], str],
        standin: StandInRegistry) -> None:
    procs, topics, _ = proxies
    proxy, topic = procs["reject"], topics["reject"]
    standin.register(7, ORDER, f"{topic}-value")
    assert produce_one(proxy.bootstrap, topic, framed(7)) is None
    asked = standin.asked("/schemas/ids/7")
    time.sleep(CACHE_TTL_S + 0.5)
    assert produce_one(proxy.bootstrap, topic, framed(7)) is None  # served while refreshed
    deadline = time.monotonic() + 10
    while standin.asked("/schemas/ids/7") == asked and time.monotonic() < deadline:
        time.sleep(0.1)
    assert standin.asked("/schemas/ids/7") == asked + 1

    standin.register(8, ORDER, f"{topic}-value")
    with standin.phase("uncompilable"):
        err = produce_one(proxy.bootstrap, topic, framed(8))
        assert err is not None and err.code() == REQUEST_TIMED_OUT  # not the record's fault
    assert delivered_eventually(proxy.bootstrap, topic, framed(8)) is None
    err = produce_one(proxy.bootstrap, topic, framed(8, b"\x02"))  # does not match: its fault
    assert err is not None and err.code() == INVALID_RECORD
