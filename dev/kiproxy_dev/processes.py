"""The processes of the local brokers (and of the tests' proxies): how one is stopped,
the registry that always ends the JVMs (an ``atexit`` hook), and the port checks done
before starting one.

Contract: every process a cluster starts is ``register``-ed; ``end_process``
ends its whole group (a signal, SIGTERM unless told, a grace period, then SIGKILL)
and forgets it; a process still registered when Python exits is killed.
``stop_process`` is the same for one process that shares its parent's group (a
Tansu broker, a ``kiproxy run`` under test), returning its exit code. Standard
library only.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["HOST", "bind_problem", "end_process", "ended_with_parent", "free_ports", "port_free",
           "register", "signal_group", "stop_process", "tail"]

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40

_RUNNING: set[subprocess.Popen[bytes]] = set()
_RUNNING_LOCK = threading.Lock()


def _kill_leftovers() -> None:
    # The last line of defence: a JVM outlives neither its cluster object nor this process.
    with _RUNNING_LOCK:
        procs = list(_RUNNING)
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


atexit.register(_kill_leftovers)

_PR_SET_PDEATHSIG = 1


def ended_with_parent() -> None:
    """``preexec_fn`` of a process in a session of its own: it gets SIGTERM when the thread
    that started it ends, so a parent killed with SIGKILL (which runs no ``atexit`` hook
    and whose process group the child left) leaves no JVM behind. Linux only; elsewhere
    it does nothing. Start such a process from a thread that lives as long as it should."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def signal_group(proc: subprocess.Popen[Any], sig: signal.Signals) -> None:
    """Send ``sig`` to the process group of ``proc`` (gone already: nothing)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def end_process(proc: subprocess.Popen[Any], grace: float,
                sig: signal.Signals = signal.SIGTERM) -> None:
    """Send ``sig`` to the process group, wait up to ``grace`` seconds, then SIGKILL it
    (whatever is left in it too, even when the leader has exited)."""
    if proc.poll() is None and grace > 0:
        signal_group(proc, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace)
    signal_group(proc, signal.SIGKILL)  # also reaps anything the JVM left in its group
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with _RUNNING_LOCK:
        _RUNNING.discard(proc)


def stop_process(proc: subprocess.Popen[Any], grace: float = 5.0,
                 sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` to ``proc`` alone (not its group: it may share ours), wait up to
    ``grace`` seconds, then SIGKILL it; its exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(5)


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a log, or a note saying there is none."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log written)"
    return "\n".join(text.splitlines()[-lines:]) or "(empty: the JVM had not logged yet)"


def port_free(port: int, host: str = HOST) -> bool:
    """Whether nothing listens on ``host``:``port`` (127.0.0.1 by default)."""
    return bind_problem(port, host) is None


def bind_problem(port: int, host: str = HOST) -> str | None:
    """Why a server could not listen on ``host``:``port`` now (``Address already in use``,
    an address that is not this host's), or None: bound and let go at once."""
    # SO_REUSEADDR as servers (Java, the proxy) set it: only a listening socket is taken.
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(address)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def free_ports(n: int) -> list[int]:
    """``n`` different free ports on 127.0.0.1."""
    # Hold every socket until all are chosen, so the n ports differ.
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((HOST, 0))
        return [int(s.getsockname()[1]) for s in socks]


def register(proc: subprocess.Popen[bytes]) -> None:
    """Remember a started process, so that it is ended at the latest when Python exits."""
    with _RUNNING_LOCK:
        _RUNNING.add(proc)
