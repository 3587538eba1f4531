"""The registry client against a registry that answers what it should not: a reference
cycle, JSON nested past Python's recursion limit. Each is the registry being unavailable
(producers retry), named, and never a lookup that waits for ever."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kiproxy.interceptors.builtin.schema_registry.registry import (
    RegistryUnavailable,
    SchemaRegistryClient,
    UnknownSchemaId,
)
from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings

INNER = json.dumps({"type": "record", "name": "A", "fields": [{"name": "x", "type": "int"}]})
OUTER = json.dumps({"type": "record", "name": "O", "fields": [{"name": "a", "type": "A"}]})


@asynccontextmanager
async def _registry(answers: Mapping[str, bytes | object], delay_s: float = 0.0,
                    asked: list[str] | None = None) -> AsyncIterator[str]:
    """An HTTP registry on loopback answering each path with its JSON (or bytes), and
    404 with Confluent's error body otherwise, each ``delay_s`` after it is asked (the
    paths asked appended to ``asked``); yields its URL."""
    async def answer(request: web.Request) -> web.Response:
        if asked is not None:
            asked.append(request.path)
        await asyncio.sleep(delay_s)
        body = answers.get(request.path)
        if body is None:
            return web.json_response({"error_code": 40403, "message": "not found"},
                                     status=404)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return web.Response(body=raw, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("versions", [
    {"/subjects/a/versions/1": {"id": 2, "schema": INNER, "references": [
        {"name": "A", "subject": "a", "version": 1}]}},
    {"/subjects/a/versions/1": {"id": 2, "schema": INNER, "references": [
        {"name": "B", "subject": "b", "version": 1}]},
     "/subjects/b/versions/1": {"id": 3, "schema": INNER, "references": [
         {"name": "A", "subject": "a", "version": 1}]}},
], ids=["itself", "through-another"])
async def test_a_reference_cycle_is_named_and_the_lookup_ends(
        versions: dict[str, object]) -> None:
    """The inner lookup joined the outer one, in flight for the same subject version,
    and waited for itself for good: no timeout applied, and the id was never asked again."""
    answers = {"/schemas/ids/1": {"schema": OUTER, "references": [
        {"name": "A", "subject": "a", "version": 1}]}, **versions}
    async with _registry(answers) as url:
        client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
        try:
            with pytest.raises(RegistryUnavailable, match=r"references form a cycle: a v1 -> "):
                await asyncio.wait_for(client.schema_by_id(1), 5)
        finally:
            await client.close()


async def test_two_ids_entering_a_reference_cycle_at_two_points_at_once_both_end() -> None:
    """Ids 1 and 2 reference the two subjects of a cycle, one each, and are looked up at
    once: the lookup of ``a`` (for id 1) reached ``b`` while the lookup of ``b`` (for
    id 2) was in flight and joined it, which had joined the lookup of ``a``: each waited
    for the other for good, and so did every later lookup of either id."""
    answers = {
        "/schemas/ids/1": {"schema": OUTER, "references": [
            {"name": "A", "subject": "a", "version": 1}]},
        "/schemas/ids/2": {"schema": OUTER, "references": [
            {"name": "A", "subject": "b", "version": 1}]},
        "/subjects/a/versions/1": {"id": 3, "schema": INNER, "references": [
            {"name": "B", "subject": "b", "version": 1}]},
        "/subjects/b/versions/1": {"id": 4, "schema": INNER, "references": [
            {"name": "A", "subject": "a", "version": 1}]}}
    async with _registry(answers, delay_s=0.05) as url:  # both first steps before either next
        client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
        try:
            one, two = await asyncio.wait_for(asyncio.gather(
                client.schema_by_id(1), client.schema_by_id(2), return_exceptions=True), 5)
            for answer in (one, two):
                assert isinstance(answer, RegistryUnavailable)
                assert "references form a cycle" in str(answer)
        finally:
            await client.close()


async def test_ids_sharing_a_referenced_version_looked_up_at_once_ask_for_it_once() -> None:
    """A referenced version's lookup in flight is joined by every other id that needs
    it (as an id's is): 20 new ids sharing a chain of two references make one request
    for each reference, not 20."""
    inner_ref = [{"name": "A", "subject": "a", "version": 1}]
    answers: dict[str, object] = {
        **{f"/schemas/ids/{i}": {"schema": OUTER, "references": [
            {"name": "A", "subject": "b", "version": 1}]} for i in range(1, 21)},
        "/subjects/b/versions/1": {"id": 30, "schema": OUTER, "references": inner_ref},
        "/subjects/a/versions/1": {"id": 31, "schema": INNER}}
    asked: list[str] = []
    async with _registry(answers, delay_s=0.02, asked=asked) as url:
        client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
        try:
            found = await asyncio.wait_for(asyncio.gather(
                *(client.schema_by_id(i) for i in range(1, 21))), 10)
        finally:
            await client.close()
    assert all(f.references[0].schema.references[0].subject == "a" for f in found)
    assert sorted(p for p in asked if p.startswith("/subjects/")) == [
        "/subjects/a/versions/1", "/subjects/b/versions/1"]


async def test_json_nested_past_the_recursion_limit_is_a_registry_fault() -> None:
    async with _registry({"/schemas/ids/1": b"[" * 200_000 + b"]" * 200_000}) as url:
        client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
        try:
            with pytest.raises(RegistryUnavailable, match="nested too deep"):
                await asyncio.wait_for(client.schema_by_id(1), 5)
        finally:
            await client.close()


async def test_a_404_that_is_not_the_registrys_answer_is_the_registry_unavailable() -> None:
    """An ingress's 404 page (or a URL that is not the API's) meant "not registered":
    INVALID_RECORD for the records, and a cached schema replaced by that answer."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(status=404, text="<html><body>404 Not Found</body></html>",
                            content_type="text/html")

    app = web.Application()
    app.router.add_get("/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
    try:
        with pytest.raises(RegistryUnavailable, match="HTTP 404 without the registry's "
                                                      "error answer: <html>"):
            await client.schema_by_id(1)
    finally:
        await client.close()
        await runner.cleanup()


async def test_the_registrys_own_404_is_an_unknown_id() -> None:
    async with _registry({}) as url:  # every path: 404 {"error_code": 40403, ...}
        client = SchemaRegistryClient(RegistrySettings.from_config({"url": url}))
        try:
            with pytest.raises(UnknownSchemaId, match="schema id 1 is not registered"):
                await client.schema_by_id(1)
        finally:
            await client.close()
