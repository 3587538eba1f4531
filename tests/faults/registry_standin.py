"""``StandInRegistry``: a schema registry on loopback that misbehaves on demand.

It speaks the paths of the Confluent Schema Registry API the proxy's client uses
(``GET /schemas/ids/{id}``, ``/schemas/ids/{id}/versions``,
``/subjects/{subject}/versions/latest``) from an aiohttp server running on a thread of
its own, and answers according to its ``mode``, switched per test phase:

``healthy``       the registered schemas (:meth:`StandInRegistry.register`)
``hang``          accepts the request and never answers
``http500``       HTTP 500 with a JSON error body
``garble``        HTTP 200 with a body that is not JSON
``flood``         HTTP 200 and a 50 MB JSON body, with its Content-Length
``flood_chunked`` the same 50 MB, chunked: no length announced
``large``         the registered schemas, each answer padded to 3.5 MB (a ``doc`` of
                  padding: under the client's 4 MiB default)
``trickle``       HTTP 200, a JSON body sent one byte per second
``uncompilable``  HTTP 200 and a schema no compiler takes (an Avro field of an unknown
                  type), for every id
``closed``        nothing listens on the port (connection refused)

Optionally it serves HTTPS (``tls``: an ``ssl.SSLContext``, which may require a client
certificate) and requires a bearer token (``token``). ``requests`` lists the paths asked,
in order, with the mode that answered.
"""

from __future__ import annotations

import asyncio
import functools
import json
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from aiohttp import web

MODES = ("healthy", "hang", "http500", "garble", "flood", "flood_chunked", "large", "trickle",
         "uncompilable", "closed")
FLOOD_BYTES = 50 * 1024 * 1024
LARGE_BYTES = 3_500_000
UNCOMPILABLE = json.dumps({"type": "record", "name": "Broken", "namespace": "faults",
                           "fields": [{"name": "a", "type": "faults.NoSuchType"}]})


class StandInRegistry:
    """A registry whose behaviour is switched per phase (see the module docstring)."""

    def __init__(self, *, tls: ssl.SSLContext | None = None, token: str | None = None) -> None:
        self.mode = "healthy"
        self.token = token
        self.requests: list[tuple[str, str]] = []
        self._schemas: dict[int, tuple[str, str, str]] = {}  # id -> (text, type, subject)
        self._tls = tls
        self._loop = asyncio.new_event_loop()
        self._release = asyncio.Event()
        self._site: web.TCPSite | None = None
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="standin-registry")
        self._thread.start()
        self.port = self._call(self._start(0))
        scheme = "https" if tls is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"

    def register(self, schema_id: int, schema: dict[str, Any] | str, subject: str,
                 schema_type: str = "AVRO") -> None:
        """Serve ``schema`` under ``schema_id`` (version 1 of ``subject``)."""
        text = schema if isinstance(schema, str) else json.dumps(schema)
        self._schemas[schema_id] = (text, schema_type, subject)

    def set_mode(self, mode: str) -> None:
        """Answer from now on as ``mode`` says; a hanging request is let go."""
        assert mode in MODES, mode
        previous, self.mode = self.mode, mode
        if previous == "hang":
            self._loop.call_soon_threadsafe(self._release.set)
        if mode == "closed" and previous != "closed":
            self._call(self._stop_site())
        elif previous == "closed" and mode != "closed":
            self._call(self._start(self.port))

    @contextmanager
    def phase(self, mode: str) -> Iterator[None]:
        """``mode`` for the block, healthy after it."""
        self.set_mode(mode)
        try:
            yield
        finally:
            self.set_mode("healthy")

    def asked(self, path: str) -> int:
        """How many requests asked for ``path``."""
        return sum(1 for p, _ in self.requests if p == path)

    def close(self) -> None:
        """Stop serving and the thread."""
        self._loop.call_soon_threadsafe(self._release.set)
        if self._runner is not None:
            self._call(self._runner.cleanup())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    # -- the server ----------------------------------------------------------------------

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self, port: int) -> int:
        if self._runner is None:
            app = web.Application()
            app.router.add_get("/{tail:.*}", self._answer)
            self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
            await self._runner.setup()
        self._site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self._tls,
                                 reuse_address=True)
        await self._site.start()
        sockets = self._site._server.sockets  # type: ignore[union-attr]
        return int(sockets[0].getsockname()[1])

    async def _stop_site(self) -> None:
        # The whole server, so the connections already open are closed too.
        self._site = None
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        mode = self.mode
        self.requests.append((request.path, mode))
        if self.token is not None and request.headers.get("Authorization") != \
                f"Bearer {self.token}":
            return web.json_response({"error_code": 401, "message": "Unauthorized"},
                                     status=401)
        if mode == "hang":
            self._release.clear()
            await self._release.wait()
            raise web.HTTPServiceUnavailable()
        if mode == "http500":
            return web.json_response({"error_code": 50001, "message": "storage failure"},
                                     status=500)
        if mode == "garble":
            return web.Response(body=b"<html><body>Bad gateway</body></html>",
                                content_type="text/html")
        if mode == "flood":
            return web.Response(body=_flood_body(), content_type="application/json")
        if mode in ("flood_chunked", "trickle"):
            return await self._stream(request, mode)
        return self._api(request.path, mode)

    async def _stream(self, request: web.Request, mode: str) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        try:
            if mode == "flood_chunked":
                view = memoryview(_flood_body())
                for start in range(0, len(view), 1 << 20):
                    await response.write(view[start:start + (1 << 20)])
            else:
                for byte in b'{"schema": "' + b"x" * 100 + b'"}':
                    await response.write(bytes([byte]))
                    await asyncio.sleep(1)
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client gave up: what the proxy is meant to do
        return response

    def _api(self, path: str, mode: str) -> web.Response:
        parts = path.strip("/").split("/")
        if parts[:2] == ["schemas", "ids"] and len(parts) in (3, 4) and parts[2].isdigit():
            known = self._schemas.get(int(parts[2]))
            if known is None:
                return _not_found(40403, "Schema not found")
            text, schema_type, subject = known
            if len(parts) == 4:
                return web.json_response([{"subject": subject, "version": 1}])
            if mode == "uncompilable":
                text, schema_type = UNCOMPILABLE, "AVRO"
            elif mode == "large":
                text = json.dumps({**json.loads(text), "doc": "x" * LARGE_BYTES})
            body: dict[str, Any] = {"schema": text}
            if schema_type != "AVRO":
                body["schemaType"] = schema_type
            return web.json_response(body)
        if parts[0] == "subjects" and parts[-2:] == ["versions", "latest"]:
            subject = "/".join(parts[1:-2])
            ids = [i for i, (_, _, s) in self._schemas.items() if s == subject]
            if not ids:
                return _not_found(40401, "Subject not found")
            return web.json_response({"subject": subject, "version": 1, "id": max(ids)})
        return _not_found(404, "Not found")


def _not_found(code: int, message: str) -> web.Response:
    return web.json_response({"error_code": code, "message": message}, status=404)


@functools.cache
def _flood_body(size: int = FLOOD_BYTES) -> bytes:
    """A valid answer of ``size`` bytes: a string schema whose doc is mostly padding."""
    head = b'{"schema": "{\\"type\\": \\"string\\", \\"doc\\": \\"'
    tail = b'\\"}"}'
    return head + b"x" * (size - len(head) - len(tail)) + tail
