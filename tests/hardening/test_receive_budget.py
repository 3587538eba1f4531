"""The process-wide limit on bytes buffered from clients (``max_client_buffered_bytes``).

One kiproxy process with ``--max-client-buffered-bytes`` of :data:`LIMIT` (8 MiB).
:data:`STALLERS` raw-socket clients, one after another, each claim a
:data:`CLAIMED`-byte Produce request, send :data:`SENT` bytes of it and stall. The
first is read whole; the second is paused once the total passes the limit; every
later one is paused on its first bytes. Two more clients then send whole 8 MiB Produce
requests: they are held back too, behind the stalled ones.

What must hold:

(a) ``kiproxy_limit_hits_total{limit="max_client_buffered_bytes"}`` counts one pause
    per held-back connection, and the first pause is a WARNING naming the limit;
(b) the bytes held stay within the limit plus one frame (only the largest holder
    keeps reading past the limit), and the proxy's peak RSS within its baseline
    plus twice that (a partial frame's buffers are at most twice its bytes) plus
    :data:`ALLOWANCE` - far below the 112 MiB the clients offered;
(c) meanwhile another client's ApiVersions is answered and a confluent-kafka
    producer's small records are all stored;
(d) once the stalled clients disconnect, the held-back clients' requests are read,
    forwarded and answered without error, and
    ``kiproxy_limit_used_bytes{limit="max_client_buffered_bytes"}`` is back to 0.

Memory and counts, not timing: the waits below only bound how long a broken proxy
is waited for.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from conftest import ProxyProcess, consume

from hardening.bombs import PRODUCE_VERSION, RssSampler, produce_answer, produce_request, rss_of
from hardening.raw_kafka import api_versions_frame, connect, recv_frame
from kiproxy.protocol.framing import encode_request_header
from kiproxy.protocol.messages import ApiKey
from kiproxy.protocol.records import Record, build_batch
from kiproxy_dev.tansu import free_port

MiB = 2**20
LIMIT = 8 * MiB
"""``--max-client-buffered-bytes`` of the proxy under test."""
CLAIMED = 8 * MiB
"""The frame length each stalled client claims."""
SENT = 6 * MiB
"""Bytes of it each stalled client sends (length prefix included) before stalling."""
STALLERS = 16
WAITERS = 2
RECORD = MiB
"""Value size of the held-back clients' records (8 per request)."""
CHUNK = 64 * 1024
"""Most a paused connection holds: its first receive, into the assembler's chunk."""
ALLOWANCE = 24 * MiB
"""RSS beyond the buffered bytes: chunks, the small producer, interpreter and allocator."""
LIMIT_LABEL = '{limit="max_client_buffered_bytes"}'
GOOD_RECORDS = 50

pytestmark = pytest.mark.timeout(300)


def _metric(metrics: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not served:\n{text}")


def _hits(metrics: str) -> int:
    return int(_metric(metrics, "kiproxy_limit_hits_total" + LIMIT_LABEL))


def _used(metrics: str) -> int:
    return int(_metric(metrics, "kiproxy_limit_used_bytes" + LIMIT_LABEL))


def _hits_reach(metrics: str, count: int) -> Callable[[], bool]:
    return lambda: _hits(metrics) == count


def _wait_until(what: str, check: Callable[[], bool], proxy: ProxyProcess,
                timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proxy.alive(), proxy.log
        assert time.monotonic() < deadline, f"gave up waiting: {what}"
        time.sleep(0.05)


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # the socket is shut down under a stalled send
        sock.sendall(data)


def _stalled_frame_start() -> bytes:
    header = encode_request_header(ApiKey.PRODUCE, PRODUCE_VERSION, 1, "staller", 1)
    return struct.pack(">i", CLAIMED) + header + bytes(SENT - 4 - len(header))


def _produce_small(address: str, topic: str) -> list[bytes]:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": address, "linger.ms": 5,
                         "message.timeout.ms": 60000})
    sent = [b"small-%d" % i for i in range(GOOD_RECORDS)]
    for value in sent:
        producer.produce(topic, value=value, partition=0)
        producer.poll(0)
    assert producer.flush(60) == 0, "the small producer's records were not all delivered"
    return sent


def _consume_large(address: str, topic: str, count: int) -> list[bytes | None]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": address, "group.id": f"read-{topic}",
                         "enable.auto.commit": False, "fetch.max.bytes": 64 * MiB,
                         "max.partition.fetch.bytes": 16 * MiB})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes | None] = []
        deadline = time.monotonic() + 60
        while len(values) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                values.append(msg.value())
        return values
    finally:
        consumer.close()


def _api_versions_answered(address: str) -> bool:
    sock = connect(address, timeout=30)
    try:
        sock.sendall(api_versions_frame(7))
        correlation_id: int = struct.unpack(">i", recv_frame(sock)[:4])[0]
        return correlation_id == 7
    finally:
        sock.close()


def _start_sending(sock: socket.socket, data: bytes) -> threading.Thread:
    thread = threading.Thread(target=_send_quietly, args=(sock, data), daemon=True)
    thread.start()
    return thread


