"""Hostile plugins through a live proxy: Tansu, ``kiproxy run`` as a subprocess, real
producers. Extism plugins (AssemblyScript, ``tests/extism/plugins``): one allocating
without end, one answering with 50 MiB, one trapping on every call, one leaving out
``"value"``; and a Python plugin (``tests/plugins/tp_balloon.py``) turning ten small
records into 200 MB. Each producer is told the cause in words naming the plugin; the
proxy's memory ends within a generous bound (a plugin holds at most ``pool_size`` times
its memory cap) and its threads come back to where they were. No timing is asserted.

Figures (RSS, threads, log lines) are printed for ``-s`` runs.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import TESTS, ProxyProcess, high_watermark, launch_proxy

from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(300)

INVALID_RECORD = 87
MiB = 2**20
CAP = 256 * MiB  # the default memory cap of a Wasm instance
POOL = 2  # the extism interceptor's default pool_size
TOPICS = {k: f"hostile-{k}-{uuid.uuid4().hex[:6]}"
          for k in ("grow", "huge", "trap", "novalue", "fine", "balloon")}


class Watch:
    """The proxy process's RSS and thread count, sampled on a thread until stopped."""

    def __init__(self, proxy: ProxyProcess) -> None:
        self.process = psutil.Process(proxy.process.pid)
        self.rss_before, self.threads_before = self.sample()
        self.rss_peak, self.threads_peak = self.rss_before, self.threads_before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> tuple[int, int]:
        return self.process.memory_info().rss, self.process.num_threads()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            rss, threads = self.sample()
            self.rss_peak = max(self.rss_peak, rss)
            self.threads_peak = max(self.threads_peak, threads)

    def settle(self, seconds: float = 3.0) -> tuple[int, int]:
        """RSS and threads after the proxy had ``seconds`` idle (its heap trim runs each
        second)."""
        time.sleep(seconds)
        self._stop.set()
        self._thread.join()
        return self.sample()

    def report(self, what: str, after: tuple[int, int]) -> str:
        line = (f"{what}: RSS {self.rss_before / MiB:.0f}/{self.rss_peak / MiB:.0f}/"
                f"{after[0] / MiB:.0f} MiB, threads {self.threads_before}/"
                f"{self.threads_peak}/{after[1]} (before/peak/after)")
        print(line)
        return line


