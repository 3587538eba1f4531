"""Resident memory after bursts, with and without the allocator setting that keeps
freed heap memory (``KIPROXY_KEEP_FREED_MEMORY``, see ``kiproxy.proxy.malloc``).

Run from the repository root with the project's virtualenv::

    python -m bench.freed_memory                 # both modes, one after the other
    python -m bench.freed_memory --modes 1       # one mode

Per mode, a fresh kiproxy process (``uppercase`` plugin, so every batch is decoded)
in front of one embedded Tansu broker, warmed up with small requests and 64
abandoned frames; then, in turn, each followed by a pause long enough for the heap
trimmer (``kiproxy.proxy.net.buffers``) to run:

1. **abandoned**: 800 clients, 16 at a time, each claiming a 100 MiB Produce
   request, sending 1 MB of it and closing (issue 24's probe);
2. **large produce**: three bursts of 16 connections at once, each sending one
   valid 4 MiB Produce request (eight 512 KiB records) and reading its answer;
3. **bombs**: 16 zstd RLE bombs at once (each refused).

Reported per step: the proxy's RSS before it, its peak during it (sampled every
50 ms) and its RSS after the pause, in MiB. Memory only; the speed side of the
trade is ``python -m bench.proxy --quick`` run with the same environment switch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the bombs and raw sockets of tests/hardening

from hardening.bombs import (  # noqa: E402
    BOMBS,
    RssSampler,
    abandon_large_frames,
    bomb_request,
    produce_request,
    rss_of,
    send_at_once,
)

from bench.bombs import launch_uppercase  # noqa: E402
from kiproxy.protocol.records import Record, build_batch  # noqa: E402
from kiproxy_dev.tansu import EmbeddedBroker  # noqa: E402

MiB = 2**20
SETTLE = 2.5
"""Seconds after a step before its RSS is read: the heap trimmer checks every second."""


def _steps(address: str) -> list[tuple[str, Callable[[], None]]]:
    records = [Record(value=b"x" * (512 * 1024), timestamp=0)] * 8
    large = produce_request("freed-large", build_batch(records), client_id="large")
    codec, build = BOMBS["zstd"]
    bomb = bomb_request("freed-bomb", codec, build())

    def large_bursts() -> None:
        for _ in range(3):
            send_at_once(address, large)

    return [("abandoned", lambda: abandon_large_frames(address, 800)),
            ("large produce", large_bursts),
            ("bombs", lambda: send_at_once(address, bomb))]


def run_mode(broker: EmbeddedBroker, keep: str) -> list[str]:
    """Markdown rows for one value of ``KIPROXY_KEEP_FREED_MEMORY``."""
    proc, address = launch_uppercase(ROOT, broker.bootstrap,
                                     {"KIPROXY_KEEP_FREED_MEMORY": keep})
    rows = []
    try:
        send_at_once(address, produce_request("freed-large", build_batch(
            [Record(value=b"x", timestamp=0)])))
        abandon_large_frames(address, 64)
        time.sleep(SETTLE)
        start = rss_of(proc.pid)
        rows.append(f"| {keep} | warmed up | | | {start / MiB:.0f} |")
        for name, step in _steps(address):
            before = rss_of(proc.pid)
            with RssSampler(proc.pid) as sampler:
                step()
            time.sleep(SETTLE)
            after = rss_of(proc.pid)
            rows.append(f"| {keep} | {name} | {before / MiB:.0f} | {sampler.peak / MiB:.0f} "
                        f"| {after / MiB:.0f} |")
    finally:
        proc.terminate()
        proc.wait(15)
    return rows


def main() -> int:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", default="1,0",
                        help="values of KIPROXY_KEEP_FREED_MEMORY to run (default 1,0)")
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.2f}")
    print("| KIPROXY_KEEP_FREED_MEMORY | step | RSS before MiB | peak MiB | "
          f"RSS {SETTLE:g} s after MiB |")
    print("|---|---|---|---|---|")
    broker = EmbeddedBroker()
    broker.start()
    try:
        for keep in args.modes.split(","):
            for row in run_mode(broker, keep):
                print(row, flush=True)
    finally:
        broker.stop()
    print(f"load after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
