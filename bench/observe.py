"""Observe mode and the dead-letter copy: what they cost the produce path, without sockets.

Run from the repository root with the project's virtualenv::

    python -m bench.observe                 # prints a table
    python -m bench.observe --write         # and writes its section of bench/RESULTS.md

The request is :mod:`bench.intercept`'s (Produce v9, ``--partitions`` partitions of one
batch of ``--records`` 100-byte JSON records, uncompressed). Cases, each on one
catch-all route built in code:

* ``validator/enforce`` and ``validator/observe``: the built-in JSON Schema validator
  (every batch passes); observe mode should cost the chain's own time, as enforce does;
* ``refuse-1%`` and ``refuse-100%``: a rule refusing that share of batches, enforced,
  without and then with ``dead_letter`` (``+copy``): the copy's cost on the produce path
  is building the :class:`~kiproxy.proxy.observe.dead_letter.DeadLetterCopy` and
  ``offer``. The sink is not started (no broker): its queue is emptied between
  rounds, so every copy is queued as it would be in front of a cluster that keeps up.

Figures: CPU microseconds per record (``time.process_time``, best of the repeats) and
the 99th percentile of one ``ProducePipeline.handle`` call's wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from bench.intercept import _frame, _plugin

__all__ = ["main", "measure"]

SECTION = "## Observe mode and the dead-letter copy: cost on the produce path"
CASES = ("validator/enforce", "validator/observe", "refuse-1%/enforce",
         "refuse-1%/enforce+copy", "refuse-100%/enforce", "refuse-100%/enforce+copy")


def _refuser(share: float) -> Any:
    from kiproxy.interceptors import ProduceRequestInterceptor, RejectBatch

    every = round(1 / share)

    class Refuse(ProduceRequestInterceptor):
        seen = 0

        def intercept(self, batch: Any, ctx: Any) -> Any:
            self.seen += 1
            if self.seen % every == 0:
                raise RejectBatch("refused by the bench", error="POLICY_VIOLATION",
                                  record_errors=[(0, "the first record")])
            return batch

    return Refuse()


def _pipeline(case: str) -> tuple[Any, Any]:
    from kiproxy.proxy.config.clients import DeadLetterSinkSettings
    from kiproxy.proxy.config.routes import MatchSettings
    from kiproxy.proxy.observe.kafka_sink import KafkaSink
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.produce.pipeline import ProducePipeline
    from kiproxy.proxy.routes.chain import LoadedLink
    from kiproxy.proxy.routes.runtime import LoadedChain, LoadedRoutes
    from kiproxy.proxy.routes.table import CompiledMatch, Route, RouteTable

    rule, mode = case.split("/")
    plugin = (_plugin("validator") if rule == "validator"
              else _refuser(float(rule.removeprefix("refuse-").rstrip("%")) / 100))
    copy = mode.endswith("+copy")
    route = Route(index=0, name="bench", match=CompiledMatch.of(MatchSettings()), links=(),
                  observe=mode == "observe", dead_letter="bench-dlq" if copy else None)
    chain = LoadedChain(route, (LoadedLink(rule, plugin, 5.0),), ())
    sink = None
    if copy:
        sink = KafkaSink("dead_letter", DeadLetterSinkSettings.model_validate(
            {"queue_records": 10**9, "queue_bytes": 10**12}), bootstrap=["127.0.0.1:9"],
            tls=None, metrics=Metrics())
    pipeline = ProducePipeline(routes=LoadedRoutes(RouteTable([route]), {0: chain}),
                               metrics=Metrics(), dead_letter=sink)
    return pipeline, sink


def measure(case: str, records: int, partitions: int, seconds: float,
            repeats: int) -> dict[str, Any]:
    """CPU per record and p99 wall time of ``handle`` for ``case`` (see the docstring)."""
    from bench.intercept import _setup
    from kiproxy.protocol.framing import parse_request_header

    logging.disable(logging.WARNING)
    _, client, _, _ = _setup("identity/100/none", 1, 1)
    frame = _frame(100, "none", records, partitions)
    header = parse_request_header(frame)
    pipeline, sink = _pipeline(case)
    loop = asyncio.new_event_loop()
    walls: list[float] = []

    async def run(n: int) -> None:
        for _ in range(n):
            t0 = time.perf_counter()
            await pipeline.handle(client, header, frame, None)
            walls.append(time.perf_counter() - t0)
        if sink is not None:  # as a writer that keeps up would
            sink._queue.clear()
            sink._queued_records = sink._queued_bytes = 0

    loop.run_until_complete(run(20))
    started = time.process_time()
    loop.run_until_complete(run(50))
    per_call = (time.process_time() - started) / 50
    n = max(100, int(seconds / max(per_call, 1e-9)))
    samples = []
    walls.clear()
    for _ in range(repeats):
        t0 = time.process_time()
        loop.run_until_complete(run(n))
        samples.append((time.process_time() - t0) / n)
    loop.close()
    walls.sort()
    return {"case": case, "us_per_record": min(samples) * 1e6 / (records * partitions),
            "p99_ms": walls[int(len(walls) * 0.99)] * 1e3,
            "p50_ms": statistics.median(walls) * 1e3}


def main(argv: list[str] | None = None) -> None:
    """Command line entry point (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=250)
    parser.add_argument("--partitions", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="write bench/RESULTS.md")
    args = parser.parse_args(argv)
    rows = [measure(c, args.records, args.partitions, args.seconds, args.repeats)
            for c in CASES]
    base = {r["case"].split("/")[0]: r for r in rows if r["case"].endswith("/enforce")}
    lines = ["| case | us/record (CPU) | vs enforce | p50 ms/request | p99 ms/request |",
             "|---|---:|---:|---:|---:|"]
    for r in rows:
        ref = base[r["case"].split("/")[0]]
        lines.append(f"| {r['case']} | {r['us_per_record']:.3f} | "
                     f"{r['us_per_record'] / ref['us_per_record']:.2f} | "
                     f"{r['p50_ms']:.3f} | {r['p99_ms']:.3f} |")
    table = "\n".join(lines)
    setup = (f"load average {os.getloadavg()[0]:.1f}; {args.partitions} partitions x "
             f"{args.records} records of 100 B per request, uncompressed; best of "
             f"{args.repeats} repeats (CPU), p50/p99 over every call")
    print(setup)
    print(table)
    if args.write:
        import datetime

        from bench.results import write_results

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True).stdout.strip()
        when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench.observe " + " ".join(sys.argv[1:] if argv is None else argv)
        write_results("\n".join([
            SECTION, "",
            f"`{command}` ({when}; commit {commit}; {os.cpu_count()} cores, shared). {setup}. "
            "`vs enforce`: CPU per record against the same rule enforced without a copy; "
            "see the module docstring of `bench/observe.py` for the cases.", "",
            table, ""]), "observe")


if __name__ == "__main__":
    main()
