"""``RegistryHttp``: one GET to the schema registry, bounded in time, size and concurrency,
its JSON answer parsed, every failure a :class:`RegistryUnavailable` naming the URL, the
cause and the setting to look at.

Contract of :meth:`RegistryHttp.get_json`:

* At most ``max_requests_in_flight`` requests run at once (per loop); a request waits
  for its turn at most ``timeout_ms`` and then takes at most ``timeout_ms``.
* An answer larger than ``max_response_bytes`` is refused: by its Content-Length before
  a byte of the body is read, else as soon as the bytes read pass the limit (the body
  is read as a stream, never whole first).
* A body above 64 KiB is parsed on a worker thread (at most ``max_requests_in_flight``
  threads, the request's turn held meanwhile); a smaller one on the loop, where a
  thread's hand-off would cost more than the parse.
* 404 raises what ``unknown()`` makes; any other status but 200, a connection or TLS
  failure, a timeout, an answer too large or not JSON raises :class:`RegistryUnavailable`
  and writes one WARNING per kind of cause at most every 10 seconds, naming the setting
  to check (``registry.ca_file`` for a certificate the CAs do not sign,
  ``registry.cert_file`` for a client certificate the registry refuses,
  ``registry.bearer_token_file`` for a 401...).

Credentials and TLS files: the bearer token file is read again whenever its mtime
changes (checked before each request); the CA, client certificate, key and password
files likewise, and a change makes a new connection pool (the old one closes once its
requests have had ``timeout_ms`` to finish). A replaced file that cannot be read or
loaded (a rotation half written) is named in a WARNING and the material read before
stays in use until the file loads; with nothing read before, the request fails as
unavailable, naming the key.

No module-level event-loop state: the HTTP client is created in the loop that first uses
it and replaced when a later call runs in another loop.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import json
import logging
import os
import ssl
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kiproxy.interceptors.log_limit import MORE_IN_INTERVAL, RateLimitedLog

from .registry_config import RegistrySettings

__all__ = ["OFF_LOOP_BYTES", "HttpCounts", "RegistryHttp", "RegistryUnavailable"]

log = logging.getLogger("kiproxy.schema_registry")

OFF_LOOP_BYTES = 64 * 1024
"""Bodies larger than this are parsed on a worker thread."""
_CHUNK = 64 * 1024


class RegistryUnavailable(Exception):
    """The registry could not answer (timeout, connection refused, 5xx, refused
    credentials, an answer too large or not the API's): the message names the URL, the
    cause and the setting to check."""


@dataclass(slots=True)
class HttpCounts:
    """HTTP requests made, those that failed, and their total duration."""

    requests: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_count: int = 0


@dataclass(slots=True)
class _Pool:
    """What belongs to one event loop: the HTTP client, the request gate, and the stamp
    of the credential files it was built from."""

    loop: asyncio.AbstractEventLoop
    http: aiohttp.ClientSession
    gate: asyncio.Semaphore
    stamp: tuple[tuple[str, int], ...]


class RegistryHttp:
    """GETs to one registry (see the module docstring)."""

    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        self.base = settings.url.rstrip("/")
        self.counts = HttpCounts()
        self._pool: _Pool | None = None
        self._token: tuple[int, str] | None = None
        self._threads: ThreadPoolExecutor | None = None
        self._closing: set[asyncio.Task[None]] = set()
        self._warn = RateLimitedLog(log)
        self._closed = False

    # -- requests -----------------------------------------------------------------------

    async def get_json(self, path: str, *, unknown: Callable[[], Exception],
                       what: str = "", parse: bool = True) -> Any:
        """The parsed JSON answer of ``GET base + path`` (see the module docstring);
        ``what`` names the lookup in a warning ("schema id 7"); without ``parse``, the
        answer's bytes."""
        url = self.base + path
        what = what or path
        headers = {}
        token = self._bearer(url)
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        pool = self._current_pool(url)
        await self._take_turn(pool.gate, url)
        try:
            status, reason, body = await self._fetch(pool, url, headers, what)
            if status == 404:
                if not _registry_error(body):
                    # Not the registry saying it has no such thing: an ingress or a load
                    # balancer in front of it, or a URL that is not the API's.
                    raise self._failed("http 404", url, "HTTP 404 without the registry's "
                                       f"error answer: {body[:200].decode('utf-8', 'replace')}",
                                       "registry.url, is it the API's base URL?")
                raise unknown()
            if status != 200:
                setting = {401: "registry.basic_auth / registry.bearer_token / "
                                "registry.bearer_token_file (the registry refused them)",
                           403: "registry.basic_auth / registry.bearer_token / "
                                "registry.bearer_token_file (they may not read schemas)",
                           }.get(status, "")
                text = body[:200].decode("utf-8", "replace")
                raise self._failed(f"http {status}", url, f"HTTP {status} {reason}: {text}",
                                   setting)
            return await self._parse(body, url) if parse else bytes(body)
        finally:
            pool.gate.release()

    async def _fetch(self, pool: _Pool, url: str, headers: dict[str, str],
                     what: str) -> tuple[int, str, bytearray]:
        limit = self.settings.max_response_bytes
        self.counts.requests += 1
        started = time.perf_counter()
        try:
            async with pool.http.get(url, headers=headers) as resp:
                status, reason = resp.status, resp.reason or ""
                length = resp.content_length
                if length is not None and length > limit:
                    raise self._too_large(url, what, f"{length} bytes")
                body = bytearray()
                async for chunk in resp.content.iter_chunked(_CHUNK):
                    body += chunk
                    if len(body) > limit:
                        raise self._too_large(url, what, f"more than {limit} bytes")
                return status, reason, body  # not copied: json.loads reads a bytearray
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # OSError: ssl.SSLError among them; a TLS 1.3 server refusing the client's
            # certificate says so only once the first response is read.
            kind, setting = _classify(exc, tls=url.startswith("https://"))
            cause = str(exc) or type(exc).__name__
            raise self._failed(kind, url, cause, setting) from exc
        finally:
            self.counts.latency_sum_s += time.perf_counter() - started
            self.counts.latency_count += 1

    async def _parse(self, body: bytearray, url: str) -> Any:
        try:
            if len(body) <= OFF_LOOP_BYTES:
                return json.loads(body)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._workers(), json.loads, body)
        except ValueError as exc:
            raise self._failed("not json", url, "the answer is not JSON",
                               "registry.url, is it the API's base URL?") from exc
        except RecursionError as exc:  # [[[...]]] nested past Python's recursion limit
            raise self._failed("not json", url, "the answer is JSON nested too deep to "
                               "read", "registry.url, is it the API's base URL?") from exc

    async def _take_turn(self, gate: asyncio.Semaphore, url: str) -> None:
        """Wait for one of the ``max_requests_in_flight`` turns, at most ``timeout_ms`` (as
        long as a request may take), so lookups queued behind a registry that stopped
        answering fail as unavailable in about that time instead of one timeout after
        another."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await gate.acquire()
        except TimeoutError:
            s = self.settings
            raise self._failed(
                "no turn", url, f"no request slot free within {s.timeout_ms} ms "
                f"({s.max_requests_in_flight} requests in flight, "
                "registry.max_requests_in_flight): the registry answers slowly",
                "registry.timeout_ms / registry.max_requests_in_flight") from None

    def _too_large(self, url: str, what: str, size: str) -> RegistryUnavailable:
        limit = self.settings.max_response_bytes
        self.counts.errors += 1
        self._warn.warning(
            "too large", "schema registry: the answer for %s (%s) is %s, more than "
            "registry.max_response_bytes (%d): refused, the lookup fails as the registry "
            "unavailable (raise registry.max_response_bytes if schemas this large are "
            "expected)", what, url, size, limit,
            more=MORE_IN_INTERVAL)
        return RegistryUnavailable(f"schema registry {url}: the answer is {size}, more than "
                                   f"registry.max_response_bytes ({limit})")

    def _failed(self, kind: str, url: str, cause: str, setting: str) -> RegistryUnavailable:
        self.counts.errors += 1
        check = f"; check {setting}" if setting else ""
        self._warn.warning(kind, "schema registry unavailable: %s: %s%s", url, cause, check,
                           more=MORE_IN_INTERVAL)
        return RegistryUnavailable(f"schema registry {url}: {cause}{check}")

    # -- the connection pool and the credential files ----------------------------------

    def _current_pool(self, url: str) -> _Pool:
        if self._closed:  # a refresh that outlived the client
            raise RegistryUnavailable(f"schema registry {url}: the client is closed")
        loop = asyncio.get_running_loop()
        pool = self._pool
        ours = pool if pool is not None and pool.loop is loop else None
        stamp: tuple[tuple[str, int], ...] | None = None
        try:
            stamp = self._stamp()
            if ours is not None and ours.stamp == stamp:
                return ours
            http = self._new_http()
        except _FileTrouble as trouble:
            if ours is None:
                raise self._failed(f"file {trouble.key}", url, str(trouble),
                                   trouble.key) from trouble
            self._warn.warning(("file", trouble.key), "schema registry: %s; the connections "
                               "made with the previous %s go on until it loads", trouble,
                               trouble.key, more=MORE_IN_INTERVAL)
            if stamp is not None:
                ours.stamp = stamp  # tried again when the file changes again
            return ours
        gate = pool.gate if pool is not None and pool.loop is loop else \
            asyncio.Semaphore(self.settings.max_requests_in_flight)
        if pool is not None and pool.loop is loop:
            self._close_later(pool.http, self.settings.timeout_s + 1)
        self._pool = _Pool(loop, http, gate, stamp)
        return self._pool

    def _stamp(self) -> tuple[tuple[str, int], ...]:
        s = self.settings
        files = {"registry.ca_file": s.ca_file, "registry.cert_file": s.cert_file,
                 "registry.key_file": s.key_file,
                 "registry.basic_auth.password_file":
                     s.basic_auth.password_file if s.basic_auth else None}
        stamp = []
        for key, path in files.items():
            if path is None:
                continue
            try:
                stamp.append((key, os.stat(path).st_mtime_ns))
            except OSError as exc:
                raise _FileTrouble(key, f"cannot read {key} {path!r}: {exc}") from exc
        return tuple(stamp)

    def _new_http(self) -> aiohttp.ClientSession:
        s = self.settings
        tls: ssl.SSLContext | bool = True
        if s.url.startswith("https://"):
            try:
                ctx = ssl.create_default_context(cafile=s.ca_file)
            except (OSError, ValueError) as exc:
                raise _FileTrouble("registry.ca_file", "cannot load registry.ca_file "
                                   f"{s.ca_file!r}: {exc}") from exc
            if s.cert_file is not None:
                try:
                    ctx.load_cert_chain(s.cert_file, s.key_file)
                except (OSError, ValueError) as exc:
                    raise _FileTrouble("registry.cert_file / registry.key_file",
                                       f"cannot load registry.cert_file {s.cert_file!r} / "
                                       f"registry.key_file {s.key_file!r}: {exc}") from exc
            tls = ctx
        headers = {"Accept": "application/vnd.schemaregistry.v1+json, application/json"}
        if s.basic_auth is not None:
            password = s.basic_auth.password
            if password is None and s.basic_auth.password_file is not None:
                try:
                    password = Path(s.basic_auth.password_file).read_text().strip()
                except OSError as exc:
                    raise _FileTrouble("registry.basic_auth.password_file",
                                       f"cannot read registry.basic_auth.password_file: "
                                       f"{exc}") from exc
            pair = f"{s.basic_auth.username}:{password or ''}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls, limit=s.max_connections),
            timeout=aiohttp.ClientTimeout(total=s.timeout_s), headers=headers)

    def _bearer(self, url: str) -> str | None:
        s = self.settings
        if s.bearer_token is not None:
            return s.bearer_token
        if s.bearer_token_file is None:
            return None
        path = Path(s.bearer_token_file)
        try:
            mtime = path.stat().st_mtime_ns
            if self._token is None or self._token[0] != mtime:
                self._token = (mtime, path.read_text().strip())
        except OSError as exc:
            cause = f"cannot read registry.bearer_token_file {s.bearer_token_file!r}: {exc}"
            if self._token is None:
                raise self._failed("file registry.bearer_token_file", url, cause,
                                   "registry.bearer_token_file") from exc
            self._warn.warning(("file", "registry.bearer_token_file"), "schema registry: %s; "
                               "the token read before is sent until it can be read", cause,
                               more=MORE_IN_INTERVAL)
        return self._token[1]

    def _workers(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self.settings.max_requests_in_flight,
                                               thread_name_prefix="schema-registry")
        return self._threads

    def _close_later(self, http: aiohttp.ClientSession, delay: float) -> None:
        async def close() -> None:
            await asyncio.sleep(delay)
            await http.close()

        task = asyncio.get_running_loop().create_task(close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close the HTTP client (when called in the loop that made it; otherwise drop it)
        and the parsing threads; lookups after this fail as unavailable."""
        self._closed = True
        pool, self._pool = self._pool, None
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)
        for task in list(self._closing):
            task.cancel()
        if pool is None or pool.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is pool.loop:
            await pool.http.close()


