"""The worker process side of plugin isolation: load the plugin, answer batches until EOF.

:func:`worker_main` is the entry point of every worker (started by
:class:`kiproxy.proxy.isolation.pool.IsolatedInterceptor`). It ignores SIGINT, asks
the kernel to SIGKILL it when its parent goes away, loads and configures the
plugin with :func:`kiproxy.interceptors.loader.load_interceptor`, reports
``("ready", pid, has_on_acknowledgement)`` or ``("load_error", message)``, and
then answers one request at a time with the verdict of
:func:`kiproxy.interceptors.verdict.judge_sync` in plain values (see
:mod:`kiproxy.proxy.isolation.wire`). The deadline is the pool's to enforce
(it kills a worker still busy at it), so the worker sets none. At EOF it runs
the plugin's ``close()`` and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import os
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Mapping
from typing import Any

from kiproxy.interceptors.loader import PluginLoadError, load_interceptor
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    Rejected,
    Unchanged,
    acknowledgement_hook,
    judge_sync,
)
from kiproxy.proxy.isolation.process import drop_safe_path
from kiproxy.proxy.isolation.wire import (
    decode_request,
    frame,
    records_out,
    recv_message,
    send_message,
)

__all__ = ["worker_main"]

def _die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when its parent exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: orphans are then only EOF-driven
        pass


def _drop_fork_server_pipe() -> None:
    """Close this worker's copy of the fork server's keep-alive pipe.

    multiprocessing gives every forked child the write end of the pipe whose EOF
    tells the fork server that the proxy is gone. A worker holding it would keep
    the fork server - and so itself (see ``_die_with_parent``) - alive after the
    proxy died. Workers start no processes, so they do not need it.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if isinstance(fd, int):
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]


def _plain_str(value: Any) -> str:
    try:
        return str(value)
    except Exception:
        return f"<{type(value).__name__} whose str() failed>"


def _answer(plugin: Any, name: str, message: Any,
            loop: list[asyncio.AbstractEventLoop], limits: OutputLimits) -> Any:
    """The verdict of ``intercept`` on one request, in plain values."""

    def run(awaitable: Awaitable[Any], timeout: float | None) -> Any:
        if not loop:
            loop.append(asyncio.new_event_loop())
        return loop[0].run_until_complete(_await(awaitable))

    try:
        batch, ctx = decode_request(message)
    except Exception as exc:  # a request this worker cannot read: answer, do not die
        return ("raised", type(exc).__name__, _plain_str(exc), traceback.format_exc())
    verdict = judge_sync(plugin, batch, ctx, name=name, timeout=None, run=run, limits=limits)
    if isinstance(verdict, Unchanged):
        return ("same",)
    if not isinstance(verdict, Rejected):
        try:
            return ("records", records_out(tuple(verdict.batch.records)))
        except Exception as exc:  # records the codec cannot write: as the proxy would
            return ("raised", type(exc).__name__, _plain_str(exc), traceback.format_exc())
    if verdict.fault is None:
        return ("reject", _plain_str(verdict.message), int(verdict.code), tuple(
            (int(i), None if m is None else _plain_str(m)) for i, m in verdict.record_errors))
    raised = verdict.exception
    if verdict.fault == "raised" and raised is not None:
        return ("raised", type(raised).__name__, _plain_str(raised),
                "".join(traceback.format_exception(raised)))
    return ("fault", verdict.fault, int(verdict.code), _plain_str(verdict.message))


async def _await(awaitable: Awaitable[Any]) -> Any:
    return await awaitable


def _close_plugin(plugin: Any, loop: list[asyncio.AbstractEventLoop]) -> None:
    close = getattr(plugin, "close", None)
    if close is None:
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            if not loop:
                loop.append(asyncio.new_event_loop())
            loop[0].run_until_complete(_await(result))
    except Exception:
        logging.getLogger("kiproxy.isolation.worker").exception(
            "interceptor close() failed in worker pid %d", os.getpid())


def worker_main(sock: socket.socket, spec: str, plugins_dir: str | None,
                 config: Mapping[str, Any], log_setup: tuple[str, str] | None,
                 limits: OutputLimits = DEFAULT_OUTPUT_LIMITS) -> None:
    """Entry point of a worker process: load the plugin, then answer requests until EOF
    (judged with ``limits``, so an oversized answer is refused before it is sent)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    drop_safe_path()
    _drop_fork_server_pipe()
    _die_with_parent()
    if log_setup is not None:
        from kiproxy.proxy.observe.logs import setup_logging

        setup_logging(*log_setup)
    try:
        plugin = load_interceptor(spec, plugins_dir, config)
    except PluginLoadError as exc:
        send_message(sock, ("load_error", str(exc)))
        return
    except Exception as exc:
        send_message(sock, ("load_error", f"loading {spec} failed: {type(exc).__name__}: {exc}"))
        return
    has_ack_hook = acknowledgement_hook(plugin) is not None
    send_message(sock, ("ready", os.getpid(), has_ack_hook))
    loop: list[asyncio.AbstractEventLoop] = []
    while True:
        try:
            message = recv_message(sock)
        except (EOFError, OSError):
            break
        reply = _answer(plugin, spec, message, loop, limits)
        try:
            data = frame(reply)
        except Exception as exc:  # e.g. a RejectBatch message that does not pickle
            data = frame(("raised", type(exc).__name__, _plain_str(exc), ""))
        try:
            sock.sendall(data)
        except OSError:  # the proxy closed its end
            break
    _close_plugin(plugin, loop)