def test_stalled_partial_frames_are_held_to_the_budget_and_released(
        start_proxy: Any, topic: str) -> None:
    metrics = f"127.0.0.1:{free_port()}"
    proxy: ProxyProcess = start_proxy("--max-client-buffered-bytes", str(LIMIT),
                                      "--metrics-listen", metrics)
    # Warms the proxy up, and creates the topic (the broker drops a bare Produce to an
    # unknown topic).
    warm = _produce_small(proxy.bootstrap, topic)
    baseline = rss_of(proxy.process.pid)
    hits_before = _hits(metrics)
    stalled_start = _stalled_frame_start()
    records = [Record(value=bytes([65 + i]) * RECORD, timestamp=1) for i in range(8)]
    waited_frame = [produce_request(topic, build_batch(records), correlation_id=100 + i,
                                    client_id="held-back") for i in range(WAITERS)]
    assert len(waited_frame[0]) > LIMIT

    stallers: list[socket.socket] = []
    senders: list[threading.Thread] = []
    waiters: list[socket.socket] = []
    try:
        with RssSampler(proxy.process.pid) as sampler:
            # The first staller is read whole: it is the largest holder.
            stallers.append(connect(proxy.bootstrap, timeout=120))
            senders.append(_start_sending(stallers[0], stalled_start))
            _wait_until("the first stalled frame is read", lambda: _used(metrics) == SENT,
                        proxy)
            # Each later one is paused once the total passes the limit: one hit each.
            for n in range(1, STALLERS):
                stallers.append(connect(proxy.bootstrap, timeout=120))
                senders.append(_start_sending(stallers[n], stalled_start))
                _wait_until(f"staller {n + 1} is held back",
                            _hits_reach(metrics, hits_before + n), proxy)
            stalled_used = _used(metrics)
            # Whole requests arriving now are held back behind the stalled ones.
            for frame in waited_frame:
                waiters.append(connect(proxy.bootstrap, timeout=120))
                senders.append(_start_sending(waiters[-1], frame))
            _wait_until("the whole requests are held back",
                        _hits_reach(metrics, hits_before + STALLERS - 1 + WAITERS), proxy)
            held_used = _used(metrics)

            # (c) Other clients are served meanwhile.
            assert _api_versions_answered(proxy.bootstrap)
            small = _produce_small(proxy.bootstrap, f"{topic}-small")
            got = consume(proxy.bootstrap, f"{topic}-small", len(small))
            assert sorted(m.value() for m in got) == sorted(small)
            readable, _, _ = select.select(waiters, [], [], 0)
            assert not readable, "a held-back request was answered before it was read"

        # (a) and (b)
        assert _hits(metrics) - hits_before == STALLERS - 1 + WAITERS
        assert LIMIT < stalled_used <= LIMIT + CLAIMED, stalled_used
        assert held_used <= LIMIT + CLAIMED + WAITERS * CHUNK, held_used
        assert f"over max_client_buffered_bytes ({LIMIT}); paused now: 1;" in proxy.log, \
            "no WARNING says the client reads are paused"
        bound = baseline + 2 * (LIMIT + CLAIMED) + ALLOWANCE
        assert sampler.peak < bound, (
            f"peak RSS {sampler.peak / MiB:.0f} MiB over the bound {bound / MiB:.0f} MiB "
            f"(baseline {baseline / MiB:.0f} MiB; the clients offered "
            f"{(STALLERS * SENT + WAITERS * len(waited_frame[0])) / MiB:.0f} MiB)")

        # (d) The stalled clients go away: the held-back requests are read and answered.
        for sock in stallers:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for sock in waiters:
            sock.settimeout(120)
            code, message = produce_answer(recv_frame(sock))
            assert code == 0, (code, message)
        _wait_until("the budget is released", lambda: _used(metrics) == 0, proxy)
        stored = _consume_large(proxy.bootstrap, topic, len(warm) + 8 * WAITERS)
        assert sorted(stored) == sorted(  # type: ignore[type-var]
            warm + [r.value for r in records for _ in range(WAITERS)])
        assert proxy.alive()
    finally:
        for sock in stallers + waiters:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in senders:
            thread.join(10)


CLAIMERS = 200
"""Clients that each send a length prefix claiming a whole 1 MiB frame, and stall."""


def test_claimed_frames_cost_address_space_not_memory(start_proxy: Any, topic: str) -> None:
    # A client's frame of up to 1 MiB is received into one buffer allocated on its length
    # prefix (no join). Its pages are faulted in only as bytes arrive: 200 clients that
    # claim 1 MiB each and send a few bytes make the proxy's RSS grow by a few pages
    # each, not by the 200 MiB they claimed; the budget counts the bytes they sent.
    from kiproxy.proxy.net.frame_stream import CLIENT_WHOLE_UP_TO

    metrics = f"127.0.0.1:{free_port()}"
    proxy: ProxyProcess = start_proxy("--metrics-listen", metrics)
    warm = _produce_small(proxy.bootstrap, topic)
    header = encode_request_header(ApiKey.PRODUCE, PRODUCE_VERSION, 1, "claimer", 1)
    start = struct.pack(">i", CLIENT_WHOLE_UP_TO) + header
    claimers: list[socket.socket] = []
    try:
        baseline = rss_of(proxy.process.pid)
        for _ in range(CLAIMERS):
            sock = connect(proxy.bootstrap, timeout=60)
            sock.sendall(start)
            claimers.append(sock)
        _wait_until("every claim is received", lambda: _used(metrics) == CLAIMERS * len(start),
                    proxy)
        grown = rss_of(proxy.process.pid) - baseline
        claimed = CLAIMERS * CLIENT_WHOLE_UP_TO
        assert grown < claimed // 8, (
            f"RSS grew {grown / MiB:.1f} MiB for {claimed / MiB:.0f} MiB claimed")
        # Served meanwhile, and everything is given back once the claimers go.
        assert _api_versions_answered(proxy.bootstrap)
        for sock in claimers:
            sock.close()
        _wait_until("the budget is released", lambda: _used(metrics) == 0, proxy)
        got = consume(proxy.bootstrap, topic, len(warm))
        assert sorted(m.value() for m in got) == sorted(warm)
        assert proxy.alive()
    finally:
        for sock in claimers:
            sock.close()
