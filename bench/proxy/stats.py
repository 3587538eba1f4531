"""The proxy benchmark's numbers: per-run results, medians across rounds, and targets.

Pure functions and values, no processes: :class:`RunResult` is one run of one
scenario and case, :func:`summarize` takes the medians of interleaved rounds
(ratios and added latency as medians of per-round pairs against ``direct``),
and :func:`evaluate_targets` checks a summary against the :data:`TARGETS`.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from bench.proxy.scenarios import GB, MB, Case


def num(value: float | None, fmt: str = ",.0f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


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
    proxy_minflt: int | None = None
    """Minor page faults of the proxy process in the throughput phase."""
    proxy_rss: int | None = None
    """The proxy's resident memory after the throughput phase, in bytes."""
    proxy_peak_rss: int | None = None
    """The proxy's peak resident memory (VmHWM) up to then, in bytes."""
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
    paced_producer_cpu: float | None = None
    """CPU seconds of the paced producer's process (its Python loop and librdkafka)."""
    paced_broker_cpu: float | None = None
    latency_sample: int = 1
    """The paced phase timed a random 1 in this many records."""
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
    cpu_vs_haproxy: float | None = None
    """The proxy's CPU per GB over haproxy's, median of per-round pairs."""
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
    haproxy = {(r.case, r.round): r for r in results if r.scenario == "haproxy" and r.ok}
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
            cpu_ratios = [ratio(r.cpu_s_per_gb(), h.cpu_s_per_gb()) for r in good
                          if (h := haproxy.get((case, r.round))) is not None]
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
                cpu_vs_haproxy=median(cpu_ratios) if name != "haproxy" else None,
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



@dataclass(frozen=True, slots=True)
class Target:
    """A goal on one metric of one scenario, for one record size and codec."""

    scenario: str
    metric: str
    """``vs_direct``, ``cpu`` (millicores per MB/s), ``cpu_vs_haproxy`` or ``p99_added_ms``."""
    bound: float
    at_least: bool
    """The value must be >= bound (else <=)."""
    case: Case = Case(1024, "none")  # noqa: RUF009 - a frozen (immutable) value

    @property
    def label(self) -> str:
        """What is compared, in words."""
        what = {"vs_direct": "throughput / direct", "cpu": "proxy millicores per MB/s",
                "cpu_vs_haproxy": "proxy CPU per GB / haproxy's",
                "p99_added_ms": "p99 latency added (ms)"}[self.metric]
        return (f"{self.scenario} {self.case.label} {self.case.codec}: {what} "
                f"{'>=' if self.at_least else '<='} {self.bound:g}")


TARGET_CASE = Case(1024, "none")
_EVERY_CASE = tuple(Case(size, codec) for size in (100, 1024) for codec in ("none", "lz4", "zstd"))
_UNCOMPRESSED = (Case(1024, "none"), Case(100, "none"))
TARGETS: tuple[Target, ...] = (
    Target("passthrough", "vs_direct", 0.95, True),
    Target("identity", "vs_direct", 0.90, True),
    Target("uppercase", "vs_direct", 0.80, True),
    Target("passthrough", "cpu", 10, False),
    Target("uppercase", "cpu", 25, False),
    *(Target(name, "cpu_vs_haproxy", bound, False, case) for case in _UNCOMPRESSED
      for name, bound in (("passthrough", 1.2), ("identity", 2.0), ("uppercase", 4.0),
                          ("readme", 4.0), ("no_secrets", 4.0))),
    *(Target(name, "p99_added_ms", bound, False, case) for case in _EVERY_CASE
      for name, bound in (("passthrough", 1.0), ("identity", 2.0), ("uppercase", 2.0))),
)
"""The goals: throughput and CPU (1 KiB uncompressed), CPU against haproxy in the same
round (uncompressed, both sizes), p99 added at the paced load (every size and codec)."""


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


def evaluate_targets(summaries: Sequence[Summary],
                     targets: Sequence[Target] = TARGETS) -> list[TargetCheck]:
    """Check every target whose record size and codec was run against its medians."""
    by_key = {(s.scenario, s.case): s for s in summaries}
    ran = {s.case for s in summaries}
    checks = []
    for t in targets:
        if t.case not in ran:
            continue
        s = by_key.get((t.scenario, t.case))
        value = None
        if s is not None:
            # millicores per MB/s equals CPU seconds per GB (see millicores_per_mbps).
            value = s.cpu_s_per_gb if t.metric == "cpu" else getattr(s, t.metric)
        checks.append(TargetCheck(t, value))
    return checks



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
             f"(direct, {num(direct.mbps, '.0f')} MB/s). While the cores are saturated a hop "
             f"spending p s/GB leaves at most {stack:.1f} / ({stack:.1f} + p) of direct's "
             f"throughput; {goal:.2f} needs p <= {stack * (1 / goal - 1):.2f} s/GB."]
    for name, s in rows.items():
        expected = cpu_bound_ratio(stack, s.cpu_s_per_gb)
        if name == "direct" or expected is None:
            continue
        user = "" if s.proxy_user_share is None else f" ({s.proxy_user_share:.0%} user space)"
        lines.append(f"  {name}: p = {s.cpu_s_per_gb:.2f} s/GB{user} -> CPU-bound ratio "
                     f"{expected:.2f}, measured {num(s.vs_direct, '.2f')}")
    return "\n".join(lines)
