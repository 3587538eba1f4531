"""The proxy learns the cluster's nodes when it starts, so that clients that come back
to a node port after a proxy restart find it open (see proxy/brokers/discovery.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import struct
import time
import uuid
from pathlib import Path

import pytest
from conftest import TANSU_NODE_ID, consume, launch_proxy
from hardening.processes import TansuBroker, free_broker_port_start, launch_proxy_at
from hardening.raw_kafka import api_versions_frame, connect, recv_frame

from kiproxy.protocol.framing import parse_response_header
from kiproxy.protocol.messages import ApiKey, parse_response
from kiproxy.proxy import server as server_module
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.server import ProxyServer
from kiproxy_dev.tansu import EmbeddedBroker, free_port


def _wait_for_line(lines: list[str], text: str, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(lines):
            if text in line:
                return line
        time.sleep(0.05)
    return None


def test_node_listener_is_open_when_the_proxy_announces_itself(broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap)
    try:
        node_port = proxy.broker_port_start + TANSU_NODE_ID
        # No client has asked for Metadata yet: the node port answers all the same.
        sock = connect(f"127.0.0.1:{node_port}", timeout=5)
        try:
            sock.sendall(api_versions_frame(9, version=0))
            frame = recv_frame(sock)
        finally:
            sock.close()
        correlation_id, body = parse_response_header(frame, 0)
        assert correlation_id == 9
        answer = parse_response(ApiKey.API_VERSIONS, 0, frame, body)
        assert answer.error_code == 0
        assert any(k.api_key == ApiKey.PRODUCE for k in answer.api_keys)
        assert "learned 1 broker node(s) from upstream" in proxy.log
        assert f"{TANSU_NODE_ID}->{node_port}" in proxy.log
    finally:
        proxy.stop()


def test_a_restarted_proxy_serves_a_producer_that_knows_only_its_node_port(
        broker: EmbeddedBroker) -> None:
    from confluent_kafka import Producer

    topic = f"rs-{uuid.uuid4().hex[:8]}"
    listen, port_start = free_port(), free_broker_port_start()
    lines: list[str] = []
    proxy = launch_proxy_at(broker.bootstrap, listen, port_start, lines=lines)
    producer = Producer({"bootstrap.servers": f"127.0.0.1:{listen}", "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5,
                         "reconnect.backoff.max.ms": 500, "message.timeout.ms": 60_000,
                         "log_level": 2})
    try:
        for i in range(100):
            producer.produce(topic, value=b"before %d" % i, partition=0)
        assert producer.flush(30) == 0
        proxy.stop(signal.SIGKILL)
        proxy = launch_proxy_at(broker.bootstrap, listen, port_start, lines=lines)
        for i in range(100):
            producer.produce(topic, value=b"after %d" % i, partition=0)
        left = producer.flush(45)
        assert left == 0, f"{left} records not delivered after the restart:\n{proxy.log}"
    finally:
        producer.flush(5)
        proxy.stop()
    got = consume(broker.bootstrap, topic, 200)
    assert sorted(m.value() for m in got) == sorted(
        [b"before %d" % i for i in range(100)] + [b"after %d" % i for i in range(100)])


def test_an_unreachable_upstream_at_start_is_retried(tmp_path: Path) -> None:
    """With --wait-for-upstream the proxy starts even when no broker answers; once one
    does, the proxy learns its nodes without any client asking."""
    broker_port = free_port()
    lines: list[str] = []
    port_start = free_broker_port_start()
    proxy = launch_proxy_at(f"127.0.0.1:{broker_port}", free_port(), port_start,
                            "--wait-for-upstream", lines=lines)
    late = TansuBroker(advertised_port=broker_port, port=broker_port,
                       log_path=tmp_path / "late.log")
    try:
        warning = _wait_for_line(lines, "could not learn the cluster's nodes", 15)
        assert warning is not None and "level=WARNING" in warning, proxy.log
        assert f"127.0.0.1:{broker_port}" in warning
        late.start()
        learned = _wait_for_line(lines, "learned 1 broker node(s) from upstream", 20)
        assert learned is not None, proxy.log
        sock = connect(f"127.0.0.1:{port_start + TANSU_NODE_ID}", timeout=5)
        sock.close()
        assert proxy.alive()
    finally:
        proxy.stop()
        late.stop()


async def _readyz(address: str) -> tuple[int, str]:
    """``GET /readyz`` on the proxy's metrics listener: status and body."""
    reader, writer = await asyncio.open_connection(*address.rsplit(":", 1))
    writer.write(b"GET /readyz HTTP/1.0\r\n\r\n")
    raw = await reader.read()
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_a_node_listener_that_cannot_open_keeps_the_proxy_unready_until_it_opens(
        broker: EmbeddedBroker, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(server_module, "LISTENER_RETRY", 0.05, raising=False)
    caplog.set_level(logging.DEBUG, "kiproxy")
    port_start = free_broker_port_start()
    node_port = port_start + TANSU_NODE_ID
    squatter = socket.create_server(("127.0.0.1", node_port))  # another process's port
    server = ProxyServer(ProxyConfig(
        upstream=[broker.bootstrap], listen=f"127.0.0.1:{free_port()}",
        broker_port_start=port_start, metrics_listen=f"127.0.0.1:{free_port()}"),
        metrics=Metrics())
    try:
        await server.start()
        address = server.metrics_address
        assert address is not None
        status, body = await _readyz(address)
        assert status == 503
        assert f"node {TANSU_NODE_ID} has no listener on port {node_port}: " in body
        assert "in use" in body  # the reason, as the system said it
        tries = 0
        for _ in range(400):  # retried, and logged once, not once per try
            await asyncio.sleep(0.01)
            tries = sum("cannot open listener" in r.getMessage() for r in caplog.records)
            if tries >= 3:
                break
        errors = [r for r in caplog.records if r.levelno == logging.ERROR
                  and "cannot open listener" in r.getMessage()]
        assert tries >= 3 and len(errors) == 1, caplog.text
        squatter.close()
        for _ in range(400):
            status, body = await _readyz(address)
            if status == 200:
                break
            await asyncio.sleep(0.01)
        assert (status, body) == (200, "ready\n")
        assert f"opened listener port {node_port} for node {TANSU_NODE_ID}" in caplog.text
        reader, writer = await asyncio.open_connection("127.0.0.1", node_port)
        writer.write(api_versions_frame(9, version=0))  # length prefix included
        size = struct.unpack(">i", await reader.readexactly(4))[0]
        answer = await reader.readexactly(size)
        writer.close()
        assert parse_response_header(answer, 0)[0] == 9  # a broker answers through it
    finally:
        squatter.close()
        await server.stop(0)
