"""Per-batch cost of choosing a route: 50 routes against 1, in the same run.

    python -m bench.routes            # full run (~20 s), writes its section of bench/RESULTS.md
    python -m bench.routes --quick    # short repeats, smoke test
    python -m bench.routes --no-write # print the table only

Three paths, each timed for a table of 1 route and a table of 50 routes whose
matching route is the last (49 routes that fail on principal, client id,
client address, listener, topic or acks before it):

* **connection** - ``ClientRoutes.select(topic, acks, transactional)``, what a
  connection that keeps its ``RouteTable.for_client(identity)`` pays per batch;
* **table** - ``RouteTable.select(identity, topic, acks, transactional)`` with
  an identity seen before (one more dict lookup, hashing the identity);
* **first sight** - a new client identity every batch, so every call evaluates
  every route's connection keys and topic regex (the cost of a cache miss).

Nanoseconds per batch of wall time (``time.perf_counter``, one thread, the
cyclic GC off while timing as ``timeit`` does), median of the repeats, the two
tables interleaved.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from bench.results import write_results
from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.routes.table import RouteTable

SECTION = "## Routes: per-batch route selection, 50 routes against 1"
LINK = {"class": "a:B"}


def _routes(count: int) -> list[dict[str, object]]:
    """``count - 1`` routes that fail for the benchmark's client, then the one that holds."""
    failing: list[dict[str, object]] = []
    kinds: list[Callable[[int], dict[str, object]]] = [
        lambda i: {"principal": [f"svc-{i}"]},
        lambda i: {"client_id": f"team-{i}-.*"},
        lambda i: {"client_address": [f"10.{i}.0.0/16", f"fd{i:02x}::/16"]},
        lambda i: {"listener": f"internal-{i}"},
        lambda i: {"topic": f"orders-{i}\\..*", "principal_regex": "app-.*"},
        lambda i: {"topic": "orders", "acks": [0]},
    ]
    for i in range(count - 1):
        failing.append({"name": f"r{i}", "match": kinds[i % len(kinds)](i),
                        "interceptors": [LINK]})
    holds: dict[str, object] = {
        "name": "orders", "interceptors": [LINK],
        "match": {"topic": "orders", "client_id": "app-.*", "client_address": ["192.168.0.0/16"]},
    }
    return [*failing, holds]


def table(count: int) -> RouteTable:
    """A compiled table of ``count`` routes, validated like a config file."""
    return RouteTable.from_config(ProxyConfig.model_validate({"routes": _routes(count)}))


def _client(port: int) -> ClientIdentity:
    return ClientIdentity(client_host="192.168.7.9", client_port=port, peer_host="10.0.0.1",
                          peer_port=40000, via_proxy_protocol=True, principal="app-7",
                          client_id="app-7", sasl_mechanism="SCRAM-SHA-512")


def _time(op: Callable[[], object], n: int) -> float:
    gc.collect()
    gc.disable()  # as timeit does: the cyclic GC's pauses depend on the whole heap, not on routes
    try:
        start = time.perf_counter()
        for _ in range(n):
            op()
        return (time.perf_counter() - start) / n * 1e9
    finally:
        gc.enable()


def measure(n: int, repeats: int) -> dict[str, dict[int, float]]:
    """ns per batch by path and by number of routes."""
    tables = {1: table(1), 50: table(50)}
    me = _client(40000)
    for t in tables.values():  # every path must pick the matching route
        chosen = t.select(me, "orders", -1, False)
        assert chosen is not None and chosen.name == "orders"
    samples: dict[str, dict[int, list[float]]] = {
        p: {1: [], 50: []} for p in ("connection", "table", "first sight")}
    for _ in range(repeats):
        for count, t in tables.items():
            view = t.for_client(me)
            samples["connection"][count].append(
                _time(lambda v=view: v.select("orders", -1, False), n))  # type: ignore[misc]
            samples["table"][count].append(
                _time(lambda t=t: t.select(me, "orders", -1, False), n))  # type: ignore[misc]
            strangers = iter([_client(p) for p in range(1, n // 10 + 1)])
            samples["first sight"][count].append(_time(
                lambda t=t, s=strangers: t.select(next(s), "orders", -1, False),  # type: ignore[misc]
                n // 10))
    return {p: {c: statistics.median(v) for c, v in by.items()} for p, by in samples.items()}


def render(results: dict[str, dict[int, float]], command: str, n: int, repeats: int,
           elapsed: float) -> str:
    """The section of RESULTS.md."""
    now = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    rows = "\n".join(
        f"| {path} | {by[1]:.0f} | {by[50]:.0f} | {by[50] / by[1]:.2f}x |"
        for path, by in results.items())
    return f"""{SECTION}

Command: `{command}` (from the repository root, project virtualenv)

- Date: {now}; machine: {platform.machine()}, {platform.system()} {platform.release()}, \
Python {platform.python_version()}; shared with other work, so read the ratios.
- {n} batches per timing ({n // 10} for first sight; GC off while timing, as `timeit` \
does), median of {repeats} repeats, the 1-route and 50-route tables interleaved; total \
{elapsed:.0f} s. In the 50-route table the matching route is the last one.

| path | 1 route (ns/batch) | 50 routes (ns/batch) | 50 / 1 |
| --- | ---: | ---: | ---: |
{rows}

*connection* is what a connection that keeps `RouteTable.for_client(identity)` pays per \
batch; *table* is `RouteTable.select` with a known identity; *first sight* is a new \
client every batch (all routes evaluated: the cache miss).
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; print the table; write RESULTS.md unless ``--no-write``."""
    parser = argparse.ArgumentParser(prog="python -m bench.routes", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="short repeats (smoke test)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    n, repeats = (20_000, 3) if args.quick else (200_000, 7)
    started = time.monotonic()
    results = measure(n, repeats)
    command = "python -m bench.routes" + (" --quick" if args.quick else "")
    text = render(results, command, n, repeats, time.monotonic() - started)
    print(text)
    if not args.no_write:
        write_results(text, "routes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
