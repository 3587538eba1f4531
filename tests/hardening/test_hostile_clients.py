"""Hostile clients against one proxy process, while a well-behaved client keeps working.

One kiproxy process (default limits) in front of a broker of this module's own
takes, all at once: a flood of 500 connections that are opened and held; 50
slowloris connections that trickle a frame one byte at a time; frames whose
length prefix says 2 GiB - 1, 2 GiB (negative as an int32), 200 MiB, -1 and
-2**31; garbage right after a valid ApiVersions; a frame too short to hold a
request header; and 8 clients with a 4 KiB receive buffer that pipeline
thousands of Metadata and ApiVersions requests and never read an answer.
Meanwhile an idempotent confluent-kafka producer writes records through the
proxy and a consumer reads them all back.

What must hold: the proxy process stays alive; its resident memory (RSS, with
psutil, the process and any children) grows less than 200 MiB over its warmed-up
baseline — a functional bound, generous, not a timing threshold; every
connection that sent a bad frame is closed promptly and named in the log by its
``host:port``; the well-behaved client's records all arrive.

The connection limits (``--max-connections``, ``--idle-timeout-ms``,
``--max-buffered-bytes``) get tests of their own, each with a small proxy: a
connection beyond the maximum is refused and logged; an idle connection (or
one trickling bytes that never make a whole request) is closed after the idle
timeout and named in the log, while an active one stays; a client that never
reads its answers stops being read once its buffered answers reach the limit.
"""

from __future__ import annotations

import functools
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, consume, launch_proxy

from hardening.bombs import RssSampler, rss_of
from hardening.fault_relay import wait_until
from hardening.raw_kafka import (
    api_versions_frame,
    closed_by_peer,
    connect,
    local_address,
    metadata_frame,
    recv_frame,
)
from kiproxy_dev.tansu import EmbeddedBroker

MiB = 2**20
RSS_BOUND = 200 * MiB
FLOOD = 500
SLOWLORIS = 50
NON_READERS = 8
TOPICS = 40
GOOD_RECORDS = 2000

pytestmark = pytest.mark.timeout(240)


@functools.cache
def _flags() -> str:
    return subprocess.run([sys.executable, "-m", "kiproxy", "run", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60).stdout


def _needs_flag(flag: str) -> None:
    if flag not in _flags():
        pytest.skip(f"kiproxy run has no {flag} flag (yet)")


def _padding_topics() -> list[str]:
    return [f"padding-{i:02d}-" + "x" * 180 for i in range(TOPICS)]


@pytest.fixture(scope="module")
def hostile_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """A broker of this module's own, with enough topics that a Metadata answer is big."""
    from confluent_kafka.admin import AdminClient, NewTopic

    broker = EmbeddedBroker(log_path=tmp_path_factory.mktemp("hostile") / "broker.log")
    broker.start()
    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    for future in admin.create_topics([NewTopic(n, 3, 1) for n in _padding_topics()]).values():
        future.result(30)
    yield broker
    broker.stop()


def produce_and_read_back(bootstrap: str, count: int, timeout: float = 60) -> None:
    """An idempotent producer writes ``count`` records; a consumer reads them all back."""
    from confluent_kafka import Producer

    topic = f"good-{uuid.uuid4().hex[:8]}"
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                         "acks": "all", "linger.ms": 5, "message.timeout.ms": int(timeout * 1000)})
    errors: list[Any] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            errors.append(err)

    try:
        for i in range(count):
            producer.produce(topic, value=b"good %06d" % i, partition=0,
                             on_delivery=on_delivery)
            if i % 500 == 0:
                producer.poll(0)
        left = producer.flush(timeout)
    finally:
        producer.close()
    assert left == 0, "the well-behaved producer could not deliver"
    assert not errors, f"delivery errors: {errors[:5]}"
    got = consume(bootstrap, topic, count, timeout=timeout)
    assert sorted(m.value() for m in got) == [b"good %06d" % i for i in range(count)]


# ---------------------------------------------------------------------------- attackers


