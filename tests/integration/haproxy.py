"""HAProxy from Debian as a real TCP load balancer in front of a test server.

:func:`running_haproxy` starts ``haproxy`` in ``mode tcp`` on loopback with a
generated configuration in a temporary directory, the one backend server
``127.0.0.1:<backend_port>`` sent a PROXY header (``send-proxy-v2`` with a
CRC-32C TLV, or ``send-proxy`` for v1), and stops it afterwards. ``make test``
installs haproxy (``apt-get install haproxy``); without it the ``haproxy``
fixture of ``tests/integration/conftest.py`` skips, saying so.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kiproxy_dev.processes import stop_process
from kiproxy_dev.tansu import free_port

__all__ = ["HaproxyFront", "StartHaproxy", "haproxy_binary", "haproxy_config",
           "running_haproxy"]


def haproxy_binary() -> str | None:
    """The haproxy executable, or None when it is not installed."""
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).exists()), None)


@dataclass(frozen=True)
class HaproxyFront:
    """A running haproxy: clients connect to ``host:port``."""

    host: str
    port: int
    send_proxy: Literal["v1", "v2"]


StartHaproxy = Callable[..., HaproxyFront]
"""The ``haproxy`` fixture: ``haproxy(backend_port, send_proxy="v2", bind="127.0.0.1",
port=None)``."""


def haproxy_config(bind: str, port: int, backend_port: int,
                   send_proxy: Literal["v1", "v2"]) -> str:
    """One TCP frontend on ``bind:port`` to ``127.0.0.1:backend_port`` with a PROXY header."""
    send = "send-proxy-v2 proxy-v2-options crc32c" if send_proxy == "v2" else "send-proxy"
    listen = f"[{bind}]:{port}" if ":" in bind else f"{bind}:{port}"
    return f"""global
    nbthread 1
defaults
    mode tcp
    timeout connect 5s
    timeout client 30s
    timeout server 30s
frontend clients
    bind {listen}
    default_backend kafka
backend kafka
    server upstream 127.0.0.1:{backend_port} {send}
"""


@contextmanager
def running_haproxy(workdir: Path, backend_port: int, *, send_proxy: Literal["v1", "v2"] = "v2",
                    bind: str = "127.0.0.1", port: int | None = None) -> Iterator[HaproxyFront]:
    """Start haproxy in front of ``backend_port`` (listening on ``port``, else a free
    one); stop it on exit."""
    binary = haproxy_binary()
    if binary is None:
        raise FileNotFoundError("haproxy is not installed (apt-get install haproxy)")
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    if port is None:
        port = free_port(bind) if family == socket.AF_INET else _free_port6(bind)
    cfg = workdir / f"haproxy-{port}.cfg"
    cfg.write_text(haproxy_config(bind, port, backend_port, send_proxy))
    log = (workdir / f"haproxy-{port}.log").open("wb")
    process = subprocess.Popen([binary, "-f", str(cfg), "-db"], stdout=log,
                               stderr=subprocess.STDOUT)
    try:
        _wait_listening(family, bind, port, process, workdir / f"haproxy-{port}.log")
        yield HaproxyFront(bind, port, send_proxy)
    finally:
        stop_process(process, grace=10)
        log.close()


def _free_port6(host: str) -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def _wait_listening(family: int, host: str, port: int, process: subprocess.Popen[bytes],
                    log: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"haproxy exited with {process.returncode}: "
                               f"{log.read_text(errors='replace')}")
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.settimeout(0.2)
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"haproxy did not listen on {host}:{port} within 10 s")
