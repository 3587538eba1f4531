"""Processes the hardening tests start themselves: a Tansu broker that advertises a
relay's address, and kiproxy on fixed ports (so that a restarted proxy comes back
where its clients left it)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import ROOT, TANSU_NODE_ID, ProxyProcess

from kiproxy.localbrokers.tansu import broker_binary, free_port

__all__ = ["TansuBroker", "free_broker_port_start", "launch_proxy_at"]


class TansuBroker:
    """A Tansu broker (memory storage) on ``port`` that advertises ``advertised_port``.

    Tansu names its advertised address in Metadata, so clients (and kiproxy) that
    learn the broker from metadata connect to ``advertised_port``: a relay there
    sees every connection, not only the bootstrap one.
    """

    def __init__(self, advertised_port: int, port: int | None = None,
                 log_path: Path | None = None) -> None:
        self.port = port or free_port()
        self.advertised_port = advertised_port
        self.log_path = log_path
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> tuple[str, int]:
        """The broker's real listener."""
        return ("127.0.0.1", self.port)

    def start(self, timeout: float = 20) -> TansuBroker:
        """Start and wait until the listener accepts connections."""
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self._process = subprocess.Popen(
            [broker_binary(), "broker",
             "--listener-url", f"tcp://127.0.0.1:{self.port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{self.advertised_port}",
             "--storage-engine", "memory://tansu/"],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"Tansu exited with {self._process.returncode} on start")
            with contextlib.suppress(OSError), socket.create_connection(self.address, 0.5):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"Tansu did not listen on port {self.port} within {timeout} s")

    @property
    def running(self) -> bool:
        """Whether the broker process is alive."""
        return self._process is not None and self._process.poll() is None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        proc, self._process = self._process, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def free_broker_port_start(node_id: int = TANSU_NODE_ID) -> int:
    """A ``--broker-port-start`` that puts node ``node_id`` (Tansu's 111) on a free port."""
    for _ in range(50):
        port = free_port()
        if port - node_id > 1024:
            return int(port - node_id)
    raise RuntimeError("no free port found")


def launch_proxy_at(upstream: str, listen_port: int, broker_port_start: int, *extra: str,
                    lines: list[str] | None = None, timeout: float = 30) -> ProxyProcess:
    """Start ``kiproxy run`` on fixed ports; ``lines`` (if given) collects its output
    across restarts."""
    cmd = [sys.executable, "-m", "kiproxy", "run", "--upstream", upstream,
           "--listen", f"127.0.0.1:{listen_port}", "--broker-port-start",
           str(broker_port_start), "--log-level", "INFO", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    handle = ProxyProcess(proc, f"127.0.0.1:{listen_port}", broker_port_start,
                          lines if lines is not None else [])
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            handle.lines.append(line.rstrip("\n"))
            if "bootstrap address" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or proc.poll() is not None:
        handle.stop()
        raise RuntimeError(f"kiproxy did not start:\n{handle.log}")
    return handle