def still_open(sock: socket.socket) -> bool:
    """Whether the peer has neither closed nor reset ``sock`` (without waiting)."""
    sock.setblocking(False)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.setblocking(True)


class Slowloris:
    """Connections that each trickle a frame one byte per round, never finishing it."""

    def __init__(self, address: str, count: int, every: float = 0.5) -> None:
        # A length prefix of 64 KiB, then a Metadata header and body padding: no
        # connection sends enough bytes in the test to complete the frame.
        frame = metadata_frame(1)
        self.payload = struct.pack(">i", 65536) + frame[4:] + b"\x00" * 65536
        self.sockets = [connect(address) for _ in range(count)]
        self.every = every
        self.sent = [0] * count
        self.closed: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> Slowloris:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            for i, sock in enumerate(self.sockets):
                if i in self.closed:
                    continue
                try:
                    sock.send(self.payload[self.sent[i] : self.sent[i] + 1])
                    self.sent[i] += 1
                except OSError:
                    self.closed.add(i)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self.sockets:
            sock.close()


_NON_READER_PAYLOAD: list[memoryview] = []


def non_reader_payload() -> memoryview:
    """About 24 MiB of pipelined requests: Metadata naming every padding topic (8 KiB
    asked, some 12 KiB answered) and ApiVersions, alternately; shared by the readers."""
    if not _NON_READER_PAYLOAD:
        pair = (metadata_frame(1, topics=_padding_topics()) + api_versions_frame(2))
        _NON_READER_PAYLOAD.append(memoryview(pair * (24 * MiB // len(pair))))
    return _NON_READER_PAYLOAD[0]


class NonReader:
    """Pipelines requests as fast as the proxy takes them and never reads an answer
    (receive buffer 4 KiB)."""

    def __init__(self, address: str) -> None:
        self.sock = connect(address, rcvbuf=4096)
        self.address = local_address(self.sock)
        self.payload = non_reader_payload()
        self.sent = 0
        self._stalled = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> NonReader:
        self._thread.start()
        return self

    def _run(self) -> None:
        self.sock.setblocking(False)
        last_progress = time.monotonic()
        while not self._stop.is_set() and self.sent < len(self.payload):
            try:
                self.sent += self.sock.send(self.payload[self.sent : self.sent + 65536])
                last_progress = time.monotonic()
            except BlockingIOError:
                if time.monotonic() - last_progress > 2:
                    self._stalled.set()
                self._stop.wait(0.05)
            except OSError:
                return

    @property
    def stalled(self) -> bool:
        """The proxy stopped taking requests before the last one."""
        return self._stalled.is_set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


def _bad_frame_connections(address: str) -> dict[str, tuple[socket.socket, str]]:
    """One connection per bad frame, already sent: name -> (socket, its address)."""
    cases = {
        "length 2 GiB - 1": struct.pack(">I", 0x7FFF_FFFF),
        "length 2 GiB (negative as int32)": struct.pack(">I", 0x8000_0000),
        "length 200 MiB": struct.pack(">i", 200 * MiB),
        "length 100 MiB + 1 (just over the default max_frame_size)": struct.pack(
            ">i", 100 * MiB + 1),
        "length -1": struct.pack(">i", -1),
        "a 3-byte frame": struct.pack(">i", 3) + b"\x00\x12\x00",
        "garbage after a valid ApiVersions": api_versions_frame(1) + b"\xde\xad\xbe\xef" * 64,
        # refused by the proxy, not forwarded for the broker to hang up on (which read
        # as the broker failing: kiproxy_upstream_connection_errors_total{kind="broken"})
        "API key 999, which Kafka does not define": struct.pack(">ihhih", 10, 999, 0, 7, -1),
    }
    out = {}
    for name, data in cases.items():
        sock = connect(address)
        sock.sendall(data)
        out[name] = (sock, local_address(sock))
    return out


# ---------------------------------------------------------------------------- the siege


def test_hostile_clients_do_not_hurt_the_proxy_or_a_well_behaved_client(
        hostile_broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(hostile_broker.bootstrap)
    flood: list[socket.socket] = []
    slowloris: Slowloris | None = None
    non_readers: list[NonReader] = []
    try:
        produce_and_read_back(proxy.bootstrap, 500)  # warm up: codecs, schemas, listeners
        baseline = rss_of(proxy.process.pid, children=True)
        with RssSampler(proxy.process.pid, interval=0.1, children=True) as sampler:
            for _ in range(FLOOD):
                flood.append(connect(proxy.bootstrap))
            slowloris = Slowloris(proxy.bootstrap, SLOWLORIS).start()
            non_readers = [NonReader(proxy.bootstrap).start() for _ in range(NON_READERS)]
            bad = _bad_frame_connections(proxy.bootstrap)

            # bad frames: closed promptly, and the log names each client
            for name, (sock, _) in bad.items():
                assert closed_by_peer(sock, 10), f"{name}: the proxy kept the connection open"
                sock.close()
            assert wait_until(lambda: all(a in proxy.log for _, a in bad.values()), 10), (
                "the log does not name every client closed for a bad frame:\n" + proxy.log)
            for name, (_, address) in bad.items():
                line = next(x for x in proxy.lines if address in x)
                assert "closing client" in line and "WARNING" in line, f"{name}: {line}"

            # a well-behaved client still works, while the attackers hold on
            produce_and_read_back(proxy.bootstrap, GOOD_RECORDS)

            # the non-readers stopped being read from, instead of being buffered for
            assert wait_until(lambda: all(r.stalled for r in non_readers), 30), (
                "the proxy kept reading requests of clients that read no answers: "
                f"{[r.sent for r in non_readers]} of {len(non_reader_payload())} bytes")
            taken = [r.sent for r in non_readers]
            held = sum(1 for s in flood if still_open(s))
            slow_open = SLOWLORIS - len(slowloris.closed)
            assert proxy.alive(), f"the proxy died:\n{proxy.log[-5000:]}"
            peak = sampler.peak
        growth = peak - baseline
        report = (f"RSS baseline {baseline / MiB:.1f} MiB, peak {peak / MiB:.1f} MiB "
                  f"(+{growth / MiB:.1f} MiB, {sampler.samples} samples); flood connections "
                  f"still open {held}/{FLOOD}; slowloris open {slow_open}/{SLOWLORIS}; "
                  f"bytes the proxy took from each non-reader: {taken}")
        print(report)
        assert growth < RSS_BOUND, report
        assert "Traceback" not in proxy.log, proxy.log[-5000:]
    finally:
        for sock in flood:
            sock.close()
        if slowloris is not None:
            slowloris.stop()
        for reader in non_readers:
            reader.stop()
        alive = proxy.alive()
        proxy.stop()
    assert alive


# ---------------------------------------------------------------------------- the limits


def test_connections_beyond_max_connections_are_refused(
        hostile_broker: EmbeddedBroker) -> None:
    _needs_flag("--max-connections")
    proxy = launch_proxy(hostile_broker.bootstrap, "--max-connections", "20")
    held: list[socket.socket] = []
    try:
        for _ in range(20):
            held.append(connect(proxy.bootstrap))
        time.sleep(0.5)  # all twenty accepted
        extra = connect(proxy.bootstrap)
        address = local_address(extra)
        assert closed_by_peer(extra, 5), "a connection beyond max_connections was kept"
        extra.close()
        port = address.rsplit(":", 1)[1]
        assert wait_until(lambda: any("max_connections" in line and port in line
                                      for line in proxy.lines), 5), (
            f"the log does not name the refused client {address}:\n{proxy.log}")
        # the ones already in are served
        held[0].sendall(api_versions_frame(3))
        assert recv_frame(held[0])[:4] == struct.pack(">i", 3)
        # room again once some leave
        for sock in held[10:]:
            sock.close()
        del held[10:]
        time.sleep(0.5)
        produce_and_read_back(proxy.bootstrap, 100)
        assert proxy.alive()
        print(f"refused {address}; log: "
              + next(line for line in proxy.lines if "max_connections" in line))
    finally:
        for sock in held:
            sock.close()
        proxy.stop()


def test_idle_connections_are_closed_after_the_idle_timeout(
        hostile_broker: EmbeddedBroker) -> None:
    _needs_flag("--idle-timeout-ms")
    proxy = launch_proxy(hostile_broker.bootstrap, "--idle-timeout-ms", "1500")
    silent = connect(proxy.bootstrap)
    trickler = Slowloris(proxy.bootstrap, 1, every=0.2).start()
    active = connect(proxy.bootstrap)
    try:
        silent_address = local_address(silent)
        trickle_address = local_address(trickler.sockets[0])
        active_address = local_address(active)
        started = time.monotonic()
        # the active client asks something every 0.5 s and reads the answer
        correlation = 0
        while time.monotonic() - started < 4:
            correlation += 1
            active.sendall(api_versions_frame(correlation))
            assert recv_frame(active)[:4] == struct.pack(">i", correlation)
            time.sleep(0.5)
        assert closed_by_peer(silent, 5), "a silent connection outlived the idle timeout"
        assert wait_until(lambda: 0 in trickler.closed, 5), (
            "a connection trickling bytes that never make a request outlived the idle timeout")
        log = proxy.log
        assert any(silent_address in line and "idle" in line for line in proxy.lines), log
        assert any(trickle_address in line and "idle" in line for line in proxy.lines), log
        assert not any(active_address in line and "idle" in line for line in proxy.lines), log
        active.sendall(api_versions_frame(999))
        assert recv_frame(active)[:4] == struct.pack(">i", 999)
    finally:
        silent.close()
        active.close()
        trickler.stop()
        proxy.stop()


def test_a_client_that_never_reads_stops_being_read(hostile_broker: EmbeddedBroker) -> None:
    _needs_flag("--max-buffered-bytes")
    proxy = launch_proxy(hostile_broker.bootstrap, "--max-buffered-bytes", str(MiB))
    baseline = rss_of(proxy.process.pid, children=True)
    reader = NonReader(proxy.bootstrap).start()
    try:
        assert wait_until(lambda: reader.stalled, 30), (
            "the proxy kept reading requests of a client that reads no answers")
        growth = rss_of(proxy.process.pid, children=True) - baseline
        assert reader.sent < len(reader.payload)
        assert growth < 64 * MiB, f"RSS grew {growth / MiB:.1f} MiB for one non-reader"
        produce_and_read_back(proxy.bootstrap, 200)
        print(f"non-reader: the proxy took {reader.sent} of {len(reader.payload)} request "
              f"bytes, then stopped reading; RSS +{growth / MiB:.1f} MiB")
    finally:
        reader.stop()
        proxy.stop()


def test_a_client_that_never_reads_is_closed_without_holding_up_others(
        hostile_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """A client that reads nothing is owed answers, so it is not idle; other idle
    clients are closed meanwhile. At shutdown, after the grace period (``shutdown_grace_ms``,
    2 s here instead of the default 10 s: the same path, sooner), what is buffered for it
    cannot be flushed: the proxy aborts it after a short wait instead of hanging, and
    exits 0."""
    config = tmp_path / "kiproxy.yaml"
    config.write_text("shutdown_grace_ms: 2000\n")
    proxy = launch_proxy(hostile_broker.bootstrap, "--idle-timeout-ms", "1500",
                         "--max-buffered-bytes", str(MiB), config_file=config)
    reader = NonReader(proxy.bootstrap).start()
    silent: socket.socket | None = None
    try:
        assert wait_until(lambda: reader.stalled, 30), "the non-reader was never paused"
        silent = connect(proxy.bootstrap)
        silent_address = local_address(silent)
        assert closed_by_peer(silent, 10), "an idle client waited behind a non-reader"
        assert wait_until(lambda: any(  # the log is read by a thread
            silent_address in line and "idle" in line for line in proxy.lines), 5), proxy.log
        assert proxy.alive()
        assert proxy.stop(timeout=25) == 0, f"shutdown hung:\n{proxy.log[-3000:]}"
        assert "Traceback" not in proxy.log, proxy.log
    finally:
        if silent is not None:
            silent.close()
        reader.stop()
        proxy.stop()
