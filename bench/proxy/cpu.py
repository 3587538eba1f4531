"""CPU and memory accounting for the proxy benchmark, from ``/proc``.

:func:`process_cpu` is the user + system CPU seconds of a process (and its
children), :func:`machine_busy_cpu` the whole machine's busy CPU seconds;
the benchmark reads them at phase boundaries and takes differences.
:func:`process_memory` is a process's minor page faults so far, and its resident
and peak resident memory. :class:`CpuSampler` reads a set of processes and the
machine at once, so that a bench can take the difference over one phase.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path


def parse_proc_stat(text: str) -> tuple[int, int]:
    """``(utime, stime)`` in clock ticks from the text of ``/proc/<pid>/stat``.

    The second field (the command name) is in parentheses and may itself hold
    spaces and parentheses, so fields are counted from the last ``)``.
    """
    end = text.rfind(")")
    if end < 0:
        raise ValueError("not a /proc/<pid>/stat line: no ')' after the command name")
    fields = text[end + 1:].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    if len(fields) < 13:
        raise ValueError(f"/proc/<pid>/stat has {len(fields) + 2} fields, expected at least 15")
    return int(fields[11]), int(fields[12])



_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out.extend(int(c) for c in
                           Path(f"/proc/{pid}/task/{task}/children").read_text().split())
    return out


def process_cpu_split(pid: int, tree: bool = True) -> tuple[float, float] | None:
    """(user, system) CPU seconds, all threads, of ``pid`` and, with ``tree``, its descendants."""
    try:
        utime, stime = parse_proc_stat(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError):
        return None
    user, system = utime / _TICKS, stime / _TICKS
    if tree:
        for child in _children(pid):
            split = process_cpu_split(child, tree=True)
            if split is not None:
                user, system = user + split[0], system + split[1]
    return user, system


def process_cpu(pid: int, tree: bool = True) -> float | None:
    """CPU seconds (user + system, all threads) of ``pid`` and, with ``tree``, its descendants."""
    split = process_cpu_split(pid, tree)
    return None if split is None else split[0] + split[1]


def process_memory(pid: int) -> dict[str, int] | None:
    """``minflt`` (minor page faults so far), ``rss`` and ``hwm`` (peak RSS), in bytes,
    of ``pid`` alone (not its children); ``None`` if it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    out = {"minflt": int(text[text.rfind(")") + 1:].split()[7])}  # field 10
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out["rss" if key == "VmRSS" else "hwm"] = int(value.split()[0]) * 1024
    return out


def machine_busy_cpu() -> float | None:
    """CPU seconds all CPUs spent not idle since boot (``/proc/stat``), steal included."""
    try:
        line = Path("/proc/stat").read_text().splitlines()[0].split()
    except (OSError, IndexError):
        return None
    values = [int(v) for v in line[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice (already in user)]
    busy = sum(values[:3]) + sum(values[5:8])
    return busy / _TICKS


def cpu_delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


class CpuSampler:
    """CPU of the processes under test, of this process and of the whole machine.

    :meth:`sample` reads them all at once (``pids`` by name, ``self`` and ``machine``);
    :meth:`delta` is the difference of two samples plus ``other``: the machine's busy
    CPU that none of them used (a gauge of noise from other work).
    """

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def sample(self) -> dict[str, float | None]:
        """CPU seconds so far: each pid's tree (and its user part), ``self`` and ``machine``."""
        out: dict[str, float | None] = {}
        for name, pid in self.pids.items():
            split = process_cpu_split(pid)
            out[name] = None if split is None else split[0] + split[1]
            out[f"{name}_user"] = None if split is None else split[0]
        out["self"] = process_cpu(os.getpid(), tree=False)
        out["machine"] = machine_busy_cpu()
        return out

    @staticmethod
    def delta(before: Mapping[str, float | None],
              after: Mapping[str, float | None]) -> dict[str, float | None]:
        """CPU seconds used between two samples, by name, and ``other``."""
        out = {k: cpu_delta(before.get(k), after.get(k)) for k in after}
        mine = [out.get(k) for k in before if k != "machine" and not k.endswith("_user")]
        machine = out.get("machine")
        if machine is not None and all(v is not None for v in mine):
            out["other"] = machine - sum(v for v in mine if v is not None)
        else:
            out["other"] = None
        return out
