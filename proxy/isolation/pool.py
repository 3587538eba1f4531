"""Plugin isolation: the interceptor runs in a pool of worker processes.

``interceptor.isolation: process`` (flag ``--interceptor-isolation process``)
moves the plugin out of the proxy's process into ``interceptor.workers``
(default 2) worker processes (per proxy process, when ``workers`` runs
several). A plugin that loops forever, segfaults or calls ``os._exit``
then costs one batch and one worker, never the proxy:

* **Deadline.** A worker still busy when the batch's deadline
  (``interceptor.timeout_ms``) passes is killed with SIGKILL; the batch is
  rejected with REQUEST_TIMED_OUT (7, retriable) and a replacement worker is
  started in the background.
* **Crash.** A worker that dies while handling a batch (segfault, ``os._exit``,
  ``sys.exit``, the OOM killer) rejects that batch with INVALID_RECORD (87), a
  ``crashed`` plugin fault (:class:`WorkerCrashed`); the message names the plugin, the
  worker's pid and its exit code (a negative code is the signal, e.g. ``-11
  (SIGSEGV)``). It is replaced too. A worker
  found dead while idle is replaced without failing anything.
* **Exceptions**, ``RejectBatch`` and other plugin faults behave exactly as inline: a
  ``RejectBatch`` keeps its error code, message and record errors; any other
  exception is re-raised in the proxy as an exception of the same class *name*
  (a subclass of :class:`PluginRaised`) with the worker's traceback attached as
  its ``__cause__``, so the pipeline rejects with the same INVALID_RECORD
  message as in inline mode and logs the plugin's own traceback. A wrong return
  type or a broken record-count rule, judged in the worker, reaches the
  pipeline as :class:`~kiproxy.interceptors.verdict.Judged` carrying the same
  rejection inline mode gives.
* **Concurrency.** Each batch checks out one idle worker for itself, so
  batches from different connections run in different workers, and a wedged
  worker stalls only the batch it holds. When every worker is busy, a batch
  waits for one until its own deadline, then is rejected with
  REQUEST_TIMED_OUT (nothing is killed for that: the busy workers belong to
  other batches with deadlines of their own).

Start-up: every worker imports and configures the plugin itself with
:func:`kiproxy.interceptors.loader.load_interceptor` (plugins never need to be
picklable, and no plugin code runs in the proxy's process). :meth:`start`
launches all workers and waits until each reports that it loaded the plugin, so
a plugin that cannot be imported or configured stops the proxy at start with
the loader's own :class:`~kiproxy.interceptors.loader.PluginLoadError` message. A
replacement that fails to load later is logged and retried with backoff
(1 s doubling to 30 s) while the remaining workers carry the traffic.

Processes: the ``forkserver`` start method (``spawn`` where it is missing),
never ``fork``: the proxy has threads and a running event loop, which a forked
child would inherit in an undefined state. The fork server is a fresh
interpreter started once; replacements are forked from it, which takes
milliseconds plus the plugin's own import and ``configure()``. As always with
``spawn``/``forkserver``, multiprocessing re-runs the proxy's main module in
each child (``python -m kiproxy`` and the ``kiproxy`` script are import-safe);
the fork server preloads it, or the modules of its package, so that this is
cheap. A plugin that does not report ready within ``start_timeout`` (60 s)
fails like one that cannot load. Workers are
daemonic (so a plugin cannot start ``multiprocessing`` children of its own),
ignore SIGINT (a terminal's Ctrl-C reaches the whole process group; the proxy
decides when workers stop) and, on Linux, ask the kernel to SIGKILL them when
their parent (the fork server, which exits with the proxy) goes away, so a
spinning worker never outlives a killed proxy.

Transport: one ``socket.socketpair()`` per worker (what
``multiprocessing.Pipe()`` is on Unix) carrying length-prefixed pickles (an
8-byte big-endian length, then a protocol-5 pickle). The proxy's end is an
asyncio stream, so sending a large batch and waiting for the answer never
block the event loop, need no thread per call, and a deadline is a plain
``asyncio.wait``. Each call runs as a task of its own that is never cancelled
half-way through a message: if the pipeline gives up on the batch (its own
``asyncio.wait_for`` or a closing connection), the worker is settled in the
background - returned to the pool if it answers before the batch's deadline,
killed and replaced otherwise - so a worker is never left running unaccounted
and the stream never goes out of step. Threads are used only to start
workers. The proxy decodes answers with an unpickler that refuses every
class, so only plain values (tuples, bytes, str, int, None) cross back and
no plugin object can bring plugin code into the proxy.

The messages between the proxy and a worker are described in
:mod:`kiproxy.proxy.isolation.wire`; the worker process side is
:mod:`kiproxy.proxy.isolation.worker`. Each worker judges its batch with
:func:`kiproxy.interceptors.verdict.judge_sync` (the deadline left to the pool),
so a verdict reads the same as inline.

What differs from inline mode:

* ``on_acknowledgement`` is not called in process mode (each worker holds its
  own plugin instance, and none of them saw the other workers' batches); the
  proxy logs a warning at start when the plugin defines it.
* Plugin state is per worker: N workers are N independent instances, each
  ``configure()``-d with the same config and ``close()``-d when the proxy
  stops (its socket closes; a worker that does not exit within 5 s is killed).
* Every batch is copied to the worker and back, so a cheap plugin is several
  times slower than inline (see bench/RESULTS.md); isolation is for plugins
  that cannot be trusted to return.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import threading
import time
from collections import deque
from collections.abc import Coroutine, Mapping
from functools import cache
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from kiproxy.interceptors.api import InterceptContext, RecordBatch, RejectBatch
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    Judged,
    OutputLimits,
    PluginFault,
    Rejected,
)
from kiproxy.proxy.isolation.process import (
    WorkerGone,
    WorkerProcess,
    process_context,
    retrieve,
)
from kiproxy.proxy.isolation.wire import (
    describe_exit,
    encode_request,
    plain_loads,
    records_in,
    recv_message,
)
from kiproxy.proxy.isolation.worker import worker_main

log = logging.getLogger("kiproxy.isolation")

__all__ = ["IsolatedInterceptor", "PluginRaised", "WorkerCrashed", "describe_exit"]

_STOP_GRACE = 5.0
"""Seconds a worker gets to run the plugin's ``close()`` and exit before it is killed."""
_MAX_BACKOFF = 30.0


