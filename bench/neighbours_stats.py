"""The neighbours benchmark's numbers: one run, medians over rounds, the table and the reading.

Pure values and functions, no processes (``bench/neighbours.py`` runs those):

* :func:`latency_summary` turns the small producer's per-record latencies into
  p50/p99/p99.9/max;
* :func:`batch_shape` reads librdkafka's statistics for the large producer's records
  and bytes (on the wire, compressed) per batch;
* :func:`fill_run` puts the two producers' reports into a :class:`Run`;
* :func:`summarize` takes medians over interleaved rounds, one :class:`Row` per path
  (kiproxy or direct) with and without the large producer, and :func:`added_p99` pairs
  "beside the large producer" with "alone" round by round;
* :func:`render_table`, :func:`render_comparison` and :func:`reading` print them next
  to :class:`BatchCost`, the proxy's CPU time for one large request measured
  in-process, and :func:`proxy_ms_per_batch`, the same read from the runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.proxy.stats import median, num, percentile

PATHS = ("kiproxy", "direct")
"""``kiproxy``: both producers through ``kiproxy run`` with uppercase; ``direct``: no proxy."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Latency:
    """The small producer's produce-to-acknowledgement latency over one run."""

    count: int
    p50_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float


def latency_summary(ms: Sequence[float]) -> Latency | None:
    """Percentiles of latencies in milliseconds; ``None`` when there are none."""
    if not ms:
        return None
    return Latency(count=len(ms), p50_ms=percentile(ms, 50), p99_ms=percentile(ms, 99),
                   p999_ms=percentile(ms, 99.9), max_ms=max(ms))


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchShape:
    """What the large producer's batches looked like (librdkafka's own statistics)."""

    batches: int
    """Batches counted."""
    records: float
    """Mean records per batch."""
    wire_bytes: float
    """Mean bytes per batch as sent (compressed)."""


def batch_shape(stats: Iterable[Mapping[str, Any]], topic: str) -> BatchShape | None:
    """Mean records and bytes per batch of ``topic`` over librdkafka statistics emissions.

    Each emission's ``topics.<topic>.batchcnt`` and ``batchsize`` are window statistics
    (reset at every emission), so their ``sum`` and ``cnt`` add up across emissions.
    """
    batches = records = size = 0
    for emission in stats:
        entry = emission.get("topics", {}).get(topic)
        if not entry:
            continue
        count, length = entry.get("batchcnt", {}), entry.get("batchsize", {})
        batches += int(count.get("cnt", 0))
        records += int(count.get("sum", 0))
        size += int(length.get("sum", 0))
    if not batches:
        return None
    return BatchShape(batches=batches, records=records / batches, wire_bytes=size / batches)


@dataclass(slots=True, kw_only=True)
class Run:
    """One run: the small producer's window, perhaps beside the large producer."""

    path: str
    """``kiproxy`` or ``direct``."""
    large: bool
    """Whether the large producer ran beside the small one."""
    round: int
    latency: Latency | None = None
    small_rps: float | None = None
    """The rate the small producer reached (it is paced)."""
    seconds: float = 0.0
    """The small producer's measured window."""
    proxy_cpu: float | None = None
    """CPU seconds of the proxy process in the window (``None`` for direct)."""
    broker_cpu: float | None = None
    other_cpu: float | None = None
    """CPU seconds of everything else on the machine in the window (a noise gauge)."""
    large_mbps: float | None = None
    """MB (10^6 bytes) per second of record values the large producer got acknowledged."""
    large_batch: BatchShape | None = None
    error: str | None = None
    load: float | None = None
    """1-minute load average when the run started."""

    @property
    def ok(self) -> bool:
        """The run finished without errors and measured the small producer."""
        return self.error is None and self.latency is not None

    @property
    def label(self) -> str:
        """``kiproxy + large`` and the like."""
        return f"{self.path} + large" if self.large else f"{self.path} alone"


def fill_run(run: Run, small: Mapping[str, Any], large: Mapping[str, Any] | None) -> None:
    """Copy the producers' reports (the JSON their processes print) into ``run``."""
    cpu = small.get("cpu") or {}
    latency = small.get("latency")
    run.latency = Latency(**latency) if latency else None
    run.seconds = float(small.get("seconds", 0.0))
    records = int(small.get("records", 0))
    run.small_rps = records / run.seconds if run.seconds > 0 else None
    run.proxy_cpu = cpu.get("proxy")
    run.broker_cpu = cpu.get("broker")
    run.other_cpu = cpu.get("other")
    errors = [f"small producer: {small['error']}"] if small.get("error") else []
    if large is not None:
        run.large_mbps = large.get("mbps")
        shape = large.get("batch")
        run.large_batch = BatchShape(**shape) if shape else None
        if large.get("error"):
            errors.append(f"large producer: {large['error']}")
    run.error = "; ".join(errors) or None


