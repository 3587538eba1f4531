"""The metrics listener: Prometheus metrics, health checks and the admin actions over HTTP.

``--metrics-listen HOST:PORT`` serves:

* ``/metrics`` - Prometheus text format (the metric names are listed in the README);
* ``/healthz`` - 200 while the process runs its event loop;
* ``/readyz`` - 200 when the interceptor is loaded, every known broker node has its
  listener open and an upstream broker accepts a TCP connection, 503 with the reason
  otherwise;
* ``/livez`` - the same as ``/healthz`` (the Kubernetes name);
* ``POST /reload`` - reload the configuration (an admin action: see
  :mod:`kiproxy.proxy.admin.guard` for who may call it; others get 401 or 403):
  200 with the outcome as JSON when it was applied, 409 when it was refused
  (a setting that needs a restart), 500 when building it failed; the running
  configuration is unchanged unless the answer says ``"ok": true``;
* ``/config`` - the running configuration as JSON, secrets redacted, with its
  generation and hash.

The endpoint is a small HTTP/1.0 responder on the proxy's own event loop, so a
scrape costs no thread and a wedged loop shows up as a failing ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kiproxy.proxy.admin.guard import AdminGuard
from kiproxy.proxy.observe.metrics import Metrics

log = logging.getLogger("kiproxy.metrics")

__all__ = ["ConfigView", "HealthServer", "ReadinessCheck", "ReloadAction"]


ReadinessCheck = Callable[[], Awaitable[str | None]]
"""Returns ``None`` when ready, else the reason it is not."""

ReloadAction = Callable[[str], Awaitable[tuple[int, dict[str, Any]]]]
"""Runs a reload (given the request's query string); returns the HTTP status and the
JSON answer."""

ConfigView = Callable[[], dict[str, Any]]
"""The running configuration, redacted, for ``/config``."""


class HealthServer:
    """Serves ``/metrics``, ``/healthz``, ``/readyz``, ``/config`` and ``/reload``."""

    def __init__(self, metrics: Metrics, ready: ReadinessCheck,
                 reload: ReloadAction | None = None, config: ConfigView | None = None,
                 guard: AdminGuard | None = None) -> None:
        self.metrics = metrics
        self.guard = guard or AdminGuard(None, metrics.admin_refused)
        self._ready = ready
        self._reload = reload
        self._config = config
        self._server: asyncio.Server | None = None
        self.started_at = time.time()

    async def start(self, host: str, port: int) -> None:
        """Open the listener."""
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    @property
    def address(self) -> str:
        """``host:port`` actually listened on."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def stop(self) -> None:
        """Close the listener."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10)
            authorization: str | None = None
            for _ in range(100):  # the request headers: only Authorization is used
                line = await asyncio.wait_for(reader.readline(), 10)
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "authorization":
                    authorization = value.strip()
            parts = request_line.decode("latin-1").split()
            method, path = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            path, _, query = path.partition("?")
            if path == "/reload" and method == "POST" and self._reload is not None:
                peer = str((writer.get_extra_info("peername") or ("",))[0])
                local = str((writer.get_extra_info("sockname") or ("",))[0])
                refusal = self.guard.check(peer, local, authorization)
            else:
                refusal = None
            extra = ""
            if refusal is not None:
                status, ctype = _STATUS[refusal[0]], "text/plain; charset=utf-8"
                body = f"{refusal[1]}\n".encode()
                if refusal[0] == 401:
                    extra = 'WWW-Authenticate: Bearer realm="kiproxy admin"\r\n'
            else:
                status, ctype, body = await self._answer(method, path, query)
            head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n{extra}"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        except Exception:
            log.exception("metrics endpoint: request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, method: str, path: str,
                      query: str = "") -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if path == "/reload" and self._reload is not None:
            if method != "POST":
                return "405 Method Not Allowed", text, b"POST /reload\n"
            status, answer = await self._reload(query)
            return _STATUS[status], "application/json", json.dumps(answer).encode() + b"\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"only GET and HEAD\n"
        if path == "/config" and self._config is not None:
            body = json.dumps(self._config(), indent=2, sort_keys=True).encode() + b"\n"
            return "200 OK", "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
        if path in ("/healthz", "/livez"):
            return "200 OK", text, b"ok\n"
        if path == "/readyz":
            reason = await self._ready()
            if reason is None:
                return "200 OK", text, b"ready\n"
            return "503 Service Unavailable", text, f"not ready: {reason}\n".encode()
        return "404 Not Found", text, b"try /metrics, /healthz, /livez, /readyz or /config\n"


_STATUS = {200: "200 OK", 401: "401 Unauthorized", 403: "403 Forbidden", 409: "409 Conflict",
           500: "500 Internal Server Error"}
