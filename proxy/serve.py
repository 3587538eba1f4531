"""Serving one configuration in this process until a signal: the event loop, the
signal handlers, the ready lines.

:func:`serve` runs the :class:`~kiproxy.proxy.server.ProxyServer` until SIGINT or
SIGTERM (SIGHUP reloads); :func:`run_loop` runs a coroutine on uvloop (asyncio
where uvloop is missing) after tuning the allocator; :func:`serve_until_stopped`
is both, announcing the bootstrap address as ``kiproxy run`` prints it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from functools import partial
from typing import Any

from kiproxy.proxy.config.model import ProxyConfig, load_config
from kiproxy.proxy.malloc import keep_freed_memory
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.server import ProxyServer

log = logging.getLogger("kiproxy")

__all__ = ["print_ready", "run_loop", "serve", "serve_until_stopped"]


async def serve(config: ProxyConfig, on_ready: Any = None, *,
                load: Callable[[], ProxyConfig] | None = None,
                config_file: str | None = None,
                siblings: tuple[tuple[str, int], ...] = ()) -> None:
    """Run the proxy until SIGINT/SIGTERM, then shut down gracefully; SIGHUP reloads
    (``load`` reads the configuration again)."""
    metrics = Metrics() if config.metrics_listen is not None else None
    server = ProxyServer(config, metrics=metrics, load=load, siblings=siblings,
                         config_file=config_file)  # builds generation 1, or raises
    # Signal handlers go in before the server announces itself, so a supervisor
    # that stops the proxy right after reading the bootstrap line gets a clean
    # shutdown rather than a KeyboardInterrupt traceback.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[Any]] = set()

    def on_sighup() -> None:
        task = loop.create_task(server.reload("signal"))
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    with contextlib.suppress(NotImplementedError):
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await stop.wait()
    log.info("shutting down: letting in-flight requests finish (grace %d ms)",
             config.shutdown_grace_ms)
    await server.stop()


def run_loop(coro: Any) -> None:
    """Run ``coro`` to its end on uvloop (asyncio without it), the allocator tuned."""
    keep_freed_memory()
    # Only the import is guarded: an ImportError the coroutine raises (a plugin's missing
    # package) is its own failure, and the coroutine cannot run a second time anyway.
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def serve_until_stopped(config: ProxyConfig, config_file: str | None,
                        overrides: dict[str, Any]) -> None:
    """Serve ``config`` in this process until SIGINT/SIGTERM; a reload reads
    ``config_file`` again with ``overrides`` over it."""
    run_loop(serve(config, on_ready=print_ready,
               load=partial(load_config, config_file, overrides), config_file=config_file))


def print_ready(server: ProxyServer) -> None:
    """Print where the proxy serves (supervisors and tests read the bootstrap line)."""
    if server.metrics_address is not None:
        print(f"kiproxy: metrics on http://{server.metrics_address}/metrics", flush=True)
    problem = server.listener_problem()
    if problem is not None:  # serving, but /readyz answers 503 until it is solved
        print(f"kiproxy: not ready: {problem}", flush=True)
    print(f"kiproxy: bootstrap address {server.bootstrap_address}", flush=True)
