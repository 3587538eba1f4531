"""End-to-end A/B of two trees of kiproxy: the base commit (A) against this tree (B).

Run from the repository root with the project's virtualenv::

    python -m bench.ab --base 0b6c14d            # 3 rounds (~15 min); updates bench/RESULTS.md
    python -m bench.ab --base HEAD~1 --quick     # 2 rounds, shorter phases; prints only

Every change to the hot path runs it. The base commit is exported (``git
archive``) into a directory of its own under the system's temporary directory
and its Cython extensions are built there in place with this virtualenv's
Python (kept, keyed by the commit, for the next run; ``--rebuild`` builds it
again). B is this working tree as it is, uncommitted changes included. Both
run in the same run, with the same broker binary, producer and libraries: only
the proxy's own code differs.

Each round runs every scenario once with each tree, A first in even rounds and
B first in odd ones, and haproxy (``mode tcp``, the floor a proxy that does not
read Kafka pays) once when it is installed (``make haproxy-deps``). Each run
starts a fresh broker (Tansu, memory storage) and proxy, then measures, against
that one proxy:

* **CPU per GB**: the throughput phase of :mod:`bench.proxy` (``--records``,
  400,000, 1 KiB JSON records, uncompressed, linger 5 ms): the proxy's CPU seconds per
  GB of record values, which is also its millicores per MB/s.
* **p99 at a paced rate**: the same producer's paced phase at ``--pace-rps``
  records/s (the same rate for both trees): librdkafka's produce-to-ack p99.
* **CPU per request**: :mod:`bench.proxy.one_record`, ``--connections``
  connections each sending one 100-byte record per Produce request and waiting
  for its ack: the proxy's CPU microseconds per request.

CPU is the proxy process's own CPU seconds (user + system, from ``/proc``),
read at the phase boundaries; it holds up on a shared machine where wall time
does not. The table gives the medians of A and B, and B/A as the min, median
and max over rounds of per-round ratios (a round's B against the same round's
A), and haproxy's medians as the floor.

Scenarios: ``passthrough`` (no interceptor), ``uppercase`` (the built-in
Python transform that upper-cases every value) and ``pii`` (the built-in
``pii_masker``, five regular expressions over every value); ``--scenarios``
picks others from :data:`bench.proxy.scenarios.SCENARIOS`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.proxy.one_record import one_record_load
from bench.proxy.run import Options, haproxy_binary, measure, started
from bench.proxy.scenarios import ROOT, SCENARIOS, Case, Scenario
from bench.proxy.stats import median, num
from bench.results import write_results

CASE = Case(1024, "none")
METRICS = (("cpu_s_per_gb", "CPU s/GB (= millicores per MB/s)", ".2f"),
           ("us_per_request", "CPU µs per request", ".0f"),
           ("p99_ms", "p99 ms at the paced rate", ".2f"))
"""What each run reports: key, label, format."""


@dataclass(slots=True)
class Tree:
    """One side of the A/B: where its sources are and what it is called."""

    label: str
    path: Path
    commit: str


@dataclass(slots=True)
class Run:
    """One scenario run on one tree in one round."""

    scenario: str
    tree: str
    round: int
    values: dict[str, float | None] = field(default_factory=dict)
    error: str | None = None


def _git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,
                          check=True).stdout.strip()


def base_tree(commit: str, rebuild: bool = False) -> Tree:
    """The tree of ``commit``, exported and built (Cython extensions in place) once."""
    sha = _git("rev-parse", "--verify", f"{commit}^{{commit}}")
    dest = Path(tempfile.gettempdir()) / f"kiproxy-ab-{sha[:12]}"
    stamp = dest / ".built"
    if rebuild or not stamp.exists():
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        archive = subprocess.Popen(["git", "archive", sha], cwd=ROOT, stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(dest)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise RuntimeError(f"git archive {sha} failed")
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                       cwd=dest, check=True, capture_output=True)
        stamp.write_text(sha + "\n")
    check_imports_from(dest)
    return Tree(label="A", path=dest, commit=sha[:10])


def check_imports_from(tree: Path) -> None:
    """Make sure a proxy started in ``tree`` imports that tree's code, compiled codec too."""
    out = subprocess.run(
        [sys.executable, "-c", "import kiproxy.proxy.connection as c, kiproxy.protocol._codec "
         "as k; print(c.__file__); print(k.__file__)"],
        cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True,
        text=True, check=False)
    files = out.stdout.split()
    if out.returncode != 0 or len(files) != 2 or not all(
            f.startswith(str(tree)) for f in files):
        raise RuntimeError(f"a proxy started in {tree} would not import that tree "
                           f"({out.stdout.strip() or out.stderr.strip()})")


