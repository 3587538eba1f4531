"""End-to-end proxy benchmark: a real producer through kiproxy, against direct and haproxy.

Run from the repository root with the project's virtualenv::

    python -m bench.proxy              # full matrix, 3 interleaved rounds; writes bench/RESULTS.md
    python -m bench.proxy --quick      # 1 KiB uncompressed only, fewer records: under 5 minutes
    python -m bench.proxy --profile uppercase   # one run under py-spy, prints the hot spots

Every run starts a fresh embedded broker (Tansu, memory storage) and, for the
proxied scenarios, a fresh proxy process in front of it, then drives it with a
real producer (confluent-kafka / librdkafka) in a subprocess of its own:

* **direct**: the producer talks to the broker (the baseline of every ratio).
* **haproxy**: ``haproxy`` in TCP mode (one thread) as a plain L4 hop, the floor
  for any proxy. Kafka clients reconnect to the addresses the broker advertises,
  so for this scenario the broker advertises haproxy's port.
* **passthrough**: ``kiproxy run`` with no interceptor.
* **identity**: ``bench/plugins/identity.py``: every batch decoded, returned unchanged.
* **uppercase**: ``kiproxy.interceptors.builtin.uppercase:Uppercase``: decode, transform, re-encode.
* **validator**: ``kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator`` with a small
  schema (the values are JSON objects that satisfy it).

Each run has two phases after a warm-up. *Throughput*: ``--records`` records are
produced as fast as the producer can queue them, timed from the first
``produce()`` to the end of ``flush()``. *Latency*: a paced producer offers a
fixed load (``--load-fraction`` of the direct scenario's throughput for that
record size and codec, measured in the first round) for ``--latency-seconds``;
every record's latency is librdkafka's own produce-to-acknowledgement time
(``Message.latency()`` in the delivery callback). The proxy's CPU is read from
``/proc/<pid>/stat`` (utime + stime of the proxy process and its children) at
the phase boundaries.

Scenarios run in rounds (every scenario once for every record size and codec,
then again), rotated each round, and the table reports medians: the machine is
shared, and interleaving makes drift hit every scenario alike. Ratios and added
latency are medians of per-round pairs (a scenario against direct in the same
round).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "SCENARIOS",
    "TARGETS",
    "Case",
    "RunResult",
    "Scenario",
    "Summary",
    "TargetCheck",
    "contention_note",
    "cpu_bound_ratio",
    "cpu_per_gb",
    "cpu_per_million",
    "evaluate_targets",
    "haproxy_config",
    "json_values",
    "main",
    "median",
    "millicores_per_mbps",
    "parse_proc_stat",
    "percentile",
    "ratio",
    "render_table",
    "render_targets",
    "replace_section",
    "summarize",
]

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
PLUGINS = Path(__file__).resolve().parent / "plugins"
SECTION = "## Proxy: end to end (producer, proxy, broker)"
TANSU_NODE_ID = 111
"""The node id Tansu gives itself; kiproxy serves it on ``broker_port_start + 111``."""
MB = 1_000_000
GB = 1_000_000_000

SIZES = (100, 1024)
CODECS = ("none", "lz4", "zstd")

VALIDATOR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["id", "kind"],
    "properties": {"id": {"type": "integer", "minimum": 0}, "kind": {"type": "string"}},
}


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """One way of putting something (or nothing) between the producer and the broker."""

    name: str
    kind: str
    """``direct``, ``haproxy`` or ``kiproxy``."""
    description: str
    interceptor: str | None = None
    """``MODULE:CLASS`` for ``kiproxy run --interceptor``."""
    interceptor_config: Mapping[str, Any] | None = None
    plugins_dir: Path | None = None
    transforms: bool = False
    """Stored values are upper-cased (checked on one record of the first round)."""


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(name="direct", kind="direct", description="producer to broker, no hop"),
    Scenario(name="haproxy", kind="haproxy",
             description="haproxy 'mode tcp', nbthread 1, broker advertises haproxy's port"),
    Scenario(name="passthrough", kind="kiproxy", description="kiproxy, no interceptor"),
    Scenario(name="identity", kind="kiproxy", interceptor="identity:Identity",
             plugins_dir=PLUGINS,
             description="kiproxy, bench/plugins/identity.py (decode, return the batch)"),
    Scenario(name="uppercase", kind="kiproxy",
             interceptor="kiproxy.interceptors.builtin.uppercase:Uppercase", transforms=True,
             description="kiproxy, kiproxy.interceptors.builtin.uppercase:Uppercase "
                         "(decode, transform, re-encode)"),
    Scenario(name="validator", kind="kiproxy",
             interceptor="kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator",
             interceptor_config={"default_schema": VALIDATOR_SCHEMA},
             description="kiproxy, kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator, "
                         "default_schema " + json.dumps(VALIDATOR_SCHEMA, separators=(",", ":"))),
)}


@dataclass(frozen=True, slots=True, order=True)
class Case:
    """Record size and codec of one cell of the matrix."""

    value_size: int
    codec: str

    @property
    def label(self) -> str:
        """``100 B`` / ``1 KiB``."""
        return f"{self.value_size // 1024} KiB" if self.value_size % 1024 == 0 \
            else f"{self.value_size} B"


# --------------------------------------------------------------------------- pure helpers


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not ``None``; ``None`` when there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is not within 0..100")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """``numerator / denominator``, or ``None`` when either is missing or the divisor is 0."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


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


def cpu_per_gb(cpu_seconds: float | None, payload_bytes: float) -> float | None:
    """CPU seconds per GB (10^9 bytes) of record values."""
    return None if cpu_seconds is None or payload_bytes <= 0 else cpu_seconds * GB / payload_bytes


def cpu_per_million(cpu_seconds: float | None, records: float) -> float | None:
    """CPU seconds per million records."""
    return None if cpu_seconds is None or records <= 0 else cpu_seconds * 1e6 / records


def millicores_per_mbps(cpu_seconds: float | None, wall_seconds: float,
                        payload_bytes: float) -> float | None:
    """Average millicores used per MB/s of record values carried.

    ``(cpu / wall * 1000) / (bytes / MB / wall)``: the wall time cancels, so this
    equals CPU seconds per GB; both names are kept because targets use this one.
    """
    if cpu_seconds is None or wall_seconds <= 0 or payload_bytes <= 0:
        return None
    return (cpu_seconds / wall_seconds * 1000) / (payload_bytes / MB / wall_seconds)