def kafka_python_error(bootstrap: str, topic: str, value: bytes) -> str:
    """What kafka-python tells its caller for one record (it shows the partition's
    error message); empty when the record was stored."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, retries=0, max_request_size=2**20)
    try:
        producer.send(topic, value, partition=0).get(60)
        return ""
    except Exception as exc:
        return str(exc)
    finally:
        producer.close(5)


def produce_many(bootstrap: str, topic: str, producers: int, per_producer: int) -> list[Any]:
    """``producers`` confluent-kafka producers, each sending ``per_producer`` records one
    batch at a time; every delivery error (None: stored)."""
    from confluent_kafka import Producer

    errors: list[Any] = []
    lock = threading.Lock()

    def one() -> None:
        producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "retries": 0,
                             "message.timeout.ms": 30000})

        def done(err: Any, msg: Any) -> None:
            with lock:
                errors.append(err)

        for i in range(per_producer):
            producer.produce(topic, value=b"v%d" % i, partition=0, on_delivery=done)
            producer.flush(30)
        producer.flush(30)

    threads = [threading.Thread(target=one) for _ in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


@pytest.fixture(scope="module")
def extism_proxy(broker: EmbeddedBroker,
                 extism_plugins: dict[str, Path]) -> Iterator[ProxyProcess]:
    config = {"topics": {TOPICS[k]: str(extism_plugins[k])
                         for k in ("grow", "huge", "trap", "novalue")}}
    config["topics"][TOPICS["fine"]] = str(extism_plugins["uppercase"])
    p = launch_proxy(broker.bootstrap, interceptor="extism", interceptor_config=config)
    kafka_python_error(p.bootstrap, TOPICS["fine"], b"warm up")  # metadata, connections
    yield p
    assert p.alive(), f"the proxy died:\n{p.log}"
    p.stop()


def test_endless_allocation_is_stopped_at_the_cap_and_its_memory_returned(
        extism_proxy: ProxyProcess, extism_plugins: dict[str, Path]) -> None:
    watch = Watch(extism_proxy)
    messages = [kafka_python_error(extism_proxy.bootstrap, TOPICS["grow"], b"more")
                for _ in range(3)]
    after = watch.settle()
    watch.report("grow", after)
    print(f"grow: {messages[-1]}")
    assert all(f"extism plugin {extism_plugins['grow']} ran out of memory (limit 256 MiB, "
               "setting max_memory_bytes" in m for m in messages), messages
    assert all("InvalidRecord" in m or "87" in m for m in messages), messages
    assert after[0] < watch.rss_before + 64 * MiB, "a crashed instance's memory is freed"
    assert after[1] <= watch.threads_before + POOL


def test_a_50_mib_answer_is_refused_and_memory_stays_bounded(
        extism_proxy: ProxyProcess) -> None:
    watch = Watch(extism_proxy)
    message = kafka_python_error(extism_proxy.bootstrap, TOPICS["huge"], b"hello")
    after = watch.settle()
    watch.report("huge", after)
    print(f"huge: {message}")
    assert "interceptor extism returned 52428813 bytes of records for 12 bytes received; " \
        "the limit is max_plugin_output_bytes (33554432)" in message
    assert after[0] < watch.rss_before + POOL * CAP, "pooled instances are capped"
    assert high_watermark(extism_proxy.bootstrap, TOPICS["huge"]) == 0


def test_an_answer_without_value_stores_nothing(extism_proxy: ProxyProcess,
                                                extism_plugins: dict[str, Path]) -> None:
    message = kafka_python_error(extism_proxy.bootstrap, TOPICS["novalue"], b"keep me")
    print(f"novalue: {message}")
    assert f'extism plugin {extism_plugins["novalue"]} transform: its answer for record 0 ' \
        'has no "value" (write "value": null to store a null value on purpose)' in message
    assert high_watermark(extism_proxy.bootstrap, TOPICS["novalue"]) == 0


def test_a_plugin_trapping_on_every_call_leaks_no_threads_and_floods_no_log(
        extism_proxy: ProxyProcess, extism_plugins: dict[str, Path]) -> None:
    # Each plugin has worker threads of its own, started on its first batches: counted
    # from there, the flood of traps below must bring no thread more for good.
    produce_many(extism_proxy.bootstrap, TOPICS["trap"], producers=POOL, per_producer=2)
    watch = Watch(extism_proxy)
    lines = len(extism_proxy.lines)
    errors = produce_many(extism_proxy.bootstrap, TOPICS["trap"], producers=8,
                          per_producer=40)
    message = kafka_python_error(extism_proxy.bootstrap, TOPICS["trap"], b"one more")
    after = watch.settle()
    logged = [line for line in extism_proxy.lines[lines:] if "trap.wasm" in line]
    watch.report("trap", after)
    print(f"trap: {len(errors)} batches answered, {len(logged)} log lines: {message}")
    print("\n".join(logged))
    assert len(errors) == 8 * 40
    assert {None if e is None else e.code() for e in errors} == {INVALID_RECORD}
    # The crash itself ("... on record 0 of TOPIC[P]"), or, backed off, what it was.
    assert f"extism plugin {extism_plugins['trap']} crashed (a WebAssembly trap) in " \
        "transform" in message
    assert "backtrace" not in message and "wasm function" not in message
    assert after[1] <= watch.threads_before + POOL, "threads come back to where they were"
    assert len(logged) <= 3, "\n".join(logged)
    # The neighbour topic of the same interceptor is served all along.
    assert kafka_python_error(extism_proxy.bootstrap, TOPICS["fine"], b"still here") == ""


def test_a_python_plugin_returning_200_mb_is_refused(broker: EmbeddedBroker) -> None:
    p = launch_proxy(broker.bootstrap, interceptor="tp_balloon:Balloon",
                     plugins_dir=TESTS / "plugins")
    try:
        watch = Watch(p)
        errors = produce_many(p.bootstrap, TOPICS["balloon"], producers=1, per_producer=1)
        from kafka import KafkaProducer

        producer = KafkaProducer(bootstrap_servers=p.bootstrap, retries=0, linger_ms=200)
        try:
            futures = [producer.send(TOPICS["balloon"], b"small %d" % i, partition=0)
                       for i in range(10)]
            producer.flush(60)
            failures = [str(f.exception) for f in futures]
        finally:
            producer.close(5)
        after = watch.settle()
        watch.report("balloon", after)
        print(f"balloon: {failures[0]}")
        assert [None if e is None else e.code() for e in errors] == [INVALID_RECORD]
        assert all("interceptor tp_balloon:Balloon returned" in f
                   and "the limit is max_plugin_output_bytes (33554432)" in f
                   for f in failures), failures
        assert after[0] < watch.rss_before + 64 * MiB
        assert p.alive()
    finally:
        p.stop()


def test_a_kiproxy_abi_module_trapping_on_every_call_is_named_and_leaks_nothing(
        broker: EmbeddedBroker) -> None:
    module = TESTS / "wasm" / "faults.wat"
    p = launch_proxy(broker.bootstrap, interceptor="wasm", interceptor_config={
        "module": str(module), "function": "trap", "encoding": "binary"})
    try:
        watch = Watch(p)
        lines = len(p.lines)
        errors = produce_many(p.bootstrap, TOPICS["trap"] + "-abi", producers=4, per_producer=25)
        message = kafka_python_error(p.bootstrap, TOPICS["trap"] + "-abi", b"one more")
        after = watch.settle()
        logged = [line for line in p.lines[lines:] if "faults.wat" in line]
        watch.report("wasm trap", after)
        print(f"wasm trap: {len(logged)} log lines: {message}")
        assert {None if e is None else e.code() for e in errors} == {INVALID_RECORD}
        assert f"wasm module {module} (trap, abi v1) trapped: wasm trap: integer divide by " \
            "zero" in message  # the crash on a record, or (backed off) what it was
        assert after[1] <= watch.threads_before + 2  # its worker thread and epoch clock
        assert len(logged) <= 3, "\n".join(logged)
    finally:
        p.stop()
