"""The proxy's handle on one interceptor worker process, and how workers are started.

:class:`WorkerProcess` owns one worker's process and the proxy's end of its
socket: it attaches the socket to the event loop, sends one framed request and
reads the answer (raising :class:`WorkerGone` when the socket closes under
it), and kills or closes the worker. :func:`process_context` is the
multiprocessing context workers start in: ``forkserver`` (``spawn`` where it
is missing), never ``fork``, with the modules of :func:`preload` imported once
by the fork server. The pool that checks workers out and replaces them is
:class:`kiproxy.proxy.isolation.pool.IsolatedInterceptor`.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import socket
import sys
import threading
from functools import cache
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import Any

from kiproxy.proxy.isolation.wire import LENGTH, plain_loads

__all__ = ["WorkerGone", "WorkerProcess", "preload", "process_context", "retrieve"]


class WorkerGone(Exception):
    """The worker's socket closed while a batch was in flight."""


def retrieve(task: asyncio.Task[Any]) -> None:
    """Mark a call's outcome as seen (a killed worker's call may end either way)."""
    if not task.cancelled():
        task.exception()


class WorkerProcess:
    """One worker process and the proxy's end of its socket."""

    def __init__(self, process: BaseProcess, sock: socket.socket, pid: int) -> None:
        self.process = process
        self.sock = sock
        self.pid = pid
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.retired = False
        self._exitcode: int | None = None
        self._process_closed = False

    @property
    def exitcode(self) -> int | None:
        """The process's exit code, None while it runs (kept after its handles are freed)."""
        if self._exitcode is None and not self._process_closed:
            self._exitcode = self.process.exitcode
        return self._exitcode

    def peer_closed(self) -> bool:
        """Whether the worker's end of the socket is closed: it died, even if nobody has
        reaped it yet (the kernel closes a dead process's sockets at once; the exit code
        waits for the fork server, which a loaded machine may schedule late)."""
        if self.reader is not None and self.reader.at_eof():
            return True
        try:
            return self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False  # nothing to read and still open: alive
        except OSError:
            return True

    def free_process(self) -> None:
        """Release the process's handles once it has exited."""
        if not self._process_closed and self.exitcode is not None:
            self._process_closed = True
            self.process.close()

    async def connect(self) -> None:
        """Attach the socket to the running event loop (once)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(
                sock=self.sock, limit=2**20)

    async def call(self, frame: bytes) -> Any:
        """Send one framed request and read the answer (``WorkerGone`` on EOF)."""
        assert self.reader is not None and self.writer is not None
        try:
            self.writer.write(frame)
            await self.writer.drain()
            (size,) = LENGTH.unpack(await self.reader.readexactly(LENGTH.size))
            data = await self.reader.readexactly(size)
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise WorkerGone from exc
        return plain_loads(data)

    def close_socket(self) -> None:
        """Close the proxy's end: an idle worker reads EOF, closes the plugin and exits."""
        if self.writer is not None:
            self.writer.close()
        else:
            self.sock.close()

    def kill(self) -> None:
        """SIGKILL the process if it is still running."""
        if self.exitcode is None:
            with contextlib.suppress(ProcessLookupError, OSError):
                self.process.kill()


def preload() -> list[str]:
    """Modules the fork server imports once, so that forked workers start with them loaded.

    multiprocessing re-runs the parent's main module (as ``__mp_main__``) in every
    child. A script (the ``kiproxy`` console script) is preloaded as ``__main__``,
    which the children then reuse. For ``python -m kiproxy`` the module itself
    must not be preloaded (runpy would warn when re-running it), so the modules of
    its package that the proxy has loaded are, and re-running it costs next to nothing.
    """
    main = sys.modules.get("__main__")
    main_name = getattr(getattr(main, "__spec__", None), "name", None)
    modules = ["kiproxy.proxy.isolation.pool", "kiproxy.proxy.isolation.worker",
               "kiproxy.interceptors", "kiproxy.protocol.records"]
    if main_name is None:
        return ["__main__", *modules]
    if main_name.endswith("__main__"):  # not re-run in children
        return modules
    package = main_name.partition(".")[0]
    return modules + [name for name in list(sys.modules)
                      if name.partition(".")[0] == package and name != main_name
                      and not name.startswith(main_name + ".")]


_starting = threading.Lock()


@cache
def process_context() -> ForkServerContext | SpawnContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(preload())
        with _starting:
            _start_fork_server()
        return ctx
    return multiprocessing.get_context("spawn")


def _start_fork_server() -> None:
    """Start the fork server now, with ``PYTHONSAFEPATH`` set for it and its workers.

    multiprocessing starts it as ``python -c ...``, which puts the working directory
    first on ``sys.path``, and Python 3.11's fork server does not take the proxy's path
    instead: a directory named ``kiproxy`` where the proxy was started (a clone of this
    repository, say) would then be imported as an empty namespace package in every
    worker, before the installed one. With ``PYTHONSAFEPATH`` (Python 3.11+) nothing is
    put first, and workers import what the proxy imports; each worker then removes it
    (:func:`drop_safe_path`). (Should the fork server die, multiprocessing starts another
    without it.)
    """
    from multiprocessing import forkserver

    if os.environ.get("PYTHONSAFEPATH"):  # the operator's own: the fork server has it
        forkserver.ensure_running()
        return
    os.environ["PYTHONSAFEPATH"] = SAFE_PATH_OURS  # its value says whose it is
    try:
        forkserver.ensure_running()
    finally:
        del os.environ["PYTHONSAFEPATH"]


SAFE_PATH_OURS = "kiproxy-fork-server"
"""``PYTHONSAFEPATH`` as the fork server is given it (any non-empty value turns it on):
a worker forked from it removes it from its environment (:func:`drop_safe_path`), so
that processes a plugin starts see the proxy's environment."""


def drop_safe_path() -> None:
    """In a worker: forget the ``PYTHONSAFEPATH`` :func:`_start_fork_server` set."""
    if os.environ.get("PYTHONSAFEPATH") == SAFE_PATH_OURS:
        del os.environ["PYTHONSAFEPATH"]