def json_values(size: int, count: int, seed: int = 7) -> list[bytes]:
    """``count`` distinct JSON objects of exactly ``size`` bytes, in lower case.

    Each starts with ``"id"`` (an integer) and ``"kind"`` (a string), the fields
    the validator's schema requires, then filler words about as compressible as
    real events. Lower case, so that the uppercase interceptor changes them.
    """
    words = ("order", "payment", "customer", "status", "pending", "shipped", "eur", "usd",
             "warehouse", "priority", "express", "standard", "refund", "invoice", "berlin",
             "lisbon", "tokyo", "sku", "quantity", "discount")
    rng = random.Random(seed * 1_000_003 + size)
    out = []
    for i in range(count):
        text = f'{{"id":{i},"kind":"{rng.choice(words)}"'
        pad = len(',"pad":""}')
        if len(text) + pad > size:
            raise ValueError(f"a JSON value cannot be as short as {size} bytes")
        for k in range(size):
            item = f',"{rng.choice(words)}_{k}":"{rng.choice(words)}-{rng.randrange(10**6)}"'
            if len(text) + len(item) + pad > size:
                break
            text += item
        text += ',"pad":"' + "x" * (size - len(text) - pad) + '"}'
        out.append(text.encode())
    return out


def haproxy_config(listen_port: int, broker_port: int, host: str = "127.0.0.1") -> str:
    """An haproxy configuration: one TCP frontend on ``listen_port`` to the broker, one thread."""
    return f"""global
    nbthread 1
    maxconn 4096

defaults
    mode tcp
    timeout connect 5s
    timeout client 120s
    timeout server 120s

frontend kafka
    bind {host}:{listen_port}
    default_backend broker

backend broker
    server tansu {host}:{broker_port}
"""


def replace_section(document: str, heading: str, text: str) -> str:
    """``document`` with the ``heading`` section (up to the next ``## ``) replaced by ``text``.

    The section is appended when the document has none; other sections are kept.
    """
    text = text.rstrip("\n") + "\n"
    start = document.find(heading + "\n")
    if start < 0:
        return document.rstrip("\n") + "\n\n" + text
    nxt = re.search(r"^## ", document[start + len(heading):], re.MULTILINE)
    if nxt is None:
        return document[:start] + text
    end = start + len(heading) + nxt.start()
    return document[:start] + text + "\n" + document[end:]


# --------------------------------------------------------------------------- results


@dataclass(slots=True, kw_only=True)
class RunResult:
    """One run of one scenario: both phases, as measured by the producer process."""

    scenario: str
    case: Case
    round: int
    records: int = 0
    """Records of the throughput phase."""
    seconds: float = 0.0
    """Throughput phase: first produce() to the end of flush()."""
    proxy_cpu: float | None = None
    """CPU seconds of the proxy process (kiproxy or haproxy) in the throughput phase."""
    proxy_user_cpu: float | None = None
    """The user-space part of ``proxy_cpu`` (the rest is the kernel: socket I/O)."""
    broker_cpu: float | None = None
    producer_cpu: float | None = None
    other_cpu: float | None = None
    """CPU seconds the rest of the machine used in the throughput phase (a noise gauge)."""
    offered_rps: float | None = None
    """Latency phase: the paced producer's target rate."""
    paced_rps: float | None = None
    """Latency phase: the rate the paced producer reached."""
    paced_records: int = 0
    paced_seconds: float = 0.0
    paced_proxy_cpu: float | None = None
    paced_other_cpu: float | None = None
    saturated: bool = False
    """The paced load was above this run's own throughput: no latency phase."""
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    check: str | None = None
    """What one stored record looked like (first round only)."""
    error: str | None = None
    load: float | None = None
    """1-minute load average when the run started."""

    @property
    def ok(self) -> bool:
        """The run finished without errors."""
        return self.error is None and self.records > 0 and self.seconds > 0

    @property
    def rps(self) -> float | None:
        """Throughput, records per second."""
        return self.records / self.seconds if self.ok else None

    def mbps(self) -> float | None:
        """Throughput, MB (10^6 bytes) of record values per second."""
        rps = self.rps
        return None if rps is None else rps * self.case.value_size / MB

    def cpu_s_per_gb(self) -> float | None:
        """Proxy CPU seconds per GB of record values, throughput phase."""
        if not self.ok:
            return None
        return cpu_per_gb(self.proxy_cpu, self.records * self.case.value_size)

    def cpu_s_per_mrec(self) -> float | None:
        """Proxy CPU seconds per million records, throughput phase."""
        return cpu_per_million(self.proxy_cpu, self.records) if self.ok else None

    def stack_cpu_s_per_gb(self) -> float | None:
        """Producer + broker CPU seconds per GB of record values, throughput phase."""
        if not self.ok or self.producer_cpu is None or self.broker_cpu is None:
            return None
        return cpu_per_gb(self.producer_cpu + self.broker_cpu,
                          self.records * self.case.value_size)

    def paced_cpu_s_per_gb(self) -> float | None:
        """Proxy CPU seconds per GB of record values, latency (paced) phase."""
        if not self.ok:
            return None
        return cpu_per_gb(self.paced_proxy_cpu, self.paced_records * self.case.value_size)


@dataclass(slots=True, kw_only=True)
class Summary:
    """Medians of one scenario's runs for one record size and codec."""

    scenario: str
    case: Case
    runs: int
    ok_runs: int
    rps: float | None = None
    mbps: float | None = None
    vs_direct: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    p99_added_ms: float | None = None
    cpu_s_per_gb: float | None = None
    cpu_s_per_mrec: float | None = None
    paced_cpu_s_per_gb: float | None = None
    offered_rps: float | None = None
    paced_rps: float | None = None
    saturated_runs: int = 0
    """Runs whose own throughput was below the paced load (no latency measured)."""
    stack_cpu_s_per_gb: float | None = None
    """CPU seconds per GB the producer and the broker spent (throughput phase)."""
    proxy_user_share: float | None = None
    """The part of the proxy's CPU spent in user space (the rest is kernel time)."""
    note: str = ""


