"""The registry client's bound on an answer's size, against the stand-in registry.

An answer larger than ``registry.max_response_bytes`` fails the lookup as "registry
unavailable", by its Content-Length or, chunked, once the bytes read pass the limit,
with one WARNING naming the id, the size and the setting; an answer under the limit but
over 64 KiB is parsed on the client's worker thread and served as any other.
"""

from __future__ import annotations

import json
import logging

import pytest

from kiproxy.interceptors.builtin.schema_registry.registry import (
    RegistryUnavailable,
    SchemaRegistryClient,
)
from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings
from kiproxy.interceptors.builtin.schema_registry.registry_http import OFF_LOOP_BYTES

from .registry_standin import FLOOD_BYTES, StandInRegistry

LIMIT = 256 * 1024


def client(url: str) -> SchemaRegistryClient:
    return SchemaRegistryClient(RegistrySettings.from_config(
        {"url": url, "max_response_bytes": LIMIT, "timeout_ms": 5000}))


@pytest.mark.parametrize(("mode", "size"), [("flood", f"{FLOOD_BYTES} bytes"),
                                            ("flood_chunked", f"more than {LIMIT} bytes")])
async def test_an_answer_over_the_limit_is_refused_naming_the_setting(
        mode: str, size: str, standin: StandInRegistry,
        caplog: pytest.LogCaptureFixture) -> None:
    standin.register(3, {"type": "string"}, "s-value")
    standin.register(4, {"type": "string"}, "s-value")
    c = client(standin.url)
    try:
        with standin.phase(mode), caplog.at_level(logging.WARNING,
                                                  logger="kiproxy.schema_registry"):
            for schema_id in (3, 4):
                with pytest.raises(RegistryUnavailable) as failed:
                    await c.schema_by_id(schema_id)
                assert f"the answer is {size}, more than registry.max_response_bytes " \
                       f"({LIMIT})" in str(failed.value)
        [line] = [r.getMessage() for r in caplog.records]  # one per interval
        assert "schema id 3" in line and size in line and "registry.max_response_bytes" in line
        assert (await c.schema_by_id(3)).schema == '{"type": "string"}'  # healthy again
    finally:
        await c.close()


async def test_an_answer_under_the_limit_over_64_kib_is_parsed_off_the_loop(
        standin: StandInRegistry) -> None:
    doc = "x" * (2 * OFF_LOOP_BYTES)
    standin.register(5, {"type": "string", "doc": doc}, "s-value")
    c = client(standin.url)
    try:
        got = await c.schema_by_id(5)
        assert json.loads(got.schema)["doc"] == doc
        assert c.http._threads is not None  # the worker thread parsed it
    finally:
        await c.close()
