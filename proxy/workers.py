"""Several processes serving the same listeners (``workers`` > 1, SO_REUSEPORT).

:func:`serve_workers` forks ``config.workers`` processes, each serving
:func:`worker_config` (its own metrics port and audit file), forwards
SIGTERM, SIGINT and SIGHUP to them and waits; the exit code is 1 when any
worker failed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from functools import partial
from typing import Any

from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.serve import print_ready, run_loop, serve

log = logging.getLogger("kiproxy")

__all__ = ["serve_workers", "worker_config"]


def worker_config(config: ProxyConfig, index: int) -> ProxyConfig:
    """The settings of worker ``index``: its own metrics port and audit file."""
    update: dict[str, Any] = {}
    if config.metrics_listen is not None:
        host, port = config.metrics_listen_address
        update["metrics_listen"] = f"{host}:{port + index}"
    if config.audit.path is not None:
        update["audit"] = config.audit.model_copy(
            update={"path": f"{config.audit.path}.w{index}"})
    return config.model_copy(update=update)


def _worker_load(config_file: str | None, overrides: dict[str, Any],
                 index: int) -> ProxyConfig:
    return worker_config(load_config(config_file, overrides), index)


def _siblings(config: ProxyConfig, index: int) -> tuple[tuple[str, int], ...]:
    """The metrics endpoints of the other workers (``POST /reload`` reaches them all)."""
    if config.metrics_listen is None:
        return ()
    host, port = config.metrics_listen_address
    return tuple((host, port + j) for j in range(config.workers) if j != index)


def serve_workers(config: ProxyConfig, config_file: str | None,
                   overrides: dict[str, Any]) -> int:
    """Fork ``config.workers`` processes serving the same listeners; wait for them."""
    if config.listen_address[1] == 0:
        raise ConfigError("workers: several workers need a fixed listen port, not 0")
    if config.broker_port_start is None and not config.node_ports:
        log.info("workers: node listeners on listen port + 1 + node id")
    children: list[int] = []
    for index in range(config.workers):
        pid = os.fork()
        if pid == 0:  # the worker
            code = 0
            try:
                run_loop(serve(worker_config(config, index),
                           on_ready=print_ready if index == 0 else None,
                           load=partial(_worker_load, config_file, overrides, index),
                           config_file=config_file, siblings=_siblings(config, index)))
            except BaseException:
                log.exception("worker %d failed", index)
                code = 1
            finally:
                logging.shutdown()
                os._exit(code)
        children.append(pid)

    def forward(sig: int, _frame: object) -> None:
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)  # every worker reloads
    failed = 0
    for child in children:
        _, status = os.waitpid(child, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
    if failed:
        log.error("%d of %d workers exited with an error", failed, len(children))
    return 1 if failed else 0
