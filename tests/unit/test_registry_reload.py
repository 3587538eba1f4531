"""A reload while the registry is unreachable: the new instance takes what the one it
replaces knew of the same registry, so producers whose ids were served go on being
served; a reload to another registry takes nothing."""

from __future__ import annotations

import io
import json
import struct

import fastavro
import pytest
from aiohttp import web

from kiproxy.interceptors import Record, RecordBatch, RejectBatch
from kiproxy.interceptors.builtin.schema_registry import SchemaRegistryValidator
from kiproxy.interceptors.builtin.schema_registry.settings import SchemaRegistrySettings
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.interceptors.testing import make_context

ORDER = {"type": "record", "name": "Order", "fields": [{"name": "id", "type": "string"}]}


def _value(order_id: str) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(ORDER), {"id": order_id})
    return b"\x00" + struct.pack(">I", 7) + buf.getvalue()


BATCH = RecordBatch(topic="orders", partition=0, records=(Record(value=_value("o1")),))


async def _registry() -> tuple[web.AppRunner, str, list[str]]:
    asked: list[str] = []
    answers = {"/schemas/ids/7": {"schema": json.dumps(ORDER)},
               "/schemas/ids/7/versions": [{"subject": "orders-value", "version": 1}]}

    async def answer(request: web.Request) -> web.Response:
        asked.append(request.path)
        body = answers.get(request.path)
        if body is None:
            return web.json_response({"error_code": 40403, "message": "not found"}, status=404)
        return web.json_response(body)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}", asked


def _validator(url: str) -> SchemaRegistryValidator:
    validator = SchemaRegistryValidator()
    validator.configure(SchemaRegistrySettings.model_validate({
        "registry": {"url": url, "negative_ttl_s": 0.1},
        "topics": {"orders": {"value": "payload"}}}))
    return validator


async def test_a_reload_during_an_outage_keeps_serving_the_ids_served_before() -> None:
    runner, url, asked = await _registry()
    first = _validator(url)
    try:
        assert await first.intercept(BATCH, make_context()) is BATCH
        assert asked  # the id and its subjects were looked up
    finally:
        await runner.cleanup()  # the registry is gone from here on

    reloaded = _validator(url)  # what a reload configures, with the same settings
    await first.close()
    try:
        assert await reloaded.intercept(BATCH, make_context()) is BATCH
    finally:
        await reloaded.close()


async def test_a_reload_to_another_registry_takes_nothing_from_the_old_one() -> None:
    runner, url, _ = await _registry()
    first = _validator(url)
    try:
        assert await first.intercept(BATCH, make_context()) is BATCH
    finally:
        await runner.cleanup()
    elsewhere = _validator(url + "/")  # other settings: a registry of its own
    try:
        with pytest.raises(RejectBatch) as refused:
            await elsewhere.intercept(BATCH, make_context())
        assert refused.value.error_code == ErrorCode.REQUEST_TIMED_OUT
    finally:
        await elsewhere.close()
        await first.close()