def this_tree() -> Tree:
    """This working tree (B), named by its commit and whether it has changes."""
    sha = _git("rev-parse", "--short=10", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return Tree(label="B", path=ROOT, commit=sha + (" + changes" if dirty else ""))


def _worker(module_flag: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "bench.ab", module_flag, json.dumps(spec)],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         check=False)
    if out.returncode != 0 or not out.stdout.strip():
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return {"error": f"worker exited {out.returncode}: " + " | ".join(tail)}
    data: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return data


def run_one(scenario: Scenario, tree: Tree | None, round_: int, options: Options,
            args: argparse.Namespace) -> Run:
    """One fresh broker and hop; the throughput and paced phases, then the one-record load."""
    run = Run(scenario.name, tree.label if tree else "haproxy", round_)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:
        try:
            with started(scenario, Path(tmp), [], tree=tree.path if tree else ROOT) as setup:
                result = measure(setup, scenario, CASE, round_, options, args.pace_rps,
                                 check=round_ == 0 and tree is not None)
                one = _worker("--worker-one-record", {
                    "bootstrap": setup.bootstrap, "topic": f"one-{uuid.uuid4().hex[:8]}",
                    "connections": args.connections, "seconds": args.one_record_seconds,
                    "value_size": 100, "pids": setup.pids}, options.timeout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            run.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return run
    run.error = result.error or one.get("error")
    proxy_cpu = (one.get("cpu") or {}).get("proxy")
    requests = one.get("requests") or 0
    run.values = {
        "cpu_s_per_gb": result.cpu_s_per_gb(),
        "us_per_request": proxy_cpu * 1e6 / requests if proxy_cpu and requests else None,
        "p99_ms": result.p99_ms,
        "requests_per_s": requests / one["seconds"] if one.get("seconds") else None,
    }
    return run


def _spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return (f"{ordered[0]:.2f}x / **{median(ordered):.2f}x** / {ordered[-1]:.2f}x")


def render(runs: Sequence[Run], scenarios: Sequence[str], trees: tuple[Tree, Tree]) -> str:
    """The table: per scenario and metric, A and B medians, B/A min/median/max, haproxy."""
    lines = ["| scenario | metric | A | B | B/A min / median / max | haproxy |",
             "|---|---|---:|---:|:---:|---:|"]
    floor = [r for r in runs if r.tree == "haproxy" and r.error is None]
    for name in scenarios:
        for key, label, fmt in METRICS:
            by_round: dict[int, dict[str, float]] = {}
            for r in runs:
                value = r.values.get(key)
                if r.scenario == name and r.error is None and value is not None:
                    by_round.setdefault(r.round, {})[r.tree] = value
            ratios = [pair["B"] / pair["A"] for pair in by_round.values()
                      if "A" in pair and "B" in pair and pair["A"] > 0]
            a = median(pair.get("A") for pair in by_round.values())
            b = median(pair.get("B") for pair in by_round.values())
            hap = median(r.values.get(key) for r in floor)
            lines.append(f"| {name} | {label} | {num(a, fmt)} | {num(b, fmt)} | "
                         f"{_spread(ratios)} | {num(hap, fmt)} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the commit to compare against (A), e.g. 0b6c14d or HEAD~1")
    p.add_argument("--rounds", type=int, help="rounds (default 3, quick 2)")
    p.add_argument("--scenarios", default="passthrough,uppercase,pii",
                   help="comma-separated kiproxy scenarios of bench.proxy "
                        "(default passthrough,uppercase,pii)")
    p.add_argument("--records", type=int,
                   help="1 KiB records of the throughput phase (default 400000, quick "
                        "100000); CPU is read in clock ticks (10 ms), so a phase needs a few "
                        "tenths of a second of it")
    p.add_argument("--pace-rps", type=float, default=3000.0,
                   help="records/s of the paced phase, both trees (default 3000)")
    p.add_argument("--latency-seconds", type=float,
                   help="length of the paced phase (default 5, quick 3)")
    p.add_argument("--connections", type=int, default=16,
                   help="connections of the one-record-per-request load (default 16)")
    p.add_argument("--one-record-seconds", type=float,
                   help="length of the one-record-per-request load (default 6, quick 3)")
    p.add_argument("--quick", action="store_true",
                   help="2 rounds, shorter phases; prints without writing RESULTS.md")
    p.add_argument("--rebuild", action="store_true", help="export and build the base again")
    p.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    p.add_argument("--json", metavar="PATH", help="also write every run's figures here")
    p.add_argument("--worker-one-record", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Build the base tree, run the rounds, print the table and record it."""
    args = _parser().parse_args(argv)
    if args.worker_one_record:
        print(json.dumps(one_record_load(json.loads(args.worker_one_record))))
        return 0
    if not args.base:
        print("--base COMMIT is required (the tree to compare this one against)",
              file=sys.stderr)
        return 2
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS or SCENARIOS[n].kind != "kiproxy"]
    if unknown:
        print(f"unknown kiproxy scenario(s) {', '.join(unknown)}; choose from "
              + ", ".join(n for n, s in SCENARIOS.items() if s.kind == "kiproxy"),
              file=sys.stderr)
        return 2
    quick = args.quick
    rounds = args.rounds or (2 if quick else 3)
    options = Options(records={1024: args.records or (100_000 if quick else 400_000)},
                      warmup=2000, latency_seconds=args.latency_seconds or (3.0 if quick else 5.0),
                      load_fraction=0.5, partitions=3, acks="1", linger_ms=5.0,
                      max_in_flight=5, proxy_flags=[], max_seconds=10.0)
    args.one_record_seconds = args.one_record_seconds or (3.0 if quick else 6.0)
    print(f"building {args.base} ...", file=sys.stderr, flush=True)
    trees = (base_tree(args.base, args.rebuild), this_tree())
    hap = SCENARIOS["haproxy"] if haproxy_binary() else None
    runs: list[Run] = []
    loads: list[float] = []
    for round_ in range(rounds):
        order = trees if round_ % 2 == 0 else trees[::-1]
        plan: list[tuple[Scenario, Tree | None]] = [(hap, None)] if hap else []
        plan += [(SCENARIOS[n], t) for n in names for t in order]
        for scenario, tree in plan:
            loads.append(os.getloadavg()[0])
            run = run_one(scenario, tree, round_, options, args)
            runs.append(run)
            shown = "  ".join(f"{k} {num(v, '.2f')}" for k, v in run.values.items())
            print(f"round {round_ + 1}/{rounds} {run.scenario:<12} {run.tree:<7} "
                  f"{shown}{'  ERROR ' + run.error if run.error else ''}",
                  file=sys.stderr, flush=True)
    table = render(runs, names, trees)
    command = "python -m bench.ab " + " ".join(argv if argv is not None else sys.argv[1:])
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    text = "\n".join([
        "## A/B: this tree against a base commit, end to end", "",
        f"A = `{trees[0].commit}`, B = `{trees[1].commit}`; {rounds} interleaved rounds, "
        f"{datetime.date.today().isoformat()}, {os.cpu_count()} CPUs ({cpu}), load average "
        f"{min(loads):.1f}-{max(loads):.1f} during the runs.", "",
        f"Command: `{command}`", "",
        table, "",
        f"CPU per GB: {options.records[1024]:,} records of 1 KiB, uncompressed, linger 5 ms; "
        f"p99: paced at {args.pace_rps:,.0f} records/s for {options.latency_seconds:g} s; "
        f"per request: {args.connections} connections, one 100-byte record per request, "
        f"each waiting for its ack, {args.one_record_seconds:g} s. CPU is the proxy "
        "process's user + system seconds (/proc). Ratios below 1.00x: B is cheaper.",
    ])
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=1))
    if not (quick or args.no_write):
        write_results(text, "ab")
    return 0


if __name__ == "__main__":
    sys.exit(main())