class WorkerCrashed(PluginFault):
    """The worker process handling a batch died; the batch is rejected (INVALID_RECORD).

    A :class:`~kiproxy.interceptors.verdict.PluginFault` whose ``fault`` is ``crashed``, as a
    Wasm trap is: counted as ``kiproxy_interceptor_errors_total{reason="crashed"}``, not as
    an exception the plugin raised (``crashed`` is the default ``fault``).
    """


class PluginRaised(Exception):
    """An exception the plugin raised in a worker process.

    The proxy re-raises it as a subclass named after the plugin's exception
    class (``ValueError``, ``KeyError``, ...) so messages read as in inline
    mode; the worker's traceback is the ``__cause__``.
    """


class _RemoteTraceback(Exception):
    """Carries the worker's formatted traceback (shown as the cause)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return "\n\n" + self.text


@cache
def _raised_type(name: str) -> type[PluginRaised]:
    """A :class:`PluginRaised` subclass called ``name`` (one class per name)."""
    safe = name if name.isidentifier() else "PluginError"
    return type(safe, (PluginRaised,), {"__module__": __name__})


class IsolatedInterceptor:
    """The configured interceptor, run in a pool of worker processes.

    The produce pipeline uses it like a plugin with an ``async def intercept``;
    see the module docstring for the deadline, crash and concurrency rules.
    Call :meth:`start` (blocking) before use and ``await close()`` at the end.
    The pool belongs to the event loop that first uses it.
    """

    def __init__(
        self,
        spec: str,
        plugins_dir: str | Path | None = None,
        config: Mapping[str, Any] | None = None,
        *,
        workers: int = 2,
        start_timeout: float = 60.0,
        log_setup: tuple[str, str] | None = None,
        limits: OutputLimits = DEFAULT_OUTPUT_LIMITS,
    ) -> None:
        if workers < 1:
            raise ValueError("interceptor.workers must be at least 1")
        self.spec = spec
        self.plugins_dir = None if plugins_dir is None else str(plugins_dir)
        self.config = dict(config or {})
        self.size = workers
        self.start_timeout = start_timeout
        self.log_setup = log_setup
        self.limits = limits
        """The output bound the workers judge by (the proxy's ``max_plugin_output_*``)."""
        self.restarts = 0
        """Workers killed or found dead and replaced since start."""
        self._workers: set[WorkerProcess] = set()
        self._idle: list[WorkerProcess] = []
        self._waiters: deque[asyncio.Future[WorkerProcess]] = deque()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._closing: asyncio.Event | None = None
        self._launch_lock = threading.Lock()
        self._serial = 0
        self._warned_ack_hook = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (idle or busy)."""
        return sorted(w.pid for w in self._workers)

    # ------------------------------------------------------------ starting workers

    def _launch(self) -> tuple[BaseProcess, socket.socket]:
        ours, theirs = socket.socketpair()
        with self._launch_lock:
            self._serial += 1
            process = process_context().Process(
                target=worker_main, name=f"kiproxy-interceptor-{self._serial}", daemon=True,
                args=(theirs, self.spec, self.plugins_dir, self.config, self.log_setup,
                      self.limits))
            try:
                process.start()
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
        return process, ours

    def _handshake(self, process: BaseProcess, sock: socket.socket) -> WorkerProcess:
        """Wait (blocking) until the worker loaded the plugin; PluginLoadError otherwise."""
        try:
            sock.settimeout(self.start_timeout)
            reply = recv_message(sock, plain_loads)
            sock.settimeout(None)
        except TimeoutError:
            sock.close()
            process.kill()
            process.join(_STOP_GRACE)
            raise PluginLoadError(
                f"interceptor {self.spec}: the worker process (pid {process.pid}) did not "
                f"finish loading it within {self.start_timeout:.0f} s") from None
        except (EOFError, OSError, pickle.UnpicklingError):
            sock.close()
            process.join(_STOP_GRACE)
            raise PluginLoadError(
                f"interceptor {self.spec}: the worker process (pid {process.pid}) died with "
                f"{describe_exit(process.exitcode)} while loading it") from None
        if reply[0] != "ready":
            sock.close()
            process.join(_STOP_GRACE)
            raise PluginLoadError(str(reply[1]))
        _, pid, has_ack_hook = reply
        if has_ack_hook and not self._warned_ack_hook:
            self._warned_ack_hook = True
            log.warning("interceptor %s defines on_acknowledgement, which is not called with "
                        "interceptor.isolation: process", self.spec)
        return WorkerProcess(process, sock, int(pid))

    def _spawn(self) -> WorkerProcess:
        return self._handshake(*self._launch())

    def start(self) -> None:
        """Start every worker and wait until each has loaded and configured the plugin.

        Blocking (it runs before the proxy serves). Raises :class:`PluginLoadError`
        with the loader's message when the plugin cannot be loaded.
        """
        launched = [self._launch() for _ in range(self.size)]
        try:
            for process, sock in launched:
                worker = self._handshake(process, sock)
                self._workers.add(worker)
                self._idle.append(worker)
        except BaseException:
            for process, sock in launched:
                sock.close()
                if process.exitcode is None:
                    process.kill()
                process.join(_STOP_GRACE)
            self._workers.clear()
            self._idle.clear()
            raise

    # ------------------------------------------------------------ checking out workers

    def _release(self, worker: WorkerProcess) -> None:
        """Hand an idle worker to the oldest waiting batch, or park it."""
        if worker.retired:
            return
        if self._closed:
            self._retire(worker, None)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    async def _checkout(self, deadline: float, where: str) -> WorkerProcess:
        """An idle, live worker for this batch; waits for one until ``deadline``."""
        loop = asyncio.get_running_loop()
        while True:
            while self._idle:
                worker = self._idle.pop()
                if worker.exitcode is not None or worker.peer_closed():
                    self._retire(worker, "while idle")
                    continue
                try:
                    await worker.connect()
                except BaseException:
                    self._idle.append(worker)
                    raise
                return worker
            if self._closed:
                raise RuntimeError(f"interceptor {self.spec}: the worker pool is closed")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no interceptor worker was free for {where}")
            waiter: asyncio.Future[WorkerProcess] = loop.create_future()
            self._waiters.append(waiter)
            try:
                async with asyncio.timeout(remaining):
                    worker = await waiter
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._release(waiter.result())  # handed over just as this batch gave up
                waiter.cancel()
                if isinstance(exc, TimeoutError):
                    log.warning("interceptor %s: all %d workers stayed busy until the deadline "
                                "of %s", self.spec, self.size, where)
                raise
            self._idle.append(worker)  # checked (alive, connected) by the next round

    # ------------------------------------------------------------ retiring workers

    def _background(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _retire(self, worker: WorkerProcess, where: str | None, *, kill: bool = False) -> None:
        """Take ``worker`` out of the pool at once and replace it in the background.

        ``kill``: it is still busy at the deadline of ``where``; otherwise it died
        (on ``where``). ``where`` None: the pool is closing, nothing is replaced.
        """
        if worker.retired:
            return
        worker.retired = True
        self._workers.discard(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        if kill:
            worker.kill()
        worker.close_socket()
        if where is None or self._closed:
            self._background(self._reap(worker))
            return
        self.restarts += 1
        self._background(self._replace(worker, where, killed=kill))

    async def _exit_code(self, worker: WorkerProcess, wait: float) -> int | None:
        """The worker's exit code, polling (without blocking the loop) for up to ``wait`` s."""
        until = time.monotonic() + wait
        while worker.exitcode is None and time.monotonic() < until:
            await asyncio.sleep(0.01)
        return worker.exitcode

    async def _reap(self, worker: WorkerProcess) -> int | None:
        """Wait for a retired worker to exit (kill it after the grace); free its handles."""
        code = await self._exit_code(worker, _STOP_GRACE)
        if code is None:
            log.warning("interceptor %s: worker pid %d did not exit within %.0f s; killing it",
                        self.spec, worker.pid, _STOP_GRACE)
            worker.kill()
            code = await self._exit_code(worker, _STOP_GRACE)
        worker.free_process()  # (a process still running after SIGKILL is left be)
        return code

    async def _replace(self, old: WorkerProcess, where: str, *, killed: bool) -> None:
        code = await self._reap(old)
        if killed:
            log.warning("interceptor %s: killed worker pid %d, still busy at the deadline of "
                        "%s; starting a replacement", self.spec, old.pid, where)
        else:
            log.warning("interceptor %s: worker pid %d died with %s %s; starting a replacement",
                        self.spec, old.pid, describe_exit(code),
                        where if where.startswith("while") else f"on {where}")
        backoff = 0.0
        while not self._closed:
            try:
                worker = await asyncio.to_thread(self._spawn)
            except PluginLoadError as exc:
                backoff = min(max(2 * backoff, 1.0), _MAX_BACKOFF)
                log.error("interceptor %s: a replacement worker failed to start: %s; "
                          "retrying in %.0f s", self.spec, exc, backoff)
                if self._closing is None:
                    self._closing = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), backoff)
                continue
            if self._closed:
                worker.close_socket()
                await self._reap(worker)
                return
            await worker.connect()
            self._workers.add(worker)
            log.info("interceptor %s: worker pid %d started, replacing pid %d",
                     self.spec, worker.pid, old.pid)
            self._release(worker)
            return

    async def _settle(self, worker: WorkerProcess, call: asyncio.Task[Any], deadline: float,
                      where: str) -> None:
        """After the caller gave up: keep the worker if it answers by ``deadline``."""
        done, _ = await asyncio.wait((call,), timeout=max(deadline - time.monotonic(), 0))
        if not done:
            call.cancel()
            self._retire(worker, where, kill=True)
        elif isinstance(call.exception(), WorkerGone):
            self._retire(worker, where)
        else:
            self._release(worker)

    # ------------------------------------------------------------ the interceptor API

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Run the plugin's ``intercept`` on ``batch`` in a worker, by ``ctx.deadline``.

        Returns ``batch`` itself when the plugin left the records unchanged.
        Raises ``RejectBatch`` as the plugin did, :class:`PluginRaised` for any
        other exception, :class:`~kiproxy.interceptors.verdict.Judged` for a wrong
        return type or a broken record-count rule (judged in the worker),
        ``TimeoutError`` at the deadline (the worker is killed and replaced) and
        :class:`WorkerCrashed` if the worker died.
        """
        where = f"{batch.topic}[{batch.partition}]"
        if ctx.deadline <= time.monotonic():  # late already: do not kill a worker over it
            raise TimeoutError(f"the deadline of {where} passed before it reached a worker")
        frame = encode_request(batch, ctx)
        worker = await self._checkout(ctx.deadline, where)
        # A task of its own, never cancelled half-way through a message (see _settle).
        call = asyncio.get_running_loop().create_task(worker.call(frame))
        call.add_done_callback(retrieve)
        try:
            done, _ = await asyncio.wait(
                (call,), timeout=max(ctx.deadline - time.monotonic(), 0))
        except asyncio.CancelledError:
            self._background(self._settle(worker, call, ctx.deadline, where))
            raise
        if not done:
            call.cancel()
            self._retire(worker, where, kill=True)
            raise TimeoutError(f"interceptor {self.spec} did not answer by the deadline")
        error = call.exception()
        if isinstance(error, WorkerGone):
            self._retire(worker, where)
            code = await self._exit_code(worker, 2.0)
            raise WorkerCrashed(
                f"the worker process running {self.spec} (pid {worker.pid}) died with "
                f"{describe_exit(code)} while handling this batch; it is being replaced")
        self._release(worker)
        if error is not None:  # an answer that is not plain values; the worker is fine
            raise PluginRaised(f"{type(error).__name__}: {error}")
        return self._result(batch, call.result())

    def _result(self, batch: RecordBatch, answer: Any) -> RecordBatch:
        kind = answer[0]
        if kind == "same":
            return batch
        if kind == "records":
            return batch.with_records(records_in(answer[1]))
        if kind == "reject":
            _, message, code, record_errors = answer
            raise RejectBatch(message, error=code, record_errors=record_errors)
        if kind == "fault":
            _, fault, code, message = answer
            raise Judged(Rejected(code=code, message=message, fault=fault))
        _, name, message, remote_traceback = answer
        exc = _raised_type(name)(message)
        if remote_traceback:
            raise exc from _RemoteTraceback(remote_traceback)
        raise exc

    def stop_now(self) -> None:
        """Kill every worker at once, without an event loop (a pool started but never
        used, e.g. when a later chain link of the same configuration failed to load)."""
        self._closed = True
        for worker in list(self._workers):
            worker.retired = True
            worker.kill()
            worker.close_socket()
            worker.process.join(_STOP_GRACE)
            worker.free_process()
        self._workers.clear()
        self._idle.clear()

    async def close(self) -> None:
        """Stop every worker: each closes its plugin and exits, or is killed after 5 s."""
        if self._closed:
            return
        self._closed = True
        if self._closing is not None:
            self._closing.set()
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(
                    RuntimeError(f"interceptor {self.spec}: the worker pool is closed"))
        self._waiters.clear()
        for worker in list(self._workers):
            # Idle workers read EOF, close the plugin and exit; busy ones are killed.
            self._retire(worker, None, kill=worker not in self._idle)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=self.start_timeout + 2 * _STOP_GRACE)