def cores(cpu_seconds: float | None, wall_seconds: float) -> float | None:
    """Average cores used: CPU seconds over wall seconds."""
    return None if cpu_seconds is None or wall_seconds <= 0 else cpu_seconds / wall_seconds


@dataclass(slots=True, kw_only=True)
class Row:
    """Medians of one path's runs with or without the large producer."""

    path: str
    large: bool
    runs: int
    ok_runs: int
    p50_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    max_ms: float | None = None
    small_rps: float | None = None
    large_mbps: float | None = None
    batch_records: float | None = None
    batch_kb: float | None = None
    """Mean kB (10^3 bytes) per large batch on the wire."""
    proxy_cores: float | None = None
    broker_cores: float | None = None
    other_cores: float | None = None


def summarize(runs: Sequence[Run]) -> list[Row]:
    """One row per path, alone then beside the large producer; failed runs left out."""
    rows = []
    for path in PATHS:
        for large in (False, True):
            mine = [r for r in runs if r.path == path and r.large == large]
            if not mine:
                continue
            ok = [r for r in mine if r.ok]
            lat = [r.latency for r in ok if r.latency is not None]
            shapes = [r.large_batch for r in ok if r.large_batch is not None]
            rows.append(Row(
                path=path, large=large, runs=len(mine), ok_runs=len(ok),
                p50_ms=median(x.p50_ms for x in lat), p99_ms=median(x.p99_ms for x in lat),
                p999_ms=median(x.p999_ms for x in lat), max_ms=median(x.max_ms for x in lat),
                small_rps=median(r.small_rps for r in ok),
                large_mbps=median(r.large_mbps for r in ok),
                batch_records=median(s.records for s in shapes),
                batch_kb=median(s.wire_bytes / 1000 for s in shapes),
                proxy_cores=median(cores(r.proxy_cpu, r.seconds) for r in ok),
                broker_cores=median(cores(r.broker_cpu, r.seconds) for r in ok),
                other_cores=median(cores(r.other_cpu, r.seconds) for r in ok)))
    return rows


def added_p99(runs: Sequence[Run], path: str) -> tuple[float | None, list[float]]:
    """The small producer's p99 beside the large producer minus alone, on ``path``.

    Returns the median of the per-round differences and the differences themselves
    (rounds where both runs succeeded).
    """
    by_round: dict[tuple[int, bool], float] = {}
    for r in runs:
        if r.path == path and r.ok and r.latency is not None:
            by_round[(r.round, r.large)] = r.latency.p99_ms
    pairs = [by_round[(n, True)] - by_round[(n, False)]
             for n in sorted({n for n, _ in by_round})
             if (n, True) in by_round and (n, False) in by_round]
    return median(pairs), pairs


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchCost:
    """The proxy's CPU time for one large request, measured in-process (no sockets)."""

    records: int
    """Records in the request's one batch (1 KiB values, zstd)."""
    request_bytes: int
    """The Produce request's size as sent (compressed)."""
    ms: float
    """CPU milliseconds of ``ProducePipeline.handle`` with uppercase: decode, transform,
    re-encode, rebuild the request (best of the repeats)."""


def render_table(rows: Sequence[Row]) -> str:
    """The markdown table, one line per :class:`Row`."""
    head = ["path", "large producer", "small p50 ms", "p99 ms", "p99.9 ms", "max ms",
            "small rec/s", "large MB/s", "large rec/batch", "large kB/batch (wire)",
            "proxy cores", "broker cores", "other cores", "runs"]
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 3) + "---|"]
    for row in rows:
        lines.append("| " + " | ".join([
            row.path, "yes" if row.large else "no", num(row.p50_ms, ".2f"),
            num(row.p99_ms, ".2f"), num(row.p999_ms, ".2f"), num(row.max_ms, ".1f"),
            num(row.small_rps), num(row.large_mbps, ".1f"), num(row.batch_records),
            num(row.batch_kb, ",.0f"), num(row.proxy_cores, ".2f"),
            num(row.broker_cores, ".2f"), num(row.other_cores, ".2f"),
            f"{row.ok_runs}/{row.runs}"]) + " |")
    return "\n".join(lines)


