"""``kiproxy dev`` as a user starts it, for the tests of the dev mode.

:func:`popen_dev` starts ``python -m kiproxy dev ARGS`` from the repository in a
session of its own, so that a test can send Ctrl-C's SIGINT to its whole process
group (the embedded broker included), with stdout and stderr merged and
unbuffered. :class:`DevMode` reads that output on a thread and says when the
bootstrap line, which ``kiproxy dev`` prints once it serves, has come;
:func:`running_dev` is both, killing whatever is left of the group at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from kiproxy_dev.processes import end_process
from support.processes import runtime_env

__all__ = ["DevMode", "popen_dev", "running_dev"]

ROOT = Path(__file__).resolve().parents[2]
BOOTSTRAP_LINE = "bootstrap address"


def popen_dev(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """``python -m kiproxy dev *args`` in a new session; ``env`` adds to this environment."""
    return subprocess.Popen(
        [sys.executable, "-m", "kiproxy", "dev", *args], cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        env=runtime_env(**(env or {})))


class DevMode:
    """A started ``kiproxy dev`` whose output lines a thread collects in ``lines``."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    @property
    def output(self) -> str:
        """Everything it printed so far."""
        return "\n".join(self.lines)

    def wait_bootstrap(self, timeout: float) -> str:
        """The address of the bootstrap line, once printed; AssertionError with the
        output if the process ends or ``timeout`` seconds pass first."""
        assert self._ready.wait(timeout) and self.process.poll() is None, self.output
        return next(ln for ln in self.lines if BOOTSTRAP_LINE in ln).split()[-1]

    def interrupt(self) -> None:
        """Ctrl-C in a terminal: SIGINT to the whole process group."""
        os.killpg(self.process.pid, signal.SIGINT)

    def stop(self, timeout: float = 20) -> None:
        """Ctrl-C, then SIGKILL to the group if it has not exited within ``timeout`` s."""
        if self.process.poll() is None:
            end_process(self.process, timeout, signal.SIGINT)

    def kill(self) -> None:
        """SIGKILL to the group, if the process still runs."""
        if self.process.poll() is None:
            end_process(self.process, grace=0)

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))
            if BOOTSTRAP_LINE in line:
                self._ready.set()
        self._ready.set()


@contextlib.contextmanager
def running_dev(*args: str, env: dict[str, str] | None = None) -> Iterator[DevMode]:
    """:func:`popen_dev` read by a :class:`DevMode`; the group is killed at the end if the
    test left it running."""
    dev = DevMode(popen_dev(*args, env=env))
    try:
        yield dev
    finally:
        dev.kill()
