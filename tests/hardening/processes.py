"""Processes the hardening tests start themselves: a Tansu broker that advertises a
relay's address, and kiproxy on fixed ports (so that a restarted proxy comes back
where its clients left it)."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from conftest import ROOT, TANSU_NODE_ID, ProxyProcess
from support.processes import runtime_env

from kiproxy_dev.tansu import EmbeddedBroker, free_port

__all__ = ["TansuBroker", "free_broker_port_start", "launch_proxy_at"]


class TansuBroker(EmbeddedBroker):
    """A Tansu broker (memory storage) on ``port`` that advertises ``advertised_port``.

    Tansu names its advertised address in Metadata, so clients (and kiproxy) that
    learn the broker from metadata connect to ``advertised_port``: a relay there
    sees every connection, not only the bootstrap one.
    """

    def __init__(self, advertised_port: int, port: int | None = None,
                 log_path: Path | None = None) -> None:
        super().__init__(port, log_path=log_path, advertised=f"127.0.0.1:{advertised_port}")
        self.advertised_port = advertised_port

    @property
    def address(self) -> tuple[str, int]:
        """The broker's real listener."""
        return (self.host, self.port)

    def start(self, timeout: float = 20) -> TansuBroker:
        """Start and wait until the listener accepts connections."""
        super().start(timeout)
        return self


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
                            cwd=ROOT, env=runtime_env())
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
