"""A client closed for a request the proxy cannot carry is logged once per interval when
it keeps sending the same one.

A producer whose request is over ``max_frame_size`` reconnects and sends it again, and
again: every connection is closed, and the proxy used to write the same WARNING for
each. The same refusal from one host is written once per interval (10 s); a different
refusal from that host is still written at once.
"""

from __future__ import annotations

import struct
import time

from conftest import launch_proxy

from hardening.raw_kafka import closed_by_peer, connect
from kiproxy_dev.tansu import EmbeddedBroker

LIMIT = 1_048_576


def _refused(address: str, claimed: int) -> None:
    sock = connect(address, timeout=5)
    try:
        sock.sendall(struct.pack(">i", claimed) + b"\x00\x00\x00\x09")  # a Produce v9 start
        assert closed_by_peer(sock, 10), "a frame over max_frame_size was not refused"
    finally:
        sock.close()


def test_the_same_refusal_from_one_host_is_one_warning(broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap, "--max-frame-size", str(LIMIT))
    try:
        for _ in range(6):  # a producer retrying its oversized request
            _refused(proxy.bootstrap, 2_000_118)
        _refused(proxy.bootstrap, 3_000_000)  # another refusal
        deadline = time.monotonic() + 10
        while (time.monotonic() < deadline
               and not any("3000000 exceeds" in line for line in proxy.lines)):
            time.sleep(0.05)  # the log is read by a thread
        refusals = [line for line in proxy.lines if "exceeds max_frame_size" in line]
        assert [("2000118" in line, "WARNING" in line) for line in refusals] == [
            (True, True), (False, True)], proxy.log
        assert "closing client 127.0.0.1:" in refusals[0]
        assert proxy.alive()
    finally:
        proxy.stop()
