"""Several processes serving the same listeners (``workers`` > 1, SO_REUSEPORT).

:func:`serve_workers` forks ``config.workers`` processes, each serving
:func:`worker_config` (its own metrics port and audit file), forwards
SIGTERM, SIGINT and SIGHUP to them and supervises them until it is told to
stop:

- a worker that ends on its own (a crash, an out-of-memory kill, ``kill -9``)
  is logged at ERROR with its exit code or signal and started again under the
  same index (metrics port and audit file), with the configuration file as it
  reads now - the start-up configuration when it no longer loads or changes a
  restart-only setting, which the running workers refused to take;
- a worker that ends within :data:`CRASH_LOOP_S` of its start is not started
  again: every worker is stopped and the exit code is 1, so that a supervisor
  (systemd, Kubernetes) sees the failure instead of a process restarting in a
  loop;
- after SIGTERM or SIGINT the workers drain and end; the exit code is 1 when
  any ended with an error (a worker still starting ends at once on SIGTERM, which
  is no error then).

Signals are blocked while a worker is forked and registered, so one that arrives
meanwhile reaches it; a forked worker starts with SIGTERM and SIGINT at their
defaults and SIGHUP ignored until its event loop takes them over (it loads the
configuration file as it reads then anyway).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from functools import partial
from typing import Any, NoReturn

from kiproxy.proxy.config.model import ConfigError, ProxyConfig, load_config
from kiproxy.proxy.reload.reloader import config_hash, restart_only_changes
from kiproxy.proxy.serve import print_ready, run_loop, serve

log = logging.getLogger("kiproxy")

__all__ = ["CRASH_LOOP_S", "serve_workers", "worker_config"]

CRASH_LOOP_S = 10.0
"""A worker that ends sooner than this after its start stops the proxy, not restarted."""

_FORWARDED = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})
_STOPPED_BY = frozenset({0, -signal.SIGTERM, -signal.SIGINT})
"""Exit codes of a worker that stopped as asked (``os.waitstatus_to_exitcode``)."""


def worker_config(config: ProxyConfig, index: int) -> ProxyConfig:
    """The settings of worker ``index``: its own metrics port and audit file."""
    update: dict[str, Any] = {}
    if config.metrics_listen is not None:
        host, port = config.metrics_listen_address
        update["metrics_listen"] = f"{host}:{port + index}"
    if config.audit.path is not None:
        update["audit"] = config.audit.model_copy(
            update={"path": f"{config.audit.path}.w{index}"})
    derived = config.model_copy(update=update)
    derived._as_written = config_hash(config)  # set after the copy, which forgets it
    return derived


def _worker_load(config_file: str | None, overrides: dict[str, Any],
                 index: int) -> ProxyConfig:
    return worker_config(load_config(config_file, overrides), index)


def _siblings(config: ProxyConfig, index: int) -> tuple[tuple[str, int], ...]:
    """The metrics endpoints of the other workers (``POST /reload`` reaches them all)."""
    if config.metrics_listen is None:
        return ()
    host, port = config.metrics_listen_address
    return tuple((host, port + j) for j in range(config.workers) if j != index)


def _work(config: ProxyConfig, index: int, config_file: str | None,
          overrides: dict[str, Any], *, announce: bool) -> NoReturn:
    """The worker process: serve until stopped, then end the process."""
    code = 0
    try:
        run_loop(serve(worker_config(config, index),
                       on_ready=print_ready if announce else None,
                       load=partial(_worker_load, config_file, overrides, index),
                       config_file=config_file, siblings=_siblings(config, index)))
    except BaseException:
        log.exception("worker %d failed", index)
        code = 1
    finally:
        logging.shutdown()
        os._exit(code)


def _ended(status: int) -> str:
    code = os.waitstatus_to_exitcode(status)
    if code >= 0:
        return f"exit code {code}"
    with contextlib.suppress(ValueError):
        return f"signal {signal.Signals(-code).name}"
    return f"signal {-code}"


def serve_workers(config: ProxyConfig, config_file: str | None,
                   overrides: dict[str, Any]) -> int:
    """Fork ``config.workers`` processes serving the same listeners; supervise them (see
    the module docstring) until told to stop."""
    if config.listen_address[1] == 0:
        raise ConfigError("workers: several workers need a fixed listen port, not 0")
    if config.broker_port_start is None and not config.node_ports:
        log.info("workers: node listeners on listen port + 1 + node id")
    children: dict[int, tuple[int, float]] = {}  # pid -> (index, started)
    stopping = False

    def start(index: int, current: ProxyConfig, *, announce: bool = False) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
        try:
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                signal.signal(signal.SIGHUP, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
                _work(current, index, config_file, overrides, announce=announce)
            children[pid] = (index, time.monotonic())
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = stopping or sig != signal.SIGHUP
        for child in list(children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)  # every worker reloads
    for index in range(config.workers):
        if stopping:  # told to stop while the first workers started
            break
        start(index, config, announce=index == 0)
    failed = 0
    while children:
        pid, status = os.wait()
        if pid not in children:
            continue
        index, started = children.pop(pid)
        if stopping:
            failed += os.waitstatus_to_exitcode(status) not in _STOPPED_BY
            continue
        ran = time.monotonic() - started
        if ran < CRASH_LOOP_S:
            log.error("worker %d (pid %d) ended (%s) %.1f s after it started: stopping "
                      "every worker", index, pid, _ended(status), ran)
            failed += 1
            forward(signal.SIGTERM, None)
            continue
        log.error("worker %d (pid %d) ended (%s): starting it again", index, pid,
                  _ended(status))
        current = _current(config, config_file, overrides)
        if stopping:  # told to stop while the file was read
            continue
        try:
            start(index, current)
        except OSError as exc:  # fork refused (memory, process limits)
            log.error("worker %d cannot be started again (%s): stopping every worker",
                      index, exc)
            failed += 1
            forward(signal.SIGTERM, None)
    if failed:
        log.error("%d of %d workers exited with an error", failed, config.workers)
    return 1 if failed else 0


def _current(config: ProxyConfig, config_file: str | None,
             overrides: dict[str, Any]) -> ProxyConfig:
    """The configuration a restarted worker serves: the file as it reads now, else
    ``config`` (the one the proxy started with)."""
    if config_file is None:
        return config
    try:
        current = load_config(config_file, overrides)
    except ConfigError as exc:
        log.warning("the configuration file does not load (%s): the restarted worker "
                    "serves the one the proxy started with", exc)
        return config
    if changed := restart_only_changes(config, current):
        log.warning("the configuration file changes %s, which needs a restart: the "
                    "restarted worker serves the one the proxy started with",
                    ", ".join(changed))
        return config
    return current