def summarize(results: Sequence[RunResult], unavailable: Mapping[str, str] | None = None,
              scenarios: Sequence[str] | None = None) -> list[Summary]:
    """Medians per (case, scenario); ratios and added latency paired with direct per round."""
    unavailable = unavailable or {}
    cases = list(dict.fromkeys(r.case for r in results))  # in the order they ran
    names = list(scenarios) if scenarios is not None else \
        list(dict.fromkeys(r.scenario for r in results))
    direct = {(r.case, r.round): r for r in results if r.scenario == "direct" and r.ok}
    out = []
    for case in cases:
        for name in names:
            runs = [r for r in results if r.case == case and r.scenario == name]
            if not runs:
                if name in unavailable:
                    out.append(Summary(scenario=name, case=case, runs=0, ok_runs=0,
                                       note=unavailable[name]))
                continue
            good = [r for r in runs if r.ok]
            ratios, added = [], []
            for r in good:
                base = direct.get((case, r.round))
                if base is None:
                    continue
                ratios.append(ratio(r.rps, base.rps))
                if r.p99_ms is not None and base.p99_ms is not None:
                    added.append(r.p99_ms - base.p99_ms)
            if not added and name != "direct":
                # No round had both latencies (over capacity): compare the medians instead.
                base_p99 = median(r.p99_ms for r in direct.values() if r.case == case)
                own_p99 = median(r.p99_ms for r in good)
                if base_p99 is not None and own_p99 is not None:
                    added.append(own_p99 - base_p99)
            errors = sorted({r.error for r in runs if r.error})
            out.append(Summary(
                scenario=name, case=case, runs=len(runs), ok_runs=len(good),
                rps=median(r.rps for r in good), mbps=median(r.mbps() for r in good),
                vs_direct=median(ratios), p50_ms=median(r.p50_ms for r in good),
                p99_ms=median(r.p99_ms for r in good), p99_added_ms=median(added),
                cpu_s_per_gb=median(r.cpu_s_per_gb() for r in good),
                cpu_s_per_mrec=median(r.cpu_s_per_mrec() for r in good),
                paced_cpu_s_per_gb=median(r.paced_cpu_s_per_gb() for r in good),
                offered_rps=median(r.offered_rps for r in good),
                paced_rps=median(r.paced_rps for r in good),
                saturated_runs=sum(r.saturated for r in good),
                stack_cpu_s_per_gb=median(r.stack_cpu_s_per_gb() for r in good),
                proxy_user_share=median(ratio(r.proxy_user_cpu, r.proxy_cpu) for r in good),
                note="; ".join(errors),
            ))
    return out