def proxy_ms_per_batch(rows: Sequence[Row], value_size: int = 1024) -> float | None:
    """The proxy's CPU per large batch in the runs themselves (sockets and all).

    The proxy's cores beside the large producer less its cores alone (the small
    producer's share), over the large batches carried per second.
    """
    by = {(r.path, r.large): r for r in rows}
    alone, beside = by.get(("kiproxy", False)), by.get(("kiproxy", True))
    if alone is None or beside is None:
        return None
    used, small_share = beside.proxy_cores, alone.proxy_cores
    mbps, records = beside.large_mbps, beside.batch_records
    if used is None or small_share is None or not mbps or not records:
        return None
    batches_per_s = mbps * 1e6 / (records * value_size)
    return (used - small_share) / batches_per_s * 1000


def render_comparison(runs: Sequence[Run], cost: BatchCost | None) -> str:
    """The small producer's added p99 per path, the proxy's share, and one batch's cost."""
    proxied, proxied_pairs = added_p99(runs, "kiproxy")
    direct, direct_pairs = added_p99(runs, "direct")
    share = None if proxied is None or direct is None else proxied - direct

    def rounds(pairs: list[float]) -> str:
        return ", ".join(f"{p:+.2f}" for p in pairs) or "no complete round"

    lines = [
        f"small p99 added by the large producer, through kiproxy: {num(proxied, '+.2f')} ms"
        f" (per round: {rounds(proxied_pairs)})",
        f"small p99 added by the large producer, direct:          {num(direct, '+.2f')} ms"
        f" (per round: {rounds(direct_pairs)})",
        f"kiproxy's share (through kiproxy minus direct):         {num(share, '+.2f')} ms",
    ]
    if cost is None:
        lines.append("one batch's cost: not measured")
        return "\n".join(lines)
    lines.append(f"one batch's cost (uppercase, {cost.records:,} x 1 KiB zstd records, "
                 f"{cost.request_bytes / 1000:,.0f} kB request): {cost.ms:.2f} ms CPU")
    in_run = proxy_ms_per_batch(summarize(runs))
    lines.append(f"proxy CPU per large batch in the runs (cores beside less alone, over "
                 f"batches/s): {num(in_run, '.2f')} ms")
    for name, value in (("through kiproxy", proxied), ("kiproxy's share", share)):
        if value is not None and cost.ms > 0:
            lines.append(f"{name} / one batch's cost: {value / cost.ms:.2f}"
                         f" ({'within' if value <= cost.ms else 'over'} one batch)")
    return "\n".join(lines)


def reading(runs: Sequence[Run], cost: BatchCost | None) -> str:
    """A few factual sentences on the comparison, for RESULTS.md (edit by hand if need be)."""
    rows = {(r.path, r.large): r for r in summarize(runs)}
    proxied, pairs = added_p99(runs, "kiproxy")
    direct, _ = added_p99(runs, "direct")
    alone, beside = rows.get(("kiproxy", False)), rows.get(("kiproxy", True))
    if proxied is None or alone is None or beside is None:
        return "No round completed both kiproxy runs; nothing to read."
    text = (f"Through kiproxy the small producer's p99 went from {num(alone.p99_ms, '.2f')} ms "
            f"alone to {num(beside.p99_ms, '.2f')} ms beside the large producer "
            f"({proxied:+.2f} ms, median of {len(pairs)} per-round difference(s)), while the "
            f"large producer carried {num(beside.large_mbps, '.1f')} MB/s of values through "
            f"uppercase and the proxy used {num(beside.proxy_cores, '.2f')} cores.")
    direct_row = rows.get(("direct", True))
    if direct is not None and direct_row is not None:
        text += (f" Straight to the broker the same pair added {direct:+.2f} ms (the large "
                 f"producer at {num(direct_row.large_mbps, '.1f')} MB/s): that much comes "
                 f"from the broker and the shared cores, not the proxy.")
    if cost is not None and cost.ms > 0:
        share = proxied - direct if direct is not None else proxied
        what = "kiproxy's share" if direct is not None else "the added p99"
        verdict = "within" if share <= cost.ms else "more than"
        text += (f" {what[0].upper() + what[1:]}, {share:+.2f} ms, is {verdict} one batch's "
                 f"cost ({cost.ms:.2f} ms CPU for one {cost.records:,}-record zstd request "
                 f"through uppercase, {share / cost.ms:.2f}x).")
    others = [c for c in (row.other_cores for row in rows.values()) if c is not None]
    if others:
        text += (f" Other work on the machine used up to {max(others):.2f} cores during the "
                 f"runs; p99.9 and max rest on a handful of records each.")
    return text

