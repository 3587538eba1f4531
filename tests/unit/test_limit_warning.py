"""A client host's refused bombs: one WARNING per interval, and those held back counted
in a line of their own when no other bomb follows."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.protocol.errors import DecompressionLimitExceeded
from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.proxy.produce.partition import PartitionHandler


async def test_bombs_held_back_are_counted_without_another_bomb(
        caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kiproxy.test.bombs")
    handler = PartitionHandler(log=logger)
    handler._limit_warnings = RateLimitedLog(logger, 0.05)
    client = SimpleNamespace(identity=ClientIdentity(client_host="10.0.0.9", client_port=1,
                                                     client_id="bomber"),
                             log_context={})
    exc = DecompressionLimitExceeded("decompresses past max_decompressed_batch_bytes",
                                     limit=1, setting="max_decompressed_batch_bytes")
    with caplog.at_level(logging.WARNING, "kiproxy.test.bombs"):
        for partition in range(4):
            job: Any = SimpleNamespace(topic="t", partition=partition, client=client)
            handler._warn_limit(job, exc)
        await asyncio.sleep(0.2)
    assert [r.getMessage() for r in caplog.records] == [
        "refused t[0] from 10.0.0.9:1 (client_id 'bomber'): decompresses past "
        "max_decompressed_batch_bytes",
        "3 more like it in the last 0.05 s not logged; the last: refused t[3] from "
        "10.0.0.9:1 (client_id 'bomber'): decompresses past max_decompressed_batch_bytes"]