def _num(value: float | None, fmt: str = ",.0f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def render_table(summaries: Sequence[Summary]) -> str:
    """The markdown results table."""
    head = ["records", "codec", "scenario", "rec/s", "MB/s", "x direct", "p50 ms", "p99 ms",
            "p99 added ms", "proxy CPU s/GB", "proxy CPU s/M rec", "paced CPU s/GB", "runs"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|---|" + "---:|" * (len(head) - 4) + "---|"]
    for s in summaries:
        if s.runs == 0:
            lines.append("| " + " | ".join(
                [s.case.label, s.case.codec, s.scenario, *["n/a"] * (len(head) - 4),
                 s.note or "not run"]) + " |")
            continue
        runs = f"{s.ok_runs}/{s.runs}"
        if s.saturated_runs:
            runs += f", {s.saturated_runs} over capacity"
        if s.note:
            runs += f" ({s.note})"
        over = "over capacity" if s.saturated_runs and s.p50_ms is None else "-"
        lines.append("| " + " | ".join([
            s.case.label, s.case.codec, s.scenario, _num(s.rps), _num(s.mbps, ",.1f"),
            _num(s.vs_direct, ".2f"), _num(s.p50_ms, ".2f", over), _num(s.p99_ms, ".2f", over),
            _num(s.p99_added_ms, "+.2f", over), _num(s.cpu_s_per_gb, ".1f"),
            _num(s.cpu_s_per_mrec, ".1f"), _num(s.paced_cpu_s_per_gb, ".1f"), runs,
        ]) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Target:
    """A goal on one metric of one scenario (1 KiB records, uncompressed)."""

    scenario: str
    metric: str
    """``vs_direct``, ``cpu`` (millicores per MB/s) or ``p99_added_ms``."""
    bound: float
    at_least: bool
    """The value must be >= bound (else <=)."""

    @property
    def label(self) -> str:
        """What is compared, in words."""
        what = {"vs_direct": "throughput / direct", "cpu": "proxy millicores per MB/s",
                "p99_added_ms": "p99 latency added (ms)"}[self.metric]
        return f"{self.scenario}: {what} {'>=' if self.at_least else '<='} {self.bound:g}"


TARGETS: tuple[Target, ...] = (
    Target("passthrough", "vs_direct", 0.95, True),
    Target("identity", "vs_direct", 0.90, True),
    Target("uppercase", "vs_direct", 0.80, True),
    Target("passthrough", "cpu", 10, False),
    Target("uppercase", "cpu", 25, False),
    Target("passthrough", "p99_added_ms", 1.0, False),
    Target("identity", "p99_added_ms", 1.0, False),
    Target("uppercase", "p99_added_ms", 1.0, False),
    Target("validator", "p99_added_ms", 1.0, False),
)
TARGET_CASE = Case(1024, "none")


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """A target and the measured median."""

    target: Target
    value: float | None

    @property
    def passed(self) -> bool | None:
        """``None`` when there is no measurement."""
        if self.value is None:
            return None
        t = self.target
        return self.value >= t.bound if t.at_least else self.value <= t.bound

    def describe(self) -> str:
        """``PASS``/``MISS``/``n/a``, the label, the value and the margin."""
        t = self.target
        if self.value is None:
            return f"n/a   {t.label}: not measured"
        margin = self.value - t.bound if t.at_least else t.bound - self.value
        rel = f", {abs(margin) / t.bound:.0%} of the bound" if t.bound else ""
        verdict = "PASS" if self.passed else "MISS"
        how = "ahead by" if margin >= 0 else "short by"
        return f"{verdict}  {t.label}: measured {self.value:.2f}, {how} {abs(margin):.2f}{rel}"


def evaluate_targets(summaries: Sequence[Summary], case: Case = TARGET_CASE,
                     targets: Sequence[Target] = TARGETS) -> list[TargetCheck]:
    """Check every target against the medians of ``case`` (1 KiB, uncompressed)."""
    by_name = {s.scenario: s for s in summaries if s.case == case}
    checks = []
    for t in targets:
        s = by_name.get(t.scenario)
        value = None
        if s is not None:
            # millicores per MB/s equals CPU seconds per GB (see millicores_per_mbps).
            value = s.cpu_s_per_gb if t.metric == "cpu" else getattr(s, t.metric)
        checks.append(TargetCheck(t, value))
    return checks


def render_targets(checks: Sequence[TargetCheck]) -> str:
    """One line per target."""
    return "\n".join(c.describe() for c in checks)


def cpu_bound_ratio(stack_s_per_gb: float | None, proxy_s_per_gb: float | None) -> float | None:
    """Throughput relative to direct when the machine's cores are the bottleneck.

    If the producer and broker need ``stack`` CPU seconds per GB and the proxy
    adds ``proxy``, a saturated machine carries ``stack / (stack + proxy)`` of
    what it carries without the proxy.
    """
    if stack_s_per_gb is None or proxy_s_per_gb is None or stack_s_per_gb + proxy_s_per_gb <= 0:
        return None
    return stack_s_per_gb / (stack_s_per_gb + proxy_s_per_gb)


def contention_note(summaries: Sequence[Summary], case: Case = TARGET_CASE,
                    goal: float = 0.95) -> str:
    """How far the ratios are explained by sharing the machine's cores (``case`` rows)."""
    rows = {s.scenario: s for s in summaries if s.case == case}
    direct = rows.get("direct")
    if direct is None or direct.stack_cpu_s_per_gb is None:
        return ""
    stack = direct.stack_cpu_s_per_gb
    lines = [f"CPU budget: with no hop the producer and broker spend {stack:.1f} CPU s/GB "
             f"(direct, {_num(direct.mbps, '.0f')} MB/s). While the cores are saturated a hop "
             f"spending p s/GB leaves at most {stack:.1f} / ({stack:.1f} + p) of direct's "
             f"throughput; {goal:.2f} needs p <= {stack * (1 / goal - 1):.2f} s/GB."]
    for name, s in rows.items():
        expected = cpu_bound_ratio(stack, s.cpu_s_per_gb)
        if name == "direct" or expected is None:
            continue
        user = "" if s.proxy_user_share is None else f" ({s.proxy_user_share:.0%} user space)"
        lines.append(f"  {name}: p = {s.cpu_s_per_gb:.2f} s/GB{user} -> CPU-bound ratio "
                     f"{expected:.2f}, measured {_num(s.vs_direct, '.2f')}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- /proc sampling


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


def _delta(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


# --------------------------------------------------------------------------- producer (worker)


def _producer_config(spec: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "bootstrap.servers": spec["bootstrap"],
        "client.id": "bench-proxy",
        "acks": str(spec["acks"]),
        "compression.type": spec["codec"],
        "linger.ms": spec["linger_ms"],
        "max.in.flight.requests.per.connection": spec["max_in_flight"],
        # A short queue: what is still queued when a slow scenario's throughput phase
        # hits --max-seconds must drain quickly, and it is plenty for 5 x 1 MB in flight.
        "queue.buffering.max.messages": 100_000,
        "queue.buffering.max.kbytes": 32 * 1024,
        "enable.idempotence": False,
    }


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(topic, num_partitions=partitions,
                                            replication_factor=1)], operation_timeout=10)
    for future in futures.values():
        future.result(timeout=30)


def _read_first_value(bootstrap: str, topic: str, timeout: float = 10) -> bytes | None:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-check",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                value: bytes | None = msg.value()
                return value
        return None
    finally:
        consumer.close()


class _Sampler:
    """CPU of the processes under test, of this process and of the whole machine."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)

    def sample(self) -> dict[str, float | None]:
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
        out = {k: _delta(before.get(k), after.get(k)) for k in after}
        mine = [out.get(k) for k in before if k != "machine" and not k.endswith("_user")]
        machine = out.get("machine")
        if machine is not None and all(v is not None for v in mine):
            out["other"] = machine - sum(v for v in mine if v is not None)
        else:
            out["other"] = None
        return out


def run_producer(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The producer side of one run (runs in its own process: ``--worker SPEC``).

    Creates the topic, warms up, then runs the throughput phase and the paced
    latency phase, sampling the CPU of ``spec["pids"]`` at the phase boundaries.
    """
    from confluent_kafka import Producer

    bootstrap, topic, partitions = spec["bootstrap"], spec["topic"], spec["partitions"]
    values = json_values(spec["value_size"], 1000)
    n_values = len(values)
    _create_topic(bootstrap, topic, partitions)
    sampler = _Sampler(spec["pids"])
    errors: list[str] = []

    def on_error(err: Any, msg: Any) -> None:
        if err is not None and len(errors) < 5:
            errors.append(str(err))

    def warm_up(producer: Any) -> None:
        for i in range(spec["warmup"]):
            producer.produce(topic, values[i % n_values], partition=i % partitions)
        if producer.flush(30):
            raise RuntimeError("warm-up records were not delivered within 30 s")

    # Throughput: one producer that reports only failed deliveries.
    producer = Producer({**_producer_config(spec), "delivery.report.only.error": True,
                         "on_delivery": on_error})
    warm_up(producer)
    if errors:
        return {"error": f"warm-up: {errors[0]}"}
    count = spec["records"]
    produce, poll = producer.produce, producer.poll
    before = sampler.sample()
    t0 = time.perf_counter()
    stop_at = t0 + spec["max_seconds"]
    i = 0
    while i < count:
        try:
            produce(topic, values[i % n_values], partition=i % partitions)
        except BufferError:
            poll(0.001)
            continue
        i += 1
        if not i % 1000 and time.perf_counter() > stop_at:
            break  # a slow scenario: fewer records rather than a longer run
    count = i
    left = producer.flush(120)
    seconds = time.perf_counter() - t0
    cpu = _Sampler.delta(before, sampler.sample())
    if left:
        errors.append(f"{left} records not delivered after flush")
    result: dict[str, Any] = {"records": count, "seconds": seconds, "cpu": cpu}
    if errors:
        result["error"] = f"throughput phase: {errors[0]}"
        return result

    # Latency: a paced producer; every delivery reports librdkafka's own latency.
    offered = spec.get("offered_rps") or spec["load_fraction"] * count / seconds
    result["offered_rps"] = offered
    if offered > count / seconds:
        # Above this scenario's own throughput the latency is just queue growth.
        result["saturated"] = True
        return result
    latencies: list[float] = []

    def on_delivery(err: Any, msg: Any) -> None:
        if err is not None:
            if len(errors) < 5:
                errors.append(str(err))
            return
        latency = msg.latency()
        if latency is not None:
            latencies.append(latency)

    paced = Producer({**_producer_config(spec), "on_delivery": on_delivery})
    warm_up(paced)
    latencies.clear()
    total = max(int(offered * spec["latency_seconds"]), 1)
    produce, poll = paced.produce, paced.poll
    tick = 0.001
    before = sampler.sample()
    start = time.perf_counter()
    sent = 0
    while sent < total:
        now = time.perf_counter()
        due = min(total, int((now - start) * offered) + 1)
        while sent < due:
            try:
                produce(topic, values[sent % n_values], partition=sent % partitions)
            except BufferError:
                poll(0.001)
                continue
            sent += 1
        poll(0)
        pause = start + sent / offered - time.perf_counter()
        if pause > 0:
            time.sleep(max(pause, tick))
    produced_in = time.perf_counter() - start
    left = paced.flush(120)
    paced_seconds = time.perf_counter() - start
    paced_cpu = _Sampler.delta(before, sampler.sample())
    if left:
        errors.append(f"{left} paced records not delivered after flush")
    result.update(paced_records=total, paced_seconds=paced_seconds,
                  paced_rps=total / produced_in if produced_in > 0 else None,
                  paced_cpu=paced_cpu, latencies=len(latencies))
    if latencies:
        ms = [v * 1000 for v in latencies]
        result.update(p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
                      p999_ms=percentile(ms, 99.9))
    if errors:
        result["error"] = f"latency phase: {errors[0]}"
        return result
    if spec.get("check"):
        value = _read_first_value(bootstrap, topic)
        result["check"] = None if value is None else value[:40].decode("latin-1")
    return result


# --------------------------------------------------------------------------- processes


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _broker_port_start() -> int:
    # Node N is served on start + N; pick start so that Tansu's node 111 gets a free port.
    for _ in range(50):
        port = _free_port()
        if port - TANSU_NODE_ID > 1024:
            return port - TANSU_NODE_ID
    raise RuntimeError("no free port found for the proxy's broker listener")


def _wait_listening(port: int, proc: subprocess.Popen[Any], what: str,
                    timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode} while starting")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within {timeout} s")


def _stop(proc: subprocess.Popen[Any] | None, timeout: float = 10) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class _Tail:
    """Keeps the last lines a process printed (and notices one line)."""

    def __init__(self, proc: subprocess.Popen[str], marker: str) -> None:
        self.lines: list[str] = []
        self.ready = threading.Event()
        self._marker = marker
        self._thread = threading.Thread(target=self._pump, args=(proc,), daemon=True)
        self._thread.start()

    def _pump(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines = [*self.lines[-40:], line.rstrip("\n")]
            if self._marker in line:
                self.ready.set()
        self.ready.set()

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@dataclass(slots=True)
class _Setup:
    """What one run started: the broker, perhaps a proxy, and where the producer connects."""

    bootstrap: str
    pids: dict[str, int]
    processes: list[subprocess.Popen[Any]] = field(default_factory=list)


def _no_attach(setup: _Setup) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@contextlib.contextmanager
def _started(scenario: Scenario, workdir: Path, proxy_flags: Sequence[str]) -> Iterator[_Setup]:
    """Start a fresh broker and the scenario's proxy; stop both afterwards."""
    from kiproxy.proxy.embedded import broker_binary

    broker_port = _free_port()
    advertised = broker_port
    hap_port = None
    if scenario.kind == "haproxy":
        hap_port = _free_port()
        advertised = hap_port
    setup = _Setup(bootstrap=f"127.0.0.1:{broker_port}", pids={})
    log = open(workdir / "broker.log", "ab")  # noqa: SIM115 - closed below
    try:
        broker = subprocess.Popen(
            [broker_binary(), "broker", "--listener-url", f"tcp://127.0.0.1:{broker_port}",
             "--advertised-listener-url", f"tcp://127.0.0.1:{advertised}",
             "--storage-engine", "memory://tansu/"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")})
        setup.processes.append(broker)
        setup.pids["broker"] = broker.pid
        _wait_listening(broker_port, broker, "the Tansu broker")
        if scenario.kind == "haproxy":
            assert hap_port is not None
            cfg = workdir / "haproxy.cfg"
            cfg.write_text(haproxy_config(hap_port, broker_port))
            hap = subprocess.Popen([_haproxy_binary() or "haproxy", "-f", str(cfg), "-db"],
                                   stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
            setup.processes.append(hap)
            setup.pids["proxy"] = hap.pid
            _wait_listening(hap_port, hap, "haproxy")
            setup.bootstrap = f"127.0.0.1:{hap_port}"
        elif scenario.kind == "kiproxy":
            listen = _free_port()
            cmd = [sys.executable, "-m", "kiproxy", "run",
                   "--upstream", f"127.0.0.1:{broker_port}", "--listen", f"127.0.0.1:{listen}",
                   "--broker-port-start", str(_broker_port_start()), "--log-level", "WARNING",
                   *proxy_flags]
            if scenario.interceptor:
                cmd += ["--interceptor", scenario.interceptor]
            if scenario.interceptor_config is not None:
                cmd += ["--interceptor-config", json.dumps(scenario.interceptor_config)]
            if scenario.plugins_dir is not None:
                cmd += ["--plugins-dir", str(scenario.plugins_dir)]
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, cwd=ROOT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
            setup.processes.append(proc)
            tail = _Tail(proc, "bootstrap address")
            if not tail.ready.wait(60) or proc.poll() is not None:
                raise RuntimeError(f"kiproxy did not start:\n{tail.text}")
            setup.pids["proxy"] = proc.pid
            setup.bootstrap = f"127.0.0.1:{listen}"
        yield setup
    finally:
        for proc in reversed(setup.processes):
            _stop(proc)
        log.close()


def _haproxy_binary() -> str | None:
    explicit = os.environ.get("HAPROXY")
    if explicit:
        return explicit if Path(explicit).exists() else None
    return shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if Path(p).exists()), None)


def _kiproxy_has_flag(flag: str) -> bool:
    out = subprocess.run([sys.executable, "-m", "kiproxy", "run", "--help"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    return flag in out.stdout


@dataclass(slots=True, kw_only=True)
class Options:
    """What the command line asked for."""

    records: dict[int, int]
    """Throughput-phase records per value size."""
    warmup: int
    latency_seconds: float
    load_fraction: float
    partitions: int
    acks: str
    linger_ms: float
    max_in_flight: int
    proxy_flags: list[str]
    max_seconds: float = 10.0
    """The throughput phase stops producing after this long (slow scenarios)."""
    timeout: float = 600


def run_once(scenario: Scenario, case: Case, round_: int, options: Options,
             offered_rps: float | None, check: bool,
             attach: Callable[[_Setup], contextlib.AbstractContextManager[None]] | None = None,
             ) -> RunResult:
    """Start a broker (and proxy), run the producer process against it, collect the result."""
    result = RunResult(scenario=scenario.name, case=case, round=round_,
                       load=os.getloadavg()[0])
    with tempfile.TemporaryDirectory(prefix="bench-proxy-") as tmp:
        try:
            with _started(scenario, Path(tmp), options.proxy_flags) as setup, \
                    (attach or _no_attach)(setup):
                spec = {
                    "bootstrap": setup.bootstrap, "topic": f"bench-{uuid.uuid4().hex[:8]}",
                    "partitions": options.partitions, "value_size": case.value_size,
                    "codec": case.codec, "acks": options.acks, "linger_ms": options.linger_ms,
                    "max_in_flight": options.max_in_flight,
                    "records": options.records[case.value_size], "warmup": options.warmup,
                    "max_seconds": options.max_seconds,
                    "latency_seconds": options.latency_seconds,
                    "load_fraction": options.load_fraction, "offered_rps": offered_rps,
                    "pids": setup.pids, "check": check,
                }
                out = subprocess.run(
                    [sys.executable, "-m", "bench.proxy", "--worker", json.dumps(spec)],
                    cwd=ROOT, capture_output=True, text=True, timeout=options.timeout,
                    check=False)
                if out.returncode != 0 or not out.stdout.strip():
                    tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
                    result.error = f"producer exited {out.returncode}: " + " | ".join(tail)
                    return result
                data = json.loads(out.stdout.strip().splitlines()[-1])
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            result.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return result
    _fill(result, data, scenario)
    return result


def _fill(result: RunResult, data: Mapping[str, Any], scenario: Scenario) -> None:
    cpu = data.get("cpu") or {}
    paced_cpu = data.get("paced_cpu") or {}
    result.records = int(data.get("records", 0))
    result.seconds = float(data.get("seconds", 0.0))
    result.proxy_cpu = cpu.get("proxy")
    result.proxy_user_cpu = cpu.get("proxy_user")
    result.broker_cpu = cpu.get("broker")
    result.producer_cpu = cpu.get("self")
    result.other_cpu = cpu.get("other")
    result.offered_rps = data.get("offered_rps")
    result.paced_rps = data.get("paced_rps")
    result.paced_records = int(data.get("paced_records", 0))
    result.paced_seconds = float(data.get("paced_seconds", 0.0))
    result.paced_proxy_cpu = paced_cpu.get("proxy")
    result.paced_other_cpu = paced_cpu.get("other")
    result.saturated = bool(data.get("saturated"))
    result.p50_ms = data.get("p50_ms")
    result.p99_ms = data.get("p99_ms")
    result.p999_ms = data.get("p999_ms")
    result.check = data.get("check")
    result.error = data.get("error")
    if result.error is None and result.check is not None:
        upper = result.check == result.check.upper()
        if scenario.transforms != upper:
            result.error = (f"stored value {result.check!r} is "
                            f"{'not ' if scenario.transforms else ''}upper-cased")


# --------------------------------------------------------------------------- orchestration


def rotated(items: Sequence[str], by: int) -> list[str]:
    """``items`` rotated left ``by`` places (round ``r`` starts with scenario ``r``)."""
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def run_matrix(scenarios: Sequence[Scenario], cases: Sequence[Case], repeats: int,
               options: Options, log: Callable[[str], None]) -> list[RunResult]:
    """Every scenario for every case, ``repeats`` rounds, interleaved and rotated."""
    results: list[RunResult] = []
    offered: dict[Case, float] = {}
    names = [s.name for s in scenarios]
    for round_ in range(repeats):
        for case in cases:
            order = names if round_ == 0 else rotated(names, round_)
            for name in order:
                scenario = SCENARIOS[name]
                r = run_once(scenario, case, round_, options, offered.get(case),
                             check=round_ == 0 and scenario.kind == "kiproxy")
                if name == "direct" and case not in offered and r.ok and r.offered_rps:
                    offered[case] = r.offered_rps
                results.append(r)
                log(_progress(r))
    return results


def _progress(r: RunResult) -> str:
    head = f"  round {r.round + 1} {r.case.label:>5} {r.case.codec:4} {r.scenario:11}"
    if not r.ok:
        return f"{head} FAILED: {r.error}"
    latency = (f"over capacity for {_num(r.offered_rps)} rec/s" if r.saturated else
               f"p50 {_num(r.p50_ms, '.2f')} p99 {_num(r.p99_ms, '.2f')} ms "
               f"@ {_num(r.paced_rps)}/{_num(r.offered_rps)} rec/s "
               f"(other {_num(_cores(r.paced_other_cpu, r.paced_seconds), '.2f')} cores)")
    return (f"{head} {_num(r.rps):>9} rec/s {_num(r.mbps(), '6.1f')} MB/s  {latency}  "
            f"proxy {_num(r.cpu_s_per_gb(), '.1f')} s/GB  cores: "
            f"producer {_num(_cores(r.producer_cpu, r.seconds), '.2f')} "
            f"broker {_num(_cores(r.broker_cpu, r.seconds), '.2f')} "
            f"proxy {_num(_cores(r.proxy_cpu, r.seconds), '.2f')} "
            f"other {_num(_cores(r.other_cpu, r.seconds), '.2f')}  "
            f"({r.seconds:.1f} s, load {_num(r.load, '.2f')})")


def _cores(cpu_seconds: float | None, wall_seconds: float) -> float | None:
    return None if cpu_seconds is None or wall_seconds <= 0 else cpu_seconds / wall_seconds


# --------------------------------------------------------------------------- reporting


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(),
                          re.MULTILINE)
        if match:
            return match.group(1).strip()
    return platform.processor() or "unknown"


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in ("confluent-kafka", "uvloop", "kio", "cramjam"):
        try:
            out.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            out.append(f"{dist} (not installed)")
    with contextlib.suppress(ImportError):
        import confluent_kafka

        out.append(f"librdkafka {confluent_kafka.libversion()[0]}")
    return ", ".join(out)


def _code_version() -> str:
    """The commit measured, and whether the proxy's code had uncommitted changes."""
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True,
                             check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return "not a git checkout"
    dirty = git("status", "--porcelain", "--", "proxy", "protocol", "interceptors")
    return f"commit {commit}" + (" with uncommitted changes in proxy/, protocol/ or "
                                 "interceptors/" if dirty else "")


def _haproxy_version(binary: str | None) -> str:
    if binary is None:
        return "not installed"
    out = subprocess.run([binary, "-v"], capture_output=True, text=True, check=False)
    first = (out.stdout or out.stderr).splitlines()
    return first[0] if first else binary


def _tansu_version() -> str:
    try:
        from kiproxy.proxy.embedded import broker_binary

        return Path(broker_binary()).name
    except Exception as exc:
        return f"unavailable ({exc})"


def _load_note(results: Sequence[RunResult], load_before: tuple[float, float, float],
               load_after: tuple[float, float, float], elapsed: float) -> str:
    loads = [r.load for r in results if r.load is not None]
    other = [r.other_cpu / r.seconds for r in results
             if r.ok and r.other_cpu is not None and r.seconds > 0]
    text = (f"load average {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} "
            f"(1/5/15 min) before the run, {load_after[0]:.2f} / {load_after[1]:.2f} / "
            f"{load_after[2]:.2f} after; 1-min load at the start of each run: median "
            f"{_num(median(loads), '.2f')}, max {_num(max(loads) if loads else None, '.2f')}")
    if other:
        text += (f"; CPU used by everything else on the machine during the throughput phases "
                 f"(not the broker, proxy or producer): median {statistics.median(other):.2f} "
                 f"cores, max {max(other):.2f}")
    return text + f". Total run: {elapsed / 60:.1f} min."


def section(summaries: Sequence[Summary], checks: Sequence[TargetCheck], *, command: str,
            options: Options, repeats: int, scenarios: Sequence[Scenario], load: str,
            notes: Sequence[str], code: str) -> str:
    """The RESULTS.md section for this benchmark."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    described = "\n".join(f"  - **{s.name}**: {s.description}" for s in scenarios)
    records = ", ".join(f"{n:,} x {Case(size, 'none').label}"
                        for size, n in sorted(options.records.items()))
    offered = ", ".join(f"{s.case.label} {s.case.codec} {_num(s.offered_rps)}"
                        for s in summaries if s.scenario == "direct" and s.offered_rps)
    if offered:
        notes = [*notes, f"Paced (offered) load, records/s: {offered}."]
    extra = "".join(f"- {n}\n" for n in notes)
    budget = contention_note(summaries)
    if budget:
        budget = f"\n```\n{budget}\n```\n"
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv)

- Date: {now}; code: {code}
- Machine: {nproc} CPUs (nproc), {_cpu_model()}, {platform.system()} {platform.release()};
  shared with other work: {load}
- Python {platform.python_version()}; {_versions()}; broker {_tansu_version()} (memory
  storage); haproxy: {_haproxy_version(_haproxy_binary())}
- Producer: confluent-kafka in its own process; acks={options.acks},
  linger.ms={options.linger_ms:g}, max.in.flight={options.max_in_flight}, no keys, JSON values
  (1,000 distinct, lower case), {options.partitions} partitions, round-robin; a fresh broker
  (and proxy) per run, {options.warmup:,} warm-up records, then {records} records as fast as
  possible, then {options.latency_seconds:g} s paced at {options.load_fraction:.0%} of the
  direct scenario's throughput (from the first round).
- Scenarios:
{described}
- {repeats} rounds, scenarios interleaved and rotated each round; medians. "x direct" and
  "p99 added" are medians of per-round pairs against direct (for p99 added, the difference
  of the medians when no round has both latencies).
- rec/s and MB/s: throughput phase, MB = 10^6 bytes of record values (before compression).
  p50/p99: librdkafka's produce-to-acknowledgement latency of every record of the paced phase.
- proxy CPU: utime+stime of the proxy process (kiproxy or haproxy) from /proc. s/GB = CPU
  seconds per 10^9 bytes of record values; this is the same number as millicores per MB/s.
  "paced CPU" is the same measure in the paced phase (smaller batches, more per-request cost).
{extra}
{render_table(summaries)}

Targets (1 KiB records, uncompressed, acks={options.acks}, medians):

```
{render_targets(checks)}
```
{budget}"""


def write_results(text: str, path: Path = RESULTS) -> None:
    """Replace (or add) this benchmark's section of RESULTS.md, keeping the others."""
    old = path.read_text() if path.exists() else "# Benchmark results\n"
    path.write_text(replace_section(old, SECTION, text))


# --------------------------------------------------------------------------- profiling


def summarize_collapsed(text: str, top: int = 25) -> str:
    """Top functions by own and by total samples, from py-spy's ``--format raw`` output.

    Each line is ``frame;frame;...;leaf COUNT`` (root first).
    """
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in text.splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        samples += count
        frames = stack.split(";")
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + count
    if not samples:
        return "no samples"

    def block(title: str, table: dict[str, int]) -> list[str]:
        rows = sorted(table.items(), key=lambda kv: -kv[1])[:top]
        return [title, *[f"  {n / samples:6.1%}  {name}" for name, n in rows]]

    return "\n".join([f"{samples} samples",
                      *block("own (self) time:", own), *block("total (inclusive) time:", total)])


def profile(scenario: Scenario, case: Case, options: Options, out_dir: Path,
            log: Callable[[str], None], native: bool = False) -> int:
    """One run of ``scenario`` with py-spy attached to the proxy; prints the hot spots."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        log("py-spy not found: pip install py-spy (into the project virtualenv)")
        return 1
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"profile-{scenario.name}.txt"
    speedscope = out_dir / f"profile-{scenario.name}.speedscope.json"
    raw.unlink(missing_ok=True)

    @contextlib.contextmanager
    def recording(setup: _Setup) -> Iterator[None]:
        cmd = [py_spy, "record", "--pid", str(setup.pids["proxy"]), "--format", "raw",
               "-o", str(raw), "--rate", "100", "--subprocesses",
               *(["--native"] if native else [])]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True)
        time.sleep(1)  # let it attach before the producer starts
        try:
            yield
        finally:
            spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
            try:
                _, err = spy.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()
                _, err = spy.communicate()
            if spy.returncode not in (0, -signal.SIGINT) and err:
                log(f"py-spy: {err.strip().splitlines()[-1]}")

    result = run_once(scenario, case, 0, options, None, check=False, attach=recording)
    log(_progress(result))
    if not raw.exists():
        log(f"py-spy wrote no profile to {raw}")
        return 1
    text = raw.read_text()
    print(summarize_collapsed(text))
    log(f"collapsed stacks: {raw}")
    with contextlib.suppress(OSError):
        _collapsed_to_speedscope(text, speedscope)
        log(f"speedscope: {speedscope} (open at https://www.speedscope.app)")
    return 0


def _collapsed_to_speedscope(text: str, path: Path) -> None:
    frames: dict[str, int] = {}
    samples: list[list[int]] = []
    weights: list[int] = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples.append([frames.setdefault(f, len(frames)) for f in stack.split(";")])
        weights.append(int(count))
    doc = {
        "$schema": "https://www.speedscope.app/file-format-schema.json",
        "shared": {"frames": [{"name": n} for n in frames]},
        "profiles": [{"type": "sampled", "name": "kiproxy", "unit": "none", "startValue": 0,
                      "endValue": sum(weights), "samples": samples, "weights": weights}],
    }
    path.write_text(json.dumps(doc))


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 KiB uncompressed only, fewer records, 3 rounds: under 5 minutes; "
                        "prints the table without writing RESULTS.md (unless --write)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS),
                   help="comma-separated subset of " + ", ".join(SCENARIOS))
    p.add_argument("--sizes", help="record value sizes in bytes (default 100,1024)")
    p.add_argument("--codecs", help="producer compression.type values (default none,lz4,zstd)")
    p.add_argument("--repeats", type=int, help="rounds (default 3)")
    p.add_argument("--records", type=int,
                   help="throughput-phase records for 1 KiB values (2x as many for 100 B; "
                        "default 600000, quick 300000)")
    p.add_argument("--max-seconds", type=float,
                   help="the throughput phase stops producing after this long "
                        "(default 10, quick 4)")
    p.add_argument("--warmup", type=int, default=2000, help="warm-up records per producer")
    p.add_argument("--latency-seconds", type=float,
                   help="length of the paced phase (default 5, quick 2)")
    p.add_argument("--load-fraction", type=float, default=0.5,
                   help="paced load as a fraction of direct's throughput (default 0.5)")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--acks", default="1", choices=("0", "1", "all", "-1"))
    p.add_argument("--linger-ms", type=float, default=5.0)
    p.add_argument("--max-in-flight", type=int, default=5,
                   help="producer max.in.flight.requests.per.connection")
    p.add_argument("--workers", type=int,
                   help="pass --workers N to kiproxy run, if this kiproxy has that flag")
    p.add_argument("--write", action="store_true", help="update RESULTS.md even with --quick")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    p.add_argument("--json", metavar="PATH", help="also write every run's raw result here")
    p.add_argument("--profile", metavar="SCENARIO",
                   help="instead: one run of SCENARIO (1 KiB, uncompressed) under py-spy; "
                        "prints the hot spots")
    p.add_argument("--profile-dir", default=str(ROOT / "bench" / "out"),
                   help="where --profile writes its files (default bench/out)")
    p.add_argument("--native", action="store_true",
                   help="with --profile: also sample native (C/Cython) frames")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def _csv(text: str | None, default: Sequence[Any], kind: Callable[[str], Any]) -> list[Any]:
    return [kind(v.strip()) for v in text.split(",") if v.strip()] if text else list(default)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table and the targets, and update bench/RESULTS.md."""
    args = _parser().parse_args(argv)
    if args.worker:
        print(json.dumps(run_producer(json.loads(args.worker))))
        return 0

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    quick = args.quick
    names = _csv(args.scenarios, list(SCENARIOS), str)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        log(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
        return 2
    if "direct" in names:
        names.remove("direct")
    names.insert(0, "direct")  # every ratio and the paced load need it
    sizes = _csv(args.sizes, (1024,) if quick else SIZES, int)
    codecs = _csv(args.codecs, ("none",) if quick else CODECS, str)
    repeats = args.repeats or 3
    base_records = args.records or (300_000 if quick else 600_000)
    options = Options(
        records={size: base_records * 2 if size <= 256 else base_records for size in sizes},
        warmup=args.warmup, latency_seconds=args.latency_seconds or (2.0 if quick else 5.0),
        load_fraction=args.load_fraction, partitions=args.partitions,
        acks="-1" if args.acks == "all" else args.acks, linger_ms=args.linger_ms,
        max_in_flight=args.max_in_flight, proxy_flags=[],
        max_seconds=args.max_seconds or (4.0 if quick else 10.0),
    )
    notes: list[str] = []
    if args.workers is not None:
        if _kiproxy_has_flag("--workers"):
            options.proxy_flags += ["--workers", str(args.workers)]
            notes.append(f"kiproxy ran with --workers {args.workers}")
        else:
            msg = f"--workers {args.workers} ignored: this kiproxy's `run` has no --workers flag"
            log(msg)
            notes.append(msg)

    if args.profile:
        if args.profile not in SCENARIOS or SCENARIOS[args.profile].kind != "kiproxy":
            log(f"--profile needs a kiproxy scenario: "
                f"{', '.join(n for n, s in SCENARIOS.items() if s.kind == 'kiproxy')}")
            return 2
        options.records = {1024: args.records or 400_000}
        return profile(SCENARIOS[args.profile], Case(1024, "none"), options,
                       Path(args.profile_dir), log, native=args.native)

    unavailable: dict[str, str] = {}
    if "haproxy" in names and _haproxy_binary() is None:
        unavailable["haproxy"] = "haproxy not installed (apt-get install haproxy); skipped"
        log(unavailable["haproxy"])
        names.remove("haproxy")
        notes.append("haproxy was not found on this machine; its rows are n/a")
    scenarios = [SCENARIOS[n] for n in names]
    cases = [Case(size, codec) for size in sizes for codec in codecs]
    load_before = os.getloadavg()
    code = _code_version()
    log(f"{len(scenarios)} scenarios x {len(cases)} cases x {repeats} rounds; "
        f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    started = time.monotonic()
    results = run_matrix(scenarios, cases, repeats, options, log)
    elapsed = time.monotonic() - started
    load = _load_note(results, load_before, os.getloadavg(), elapsed)
    order = [*names, *unavailable]
    summaries = summarize(results, unavailable, order)
    checks = evaluate_targets(summaries)
    command = " ".join(["python -m bench.proxy", *(argv if argv is not None else sys.argv[1:])])
    text = section(summaries, checks, command=command, options=options, repeats=repeats,
                   scenarios=[*scenarios], load=load, notes=notes, code=code)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**dataclasses.asdict(r), "case": dataclasses.asdict(r.case)} for r in results],
            indent=1))
    if args.write or not (quick or args.no_write):
        write_results(text)
        log(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
