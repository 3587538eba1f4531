"""A client that goes away while its answer is owed: an ordinary close, not an error.

On a real socket the client pipelines a Metadata request and a Produce request,
and resets the connection while the proxy holds the Produce in the interceptor
(``hardening_stall:Stall``, which holds the event loop for 3 s, long enough for the
broker's answer to arrive on a loaded machine, and writes a file when it
starts). The Metadata request was forwarded before the stall, so the broker's
answer and the client's reset both wait for the proxy when the stall ends: the
answer is ready for a client whose connection is already closed. The proxy says
so at DEBUG, logs nothing at ERROR (no traceback), and keeps serving: a Produce
request on a new connection is acknowledged afterwards.
"""

from __future__ import annotations

import socket
import struct
import time
from pathlib import Path
from typing import Any

from support.raw_client import RawClient

from kiproxy.protocol.messages import ApiKey, request_type
from kiproxy.protocol.records import Record, build_batch

PLUGINS = Path(__file__).resolve().parent / "plugins"


def _reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), as a killed client does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_client_gone_before_its_answer_is_an_ordinary_close(
        start_proxy: Any, topic: str, tmp_path: Path) -> None:
    started = tmp_path / "started"
    proxy = start_proxy("--log-level", "DEBUG", plugins_dir=PLUGINS,
                        interceptor="hardening_stall:Stall",
                        interceptor_config={"stall_ms": 3000, "started_file": str(started)})
    metadata = request_type(ApiKey.METADATA, 9)(
        topics=None, allow_auto_topic_creation=False, include_cluster_authorized_operations=False,
        include_topic_authorized_operations=False)
    batch = build_batch([Record(key=None, value=b"gone", headers=[], timestamp=0)])
    client = RawClient(proxy.bootstrap)
    client.send(RawClient.frame(ApiKey.METADATA, 9, 1, metadata)
                + RawClient.produce(9, [(topic, batch)], correlation_id=2))
    while not started.exists():  # the Metadata request is forwarded; the Produce is held
        assert proxy.alive(), proxy.log
        time.sleep(0.01)
    address = client.local_address
    _reset(client.sock)

    proxy.wait_for_line("went away before", address)
    errors = [line for line in proxy.lines if "level=ERROR" in line or "Traceback" in line]
    assert errors == [], proxy.log

    # Still serving: a new connection gets its Metadata answer, and a Produce request
    # goes through the interceptor to the broker and is acknowledged.
    with RawClient(proxy.bootstrap) as again:
        assert again.request(ApiKey.METADATA, 9, metadata).brokers
        again.send(RawClient.produce(9, [(topic, build_batch([Record(
            key=None, value=b"after", headers=[], timestamp=0)]))], correlation_id=3))
        correlation_id, response = again.read_produce(9)
    assert correlation_id == 3
    [part] = [p for t in response.responses for p in t.partition_responses]
    assert int(part.error_code) == 0, part
    assert proxy.alive()