class _FileTrouble(Exception):
    """A credential or TLS file that cannot be read or loaded; ``key`` names its setting."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def _classify(exc: BaseException, *, tls: bool) -> tuple[str, str]:
    """The kind of a transport failure (one warning per kind per interval) and the
    setting to check."""
    text = f"{type(exc).__name__} {exc}".upper()
    if tls and (isinstance(exc, aiohttp.ServerDisconnectedError)
                or (isinstance(exc, OSError) and exc.errno == errno.ECONNRESET)):
        # TLS 1.3: a server that refuses the client's certificate says so after the
        # handshake, by closing (or resetting) the connection before it answers.
        return "tls closed", ("registry.cert_file / registry.key_file (the registry closed "
                              "the connection unanswered: it may refuse the client "
                              "certificate - missing, expired or not signed by a CA it "
                              "trusts)")
    if isinstance(exc, aiohttp.ClientConnectorCertificateError) or \
            "CERTIFICATE_VERIFY_FAILED" in text:
        return "tls verify", ("registry.ca_file (the registry's certificate is not signed by "
                              "those CAs, or has expired)")
    if "CERTIFICATE" in text or "ALERT" in text:
        return "tls refused", ("registry.cert_file / registry.key_file (the registry "
                               "refused the client certificate: missing, expired or not "
                               "signed by a CA it trusts)")
    if isinstance(exc, (aiohttp.ClientSSLError, ssl.SSLError)):
        return "tls", "registry.url / registry.ca_file"
    if isinstance(exc, TimeoutError):
        return "timeout", "registry.timeout_ms"
    return "connect", "registry.url"


def _registry_error(body: bytearray) -> bool:
    """Whether a 404's body is a registry's own error answer: a JSON object (Confluent's
    and its API's ``{"error_code": 40403, ...}``, Apicurio's ``{"status": 404, ...}``), not
    an ingress's page."""
    try:
        return isinstance(json.loads(body), dict) if len(body) <= _ERROR_BODY_BYTES else False
    except (ValueError, RecursionError):
        return False


_ERROR_BODY_BYTES = 64 * 1024
"""A registry's error answer is small; a larger 404 body is not read as one."""
