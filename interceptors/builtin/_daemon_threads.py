"""An executor of daemon threads, for built-ins' calls that wait on the network.

Contract: :class:`DaemonThreads` is a :class:`concurrent.futures.Executor` (what
``loop.run_in_executor`` takes) running at most ``max_workers`` calls at once, each on a
daemon thread started when a call finds no idle one. ``shutdown(wait=False)`` returns at
once and, unlike the standard library's thread pool, leaves nothing for the interpreter
to wait for at exit: a call stuck on a KMS or a registry that stopped answering (until
its own socket timeout, which may be minutes) does not hold a stopping proxy's process
open after it said it stopped. A call still running then is abandoned with its thread.

Why not ``ThreadPoolExecutor``: its threads are joined at interpreter exit, whatever
``shutdown`` was told, and it offers no daemon threads.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["DaemonThreads"]

_T = TypeVar("_T")

_Work = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...],
              dict[str, Any]]


class DaemonThreads(concurrent.futures.Executor):
    """At most ``max_workers`` calls at once on daemon threads named ``name``_N (as the
    standard library's pool names its threads)."""

    def __init__(self, max_workers: int, name: str) -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max = max_workers
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closed = False
        # Dropped without shutdown(): its idle threads end (they hold the queue, not this).
        weakref.finalize(self, _stop, self._work, self._threads)

    def submit(self, fn: Callable[..., _T], /, *args: Any,
               **kwargs: Any) -> concurrent.futures.Future[_T]:
        """Run ``fn(*args, **kwargs)`` on a thread of the pool; its future."""
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future[_T] = concurrent.futures.Future()
            self._work.put((future, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                thread = threading.Thread(target=_run, args=(self._work, self._idle),
                                          daemon=True,
                                          name=f"{self._name}_{len(self._threads)}")
                thread.start()
                self._threads.append(thread)
            return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; ``cancel_futures`` cancels those not started; ``wait`` waits for
        the running ones (else they are left to their daemon threads)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()


def _run(work: queue.SimpleQueue[_Work | None], idle: threading.Semaphore) -> None:
    """One thread of the pool: calls until told to stop (None)."""
    while True:
        item = work.get()
        if item is None:
            return
        future, fn, args, kwargs = item
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # the caller's to see, as with any executor
                future.set_exception(exc)
        del item, future  # nothing of the call kept alive while the thread waits
        idle.release()


def _stop(work: queue.SimpleQueue[_Work | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        work.put(None)
