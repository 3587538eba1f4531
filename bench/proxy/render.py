"""Rendering the proxy benchmark: the results table, the targets and the RESULTS.md section.

:func:`section` is the whole ``## Proxy: end to end`` section: the command,
the machine, the versions, the median table (:func:`render_table`) and the
targets (:func:`render_targets`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path

from bench.proxy.run import Options, haproxy_binary
from bench.proxy.scenarios import ROOT, SECTION, Case, Scenario
from bench.proxy.stats import RunResult, Summary, TargetCheck, contention_note, median, num


def render_table(summaries: Sequence[Summary]) -> str:
    """The markdown results table."""
    head = ["records", "codec", "scenario", "rec/s", "MB/s", "x direct", "p50 ms", "p99 ms",
            "p99 added ms", "proxy CPU s/GB", "CPU x haproxy", "proxy CPU s/M rec",
            "paced CPU s/GB", "runs"]
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
            s.case.label, s.case.codec, s.scenario, num(s.rps), num(s.mbps, ",.1f"),
            num(s.vs_direct, ".2f"), num(s.p50_ms, ".2f", over), num(s.p99_ms, ".2f", over),
            num(s.p99_added_ms, "+.2f", over), num(s.cpu_s_per_gb, ".1f"),
            num(s.cpu_vs_haproxy, ".1f"), num(s.cpu_s_per_mrec, ".1f"),
            num(s.paced_cpu_s_per_gb, ".1f"), runs,
        ]) + " |")
    return "\n".join(lines)



def render_rounds(results: Sequence[RunResult], scenarios: Sequence[str]) -> str:
    """p99 added per round: each scenario's paced p99 minus direct's in the same round,
    with the producer's CPU per record in that run's throughput phase, a gauge of how
    fast the machine was then (the producer does the same work in every run of a case).

    The medians in the table hide the spread; this shows whether a miss is one round.
    """
    names = [n for n in scenarios if n != "direct"]
    head = ["records", "codec", "round", "direct p99 ms",
            *(f"{n} +ms (producer us/rec)" for n in names)]
    lines = ["| " + " | ".join(head) + " |", "|---|---|---|" + "---:|" * (len(head) - 3)]
    runs = {(r.case, r.round, r.scenario): r for r in results if r.ok}
    rounds = sorted({r.round for r in results if r.ok and r.p99_ms is not None})
    for case in dict.fromkeys(r.case for r in results):
        for round_ in rounds:
            direct = runs.get((case, round_, "direct"))
            if direct is None or direct.p99_ms is None:
                continue
            cells = [f"{direct.p99_ms:.2f} ({_producer_us(direct)})"]
            for name in names:
                run = runs.get((case, round_, name))
                if run is None or run.p99_ms is None:
                    cells.append("-")
                    continue
                cells.append(f"{run.p99_ms - direct.p99_ms:+.2f} ({_producer_us(run)})")
            lines.append("| " + " | ".join([case.label, case.codec, str(round_), *cells]) + " |")
    return "\n".join(lines)


def _producer_us(run: RunResult) -> str:
    return num(None if run.producer_cpu is None else run.producer_cpu / run.records * 1e6, ".2f")


def render_targets(checks: Sequence[TargetCheck]) -> str:
    """One line per target."""
    return "\n".join(c.describe() for c in checks)



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


def code_version() -> str:
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
        from kiproxy_dev.tansu import broker_binary

        return Path(broker_binary()).name
    except Exception as exc:
        return f"unavailable ({exc})"


def load_note(results: Sequence[RunResult], load_before: tuple[float, float, float],
               load_after: tuple[float, float, float], elapsed: float) -> str:
    loads = [r.load for r in results if r.load is not None]
    other = [r.other_cpu / r.seconds for r in results
             if r.ok and r.other_cpu is not None and r.seconds > 0]
    text = (f"load average {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} "
            f"(1/5/15 min) before the run, {load_after[0]:.2f} / {load_after[1]:.2f} / "
            f"{load_after[2]:.2f} after; 1-min load at the start of each run: median "
            f"{num(median(loads), '.2f')}, max {num(max(loads) if loads else None, '.2f')}")
    if other:
        text += (f"; CPU used by everything else on the machine during the throughput phases "
                 f"(not the broker, proxy or producer): median {statistics.median(other):.2f} "
                 f"cores, max {max(other):.2f}")
    return text + f". Total run: {elapsed / 60:.1f} min."


def section(summaries: Sequence[Summary], checks: Sequence[TargetCheck], *, command: str,
            results: Sequence[RunResult], options: Options, repeats: int,
            scenarios: Sequence[Scenario], load: str, notes: Sequence[str], code: str,
            pace: str = "direct's throughput", details: bool = True) -> str:
    """This benchmark's report: the setup and the table, then (``details``) the targets,
    the CPU budget and the p99 added in each round. RESULTS.md keeps the first part."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    timed = ("every record" if options.latency_sample <= 1 else
             f"a random 1 in {options.latency_sample} records")
    nproc = (len(os.sched_getaffinity(0) | (options.proxy_cpus or set()))
             if hasattr(os, "sched_getaffinity") else os.cpu_count())
    named = ", ".join(s.name for s in scenarios)
    records = ", ".join(f"{n:,} x {Case(size, 'none').label}"
                        for size, n in sorted(options.records.items()))
    offered = ", ".join(f"{s.case.label} {s.case.codec} {num(s.offered_rps)}"
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
- Machine: {nproc} CPUs (nproc), {_cpu_model()}, {platform.system()} {platform.release()}; \
shared with other work: {load}
- Python {platform.python_version()}; {_versions()}; broker {_tansu_version()} (memory \
storage); haproxy: {_haproxy_version(haproxy_binary())}
- Producer: confluent-kafka in its own process; acks={options.acks}, \
linger.ms={options.linger_ms:g}, max.in.flight={options.max_in_flight}, no keys, JSON values \
(1,000 distinct, lower case), {options.partitions} partitions, round-robin; a fresh broker \
(and proxy) per run, {options.warmup:,} warm-up records, then {records} records as fast as \
possible, then {options.latency_seconds:g} s paced at {options.load_fraction:.0%} of {pace}.
- Scenarios (each described in `bench/proxy/scenarios.py`): {named}.
- {repeats} rounds, scenarios interleaved and rotated each round; medians. "x direct" and \
"p99 added" are medians of per-round pairs against direct (for p99 added, the difference \
of the medians when no round has both latencies).
- rec/s and MB/s: throughput phase, MB = 10^6 bytes of record values (before compression). \
p50/p99: librdkafka's produce-to-acknowledgement latency of {timed} of the paced phase.
- proxy CPU: utime+stime of the proxy process (kiproxy or haproxy) from /proc. s/GB = CPU \
seconds per 10^9 bytes of record values; this is the same number as millicores per MB/s. \
"paced CPU" is the same measure in the paced phase (smaller batches, more per-request cost).
{extra}
{render_table(summaries)}
""" + (f"""
Targets (acks={options.acks}, medians; "CPU x haproxy" is the median of per-round
ratios to haproxy's CPU per GB):

```
{render_targets(checks)}
```
{budget}
p99 added in each paced round (ms, against direct in the same round; in brackets the
producer's CPU us per record in that run's throughput phase, which rises when the
machine is slow for everyone):

{render_rounds(results, [s.name for s in scenarios])}
""" if details else "")
