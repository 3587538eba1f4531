"""Delivers request and response events to observers, off the event loop.

Each observer gets a thread and a bounded queue of its own. The event loop only
appends to the queues (``put_nowait``), so a slow observer delays nothing but
itself; when its queue is full, further events for it are dropped and counted
(``kiproxy_observer_dropped_events_total``) with a log line, rather than
growing memory without bound. An observer that raises has the error logged
(at most once a minute per observer, with the traceback) and counted. On
shutdown every queue is drained before ``close()`` is called, so no event of a
finished request is lost.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import Any

from kiproxy.interceptors.observer import Observer, RequestInfo, ResponseInfo
from kiproxy.proxy.observe.metrics import Metrics

log = logging.getLogger("kiproxy.observe")

__all__ = ["ObserverHub"]

_STOP = object()
_LOG_EVERY_S = 60.0


def _overrides(obj: Any, name: str) -> bool:
    method = getattr(type(obj), name, None)
    return method is not None and method is not getattr(Observer, name)


class _Worker:
    """One observer, its queue and its thread."""

    def __init__(self, name: str, observer: Any, queue_size: int,
                 metrics: Metrics | None) -> None:
        self.name = name
        self.observer = observer
        self.wants_requests = _overrides(observer, "on_request") or not isinstance(
            observer, Observer)
        self.wants_responses = _overrides(observer, "on_response") or not isinstance(
            observer, Observer)
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        self.errors = 0
        self.dropped = 0
        self.delivered = 0
        self._metrics = metrics
        self._last_error_log = -_LOG_EVERY_S
        self._last_drop_log = -_LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name=f"observer-{name}", daemon=True)
        self._thread.start()

    def submit(self, method: str, info: Any) -> None:
        try:
            self.queue.put_nowait((method, info))
        except queue.Full:
            self.dropped += 1
            if self._metrics is not None:
                self._metrics.observer_dropped.labels(self.name).inc()
            now = time.monotonic()
            if now - self._last_drop_log >= _LOG_EVERY_S:
                self._last_drop_log = now
                log.warning("observer %s is falling behind: its queue of %d events is full; "
                            "dropping events (%d so far)", self.name, self.queue.maxsize,
                            self.dropped)

    def _run(self) -> None:
        while True:
            item = self.queue.get()
            if item is _STOP:
                return
            method, info = item
            try:
                getattr(self.observer, method)(info)
                self.delivered += 1
            except Exception:
                self.errors += 1
                if self._metrics is not None:
                    self._metrics.observer_errors.labels(self.name).inc()
                now = time.monotonic()
                if now - self._last_error_log >= _LOG_EVERY_S:
                    self._last_error_log = now
                    log.exception("observer %s: %s failed (%d errors so far; traffic is not "
                                  "affected)", self.name, method, self.errors)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        try:
            self.queue.put(_STOP, timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Full:
            log.error("observer %s did not drain its queue on shutdown; %d events lost",
                      self.name, self.queue.qsize())
        self._thread.join(max(deadline - time.monotonic(), 0.01))
        if self._thread.is_alive():
            log.error("observer %s is still busy after %.0f s; closing it anyway",
                      self.name, timeout)
        close = getattr(self.observer, "close", None)
        if close is not None:
            try:
                close()
            except Exception:
                log.exception("observer %s: close() failed", self.name)


class ObserverHub:
    """Fans events out to the configured observers."""

    def __init__(
        self,
        observers: Sequence[tuple[str, Any]] = (),
        *,
        metrics: Metrics | None = None,
        queue_size: int = 100_000,
    ) -> None:
        self.metrics = metrics
        self._workers = [_Worker(name, obs, queue_size, metrics) for name, obs in observers]
        self._request_workers = [w for w in self._workers if w.wants_requests]
        self._response_workers = [w for w in self._workers if w.wants_responses]
        self.active = bool(self._workers)
        """Some observer wants events (the proxy builds them only then)."""
        self.wants_requests = bool(self._request_workers)
        self.wants_responses = bool(self._response_workers)

    @property
    def workers(self) -> list[_Worker]:
        """The observers' workers (for stats)."""
        return list(self._workers)

    def request(self, info: RequestInfo) -> None:
        """Queue a request event."""
        for worker in self._request_workers:
            worker.submit("on_request", info)

    def response(self, info: ResponseInfo) -> None:
        """Queue a response event."""
        for worker in self._response_workers:
            worker.submit("on_response", info)

    def close(self, timeout: float = 30.0) -> None:
        """Drain every queue, then close each observer (blocking; call from a thread)."""
        for worker in self._workers:
            worker.close(timeout)
