"""Decompression bombs and abandoned large frames cost the proxy bounded memory.

One kiproxy process (with the transforming ``uppercase`` plugin, so every batch is
decoded) in front of the session's Tansu broker takes, per codec, 16 bombs at once
from 16 connections: the zstd RLE bomb (a 12 KiB request that expands to 384 MiB),
a 306 KB gzip bomb (300 MiB of zeros), an LZ4 frame of 64 MiB of zeros, a raw snappy
stream claiming 4 GiB and a Xerial snappy stream of 40 MiB. Meanwhile another client
keeps asking ApiVersions and a confluent-kafka producer writes small batches.

What must hold: every bomb is answered INVALID_RECORD with an error message naming
the limit (``max_decompressed_batch_bytes`` or ``max_decompression_ratio``); the other
client is answered; the producer's records are all stored, exactly (uppercased);
``kiproxy_rejected_batches_total{reason="decompression_limit"}`` counts the bombs;
the proxy's peak RSS stays below its warmed-up baseline plus ``max_decode_memory``
plus a fixed allowance for everything else (frames received, the interpreter).
Memory, not timing: these tests assert no latency.

Abandoned large frames (clients that claim 100 MiB, send 1 MB and close), and bursts
of 16 whole 4 MiB Produce requests at once (decoded, uppercased and re-encoded on the
decode threads): RSS afterwards is back within :data:`ABANDONED_BOUND` and
:data:`LARGE_BOUND` of where it started.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ProxyProcess, consume

from hardening.bombs import (
    BOMBS,
    RssSampler,
    abandon_large_frames,
    bomb_request,
    produce_answer,
    produce_request,
    rss_of,
    send_at_once,
)
from hardening.fault_relay import wait_until
from hardening.raw_kafka import api_versions_frame, connect, recv_frame
from kiproxy.protocol.records import Record, build_batch
from kiproxy_dev.tansu import EmbeddedBroker, free_port

MiB = 2**20
DECODE_MEMORY = 64 * MiB
"""``--max-decode-memory`` of the proxy under test."""
OTHER = 96 * MiB
"""Allowance beyond the decode budget: 16 requests of up to 2 MB received at once,
the inline attempts (1 MiB each), the interpreter and allocator slack."""
ABANDONED_BOUND = 48 * MiB
LARGE_BOUND = 16 * MiB
"""RSS growth allowed after bursts of large requests (measured: none; with a decode
thread arena of its own, 24-68 MiB stayed resident)."""
INVALID_RECORD = 87
CLIENTS = 16
GOOD_RECORDS = 300

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    from conftest import launch_proxy

    metrics = f"127.0.0.1:{free_port()}"
    p = launch_proxy(broker.bootstrap, "--max-decode-memory", str(DECODE_MEMORY),
                     "--metrics-listen", metrics, interceptor="uppercase")
    p.metrics = metrics  # type: ignore[attr-defined]
    yield p
    p.stop()


def _api_versions_loop(address: str, stop: threading.Event, answered: list[int]) -> None:
    sock = connect(address, timeout=60)
    try:
        correlation = 0
        while not stop.is_set():
            correlation += 1
            sock.sendall(api_versions_frame(correlation))
            recv_frame(sock)
            answered.append(correlation)
            time.sleep(0.01)
    finally:
        sock.close()


def _produce(address: str, topic: str, stop: threading.Event, sent: list[bytes]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": address, "enable.idempotence": True,
                         "linger.ms": 5, "message.timeout.ms": 60000})
    i = 0
    while i < GOOD_RECORDS:
        value = b"ok-%d" % i
        producer.produce(topic, value=value, partition=0)
        sent.append(value)
        producer.poll(0)
        i += 1
        if not stop.is_set():
            time.sleep(0.005)
    assert producer.flush(60) == 0


def _send_bombs(address: str, topic: str, frame: bytes) -> list[tuple[int, str | None]]:
    socks = [connect(address, timeout=120) for _ in range(CLIENTS)]
    try:
        senders = [threading.Thread(target=s.sendall, args=(frame,)) for s in socks]
        for t in senders:
            t.start()
        for t in senders:
            t.join(120)
        return [produce_answer(recv_frame(s)) for s in socks]
    finally:
        for s in socks:
            s.close()


def _metric(proxy: ProxyProcess, name: str) -> float:
    url = f"http://{proxy.metrics}/metrics"  # type: ignore[attr-defined]
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))


def _warm_up(proxy: ProxyProcess, topic: str) -> None:
    sent: list[bytes] = []
    _produce(proxy.bootstrap, topic, threading.Event(), sent)
    assert len(consume(proxy.bootstrap, topic, len(sent))) == len(sent)


@pytest.mark.parametrize("kind", list(BOMBS))
def test_sixteen_bombs_are_refused_within_the_memory_budget(
        proxy: ProxyProcess, kind: str, topic: str) -> None:
    codec, build = BOMBS[kind]
    frame = bomb_request(topic, codec, build())
    _warm_up(proxy, f"{topic}-warm")
    baseline = rss_of(proxy.process.pid)
    rejected_before = _metric(proxy,
                              'kiproxy_rejected_batches_total{reason="decompression_limit"}')

    stop = threading.Event()
    answered: list[int] = []
    sent: list[bytes] = []
    errors: list[BaseException] = []

    def guarded(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException as exc:  # reported by the test below
            errors.append(exc)

    others = [threading.Thread(target=guarded, args=(_api_versions_loop, proxy.bootstrap,
                                                     stop, answered)),
              threading.Thread(target=guarded, args=(_produce, proxy.bootstrap, topic,
                                                     stop, sent))]
    with RssSampler(proxy.process.pid) as sampler:
        for t in others:
            t.start()
        deadline = time.monotonic() + 30
        while not answered and not errors and time.monotonic() < deadline:
            time.sleep(0.01)  # the other client is being served before the bombs go out
        before = len(answered)
        answers = _send_bombs(proxy.bootstrap, topic, frame)
        time.sleep(0.2)
        during = len(answered) - before
        stop.set()
        for t in others:
            t.join(120)

    assert not errors, errors
    for code, message in answers:
        assert code == INVALID_RECORD, (code, message)
        assert message is not None and ("max_decompressed_batch_bytes" in message
                                        or "max_decompression_ratio" in message), message
    assert before > 0 and during > 0, \
        "the other client's ApiVersions went unanswered during the bombs"
    got = consume(proxy.bootstrap, topic, len(sent))
    assert sorted(m.value() for m in got) == sorted(v.upper() for v in sent)
    assert len(got) == GOOD_RECORDS
    bound = baseline + DECODE_MEMORY + OTHER
    assert sampler.peak < bound, (
        f"peak RSS {sampler.peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB "
        f"(baseline {baseline / MiB:.0f} MiB)")
    rejected = _metric(proxy, 'kiproxy_rejected_batches_total{reason="decompression_limit"}')
    assert rejected - rejected_before == CLIENTS
    assert "refused" in proxy.log and "bomber" in proxy.log  # the rate-limited WARNING
    assert proxy.alive()


def test_abandoned_large_frames_give_their_memory_back(proxy: ProxyProcess) -> None:
    abandon_large_frames(proxy.bootstrap, 64)  # warm up the allocator
    time.sleep(2.5)
    start = rss_of(proxy.process.pid)
    abandon_large_frames(proxy.bootstrap, 800)
    # The heap trimmer checks every second: back under the bound within 2.5 s.
    wait_until(lambda: rss_of(proxy.process.pid) - start < ABANDONED_BOUND, 2.5)
    after = rss_of(proxy.process.pid)
    assert after - start < ABANDONED_BOUND, (
        f"RSS {after / MiB:.0f} MiB after 800 abandoned frames, {start / MiB:.0f} MiB before")
    assert proxy.alive()


def test_bursts_of_large_requests_give_their_memory_back(start_proxy: Any,
                                                         topic: str) -> None:
    # Default limits: up to 256 MiB decoded at once, on the decode threads.
    proxy: ProxyProcess = start_proxy(interceptor="uppercase")
    records = [Record(value=b"x" * (512 * 1024), timestamp=0)] * 8
    frame = produce_request(topic, build_batch(records), client_id="large")
    small = produce_request(topic, build_batch([Record(value=b"x", timestamp=0)]))
    send_at_once(proxy.bootstrap, small)  # warm up with small requests (decoded inline)
    time.sleep(2.5)
    start = rss_of(proc := proxy.process.pid)
    for _ in range(3):
        answers = send_at_once(proxy.bootstrap, frame)
        assert [produce_answer(a)[0] for a in answers] == [0] * len(answers)
    # The heap trimmer checks every second: back under the bound within 2.5 s.
    wait_until(lambda: rss_of(proc) - start < LARGE_BOUND, 2.5)
    after = rss_of(proc)
    assert after - start < LARGE_BOUND, (
        f"RSS {after / MiB:.0f} MiB after 48 requests of 4 MiB, {start / MiB:.0f} MiB before")
    assert proxy.alive()
