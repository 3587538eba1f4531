"""``python -m bench.proxy``: the command line, the rounds of the matrix and the profile run.

The benchmark itself is described in :mod:`bench.proxy` (the package docstring).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench.proxy.render import code_version, load_note, section
from bench.proxy.run import Options, Setup, haproxy_binary, kiproxy_has_flag, run_once, run_producer
from bench.proxy.scenarios import CODECS, ROOT, SCENARIOS, SIZES, Case, Scenario
from bench.proxy.stats import RunResult, evaluate_targets, num, summarize
from bench.results import RESULTS, write_results

__all__ = ["main", "paced_load", "profile", "rotated", "run_matrix", "split_cpus",
           "summarize_collapsed"]


def rotated(items: Sequence[str], by: int) -> list[str]:
    """``items`` rotated left ``by`` places (round ``r`` starts with scenario ``r``)."""
    if not items:
        return []
    by %= len(items)
    return [*items[by:], *items[:by]]


def paced_load(capacity: Sequence[RunResult], fraction: float,
               pace_of: Sequence[str]) -> dict[Case, float]:
    """``fraction`` of the slowest throughput among ``pace_of`` per case (capacity round)."""
    out: dict[Case, float] = {}
    for r in capacity:
        if r.ok and r.scenario in pace_of and r.rps:
            out[r.case] = min(out.get(r.case, r.rps), r.rps)
    return {case: rps * fraction for case, rps in out.items()}


def run_matrix(scenarios: Sequence[Scenario], cases: Sequence[Case], repeats: int,
               options: Options, log: Callable[[str], None],
               pace_of: Sequence[str] | None = None,
               fixed_rps: float | None = None) -> list[RunResult]:
    """Every scenario for every case, ``repeats`` rounds, interleaved and rotated.

    With ``pace_of``, a capacity round (throughput only, round 0) comes first and every
    paced phase offers ``load_fraction`` of the slowest of those scenarios' throughput
    in it; without, the paced load is that fraction of direct's throughput in round 1.
    ``fixed_rps`` paces every case at that rate.
    """
    results: list[RunResult] = []
    offered: dict[Case, float] = {case: fixed_rps for case in cases} if fixed_rps else {}
    names = [s.name for s in scenarios]
    first = 0
    if pace_of is not None and not fixed_rps:
        capacity_options = dataclasses.replace(options, latency_seconds=0.0)
        for case in cases:
            for name in names:
                r = run_once(SCENARIOS[name], case, 0, capacity_options, None,
                             check=SCENARIOS[name].kind == "kiproxy")
                results.append(r)
                log(_progress(r))
        offered = paced_load(results, options.load_fraction, pace_of)
        log("paced load, records/s: " + ", ".join(
            f"{c.label} {c.codec} {num(v)}" for c, v in offered.items()))
        first = 1
    for round_ in range(first, first + repeats):
        for case in cases:
            order = rotated(names, round_)
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
    latency = (
        "capacity round" if r.offered_rps is None else
        f"over capacity for {num(r.offered_rps)} rec/s" if r.saturated else
        f"p50 {num(r.p50_ms, '.2f')} p99 {num(r.p99_ms, '.2f')} ms "
        f"@ {num(r.paced_rps)}/{num(r.offered_rps)} rec/s "
        f"(cores: producer {num(_cores(r.paced_producer_cpu, r.paced_seconds), '.2f')} "
        f"broker {num(_cores(r.paced_broker_cpu, r.paced_seconds), '.2f')} "
        f"proxy {num(_cores(r.paced_proxy_cpu, r.paced_seconds), '.2f')} "
        f"other {num(_cores(r.paced_other_cpu, r.paced_seconds), '.2f')})")
    return (f"{head} {num(r.rps):>9} rec/s {num(r.mbps(), '6.1f')} MB/s  {latency}  "
            f"proxy {num(r.cpu_s_per_gb(), '.1f')} s/GB  cores: "
            f"producer {num(_cores(r.producer_cpu, r.seconds), '.2f')} "
            f"broker {num(_cores(r.broker_cpu, r.seconds), '.2f')} "
            f"proxy {num(_cores(r.proxy_cpu, r.seconds), '.2f')} "
            f"other {num(_cores(r.other_cpu, r.seconds), '.2f')}  "
            f"({r.seconds:.1f} s, load {num(r.load, '.2f')})")


def _cores(cpu_seconds: float | None, wall_seconds: float) -> float | None:
    return None if cpu_seconds is None or wall_seconds <= 0 else cpu_seconds / wall_seconds



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
    def recording(setup: Setup) -> Iterator[None]:
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


def _package_doc() -> str:
    """The benchmark's description: the package docstring."""
    import bench.proxy

    return bench.proxy.__doc__ or ""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.proxy", description=_package_doc(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="1 KiB uncompressed only, fewer records, 3 rounds: under 5 minutes; "
                        "prints the table without writing RESULTS.md (unless --write)")
    p.add_argument("--scenarios",
                   default=",".join(n for n, s in SCENARIOS.items() if s.by_default),
                   help="comma-separated subset of " + ", ".join(SCENARIOS)
                   + " (default: all but "
                   + ", ".join(n for n, s in SCENARIOS.items() if not s.by_default) + ")")
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
                   help="paced load as a fraction of the pace's throughput (default 0.5)")
    p.add_argument("--pace-of", metavar="SCENARIOS",
                   help="pace at --load-fraction of the slowest of these scenarios, measured "
                        "in a capacity round run first (default: every scenario run); "
                        "'direct' alone paces at direct's throughput in round 1, no "
                        "capacity round")
    p.add_argument("--pace-rps", type=float,
                   help="pace every case at this many records/s instead (for A/B runs of "
                        "two trees at the same load); no capacity round")
    p.add_argument("--latency-sample", type=int, default=1, metavar="N",
                   help="time a random 1 in N records of the paced phase (default 1: every "
                        "record); untimed records cost the producer no delivery callback")
    p.add_argument("--others-nice", type=int, default=0, metavar="N",
                   help="run the broker and the producer N nice steps below the hop "
                        "(kiproxy or haproxy alike): the hop gets the CPU first, as with cores "
                        "reserved for it (default 0: all at the same priority)")
    p.add_argument("--partitions", type=int, default=3)
    p.add_argument("--acks", default="1", choices=("0", "1", "all", "-1"))
    p.add_argument("--linger-ms", type=float, default=5.0)
    p.add_argument("--max-in-flight", type=int, default=5,
                   help="producer max.in.flight.requests.per.connection")
    p.add_argument("--connections", type=int, default=1,
                   help="producer instances in the throughput phase, each with connections "
                        "of its own (so that --workers has connections to spread)")
    p.add_argument("--workers", type=int,
                   help="pass --workers N to kiproxy run, if this kiproxy has that flag")
    p.add_argument("--proxy-cpus", metavar="CPUS",
                   help="give the hop (kiproxy or haproxy) these CPUs (e.g. 1 or 2,3) and the "
                        "broker and the producer the others; default: every process may run "
                        "on every CPU")
    p.add_argument("--write", action="store_true", help="update RESULTS.md even with --quick")
    p.add_argument("--kiproxy-arg", action="append", default=[], metavar="ARG",
                   help="pass ARG to every kiproxy scenario's `kiproxy run` (repeat it: "
                        "--kiproxy-arg=--compression-zstd-level --kiproxy-arg=1)")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    p.add_argument("--json", metavar="PATH", help="also write every run's raw result here")
    p.add_argument("--profile", metavar="SCENARIO",
                   help="instead: one run of SCENARIO under py-spy (the first of --sizes and "
                        "--codecs; default 1 KiB, uncompressed); prints the hot spots")
    p.add_argument("--profile-dir", default=str(ROOT / "bench" / "out"),
                   help="where --profile writes its files (default bench/out)")
    p.add_argument("--native", action="store_true",
                   help="with --profile: also sample native (C/Cython) frames")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def split_cpus(text: str) -> set[int]:
    """CPUs named like ``1`` or ``2,3`` or ``0-3``: a proper subset of those this process has."""
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"--proxy-cpus {text!r}: expected CPU numbers like 1 or 2,3 or 0-3")
        cpus.update(range(int(first), int(last or first) + 1))
    mine = os.sched_getaffinity(0)
    if not cpus or not cpus < mine:
        raise ValueError(f"--proxy-cpus {text!r}: must leave at least one of this process's "
                         f"CPUs ({','.join(map(str, sorted(mine)))}) for the broker and producer")
    return cpus


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
        max_in_flight=args.max_in_flight, proxy_flags=list(args.kiproxy_arg),
        max_seconds=args.max_seconds or (4.0 if quick else 10.0),
        connections=args.connections, latency_sample=args.latency_sample,
        others_nice=args.others_nice,
    )
    notes: list[str] = []
    if args.latency_sample < 1:
        log(f"--latency-sample must be 1 or more, not {args.latency_sample}")
        return 2
    if args.latency_sample > 1:
        notes.append(f"the paced phase timed a random 1 in {args.latency_sample} records "
                     "(the others carried no delivery callback)")
    if not 0 <= args.others_nice <= 19:
        log(f"--others-nice must be 0..19, not {args.others_nice}")
        return 2
    if args.others_nice:
        notes.append(f"the broker and the producer ran {args.others_nice} nice steps below "
                     "the hop (kiproxy or haproxy), which got the CPU first")
    if args.proxy_cpus:
        try:
            options.proxy_cpus = split_cpus(args.proxy_cpus)
        except ValueError as exc:
            log(str(exc))
            return 2
        rest = sorted(os.sched_getaffinity(0) - options.proxy_cpus)
        os.sched_setaffinity(0, rest)  # the broker and the producer inherit it
        notes.append(f"the hop ran on CPU {','.join(map(str, sorted(options.proxy_cpus)))}, "
                     f"the broker and the producer on CPU {','.join(map(str, rest))} "
                     "(--proxy-cpus); direct used those CPUs only")
    if args.kiproxy_arg:
        notes.append(f"kiproxy ran with {' '.join(args.kiproxy_arg)}")
    if args.connections > 1:
        notes.append(f"throughput phase: {args.connections} producers, each with its own "
                     "connections, taking turns by 1,000 records")
    if args.workers is not None:
        if kiproxy_has_flag("--workers"):
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
        case = Case(sizes[0] if args.sizes else 1024, codecs[0] if args.codecs else "none")
        options.records = {case.value_size: args.records or 400_000}
        return profile(SCENARIOS[args.profile], case, options,
                       Path(args.profile_dir), log, native=args.native)

    unavailable: dict[str, str] = {}
    if "haproxy" in names and haproxy_binary() is None:
        unavailable["haproxy"] = "haproxy not installed (apt-get install haproxy); skipped"
        log(unavailable["haproxy"])
        names.remove("haproxy")
        notes.append("haproxy was not found on this machine; its rows are n/a")
    scenarios = [SCENARIOS[n] for n in names]
    cases = [Case(size, codec) for size in sizes for codec in codecs]
    load_before = os.getloadavg()
    code = code_version()
    log(f"{len(scenarios)} scenarios x {len(cases)} cases x {repeats} rounds; "
        f"load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}")
    started = time.monotonic()
    pace_of = _csv(args.pace_of, names, str)
    if args.pace_rps:
        results = run_matrix(scenarios, cases, repeats, options, log,
                             fixed_rps=args.pace_rps)
        pace = f"a fixed {args.pace_rps:,.0f} records/s (--pace-rps); no capacity round"
    elif pace_of == ["direct"]:
        results = run_matrix(scenarios, cases, repeats, options, log)
        pace = "the direct scenario's throughput (from the first round)"
    else:
        results = run_matrix(scenarios, cases, repeats, options, log, pace_of)
        pace = (f"the slowest throughput among {', '.join(pace_of)} in a capacity round "
                f"(throughput only) run first; the {repeats} rounds after it are paced")
    elapsed = time.monotonic() - started
    load = load_note(results, load_before, os.getloadavg(), elapsed)
    order = [*names, *unavailable]
    summaries = summarize(results, unavailable, order)
    checks = evaluate_targets(summaries)
    command = " ".join(["python -m bench.proxy", *(argv if argv is not None else sys.argv[1:])])
    report = functools.partial(section, summaries, checks, command=command, results=results,
                               options=options, repeats=repeats, scenarios=[*scenarios],
                               load=load, notes=notes, code=code, pace=pace)
    print(report())
    text = report(details=False)  # RESULTS.md: the setup and the table
    if args.json:
        Path(args.json).write_text(json.dumps(
            [{**dataclasses.asdict(r), "case": dataclasses.asdict(r.case)} for r in results],
            indent=1))
    if args.write or not (quick or args.no_write):
        write_results(text, "proxy")
        log(f"wrote {RESULTS}")
    return 0


